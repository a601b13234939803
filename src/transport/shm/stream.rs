//! Streaming (non-temporal) stores for the `shm` copy core: which
//! transfers use them, and the copy itself. Part of the copy core, where
//! `unsafe` is allowed (see the crate docs); each block says why it holds.

use std::sync::OnceLock;

/// Transfers cut into more than this many chunks ([`super::CHUNK_BYTES`]
/// each, so at least `threshold` bytes) are copied with streaming stores.
pub(super) fn streams(chunks: usize) -> bool {
    static CHUNKS: OnceLock<usize> = OnceLock::new();
    let limit = *CHUNKS.get_or_init(|| stream_threshold_bytes().div_ceil(super::CHUNK_BYTES) as usize);
    cfg!(target_arch = "x86_64") && chunks > limit
}

/// Bytes per transfer from which streaming stores pay: the size of the
/// largest CPU cache (sysfs), else [`FALLBACK_LLC_BYTES`].
///
/// Measured on the 2-vCPU EPYC guest (32 MiB L3, glibc 2.36, whose
/// `memcpy` streams only single copies of several MiB, never a 4 KiB–1 MiB
/// page), `kvwire bench --scatter`, 2 copy threads, streaming forced on or
/// off, interleaved runs on a machine under load 12–20 (docs/PERFORMANCE.md):
/// 2-thread copy of 256 MiB of scattered 4 KiB / 64 KiB pages, streaming
/// 1.0–1.6× `memcpy` (median 1.24×, 10 same-process pairs); kvwire with
/// streaming forced on / off, 3 pairs each: 1 MiB pages WRITE 1.4–1.85×,
/// READ 0.99–1.15×; 64 KiB WRITE 0.91–1.37×, READ 1.09–1.80×; 64 KiB pages
/// at 32 MiB per transfer (the L3) 1.1–1.3×; at 8 MiB (fits the L3) 0.88–2.9×,
/// i.e. noise — there cached stores keep the pages in the L3 for their reader.
fn stream_threshold_bytes() -> u64 {
    largest_cache_bytes().unwrap_or(FALLBACK_LLC_BYTES)
}

/// Last-level cache size assumed where sysfs does not say (bytes).
const FALLBACK_LLC_BYTES: u64 = 32 << 20;

fn largest_cache_bytes() -> Option<u64> {
    (0..8)
        .filter_map(|i| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok())
        .filter_map(|s| parse_cache_size(&s))
        .max()
}

/// `"32768K"` → 32 MiB, as sysfs writes cache sizes.
fn parse_cache_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, mul) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<u64>().ok()?.checked_mul(mul).filter(|&n| n > 0)
}

/// Copy `len` bytes, with streaming stores when `stream` (x86-64; elsewhere
/// a plain `memcpy`). After streaming, the caller fences ([`store_fence`])
/// before publishing that the bytes arrived.
///
/// # Safety
/// `src` is readable and `dst` writable for `len` bytes, and the two ranges
/// do not overlap.
pub(crate) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream {
        // SAFETY: forwarded from the caller.
        unsafe { stream_raw(src, dst, len) };
        return;
    }
    let _ = stream;
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copy `src` into `dst` (equal lengths) with non-temporal stores, then
/// fence, as the copy threads move transfers larger than the last-level
/// cache; a plain copy off x86-64. Public so that `kvwire bench` can measure
/// the same routine's N-thread ceiling.
///
/// # Panics
/// When the lengths differ.
pub fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_copy of slices of different lengths");
    // SAFETY: both slices are valid for their (equal) length, and a `&mut`
    // slice never overlaps a shared one.
    unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr(), src.len(), true) };
    store_fence();
}

/// Make this thread's streaming stores visible to other threads before
/// the stores (and atomics) that follow.
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` is part of SSE, which every x86-64 CPU has.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// The x86-64 streaming copy: the head up to a 64-byte aligned destination
/// and the tail with `memcpy`, the rest in 64-byte lines with unaligned
/// 16-byte loads and `movntdq` stores (SSE2, every x86-64 CPU; 32-byte AVX
/// stores were within the noise of it on this memory-bound loop).
///
/// # Safety
/// As [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_raw(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(64).min(len);
    // SAFETY: (the whole loop) every access is at an offset below `len`,
    // inside the caller's non-overlapping ranges; `dst + head` is 64-byte
    // aligned, so each `_mm_stream_si128` target is 16-byte aligned.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b, c, e) =
                (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("0K"), None);
        assert_eq!(parse_cache_size("lots"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    /// Every alignment of source and destination and lengths around the
    /// 64-byte line: the streaming copy moves exactly the bytes asked for.
    #[test]
    fn stream_copy_moves_every_byte_at_every_alignment() {
        let src: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0usize, 1, 15, 16, 63, 64, 65, 127, 128, 129, 300, 700] {
            for so in 0..17 {
                for d_off in [0usize, 1, 8, 16, 33, 63] {
                    let mut dst = vec![0xEEu8; 1024];
                    stream_copy(&mut dst[d_off..d_off + len], &src[so..so + len]);
                    assert_eq!(&dst[d_off..d_off + len], &src[so..so + len], "len {len} src+{so} dst+{d_off}");
                    assert!(dst[..d_off].iter().all(|&b| b == 0xEE), "wrote before the range");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xEE), "wrote past the range");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn stream_copy_refuses_unequal_lengths() {
        stream_copy(&mut [0u8; 4], &[0u8; 5]);
    }

    #[test]
    fn only_transfers_past_the_threshold_stream() {
        let limit = stream_threshold_bytes().div_ceil(super::super::CHUNK_BYTES) as usize;
        assert!(!streams(1));
        assert!(!streams(limit));
        assert_eq!(streams(limit + 1), cfg!(target_arch = "x86_64"));
    }
}
