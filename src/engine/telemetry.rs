//! Per-transfer telemetry (NIXL's `nixlXferTelemetry`) and the classification
//! of a failed transfer's cause.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{EngineError, TransferEngine, TransferHandle, TransferStatus};
use crate::transport::{FailureKind, TransferFailure};

/// Prefix of the failure reason of a transfer cancelled by `disconnect`.
pub(super) const REMOVED: &str = "removed";
/// Prefix of the failure reason of a transfer cancelled by `release`.
pub(super) const RELEASED: &str = "cancelled";

/// What one finished transfer took, as NIXL 1.5's `getXferTelemetry`
/// (ai-dynamo/nixl `src/api/cpp/nixl_types.h`, `nixl_xfer_telem_t`).
///
/// Durations are whole microseconds rounded **up**, so a real transfer
/// never reports 0 (NIXL's `test_nixl_api.py` asserts `postDuration > 0`
/// and `xferDuration >= postDuration`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XferTelemetry {
    /// Post start, µs since the Unix epoch (wall clock, comparable across processes).
    pub start_us: u64,
    /// Time spent inside `post` (validation, coalescing, queueing), µs.
    pub post_us: u64,
    /// Post start until the engine saw the completion, µs (≥ `post_us`).
    pub xfer_us: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptors the caller passed, before coalescing (NIXL `descCount`).
    pub desc_count: u64,
}

/// Why a transfer failed, for callers that react differently (NIXL's
/// `NIXL_ERR_REMOTE_DISCONNECT` vs `NIXL_ERR_NOT_FOUND` vs a cancel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureCause {
    /// The peer died or closed its connection; the engine marks it dead
    /// (`is_connected` turns false, `is_remote_loaded` stays true until the
    /// caller removes it, as NIXL 1.5.1 keeps a disconnected agent loaded).
    PeerLost,
    /// `disconnect` removed the peer while the transfer was moving.
    Removed,
    /// `release` cancelled it.
    Released,
    /// Anything else (remote access error, deregistered memory, ...).
    Other,
}

/// µs since the Unix epoch, 0 if the clock is before it.
pub(super) fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// Whole µs, rounded up, never 0.
fn ceil_us(d: Duration) -> u64 {
    (d.as_nanos().div_ceil(1000) as u64).max(1)
}

/// Classify a failure: the transport's typed kind, and for cancels the
/// engine's own prefix (`disconnect` vs `release`).
pub(super) fn classify(failure: &TransferFailure) -> FailureCause {
    match failure.kind {
        FailureKind::PeerDied | FailureKind::PeerTimeout => FailureCause::PeerLost,
        FailureKind::Cancelled if failure.detail.starts_with(REMOVED) => FailureCause::Removed,
        FailureKind::Cancelled if failure.detail.starts_with(RELEASED) => FailureCause::Released,
        _ => FailureCause::Other,
    }
}

impl TransferEngine {
    /// Telemetry of a finished transfer (NIXL `getXferTelemetry`).
    ///
    /// # Errors
    /// [`EngineError::UnknownHandle`]; [`EngineError::NotCompleted`] while it
    /// is still in progress.
    pub fn telemetry(&mut self, handle: TransferHandle) -> Result<XferTelemetry, EngineError> {
        if self.status(handle)? == TransferStatus::InProgress {
            return Err(EngineError::NotCompleted(handle.0));
        }
        let t = self.transfers.get(&handle.0).ok_or(EngineError::UnknownHandle(handle.0))?;
        let post_us = ceil_us(t.post_duration);
        let xfer_us = t.xfer_duration.map_or(post_us, ceil_us).max(post_us);
        Ok(XferTelemetry { start_us: t.start_us, post_us, xfer_us, bytes: t.bytes, desc_count: t.descs })
    }

    /// Why a failed transfer failed; `None` while it is not `Failed`.
    ///
    /// # Errors
    /// [`EngineError::UnknownHandle`].
    pub fn failure_cause(&self, handle: TransferHandle) -> Result<Option<FailureCause>, EngineError> {
        self.transfers.get(&handle.0).map(|t| t.cause).ok_or(EngineError::UnknownHandle(handle.0))
    }
}
