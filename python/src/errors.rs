//! Mapping of kvwire errors to the Python exceptions a MAX user expects:
//! validation → `ValueError`, GATHER_SCATTER / recurrent state →
//! `NotImplementedError`, `sync_and_release` deadline → `TimeoutError`,
//! transport failures → `kvwire.TransferError` (a `RuntimeError`).

use kvwire::kv::KvError;
use pyo3::create_exception;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

create_exception!(kvwire, TransferError, PyRuntimeError, "A transfer or the transport under it failed.");
create_exception!(kvwire, KVLoadRefused, PyRuntimeError, "A connector refused a load before any byte moved.");
create_exception!(kvwire, KVLoadFailed, PyRuntimeError, "A connector load failed after it was accepted.");

/// The Python exception for a KV-layer error.
pub fn kv_err(e: KvError) -> PyErr {
    let msg = e.to_string();
    match e {
        KvError::Unsupported(_) => PyNotImplementedError::new_err(msg),
        KvError::Timeout { .. } => PyTimeoutError::new_err(msg),
        KvError::PostFailed { .. } | KvError::TransferFailed { .. } | KvError::Engine(_) => TransferError::new_err(msg),
        // Everything else is a caller mistake: bad shapes, names, indices, wire data.
        _ => PyValueError::new_err(msg),
    }
}
