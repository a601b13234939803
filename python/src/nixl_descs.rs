//! Descriptor lists for the NIXL core: little-endian `u64` rows as the
//! `nixl` package hands them over (`numpy.ndarray.tobytes()` of an `Nx2`,
//! `Nx3` or `Nx5` `uint64` array), and index lists (the bytes of an `int32`
//! or `int64` array, as the caller made it).
//!
//! No per-descriptor Python object is ever made: one `bytes` object crosses
//! per list, and parsing is a tight loop here.

use kvwire::engine::Desc;

/// Most descriptors one list may expand to (an `Nx5` row can name many
/// blocks): 2^26, 1 GiB of `Desc`s, far above vLLM's 10^5 per request.
pub const MAX_DESCS: u64 = 1 << 26;

fn words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes.chunks_exact(8).map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
}

/// Parse rows of `ncols` `u64`s: `(addr, len)`, `(addr, len, dev)` or NIXL
/// 1.5's strided `(addr, len, dev, stride, count)`, which stands for
/// `count` blocks of `len` bytes at `addr + i * stride` (vLLM 0.33's and
/// SGLang 0.5.23's `prep_xfer_dlist` input).
///
/// # Errors
/// A message naming the problem: a length that is no whole number of rows,
/// an unknown column count, an expansion past [`MAX_DESCS`], an address
/// overflow.
pub fn parse_rows(bytes: &[u8], ncols: usize) -> Result<Vec<Desc>, String> {
    if !matches!(ncols, 2 | 3 | 5) {
        return Err(format!("descriptor rows have {ncols} columns; expected 2, 3 or 5"));
    }
    let row = 8 * ncols;
    if !bytes.len().is_multiple_of(row) {
        return Err(format!("{} bytes is not a whole number of {ncols}-column u64 rows", bytes.len()));
    }
    let nrows = bytes.len() / row;
    if ncols != 5 {
        let mut out = Vec::with_capacity(nrows);
        for r in bytes.chunks_exact(row) {
            let mut w = words(r);
            let (addr, len) = (w.next().unwrap_or(0), w.next().unwrap_or(0));
            out.push(Desc::new(addr, len));
        }
        return Ok(out);
    }
    let mut total = 0u64;
    for r in bytes.chunks_exact(row) {
        total = total.saturating_add(words(&r[32..]).next().unwrap_or(0));
    }
    if total > MAX_DESCS {
        return Err(format!("strided rows expand to {total} descriptors; the limit is {MAX_DESCS}"));
    }
    let mut out = Vec::with_capacity(total as usize);
    for r in bytes.chunks_exact(row) {
        let w: Vec<u64> = words(r).collect();
        let (addr, len, stride, count) = (w[0], w[1], w[3], w[4]);
        for i in 0..count {
            let a = stride.checked_mul(i).and_then(|o| addr.checked_add(o)).ok_or_else(|| {
                format!("strided row at {addr:#x}: block {i} of stride {stride} overflows the address space")
            })?;
            out.push(Desc::new(a, len));
        }
    }
    Ok(out)
}

/// Number of indices in `bytes` of little-endian signed integers `width`
/// bytes wide (4: `int32`, 8: `int64`).
///
/// # Errors
/// A width other than 4 or 8, or a length that is no whole number of indices.
pub fn index_count(bytes: &[u8], width: usize) -> Result<usize, String> {
    if !matches!(width, 4 | 8) {
        return Err(format!("indices are {width} bytes wide; expected 4 (int32) or 8 (int64)"));
    }
    if !bytes.len().is_multiple_of(width) {
        return Err(format!("{} bytes is not a whole number of {width}-byte indices", bytes.len()));
    }
    Ok(bytes.len() / width)
}

/// `out = [descs[i] for i in idx]`, straight from the index bytes (`int32`
/// or `int64`, as the caller's numpy array holds them: no conversion or
/// intermediate list), refusing an index out of range.
///
/// # Errors
/// As [`index_count`], and an index that is negative or past the list.
pub fn gather(descs: &[Desc], idx: &[u8], width: usize, out: &mut Vec<Desc>) -> Result<(), String> {
    out.clear();
    out.reserve(index_count(idx, width)?);
    let mut push = |i: i64| -> Result<(), String> {
        let d = usize::try_from(i)
            .ok()
            .and_then(|i| descs.get(i))
            .ok_or_else(|| format!("index {i} is out of range for a list of {} descriptors", descs.len()))?;
        out.push(*d);
        Ok(())
    };
    if width == 4 {
        for c in idx.chunks_exact(4) {
            push(i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))?;
        }
    } else {
        for w in words(idx) {
            push(w as i64)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(v: &[u64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn parses_plain_and_strided_rows() {
        assert_eq!(
            parse_rows(&le(&[0x1000, 64, 0, 0x2000, 32, 0]), 3).unwrap(),
            vec![Desc::new(0x1000, 64), Desc::new(0x2000, 32)]
        );
        let v = parse_rows(&le(&[0x1000, 16, 0, 64, 3, 0x9000, 8, 0, 0, 1]), 5).unwrap();
        assert_eq!(v, vec![Desc::new(0x1000, 16), Desc::new(0x1040, 16), Desc::new(0x1080, 16), Desc::new(0x9000, 8)]);
        assert!(parse_rows(&le(&[1, 2, 3]), 2).is_err());
        assert!(parse_rows(&le(&[1, 2, 3, 4]), 4).is_err());
        assert!(parse_rows(&le(&[u64::MAX - 10, 1, 0, 8, 4]), 5).is_err());
        assert!(parse_rows(&le(&[0, 1, 0, 1, MAX_DESCS + 1]), 5).is_err());
    }

    #[test]
    fn gathers_by_index_and_refuses_out_of_range() {
        let d = [Desc::new(1, 1), Desc::new(2, 2), Desc::new(3, 3)];
        let mut out = Vec::new();
        gather(&d, &le(&[2, 0]), 8, &mut out).unwrap();
        assert_eq!(out, vec![Desc::new(3, 3), Desc::new(1, 1)]);
        let i32s: Vec<u8> = [1i32, 2, 0].iter().flat_map(|x| x.to_le_bytes()).collect();
        gather(&d, &i32s, 4, &mut out).unwrap();
        assert_eq!(out, vec![Desc::new(2, 2), Desc::new(3, 3), Desc::new(1, 1)]);
        assert!(gather(&d, &le(&[3]), 8, &mut out).is_err());
        assert!(gather(&d, &(-1i64).to_le_bytes(), 8, &mut out).is_err());
        assert!(gather(&d, &(-1i32).to_le_bytes(), 4, &mut out).is_err());
        assert!(gather(&d, &[0u8; 6], 4, &mut out).is_err());
        assert!(gather(&d, &[0u8; 8], 2, &mut out).is_err());
        assert_eq!(index_count(&[0u8; 12], 4), Ok(3));
    }
}
