//! The device as `VerbsTransport` uses it outside the progress engine: what
//! [`Nic`] gives the engine (QPs, the shared CQ, notification memory) plus
//! memory registration and bringing a QP to RTS with the endpoint its peer
//! sent in the handshake (`conn.rs`).
//!
//! Implemented by [`RealNic`] (libibverbs) and, with the `sim` feature, by
//! the simulated NIC (`sim/nic.rs`): there the same transport, handshake
//! and liveness channel run over one in-process
//! [`SimFabric`](super::sim::SimFabric), QPs connected by the QP numbers the
//! handshake exchanged (`VerbsTransport::on_sim`).

use std::sync::Arc;

use super::gpu;
use super::nic::{Nic, RealNic};
use crate::transport::{MemoryBacking, MemoryDesc, MemoryKind, TransportError};
use crate::verbs::{MemoryRegion, QpEndpoint, QpOptions, VerbsError};

/// A registered memory region of a [`Device`]: dropping it deregisters it.
pub struct Registered<M> {
    /// The region (deregistered on drop).
    pub mr: M,
    /// Its local key (SGEs name it).
    pub lkey: u32,
    /// Its remote key (peers' RDMA WRs name it).
    pub rkey: u32,
}

/// A device the verbs transport runs on (see the module docs).
pub trait Device: Nic + Clone + 'static {
    /// A registered memory region (deregistered when dropped).
    type Mr: Send + 'static;

    /// Register `desc` (host or GPU memory; `first` is the backing that
    /// starts the range, whose dma-buf export a VRAM run uses).
    ///
    /// # Safety
    /// `[desc.addr, desc.addr + desc.len_bytes)` must stay valid memory
    /// until the returned region is dropped (the registration table keeps
    /// every backing of the range alive until then).
    ///
    /// # Errors
    /// [`TransportError::Registration`] naming the failing call.
    unsafe fn register(
        &self,
        desc: &MemoryDesc,
        first: &Arc<dyn MemoryBacking>,
    ) -> Result<Registered<Self::Mr>, TransportError>;

    /// What the peer needs to connect to `qp` (sent in the handshake).
    ///
    /// # Errors
    /// The port or GID query's error.
    fn endpoint(&self, qp: &Self::Qp, o: &QpOptions) -> Result<QpEndpoint, VerbsError>;

    /// Bring `qp` (described by `local`) to RTS connected to `remote`.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error (an unknown remote QP on the simulator).
    fn connect(&self, qp: &Self::Qp, local: &QpEndpoint, remote: &QpEndpoint, o: &QpOptions) -> Result<(), VerbsError>;
}

impl Device for RealNic {
    type Mr = MemoryRegion;

    unsafe fn register(
        &self,
        d: &MemoryDesc,
        first: &Arc<dyn MemoryBacking>,
    ) -> Result<Registered<MemoryRegion>, TransportError> {
        let pd = &self.pd;
        let len = usize::try_from(d.len_bytes).map_err(|_| TransportError::Registration("range too large".into()))?;
        let reg = |e: VerbsError| TransportError::Registration(e.to_string());
        let mr = match d.kind {
            // GPU memory: dma-buf, then the plain pointer (nvidia-peermem),
            // else an error naming both causes (the chain of `cuda::register`).
            MemoryKind::Vram => {
                let dmabuf = first.dmabuf_fd().ok_or_else(|| "the memory exports no dma-buf".to_string());
                gpu::register_with_fallback(
                    d.addr,
                    d.len_bytes,
                    dmabuf,
                    // SAFETY: the caller keeps the range valid until the MR
                    // drops (this function's contract). A VRAM run spans one
                    // dma-buf export (`regions.rs`).
                    |fd, off, _, iova| unsafe { MemoryRegion::register_dmabuf(pd, fd, off, len, iova) },
                    // SAFETY: as above.
                    |addr, _| unsafe { MemoryRegion::register(pd, addr, len) },
                )
                .map(|(mr, _path)| mr)
                .map_err(|e| TransportError::Registration(e.to_string()))?
            }
            // SAFETY: as above (host memory).
            MemoryKind::Dram => unsafe { MemoryRegion::register(pd, d.addr, len).map_err(reg)? },
        };
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        Ok(Registered { mr, lkey, rkey })
    }

    fn endpoint(&self, qp: &crate::verbs::QueuePair, o: &QpOptions) -> Result<QpEndpoint, VerbsError> {
        qp.endpoint(o)
    }

    fn connect(
        &self,
        qp: &crate::verbs::QueuePair,
        local: &QpEndpoint,
        remote: &QpEndpoint,
        o: &QpOptions,
    ) -> Result<(), VerbsError> {
        qp.connect(local, remote, o)
    }
}
