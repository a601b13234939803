//! `KVCacheMemory` (what an engine registers) and the metadata classes a
//! peer needs to connect: `KVTransferEngineMetadata`, `TensorAgentMetadata`.

use kvwire::kv::{KVCacheMemory, KVTransferEngineMetadata, MemoryType, TensorAgentMetadata};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

use crate::buffers::kv_buffer;
use crate::errors::kv_err;

/// One logical KV tensor (a NIXL group) as one view per TP shard, as MAX's
/// `max.nn.kv_cache.cache_params.KVCacheMemory`.
///
/// `buffers`: one writable host buffer per TP shard, each 2-D `uint8` of shape
/// `[num_pages, bytes_per_page]` (null block included in `num_pages`),
/// contiguous. Anything with `__array_interface__` (numpy), `__dlpack__` (CPU
/// torch tensors) or the buffer protocol. The buffers are kept alive by this
/// object and by every engine that registered them.
///
/// Raises `ValueError` as MAX's `__post_init__`: no buffers, not 2-D, not
/// `uint8`, not contiguous, shapes differ, `replicated` with < 2 buffers.
#[pyclass(module = "kvwire", name = "KVCacheMemory", frozen)]
pub struct PyKVCacheMemory {
    pub inner: KVCacheMemory,
    buffers: Py<PyList>,
}

#[pymethods]
impl PyKVCacheMemory {
    #[new]
    pub fn new(py: Python<'_>, replicated: bool, buffers: &Bound<'_, PyAny>) -> PyResult<Self> {
        let objs: Vec<Bound<'_, PyAny>> = buffers.try_iter()?.collect::<PyResult<_>>()?;
        let kv = objs.iter().map(kv_buffer).collect::<PyResult<Vec<_>>>()?;
        let inner = KVCacheMemory::new(replicated, kv).map_err(kv_err)?;
        Ok(Self { inner, buffers: PyList::new(py, objs)?.unbind() })
    }

    /// All shard buffers hold identical bytes (TP + MLA).
    #[getter]
    fn replicated(&self) -> bool {
        self.inner.replicated()
    }
    /// The shard buffers as given.
    #[getter]
    fn buffers(&self, py: Python<'_>) -> Py<PyList> {
        self.buffers.clone_ref(py)
    }
    /// `buffers[0].shape[1]`: bytes per page.
    #[getter]
    fn bytes_per_page(&self) -> u64 {
        self.inner.bytes_per_page()
    }
    /// `buffers[0].shape[0]`: pages, null block included.
    #[getter]
    fn total_num_pages(&self) -> u64 {
        self.inner.total_num_pages()
    }
    /// `bytes_per_page * (1 if replicated else len(buffers))`: one host-tier row (bytes).
    #[getter]
    fn host_bytes_per_page(&self) -> u64 {
        self.inner.host_bytes_per_page()
    }
    fn __repr__(&self) -> String {
        format!(
            "KVCacheMemory(replicated={}, shards={}, shape=[{}, {}])",
            if self.inner.replicated() { "True" } else { "False" },
            self.inner.num_shards(),
            self.inner.total_num_pages(),
            self.inner.bytes_per_page()
        )
    }
}

/// What a peer needs to `connect` to an engine, as MAX's
/// `KVTransferEngineMetadata` (msgspec JSON). Send it with `to_bytes()`,
/// rebuild it with `KVTransferEngineMetadata.from_bytes(b)`; it also pickles.
#[pyclass(module = "kvwire", name = "KVTransferEngineMetadata", eq, frozen)]
#[derive(Clone, PartialEq)]
pub struct PyMetadata {
    pub inner: KVTransferEngineMetadata,
}

#[pymethods]
impl PyMetadata {
    /// Engine base name.
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    /// `gethostname()` of the engine's host.
    #[getter]
    fn hostname(&self) -> &str {
        &self.inner.hostname
    }
    /// `kvwire.MemoryType.DRAM` or `.VRAM` (`nixl.MemoryType`'s values; the
    /// encodings carry the integer).
    #[getter]
    fn memory_type<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        memory_type_py(py, self.inner.memory_type)
    }
    /// Per replica, per TP shard, each agent's metadata.
    #[getter]
    fn agents_meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let rows = PyList::empty(py);
        for row in &self.inner.agents_meta {
            let r = PyList::empty(py);
            for a in row {
                r.append(Py::new(py, PyTensorAgentMetadata { inner: a.clone() })?)?;
            }
            rows.append(r)?;
        }
        Ok(rows)
    }
    /// `sum(bytes_per_group)` as the engine sent it (bytes).
    #[getter]
    fn bytes_per_page(&self) -> u64 {
        self.inner.bytes_per_page
    }
    /// Group ids.
    #[getter]
    fn leaf_ids(&self) -> Vec<String> {
        self.inner.leaf_ids.clone()
    }
    /// Pages per group (null block included).
    #[getter]
    fn num_pages_per_group(&self) -> Vec<u64> {
        self.inner.num_pages_per_group.clone()
    }
    /// Bytes per page per group.
    #[getter]
    fn bytes_per_group(&self) -> Vec<u64> {
        self.inner.bytes_per_group.clone()
    }
    /// Replication per group.
    #[getter]
    fn replicated_per_group(&self) -> Vec<bool> {
        self.inner.replicated_per_group.clone()
    }
    /// DP replicas.
    #[getter]
    fn dp(&self) -> usize {
        self.inner.dp()
    }
    /// TP shards per replica.
    #[getter]
    fn tp(&self) -> usize {
        self.inner.tp()
    }
    /// The msgspec JSON form.
    fn to_json(&self) -> String {
        self.inner.to_json()
    }
    /// The JSON form as bytes: `msgspec.json.encode(metadata)`.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }
    /// The msgpack form: `msgspec.msgpack.encode(metadata)`.
    fn to_msgpack<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_msgpack())
    }
    /// Decode the JSON form (as `msgspec.json.decode(data, type=KVTransferEngineMetadata)`,
    /// then kvwire's consistency checks). Raises `kvwire.DecodeError`,
    /// `kvwire.ValidationError` or `ValueError` (inconsistent engine).
    #[staticmethod]
    fn from_bytes(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let b = meta_bytes(data)?;
        Ok(Self { inner: KVTransferEngineMetadata::from_bytes(&b).map_err(kv_err)? })
    }
    /// Decode the msgpack form. Raises as `from_bytes`.
    #[staticmethod]
    fn from_msgpack(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let b = meta_bytes(data)?;
        Ok(Self { inner: KVTransferEngineMetadata::from_msgpack(&b).map_err(kv_err)? })
    }
    /// Decode `to_json()` output. Raises `ValueError` on malformed data.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        Ok(Self { inner: KVTransferEngineMetadata::from_json(text).map_err(kv_err)? })
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let ctor = slf.get_type().getattr("from_msgpack")?;
        Ok((ctor, (PyBytes::new(slf.py(), &slf.get().inner.to_msgpack()),)))
    }
    fn __repr__(&self) -> String {
        format!("KVTransferEngineMetadata(name={:?}, dp={}, tp={})", self.inner.name, self.inner.dp(), self.inner.tp())
    }
}

fn meta_bytes(data: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = data.downcast::<PyString>() {
        return Ok(s.extract::<String>()?.into_bytes());
    }
    data.extract::<Vec<u8>>().map_err(|_| PyValueError::new_err("expected bytes or str"))
}

/// `kvwire.MemoryType` member of `t`.
pub fn memory_type_py(py: Python<'_>, t: MemoryType) -> PyResult<Bound<'_, PyAny>> {
    py.import("kvwire._max")?.getattr("MemoryType")?.call1((t.nixl_value(),))
}

/// One agent (one `(replica, tp_shard)`) of an engine's metadata, as MAX's
/// `TensorAgentMetadata`.
#[pyclass(module = "kvwire", name = "TensorAgentMetadata", eq, frozen)]
#[derive(Clone, PartialEq)]
pub struct PyTensorAgentMetadata {
    inner: TensorAgentMetadata,
}

#[pymethods]
impl PyTensorAgentMetadata {
    /// `{engine}_{replica}_{shard}`.
    #[getter]
    fn agent_name(&self) -> &str {
        &self.inner.agent_name
    }
    /// The agent's connection data (kvwire's agent metadata where MAX has NIXL's blob).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.metadata)
    }
    /// Address of page 0 of each group.
    #[getter]
    fn base_addrs(&self) -> Vec<u64> {
        self.inner.base_addrs.clone()
    }
    /// Device ordinal (0 for host memory).
    #[getter]
    fn device_id(&self) -> u32 {
        self.inner.device_id
    }
    /// Per group, offsets where a new registered region begins (empty lists: one region).
    #[getter]
    fn region_splits(&self) -> Vec<Vec<u64>> {
        self.inner.region_splits.clone()
    }
    fn __repr__(&self) -> String {
        format!("TensorAgentMetadata(agent_name={:?}, device_id={})", self.inner.agent_name, self.inner.device_id)
    }
}
