//! `HostBuffer`: page-aligned host memory backed by a memfd, so a same-host
//! peer can map it and a transfer becomes one `memcpy`.

use std::fs::File;
use std::io;
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
    /// `InvalidInput` for a zero length.
    pub fn new(len_bytes: usize) -> io::Result<Self> {
        if len_bytes == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "HostBuffer of 0 bytes"));
        }
        let fd = memfd_create("kvwire-host-buffer", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(io::Error::from)?;
        let file = File::from(fd);
        // Whole pages, so that the memfd handed to peers holds exactly this
        // buffer; sealed so that no holder of the fd can shrink it (SIGBUS
        // at our next access), grow it, or change the seals.
        file.set_len((len_bytes as u64).div_ceil(4096) * 4096)?;
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

    /// The bytes. Contents written by an in-progress transfer may change
    /// underneath; read only after the transfer completed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len_bytes` long, readable, and lives as long
        // as `self`; other writers are transfers the caller has waited for.
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

    /// A copy of `len` bytes at `offset`.
    ///
    /// # Panics
    /// When the range exceeds the buffer.
    pub fn to_vec(&self, offset: usize, len: usize) -> Vec<u8> {
        let end = offset.checked_add(len).expect("offset overflow");
        assert!(end <= self.len_bytes, "read of {offset}..{end} past a {}-byte HostBuffer", self.len_bytes);
        let mut out = vec![0u8; len];
        // SAFETY: bounds checked; the mapping is readable and does not
        // overlap `out`, a fresh allocation.
        unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr().add(offset), out.as_mut_ptr(), len) };
        out
    }

    /// Let `f` write `len` bytes at `offset` in place (no staging copy).
    ///
    /// # Safety
    /// While `f` runs, nothing else may read or write the range: no transfer
    /// that reads or writes it is in progress (local or remote), and no
    /// other slice of it (from [`HostBuffer::as_slice`] or another
    /// `write_with`) is alive.
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
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.write(9_990, &[7; 10]);
        assert_eq!(&b.as_slice()[9_990..], &[7; 10]);
        b.fill_with(0, 4, |i| i as u8 + 1);
        assert_eq!(&b.as_slice()[..4], &[1, 2, 3, 4]);
        assert!(HostBuffer::new(0).is_err());
    }

    #[test]
    #[should_panic(expected = "past a")]
    fn write_out_of_bounds_panics() {
        HostBuffer::new(16).unwrap().write(10, &[0; 7]);
    }
}
