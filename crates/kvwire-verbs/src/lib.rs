//! Safe, RAII access to libibverbs, loaded at run time.
//!
//! Layers: [`ffi`] (our mirror of `<infiniband/verbs.h>`, checked against the
//! system header by `build.rs`) → [`loader`] (`dlopen("libibverbs.so.1")`)
//! → the safe objects [`Context`], [`ProtectionDomain`], [`MemoryRegion`],
//! [`CompletionQueue`], [`QueuePair`]. Each holds an `Arc` of its parent, so
//! a QP is destroyed before its CQ and PD, an MR before its PD, everything
//! before the device context is closed. `Drop` never panics: a failing
//! destroy call is logged and counted ([`drop_failures`]).
//!
//! Posting needs `&mut QueuePair` (one poster per QP); the objects are
//! `Send + Sync` because libibverbs verbs are thread-safe, and the data-path
//! calls only take `&mut` where the provider requires serialisation.
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod context;
pub mod cq;
#[doc(hidden)]
pub mod ffi;
pub mod loader;
pub mod mr;
pub mod pd;
pub mod qp;
mod wc;
pub mod wr;

use std::sync::atomic::{AtomicU64, Ordering};

pub use context::{Context, DeviceInfo, GidEntry, PortInfo, device_names, list_devices};
pub use cq::{CompletionQueue, WorkCompletion};
pub use loader::{LIBRARY, available};
pub use mr::MemoryRegion;
pub use pd::ProtectionDomain;
pub use qp::{QpEndpoint, QpOptions, QueuePair};
pub use wc::WcStatus;
pub use wr::{WrBatch, WrId, WrView};

/// Errors of the verbs layer: one variant per failing verb, naming the call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// libibverbs (or a symbol) is missing, or no such device/port.
    #[error("{0}")]
    Unsupported(String),
    /// A verb failed; `call` is the C function, `source` the OS error.
    #[error("{call}: {source}")]
    Call {
        /// The C call, e.g. `ibv_reg_mr`.
        call: &'static str,
        /// errno as reported.
        #[source]
        source: std::io::Error,
    },
}

impl VerbsError {
    /// The error of `call` from the current `errno` (or `rc` when positive,
    /// as `ibv_modify_qp` and `ibv_post_send` return it directly).
    pub fn call(call: &'static str, rc: i32) -> Self {
        let source = if rc > 0 { std::io::Error::from_raw_os_error(rc) } else { std::io::Error::last_os_error() };
        Self::Call { call, source }
    }
}

static DROP_FAILURES: AtomicU64 = AtomicU64::new(0);

/// How many destroy/deregister calls failed in `Drop` so far (each is also
/// logged with `tracing::error!`).
pub fn drop_failures() -> u64 {
    DROP_FAILURES.load(Ordering::Relaxed)
}

pub(crate) fn record_drop_failure(call: &'static str, rc: i32) {
    DROP_FAILURES.fetch_add(1, Ordering::Relaxed);
    let err = VerbsError::call(call, rc);
    tracing::error!("verbs: {err} during drop (resource leaked)");
}
