//! The registration chain for GPU memory on a verbs NIC: (1) dma-buf
//! (`ibv_reg_dmabuf_mr` on the exported fd, iova = the original address),
//! (2) the plain device pointer (`ibv_reg_mr`, which works only with
//! nvidia-peermem), (3) [`GpuRegistrationError`] naming both causes.
//!
//! Generic over the verbs layer: the two registration calls are closures,
//! so the chain is tested with fakes (`kvwire::cuda`'s tests), and
//! [`VerbsTransport`](super::VerbsTransport) plugs in
//! `MemoryRegion::register_dmabuf` / `MemoryRegion::register`. It lives here,
//! in the transport, because registration is the transport's job; the `cuda`
//! layer above re-exports it.

use std::fmt::Display;
use std::os::fd::BorrowedFd;

/// Which path registered the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistrationPath {
    /// `ibv_reg_dmabuf_mr` on a dma-buf export.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer (nvidia-peermem).
    PeerMem,
}

/// Both paths of the chain failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "GPU memory at {addr:#x}+{len_bytes} cannot be registered for RDMA: dma-buf path: {dmabuf}; \
     nvidia-peermem path (ibv_reg_mr on the device pointer): {peermem}"
)]
pub struct GpuRegistrationError {
    /// Start of the range.
    pub addr: u64,
    /// Length in bytes.
    pub len_bytes: u64,
    /// Why the dma-buf path failed (export or `ibv_reg_dmabuf_mr`).
    pub dmabuf: String,
    /// Why the plain-pointer path failed.
    pub peermem: String,
}

/// Run the chain for `[addr, addr + len_bytes)`. `dmabuf` is the exported
/// `(fd, offset)` or why there is none; `reg_dmabuf(fd, offset, len, iova)`
/// and `reg_ptr(addr, len)` are the two verbs calls.
///
/// # Errors
/// [`GpuRegistrationError`] with both causes when both paths fail.
pub fn register_with_fallback<R, E1: Display, E2: Display>(
    addr: u64,
    len_bytes: u64,
    dmabuf: Result<(BorrowedFd<'_>, u64), String>,
    reg_dmabuf: impl FnOnce(BorrowedFd<'_>, u64, u64, u64) -> Result<R, E1>,
    reg_ptr: impl FnOnce(u64, u64) -> Result<R, E2>,
) -> Result<(R, RegistrationPath), GpuRegistrationError> {
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
        Err(e) => Err(GpuRegistrationError { addr, len_bytes, dmabuf: dmabuf_cause, peermem: e.to_string() }),
    }
}
