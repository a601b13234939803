//! Pinned host memory and asynchronous GPU↔host copies on dedicated streams,
//! completed by event query: the copy engine of a VRAM connector tier.

use std::sync::Arc;

use cudarc::driver::sys;

use super::CudaError;
use super::buffer::DeviceBuffer;
use super::driver::{GpuContext, check, driver_error};
use super::stream::{Event, Stream};

/// Page-locked host memory (`cuMemHostAlloc`, portable across contexts),
/// the only kind the DMA engines copy asynchronously. Freed on drop.
pub struct PinnedHostBuffer {
    ptr: *mut u8,
    len_bytes: usize,
    ctx: Arc<GpuContext>,
}

// SAFETY: plain owned host memory; access goes through &/&mut self.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedHostBuffer {}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostBuffer").field("len_bytes", &self.len_bytes).finish()
    }
}

impl PinnedHostBuffer {
    /// Allocate `len_bytes` (> 0), zeroed.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for 0 bytes; `cuMemHostAlloc`.
    pub fn new(ctx: &Arc<GpuContext>, len_bytes: usize) -> Result<Self, CudaError> {
        if len_bytes == 0 {
            return Err(CudaError::Unsupported("zero-byte pinned buffer".into()));
        }
        ctx.bind()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: context bound; out-pointer valid; freed in Drop.
        check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut p, len_bytes, sys::CU_MEMHOSTALLOC_PORTABLE) })?;
        let ptr = p.cast::<u8>();
        // SAFETY: fresh allocation of `len_bytes`.
        unsafe { ptr.write_bytes(0, len_bytes) };
        Ok(Self { ptr, len_bytes, ctx: ctx.clone() })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len_bytes
    }

    /// Always false (zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// The bytes. No copy can be writing them: an in-flight copy owns the
    /// buffer ([`PendingCopy`]).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for `len_bytes` while `self` lives; no aliasing
        // writer (see above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len_bytes) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len_bytes) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: allocated in `new`, freed once; no copy in flight (a
        // PendingCopy owning us waits first).
        let r = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("cuda: {} during drop", driver_error("cuMemFreeHost", r));
        }
    }
}

/// Two dedicated streams of one GPU, host→device and device→host, so that
/// uploads and downloads overlap each other and the inference streams.
#[derive(Debug)]
pub struct CopyStreams {
    h2d: Stream,
    d2h: Stream,
}

/// Direction of a [`PendingCopy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// Host to device (upload, a connector load).
    HostToDevice,
    /// Device to host (download, a connector offload).
    DeviceToHost,
}

/// An asynchronous copy in flight. It owns the pinned staging buffer and
/// holds the device buffer, so neither can go while the DMA runs; dropping it
/// unfinished waits for the copy.
#[derive(Debug)]
pub struct PendingCopy {
    event: Event,
    staging: Option<PinnedHostBuffer>,
    _device: Arc<DeviceBuffer>,
    direction: CopyDirection,
}

impl PendingCopy {
    /// Non-blocking completion (`cuEventQuery`).
    ///
    /// # Errors
    /// An asynchronous failure of the copy.
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        self.event.is_complete()
    }

    /// Which way it copies.
    pub fn direction(&self) -> CopyDirection {
        self.direction
    }

    /// Block until done and give the staging buffer back (for a download,
    /// it now holds the bytes).
    ///
    /// # Errors
    /// `cuEventSynchronize` (an asynchronous failure of the copy).
    pub fn wait(mut self) -> Result<PinnedHostBuffer, CudaError> {
        self.event.synchronize()?;
        Ok(self.staging.take().expect("staging present until wait"))
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if self.staging.is_some()
            && let Err(e) = self.event.synchronize()
        {
            tracing::error!("cuda: {e} while dropping a pending copy");
        }
    }
}

impl CopyStreams {
    /// Create both streams on `ctx`'s GPU.
    ///
    /// # Errors
    /// `cuStreamCreate`.
    pub fn new(ctx: &Arc<GpuContext>) -> Result<Self, CudaError> {
        Ok(Self { h2d: Stream::new(ctx)?, d2h: Stream::new(ctx)? })
    }

    /// Upload all of `staging` to `dst` at `dst_offset`, asynchronously.
    ///
    /// # Errors
    /// [`CudaError::OutOfBounds`], [`CudaError::Unsupported`] when `dst`
    /// is on another GPU; `cuMemcpyHtoDAsync_v2`, `cuEventRecord`.
    pub fn upload(
        &self,
        staging: PinnedHostBuffer,
        dst: &Arc<DeviceBuffer>,
        dst_offset: u64,
    ) -> Result<PendingCopy, CudaError> {
        self.start(CopyDirection::HostToDevice, staging, dst, dst_offset)
    }

    /// Download `staging.len()` bytes of `src` from `src_offset` into
    /// `staging`, asynchronously.
    ///
    /// # Errors
    /// As [`upload`](Self::upload), with `cuMemcpyDtoHAsync_v2`.
    pub fn download(
        &self,
        src: &Arc<DeviceBuffer>,
        src_offset: u64,
        staging: PinnedHostBuffer,
    ) -> Result<PendingCopy, CudaError> {
        self.start(CopyDirection::DeviceToHost, staging, src, src_offset)
    }

    fn start(
        &self,
        direction: CopyDirection,
        staging: PinnedHostBuffer,
        dev: &Arc<DeviceBuffer>,
        offset: u64,
    ) -> Result<PendingCopy, CudaError> {
        let len = staging.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > dev.len_bytes()) {
            return Err(CudaError::OutOfBounds {
                offset_bytes: offset,
                len_bytes: len,
                capacity_bytes: dev.len_bytes(),
            });
        }
        let stream = match direction {
            CopyDirection::HostToDevice => &self.h2d,
            CopyDirection::DeviceToHost => &self.d2h,
        };
        if dev.context().ordinal() != stream.context().ordinal() {
            return Err(CudaError::Unsupported(format!(
                "copy between GPU {}'s buffer and GPU {}'s streams",
                dev.context().ordinal(),
                stream.context().ordinal()
            )));
        }
        stream.context().bind()?;
        let (host, n) = (staging.ptr, staging.len());
        let r = match direction {
            // SAFETY: range checked; pinned memory owned by the returned
            // PendingCopy until the event completes.
            CopyDirection::HostToDevice => unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev.addr() + offset, host.cast_const().cast(), n, stream.raw())
            },
            // SAFETY: as above; nothing else can read `staging` meanwhile.
            CopyDirection::DeviceToHost => unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), dev.addr() + offset, n, stream.raw())
            },
        };
        check(
            if direction == CopyDirection::HostToDevice { "cuMemcpyHtoDAsync_v2" } else { "cuMemcpyDtoHAsync_v2" },
            r,
        )?;
        let event = match stream.record() {
            Ok(ev) => ev,
            Err(e) => {
                // Cannot track the copy: drain the stream before the staging
                // buffer may be freed.
                let _ = stream.synchronize();
                return Err(e);
            }
        };
        Ok(PendingCopy { event, staging: Some(staging), _device: dev.clone(), direction })
    }
}
