//! [`ExternalDeviceMemory`]: VRAM an inference engine allocated itself (its
//! KV pool), described by address and length, registrable like a
//! [`DeviceBuffer`](super::DeviceBuffer).

use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};

use super::CudaError;
use super::dmabuf::{DmaBuf, export_dmabuf};
use super::driver::GpuContext;
use crate::transport::{MemoryBacking, MemoryDesc, MemoryKind};

/// Caller-owned GPU memory `[addr, addr + len_bytes)` on one GPU, as a
/// [`MemoryBacking`] with `kind: Vram`. Its dma-buf export (made on first
/// use) covers the range rounded out to host pages inside its allocation,
/// with `addr`'s offset in it, and stays open while this value lives.
pub struct ExternalDeviceMemory {
    addr: u64,
    len_bytes: u64,
    dmabuf: OnceLock<Result<DmaBuf, CudaError>>,
    ctx: Arc<GpuContext>,
}

impl std::fmt::Debug for ExternalDeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalDeviceMemory")
            .field("gpu", &self.ctx.ordinal())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl ExternalDeviceMemory {
    /// Describe `len_bytes` of GPU memory at device address `addr` on `ctx`'s GPU.
    ///
    /// # Safety
    /// The range must be device memory of that GPU (from `cuMemAlloc`,
    /// `cudaMalloc` or a mapped VMM allocation) and stay allocated for as long
    /// as this value, or any engine it is registered with, is alive.
    pub unsafe fn new(ctx: &Arc<GpuContext>, addr: u64, len_bytes: u64) -> Self {
        Self { addr, len_bytes, dmabuf: OnceLock::new(), ctx: ctx.clone() }
    }

    /// The GPU.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    /// The dma-buf export and the offset of `addr` in it, made on first call.
    ///
    /// # Errors
    /// As [`export_dmabuf`] (cached).
    pub fn dmabuf(&self) -> Result<(BorrowedFd<'_>, u64), CudaError> {
        match self.dmabuf.get_or_init(|| export_dmabuf(&self.ctx, self.addr, self.len_bytes)) {
            Ok(d) => Ok((d.fd(), d.range().offset)),
            Err(e) => Err(e.clone()),
        }
    }
}

// SAFETY: `ExternalDeviceMemory::new`'s caller promised the device range
// stays allocated for this value's lifetime; the dma-buf exports that range.
unsafe impl MemoryBacking for ExternalDeviceMemory {
    fn desc(&self) -> MemoryDesc {
        MemoryDesc { addr: self.addr, len_bytes: self.len_bytes, kind: MemoryKind::Vram, device_id: self.ctx.ordinal() }
    }

    fn dmabuf_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        self.dmabuf().map_err(|e| tracing::debug!("GPU memory {:#x}: {e}", self.addr)).ok()
    }
}
