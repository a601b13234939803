//! [`CudaError`]: the one error type of the GPU layer.

/// Errors of the GPU layer. Variants a caller can branch on: no driver or
/// device at all ([`CudaError::NoDriver`], [`CudaError::NoDevice`]), a feature
/// the driver or build lacks ([`CudaError::Unsupported`]), a failing driver
/// call ([`CudaError::Driver`], naming the C function), and a GPU registration
/// that failed on every path ([`CudaError::Registration`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// `libcuda.so.1` cannot be loaded (no NVIDIA driver), lacks a symbol
    /// kvwire needs, or `cuInit` reported no usable driver.
    #[error("no CUDA driver: {reason}")]
    NoDriver {
        /// Why, e.g. the loader's message.
        reason: String,
    },
    /// The driver loaded but there is no such GPU (`ordinal` past
    /// `num_devices`; `num_devices` may be 0).
    #[error("no CUDA device {ordinal} ({num_devices} present)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices the driver reports.
        num_devices: u32,
    },
    /// The build, driver or device cannot do this (e.g. built without the
    /// `cuda` feature; dma-buf export on a GPU without
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A driver call failed.
    #[error("{call}: {name} ({code})")]
    Driver {
        /// The C call, e.g. `cuMemAlloc_v2`.
        call: &'static str,
        /// The `CUresult` value.
        code: u32,
        /// Its `cuGetErrorName`, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
    },
    /// An offset/length outside a buffer.
    #[error("out of bounds: {offset_bytes}+{len_bytes} past {capacity_bytes} bytes")]
    OutOfBounds {
        /// Start of the access (bytes).
        offset_bytes: u64,
        /// Length of the access (bytes).
        len_bytes: u64,
        /// Size of the buffer (bytes).
        capacity_bytes: u64,
    },
    /// GPU memory could not be registered for RDMA on any path: dma-buf
    /// (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`) and the plain
    /// device pointer (`ibv_reg_mr` through nvidia-peermem). Both causes are
    /// kept (dma-buf fails with EOPNOTSUPP or EFAULT on some NICs, nixl#1609;
    /// `ibv_reg_mr` without peermem with EFAULT, Mooncake#351).
    #[error(
        "GPU memory at {addr:#x}+{len_bytes} cannot be registered for RDMA: dma-buf path: {dmabuf}; \
         nvidia-peermem path (ibv_reg_mr on the device pointer): {peermem}"
    )]
    Registration {
        /// Start of the range.
        addr: u64,
        /// Length in bytes.
        len_bytes: u64,
        /// Why the dma-buf path failed (export or `ibv_reg_dmabuf_mr`).
        dmabuf: String,
        /// Why the plain-pointer path failed.
        peermem: String,
    },
}
