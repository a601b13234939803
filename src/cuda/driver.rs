//! Loading the CUDA driver without panicking, checking `CUresult`s, and the
//! per-GPU [`GpuContext`] (the device's primary context).
//!
//! cudarc loads `libcuda` lazily and panics on first use when the library or
//! a symbol is missing. Every entry point of this module goes through
//! [`driver`] first, which checks that the library loads and that every
//! symbol kvwire calls is present, then runs `cuInit` once.

use std::ffi::{CStr, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use super::CudaError;

/// Driver symbols kvwire calls unconditionally (present since CUDA 11.0).
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuMemsetD8Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
];

/// What `cuInit` found.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DriverState {
    /// `cuDriverGetVersion`, e.g. 12080.
    pub(crate) version: i32,
    /// `cuDeviceGetCount` (0 when `cuInit` reported `CUDA_ERROR_NO_DEVICE`).
    pub(crate) num_devices: u32,
}

/// The loaded, initialised driver, or why there is none. Never panics.
pub(crate) fn driver() -> Result<DriverState, CudaError> {
    static STATE: OnceLock<Result<DriverState, CudaError>> = OnceLock::new();
    STATE.get_or_init(load).clone()
}

fn load() -> Result<DriverState, CudaError> {
    // SAFETY: only tries to dlopen the candidate names (and closes them).
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver { reason: "libcuda.so.1 not found by the dynamic loader".into() });
    }
    for sym in REQUIRED {
        if !has_symbol(sym) {
            return Err(CudaError::NoDriver { reason: format!("libcuda lacks {sym} (driver too old)") });
        }
    }
    let mut version = 0;
    // SAFETY: symbol checked present; out-pointer valid.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) })?;
    // SAFETY: symbol checked present; flags must be 0.
    match unsafe { sys::cuInit(0) } {
        sys::CUresult::CUDA_SUCCESS => {}
        sys::CUresult::CUDA_ERROR_NO_DEVICE => return Ok(DriverState { version, num_devices: 0 }),
        r => return Err(CudaError::NoDriver { reason: driver_error("cuInit", r).to_string() }),
    }
    let mut n = 0;
    // SAFETY: initialised; out-pointer valid.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(DriverState { version, num_devices: n.max(0) as u32 })
}

/// True when the loaded `libcuda` exports `name`. Call only after
/// `is_culib_present` returned true.
pub(crate) fn has_symbol(name: &str) -> bool {
    // SAFETY: the library is present (checked by the caller), so `culib`
    // loads it instead of panicking; `get` only looks the symbol up.
    unsafe { sys::culib().get::<*const c_void>(name.as_bytes()).is_ok() }
}

/// `Ok` for `CUDA_SUCCESS`, else [`CudaError::Driver`] naming `call`.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        r => Err(driver_error(call, r)),
    }
}

pub(crate) fn driver_error(call: &'static str, r: sys::CUresult) -> CudaError {
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: only called once the library loaded; out-pointer valid; the
    // returned string is static in the driver.
    let name = unsafe {
        if sys::cuGetErrorName(r, &mut s) == sys::CUresult::CUDA_SUCCESS && !s.is_null() {
            CStr::from_ptr(s).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        }
    };
    CudaError::Driver { call, code: r as u32, name }
}

/// One GPU's primary context, retained while any buffer, stream or event of
/// that GPU is alive (they hold an `Arc` of it), released on drop.
#[derive(Debug)]
pub struct GpuContext {
    ordinal: u32,
    device: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext is a process-wide handle; the driver API is thread-safe
// and every call binds it to the calling thread first (`bind`).
unsafe impl Send for GpuContext {}
// SAFETY: as above; no method mutates Rust-visible state.
unsafe impl Sync for GpuContext {}

impl GpuContext {
    /// Retain GPU `ordinal`'s primary context.
    ///
    /// # Errors
    /// [`CudaError::NoDriver`], [`CudaError::NoDevice`], or the failing call.
    pub fn new(ordinal: u32) -> Result<Arc<Self>, CudaError> {
        let st = driver()?;
        if ordinal >= st.num_devices {
            return Err(CudaError::NoDevice { ordinal, num_devices: st.num_devices });
        }
        let mut device = 0;
        // SAFETY: initialised driver; ordinal checked; out-pointer valid.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ordinal as i32) })?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid device; out-pointer valid. Released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, device) })?;
        Ok(Arc::new(Self { ordinal, device, raw }))
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    pub(crate) fn device(&self) -> sys::CUdevice {
        self.device
    }

    /// Make this context current on the calling thread (every driver call
    /// that allocates, copies or creates streams does this first).
    ///
    /// # Errors
    /// `cuCtxSetCurrent`.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `raw` is retained for the life of `self`.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }

    /// Make GPUDirect RDMA writes that a NIC has completed into this GPU's
    /// memory visible to work launched afterwards
    /// (`cuFlushGPUDirectRDMAWrites`, scope: this context's owner). Call it
    /// after a READ/WRITE into VRAM completed and before a kernel consumes the
    /// bytes, on GPUs whose `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`
    /// is below `OWNER`.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when the driver lacks the call (before CUDA
    /// 11.3); the failing call.
    pub fn flush_rdma_writes(&self) -> Result<(), CudaError> {
        if !has_symbol("cuFlushGPUDirectRDMAWrites") {
            return Err(CudaError::Unsupported("driver lacks cuFlushGPUDirectRDMAWrites (CUDA < 11.3)".into()));
        }
        self.bind()?;
        // SAFETY: symbol present; current context bound.
        check("cuFlushGPUDirectRDMAWrites", unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
        })
    }
}

impl Drop for GpuContext {
    fn drop(&mut self) {
        // SAFETY: retained in `new`, released once.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!("cuda: {} during drop", driver_error("cuDevicePrimaryCtxRelease_v2", r));
        }
    }
}
