//! Memory regions: host memory, dma-buf GPU memory, or a plain device
//! pointer (nvidia-peermem). The GPU issue adds only the CUDA side.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use super::ffi::*;
use super::{ProtectionDomain, VerbsError, record_drop_failure};

/// Local write, remote read, remote write; relaxed ordering where the device
/// supports it (an optional flag: ignored by devices that do not).
pub const DEFAULT_ACCESS: i32 =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_RELAXED_ORDERING;

/// `struct ibv_mr`; deregistered on drop, before its PD, and before any
/// buffer it owns is freed.
pub struct MemoryRegion {
    raw: NonNull<ibv_mr>,
    pd: Arc<ProtectionDomain>,
    /// A buffer the MR owns (`Box<[u64]>` turned raw, so that the NIC and
    /// [`MemoryRegion::write_owned`] may write it while `&self` exists;
    /// freed after deregistration).
    owned: Option<NonNull<[u64]>>,
}

// SAFETY: an MR is an immutable handle after registration.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Register `[addr, addr + len_bytes)` of host (or peermem-mapped GPU)
    /// memory with [`DEFAULT_ACCESS`].
    ///
    /// # Safety
    /// The range must stay valid (mapped, not freed) until this MR is
    /// dropped: the NIC may read or write it until then.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_reg_mr` (e.g. `ENOMEM` from `ulimit -l`,
    /// `EFAULT` for a GPU pointer without nvidia-peermem).
    pub unsafe fn register(pd: &Arc<ProtectionDomain>, addr: u64, len_bytes: usize) -> Result<Self, VerbsError> {
        let lib = pd.ctx.lib;
        let ptr = addr as *mut c_void;
        let raw = match lib.reg_mr_iova2 {
            // SAFETY: live PD; the caller guarantees the range.
            Some(f) => unsafe { f(pd.raw.as_ptr(), ptr, len_bytes, addr, DEFAULT_ACCESS as u32) },
            None => std::ptr::null_mut(),
        };
        let raw = if raw.is_null() {
            // SAFETY: as above; older libraries lack iova2 and reject the
            // optional relaxed-ordering flag, so drop it here.
            unsafe { (lib.reg_mr)(pd.raw.as_ptr(), ptr, len_bytes, DEFAULT_ACCESS & !IBV_ACCESS_RELAXED_ORDERING) }
        } else {
            raw
        };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::call("ibv_reg_mr", 0))?;
        Ok(Self { raw, pd: pd.clone(), owned: None })
    }

    /// Register GPU memory exported as a dma-buf: `len_bytes` from `offset`
    /// in `fd`, addressed by peers as `iova` (the GPU virtual address).
    ///
    /// # Safety
    /// The exported memory must stay allocated until this MR is dropped.
    ///
    /// # Errors
    /// [`VerbsError::Unsupported`] when libibverbs lacks `ibv_reg_dmabuf_mr`
    /// (before rdma-core 34); [`VerbsError::Call`] when it fails (the caller
    /// may then fall back to [`MemoryRegion::register`] with the pointer).
    pub unsafe fn register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        fd: BorrowedFd<'_>,
        offset: u64,
        len_bytes: usize,
        iova: u64,
    ) -> Result<Self, VerbsError> {
        let f = pd
            .ctx
            .lib
            .reg_dmabuf_mr
            .ok_or_else(|| VerbsError::Unsupported("libibverbs lacks ibv_reg_dmabuf_mr (rdma-core < 34)".into()))?;
        // SAFETY: live PD and fd; the caller guarantees the memory.
        let raw = unsafe { f(pd.raw.as_ptr(), offset, len_bytes, iova, fd.as_raw_fd(), DEFAULT_ACCESS) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::call("ibv_reg_dmabuf_mr", 0))?;
        Ok(Self { raw, pd: pd.clone(), owned: None })
    }

    /// Allocate a zeroed, 8-byte-aligned buffer of `len_bytes` and register
    /// it; the MR owns it.
    ///
    /// # Errors
    /// As [`MemoryRegion::register`].
    pub fn alloc(pd: &Arc<ProtectionDomain>, len_bytes: usize) -> Result<Self, VerbsError> {
        let buf = NonNull::from(Box::leak(vec![0u64; len_bytes.div_ceil(8).max(1)].into_boxed_slice()));
        // SAFETY: the buffer is handed to the MR below and freed only after
        // deregistration (Drop); on failure it is freed here, unregistered.
        match unsafe { Self::register(pd, buf.as_ptr() as *mut u64 as u64, len_bytes.max(1)) } {
            Ok(mut mr) => {
                mr.owned = Some(buf);
                Ok(mr)
            }
            Err(e) => {
                // SAFETY: from Box::leak above, not registered, not aliased.
                drop(unsafe { Box::from_raw(buf.as_ptr()) });
                Err(e)
            }
        }
    }

    /// Start address of the registered range.
    pub fn addr(&self) -> u64 {
        // SAFETY: `raw` is a live MR; fields are read-only after creation.
        unsafe { (*self.raw.as_ptr()).addr as u64 }
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).length }
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// The owned buffer, if [`MemoryRegion::alloc`] made it, as a raw pointer
    /// (the NIC may write it concurrently: read it only for completed work).
    pub fn owned_ptr(&self) -> Option<*mut u8> {
        self.owned.map(|b| b.as_ptr() as *mut u8)
    }

    /// `[offset, offset + len)` of the owned buffer, when there is one and
    /// the range fits.
    fn owned_range(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        (end <= self.len_bytes()).then_some(())?;
        // `wrapping_add` cannot leave the allocation: `end` is in bounds.
        self.owned_ptr().map(|p| p.wrapping_add(offset))
    }

    /// Copy `data` into the owned buffer at `offset`; false (nothing
    /// written) when the MR owns no buffer or the range does not fit.
    /// The buffer is shared with the NIC (like shared memory with another
    /// process): write only ranges that no posted work request uses, or the
    /// NIC sends a mix of old and new bytes.
    pub fn write_owned(&mut self, offset: usize, data: &[u8]) -> bool {
        let Some(dst) = self.owned_range(offset, data.len()) else {
            return false;
        };
        // SAFETY: in bounds of the owned allocation (checked), which no Rust
        // reference covers (it is held raw) and `&mut self` excludes other
        // writers on this side; `data` cannot overlap it (no `&[u8]` to it
        // is ever handed out).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        true
    }

    /// A copy of `len` bytes of the owned buffer at `offset` (None when the
    /// MR owns no buffer or the range does not fit). Read ranges the NIC has
    /// finished writing (a completed receive), or the bytes may be mixed.
    pub fn read_owned(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let src = self.owned_range(offset, len)?;
        let mut out = vec![0u8; len];
        // SAFETY: in bounds of the owned allocation (checked); `out` is new.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), len) };
        Some(out)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: live MR, deregistered once; `owned` is freed after this.
        let rc = unsafe { (self.pd.ctx.lib.dereg_mr)(self.raw.as_ptr()) };
        if rc != 0 {
            record_drop_failure("ibv_dereg_mr", rc);
            // The NIC may still reach the buffer: leak it rather than free it.
            return;
        }
        if let Some(b) = self.owned.take() {
            // SAFETY: from Box::leak in `alloc`, deregistered just now, and
            // no reference to it outlives `self`.
            drop(unsafe { Box::from_raw(b.as_ptr()) });
        }
    }
}
