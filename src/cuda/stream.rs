//! CUDA streams and events: how GPU work is ordered before a NIC or the host
//! touches the bytes.
//!
//! The NIC does not see CUDA streams. Before posting a transfer that reads
//! VRAM, the producer records an [`Event`] on the stream that wrote the bytes
//! ([`Stream::record`]) and the poster waits for it: [`Event::synchronize`]
//! (blocking) or [`Event::is_complete`] (non-blocking, for a progress loop).
//! [`Stream::synchronize`] is the coarse form. After a transfer *into* VRAM
//! completed, call [`GpuContext::flush_rdma_writes`] before launching the
//! consumer on GPUs with weak GPUDirect write ordering.

use std::sync::Arc;

use cudarc::driver::sys;

use super::CudaError;
use super::driver::{GpuContext, check, driver_error};

/// A non-blocking CUDA stream (`CU_STREAM_NON_BLOCKING`: it does not
/// synchronize with the legacy default stream), destroyed on drop.
#[derive(Debug)]
pub struct Stream {
    raw: sys::CUstream,
    ctx: Arc<GpuContext>,
}

// SAFETY: a CUstream may be used from any thread of the process; the context
// is bound before each call.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueueing on one stream from several threads is allowed
// by the driver API (order between threads is the caller's concern).
unsafe impl Sync for Stream {}

impl Stream {
    /// Create a stream on `ctx`'s GPU.
    ///
    /// # Errors
    /// `cuStreamCreate`.
    pub fn new(ctx: &Arc<GpuContext>) -> Result<Self, CudaError> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: context bound; out-pointer valid; destroyed in Drop.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Self { raw, ctx: ctx.clone() })
    }

    /// The GPU this stream runs on.
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Block until all work enqueued so far has finished.
    ///
    /// # Errors
    /// `cuStreamSynchronize` (including errors of earlier async work).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: live stream.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.raw) })
    }

    /// Record an event after all work enqueued so far.
    ///
    /// # Errors
    /// `cuEventCreate`, `cuEventRecord`.
    pub fn record(&self) -> Result<Event, CudaError> {
        let ev = Event::new(&self.ctx)?;
        // SAFETY: live event and stream of the same context (bound by Event::new).
        check("cuEventRecord", unsafe { sys::cuEventRecord(ev.raw, self.raw) })?;
        Ok(ev)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: created in `new`, destroyed once; pending work completes
        // asynchronously (the driver keeps resources until then).
        let r = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("cuda: {} during drop", driver_error("cuStreamDestroy_v2", r));
        }
    }
}

/// A CUDA event (timing disabled), destroyed on drop.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<GpuContext>,
}

// SAFETY: events may be queried and synchronized from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; `cuEventQuery`/`cuEventSynchronize` are thread-safe.
unsafe impl Sync for Event {}

impl Event {
    fn new(ctx: &Arc<GpuContext>) -> Result<Self, CudaError> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: context bound; out-pointer valid; destroyed in Drop.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Self { raw, ctx: ctx.clone() })
    }

    /// Non-blocking: true once all work before the record point finished.
    ///
    /// # Errors
    /// `cuEventQuery` with anything but `CUDA_SUCCESS` / `CUDA_ERROR_NOT_READY`
    /// (an earlier async failure).
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        // SAFETY: live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(driver_error("cuEventQuery", r)),
        }
    }

    /// Block until the work before the record point finished.
    ///
    /// # Errors
    /// `cuEventSynchronize`.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: created in `new`, destroyed once.
        let r = unsafe { sys::cuEventDestroy_v2(self.raw) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("cuda: {} during drop", driver_error("cuEventDestroy_v2", r));
        }
    }
}
