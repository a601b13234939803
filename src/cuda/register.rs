//! The RDMA registration chain for GPU memory (as pplx-garden's `fabric-lib`
//! and Mooncake's `WITH_NVIDIA_PEERMEM` opt-out do): (1) dma-buf
//! (`ibv_reg_dmabuf_mr` on the exported fd, iova = the original address),
//! (2) the plain device pointer (`ibv_reg_mr`, which works only with
//! nvidia-peermem), (3) [`CudaError::Registration`] naming both causes.
//!
//! Generic over the verbs layer: the two registration calls are closures,
//! so the chain is tested here with fakes, and the verbs transport plugs in
//! `MemoryRegion::register_dmabuf` / `MemoryRegion::register`.

use std::fmt::Display;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use super::CudaError;
use crate::transport::MemoryBacking;

/// Which path registered the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistrationPath {
    /// `ibv_reg_dmabuf_mr` on a dma-buf export.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer (nvidia-peermem).
    PeerMem,
}

/// Run the chain for `[addr, addr + len_bytes)`. `dmabuf` is the exported
/// `(fd, offset)` or why there is none; `reg_dmabuf(fd, offset, len, iova)`
/// and `reg_ptr(addr, len)` are the two verbs calls.
///
/// # Errors
/// [`CudaError::Registration`] with both causes when both paths fail.
pub fn register_with_fallback<R, E1: Display, E2: Display>(
    addr: u64,
    len_bytes: u64,
    dmabuf: Result<(BorrowedFd<'_>, u64), String>,
    reg_dmabuf: impl FnOnce(BorrowedFd<'_>, u64, u64, u64) -> Result<R, E1>,
    reg_ptr: impl FnOnce(u64, u64) -> Result<R, E2>,
) -> Result<(R, RegistrationPath), CudaError> {
    let dmabuf_cause = match dmabuf {
        Ok((fd, offset)) => match reg_dmabuf(fd, offset, len_bytes, addr) {
            Ok(r) => return Ok((r, RegistrationPath::DmaBuf)),
            Err(e) => format!("ibv_reg_dmabuf_mr: {e}"),
        },
        Err(why) => format!("no dma-buf export: {why}"),
    };
    match reg_ptr(addr, len_bytes) {
        Ok(r) => {
            tracing::info!("GPU memory {addr:#x}+{len_bytes} registered through nvidia-peermem ({dmabuf_cause})");
            Ok((r, RegistrationPath::PeerMem))
        }
        Err(e) => Err(CudaError::Registration { addr, len_bytes, dmabuf: dmabuf_cause, peermem: e.to_string() }),
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
