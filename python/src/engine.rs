//! `KVTransferEngine` (its memory and metadata classes: `metadata.rs`).

use std::sync::Mutex;
use std::time::Duration;

use kvwire::kv::{KVCacheMemory, KVTransferEngine, KVTransferEngineMetadata, PageIdxs, TransferReqData};
use kvwire::transport::{TransportConfig, TransportKind};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::kv_err;
use crate::metadata::{PyKVCacheMemory, PyMetadata, memory_type_py};
use crate::reqdata::{core_of, page_idxs, req_py};

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
    /// Peers in the order they were connected: MAX's `remote_connections`
    /// is a dict, so it lists (and `remote_agent_to_engine` maps) them in
    /// that order, before and after `cleanup()`.
    peer_order: Mutex<Vec<String>>,
    /// `completed_recv_transfers` as `cleanup()` found it: MAX's cleanup
    /// leaves that dict alone, the core engine clears it.
    recv_at_cleanup: Mutex<Option<RecvMap>>,
}

/// `[(remote engine, [(transfer_name, notifications received)])]`.
type RecvMap = Vec<(String, Vec<(String, usize)>)>;

fn lock<T>(m: &Mutex<T>) -> PyResult<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| PyRuntimeError::new_err("engine poisoned by an earlier panic"))
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

/// `{transfer_name: TransferReqData}`.
fn reqs_dict(py: Python<'_>, v: Vec<TransferReqData>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for r in v {
        d.set_item(r.transfer_name.clone(), req_py(py, &r)?)?;
    }
    Ok(d)
}

/// A group: kvwire's `KVCacheMemory`, or any object with `replicated` and
/// `buffers` (MAX's `KVCacheMemory`, whose buffers export DLPack / the
/// array interface).
fn unit_memory(py: Python<'_>, unit: &Bound<'_, PyAny>) -> PyResult<KVCacheMemory> {
    if let Ok(m) = unit.downcast::<PyKVCacheMemory>() {
        return Ok(m.get().inner.clone());
    }
    let (Ok(replicated), Ok(buffers)) = (unit.getattr("replicated"), unit.getattr("buffers")) else {
        return Err(PyValueError::new_err(
            "memory must be [replica][group] of KVCacheMemory (or objects with `replicated` and `buffers`)",
        ));
    };
    let m = PyKVCacheMemory::new(py, replicated.extract()?, &buffers)?;
    Ok(m.inner)
}

/// MAX's `recurrent_leaf`: a leaf parameter whose `group_id` (or kind) says recurrent / state.
fn is_recurrent_leaf(p: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(g) = p.getattr("group_id") else { return Ok(false) };
    for m in ["is_recurrent", "is_scratch"] {
        if let Ok(f) = g.getattr(m)
            && f.call0()?.is_truthy()?
        {
            return Ok(true);
        }
    }
    Ok(false)
}

impl PyKVTransferEngine {
    #[allow(clippy::too_many_arguments)]
    fn build(
        py: Python<'_>,
        name: String,
        groups: Vec<Vec<KVCacheMemory>>,
        leaf_ids: Option<Vec<String>>,
        transport: &str,
        peer_timeout_s: f64,
        copy_threads: usize,
        options: Vec<(String, String)>,
    ) -> PyResult<Self> {
        let kind: TransportKind = transport.parse().map_err(|e| PyValueError::new_err(format!("{e}")))?;
        if !(peer_timeout_s.is_finite() && peer_timeout_s > 0.0) {
            return Err(PyValueError::new_err("peer_timeout_s must be a positive number of seconds"));
        }
        let cfg = TransportConfig { peer_timeout: Duration::from_secs_f64(peer_timeout_s), copy_threads, options };
        let engine = crate::gil::without_gil(py, || KVTransferEngine::new(&name, groups, leaf_ids, kind, &cfg))
            .map_err(kv_err)?;
        Ok(Self {
            inner: Mutex::new(engine),
            name,
            peer_order: Mutex::new(Vec::new()),
            recv_at_cleanup: Mutex::new(None),
        })
    }

    /// Run `f` on the engine with the GIL released. The lock is taken
    /// without the GIL too, so a second Python thread waiting on it cannot
    /// deadlock with the holder re-acquiring the GIL.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut KVTransferEngine) -> Result<T, kvwire::kv::KvError> + Send,
    ) -> PyResult<T> {
        crate::gil::without_gil(py, || {
            let mut e =
                self.inner.lock().map_err(|_| PyRuntimeError::new_err("engine poisoned by an earlier panic"))?;
            f(&mut e).map_err(kv_err)
        })
    }

    fn get<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&KVTransferEngine) -> T + Send) -> PyResult<T> {
        self.run(py, |e| Ok(f(e)))
    }

    /// MAX's `remote_connections` in connect order (peers the core lists
    /// that this wrapper never saw connect, if any, come last by name).
    fn peers(&self, py: Python<'_>) -> PyResult<Vec<(String, KVTransferEngineMetadata)>> {
        let mut v: Vec<(String, KVTransferEngineMetadata)> =
            self.get(py, |e| e.remote_connections().into_iter().map(|(n, m)| (n.to_string(), m.clone())).collect())?;
        let order = lock(&self.peer_order)?;
        v.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        Ok(v)
    }

    fn recv_map(&self, py: Python<'_>) -> PyResult<RecvMap> {
        self.get(py, |e| {
            e.completed_recv_transfers()
                .iter()
                .map(|(n, m)| (n.clone(), m.iter().map(|(t, c)| (t.clone(), *c)).collect()))
                .collect()
        })
    }

    fn initiate<'py>(
        &self,
        py: Python<'py>,
        remote: &Bound<'_, PyAny>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        replicas: (i64, i64),
        read: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let remote = remote_of(remote)?;
        // MAX: `if not (0 <= src_replica_idx < dp): raise ValueError(...)`.
        let local_dp = self.get(py, |e| e.dp())?;
        let remote_dp = match &remote {
            Remote::Meta(m) => Some(m.dp()),
            Remote::Name(n) => self.get(py, |e| {
                e.remote_connections().into_iter().find(|(name, _)| *name == n.as_str()).map(|(_, m)| m.dp())
            })?,
        };
        let (local_name, remote_name) =
            if read { ("dst_replica_idx", "src_replica_idx") } else { ("src_replica_idx", "dst_replica_idx") };
        let (local_idx, remote_idx) = if read { (replicas.1, replicas.0) } else { (replicas.0, replicas.1) };
        let between = |n: usize| format!("must be between 0 and {}", n as i64 - 1);
        if local_idx < 0 {
            return Err(PyValueError::new_err(format!("{local_name} {local_idx} {}", between(local_dp))));
        }
        if remote_idx < 0 {
            let tail = remote_dp.map_or_else(|| "must be >= 0".to_string(), between);
            return Err(PyValueError::new_err(format!("{remote_name} {remote_idx} {tail}")));
        }
        let replicas = (replicas.0 as usize, replicas.1 as usize);
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
        req_py(py, &inner)
    }

    fn with_req<T: Send>(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut KVTransferEngine, &TransferReqData) -> Result<T, kvwire::kv::KvError> + Send,
    ) -> PyResult<T> {
        let r = core_of(req)?;
        self.run(py, |e| f(e, &r))
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
        options: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut groups: Vec<Vec<KVCacheMemory>> = Vec::new();
        for replica in memory.try_iter()? {
            let replica = replica?;
            let mut row = Vec::new();
            for g in replica.try_iter().map_err(|_| {
                PyValueError::new_err("memory must be [replica][group] of KVCacheMemory (a list of lists)")
            })? {
                let g = g?;
                row.push(unit_memory(py, &g)?);
            }
            groups.push(row);
        }
        let options = crate::options::transport_options(options)?;
        Self::build(py, name, groups, leaf_ids, transport, peer_timeout_s, copy_threads, options)
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
    /// `sum(bytes_per_group)` (bytes).
    #[getter]
    fn bytes_per_page(&self, py: Python<'_>) -> PyResult<u64> {
        self.get(py, |e| e.bytes_per_page())
    }
    /// `kvwire.MemoryType.DRAM` or `.VRAM`.
    #[getter]
    fn memory_type<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = self.get(py, |e| e.memory_type())?;
        memory_type_py(py, t)
    }
    /// `{remote engine name: KVTransferEngineMetadata}` of the peers
    /// connected (a snapshot; `cleanup()` leaves it as it was, as MAX's).
    #[getter]
    fn remote_connections<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (n, m) in self.peers(py)? {
            d.set_item(n, PyMetadata { inner: m })?;
        }
        Ok(d)
    }
    /// `{remote agent name: remote engine name}` (a snapshot).
    #[getter]
    fn remote_agent_to_engine<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (n, m) in self.peers(py)? {
            for a in m.agents_meta.iter().flatten() {
                d.set_item(&a.agent_name, &n)?;
            }
        }
        Ok(d)
    }
    /// `{transfer_name: TransferReqData}` of sends started here and not released (a snapshot).
    #[getter]
    fn inflight_send_transfers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let v: Vec<TransferReqData> = self.get(py, |e| e.inflight_send_transfers().values().cloned().collect())?;
        reqs_dict(py, v)
    }
    /// `{transfer_name: TransferReqData}` of reads started here and not released (a snapshot).
    #[getter]
    fn inflight_read_transfers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let v: Vec<TransferReqData> = self.get(py, |e| e.inflight_read_transfers().values().cloned().collect())?;
        reqs_dict(py, v)
    }
    /// `{remote engine: {transfer_name: notifications received}}` (passive
    /// side; a snapshot). `cleanup()` leaves it as it was, as MAX's does.
    #[getter]
    fn completed_recv_transfers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let kept = lock(&self.recv_at_cleanup)?.clone();
        let v = match kept {
            Some(v) => v,
            None => self.recv_map(py)?,
        };
        let d = PyDict::new(py);
        for (n, m) in v {
            let inner = PyDict::new(py);
            for (t, c) in m {
                inner.set_item(t, c)?;
            }
            d.set_item(n, inner)?;
        }
        Ok(d)
    }

    /// Build an engine from a MAX `PagedKVCacheManager`-shaped object, as
    /// MAX's `KVTransferEngine.from_paged_kv_cache`: for each replica `r` of
    /// `kv_cache.params.data_parallel_degree`,
    /// `kv_cache.get_device_buffer(r).to_memory()` gives `{leaf_id: unit}`;
    /// the units are taken in `kv_cache.params.leaves()` order. A unit is any
    /// object with `replicated` and `buffers` (MAX's `KVCacheMemory` or
    /// kvwire's). MAX is not imported.
    ///
    /// Raises `NotImplementedError` when a declared leaf keeps recurrent
    /// state (MAX's `recurrent_leaf(params)`), `ValueError` as the constructor.
    #[classmethod]
    #[pyo3(signature = (name, kv_cache, *, transport="shm", peer_timeout_s=5.0, copy_threads=2, options=None))]
    #[allow(clippy::too_many_arguments)]
    fn from_paged_kv_cache(
        cls: &Bound<'_, pyo3::types::PyType>,
        name: String,
        kv_cache: &Bound<'_, PyAny>,
        transport: &str,
        peer_timeout_s: f64,
        copy_threads: usize,
        options: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let py = cls.py();
        let params = kv_cache.getattr("params")?;
        let leaves = params.call_method0("leaves")?;
        let leaf_ids: Vec<String> = leaves.try_iter()?.map(|l| l?.extract()).collect::<PyResult<_>>()?;
        if leaves.hasattr("items")? {
            for item in leaves.call_method0("items")?.try_iter()? {
                let (leaf, p): (String, Bound<'_, PyAny>) = item?.extract()?;
                if is_recurrent_leaf(&p)? {
                    return Err(pyo3::exceptions::PyNotImplementedError::new_err(format!(
                        "Disaggregated inference cannot transfer a recurrent state pool (leaf {leaf}): a state \
                         block is a whole request's state, not a span of tokens"
                    )));
                }
            }
        }
        let dp: usize = params.getattr("data_parallel_degree")?.extract()?;
        let mut memory: Vec<Vec<KVCacheMemory>> = Vec::with_capacity(dp);
        for r in 0..dp {
            let units = kv_cache.call_method1("get_device_buffer", (r,))?.call_method0("to_memory")?;
            let mut row = Vec::with_capacity(leaf_ids.len());
            for leaf in &leaf_ids {
                let unit = units.get_item(leaf.as_str())?;
                row.push(unit_memory(py, &unit)?);
            }
            memory.push(row);
        }
        let options = crate::options::transport_options(options)?;
        Self::build(py, name, memory, Some(leaf_ids), transport, peer_timeout_s, copy_threads, options)
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
        let name = m.name.clone();
        self.run(py, |e| e.connect(&m))?;
        let mut order = lock(&self.peer_order)?;
        order.retain(|n| *n != name);
        order.push(name);
        Ok(())
    }

    /// Forget a connected peer. Raises `ValueError` when not connected.
    fn disconnect(&self, py: Python<'_>, remote_name: &str) -> PyResult<()> {
        self.run(py, |e| e.disconnect(remote_name))?;
        lock(&self.peer_order)?.retain(|n| n != remote_name);
        Ok(())
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
    fn initiate_send_transfer<'py>(
        &self,
        py: Python<'py>,
        remote: &Bound<'_, PyAny>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        src_replica_idx: i64,
        dst_replica_idx: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.initiate(py, remote, src_idxs, dst_idxs, (src_replica_idx, dst_replica_idx), false)
    }

    /// READ pages `src_idxs` of replica `src_replica_idx` of `remote` into
    /// local pages `dst_idxs` of replica `dst_replica_idx` (`is_read=True`).
    #[pyo3(signature = (remote, src_idxs, dst_idxs, src_replica_idx=0, dst_replica_idx=0))]
    fn initiate_read_transfer<'py>(
        &self,
        py: Python<'py>,
        remote: &Bound<'_, PyAny>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        src_replica_idx: i64,
        dst_replica_idx: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.initiate(py, remote, src_idxs, dst_idxs, (src_replica_idx, dst_replica_idx), true)
    }

    /// Poll a transfer on either side: True once every shard request landed
    /// (initiator) or every expected notification arrived (passive side).
    /// Raises `kvwire.TransferError` when a shard request failed.
    fn is_complete(&self, py: Python<'_>, req: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.with_req(py, req, |e, r| e.is_complete(r))
    }

    /// Release a completed transfer's resources (either side).
    /// Raises `ValueError` when it is not complete or unknown.
    fn cleanup_transfer(&self, py: Python<'_>, req: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_req(py, req, |e, r| e.cleanup_transfer(r))
    }

    /// Cancel an in-flight transfer (initiator); returns once no copy can touch its pages.
    fn cancel_transfer(&self, py: Python<'_>, req: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_req(py, req, |e, r| e.cancel_transfer(r))
    }

    /// Wait (GIL released) up to `timeout_s` seconds for the transfer, then
    /// release it. Raises `TimeoutError` (the transfer is cancelled first).
    #[pyo3(signature = (req, timeout_s=30.0))]
    fn sync_and_release(&self, py: Python<'_>, req: &Bound<'_, PyAny>, timeout_s: f64) -> PyResult<()> {
        if !(timeout_s.is_finite() && timeout_s >= 0.0) {
            return Err(PyValueError::new_err("timeout_s must be a non-negative number of seconds"));
        }
        let t = Duration::from_secs_f64(timeout_s);
        self.with_req(py, req, |e, r| e.sync_and_release(r, t))
    }

    /// Cancel everything in flight, disconnect every peer and deregister memory.
    ///
    /// As MAX's: `remote_connections`, `remote_agent_to_engine` and
    /// `completed_recv_transfers` stay as they were (so `connect` to one of
    /// those peers raises "already connected"); the in-flight maps empty.
    fn cleanup(&self, py: Python<'_>) -> PyResult<()> {
        let recv = self.recv_map(py)?;
        lock(&self.recv_at_cleanup)?.get_or_insert(recv);
        self.run(py, |e| e.cleanup())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (dp, tp, leaves) = self.get(py, |e| (e.dp(), e.tp(), e.leaf_ids().to_vec()))?;
        Ok(format!("KVTransferEngine(name={:?}, dp={dp}, tp={tp}, leaf_ids={leaves:?})", self.name))
    }
}
