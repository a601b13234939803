//! dma-buf export of GPU memory (`cuMemGetHandleForAddressRange`), the first
//! RDMA registration path (NVIDIA's GPUDirect RDMA docs recommend DMA-BUF
//! where supported; Mooncake defaults to it).
//!
//! The exported range must be host-page aligned and lie inside one
//! allocation. [`export_range`] computes it (pure, tested everywhere): the
//! registration then passes `offset = addr - aligned_base` into the dma-buf
//! and `iova = addr`, so that peers keep addressing plain virtual addresses.

use super::CudaError;

/// A page-aligned range to export, and where the wanted bytes start in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportRange {
    /// Aligned start (bytes, a device virtual address).
    pub base: u64,
    /// Aligned length (bytes).
    pub len_bytes: u64,
    /// `addr - base`: the offset to pass to `ibv_reg_dmabuf_mr`.
    pub offset: u64,
}

/// The page-aligned range covering `[addr, addr + len_bytes)`, which must lie
/// inside the allocation `[alloc_base, alloc_base + alloc_len)`.
///
/// # Errors
/// [`CudaError::Unsupported`] when `page_bytes` is not a power of two,
/// `len_bytes` is 0, the range leaves the allocation, or its aligned cover
/// does (an allocation that is not page-aligned itself).
pub fn export_range(
    addr: u64,
    len_bytes: u64,
    alloc_base: u64,
    alloc_len: u64,
    page_bytes: u64,
) -> Result<ExportRange, CudaError> {
    let bad = |why: String| Err(CudaError::Unsupported(format!("dma-buf export of {addr:#x}+{len_bytes}: {why}")));
    if !page_bytes.is_power_of_two() {
        return bad(format!("page size {page_bytes} is not a power of two"));
    }
    if len_bytes == 0 {
        return bad("empty range".into());
    }
    let (Some(end), Some(alloc_end)) = (addr.checked_add(len_bytes), alloc_base.checked_add(alloc_len)) else {
        return bad("address overflow".into());
    };
    if addr < alloc_base || end > alloc_end {
        return bad(format!("outside its allocation {alloc_base:#x}+{alloc_len}"));
    }
    let base = addr & !(page_bytes - 1);
    let Some(aligned_end) = end.checked_add(page_bytes - 1).map(|e| e & !(page_bytes - 1)) else {
        return bad("address overflow".into());
    };
    if base < alloc_base || aligned_end > alloc_end {
        return bad(format!(
            "its {page_bytes}-byte aligned cover {base:#x}..{aligned_end:#x} leaves the allocation \
             {alloc_base:#x}+{alloc_len}"
        ));
    }
    Ok(ExportRange { base, len_bytes: aligned_end - base, offset: addr - base })
}

/// The host page size (`sysconf(_SC_PAGESIZE)`), 4096 if unknown.
pub fn host_page_bytes() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 { v as u64 } else { 4096 }
}

#[cfg(feature = "cuda")]
pub use imp::{DmaBuf, export_dmabuf};

#[cfg(feature = "cuda")]
mod imp {
    use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

    use cudarc::driver::sys;

    use super::{ExportRange, export_range, host_page_bytes};
    use crate::cuda::CudaError;
    use crate::cuda::driver::{GpuContext, check, has_symbol};
    use crate::cuda::probe::attribute;

    /// An exported dma-buf: the fd (closed on drop, so keep this alive until
    /// every memory region registered from it is deregistered) and the range.
    #[derive(Debug)]
    pub struct DmaBuf {
        fd: OwnedFd,
        range: ExportRange,
    }

    impl DmaBuf {
        /// The dma-buf file descriptor.
        pub fn fd(&self) -> BorrowedFd<'_> {
            self.fd.as_fd()
        }

        /// The exported range; `range().offset` is where the asked-for
        /// address lies in the dma-buf.
        pub fn range(&self) -> ExportRange {
            self.range
        }
    }

    /// Export `[addr, addr + len_bytes)` of GPU memory owned by `ctx`'s GPU
    /// as a dma-buf, rounded out to host pages inside its allocation.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when the driver lacks
    /// `cuMemGetHandleForAddressRange` (before CUDA 11.7), the GPU lacks
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (closed kernel modules,
    /// pre-Turing), or the range cannot be aligned ([`export_range`]);
    /// [`CudaError::Driver`] for `cuMemGetAddressRange_v2` (not device
    /// memory) or `cuMemGetHandleForAddressRange`.
    pub fn export_dmabuf(ctx: &GpuContext, addr: u64, len_bytes: u64) -> Result<DmaBuf, CudaError> {
        if !has_symbol("cuMemGetHandleForAddressRange") {
            return Err(CudaError::Unsupported("driver lacks cuMemGetHandleForAddressRange (CUDA < 11.7)".into()));
        }
        let supported =
            attribute(ctx.device(), sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED).unwrap_or(0);
        if supported == 0 {
            return Err(CudaError::Unsupported(format!(
                "GPU {} lacks CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (needs the open kernel modules, Turing or newer)",
                ctx.ordinal()
            )));
        }
        ctx.bind()?;
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: context bound; out-pointers valid.
        check("cuMemGetAddressRange_v2", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) })?;
        let range = export_range(addr, len_bytes, base, size as u64, host_page_bytes())?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: symbol present; the range is page-aligned inside one
        // allocation; the handle out-pointer is an int for DMA_BUF_FD.
        check("cuMemGetHandleForAddressRange", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                range.base,
                range.len_bytes as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CudaError::Unsupported("cuMemGetHandleForAddressRange returned no fd".into()));
        }
        // SAFETY: the driver handed us a new fd we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBuf { fd, range })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    #[test]
    fn aligned_ranges_export_as_is() {
        let r = export_range(0x7f00_0000_0000, 8 * P, 0x7f00_0000_0000, 16 * P, P).unwrap();
        assert_eq!(r, ExportRange { base: 0x7f00_0000_0000, len_bytes: 8 * P, offset: 0 });
    }

    #[test]
    fn unaligned_ranges_round_out_with_an_offset() {
        let base = 0x10_0000;
        let r = export_range(base + P + 100, 2 * P, base, 1 << 21, P).unwrap();
        assert_eq!(r, ExportRange { base: base + P, len_bytes: 3 * P, offset: 100 });
        // exactly one byte into the next page
        let r = export_range(base + P - 1, 2, base, 4 * P, P).unwrap();
        assert_eq!(r, ExportRange { base, len_bytes: 2 * P, offset: P - 1 });
    }

    #[test]
    fn ranges_leaving_the_allocation_are_refused() {
        let base = 0x10_0000;
        assert!(export_range(base, 2 * P, base, P, P).is_err());
        assert!(export_range(base - 1, 10, base, P, P).is_err());
        // allocation not page-aligned: its cover would leave it
        let e = export_range(base + 256, 100, base + 256, P, P).unwrap_err();
        assert!(e.to_string().contains("aligned cover"), "{e}");
        assert!(export_range(base, 0, base, P, P).is_err());
        assert!(export_range(base, 10, base, P, 3000).is_err());
        assert!(export_range(u64::MAX - 10, 100, 0, u64::MAX, P).is_err());
    }
}
