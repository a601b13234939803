//! GPU memory: VRAM KV caches through the CUDA driver API (cudarc, loaded at
//! run time), GPUDirect RDMA registration, GPU↔host copies, and NIC choice.
//!
//! The only module that imports cudarc. Nothing CUDA is needed to build;
//! without `libcuda` (or without the `cuda` cargo feature) [`probe`] reports
//! no device and says why, and every constructor returns
//! [`CudaError::NoDriver`] / [`CudaError::NoDevice`]; nothing panics.
//!
//! - [`probe`]: devices, driver version, PCIe bus ids, dma-buf support.
//! - `DeviceBuffer`: VRAM as a [`MemoryBacking`](crate::transport::MemoryBacking)
//!   with `kind: Vram`, usable as a `KvBuffer` shard (MAX `KVCacheMemory`);
//!   `ExternalDeviceMemory`: the same for VRAM an inference engine allocated.
//! - [`register`]: the RDMA registration chain (dma-buf, then
//!   nvidia-peermem, then an error naming both causes), generic over the verbs
//!   calls; [`dmabuf`]: the export and its page alignment.
//! - `Stream` / `Event`: ordering GPU work before the NIC reads (see
//!   the `stream` module docs); `CopyStreams` / `PinnedHostBuffer` /
//!   `PendingCopy`: asynchronous H2D/D2H copies completed by event query.
//! - [`nic`]: the RDMA device closest to a GPU on PCIe.
//!
//! Thread safety: every type is `Send + Sync`; each driver call binds the
//! GPU's primary context to the calling thread first. Cleanup: buffers,
//! streams, events and pinned memory are released on drop (failures are
//! logged, never panicked on); a buffer drains its stream and closes its
//! dma-buf before its memory is freed, and anything registered or copying
//! holds an `Arc` of it.

pub mod dmabuf;
mod error;
pub mod nic;
mod probe;
pub mod register;

#[cfg(feature = "cuda")]
mod buffer;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod external;
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
mod stream;

pub use error::CudaError;
pub use probe::{GpuInfo, ProbeReport, probe};
pub use register::{RegistrationPath, register_with_fallback};

#[cfg(feature = "cuda")]
pub use buffer::{ALLOC_ALIGN_BYTES, DeviceBuffer};
#[cfg(feature = "cuda")]
pub use driver::GpuContext;
#[cfg(feature = "cuda")]
pub use external::ExternalDeviceMemory;
#[cfg(feature = "cuda")]
pub use pinned::{CopyDirection, CopyStreams, PendingCopy, PinnedHostBuffer};
#[cfg(feature = "cuda")]
pub use stream::{Event, Stream};

/// True when this build includes the CUDA code paths (the `cuda` feature).
pub const fn compiled_in() -> bool {
    cfg!(feature = "cuda")
}
