//! `TransferReqData` and page-index conversion.

use kvwire::kv::{PageIdxs, TransferReqData};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::kv_err;

/// Page indices from Python: `list[int]` (one list for every leaf) or
/// `dict[leaf_id, list[int]]`.
pub fn page_idxs(obj: &Bound<'_, PyAny>) -> PyResult<PageIdxs> {
    if let Ok(d) = obj.downcast::<PyDict>() {
        let mut out = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let leaf: String =
                k.extract().map_err(|_| PyValueError::new_err("page index keys must be leaf ids (str)"))?;
            let pages: Vec<u64> = v
                .extract()
                .map_err(|_| PyValueError::new_err(format!("pages of leaf {leaf:?} must be a list of ints >= 0")))?;
            out.push((leaf, pages));
        }
        return Ok(PageIdxs::PerLeaf(out));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyValueError::new_err("page indices must be list[int] or dict[str, list[int]], got str"));
    }
    let pages: Vec<u64> = obj
        .extract()
        .map_err(|_| PyValueError::new_err("page indices must be list[int] or dict[str, list[int]] of ints >= 0"))?;
    Ok(PageIdxs::Flat(pages))
}

fn idxs_to_py<'py>(py: Python<'py>, idxs: &PageIdxs) -> PyResult<Bound<'py, PyAny>> {
    Ok(match idxs {
        PageIdxs::Flat(v) => PyList::new(py, v)?.into_any(),
        PageIdxs::PerLeaf(m) => {
            let d = PyDict::new(py);
            for (k, v) in m {
                d.set_item(k, PyList::new(py, v)?)?;
            }
            d.into_any()
        }
    })
}

/// Metadata of one transfer request, as MAX's
/// `max.pipelines.kv_cache.TransferReqData` (a msgspec struct, `tag=True`,
/// `kw_only=True`, `omit_defaults=True`). Safe to send between threads and
/// processes: `to_json()` / `from_json()`, or pickle.
#[pyclass(module = "kvwire", name = "TransferReqData", eq, frozen)]
#[derive(Clone, PartialEq)]
pub struct PyTransferReqData {
    pub inner: TransferReqData,
}

#[pymethods]
impl PyTransferReqData {
    #[new]
    #[pyo3(signature = (*, dst_name, src_name, transfer_name, transfer_ids, src_idxs, dst_idxs,
        src_replica_idx, dst_replica_idx, is_read=false, tp_shard_count=0, local_shards_used=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        dst_name: String,
        src_name: String,
        transfer_name: String,
        transfer_ids: Vec<u64>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        src_replica_idx: usize,
        dst_replica_idx: usize,
        is_read: bool,
        tp_shard_count: usize,
        local_shards_used: Option<Vec<usize>>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: TransferReqData {
                dst_name,
                src_name,
                transfer_name,
                transfer_ids,
                src_idxs: page_idxs(src_idxs)?,
                dst_idxs: page_idxs(dst_idxs)?,
                src_replica_idx,
                dst_replica_idx,
                is_read,
                tp_shard_count,
                local_shards_used: local_shards_used.unwrap_or_default(),
            },
        })
    }

    /// Base name of the destination engine.
    #[getter]
    fn dst_name(&self) -> &str {
        &self.inner.dst_name
    }
    /// Base name of the source engine.
    #[getter]
    fn src_name(&self) -> &str {
        &self.inner.src_name
    }
    /// Transfer name (a UUID v4; also the notification payload).
    #[getter]
    fn transfer_name(&self) -> &str {
        &self.inner.transfer_name
    }
    /// One transfer handle per posted `(src_shard, dst_shard)` pair (initiator only).
    #[getter]
    fn transfer_ids(&self) -> Vec<u64> {
        self.inner.transfer_ids.clone()
    }
    /// Source page indices: `dict[leaf_id, list[int]]` (or `list[int]`).
    #[getter]
    fn src_idxs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        idxs_to_py(py, &self.inner.src_idxs)
    }
    /// Destination page indices: `dict[leaf_id, list[int]]` (or `list[int]`).
    #[getter]
    fn dst_idxs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        idxs_to_py(py, &self.inner.dst_idxs)
    }
    /// DP replica on the source engine.
    #[getter]
    fn src_replica_idx(&self) -> usize {
        self.inner.src_replica_idx
    }
    /// DP replica on the destination engine.
    #[getter]
    fn dst_replica_idx(&self) -> usize {
        self.inner.dst_replica_idx
    }
    /// True for a READ (pull) started by the destination.
    #[getter]
    fn is_read(&self) -> bool {
        self.inner.is_read
    }
    /// Shard requests posted; 0 = all shards.
    #[getter]
    fn tp_shard_count(&self) -> usize {
        self.inner.tp_shard_count
    }
    /// Initiator TP shard owning each `transfer_ids[i]`; empty = `0..n-1`.
    #[getter]
    fn local_shards_used(&self) -> Vec<usize> {
        self.inner.local_shards_used.clone()
    }

    /// The msgspec JSON form (compact `str`), byte-identical to
    /// `msgspec.json.encode(req).decode()` and to the Rust encoder.
    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    /// `to_json()` as UTF-8 `bytes` (what `msgspec.json.encode` returns).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.to_bytes())
    }

    /// Decode the msgspec JSON form (`str` or `bytes`).
    ///
    /// Raises `ValueError` on anything malformed.
    #[staticmethod]
    fn from_json(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let inner = if let Ok(s) = data.extract::<String>() {
            TransferReqData::from_json(&s)
        } else {
            let b: Vec<u8> = data.extract().map_err(|_| PyValueError::new_err("from_json takes str or bytes"))?;
            TransferReqData::from_bytes(&b)
        }
        .map_err(kv_err)?;
        Ok(Self { inner })
    }

    /// Same as `from_json`, for `bytes`.
    #[staticmethod]
    fn from_bytes(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        Self::from_json(data)
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        let ctor = slf.get_type().getattr("from_json")?;
        Ok((ctor, (slf.get().inner.to_json(),)))
    }

    fn __repr__(&self) -> String {
        format!("TransferReqData({})", self.inner.to_json())
    }
}
