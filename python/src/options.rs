//! Transport `options=` as a Python user passes them.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString, PyTuple};

const TAKES: &str = "options takes a dict {\"key\": \"value\"}, \"key=value\" strings (one, or a list of them) \
                     or (key, value) pairs, e.g. options={\"conns_per_peer\": 4} or options=[\"conns_per_peer=4\"]";

/// A value as the transport reads it: a `str`, or an `int` written out.
fn value(key: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = v.downcast::<PyString>() {
        return Ok(s.to_cow()?.into_owned());
    }
    if v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>() {
        return Ok(v.str()?.to_cow()?.into_owned());
    }
    let ty = v.get_type().name()?;
    Err(PyTypeError::new_err(format!("option {key:?}: the value must be a str or an int, got {ty}")))
}

fn key(k: &Bound<'_, PyAny>) -> PyResult<String> {
    let Ok(s) = k.downcast::<PyString>() else {
        let ty = k.get_type().name()?;
        return Err(PyTypeError::new_err(format!("option keys must be str, got {ty}; {TAKES}")));
    };
    let s = s.to_cow()?;
    let s = s.trim();
    if s.is_empty() {
        return Err(PyValueError::new_err(format!("an option key is empty; {TAKES}")));
    }
    Ok(s.to_owned())
}

fn key_value(s: &str) -> PyResult<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(PyValueError::new_err(format!("option {s:?} is not key=value; {TAKES}"))),
    }
}

/// `options=`: `None`, a mapping `{key: value}`, one `"key=value"` string,
/// or an iterable of `"key=value"` strings and `(key, value)` pairs; values
/// are `str` or `int`. Raises `TypeError` / `ValueError` saying what it takes.
pub fn transport_options(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<(String, String)>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Vec::new()) };
    if let Ok(d) = obj.downcast::<PyDict>() {
        return d
            .iter()
            .map(|(k, v)| {
                let k = key(&k)?;
                Ok((k.clone(), value(&k, &v)?))
            })
            .collect();
    }
    if let Ok(s) = obj.downcast::<PyString>() {
        return Ok(vec![key_value(&s.to_cow()?)?]);
    }
    if obj.hasattr("keys")? && obj.hasattr("__getitem__")? {
        let mut out = Vec::new();
        for k in obj.call_method0("keys")?.try_iter()? {
            let k = k?;
            let v = obj.get_item(&k)?;
            let k = key(&k)?;
            out.push((k.clone(), value(&k, &v)?));
        }
        return Ok(out);
    }
    let Ok(items) = obj.try_iter() else {
        let ty = obj.get_type().name()?;
        return Err(PyTypeError::new_err(format!("{TAKES}; got {ty}")));
    };
    let mut out = Vec::new();
    for item in items {
        let item = item?;
        if let Ok(s) = item.downcast::<PyString>() {
            out.push(key_value(&s.to_cow()?)?);
        } else if let Ok(t) = item.downcast::<PyTuple>()
            && t.len() == 2
        {
            let k = key(&t.get_item(0)?)?;
            out.push((k.clone(), value(&k, &t.get_item(1)?)?));
        } else {
            let ty = item.get_type().name()?;
            return Err(PyTypeError::new_err(format!("an option is a {ty}; {TAKES}")));
        }
    }
    Ok(out)
}
