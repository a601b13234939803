//! `HostBuffer`: page-aligned host memory backed by a memfd, so a same-host
//! peer can map it and a transfer becomes one `memcpy`.

use std::fs::File;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::os::fd::{AsFd, BorrowedFd};

use memmap2::{MmapOptions, MmapRaw};
use nix::sys::memfd::{MFdFlags, memfd_create};

use crate::transport::{MemoryBacking, MemoryDesc, MemoryKind};

/// Host memory (`len_bytes` bytes, page-aligned, zero-filled) that kvwire can
/// share with same-host peers through its memfd.
///
/// Transfers write into it from other threads or processes: read it only
/// when no transfer that targets it is in progress (as with any RDMA buffer).
pub struct HostBuffer {
    file: File,
    map: MmapRaw,
    len_bytes: usize,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl HostBuffer {
    /// Allocate `len_bytes` of shared, pre-faulted, zeroed host memory.
    ///
    /// # Errors
    /// The failing call (`memfd_create`, `ftruncate`, `mmap`) as an I/O error;
    /// `InvalidInput` for a zero length; `FileTooLarge` when the buffer
    /// exceeds the process's `RLIMIT_FSIZE` (instead of dying of SIGXFSZ).
    pub fn new(len_bytes: usize) -> io::Result<Self> {
        if len_bytes == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "HostBuffer of 0 bytes"));
        }
        let fd = memfd_create("kvwire-host-buffer", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(io::Error::from)?;
        let file = File::from(fd);
        let size = (len_bytes as u64).div_ceil(4096) * 4096;
        // A memfd counts against RLIMIT_FSIZE: past it `ftruncate` raises
        // SIGXFSZ, which kills the process by default. Check first, so the
        // caller gets an error instead (issue 27).
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one rlimit into a live local.
        if unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim) } == 0
            && lim.rlim_cur != libc::RLIM_INFINITY
            && size > lim.rlim_cur
        {
            return Err(io::Error::new(
                io::Error::from_raw_os_error(libc::EFBIG).kind(),
                format!(
                    "HostBuffer of {len_bytes} bytes exceeds this process's file-size limit (RLIMIT_FSIZE, {} bytes): \
                     its memfd could not be sized (EFBIG)",
                    lim.rlim_cur
                ),
            ));
        }
        // Whole pages, so that the memfd handed to peers holds exactly this
        // buffer; sealed so that no holder of the fd can shrink it (SIGBUS
        // at our next access), grow it, or change the seals.
        file.set_len(size)?;
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        fcntl(&file, FcntlArg::F_ADD_SEALS(seals)).map_err(io::Error::from)?;
        let map = MmapOptions::new().len(len_bytes).populate().map_raw(&file)?;
        Ok(Self { file, map, len_bytes })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len_bytes
    }

    /// Always false: a `HostBuffer` is never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes as a shared slice, without copying.
    ///
    /// There is no safe way to borrow a `HostBuffer`'s bytes from `&self`:
    /// a registered buffer is written by transfers (other threads, a peer
    /// process, a NIC) that a `&[u8]` would alias. Read with
    /// [`HostBuffer::to_vec`] or [`HostBuffer::copy_to`] (a copy through raw
    /// pointers), or [`HostBuffer::as_mut_slice`] with `&mut self`.
    ///
    /// # Safety
    /// While the returned slice lives, nothing writes the buffer: no
    /// transfer that writes into it (local or from a peer) is in progress or
    /// will start, no [`HostBuffer::write`], [`HostBuffer::fill_with`] or
    /// [`HostBuffer::write_with`] runs on it, and no peer process maps it
    /// writably and writes (a `shm` peer it is registered with may).
    pub unsafe fn as_slice_unchecked(&self) -> &[u8] {
        // SAFETY: the mapping is `len_bytes` long, readable, and lives as long
        // as `self`; the absence of writers is the caller's obligation.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.len_bytes) }
    }

    /// Copy `data` into the buffer at `offset`.
    ///
    /// # Panics
    /// When `offset + data.len()` exceeds the buffer.
    pub fn write(&self, offset: usize, data: &[u8]) {
        let end = offset.checked_add(data.len()).expect("offset overflow");
        assert!(end <= self.len_bytes, "write of {}..{end} past a {}-byte HostBuffer", offset, self.len_bytes);
        // SAFETY: bounds checked above; the mapping is writable and does not
        // overlap `data`, which is a Rust slice of other memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.as_mut_ptr().add(offset), data.len()) }
    }

    /// Fill `len` bytes at `offset` with `f(i)` for the i-th byte of the range.
    /// Writes through the raw mapping, one byte at a time; no reference to
    /// the buffer's bytes is formed (a transfer may run meanwhile: the bytes
    /// it moves are then unspecified, as with any RDMA buffer).
    ///
    /// # Panics
    /// When the range exceeds the buffer.
    pub fn fill_with(&self, offset: usize, len: usize, mut f: impl FnMut(usize) -> u8) {
        let end = offset.checked_add(len).expect("offset overflow");
        assert!(end <= self.len_bytes, "write of {offset}..{end} past a {}-byte HostBuffer", self.len_bytes);
        let base = self.map.as_mut_ptr();
        for i in 0..len {
            // SAFETY: `offset + i < len_bytes` (checked above): inside the
            // writable mapping, which lives as long as `self`.
            unsafe { base.add(offset + i).write(f(i)) };
        }
    }

    /// The bytes, mutably: `&mut self` proves no other reference exists
    /// (a registered buffer is shared through an `Arc`; use
    /// [`HostBuffer::write_with`] or the copying methods there).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len_bytes` long, writable, lives as long as
        // `self`, and `&mut self` excludes every other reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr(), self.len_bytes) }
    }

    /// A copy of the bytes in `range` (`..` for all of them), read through
    /// the raw mapping: no reference to the buffer's bytes is formed, so a
    /// transfer may run meanwhile (the bytes it moves are then unspecified).
    ///
    /// # Panics
    /// When the range exceeds the buffer.
    pub fn to_vec(&self, range: impl RangeBounds<usize>) -> Vec<u8> {
        let (offset, len) = self.range(range);
        let mut out = vec![0u8; len];
        self.copy_to(offset, &mut out);
        out
    }

    /// Copy `out.len()` bytes at `offset` into `out` (a reused scratch buffer
    /// on hot paths: no allocation), as [`HostBuffer::to_vec`] does.
    ///
    /// # Panics
    /// When `offset + out.len()` exceeds the buffer.
    pub fn copy_to(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len(), "read");
        // SAFETY: bounds checked; the mapping is readable and lives as long
        // as `self`; `out` is a `&mut` slice, so it is not the mapping of
        // this buffer (that is never handed out while `&self` is borrowed).
        unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
    }

    /// Fold the `words` little-endian `u64` words at `offset` into `acc`
    /// with `f(acc, word_index, word)`, read through the raw mapping as
    /// [`HostBuffer::copy_to`] reads (no reference into the buffer is formed;
    /// words a running transfer moves are unspecified): verifying a landed
    /// page in one pass over memory, where a copy first made the main job's
    /// verification 28 % slower (`kvwire replay`, 84 → 107 s, A/B on a quiet
    /// 2-vCPU guest).
    ///
    /// # Panics
    /// When `offset + 8 * words` exceeds the buffer.
    pub fn fold_words<A>(&self, offset: usize, words: usize, mut acc: A, mut f: impl FnMut(A, u64, u64) -> A) -> A {
        let len = words.checked_mul(8).expect("length overflow");
        self.check(offset, len, "read");
        // SAFETY: bounds checked; the mapping is readable and lives as long as `self`.
        let base = unsafe { self.map.as_ptr().add(offset) };
        for k in 0..words {
            // SAFETY: `k * 8 + 8 <= len`, inside the checked range; unaligned read of plain bytes.
            let w = unsafe { base.add(k * 8).cast::<u64>().read_unaligned() };
            acc = f(acc, k as u64, u64::from_le(w));
        }
        acc
    }

    /// As [`HostBuffer::copy_to`], with the `shm` copy core's streaming
    /// stores into `out` (x86-64; elsewhere a plain copy): what the shm
    /// transport's large copies do, for measuring the copy ceiling.
    ///
    /// # Panics
    /// When `offset + out.len()` exceeds the buffer.
    pub fn stream_copy_to(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len(), "read");
        // SAFETY: as in `copy_to`: the source range is inside the live,
        // readable mapping and does not overlap the `&mut` destination.
        unsafe { super::stream::copy_bytes(self.map.as_ptr().add(offset), out.as_mut_ptr(), out.len(), true) };
        super::stream::store_fence();
    }

    /// Whether the bytes at `offset` equal `expected`, compared through a
    /// copy into a small stack buffer (no reference into the mapping, no
    /// allocation).
    ///
    /// # Panics
    /// When `offset + expected.len()` exceeds the buffer.
    pub fn eq_at(&self, offset: usize, expected: &[u8]) -> bool {
        self.check(offset, expected.len(), "read");
        let mut chunk = [0u8; 4096];
        expected.chunks(chunk.len()).enumerate().all(|(i, want)| {
            let got = &mut chunk[..want.len()];
            self.copy_to(offset + i * 4096, got);
            got == want
        })
    }

    fn range(&self, range: impl RangeBounds<usize>) -> (usize, usize) {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.checked_add(1).expect("offset overflow"),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1).expect("offset overflow"),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len_bytes,
        };
        assert!(start <= end, "read of {start}..{end}: start after end");
        self.check(start, end - start, "read");
        (start, end - start)
    }

    fn check(&self, offset: usize, len: usize, what: &str) {
        let end = offset.checked_add(len).expect("offset overflow");
        assert!(end <= self.len_bytes, "{what} of {offset}..{end} past a {}-byte HostBuffer", self.len_bytes);
    }

    /// Let `f` write `len` bytes at `offset` in place (no staging copy).
    ///
    /// # Safety
    /// While `f` runs, nothing else may read or write the range: no transfer
    /// that reads or writes it is in progress (local or remote), and no
    /// other slice of it (from [`HostBuffer::as_slice_unchecked`] or
    /// another `write_with`) is alive.
    ///
    /// # Panics
    /// When the range exceeds the buffer.
    pub unsafe fn write_with<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let end = offset.checked_add(len).expect("offset overflow");
        assert!(end <= self.len_bytes, "write of {offset}..{end} past a {}-byte HostBuffer", self.len_bytes);
        // SAFETY: bounds checked; the mapping is writable and lives as long as
        // `self`; exclusive use of the range while `f` runs is the caller's
        // obligation (this function's contract).
        let s = unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset), len) };
        f(s)
    }
}

// SAFETY: the mapping `[addr, addr + len_bytes)` is created in `new` and
// unmapped only when the HostBuffer drops; `map` is never remapped; the
// memfd is the file it maps, from offset 0, sealed against shrinking.
unsafe impl MemoryBacking for HostBuffer {
    fn desc(&self) -> MemoryDesc {
        MemoryDesc { addr: self.addr(), len_bytes: self.len_bytes as u64, kind: MemoryKind::Dram, device_id: 0 }
    }

    fn shared_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        Some((self.file.as_fd(), 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_zeroed_page_aligned_memory() {
        let b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.addr() % 4096, 0);
        assert!(b.to_vec(..).iter().all(|&x| x == 0));
        b.write(9_990, &[7; 10]);
        assert_eq!(b.to_vec(9_990..), [7; 10]);
        b.fill_with(0, 4, |i| i as u8 + 1);
        assert_eq!(b.to_vec(..4), [1, 2, 3, 4]);
        assert_eq!(b.to_vec(1..=2), [2, 3]);
        assert!(HostBuffer::new(0).is_err());
    }

    #[test]
    fn reads_copy_compare_and_stream_without_borrowing_the_mapping() {
        let b = HostBuffer::new(3 * 4096 + 100).unwrap();
        b.fill_with(0, b.len(), |i| (i % 251) as u8);
        let want: Vec<u8> = (0..b.len()).map(|i| (i % 251) as u8).collect();
        let mut out = vec![0u8; 9000];
        b.copy_to(77, &mut out);
        assert_eq!(out, want[77..9077]);
        out.fill(0);
        b.stream_copy_to(77, &mut out);
        assert_eq!(out, want[77..9077]);
        assert!(b.eq_at(0, &want));
        assert!(b.eq_at(4095, &want[4095..8300]));
        assert!(!b.eq_at(1, &want[..5000]));
        assert!(b.eq_at(b.len(), &[]));
        // SAFETY: no transfer or other writer touches `b` while `s` lives.
        let s = unsafe { b.as_slice_unchecked() };
        assert_eq!(s, &want[..]);
        let mut m = HostBuffer::new(8).unwrap();
        m.as_mut_slice().copy_from_slice(b"12345678");
        assert_eq!(m.to_vec(2..4), b"34");
    }

    #[test]
    #[should_panic(expected = "past a")]
    fn read_out_of_bounds_panics() {
        HostBuffer::new(16).unwrap().to_vec(8..17);
    }

    #[test]
    #[should_panic(expected = "past a")]
    fn compare_out_of_bounds_panics() {
        HostBuffer::new(16).unwrap().eq_at(10, &[0; 7]);
    }

    #[test]
    #[should_panic(expected = "past a")]
    fn write_out_of_bounds_panics() {
        HostBuffer::new(16).unwrap().write(10, &[0; 7]);
    }
}
