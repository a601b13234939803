//! Transfer handles (MAX `KVTransfer`, `KVConnectorTransfer`,
//! `CompletedTransfer`) and the shared completion state a copy worker sets.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use super::{BlockId, ConnectorError, PerLeaf};

/// A copy in flight between a tier and device pages (MAX `KVTransfer`).
///
/// Handles are `Send + Sync`: poll from the scheduler thread, synchronize from
/// a drain thread.
pub trait KVTransfer: Send + Sync + fmt::Debug {
    /// True once the copy has landed. Never blocks; one atomic load, cheap
    /// enough for every scheduler iteration. Safe to call again after it
    /// returned `true` or an error: it answers the same again.
    ///
    /// # Errors
    /// [`ConnectorError::LoadFailed`] (or `OffloadFailed` for an offload) when
    /// the copy failed; terminal, and nothing still writes into the
    /// destination blocks by then.
    fn is_complete(&self) -> Result<bool, ConnectorError>;

    /// Block until the copy has landed or failed (drain and shutdown only).
    ///
    /// # Errors
    /// As [`is_complete`](Self::is_complete).
    fn synchronize(&self) -> Result<(), ConnectorError>;
}

/// A transfer that is already complete: returned when nothing moved
/// (`is_complete` → `true`, `synchronize` a no-op).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompletedTransfer;

impl KVTransfer for CompletedTransfer {
    fn is_complete(&self) -> Result<bool, ConnectorError> {
        Ok(true)
    }

    fn synchronize(&self) -> Result<(), ConnectorError> {
        Ok(())
    }
}

/// The handle an offload returns (MAX `KVConnectorTransfer`): a transfer plus
/// the device blocks it reads, which the caller keeps pinned (not freed, not
/// rewritten) until it is complete.
#[derive(Debug)]
pub struct KVConnectorTransfer {
    g0_blocks_per_leaf: PerLeaf<BlockId>,
    inner: Box<dyn KVTransfer>,
}

impl KVConnectorTransfer {
    /// An offload that moved nothing and pins nothing (MAX
    /// `CompletedTransfer(g0_blocks_per_leaf=None)`).
    pub fn completed() -> Self {
        Self {
            g0_blocks_per_leaf: PerLeaf::new(),
            inner: Box::new(CompletedTransfer),
        }
    }

    /// Wrap `inner`, which reads `g0_blocks_per_leaf`.
    pub fn new(g0_blocks_per_leaf: PerLeaf<BlockId>, inner: Box<dyn KVTransfer>) -> Self {
        Self {
            g0_blocks_per_leaf,
            inner,
        }
    }

    /// Device blocks pinned until this lands, per leaf: the subset of the
    /// offload's blocks whose hashes were neither held already nor dropped for
    /// lack of room. Empty when nothing moved.
    pub fn g0_blocks_per_leaf(&self) -> &PerLeaf<BlockId> {
        &self.g0_blocks_per_leaf
    }

    /// Number of device blocks pinned, over all leaves.
    pub fn num_pinned_blocks(&self) -> usize {
        self.g0_blocks_per_leaf.values().map(Vec::len).sum()
    }
}

impl KVTransfer for KVConnectorTransfer {
    fn is_complete(&self) -> Result<bool, ConnectorError> {
        self.inner.is_complete()
    }

    fn synchronize(&self) -> Result<(), ConnectorError> {
        self.inner.synchronize()
    }
}

/// Direction of a posted copy, which picks the error a failure reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Tier → device (`load`).
    Load,
    /// Device → tier (`offload`).
    Offload,
}

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// Completion state shared by a posted transfer's handle and the worker that
/// runs it. The worker settles its bookkeeping first, then calls `finish`.
#[derive(Debug)]
pub(crate) struct TransferState {
    direction: Direction,
    state: AtomicU8,
    error: OnceLock<String>,
    lock: Mutex<()>,
    done: Condvar,
}

impl TransferState {
    pub(crate) fn new(direction: Direction) -> Arc<Self> {
        Arc::new(Self {
            direction,
            state: AtomicU8::new(PENDING),
            error: OnceLock::new(),
            lock: Mutex::new(()),
            done: Condvar::new(),
        })
    }

    /// Mark the transfer landed (`Ok`) or failed (`Err(reason)`). Only the
    /// first call counts.
    pub(crate) fn finish(&self, outcome: Result<(), String>) {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.state.load(Ordering::Acquire) != PENDING {
            return;
        }
        match outcome {
            Ok(()) => self.state.store(DONE, Ordering::Release),
            Err(reason) => {
                let _ = self.error.set(reason);
                self.state.store(FAILED, Ordering::Release);
            }
        }
        self.done.notify_all();
    }

    fn check(&self) -> Result<bool, ConnectorError> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Ok(false),
            DONE => Ok(true),
            _ => {
                let reason = self.error.get().cloned().unwrap_or_default();
                Err(match self.direction {
                    Direction::Load => ConnectorError::LoadFailed { reason },
                    Direction::Offload => ConnectorError::OffloadFailed { reason },
                })
            }
        }
    }
}

/// Handle of a copy posted to a worker.
#[derive(Debug)]
pub(crate) struct PendingTransfer(pub(crate) Arc<TransferState>);

impl KVTransfer for PendingTransfer {
    fn is_complete(&self) -> Result<bool, ConnectorError> {
        self.0.check()
    }

    fn synchronize(&self) -> Result<(), ConnectorError> {
        let mut g = self.0.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.0.check()? {
            g = self.0.done.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        Ok(())
    }
}
