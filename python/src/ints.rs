//! Python lists of ints read straight into `u64`s, for the batch calls that
//! take a list per column (Mooncake 0.3's `batch_transfer_sync_write(session,
//! buffers, peer_buffer_addresses, lengths)`): one borrowed item read and one
//! conversion per element, the three columns in one pass with no list of
//! their own in between (`bench/compare/mooncake_caller_cpu.py`, caller CPU
//! per page).
//!
//! The conversion is CPython's `PyLong_AsUnsignedLong` / `PyLong_AsLong`
//! where C `long` is 64 bits (Linux and macOS on 64-bit machines): both read
//! an int's digits in a loop, while CPython 3.11's `…LongLong` variants send
//! every int of more than one 30-bit digit (every virtual address) through
//! `_PyLong_AsByteArray`, which was 44 % of the caller CPU of a 65,536-page
//! batch. Same values, same `TypeError` / `OverflowError` on bad elements.

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// The last element read from one column and its value: a column that
/// repeats one int object (`[page_len] * n`, the usual lengths column)
/// converts it once. Python ints are immutable, so the same object has the
/// same value.
#[derive(Default)]
struct Memo {
    last: Option<(*mut ffi::PyObject, u64)>,
}

impl Memo {
    /// Element `i` of `list` as a `u64` (`signed`: as an `i64`,
    /// reinterpreted; the caller checks the sign).
    ///
    /// # Safety
    /// The GIL is held and `i` is below the length of `list`, read with the
    /// GIL held since the caller last ran Python code; every earlier read
    /// through this memo was of the same `list` with no Python code run
    /// since (the remembered object is one the list still holds).
    ///
    /// # Errors
    /// `TypeError` for an element that is not an int, `OverflowError` for
    /// one out of range (a negative value when not `signed`) — CPython's
    /// own messages.
    #[allow(unsafe_code)]
    unsafe fn read(&mut self, list: &Bound<'_, PyList>, i: usize, signed: bool) -> PyResult<u64> {
        // SAFETY: GIL held and `i` in range (the contract above).
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
        if item.is_null() {
            return Err(PyErr::fetch(list.py()));
        }
        // SAFETY: `item` is element `i` of `list`, just read (the contract
        // of `value` is this one's).
        unsafe { self.value(list, i, item, signed) }
    }

    /// The value of `item`, element `i` of `list`, as [`read`](Self::read).
    ///
    /// # Safety
    /// As [`read`](Self::read), and `item` is the non-null pointer
    /// `PyList_GetItem(list, i)` returned with no Python code run since.
    #[allow(unsafe_code)]
    unsafe fn value(
        &mut self,
        list: &Bound<'_, PyList>,
        i: usize,
        item: *mut ffi::PyObject,
        signed: bool,
    ) -> PyResult<u64> {
        if let Some((p, v)) = self.last
            && p == item
        {
            return Ok(v);
        }
        // SAFETY: per the contract above: a borrowed item the list keeps
        // alive; nothing here runs Python code that could shrink the list:
        // the int check comes before the conversions, which for an int (or
        // subclass) read its value without calling back. An exact int is
        // told by its type pointer alone (no `PyType_GetFlags` call).
        let (value, failed) = unsafe {
            if ffi::PyLong_CheckExact(item) == 0 && ffi::PyLong_Check(item) == 0 {
                let name = list.get_item(i)?.get_type().name()?.to_string();
                return Err(PyTypeError::new_err(format!("an integer is required (element {i} is {name})")));
            }
            if signed {
                let v = as_i64(item);
                (v as u64, v == -1 && !ffi::PyErr_Occurred().is_null())
            } else {
                let v = as_u64(item);
                (v, v == u64::MAX && !ffi::PyErr_Occurred().is_null())
            }
        };
        if failed {
            return Err(PyErr::fetch(list.py()));
        }
        self.last = Some((item, value));
        Ok(value)
    }
}

/// `PyLong_AsUnsignedLong` where C `unsigned long` holds a `u64`.
#[allow(unsafe_code)]
#[cfg(all(target_pointer_width = "64", not(windows)))]
unsafe fn as_u64(item: *mut ffi::PyObject) -> u64 {
    // SAFETY: `item` is a live int (checked by the caller, GIL held).
    unsafe { ffi::PyLong_AsUnsignedLong(item) as u64 }
}

/// `PyLong_AsUnsignedLongLong` where C `long` is 32 bits.
#[allow(unsafe_code)]
#[cfg(not(all(target_pointer_width = "64", not(windows))))]
unsafe fn as_u64(item: *mut ffi::PyObject) -> u64 {
    // SAFETY: `item` is a live int (checked by the caller, GIL held).
    unsafe { ffi::PyLong_AsUnsignedLongLong(item) }
}

/// `PyLong_AsLong` where C `long` holds an `i64`.
#[allow(unsafe_code)]
#[cfg(all(target_pointer_width = "64", not(windows)))]
unsafe fn as_i64(item: *mut ffi::PyObject) -> i64 {
    // SAFETY: `item` is a live int (checked by the caller, GIL held).
    unsafe { ffi::PyLong_AsLong(item) as i64 }
}

/// `PyLong_AsLongLong` where C `long` is 32 bits.
#[allow(unsafe_code)]
#[cfg(not(all(target_pointer_width = "64", not(windows))))]
unsafe fn as_i64(item: *mut ffi::PyObject) -> i64 {
    // SAFETY: `item` is a live int (checked by the caller, GIL held).
    unsafe { ffi::PyLong_AsLongLong(item) }
}

/// The elements of `list` as `u64`s (`signed`: as `i64`s, reinterpreted;
/// the caller checks the sign).
///
/// # Errors
/// As [`Memo::read`], for the first bad element.
pub(crate) fn list_u64(list: &Bound<'_, PyList>, signed: bool) -> PyResult<Vec<u64>> {
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    let mut memo = Memo::default();
    for i in 0..n {
        #[allow(unsafe_code)]
        // SAFETY: GIL held (`Bound`), `i < n`, one list for the memo, and no
        // Python code runs in this loop (`read` calls none for ints and
        // returns on others).
        out.push(unsafe { memo.read(list, i, signed) }?);
    }
    Ok(out)
}

/// Rows read per block by [`rows3`]: the items of a block are looked up and
/// their int objects prefetched before the first of them is converted.
const BLOCK: usize = 32;

/// Row `i` of three equally long lists, (unsigned, unsigned, signed), handed
/// to `row` in order, in one pass: Mooncake's `(buffers,
/// peer_buffer_addresses, lengths)` read without a vector per column.
///
/// The rows go in blocks of [`BLOCK`]: first the block's items of all three
/// lists are looked up and their int objects prefetched, then converted. A
/// batch's int objects are 96 bytes per row in CPython's heap, not in cache
/// after the pages themselves were filled or copied; a row's conversion
/// otherwise waits on each of its three objects in turn
/// (`bench/compare/mooncake_caller_cpu.py`, its cold rounds).
///
/// # Errors
/// `ValueError` naming the three lengths when they differ; as [`Memo::read`]
/// for the first bad element; whatever `row` returns.
pub(crate) fn rows3(
    a: &Bound<'_, PyList>,
    b: &Bound<'_, PyList>,
    c: &Bound<'_, PyList>,
    mut row: impl FnMut(u64, u64, i64) -> PyResult<()>,
) -> PyResult<()> {
    let n = a.len();
    if b.len() != n || c.len() != n {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "buffers ({n}), peer_buffer_addresses ({}) and lengths ({}) have different sizes",
            b.len(),
            c.len()
        )));
    }
    let (mut ma, mut mb, mut mc) = (Memo::default(), Memo::default(), Memo::default());
    let lists = [a, b, c];
    let mut items = [[std::ptr::null_mut::<ffi::PyObject>(); 3]; BLOCK];
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        for (i, row_items) in (start..end).zip(items.iter_mut()) {
            for (l, item) in lists.iter().zip(row_items.iter_mut()) {
                *item = item_prefetched(l, i)?;
            }
        }
        for (i, it) in (start..end).zip(items.iter()) {
            #[allow(unsafe_code)]
            // SAFETY: GIL held (`Bound`); `i < n`, the length of all three;
            // each item is what `PyList_GetItem` just returned for row `i`,
            // with no Python code run since (`row` is Rust); each memo reads
            // one list.
            let (x, y, z) = unsafe {
                (ma.value(a, i, it[0], false)?, mb.value(b, i, it[1], false)?, mc.value(c, i, it[2], true)? as i64)
            };
            row(x, y, z)?;
        }
        start = end;
    }
    Ok(())
}

/// Element `i` of `list` (borrowed), with a hint to the CPU to fetch its
/// object into cache; the hint has no effect on what is read later.
///
/// # Errors
/// `IndexError` for `i` past the end (callers stay below the length).
#[allow(unsafe_code)]
fn item_prefetched(list: &Bound<'_, PyList>, i: usize) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: GIL held (`Bound`); `PyList_GetItem` bounds-checks `i` and
    // returns a borrowed item or null with IndexError set.
    let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
    if item.is_null() {
        return Err(PyErr::fetch(list.py()));
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally and cannot fault.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(item.cast::<i8>());
    }
    Ok(item)
}
