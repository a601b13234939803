//! `kvwire._kvwire`: the Python extension behind the `kvwire` package.
//!
//! Classes follow Modular MAX's KV transfer API (`KVCacheMemory`,
//! `KVTransferEngine`, `KVTransferEngineMetadata`, `TransferReqData`) so a
//! MAX user can switch by changing an import. See `docs/PYTHON.md`.
// `unsafe` only at the FFI edges of Python-owned memory (`buffers`: host
// buffers and a CUDA tensor's device memory), each block with its
// `// SAFETY:` reasoning.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod buffers;
mod connector;
mod engine;
mod errors;
mod gil;
mod ints;
mod metadata;
#[allow(unsafe_code)]
mod nixl;
mod options;
mod reqdata;

use pyo3::prelude::*;

/// The process's metrics (transfer telemetry per op and peer, connector
/// `KVCacheMetrics` windows taken with `take_metrics()`) as Prometheus text,
/// with MAX's metric names (`maxserve_dkv_*`, `maxserve_cache_*`).
#[pyfunction]
fn metrics_text() -> String {
    kvwire::metrics::prometheus_text()
}

#[pymodule]
fn _kvwire(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<metadata::PyKVCacheMemory>()?;
    m.add_class::<metadata::PyMetadata>()?;
    m.add_class::<metadata::PyTensorAgentMetadata>()?;
    m.add_class::<engine::PyKVTransferEngine>()?;
    m.add_class::<reqdata::PyTransferReqData>()?;
    m.add_class::<connector::PyConnTransfer>()?;
    m.add_class::<connector::PyConnector>()?;
    m.add_class::<connector::PyHostTierConnector>()?;
    nixl::register(m)?;
    gil::register(m)?;
    m.add_function(wrap_pyfunction!(metrics_text, m)?)?;
    m.add("TransferError", py.get_type::<errors::TransferError>())?;
    m.add("KVLoadRefused", py.get_type::<errors::KVLoadRefused>())?;
    m.add("KVLoadFailed", py.get_type::<errors::KVLoadFailed>())?;
    m.add("DecodeError", py.get_type::<errors::DecodeError>())?;
    m.add("ValidationError", py.get_type::<errors::ValidationError>())?;
    Ok(())
}
