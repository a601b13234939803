//! The NIC as the verbs state machine (`State` in `state.rs`) sees it: a
//! few traits over queue pairs, registered notification memory and the
//! completion queue, with the verbs error codes (`VerbsError` keeps the
//! errno of the failing call).
//!
//! Implemented twice: by the real `verbs/` objects ([`QueuePair`],
//! [`MemoryRegion`], [`RealNic`] over a [`CompletionQueue`]) and by
//! [`super::sim::SimNic`], a deterministic simulator that runs every
//! state-machine test without RDMA hardware (as quinn-proto tests its
//! I/O-free core through an in-process pair).

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::verbs::{CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, VerbsError, WorkCompletion, WrBatch};

/// Registered memory the transport owns (notification slots): the NIC
/// reads it for SENDs and writes it for receives.
pub trait NicSlab: Send + Sync + 'static {
    /// Address of the first byte (as SGEs name it).
    fn addr(&self) -> u64;
    /// Local key.
    fn lkey(&self) -> u32;
    /// Length in bytes.
    fn len_bytes(&self) -> usize;
    /// Copy `data` in at `offset`; false when the range does not fit.
    /// Only for ranges no posted WR uses.
    fn write(&mut self, offset: usize, data: &[u8]) -> bool;
    /// A copy of `len` bytes at `offset` (None when out of range). Only for
    /// ranges the NIC finished writing (a completed receive).
    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>>;
}

/// One RC queue pair (connected by the connection manager).
pub trait NicQp: Send + 'static {
    /// Memory its receives land in.
    type Slab: NicSlab;
    /// The QP number (unique among live QPs of one device; reused after
    /// destroy).
    fn qp_num(&self) -> u32;
    /// Post a chained batch with one `ibv_post_send`.
    ///
    /// # Safety
    /// Every SGE's memory must be registered under its `lkey` and stay
    /// valid until its WR completes or the QP is destroyed (dropped).
    ///
    /// # Errors
    /// `(index of the first WR not posted, error)`: WRs before it were posted.
    unsafe fn post_send(&mut self, batch: &mut WrBatch) -> Result<(), (usize, VerbsError)>;
    /// Post one receive into `[offset, offset + len_bytes)` of `slab`; the
    /// QP keeps `slab` alive until it is destroyed.
    ///
    /// # Errors
    /// `ibv_post_recv`'s error, `EINVAL` when the range does not fit.
    fn post_recv(
        &mut self,
        wr_id: u64,
        slab: &Arc<Self::Slab>,
        offset: usize,
        len_bytes: u32,
    ) -> Result<(), VerbsError>;
    /// Move the QP to the error state: every posted WR is flushed with an
    /// `IBV_WC_WR_FLUSH_ERR` completion (signalled or not).
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error.
    fn set_error(&self) -> Result<(), VerbsError>;
}

/// A device context as the progress engine uses it: one completion queue
/// shared by every QP, QP creation (destroy = drop), notification memory.
pub trait Nic: Send + Sync {
    /// The device's queue pairs.
    type Qp: NicQp<Slab = Self::Slab>;
    /// The device's registered, transport-owned memory.
    type Slab: NicSlab;
    /// Poll up to `out.len()` completions; how many were written.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error (a CQ overrun on some providers).
    fn poll_cq(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError>;
    /// Ask for an event on the next completion (`ibv_req_notify_cq`).
    ///
    /// # Errors
    /// The call's error, or no completion channel.
    fn req_notify(&self) -> Result<(), VerbsError>;
    /// True when [`req_notify`](Self::req_notify) and
    /// [`wait_event`](Self::wait_event) work (a completion channel).
    fn has_events(&self) -> bool;
    /// Block until the armed CQ raises its event (consumed: true), `wake`
    /// is readable or `timeout_ms` passed (false).
    ///
    /// # Errors
    /// `poll(2)`'s or `ibv_get_cq_event`'s error, or no completion channel.
    fn wait_event(&self, wake: BorrowedFd<'_>, timeout_ms: i32) -> Result<bool, VerbsError>;
    /// A new RC QP on the shared CQ, `max_send_wr` deep, `max_recv_wr` receives.
    ///
    /// # Errors
    /// `ibv_create_qp`'s error.
    fn create_qp(&self, max_send_wr: u32, max_recv_wr: u32) -> Result<Self::Qp, VerbsError>;
    /// `len_bytes` of zeroed memory registered for local access.
    ///
    /// # Errors
    /// `ibv_reg_mr`'s error.
    fn alloc_slab(&self, len_bytes: usize) -> Result<Self::Slab, VerbsError>;
}

impl NicSlab for MemoryRegion {
    fn addr(&self) -> u64 {
        MemoryRegion::addr(self)
    }
    fn lkey(&self) -> u32 {
        MemoryRegion::lkey(self)
    }
    fn len_bytes(&self) -> usize {
        MemoryRegion::len_bytes(self)
    }
    fn write(&mut self, offset: usize, data: &[u8]) -> bool {
        self.write_owned(offset, data)
    }
    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        self.read_owned(offset, len)
    }
}

impl NicQp for QueuePair {
    type Slab = MemoryRegion;
    fn qp_num(&self) -> u32 {
        QueuePair::qp_num(self)
    }
    unsafe fn post_send(&mut self, batch: &mut WrBatch) -> Result<(), (usize, VerbsError)> {
        // SAFETY: the caller's contract is `QueuePair::post_send`'s.
        unsafe { QueuePair::post_send(self, batch) }
    }
    fn post_recv(
        &mut self,
        wr_id: u64,
        slab: &Arc<MemoryRegion>,
        offset: usize,
        len_bytes: u32,
    ) -> Result<(), VerbsError> {
        self.post_recv_owned(wr_id, slab, offset, len_bytes)
    }
    fn set_error(&self) -> Result<(), VerbsError> {
        QueuePair::set_error(self)
    }
}

/// The real device: a protection domain and the completion queue every QP
/// of the transport shares. The progress thread owns one (its engine runs
/// on it); the transport keeps a clone to create QPs and register memory.
#[derive(Clone)]
pub struct RealNic {
    /// Protection domain of every QP and MR.
    pub pd: Arc<ProtectionDomain>,
    /// The shared completion queue.
    pub cq: Arc<CompletionQueue>,
}

impl Nic for RealNic {
    type Qp = QueuePair;
    type Slab = MemoryRegion;
    fn poll_cq(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        self.cq.poll(out)
    }
    fn req_notify(&self) -> Result<(), VerbsError> {
        self.cq.arm()
    }
    fn has_events(&self) -> bool {
        self.cq.has_events()
    }
    fn wait_event(&self, wake: BorrowedFd<'_>, timeout_ms: i32) -> Result<bool, VerbsError> {
        self.cq.wait_event_or(Some(wake), timeout_ms)
    }
    fn create_qp(&self, max_send_wr: u32, max_recv_wr: u32) -> Result<QueuePair, VerbsError> {
        QueuePair::new(&self.pd, &self.cq, &self.cq, max_send_wr, max_recv_wr)
    }
    fn alloc_slab(&self, len_bytes: usize) -> Result<MemoryRegion, VerbsError> {
        MemoryRegion::alloc(&self.pd, len_bytes)
    }
}
