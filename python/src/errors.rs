//! Mapping of kvwire errors to the Python exceptions a MAX user expects:
//! validation → `ValueError`, GATHER_SCATTER / recurrent state →
//! `NotImplementedError`, `sync_and_release` deadline → `TimeoutError`,
//! transport failures → `kvwire.TransferError` (a `RuntimeError`, with a
//! `.kind` string such as `"peer_died"`), malformed wire data →
//! `kvwire.DecodeError` and `kvwire.ValidationError`, which stand for
//! `msgspec.DecodeError` and `msgspec.ValidationError` (same hierarchy:
//! `ValidationError` ⊂ `DecodeError` ⊂ `ValueError`).

use kvwire::engine::EngineError;
use kvwire::kv::KvError;
use kvwire::transport::TransportError;
use pyo3::create_exception;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    kvwire,
    TransferError,
    PyRuntimeError,
    "A transfer or the transport under it failed; `.kind` names why."
);
create_exception!(kvwire, KVLoadRefused, PyRuntimeError, "A connector refused a load before any byte moved.");
create_exception!(kvwire, KVLoadFailed, PyRuntimeError, "A connector load failed after it was accepted.");
create_exception!(
    kvwire,
    DecodeError,
    PyValueError,
    "Wire data is not JSON / msgpack, is truncated or has trailing data (msgspec.DecodeError)."
);
create_exception!(
    kvwire,
    ValidationError,
    DecodeError,
    "Wire data of the wrong shape: a wrong type or tag, a missing field (msgspec.ValidationError)."
);

/// `kvwire.TransferError(msg)` with `.kind` set (`None` when the transport
/// gave no category).
pub fn transfer_error(msg: String, kind: Option<&str>) -> PyErr {
    Python::with_gil(|py| {
        let e = TransferError::new_err(msg);
        let v = e.value(py);
        // Setting an attribute on a fresh exception instance cannot fail.
        let _ = v.setattr("kind", kind);
        e
    })
}

/// The `.kind` of a transport error below the engine: the typed failure
/// when the transport gave one, else the category of the error.
fn engine_kind(e: &EngineError) -> &'static str {
    match e {
        EngineError::Transport(TransportError::PeerDisconnected(_) | TransportError::Connect { .. }) => "peer_died",
        EngineError::Transport(TransportError::Timeout { .. }) => "peer_timeout",
        _ => "transport",
    }
}

/// `TransferError.kind` of a KV error: [`kvwire::transport::FailureKind::name`]
/// (`"peer_died"`, `"peer_timeout"`, `"remote_access"`, `"cancelled"`,
/// `"local_protection"`, `"protocol"`, `"transport"`).
fn failure_kind(e: &KvError) -> Option<&'static str> {
    match e {
        KvError::TransferFailed { reason, .. } => Some(reason.kind.name()),
        KvError::PostFailed { source, .. } | KvError::Engine(source) => Some(engine_kind(source)),
        _ => None,
    }
}

/// The Python exception for a KV-layer error.
pub fn kv_err(e: KvError) -> PyErr {
    let msg = e.to_string();
    let kind = failure_kind(&e);
    match e {
        KvError::Unsupported(_) => PyNotImplementedError::new_err(msg),
        KvError::Timeout { .. } => PyTimeoutError::new_err(msg),
        // A bad `options=` entry is the caller's mistake, not a transfer failure.
        KvError::Engine(EngineError::Transport(TransportError::InvalidOption { .. })) => PyValueError::new_err(msg),
        KvError::PostFailed { .. } | KvError::TransferFailed { .. } | KvError::Engine(_) => transfer_error(msg, kind),
        KvError::Decode(_) => DecodeError::new_err(msg),
        KvError::Validation(_) => ValidationError::new_err(msg),
        // Everything else is a caller mistake: bad shapes, names, indices, wire data.
        _ => PyValueError::new_err(msg),
    }
}
