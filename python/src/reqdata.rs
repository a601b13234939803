//! `TransferReqData` and page-index conversion.

use kvwire::kv::msgspec::MsgInt;
use kvwire::kv::{PageIdxs, TransferReqData, WireIdxs, WireTransferReqData};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyType};

use crate::errors::kv_err;

/// Page indices an engine call takes: `dict[leaf_id, list[int]]`, or one
/// `list[int]` for every leaf.
///
/// Raises `ValueError` for a negative index (MAX: `"... must be between 0
/// and N-1"`) or anything that is not such a list or dict.
pub fn page_idxs(obj: &Bound<'_, PyAny>) -> PyResult<PageIdxs> {
    let w = wire_idxs(obj)?;
    let list = |leaf: &str, v: &[MsgInt]| -> PyResult<Vec<u64>> {
        v.iter()
            .map(|x| {
                u64::try_from(x.0).map_err(|_| {
                    PyValueError::new_err(format!("index {} of leaf {leaf:?} must be between 0 and 2^64-1", x.0))
                })
            })
            .collect()
    };
    Ok(match w {
        WireIdxs::Flat(v) => PageIdxs::Flat(list("*", &v)?),
        WireIdxs::PerLeaf(m) => {
            PageIdxs::PerLeaf(m.iter().map(|(k, v)| Ok((k.clone(), list(k, v)?))).collect::<PyResult<_>>()?)
        }
    })
}

fn ints(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<MsgInt>> {
    if obj.is_instance_of::<PyString>() {
        return Err(PyValueError::new_err(format!("{what} must be a list of ints, got str")));
    }
    let items = obj.try_iter().map_err(|_| PyValueError::new_err(format!("{what} must be a list of ints")))?;
    let mut out = Vec::new();
    for item in items {
        let item = item?;
        if item.is_instance_of::<pyo3::types::PyBool>() {
            return Err(PyValueError::new_err(format!("{what} must be a list of ints, got bool")));
        }
        match item.extract::<i128>() {
            Ok(x) => out.push(int(x, what)?),
            Err(_) if item.is_instance_of::<pyo3::types::PyInt>() => {
                return Err(PyValueError::new_err(format!(
                    "{what}: {item} is outside -2^63..2^64 (msgpack and 64-bit NIXL handles cannot carry it)"
                )));
            }
            Err(_) => {
                let ty = item.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
                return Err(PyValueError::new_err(format!("{what} must be a list of ints, got {ty}")));
            }
        }
    }
    Ok(out)
}

fn int(x: i128, what: &str) -> PyResult<MsgInt> {
    if (MsgInt::MIN..=MsgInt::MAX).contains(&x) {
        Ok(MsgInt(x))
    } else {
        Err(PyValueError::new_err(format!(
            "{what}: {x} is outside -2^63..2^64 (msgpack and 64-bit NIXL handles cannot carry it)"
        )))
    }
}

/// Page indices as a request holds them (negative values kept, as MAX's
/// msgspec struct keeps them).
pub fn wire_idxs(obj: &Bound<'_, PyAny>) -> PyResult<WireIdxs> {
    if let Ok(d) = obj.downcast::<PyDict>() {
        let mut out = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let leaf: String =
                k.extract().map_err(|_| PyValueError::new_err("page index keys must be leaf ids (str)"))?;
            let pages = ints(&v, &format!("pages of leaf {leaf:?}"))?;
            out.push((leaf, pages));
        }
        return Ok(WireIdxs::PerLeaf(out));
    }
    ints(obj, "page indices (list[int] or dict[str, list[int]])").map(WireIdxs::Flat)
}

fn idxs_to_py<'py>(py: Python<'py>, idxs: &WireIdxs) -> PyResult<Bound<'py, PyAny>> {
    let l = |v: &[MsgInt]| PyList::new(py, v.iter().map(|x| x.0));
    Ok(match idxs {
        WireIdxs::Flat(v) => l(v)?.into_any(),
        WireIdxs::PerLeaf(m) => {
            let d = PyDict::new(py);
            for (k, v) in m {
                d.set_item(k, l(v)?)?;
            }
            d.into_any()
        }
    })
}

fn bytes_arg(data: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    if let Ok(s) = data.downcast::<PyString>() {
        return Ok(s.extract::<String>()?.into_bytes());
    }
    if data.is_instance_of::<pyo3::types::PyInt>() {
        return Err(PyTypeError::new_err(format!("{what} takes bytes, bytearray, memoryview or str")));
    }
    data.extract::<Vec<u8>>()
        .or_else(|_| data.call_method0("__bytes__").and_then(|b| b.extract()))
        .map_err(|_| PyTypeError::new_err(format!("{what} takes bytes, bytearray, memoryview or str")))
}

/// `kvwire.TransferReqData`: the msgspec struct of `kvwire/_reqdata.py`, or
/// [`PyTransferReqData`] where msgspec is not installed.
fn req_class(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static CLASS: GILOnceCell<Py<PyType>> = GILOnceCell::new();
    CLASS.import(py, "kvwire", "TransferReqData")
}

/// An engine's record as a `kvwire.TransferReqData`.
pub fn req_py<'py>(py: Python<'py>, r: &TransferReqData) -> PyResult<Bound<'py, PyAny>> {
    let cls = req_class(py)?;
    if cls.is(&py.get_type::<PyTransferReqData>()) {
        return Ok(Bound::new(py, PyTransferReqData::from_core(r))?.into_any());
    }
    let w: WireTransferReqData = r.into();
    let kw = PyDict::new(py);
    kw.set_item("dst_name", &w.dst_name)?;
    kw.set_item("src_name", &w.src_name)?;
    kw.set_item("transfer_name", &w.transfer_name)?;
    kw.set_item("transfer_ids", w.transfer_ids.iter().map(|x| x.0).collect::<Vec<_>>())?;
    kw.set_item("src_idxs", idxs_to_py(py, &w.src_idxs)?)?;
    kw.set_item("dst_idxs", idxs_to_py(py, &w.dst_idxs)?)?;
    kw.set_item("src_replica_idx", w.src_replica_idx.0)?;
    kw.set_item("dst_replica_idx", w.dst_replica_idx.0)?;
    kw.set_item("is_read", w.is_read)?;
    kw.set_item("tp_shard_count", w.tp_shard_count.0)?;
    kw.set_item("local_shards_used", w.local_shards_used.iter().map(|x| x.0).collect::<Vec<_>>())?;
    cls.call((), Some(&kw))
}

fn field_int(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<MsgInt> {
    let v = obj.getattr(name)?;
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyValueError::new_err(format!("{name} must be an int, got bool")));
    }
    let x: i128 = v.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be an int in -2^63..2^64, got {}",
            v.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })?;
    int(x, name)
}

/// The engine's record of any `TransferReqData` (kvwire's msgspec struct,
/// the extension's class, or an object with the same attributes, such as
/// MAX's struct), with the checks MAX makes at use (`ValueError`).
pub fn core_of(obj: &Bound<'_, PyAny>) -> PyResult<TransferReqData> {
    if let Ok(r) = obj.downcast::<PyTransferReqData>() {
        return r.get().core();
    }
    let s = |name: &str| -> PyResult<String> {
        obj.getattr(name)?.extract().map_err(|_| PyValueError::new_err(format!("{name} must be a str")))
    };
    let is_read = obj.getattr("is_read")?;
    let wire = WireTransferReqData {
        dst_name: s("dst_name")?,
        src_name: s("src_name")?,
        transfer_name: s("transfer_name")?,
        transfer_ids: ints(&obj.getattr("transfer_ids")?, "transfer_ids")?,
        src_idxs: wire_idxs(&obj.getattr("src_idxs")?)?,
        dst_idxs: wire_idxs(&obj.getattr("dst_idxs")?)?,
        src_replica_idx: field_int(obj, "src_replica_idx")?,
        dst_replica_idx: field_int(obj, "dst_replica_idx")?,
        is_read: is_read.extract().map_err(|_| PyValueError::new_err("is_read must be a bool"))?,
        tp_shard_count: field_int(obj, "tp_shard_count")?,
        local_shards_used: ints(&obj.getattr("local_shards_used")?, "local_shards_used")?,
    };
    TransferReqData::try_from(&wire).map_err(kv_err)
}

/// Metadata of one transfer request, as MAX 26.7's
/// `max.pipelines.kv_cache.TransferReqData` (a msgspec struct, `tag=True`,
/// `kw_only=True`, `omit_defaults=True`). Holds what msgspec would hold
/// (a negative replica index, say); an engine refuses such values with
/// `ValueError` when handed the request. Safe to send between threads and
/// processes: `to_json()` / `to_msgpack()` and their `from_*`, or pickle.
#[pyclass(module = "kvwire", name = "TransferReqData", eq, frozen)]
#[derive(Clone, PartialEq)]
pub struct PyTransferReqData {
    pub wire: WireTransferReqData,
}

impl PyTransferReqData {
    /// Wrap an engine's record.
    pub fn from_core(r: &TransferReqData) -> Self {
        Self { wire: r.into() }
    }

    /// The engine's record, with the checks MAX makes at use (`ValueError`).
    pub fn core(&self) -> PyResult<TransferReqData> {
        TransferReqData::try_from(&self.wire).map_err(kv_err)
    }
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
        transfer_ids: &Bound<'_, PyAny>,
        src_idxs: &Bound<'_, PyAny>,
        dst_idxs: &Bound<'_, PyAny>,
        src_replica_idx: i128,
        dst_replica_idx: i128,
        is_read: bool,
        tp_shard_count: i128,
        local_shards_used: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(Self {
            wire: WireTransferReqData {
                dst_name,
                src_name,
                transfer_name,
                transfer_ids: ints(transfer_ids, "transfer_ids")?,
                src_idxs: wire_idxs(src_idxs)?,
                dst_idxs: wire_idxs(dst_idxs)?,
                src_replica_idx: int(src_replica_idx, "src_replica_idx")?,
                dst_replica_idx: int(dst_replica_idx, "dst_replica_idx")?,
                is_read,
                tp_shard_count: int(tp_shard_count, "tp_shard_count")?,
                local_shards_used: match local_shards_used {
                    Some(v) => ints(v, "local_shards_used")?,
                    None => Vec::new(),
                },
            },
        })
    }

    /// Base name of the destination engine.
    #[getter]
    fn dst_name(&self) -> &str {
        &self.wire.dst_name
    }
    /// Base name of the source engine.
    #[getter]
    fn src_name(&self) -> &str {
        &self.wire.src_name
    }
    /// Transfer name (a UUID v4; also the notification payload).
    #[getter]
    fn transfer_name(&self) -> &str {
        &self.wire.transfer_name
    }
    /// One transfer handle per posted `(src_shard, dst_shard)` pair (initiator only).
    #[getter]
    fn transfer_ids(&self) -> Vec<i128> {
        self.wire.transfer_ids.iter().map(|x| x.0).collect()
    }
    /// Source page indices: `dict[leaf_id, list[int]]` (or the `list[int]` given).
    #[getter]
    fn src_idxs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        idxs_to_py(py, &self.wire.src_idxs)
    }
    /// Destination page indices: `dict[leaf_id, list[int]]` (or the `list[int]` given).
    #[getter]
    fn dst_idxs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        idxs_to_py(py, &self.wire.dst_idxs)
    }
    /// DP replica on the source engine.
    #[getter]
    fn src_replica_idx(&self) -> i128 {
        self.wire.src_replica_idx.0
    }
    /// DP replica on the destination engine.
    #[getter]
    fn dst_replica_idx(&self) -> i128 {
        self.wire.dst_replica_idx.0
    }
    /// True for a READ (pull) started by the destination.
    #[getter]
    fn is_read(&self) -> bool {
        self.wire.is_read
    }
    /// Shard requests posted; 0 = all shards.
    #[getter]
    fn tp_shard_count(&self) -> i128 {
        self.wire.tp_shard_count.0
    }
    /// Initiator TP shard owning each `transfer_ids[i]`; empty = `0..n-1`.
    #[getter]
    fn local_shards_used(&self) -> Vec<i128> {
        self.wire.local_shards_used.iter().map(|x| x.0).collect()
    }

    /// The msgspec JSON form (compact `str`): `msgspec.json.encode(req).decode()`.
    fn to_json(&self) -> String {
        self.wire.to_json()
    }

    /// `to_json()` as UTF-8 `bytes` (what `msgspec.json.encode` returns).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.wire.to_json().as_bytes())
    }

    /// The msgpack form, byte-identical to `msgspec.msgpack.encode(req)`
    /// (what MAX's ZMQ sockets carry).
    fn to_msgpack<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.wire.to_msgpack())
    }

    /// Decode the msgspec JSON form (`str` or bytes-like), accepting what
    /// `msgspec.json.decode(data, type=TransferReqData)` accepts.
    ///
    /// Raises `kvwire.DecodeError` (malformed, truncated, trailing data) or
    /// `kvwire.ValidationError` (a wrong type or tag, a missing field);
    /// both are `ValueError`s.
    #[staticmethod]
    fn from_json(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let b = bytes_arg(data, "from_json")?;
        Ok(Self { wire: WireTransferReqData::from_json(&b).map_err(kv_err)? })
    }

    /// Same as `from_json`.
    #[staticmethod]
    fn from_bytes(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        Self::from_json(data)
    }

    /// Decode the msgpack form (`msgspec.msgpack.decode(data, type=TransferReqData)`).
    /// Raises as `from_json`.
    #[staticmethod]
    fn from_msgpack(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let b = bytes_arg(data, "from_msgpack")?;
        Ok(Self { wire: WireTransferReqData::from_msgpack(&b).map_err(kv_err)? })
    }

    /// Pickles through `kvwire._rebuild_req(fields)` (the constructor's
    /// keywords), so every value the constructor took survives.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyDict>,))> {
        let py = slf.py();
        let me = slf.get();
        let d = PyDict::new(py);
        d.set_item("dst_name", me.dst_name())?;
        d.set_item("src_name", me.src_name())?;
        d.set_item("transfer_name", me.transfer_name())?;
        d.set_item("transfer_ids", me.transfer_ids())?;
        d.set_item("src_idxs", me.src_idxs(py)?)?;
        d.set_item("dst_idxs", me.dst_idxs(py)?)?;
        d.set_item("src_replica_idx", me.src_replica_idx())?;
        d.set_item("dst_replica_idx", me.dst_replica_idx())?;
        d.set_item("is_read", me.is_read())?;
        d.set_item("tp_shard_count", me.tp_shard_count())?;
        d.set_item("local_shards_used", me.local_shards_used())?;
        Ok((py.import("kvwire")?.getattr("_rebuild_req")?, (d,)))
    }

    fn __repr__(&self) -> String {
        format!("TransferReqData({})", self.wire.to_json())
    }
}
