//! The RDMA registration chain for GPU memory (as pplx-garden's `fabric-lib`
//! and Mooncake's `WITH_NVIDIA_PEERMEM` opt-out do): (1) dma-buf
//! (`ibv_reg_dmabuf_mr` on the exported fd, iova = the original address),
//! (2) the plain device pointer (`ibv_reg_mr`, which works only with
//! nvidia-peermem), (3) [`CudaError::Registration`] naming both causes.
//!
//! The chain itself lives in the verbs transport
//! (`transport::verbs::gpu`, re-exported here); this module adds
//! [`GpuMemoryRegion`], which holds the backing with the region, and tests the
//! chain with fakes.

use std::fmt::Display;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use super::CudaError;
use crate::transport::MemoryBacking;

pub use crate::transport::verbs::gpu::{GpuRegistrationError, RegistrationPath, register_with_fallback};

impl From<GpuRegistrationError> for CudaError {
    fn from(e: GpuRegistrationError) -> Self {
        CudaError::Registration { addr: e.addr, len_bytes: e.len_bytes, dmabuf: e.dmabuf, peermem: e.peermem }
    }
}

/// A memory region over GPU memory that keeps the memory (and its dma-buf fd)
/// alive: the region `R` is dropped (deregistered) first, then the backing,
/// so the memory can never be freed while registered.
pub struct GpuMemoryRegion<R> {
    // Field order is drop order: the region before the memory it covers.
    region: R,
    path: RegistrationPath,
    backing: Arc<dyn MemoryBacking>,
}

impl<R> GpuMemoryRegion<R> {
    /// Register `backing` (its whole [`desc`](MemoryBacking::desc) range)
    /// through the chain, using its [`dmabuf_fd`](MemoryBacking::dmabuf_fd)
    /// when it has one.
    ///
    /// # Errors
    /// As [`register_with_fallback`].
    pub fn register<E1: Display, E2: Display>(
        backing: Arc<dyn MemoryBacking>,
        reg_dmabuf: impl FnOnce(BorrowedFd<'_>, u64, u64, u64) -> Result<R, E1>,
        reg_ptr: impl FnOnce(u64, u64) -> Result<R, E2>,
    ) -> Result<Self, CudaError> {
        let d = backing.desc();
        let fd = backing.dmabuf_fd().ok_or_else(|| "the memory exports no dma-buf".to_string());
        let (region, path) = register_with_fallback(d.addr, d.len_bytes, fd, reg_dmabuf, reg_ptr)?;
        Ok(Self { region, path, backing })
    }

    /// The verbs memory region.
    pub fn region(&self) -> &R {
        &self.region
    }

    /// Which path succeeded.
    pub fn path(&self) -> RegistrationPath {
        self.path
    }

    /// The registered memory.
    pub fn backing(&self) -> &Arc<dyn MemoryBacking> {
        &self.backing
    }
}

impl<R: std::fmt::Debug> std::fmt::Debug for GpuMemoryRegion<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuMemoryRegion").field("region", &self.region).field("path", &self.path).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, BorrowedFd};
    use std::sync::Mutex;

    use super::*;
    use crate::transport::{MemoryDesc, MemoryKind};

    /// Fake VRAM with a dma-buf (any fd stands in for it).
    struct FakeVram {
        file: Option<std::fs::File>,
        log: Arc<Mutex<Vec<String>>>,
    }

    // SAFETY: test double: the fake device range is only handed to the fake
    // verbs calls of these tests, which never dereference it.
    unsafe impl MemoryBacking for FakeVram {
        fn desc(&self) -> MemoryDesc {
            MemoryDesc { addr: 0x7000_0000_1000, len_bytes: 8192, kind: MemoryKind::Vram, device_id: 1 }
        }
        fn dmabuf_fd(&self) -> Option<(BorrowedFd<'_>, u64)> {
            self.file.as_ref().map(|f| (f.as_fd(), 0x1000))
        }
    }

    impl Drop for FakeVram {
        fn drop(&mut self) {
            self.log.lock().unwrap().push("free".into());
        }
    }

    #[derive(Debug)]
    struct FakeMr(&'static str, Arc<Mutex<Vec<String>>>);
    impl Drop for FakeMr {
        fn drop(&mut self) {
            self.1.lock().unwrap().push(format!("dereg {}", self.0));
        }
    }

    fn vram(dmabuf: bool, log: &Arc<Mutex<Vec<String>>>) -> Arc<dyn MemoryBacking> {
        let file = dmabuf.then(|| std::fs::File::open("/dev/null").unwrap());
        Arc::new(FakeVram { file, log: log.clone() })
    }

    #[test]
    fn dmabuf_first_with_iova_and_offset() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        let mr = GpuMemoryRegion::register(
            vram(true, &log),
            |_fd, off, len, iova| {
                assert_eq!((off, len, iova), (0x1000, 8192, 0x7000_0000_1000));
                Ok::<_, String>(FakeMr("dmabuf", l))
            },
            |_, _| -> Result<FakeMr, String> { panic!("peermem tried after dma-buf worked") },
        )
        .unwrap();
        assert_eq!(mr.path(), RegistrationPath::DmaBuf);
        drop(mr);
        assert_eq!(*log.lock().unwrap(), ["dereg dmabuf", "free"], "deregistered before freed");
    }

    #[test]
    fn peermem_when_dmabuf_fails_or_is_absent() {
        let log = Arc::new(Mutex::new(Vec::new()));
        for has_dmabuf in [true, false] {
            let l = log.clone();
            let mr = GpuMemoryRegion::register(
                vram(has_dmabuf, &log),
                |_, _, _, _| Err("Operation not supported (os error 95)"),
                |addr, len| {
                    assert_eq!((addr, len), (0x7000_0000_1000, 8192));
                    Ok::<_, String>(FakeMr("ptr", l))
                },
            )
            .unwrap();
            assert_eq!(mr.path(), RegistrationPath::PeerMem);
        }
    }

    #[test]
    fn both_failing_names_both_causes() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let e = GpuMemoryRegion::<FakeMr>::register(
            vram(true, &log),
            |_, _, _, _| Err("Operation not supported (os error 95)"),
            |_, _| Err("Bad address (os error 14)"),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, CudaError::Registration { .. }));
        assert!(msg.contains("ibv_reg_dmabuf_mr: Operation not supported"), "{msg}");
        assert!(msg.contains("nvidia-peermem") && msg.contains("Bad address"), "{msg}");
        let e = GpuMemoryRegion::<FakeMr>::register(
            vram(false, &log),
            |_, _, _, _| -> Result<FakeMr, String> { panic!("no fd, so no dma-buf call") },
            |_, _| Err("Bad address (os error 14)"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("no dma-buf export: the memory exports no dma-buf"), "{e}");
    }
}
