//! `HostBuffer`: page-aligned host memory backed by a memfd, so a same-host
//! peer can map it and a transfer becomes one `memcpy`.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::{LazyLock, Mutex, MutexGuard};

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
    /// exceeds the process's `RLIMIT_FSIZE` (instead of dying of SIGXFSZ);
    /// `OutOfMemory` when it exceeds [`available_host_bytes`] (its pages are
    /// faulted in at once, so past that the kernel's OOM killer would answer
    /// instead of an error).
    pub fn new(len_bytes: usize) -> io::Result<Self> {
        if len_bytes == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "HostBuffer of 0 bytes"));
        }
        check_room((len_bytes as u64).div_ceil(4096) * 4096, len_bytes, available_host_bytes())?;
        let fd = memfd_create("kvwire-host-buffer", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(io::Error::from)?;
        let file = File::from(fd);
        let size = (len_bytes as u64).div_ceil(4096) * 4096;
        // A memfd counts against RLIMIT_FSIZE: past it `ftruncate` raises
        // SIGXFSZ, which kills the process by default. Check first, so the
        // caller gets an error instead (issue 27).
        check_fsize(size, len_bytes)?;
        // Whole pages, so that the memfd handed to peers holds exactly this
        // buffer; sealed so that no holder of the fd can shrink it (SIGBUS
        // at our next access), grow it, or change the seals.
        file.set_len(size)?;
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        fcntl(&file, FcntlArg::F_ADD_SEALS(seals)).map_err(io::Error::from)?;
        let map = MmapOptions::new().len(len_bytes).populate().map_raw(&file)?;
        let this = Self { file, map, len_bytes };
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        lock_live().insert(this.file.as_raw_fd(), Live { id, addr: this.addr(), len_bytes, exported: false });
        Ok(this)
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

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // First, under the lock: a re-homing in progress (which holds the
        // lock) finishes before the mapping and the memfd go.
        lock_live().remove(&self.file.as_raw_fd());
    }
}

/// A live `HostBuffer`, by the number of its memfd descriptor (stable for
/// the buffer's life: re-homing replaces the file behind it with `dup3`).
struct Live {
    /// Unique per buffer (a descriptor number is reused once closed).
    id: u64,
    addr: u64,
    len_bytes: usize,
    /// Handed to one `shm` registration ([`ExportClaim`]).
    exported: bool,
}

/// Every live `HostBuffer` of this process. Re-homing runs under this lock,
/// so a buffer cannot be dropped (or claimed twice) meanwhile.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
static LIVE: LazyLock<Mutex<HashMap<RawFd, Live>>> = LazyLock::new(Mutex::default);

fn lock_live() -> MutexGuard<'static, HashMap<RawFd, Live>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The right of one `shm` registration to hand a [`HostBuffer`]'s memfd to
/// peers and to re-home the buffer when the registration ends
/// (issue 27 item 4). At most one claim per buffer exists at a time: a
/// second registration of the same buffer is reached by cross-memory attach
/// (or refused with `cma=deny`), because re-homing for one registration
/// would cut off the peers of another that shares the memfd.
#[derive(Debug)]
pub(crate) struct ExportClaim {
    fd: RawFd,
    id: u64,
}

impl ExportClaim {
    /// Claim `fd` (a backing's `shared_fd`, at offset 0) for export when it
    /// is the memfd of a live `HostBuffer` mapped exactly at `[addr, addr +
    /// len_bytes)` that no other registration has claimed; `None` otherwise
    /// (memory kvwire did not allocate, whose pages it cannot move).
    pub(crate) fn claim(fd: BorrowedFd<'_>, addr: u64, len_bytes: u64) -> Option<Self> {
        let mut live = lock_live();
        let e = live.get_mut(&fd.as_raw_fd())?;
        if e.exported || e.addr != addr || e.len_bytes as u64 != len_bytes {
            return None;
        }
        e.exported = true;
        Some(Self { fd: fd.as_raw_fd(), id: e.id })
    }

    /// End the claim without moving anything: the registration ends and no
    /// peer was ever handed the memfd, or the buffer is being freed.
    pub(crate) fn release(self) {
        if let Some(e) = lock_live().get_mut(&self.fd).filter(|e| e.id == self.id) {
            e.exported = false;
        }
    }

    /// Re-home the buffer (issue 27 item 4): copy its pages into a fresh
    /// sealed memfd, move that mapping over the buffer's address with
    /// `mremap(MREMAP_FIXED)` (one atomic replacement: the owner's pointer
    /// stays valid and keeps its contents), make the buffer's descriptor
    /// refer to the new file (`dup3` onto the same number), and punch every
    /// page out of `old` (the memfd peers were handed; this `old` is the
    /// registration's duplicate of it). A peer that kept a mapping of `old`
    /// then reads zeros and writes into pages nobody else maps.
    ///
    /// The caller (shm `deregister`) guarantees that no kvwire transfer uses
    /// the buffer; writes the owner itself makes while this runs may be lost
    /// (`docs/SECURITY.md`).
    ///
    /// # Errors
    /// The failing call before the mapping moved (`fstat`, `memfd_create`,
    /// `ftruncate` or `RLIMIT_FSIZE`, `fallocate` of the new pages (memory
    /// short), `mmap`, `dup3`, `mremap`): nothing has changed and the claim
    /// comes back (the registration stays in place). A failure to punch the
    /// old pages after the move is logged: the peers are cut off already.
    pub(crate) fn rehome(self, old: BorrowedFd<'_>) -> Result<(), (Self, io::Error)> {
        let mut live = lock_live();
        let Some(e) = live.get_mut(&self.fd).filter(|e| e.id == self.id) else {
            return Ok(()); // the buffer is gone: nothing of the owner's is left to reach
        };
        // SAFETY: `e` describes a live HostBuffer (its entry is removed
        // first thing in its drop, under this lock, which we hold), so
        // `[addr, addr + len)` is its mapping of the memfd `self.fd`.
        match unsafe { rehome_pages(e.addr, e.len_bytes, self.fd, old) } {
            Ok(()) => {
                e.exported = false;
                Ok(())
            }
            Err(err) => {
                drop(live);
                Err((self, err))
            }
        }
    }
}

/// See [`ExportClaim::rehome`]. On success the buffer's mapping and its
/// descriptor both name the new file; once the mapping moved, the peers are
/// cut off, so the one later step (punching the old pages) only logs.
///
/// # Safety
/// `[addr, addr + len)` is a live `MAP_SHARED` read-write mapping (from
/// offset 0) of the memfd behind descriptor `fd`, page-aligned, that nothing
/// unmaps while this runs; `old` is that same file.
unsafe fn rehome_pages(addr: u64, len: usize, fd: RawFd, old: BorrowedFd<'_>) -> io::Result<()> {
    let size = nix::sys::stat::fstat(old).map_err(io::Error::from)?.st_size as usize;
    if size < len {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "memfd smaller than its mapping"));
    }
    let new = memfd_create("kvwire-host-buffer", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(io::Error::from)?;
    let new = File::from(new);
    check_fsize(size as u64, len)?;
    check_room(size as u64, len, available_host_bytes())?;
    new.set_len(size as u64)?;
    // Allocate the new pages now: where memory is short this fails here
    // (ENOSPC / ENOMEM, nothing moved) instead of the copy's page faults
    // waking the OOM killer.
    // SAFETY: fallocate (mode 0) on the descriptor we just created, in range.
    if unsafe { libc::fallocate(new.as_raw_fd(), 0, 0, size as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(&new, FcntlArg::F_ADD_SEALS(seals)).map_err(io::Error::from)?;
    // SAFETY: a fresh shared mapping of the new file, `size` bytes, at an
    // address of the kernel's choosing; unmapped below on error.
    let tmp = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            new.as_raw_fd(),
            0,
        )
    };
    if tmp == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `tmp` is `size` writable bytes of our own new mapping; the
    // source is the live mapping of `old` (the caller's promise), `size`
    // bytes long (the file's size: whole pages, which the mapping covers),
    // and the two do not overlap.
    unsafe {
        super::stream::copy_bytes(addr as *const u8, tmp.cast(), size, true);
        super::stream::store_fence();
    }
    // The buffer's descriptor number names the new file first (its `File`
    // keeps owning that number and closes it on drop), so a failure after
    // the move cannot leave it naming pages about to be punched.
    // SAFETY: both descriptors are open; `fd` is the HostBuffer's own.
    if unsafe { libc::dup3(new.as_raw_fd(), fd, libc::O_CLOEXEC) } < 0 {
        let err = io::Error::last_os_error();
        // SAFETY: `tmp` is our own mapping; nothing moved.
        unsafe { libc::munmap(tmp, size) };
        return Err(err);
    }
    // SAFETY: moves our own `tmp` mapping onto `[addr, addr + size)`, which
    // the caller's promise says is the buffer's mapping of the same length:
    // it is replaced atomically, so the owner's pointer stays valid.
    let moved =
        unsafe { libc::mremap(tmp, size, size, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, addr as *mut libc::c_void) };
    if moved == libc::MAP_FAILED {
        let err = io::Error::last_os_error();
        // SAFETY: `fd` names the old file again, as the owner's mapping
        // still is; `tmp` is still our own mapping (mremap failed).
        unsafe {
            libc::dup3(old.as_raw_fd(), fd, libc::O_CLOEXEC);
            libc::munmap(tmp, size);
        }
        return Err(err);
    }
    drop(new);
    // Whatever a peer still maps of `old` loses its pages: it reads zeros and
    // writes where nobody else looks (F_SEAL_SHRINK forbids truncating it,
    // not punching holes).
    // SAFETY: fallocate on a descriptor we hold, in range.
    let punched = unsafe {
        libc::fallocate(old.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, size as libc::off_t)
    };
    if punched != 0 {
        // The peers are cut off already; the old pages then stay until the
        // last peer mapping goes, holding bytes as of this deregistration.
        tracing::warn!("shm: could not punch the old memfd of {addr:#x}+{len}: {}", io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes of host memory a new allocation can take now: `MemAvailable` of
/// `/proc/meminfo`, lowered to the room left under this process's memory
/// cgroup where it has a limit, as a container's limit is not in
/// `/proc/meminfo`: the limit (v2 `memory.max`, v1 `memory.limit_in_bytes`)
/// less the usage (`memory.current`, `memory.usage_in_bytes`) that the
/// kernel cannot reclaim at once, i.e. less the inactive page cache
/// (`memory.stat` `inactive_file`, v1 `total_inactive_file`): a container
/// that has just read model weights has that much more room. `None` where
/// neither can be read (then nothing is refused for want of memory).
pub fn available_host_bytes() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let meminfo = read("/proc/meminfo").and_then(|t| meminfo_available(&t));
    let cgroup = read("/proc/self/cgroup").and_then(|t| cgroup_files(&t)).and_then(|f| {
        cgroup_room(&read(&f.limit)?, &read(&f.usage)?, &read(&f.stat).unwrap_or_default(), f.inactive_key)
    });
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` (bytes) of a `/proc/meminfo` text.
fn meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
}

/// The files of a memory cgroup that [`available_host_bytes`] reads.
#[derive(Debug, PartialEq, Eq)]
struct CgroupFiles {
    limit: String,
    usage: String,
    stat: String,
    /// The `memory.stat` key of the inactive page cache.
    inactive_key: &'static str,
}

/// This process's memory cgroup files, from the text of `/proc/self/cgroup`
/// (v1's `memory` controller line, else v2's `0::`).
fn cgroup_files(text: &str) -> Option<CgroupFiles> {
    let files = |dir: String, limit: &str, usage: &str, inactive_key| CgroupFiles {
        limit: format!("{dir}/{limit}"),
        usage: format!("{dir}/{usage}"),
        stat: format!("{dir}/memory.stat"),
        inactive_key,
    };
    let mut v2 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?.trim_end());
        let path = path.trim_end_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            let dir = format!("/sys/fs/cgroup/memory{path}");
            return Some(files(dir, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"));
        }
        if controllers.is_empty() {
            v2 = Some(files(format!("/sys/fs/cgroup{path}"), "memory.max", "memory.current", "inactive_file"));
        }
    }
    v2
}

/// Room under a cgroup limit (bytes): limit − (usage − inactive page
/// cache), the cache read from the `memory.stat` text under `inactive_key`
/// (0 where absent); `None` without a limit (`max`) or an unreadable value.
fn cgroup_room(limit: &str, usage: &str, stat: &str, inactive_key: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?;
    let usage: u64 = usage.trim().parse().ok()?;
    let inactive = stat
        .lines()
        .find_map(|l| l.strip_prefix(inactive_key)?.strip_prefix(' ')?.trim().parse::<u64>().ok())
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(inactive)))
}

/// Refuse `size` bytes of pre-faulted memory above `avail` (see
/// [`available_host_bytes`]).
fn check_room(size: u64, len_bytes: usize, avail: Option<u64>) -> io::Result<()> {
    match avail {
        Some(avail) if size > avail => Err(io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!(
                "HostBuffer of {len_bytes} bytes exceeds the {avail} bytes of memory available \
                 (MemAvailable, or the room under the memory cgroup's limit): its pages are faulted in at once, \
                 which would wake the OOM killer"
            ),
        )),
        _ => Ok(()),
    }
}

fn check_fsize(size: u64, len_bytes: usize) -> io::Result<()> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim) } == 0
        && lim.rlim_cur != libc::RLIM_INFINITY
        && size > lim.rlim_cur
    {
        return Err(io::Error::new(
            io::Error::from_raw_os_error(libc::EFBIG).kind(),
            format!(
                "HostBuffer of {len_bytes} bytes exceeds this process's file-size limit (RLIMIT_FSIZE, {} bytes): \\
                 its memfd could not be sized (EFBIG)",
                lim.rlim_cur
            ),
        ));
    }
    Ok(())
}

// SAFETY: the mapping `[addr, addr + len_bytes)` is created in `new` and
// unmapped only when the HostBuffer drops; the memfd is the file it maps,
// from offset 0, sealed against shrinking. Re-homing (`ExportClaim::rehome`)
// replaces the mapping's pages and the file behind `file`'s descriptor in
// one step each, with the same contents, so both promises keep holding: the
// range stays mapped, readable and writable throughout, and `shared_fd`
// names the file the range maps once `rehome` returns.
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
    fn refuses_more_memory_than_is_available() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   1000 kB\n";
        assert_eq!(meminfo_available(meminfo), Some(1_024_000));
        assert_eq!(meminfo_available("MemTotal: 5 kB\n"), None);
        assert_eq!(cgroup_room("max\n", "4096\n", "", "inactive_file"), None);
        assert_eq!(cgroup_room("1048576\n", "4096\n", "", "inactive_file"), Some(1_044_480));
        assert_eq!(cgroup_room("4096\n", "8192\n", "", "inactive_file"), Some(0));
        // page cache the kernel can drop is room: usage 900, of it 600 inactive file pages
        let v2stat = "anon 300\nfile 600\ninactive_file 600\nactive_file 0\n";
        assert_eq!(cgroup_room("1000", "900", v2stat, "inactive_file"), Some(700));
        let v1stat = "cache 600\ninactive_file 9\ntotal_inactive_file 600\n";
        assert_eq!(cgroup_room("1000", "900", v1stat, "total_inactive_file"), Some(700));
        assert_eq!(cgroup_room("1000", "900", v1stat, "inactive_file"), Some(109));
        let v1 = cgroup_files("5:memory:/pod/c1\n0::/\n").unwrap();
        assert_eq!(v1.limit, "/sys/fs/cgroup/memory/pod/c1/memory.limit_in_bytes");
        assert_eq!(v1.usage, "/sys/fs/cgroup/memory/pod/c1/memory.usage_in_bytes");
        assert_eq!(v1.stat, "/sys/fs/cgroup/memory/pod/c1/memory.stat");
        assert_eq!(v1.inactive_key, "total_inactive_file");
        let v2 = cgroup_files("0::/user.slice/x\n").unwrap();
        assert_eq!(v2.limit, "/sys/fs/cgroup/user.slice/x/memory.max");
        assert_eq!(v2.usage, "/sys/fs/cgroup/user.slice/x/memory.current");
        assert_eq!(v2.stat, "/sys/fs/cgroup/user.slice/x/memory.stat");
        assert_eq!(v2.inactive_key, "inactive_file");
        assert_eq!(cgroup_files("0::/\n").unwrap().limit, "/sys/fs/cgroup/memory.max");
        assert_eq!(cgroup_files("3:cpu:/\n"), None);
        assert!(check_room(8192, 8000, Some(8192)).is_ok());
        assert!(check_room(8192, 8000, None).is_ok());
        let e = check_room(12_288, 9000, Some(8192)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::OutOfMemory);
        assert!(e.to_string().contains("9000 bytes") && e.to_string().contains("8192 bytes"), "{e}");
        // This machine: its figure is known, and a buffer twice its size is
        // refused before a page is touched (a regression here would wake
        // the OOM killer rather than pass).
        let avail = available_host_bytes().expect("MemAvailable of /proc/meminfo");
        assert!(avail > 0);
        let Ok(twice) = usize::try_from(avail.saturating_mul(2)) else { return };
        let e = HostBuffer::new(twice).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::OutOfMemory, "{e}");
    }

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
