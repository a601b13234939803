//! `KVCacheMemory`, `KVTransferEngineMetadata` and `KVTransferEngine`.

use std::sync::Mutex;
use std::time::Duration;

use kvwire::kv::{KVCacheMemory, KVTransferEngine, KVTransferEngineMetadata, PageIdxs, TransferReqData};
use kvwire::transport::{TransportConfig, TransportKind};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::buffers::kv_buffer;
use crate::errors::kv_err;
use crate::reqdata::{PyTransferReqData, page_idxs};

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
    fn new(py: Python<'_>, replicated: bool, buffers: &Bound<'_, PyAny>) -> PyResult<Self> {
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
    /// `"DRAM"` or `"VRAM"`.
    #[getter]
    fn memory_type(&self) -> &'static str {
        match self.inner.memory_type {
            kvwire::kv::MemoryType::Dram => "DRAM",
            kvwire::kv::MemoryType::Vram => "VRAM",
        }
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
    /// The wire form (bytes).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }
    /// Decode `to_bytes()` output. Raises `ValueError` on malformed data.
    #[staticmethod]
    fn from_bytes(data: Vec<u8>) -> PyResult<Self> {
        Ok(Self { inner: KVTransferEngineMetadata::from_bytes(&data).map_err(kv_err)? })
    }
    /// Decode `to_json()` output. Raises `ValueError` on malformed data.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        Ok(Self { inner: KVTransferEngineMetadata::from_json(text).map_err(kv_err)? })
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let ctor = slf.get_type().getattr("from_bytes")?;
        Ok((ctor, (PyBytes::new(slf.py(), &slf.get().inner.to_bytes()),)))
    }
    fn __repr__(&self) -> String {
        format!("KVTransferEngineMetadata(name={:?}, dp={}, tp={})", self.inner.name, self.inner.dp(), self.inner.tp())
    }
}

/// KV-cache transfer engine with DP and TP, as MAX's
/// `max.pipelines.kv_cache.KVTransferEngine`.
///
/// `memory` is `[replica][group]` of `KVCacheMemory`; `leaf_ids` names the
/// groups (default `"0"`, `"1"`, ...). `transport` is `"shm"` (same host,
/// default), `"tcp"` or `"verbs"`. Not thread-safe in MAX; here calls are
/// serialized by a lock and release the GIL while they wait or copy.
#[pyclass(module = "kvwire", name = "KVTransferEngine", frozen)]
pub struct PyKVTransferEngine {
    inner: Mutex<KVTransferEngine>,
    name: String,
}

/// The peer of a transfer: its name or its metadata.
enum Remote {
    Name(String),
    Meta(KVTransferEngineMetadata),
}

fn remote_of(obj: &Bound<'_, PyAny>) -> PyResult<Remote> {
    if let Ok(m) = obj.downcast::<PyMetadata>() {
        return Ok(Remote::Meta(m.get().inner.clone()));
    }
    obj.extract::<String>()
        .map(Remote::Name)
        .map_err(|_| PyValueError::new_err("remote must be an engine name (str) or KVTransferEngineMetadata"))
}

impl PyKVTransferEngine {
    /// Run `f` on the engine with the GIL released. The lock is taken
    /// without the GIL too, so a second Python thread waiting on it cannot
    /// deadlock with the holder re-acquiring the GIL.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut KVTransferEngine) -> Result<T, kvwire::kv::KvError> + Send,
    ) -> PyResult<T> {
        py.allow_threads(|| {
            let mut e =
                self.inner.lock().map_err(|_| PyRuntimeError::new_err("engine poisoned by an earlier panic"))?;
            f(&mut e).map_err(kv_err)
        })
    }

    fn get<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&KVTransferEngine) -> T + Send) -> PyResult<T> {
        self.run(py, |e| Ok(f(e)))
    }

    fn initiate(
        &self,
        py: Python<'_>,
        remote: &Bound<'_, PyAny>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        replicas: (usize, usize),
        read: bool,
    ) -> PyResult<PyTransferReqData> {
        let remote = remote_of(remote)?;
        let (src, dst): (PageIdxs, PageIdxs) = (page_idxs(src_idxs)?, page_idxs(dst_idxs)?);
        let inner = self.run(py, |e| {
            let (s, d) = replicas;
            match (&remote, read) {
                (Remote::Name(n), false) => e.initiate_send_transfer(n.as_str(), &src, &dst, s, d),
                (Remote::Name(n), true) => e.initiate_read_transfer(n.as_str(), &src, &dst, s, d),
                (Remote::Meta(m), false) => e.initiate_send_transfer(m, &src, &dst, s, d),
                (Remote::Meta(m), true) => e.initiate_read_transfer(m, &src, &dst, s, d),
            }
        })?;
        Ok(PyTransferReqData { inner })
    }

    fn with_req<T: Send>(
        &self,
        py: Python<'_>,
        req: &PyTransferReqData,
        f: impl FnOnce(&mut KVTransferEngine, &TransferReqData) -> Result<T, kvwire::kv::KvError> + Send,
    ) -> PyResult<T> {
        let r = &req.inner;
        self.run(py, |e| f(e, r))
    }
}

#[pymethods]
impl PyKVTransferEngine {
    #[new]
    #[pyo3(signature = (name, memory, leaf_ids=None, *, transport="shm", peer_timeout_s=5.0, copy_threads=2, options=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        memory: &Bound<'_, PyAny>,
        leaf_ids: Option<Vec<String>>,
        transport: &str,
        peer_timeout_s: f64,
        copy_threads: usize,
        options: Option<Vec<(String, String)>>,
    ) -> PyResult<Self> {
        let kind: TransportKind = transport.parse().map_err(|e| PyValueError::new_err(format!("{e}")))?;
        if !(peer_timeout_s.is_finite() && peer_timeout_s > 0.0) {
            return Err(PyValueError::new_err("peer_timeout_s must be a positive number of seconds"));
        }
        let mut groups: Vec<Vec<KVCacheMemory>> = Vec::new();
        for replica in memory.try_iter()? {
            let replica = replica?;
            let mut row = Vec::new();
            for g in replica.try_iter().map_err(|_| {
                PyValueError::new_err("memory must be [replica][group] of KVCacheMemory (a list of lists)")
            })? {
                let g = g?;
                let m = g
                    .downcast::<PyKVCacheMemory>()
                    .map_err(|_| PyValueError::new_err("memory must be [replica][group] of KVCacheMemory"))?;
                row.push(m.get().inner.clone());
            }
            groups.push(row);
        }
        let cfg = TransportConfig {
            peer_timeout: Duration::from_secs_f64(peer_timeout_s),
            copy_threads,
            options: options.unwrap_or_default(),
        };
        let engine = py.allow_threads(|| KVTransferEngine::new(&name, groups, leaf_ids, kind, &cfg)).map_err(kv_err)?;
        Ok(Self { inner: Mutex::new(engine), name })
    }

    /// Engine base name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    /// DP replicas.
    #[getter]
    fn dp(&self, py: Python<'_>) -> PyResult<usize> {
        self.get(py, |e| e.dp())
    }
    /// TP shards per replica.
    #[getter]
    fn tp(&self, py: Python<'_>) -> PyResult<usize> {
        self.get(py, |e| e.tp())
    }
    /// Group ids.
    #[getter]
    fn leaf_ids(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.get(py, |e| e.leaf_ids().to_vec())
    }
    /// Bytes per page per group.
    #[getter]
    fn bytes_per_group(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.get(py, |e| e.bytes_per_group().to_vec())
    }
    /// Pages per group (null block included).
    #[getter]
    fn num_pages_per_group(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.get(py, |e| e.num_pages_per_group().to_vec())
    }
    /// Replication per group.
    #[getter]
    fn replicated_per_group(&self, py: Python<'_>) -> PyResult<Vec<bool>> {
        self.get(py, |e| e.replicated_per_group().to_vec())
    }
    /// This engine's metadata, for peers to `connect` with.
    #[getter]
    fn metadata(&self, py: Python<'_>) -> PyResult<PyMetadata> {
        Ok(PyMetadata { inner: self.get(py, |e| e.metadata())? })
    }

    /// Connect to a peer engine (its metadata, e.g. from
    /// `KVTransferEngineMetadata.from_bytes`).
    ///
    /// Raises `ValueError` (already connected, bytes-per-page or leaf
    /// mismatch), `NotImplementedError` (GATHER_SCATTER: sharded TP != TP').
    fn connect(&self, py: Python<'_>, remote: &Bound<'_, PyAny>) -> PyResult<()> {
        let m = remote
            .downcast::<PyMetadata>()
            .map_err(|_| PyValueError::new_err("connect takes a KVTransferEngineMetadata"))?
            .get()
            .inner
            .clone();
        self.run(py, |e| e.connect(&m))
    }

    /// Forget a connected peer. Raises `ValueError` when not connected.
    fn disconnect(&self, py: Python<'_>, remote_name: &str) -> PyResult<()> {
        self.run(py, |e| e.disconnect(remote_name))
    }

    /// True when connected to `remote_name`.
    fn is_connected(&self, py: Python<'_>, remote_name: &str) -> PyResult<bool> {
        self.get(py, |e| e.is_connected(remote_name))
    }

    /// WRITE local pages `src_idxs` of replica `src_replica_idx` into pages
    /// `dst_idxs` of replica `dst_replica_idx` of `remote` (a name or metadata).
    /// Page indices: `dict[leaf_id, list[int]]` or one `list[int]` for every
    /// leaf; each page is `bytes_per_page` bytes of every TP shard.
    ///
    /// Raises `ValueError` for bad replicas, leaves or pages,
    /// `kvwire.TransferError` when a request cannot be posted.
    #[pyo3(signature = (remote, src_idxs, dst_idxs, src_replica_idx=0, dst_replica_idx=0))]
    fn initiate_send_transfer(
        &self,
        py: Python<'_>,
        remote: &Bound<'_, PyAny>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        src_replica_idx: usize,
        dst_replica_idx: usize,
    ) -> PyResult<PyTransferReqData> {
        self.initiate(py, remote, src_idxs, dst_idxs, (src_replica_idx, dst_replica_idx), false)
    }

    /// READ pages `src_idxs` of replica `src_replica_idx` of `remote` into
    /// local pages `dst_idxs` of replica `dst_replica_idx` (`is_read=True`).
    #[pyo3(signature = (remote, src_idxs, dst_idxs, src_replica_idx=0, dst_replica_idx=0))]
    fn initiate_read_transfer(
        &self,
        py: Python<'_>,
        remote: &Bound<'_, PyAny>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        src_replica_idx: usize,
        dst_replica_idx: usize,
    ) -> PyResult<PyTransferReqData> {
        self.initiate(py, remote, src_idxs, dst_idxs, (src_replica_idx, dst_replica_idx), true)
    }

    /// Poll a transfer on either side: True once every shard request landed
    /// (initiator) or every expected notification arrived (passive side).
    /// Raises `kvwire.TransferError` when a shard request failed.
    fn is_complete(&self, py: Python<'_>, req: &PyTransferReqData) -> PyResult<bool> {
        self.with_req(py, req, |e, r| e.is_complete(r))
    }

    /// Release a completed transfer's resources (either side).
    /// Raises `ValueError` when it is not complete or unknown.
    fn cleanup_transfer(&self, py: Python<'_>, req: &PyTransferReqData) -> PyResult<()> {
        self.with_req(py, req, |e, r| e.cleanup_transfer(r))
    }

    /// Cancel an in-flight transfer (initiator); returns once no copy can touch its pages.
    fn cancel_transfer(&self, py: Python<'_>, req: &PyTransferReqData) -> PyResult<()> {
        self.with_req(py, req, |e, r| e.cancel_transfer(r))
    }

    /// Wait (GIL released) up to `timeout_s` seconds for the transfer, then
    /// release it. Raises `TimeoutError` (the transfer is cancelled first).
    #[pyo3(signature = (req, timeout_s=30.0))]
    fn sync_and_release(&self, py: Python<'_>, req: &PyTransferReqData, timeout_s: f64) -> PyResult<()> {
        if !(timeout_s.is_finite() && timeout_s >= 0.0) {
            return Err(PyValueError::new_err("timeout_s must be a non-negative number of seconds"));
        }
        let t = Duration::from_secs_f64(timeout_s);
        self.with_req(py, req, |e, r| e.sync_and_release(r, t))
    }

    /// Cancel everything in flight, disconnect every peer and deregister memory.
    fn cleanup(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |e| e.cleanup())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (dp, tp, leaves) = self.get(py, |e| (e.dp(), e.tp(), e.leaf_ids().to_vec()))?;
        Ok(format!("KVTransferEngine(name={:?}, dp={dp}, tp={tp}, leaf_ids={leaves:?})", self.name))
    }
}
