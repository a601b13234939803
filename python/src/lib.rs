//! `kvwire._kvwire`: the Python extension behind the `kvwire` package.
//!
//! Classes follow Modular MAX's KV transfer API (`KVCacheMemory`,
//! `KVTransferEngine`, `KVTransferEngineMetadata`, `TransferReqData`) so a
//! MAX user can switch by changing an import. See `docs/PYTHON.md`.
// `unsafe` only at the FFI edge of Python-owned memory (`buffers`), each
// block with its `// SAFETY:` reasoning.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod buffers;
mod connector;
mod engine;
mod errors;
mod nixl;
mod reqdata;

use pyo3::prelude::*;

#[pymodule]
fn _kvwire(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<engine::PyKVCacheMemory>()?;
    m.add_class::<engine::PyMetadata>()?;
    m.add_class::<engine::PyKVTransferEngine>()?;
    m.add_class::<reqdata::PyTransferReqData>()?;
    m.add_class::<connector::PyGroupId>()?;
    m.add_class::<connector::PyConnTransfer>()?;
    m.add_class::<connector::PyConnector>()?;
    m.add_class::<connector::PyNullConnector>()?;
    m.add_class::<connector::PyHostTierConnector>()?;
    nixl::register(m)?;
    m.add("TransferError", py.get_type::<errors::TransferError>())?;
    m.add("KVLoadRefused", py.get_type::<errors::KVLoadRefused>())?;
    m.add("KVLoadFailed", py.get_type::<errors::KVLoadFailed>())?;
    Ok(())
}
