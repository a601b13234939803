//! Memory that can be registered with a transport: its description and the
//! owner that keeps it alive while registered.

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Where a memory range lives, as NIXL's `DRAM_SEG` / `VRAM_SEG`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Host memory (DRAM).
    Dram,
    /// GPU memory (VRAM), registered through GPUDirect RDMA.
    Vram,
}

/// One contiguous range of memory: `len_bytes` bytes starting at virtual
/// address `addr`, on `device_id` (the GPU ordinal for VRAM, 0 for DRAM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryDesc {
    /// Start virtual address (bytes).
    pub addr: u64,
    /// Length in bytes.
    pub len_bytes: u64,
    /// DRAM or VRAM.
    pub kind: MemoryKind,
    /// Device ordinal (GPU id for VRAM; 0 for host memory).
    pub device_id: u32,
}

impl MemoryDesc {
    /// One past the last byte, or `None` when `addr + len_bytes` overflows.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len_bytes)
    }

    /// True when `[addr, addr + len)` lies inside this range.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.end()) {
            (Some(e), Some(end)) => addr >= self.addr && e <= end,
            _ => false,
        }
    }
}

/// Something that owns (or borrows) a memory range and keeps it alive for as
/// long as the engine holds it registered, as rust-ibverbs' MR owns its buffer.
///
/// The engine keeps an `Arc` of the backing until `deregister`, so the memory
/// can never be freed while a NIC or peer may still access it.
///
/// # Safety
/// The shm and tcp copy threads and the NIC read and write `desc()`'s range
/// through raw pointers, trusting it. An implementor promises that
/// - `desc()` always returns the same range, and for [`MemoryKind::Dram`]
///   every byte of `[addr, addr + len_bytes)` is mapped, readable and
///   writable host memory of this process (for [`MemoryKind::Vram`], device
///   memory of GPU `device_id`), for as long as the value lives;
/// - nothing frees, unmaps or remaps that range while the value lives;
/// - [`MemoryBacking::shared_fd`] / [`MemoryBacking::dmabuf_fd`], when they
///   return a descriptor, return one whose bytes at the given offset are
///   that same memory.
///
/// Transfers write into the range from other threads and processes: an
/// implementor must not hand out `&`/`&mut` references to it that safe code
/// could hold while a transfer runs. Safe code wraps a sub-range of another
/// backing with [`View`], and caller-owned memory with [`RawMemory`] (whose
/// constructor is `unsafe`).
pub unsafe trait MemoryBacking: Send + Sync {
    /// The range this backing provides.
    fn desc(&self) -> MemoryDesc;

    /// A file descriptor the memory is a shared mapping of, with the offset
    /// (bytes) of `desc().addr` inside that file. The `shm` transport hands it
    /// to same-host peers so that a transfer is a single `memcpy` (only when
    /// the file holds exactly this range and is sealed against resizing).
    fn shared_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }

    /// A dma-buf file descriptor and the offset of `desc().addr` inside it,
    /// for GPU memory registered with `ibv_reg_dmabuf_mr`.
    fn dmabuf_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }
}

impl std::fmt::Debug for dyn MemoryBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBacking").field("desc", &self.desc()).finish()
    }
}

/// A sub-range of another backing, registrable on its own (e.g. one KV
/// group inside a larger host buffer). Built only by [`View::new`], which
/// checks the range lies inside the backing it keeps alive.
pub struct View {
    inner: Arc<dyn MemoryBacking>,
    offset_bytes: u64,
    len_bytes: u64,
}

impl std::fmt::Debug for View {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View").field("desc", &self.desc()).finish()
    }
}

impl View {
    /// `len_bytes` bytes at `offset_bytes` of `inner`; `None` when that range
    /// is not inside `inner`. An empty view is allowed (MAX builds groups of
    /// zero pages); backends refuse to register it, and the KV layer never asks.
    pub fn new(inner: Arc<dyn MemoryBacking>, offset_bytes: u64, len_bytes: u64) -> Option<Self> {
        let d = inner.desc();
        let end = offset_bytes.checked_add(len_bytes)?;
        (end <= d.len_bytes).then_some(Self { inner, offset_bytes, len_bytes })
    }
}

// SAFETY: the range is inside `inner`'s (checked by `View::new`, and
// `inner.desc()` never changes), and `inner` is kept alive by the `Arc`, so
// `inner`'s promise covers every byte of it; the descriptors are `inner`'s
// with the offset moved by the same amount.
unsafe impl MemoryBacking for View {
    fn desc(&self) -> MemoryDesc {
        let d = self.inner.desc();
        MemoryDesc { addr: d.addr + self.offset_bytes, len_bytes: self.len_bytes, ..d }
    }

    fn shared_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        self.inner.shared_fd().map(|(fd, off)| (fd, off + self.offset_bytes))
    }

    fn dmabuf_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        self.inner.dmabuf_fd().map(|(fd, off)| (fd, off + self.offset_bytes))
    }
}

/// One registration covering several overlapping backings (leaves that view
/// one shared slab, as MAX's Jenga layout hands out): the union of their
/// ranges, keeping every part alive. A union has no shared or dma-buf file
/// descriptor of its own, so `shm` reaches it by cross-memory attach.
pub struct Union {
    _parts: Vec<Arc<dyn MemoryBacking>>,
    desc: MemoryDesc,
}

impl std::fmt::Debug for Union {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Union").field("desc", &self.desc).field("parts", &self._parts.len()).finish()
    }
}

impl Union {
    /// The union of `parts`, which must be non-empty, of one kind and device,
    /// and overlap: sorted by address, each part starts before the end of
    /// the ones before it. Otherwise the parts come back unchanged.
    ///
    /// # Errors
    /// The parts, when they do not form one contiguous overlapping range.
    pub fn new(mut parts: Vec<Arc<dyn MemoryBacking>>) -> Result<Self, Vec<Arc<dyn MemoryBacking>>> {
        parts.sort_by_key(|p| p.desc().addr);
        let Some(first) = parts.first().map(|p| p.desc()) else { return Err(parts) };
        let mut end = first.addr.saturating_add(first.len_bytes);
        for p in &parts[1..] {
            let d = p.desc();
            if d.kind != first.kind || d.device_id != first.device_id || d.addr >= end || d.len_bytes == 0 {
                return Err(parts);
            }
            end = end.max(d.addr.saturating_add(d.len_bytes));
        }
        let desc = MemoryDesc { len_bytes: end - first.addr, ..first };
        Ok(Self { _parts: parts, desc })
    }
}

// SAFETY: `Union::new` accepts only parts that overlap one another in address
// order, so every byte of the union's range lies in some part's range, each
// valid for as long as that part lives (its own `MemoryBacking` promise);
// `_parts` keeps every part alive as long as the union.
unsafe impl MemoryBacking for Union {
    fn desc(&self) -> MemoryDesc {
        self.desc
    }
}

/// Host memory relabelled as VRAM, for tests of the kind rules in layers
/// that forbid `unsafe` (nothing reads it as device memory: the backends
/// that copy with the CPU refuse VRAM).
#[cfg(test)]
pub(crate) struct RelabelledVram(pub Arc<crate::HostBuffer>);

// SAFETY: the range is the HostBuffer's, kept alive by the Arc; only the
// kind differs, and CPU copiers refuse VRAM so none dereferences it.
#[cfg(test)]
unsafe impl MemoryBacking for RelabelledVram {
    fn desc(&self) -> MemoryDesc {
        MemoryDesc { kind: MemoryKind::Vram, ..self.0.desc() }
    }
}

/// Memory the caller allocated elsewhere (an inference engine's own buffers),
/// described by address and length only.
#[derive(Debug)]
pub struct RawMemory {
    desc: MemoryDesc,
}

impl RawMemory {
    /// Wrap a caller-owned range.
    ///
    /// # Safety
    /// `[desc.addr, desc.addr + desc.len_bytes)` must be valid, writable memory
    /// of the given kind for as long as this value (or any engine it is
    /// registered with) is alive, and nothing else may free it meanwhile.
    pub unsafe fn new(desc: MemoryDesc) -> Self {
        Self { desc }
    }
}

// SAFETY: `RawMemory::new`'s caller promised the range stays valid and
// unfreed for as long as this value lives; the descriptor never changes.
unsafe impl MemoryBacking for RawMemory {
    fn desc(&self) -> MemoryDesc {
        self.desc
    }
}
