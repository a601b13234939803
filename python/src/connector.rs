//! KV connectors (MAX `max.pipelines.kv_cache.connectors`): `NullConnector`
//! and the host tier `HostTierConnector`, with `lookup` / `load` / `offload`
//! / `touch` / `poll_transfers` / `shutdown` / `reset_prefix_cache` / `metrics`.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvwire::connector::{
    BlockHash, BlockId, ConnectorError, DevicePages, HostTierConnector, KVCacheGroupId, KVCacheGroupKind, KVConnector,
    KVTransfer, LeafId, PerLeaf,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffers::PyPages;
use crate::errors::{KVLoadFailed, KVLoadRefused};
use crate::metadata::PyKVCacheMemory;

fn conn_err(e: ConnectorError) -> PyErr {
    let msg = e.to_string();
    match e {
        ConnectorError::LoadRefused { .. } => KVLoadRefused::new_err(msg),
        ConnectorError::LoadFailed { .. } => KVLoadFailed::new_err(msg),
        ConnectorError::ShutDown | ConnectorError::OffloadFailed { .. } => PyRuntimeError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

/// `kvwire.KVCacheGroupId` (MAX's frozen dataclass: `type`, `window_size`) of a group.
fn group_py<'py>(py: Python<'py>, g: &KVCacheGroupId) -> PyResult<Bound<'py, PyAny>> {
    let cls = py.import("kvwire._max")?.getattr("KVCacheGroupId")?;
    match g.kind {
        KVCacheGroupKind::Full => cls.call1(("full",)),
        KVCacheGroupKind::SlidingWindow => cls.call1(("sliding_window", g.window_size.map_or(-1, i64::from))),
        KVCacheGroupKind::Recurrent => cls.call1(("recurrent",)),
    }
}

/// A group from any object with MAX's `type` / `window_size` fields.
fn group_of(obj: &Bound<'_, PyAny>) -> PyResult<KVCacheGroupId> {
    let bad = || PyValueError::new_err("leaves values must be KVCacheGroupId (with `type` and `window_size`)");
    let kind: String = obj.getattr("type").map_err(|_| bad())?.extract().map_err(|_| bad())?;
    let window: i64 = obj.getattr("window_size").map_err(|_| bad())?.extract().map_err(|_| bad())?;
    match (kind.as_str(), window) {
        ("full", -1) => Ok(KVCacheGroupId::full()),
        ("recurrent", -1) => Ok(KVCacheGroupId::recurrent()),
        ("sliding_window", w) if w > 1 => Ok(KVCacheGroupId::sliding_window(
            u32::try_from(w).map_err(|_| PyValueError::new_err(format!("window_size {w} is too large")))?,
        )),
        _ => Err(PyValueError::new_err(format!(
            "kvwire's tier connectors serve full, sliding_window and recurrent groups, not {kind:?} (window {window})"
        ))),
    }
}

/// A connector copy to poll: `is_complete()` (never blocks) or
/// `synchronize()` (blocks, GIL released). An offload's handle also names
/// the device blocks to keep pinned until it lands: `g0_blocks_per_leaf`.
#[pyclass(module = "kvwire", name = "KVConnectorTransfer", frozen)]
pub struct PyConnTransfer {
    inner: Box<dyn KVTransfer>,
    pinned: PerLeaf<BlockId>,
}

#[pymethods]
impl PyConnTransfer {
    /// True once the copy landed. Raises `KVLoadFailed` (load) or `RuntimeError` (offload) when it failed.
    fn is_complete(&self) -> PyResult<bool> {
        self.inner.is_complete().map_err(conn_err)
    }
    /// Block until the copy lands or fails.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        crate::gil::without_gil(py, || self.inner.synchronize()).map_err(conn_err)
    }
    /// `{leaf_id: [device block id, ...]}` pinned until complete (empty for loads).
    #[getter]
    fn g0_blocks_per_leaf<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (leaf, ids) in &self.pinned {
            d.set_item(leaf.as_str(), PyList::new(py, ids.iter().map(|b| b.0))?)?;
        }
        Ok(d)
    }
}

fn hash_of(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return BlockHash::from_bytes(b.as_bytes()).map_err(conn_err);
    }
    obj.extract::<u64>()
        .map(BlockHash::from_u64)
        .map_err(|_| PyValueError::new_err("block hashes are bytes (8 or 32) or ints < 2**64"))
}

fn hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    obj.try_iter()?.map(|h| hash_of(&h?)).collect()
}

fn per_leaf<T>(obj: &Bound<'_, PyAny>, f: impl Fn(&Bound<'_, PyAny>) -> PyResult<Vec<T>>) -> PyResult<PerLeaf<T>> {
    let d = obj.downcast::<PyDict>().map_err(|_| PyValueError::new_err("expected a dict {leaf_id: [...]}"))?;
    let mut out = BTreeMap::new();
    for (k, v) in d.iter() {
        out.insert(LeafId(k.extract()?), f(&v)?);
    }
    Ok(out)
}

fn block_ids(obj: &Bound<'_, PyAny>) -> PyResult<PerLeaf<BlockId>> {
    per_leaf(obj, |v| Ok(v.extract::<Vec<u32>>()?.into_iter().map(BlockId).collect()))
}

/// Base of the connectors, as MAX's `KVConnector` protocol.
#[pyclass(module = "kvwire", name = "KVConnector", subclass, frozen)]
pub struct PyConnector {
    inner: Arc<dyn KVConnector>,
}

#[pymethods]
impl PyConnector {
    /// Connector name for logs.
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }
    /// `{leaf_id: KVCacheGroupId}` served.
    #[getter]
    fn leaves<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (leaf, g) in self.inner.leaves() {
            d.set_item(leaf.as_str(), group_py(py, g)?)?;
        }
        Ok(d)
    }
    /// Presence only: `{leaf_id: [bool per hash]}`. `block_hashes` are bytes
    /// (8 big-endian or 32) in prefix order; `hint` is raw JSON bytes or None.
    #[pyo3(signature = (block_hashes, replica_idx=0, hint=None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        replica_idx: usize,
        hint: Option<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hs = hashes(block_hashes)?;
        let m = self.inner.lookup(&hs, replica_idx, hint.as_deref()).map_err(conn_err)?;
        let d = PyDict::new(py);
        for (leaf, mask) in m {
            d.set_item(leaf.0, PyList::new(py, mask)?)?;
        }
        Ok(d)
    }
    /// Read `block_hashes[leaf][i]` into device block `block_ids[leaf][i]`,
    /// all or nothing. Must follow a `lookup` with the same `replica_idx`
    /// and `hint`. Raises `KVLoadRefused` (nothing moved), `KVLoadFailed`, `ValueError`.
    #[pyo3(signature = (block_ids, block_hashes, replica_idx=0, hint=None))]
    fn load(
        &self,
        py: Python<'_>,
        block_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        replica_idx: usize,
        hint: Option<Vec<u8>>,
    ) -> PyResult<PyConnTransfer> {
        let ids = self::block_ids(block_ids)?;
        let hs = per_leaf(block_hashes, hashes)?;
        let inner = crate::gil::without_gil(py, || self.inner.load(&ids, &hs, replica_idx, hint.as_deref()))
            .map_err(conn_err)?;
        Ok(PyConnTransfer { inner, pinned: PerLeaf::new() })
    }
    /// Write device block `block_ids[leaf][i]` under `block_hashes[leaf][i]`;
    /// the handle's `g0_blocks_per_leaf` stay pinned until it lands.
    #[pyo3(signature = (block_ids, block_hashes, replica_idx=0))]
    fn offload(
        &self,
        py: Python<'_>,
        block_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        replica_idx: usize,
    ) -> PyResult<PyConnTransfer> {
        let ids = self::block_ids(block_ids)?;
        let hs = per_leaf(block_hashes, hashes)?;
        let t = crate::gil::without_gil(py, || self.inner.offload(&ids, &hs, replica_idx)).map_err(conn_err)?;
        let pinned = t.g0_blocks_per_leaf().clone();
        Ok(PyConnTransfer { inner: Box::new(t), pinned })
    }
    /// Refresh recency of blocks served from device memory (whole root-anchored sequence).
    #[pyo3(signature = (block_hashes, replica_idx=0))]
    fn touch(&self, block_hashes: &Bound<'_, PyAny>, replica_idx: usize) -> PyResult<()> {
        self.inner.touch(&hashes(block_hashes)?, replica_idx);
        Ok(())
    }
    /// Reclaim what settled transfers left behind.
    fn poll_transfers(&self) {
        self.inner.poll_transfers()
    }
    /// Finish in-flight copies and stop (idempotent).
    fn shutdown(&self, py: Python<'_>) {
        crate::gil::without_gil(py, || self.inner.shutdown())
    }
    /// Drop every block held.
    fn reset_prefix_cache(&self) {
        self.inner.reset_prefix_cache()
    }
    /// Metrics of the current window: a `kvwire.KVCacheMetrics` (MAX's dataclass).
    #[getter]
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        metrics_py(py, &self.inner.metrics())
    }
    /// Metrics of the current window, clearing its counters.
    /// The window also goes to the process's metrics registry (`kvwire.metrics_text()`).
    fn take_metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let m = self.inner.take_metrics();
        kvwire::metrics::global().add_connector_metrics(self.inner.name(), &m);
        metrics_py(py, &m)
    }
    /// Host tier occupancy: `kvwire.ByteCount(free, total)` (bytes).
    #[getter]
    fn host_byte_count<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.inner.host_byte_count();
        py.import("kvwire._max")?.getattr("ByteCount")?.call1((c.free, c.total))
    }
    /// Disk tier occupancy: kvwire has no disk tier, `ByteCount(0, 0)` (MAX's default).
    #[getter]
    fn disk_byte_count<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("kvwire._max")?.getattr("ByteCount")?.call1((0, 0))
    }
}

/// `kvwire.KVCacheMetrics(**fields)`: the Rust counters by MAX's names; the
/// fields Rust does not count keep the dataclass defaults.
fn metrics_py<'py>(py: Python<'py>, m: &kvwire::connector::KVCacheMetrics) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::to_string(m).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let fields = py.import("json")?.call_method1("loads", (text,))?;
    let kwargs = fields.downcast::<PyDict>()?;
    py.import("kvwire._max")?.getattr("KVCacheMetrics")?.call((), Some(kwargs))
}

fn leaves_arg(obj: Option<&Bound<'_, PyAny>>, default: &[String]) -> PyResult<BTreeMap<LeafId, KVCacheGroupId>> {
    let Some(obj) = obj else {
        return Ok(default.iter().map(|l| (LeafId(l.clone()), KVCacheGroupId::full())).collect());
    };
    let d = obj.downcast::<PyDict>().map_err(|_| PyValueError::new_err("leaves must be {leaf_id: KVCacheGroupId}"))?;
    let mut out = BTreeMap::new();
    for (k, v) in d.iter() {
        out.insert(LeafId(k.extract()?), group_of(&v)?);
    }
    Ok(out)
}

/// Host-memory tier of `capacity_bytes`, LRU by `(leaf, hash)`, copying on
/// a worker thread. `replicas[replica_idx]` maps each leaf id to its device
/// `KVCacheMemory`; a row is `host_bytes_per_page` bytes (replicated leaves
/// stored once, broadcast on load). `leaves` defaults to every leaf as a
/// full-attention group.
#[pyclass(module = "kvwire", name = "HostTierConnector", extends = PyConnector, frozen)]
pub struct PyHostTierConnector;

#[pymethods]
impl PyHostTierConnector {
    #[new]
    #[pyo3(signature = (replicas, capacity_bytes, leaves=None))]
    fn new(
        replicas: &Bound<'_, PyAny>,
        capacity_bytes: u64,
        leaves: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Self, PyConnector)> {
        let mut reps: Vec<BTreeMap<LeafId, Arc<dyn DevicePages>>> = Vec::new();
        for r in replicas.try_iter()? {
            let r = r?;
            let d = r
                .downcast::<PyDict>()
                .map_err(|_| PyValueError::new_err("replicas must be [{leaf_id: KVCacheMemory}]"))?;
            let mut m: BTreeMap<LeafId, Arc<dyn DevicePages>> = BTreeMap::new();
            for (k, v) in d.iter() {
                let mem = v
                    .downcast::<PyKVCacheMemory>()
                    .map_err(|_| PyValueError::new_err("values must be KVCacheMemory"))?;
                let pages = PyPages::new(mem.get().inner.clone());
                m.insert(LeafId(k.extract()?), Arc::new(pages));
            }
            reps.push(m);
        }
        let default: Vec<String> = reps.first().map(|m| m.keys().map(|k| k.0.clone()).collect()).unwrap_or_default();
        let leaves = leaves_arg(leaves, &default)?;
        let inner: Arc<dyn KVConnector> =
            Arc::new(HostTierConnector::new(leaves, reps, capacity_bytes).map_err(conn_err)?);
        Ok((PyHostTierConnector, PyConnector { inner }))
    }
}
