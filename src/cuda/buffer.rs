//! [`DeviceBuffer`]: a VRAM allocation with its GPU context and stream,
//! registrable as [`MemoryBacking`] (`kind: Vram`) and usable as a
//! `KVCacheMemory` shard buffer.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use super::CudaError;
use super::dmabuf::{DmaBuf, export_dmabuf};
use super::driver::{GpuContext, check, driver_error};
use super::stream::Stream;
use crate::transport::{MemoryBacking, MemoryDesc, MemoryKind};

/// Allocations are rounded up to the GPU's large-page size so that the
/// driver hands out a 2 MiB-aligned range: a dma-buf export must cover whole
/// host pages inside one allocation, and small allocations may be
/// sub-allocated at 512-byte alignment. At most 2 MiB is wasted per buffer;
/// a KV pool is GiBs.
pub const ALLOC_ALIGN_BYTES: u64 = 2 << 20;

/// VRAM: `len_bytes` on one GPU (`cuMemAlloc`, zero-filled), freed on drop
/// after its stream drained. It owns a stream for its own copies and, once
/// asked for, a dma-buf export of the whole allocation (kept open for the
/// buffer's life, so for longer than any memory region registered from it:
/// the engine holds the buffer's `Arc` until it deregisters).
///
/// # Ordering before the NIC
/// Its own copies ([`copy_from_host`](Self::copy_from_host),
/// [`fill`](Self::fill)) are complete when they return. Work another stream
/// enqueued (a kernel writing KV pages) is not: record an event on that
/// stream and wait for it ([`Event::synchronize`](super::Event::synchronize)
/// or poll [`Event::is_complete`](super::Event::is_complete)) before posting
/// a transfer that reads these bytes.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len_bytes: u64,
    alloc_len_bytes: u64,
    dmabuf: OnceLock<Result<DmaBuf, CudaError>>,
    stream: Stream,
    ctx: Arc<GpuContext>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("gpu", &self.ctx.ordinal())
            .field("addr", &format_args!("{:#x}", self.ptr))
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl DeviceBuffer {
    /// Allocate `len_bytes` (> 0) on GPU `ordinal`, zero-filled.
    ///
    /// # Errors
    /// [`CudaError::NoDriver`] / [`CudaError::NoDevice`] without a driver or
    /// GPU; [`CudaError::Unsupported`] for 0 bytes; the failing call
    /// (`cuMemAlloc_v2` with `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn new(ordinal: u32, len_bytes: u64) -> Result<Self, CudaError> {
        Self::on(&GpuContext::new(ordinal)?, len_bytes)
    }

    /// As [`new`](Self::new), on an existing context.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn on(ctx: &Arc<GpuContext>, len_bytes: u64) -> Result<Self, CudaError> {
        if len_bytes == 0 {
            return Err(CudaError::Unsupported("zero-byte device buffer".into()));
        }
        let alloc_len_bytes = len_bytes.div_ceil(ALLOC_ALIGN_BYTES) * ALLOC_ALIGN_BYTES;
        let stream = Stream::new(ctx)?;
        let mut ptr = 0;
        // SAFETY: context bound by Stream::new on this thread; out-pointer
        // valid; freed in Drop.
        check("cuMemAlloc_v2", unsafe { sys::cuMemAlloc_v2(&mut ptr, alloc_len_bytes as usize) })?;
        let buf = Self { ptr, len_bytes, alloc_len_bytes, dmabuf: OnceLock::new(), stream, ctx: ctx.clone() };
        buf.fill(0)?;
        Ok(buf)
    }

    /// Device virtual address of byte 0.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Usable length (bytes).
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// The GPU.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    /// The buffer's own stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(CudaError::OutOfBounds { offset_bytes: offset, len_bytes: len, capacity_bytes: self.len_bytes }),
        }
    }

    /// Set every byte to `value`; complete on return.
    ///
    /// # Errors
    /// `cuMemsetD8Async`, `cuStreamSynchronize`.
    pub fn fill(&self, value: u8) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the whole allocation is ours. On our stream, not the legacy
        // default one, which our non-blocking stream does not wait for.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(self.ptr, value, self.alloc_len_bytes as usize, self.stream.raw())
        })?;
        self.stream.synchronize()
    }

    /// Copy `src` to `offset`; complete on return (pageable host memory:
    /// the driver stages it; use [`CopyStreams`](super::CopyStreams) with pinned
    /// memory for asynchronous bulk copies).
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`]; `cuMemcpyHtoDAsync_v2`.
    pub fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<(), CudaError> {
        self.check_range(offset, src.len() as u64)?;
        self.ctx.bind()?;
        // SAFETY: range checked; `src` outlives the copy because we
        // synchronize before returning.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(self.ptr + offset, src.as_ptr().cast(), src.len(), self.stream.raw())
        })?;
        self.stream.synchronize()
    }

    /// Copy `dst.len()` bytes from `offset` into `dst`; complete on return.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`]; `cuMemcpyDtoHAsync_v2`.
    pub fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check_range(offset, dst.len() as u64)?;
        self.ctx.bind()?;
        // SAFETY: range checked; `dst` is exclusively borrowed until the
        // synchronize below.
        check("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr + offset, dst.len(), self.stream.raw())
        })?;
        self.stream.synchronize()
    }

    /// The dma-buf export of the whole allocation and the offset of byte 0
    /// in it, made on first call and kept until drop.
    ///
    /// # Errors
    /// The export's error (cached: a GPU that cannot export never will),
    /// see [`export_dmabuf`].
    pub fn dmabuf(&self) -> Result<(BorrowedFd<'_>, u64), CudaError> {
        match self.dmabuf.get_or_init(|| export_dmabuf(&self.ctx, self.ptr, self.alloc_len_bytes)) {
            Ok(d) => Ok((d.fd(), d.range().offset)),
            Err(e) => Err(e.clone()),
        }
    }
}

// SAFETY: the allocation `[ptr, ptr + len_bytes)` on this context's GPU is
// freed only in `Drop`, after the last transfer (the engine keeps the Arc
// until deregister); the dma-buf exports that same allocation.
unsafe impl MemoryBacking for DeviceBuffer {
    fn desc(&self) -> MemoryDesc {
        MemoryDesc { addr: self.ptr, len_bytes: self.len_bytes, kind: MemoryKind::Vram, device_id: self.ctx.ordinal() }
    }

    fn dmabuf_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
        self.dmabuf().map_err(|e| tracing::debug!("GPU buffer {:#x}: {e}", self.ptr)).ok()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Pending copies on our stream finish before the memory goes.
        if let Err(e) = self.stream.synchronize() {
            tracing::error!("cuda: {e} while freeing a device buffer");
        }
        // Close the dma-buf (every MR from it is gone: they hold our Arc).
        drop(self.dmabuf.take());
        let _ = self.ctx.bind();
        // SAFETY: allocated in `on`, freed once, no registration or copy
        // can reach it any more.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("cuda: {} during drop", driver_error("cuMemFree_v2", r));
        }
    }
}
