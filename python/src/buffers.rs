//! Python buffers as registrable memory: any object with
//! `__array_interface__` (numpy arrays), `__dlpack__` (CPU torch tensors,
//! through `numpy.from_dlpack`) or the buffer protocol (`bytearray`,
//! writable `memoryview`, `mmap`), viewed as a 2-D `uint8`
//! `[num_pages, bytes_per_page]` array.

use std::sync::Arc;

use kvwire::kv::KvBuffer;
use kvwire::transport::{MemoryBacking, MemoryDesc, MemoryKind};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// Caller-owned host memory that keeps the Python object exporting it alive
/// for as long as any engine holds it registered (the engine holds an `Arc`
/// of the backing until it deregisters).
pub struct PyBacking {
    desc: MemoryDesc,
    _owner: Py<PyAny>,
}

// SAFETY: `desc` describes the writable buffer that `_owner` exports (checked
// when the view was made: not read-only, in bounds of its shape); holding
// `_owner` keeps the Python object, and with it the memory, alive for as
// long as this value lives.
unsafe impl MemoryBacking for PyBacking {
    fn desc(&self) -> MemoryDesc {
        self.desc
    }
}

/// What we learned of one Python buffer.
pub struct BufferView {
    /// Address of element 0.
    pub addr: u64,
    /// Shape in elements.
    pub shape: Vec<u64>,
    /// Strides in bytes (C order when the object gave none).
    pub strides: Vec<i64>,
    /// Bytes per element.
    pub itemsize: u64,
    /// `typestr` / struct format, for the dtype check.
    pub dtype: String,
    /// The object (or view) to keep alive.
    pub owner: Py<PyAny>,
}

fn c_strides(shape: &[u64], itemsize: u64) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = itemsize as i64;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc = acc.saturating_mul(shape[i] as i64);
    }
    s
}

fn from_array_interface(obj: &Bound<'_, PyAny>, ai: &Bound<'_, PyAny>) -> PyResult<BufferView> {
    let ai = ai.downcast::<PyDict>().map_err(|_| PyValueError::new_err("__array_interface__ is not a dict"))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        ai.get_item(k)?.ok_or_else(|| PyValueError::new_err(format!("__array_interface__ has no {k:?}")))
    };
    let data = get("data")?;
    let data = data.downcast::<PyTuple>().map_err(|_| PyValueError::new_err("buffer: data must be (ptr, readonly)"))?;
    let addr: u64 = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    if readonly {
        return Err(PyValueError::new_err("buffer is read-only; KV memory must be writable"));
    }
    let shape: Vec<u64> = get("shape")?.extract()?;
    let dtype: String = get("typestr")?.extract()?;
    let itemsize: u64 = dtype.get(2..).and_then(|s| s.parse().ok()).unwrap_or(0);
    let strides = match ai.get_item("strides")? {
        Some(s) if !s.is_none() => s.extract()?,
        _ => c_strides(&shape, itemsize),
    };
    Ok(BufferView { addr, shape, strides, itemsize, dtype, owner: obj.clone().unbind() })
}

fn from_buffer_protocol(obj: &Bound<'_, PyAny>) -> PyResult<BufferView> {
    let py = obj.py();
    let mv = py.import("builtins")?.getattr("memoryview")?.call1((obj,)).map_err(|_| {
        PyValueError::new_err(format!(
            "{} has neither __array_interface__, __dlpack__ nor the buffer protocol",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    if mv.getattr("readonly")?.extract::<bool>()? {
        return Err(PyValueError::new_err("buffer is read-only; KV memory must be writable"));
    }
    let shape: Vec<u64> = mv.getattr("shape")?.extract()?;
    let strides: Vec<i64> = mv.getattr("strides")?.extract()?;
    let itemsize: u64 = mv.getattr("itemsize")?.extract()?;
    let format: String = mv.getattr("format")?.extract()?;
    let dtype = if format == "B" { "|u1".to_string() } else { format };
    // ctypes gives the address of a writable buffer without leaving the limited API.
    let ctypes = py.import("ctypes")?;
    let anchor = ctypes.getattr("c_char")?.call_method1("from_buffer", (&mv,))?;
    let addr: u64 = ctypes.call_method1("addressof", (&anchor,))?.extract()?;
    // Keep the memoryview (which pins the export) and its anchor alive together.
    let owner = PyTuple::new(py, [obj.clone(), mv, anchor])?.into_any().unbind();
    Ok(BufferView { addr, shape, strides, itemsize, dtype, owner })
}

/// Describe any supported Python buffer object.
///
/// # Errors
/// `ValueError` when the object exports no usable host buffer or is read-only.
pub fn view_of(obj: &Bound<'_, PyAny>) -> PyResult<BufferView> {
    if let Ok(ai) = obj.getattr("__array_interface__") {
        return from_array_interface(obj, &ai);
    }
    if obj.hasattr("__dlpack__")? {
        let py = obj.py();
        if let Ok(np) = py.import("numpy") {
            let arr = np.getattr("from_dlpack")?.call1((obj,))?;
            let mut v = from_array_interface(&arr, &arr.getattr("__array_interface__")?)?;
            v.owner = PyTuple::new(py, [obj.clone(), arr])?.into_any().unbind();
            return Ok(v);
        }
    }
    from_buffer_protocol(obj)
}

/// A Python buffer as a [`KvBuffer`] whose shape and row stride are in bytes,
/// so that [`kvwire::kv::KVCacheMemory::new`] can reject it precisely.
///
/// # Errors
/// `ValueError`: not a host buffer, read-only, dtype not `uint8`, negative strides.
pub fn kv_buffer(obj: &Bound<'_, PyAny>) -> PyResult<KvBuffer> {
    let v = view_of(obj)?;
    if v.itemsize != 1 || !(v.dtype.ends_with("u1") || v.dtype == "B") {
        return Err(PyValueError::new_err(format!("KV buffers must be uint8, got dtype {:?}", v.dtype)));
    }
    if v.strides.iter().any(|&s| s < 0) {
        return Err(PyValueError::new_err("KV buffers must not have negative strides"));
    }
    // Extent in bytes: last element's offset + 1 (0 for an empty array).
    let len_bytes = if v.shape.contains(&0) {
        0
    } else {
        v.shape.iter().zip(&v.strides).map(|(&n, &s)| (n - 1) * s as u64).sum::<u64>() + 1
    };
    let row_stride_bytes = v.strides.first().copied().unwrap_or(1) as u64;
    let shape = v.shape.clone();
    let desc = MemoryDesc { addr: v.addr, len_bytes, kind: MemoryKind::Dram, device_id: 0 };
    let backing: Arc<dyn MemoryBacking> = Arc::new(PyBacking { desc, _owner: v.owner });
    if shape.len() == 2 && shape[1] > 1 && v.strides[1] != 1 {
        return Err(PyValueError::new_err(format!(
            "KV buffers must be contiguous: column stride {} bytes, expected 1",
            v.strides[1]
        )));
    }
    Ok(KvBuffer::with_layout(backing, 0, shape, row_stride_bytes))
}

/// [`kvwire::connector::DevicePages`] over Python-owned host buffers (no
/// shared fd): pages are copied with `memcpy` from/to the buffers, which
/// stay alive through the [`PyBacking`]s held by `mem`.
#[derive(Debug)]
pub struct PyPages {
    mem: kvwire::kv::KVCacheMemory,
}

impl PyPages {
    /// Pages of `mem`.
    pub fn new(mem: kvwire::kv::KVCacheMemory) -> Self {
        Self { mem }
    }

    fn page_addr(&self, shard: usize, page: kvwire::connector::BlockId, len: usize) -> std::io::Result<u64> {
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        let b = self.mem.buffers().get(shard).ok_or_else(|| invalid(format!("shard {shard} out of range")))?;
        if u64::from(page.0) >= b.num_pages() || len as u64 != b.bytes_per_page() {
            return Err(invalid(format!("page {} ({len} bytes) outside {:?}", page.0, b.shape())));
        }
        Ok(b.addr() + u64::from(page.0) * b.row_stride_bytes())
    }
}

impl kvwire::connector::DevicePages for PyPages {
    fn num_shards(&self) -> usize {
        self.mem.num_shards()
    }
    fn replicated(&self) -> bool {
        self.mem.replicated()
    }
    fn bytes_per_page(&self) -> usize {
        self.mem.bytes_per_page() as usize
    }
    fn num_pages(&self) -> usize {
        self.mem.total_num_pages() as usize
    }
    fn read_page(&self, shard: usize, page: kvwire::connector::BlockId, out: &mut [u8]) -> std::io::Result<()> {
        let addr = self.page_addr(shard, page, out.len())?;
        // SAFETY: `page_addr` checked that `[addr, addr + out.len())` is one
        // whole page inside a registered buffer, which the PyBacking in
        // `mem` keeps alive (its memory is owned by a live Python object);
        // `out` is a Rust buffer of our own, so the ranges do not overlap.
        // The connector moves a page only when no transfer uses it.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn write_page(&self, shard: usize, page: kvwire::connector::BlockId, data: &[u8]) -> std::io::Result<()> {
        let addr = self.page_addr(shard, page, data.len())?;
        // SAFETY: as in `read_page`; the buffer was checked writable when it
        // was wrapped (read-only buffers are refused).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }
}
