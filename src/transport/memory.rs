//! Memory that can be registered with a transport: its description and the
//! owner that keeps it alive while registered.

use std::os::fd::BorrowedFd;

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
pub trait MemoryBacking: Send + Sync {
    /// The range this backing provides.
    fn desc(&self) -> MemoryDesc;

    /// A file descriptor the memory is a shared mapping of, with the offset
    /// (bytes) of `desc().addr` inside that file. The `shm` transport hands it
    /// to same-host peers so that a transfer is a single `memcpy`.
    fn shared_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }

    /// A dma-buf file descriptor and the offset of `desc().addr` inside it,
    /// for GPU memory registered with `ibv_reg_dmabuf_mr`.
    fn dmabuf_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
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

impl MemoryBacking for RawMemory {
    fn desc(&self) -> MemoryDesc {
        self.desc
    }
}
