//! The RDMA registration chain for GPU memory (as pplx-garden's `fabric-lib`
//! and Mooncake's `WITH_NVIDIA_PEERMEM` opt-out do): (1) dma-buf
//! (`ibv_reg_dmabuf_mr` on the exported fd, iova = the original address),
//! (2) the plain device pointer (`ibv_reg_mr`, which works only with
//! nvidia-peermem), (3) [`CudaError::Registration`] naming both causes.
//!
//! The chain itself lives in the verbs transport
//! (`transport::verbs::gpu`, re-exported here), and it is the one path:
//! `VerbsTransport::register` runs it for VRAM and keeps the backing with
//! the region (deregistering first). This module tests the chain with fakes.

use super::CudaError;

pub use crate::transport::verbs::gpu::{GpuRegistrationError, RegistrationPath, register_with_fallback};

impl From<GpuRegistrationError> for CudaError {
    fn from(e: GpuRegistrationError) -> Self {
        CudaError::Registration { addr: e.addr, len_bytes: e.len_bytes, dmabuf: e.dmabuf, peermem: e.peermem }
    }
}

#[cfg(test)]
mod tests {
    use std::fmt::Display;
    use std::os::fd::{AsFd, BorrowedFd};
    use std::sync::Arc;

    use super::*;
    use crate::transport::{MemoryBacking, MemoryDesc, MemoryKind};

    /// Fake VRAM with a dma-buf (any fd stands in for it).
    struct FakeVram {
        file: Option<std::fs::File>,
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

    fn vram(dmabuf: bool) -> Arc<dyn MemoryBacking> {
        let file = dmabuf.then(|| std::fs::File::open("/dev/null").unwrap());
        Arc::new(FakeVram { file })
    }

    /// The chain over `b` as `VerbsTransport::register` runs it for VRAM.
    fn chain<R, E1: Display, E2: Display>(
        b: &Arc<dyn MemoryBacking>,
        reg_dmabuf: impl FnOnce(BorrowedFd<'_>, u64, u64, u64) -> Result<R, E1>,
        reg_ptr: impl FnOnce(u64, u64) -> Result<R, E2>,
    ) -> Result<(R, RegistrationPath), CudaError> {
        let d = b.desc();
        let fd = b.dmabuf_fd().ok_or_else(|| "the memory exports no dma-buf".to_string());
        Ok(register_with_fallback(d.addr, d.len_bytes, fd, reg_dmabuf, reg_ptr)?)
    }

    #[test]
    fn dmabuf_first_with_iova_and_offset() {
        let (mr, path) = chain(
            &vram(true),
            |_fd, off, len, iova| {
                assert_eq!((off, len, iova), (0x1000, 8192, 0x7000_0000_1000));
                Ok::<_, String>("dmabuf")
            },
            |_, _| -> Result<&str, String> { panic!("peermem tried after dma-buf worked") },
        )
        .unwrap();
        assert_eq!((mr, path), ("dmabuf", RegistrationPath::DmaBuf));
    }

    #[test]
    fn peermem_when_dmabuf_fails_or_is_absent() {
        for has_dmabuf in [true, false] {
            let (mr, path) = chain(
                &vram(has_dmabuf),
                |_, _, _, _| Err("Operation not supported (os error 95)"),
                |addr, len| {
                    assert_eq!((addr, len), (0x7000_0000_1000, 8192));
                    Ok::<_, String>("ptr")
                },
            )
            .unwrap();
            assert_eq!((mr, path), ("ptr", RegistrationPath::PeerMem));
        }
    }

    #[test]
    fn both_failing_names_both_causes() {
        let e = chain::<(), _, _>(
            &vram(true),
            |_, _, _, _| Err("Operation not supported (os error 95)"),
            |_, _| Err("Bad address (os error 14)"),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, CudaError::Registration { .. }));
        assert!(msg.contains("ibv_reg_dmabuf_mr: Operation not supported"), "{msg}");
        assert!(msg.contains("nvidia-peermem") && msg.contains("Bad address"), "{msg}");
        let e = chain::<(), _, _>(
            &vram(false),
            |_, _, _, _| -> Result<(), String> { panic!("no fd, so no dma-buf call") },
            |_, _| Err("Bad address (os error 14)"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("no dma-buf export: the memory exports no dma-buf"), "{e}");
    }
}
