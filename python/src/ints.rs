//! Python lists of ints read straight into `u64`s, for the batch calls that
//! take a list per column (Mooncake 0.3's `batch_transfer_sync_write(session,
//! buffers, peer_buffer_addresses, lengths)`): one borrowed item read and one
//! conversion per element, about a third of the cost of PyO3's generic
//! element extraction or of `array.array` (`bench/compare/mooncake_api_bench.py`,
//! caller CPU per page).

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// The elements of `list` as `u64`s (`signed`: as `i64`s, reinterpreted;
/// the caller checks the sign).
///
/// # Errors
/// `TypeError` for an element that is not an int, `OverflowError` for one
/// out of range (a negative value when not `signed`) — CPython's own
/// messages.
pub(crate) fn list_u64(list: &Bound<'_, PyList>, signed: bool) -> PyResult<Vec<u64>> {
    let py = list.py();
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        #[allow(unsafe_code)]
        // SAFETY: the GIL is held (`Bound`) and `list` is a live list; `i`
        // is below the length read above, and nothing in this loop runs
        // Python code that could shrink the list: `PyList_GetItem` returns a
        // borrowed, non-null item the list keeps alive, and the int check
        // comes before the conversions, which for an int (or subclass) read
        // its value without calling back into Python.
        let (value, failed) = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            if ffi::PyLong_Check(item) == 0 {
                let name = list.get_item(i)?.get_type().name()?.to_string();
                return Err(PyTypeError::new_err(format!("an integer is required (element {i} is {name})")));
            }
            if signed {
                let v = ffi::PyLong_AsLongLong(item);
                (v as u64, v == -1 && !ffi::PyErr_Occurred().is_null())
            } else {
                let v = ffi::PyLong_AsUnsignedLongLong(item);
                (v, v == u64::MAX && !ffi::PyErr_Occurred().is_null())
            }
        };
        if failed {
            return Err(PyErr::fetch(py));
        }
        out.push(value);
    }
    Ok(out)
}
