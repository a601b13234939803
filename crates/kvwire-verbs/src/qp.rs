//! RC queue pairs: creation, RESET → INIT → RTR → RTS, posting.

use std::ptr::NonNull;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ffi::*;
use super::wr::WrBatch;
use super::{CompletionQueue, MemoryRegion, ProtectionDomain, VerbsError, record_drop_failure};

/// What a peer needs to connect to one of our QPs (exchanged at connect).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number.
    pub psn: u32,
    /// Port GID (RoCE; zero on InfiniBand without GRH).
    pub gid: [u8; 16],
    /// Port LID (InfiniBand).
    pub lid: u16,
    /// Port active MTU (`enum ibv_mtu`).
    pub mtu: u32,
    /// RDMA READs this QP accepts in flight as responder
    /// (`max_dest_rd_atomic`): the peer issues no more than that.
    pub rd_atom: u8,
}

/// Connection parameters of a QP.
#[derive(Debug, Clone, Copy)]
pub struct QpOptions {
    /// 1-based port.
    pub port: u8,
    /// `Some(index)`: RoCE / global routing with this source GID index;
    /// `None`: InfiniBand LID routing.
    pub gid_index: Option<u8>,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR`.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Outstanding RDMA READs we issue (≤ the device's
    /// `max_qp_init_rd_atom`); lowered at connect to what the peer accepts.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs we accept as responder (≤ the device's
    /// `max_qp_rd_atom`), told to the peer in [`QpEndpoint::rd_atom`].
    pub max_dest_rd_atomic: u8,
    /// Minimal RNR NAK timer code.
    pub min_rnr_timer: u8,
}

/// `struct ibv_qp` (RC); holds its PD and CQs. Destroyed on drop, which
/// also ends any access the NIC had through it.
pub struct QueuePair {
    raw: NonNull<ibv_qp>,
    pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    post_send: PostSendFn,
    post_recv: PostRecvFn,
    cap: ibv_qp_cap,
    psn: u32,
    /// MRs that [`QueuePair::post_recv_owned`] posted receives into: dropped
    /// (deregistered, buffer freed) only after the QP is destroyed.
    recv_mrs: Vec<Arc<MemoryRegion>>,
}

// SAFETY: posting takes `&mut self`; other calls are thread-safe verbs.
unsafe impl Send for QueuePair {}
// SAFETY: `&self` methods only read immutable fields or call thread-safe verbs.
unsafe impl Sync for QueuePair {}

impl QueuePair {
    /// Create an RC QP with room for `max_send_wr` / `max_recv_wr` WRs of
    /// one SGE each.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_create_qp`.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        max_send_wr: u32,
        max_recv_wr: u32,
    ) -> Result<Self, VerbsError> {
        let ctx = &pd.ctx;
        // SAFETY: open context; reading the ops table.
        let ops = unsafe { (*ctx.raw.as_ptr()).ops };
        let (Some(post_send), Some(post_recv)) = (ops.post_send, ops.post_recv) else {
            return Err(VerbsError::Unsupported("provider has no post_send/post_recv".into()));
        };
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: send_cq.raw.as_ptr(),
            recv_cq: recv_cq.raw.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap { max_send_wr, max_recv_wr, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: live PD and CQs; `init` is a valid attribute block.
        let raw = unsafe { (ctx.lib.create_qp)(pd.raw.as_ptr(), &mut init) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::call("ibv_create_qp", 0))?;
        let psn = (rand_u32() & 0xff_ffff).max(1);
        Ok(Self {
            raw,
            pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            post_send,
            post_recv,
            cap: init.cap,
            psn,
            recv_mrs: Vec::new(),
        })
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: live QP; qp_num is immutable.
        unsafe { (*self.raw.as_ptr()).qp_num }
    }

    /// The capacities the provider granted.
    pub fn cap(&self) -> ibv_qp_cap {
        self.cap
    }

    /// Our side of the connection with options `o` (port, GID index,
    /// responder READ depth).
    ///
    /// # Errors
    /// Port or GID query failures.
    pub fn endpoint(&self, o: &QpOptions) -> Result<QpEndpoint, VerbsError> {
        let ctx = &self.pd.ctx;
        let pattr = ctx.query_port(o.port)?;
        let gid = match o.gid_index {
            Some(i) => ctx.query_gid(o.port, i32::from(i))?.raw,
            None => [0; 16],
        };
        Ok(QpEndpoint {
            qpn: self.qp_num(),
            psn: self.psn,
            gid,
            lid: pattr.lid,
            mtu: pattr.active_mtu,
            rd_atom: o.max_dest_rd_atomic,
        })
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: i32, what: &'static str) -> Result<(), VerbsError> {
        // SAFETY: live QP, valid attribute block and mask.
        let rc = unsafe { (self.pd.ctx.lib.modify_qp)(self.raw.as_ptr(), attr, mask) };
        if rc != 0 {
            return Err(VerbsError::call(what, rc));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS towards `remote`.
    ///
    /// # Errors
    /// [`VerbsError::Call`] naming the failing transition
    /// (e.g. "ibv_modify_qp(RTR)": wrong GID index, MTU or LID).
    pub fn connect(&self, local: &QpEndpoint, remote: &QpEndpoint, o: &QpOptions) -> Result<(), VerbsError> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            pkey_index: 0,
            port_num: o.port,
            qp_access_flags: (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE) as u32,
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        let mut ah = ibv_ah_attr { dlid: remote.lid, sl: 0, port_num: o.port, ..Default::default() };
        if let Some(idx) = o.gid_index {
            ah.is_global = 1;
            ah.grh = ibv_global_route {
                dgid: ibv_gid { raw: remote.gid },
                flow_label: 0,
                sgid_index: idx,
                hop_limit: 64,
                traffic_class: 0,
            };
        }
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: local.mtu.min(remote.mtu).clamp(IBV_MTU_256, IBV_MTU_4096),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: o.max_dest_rd_atomic,
            min_rnr_timer: o.min_rnr_timer,
            ah_attr: ah,
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: o.timeout,
            retry_cnt: o.retry_cnt,
            rnr_retry: o.rnr_retry,
            sq_psn: local.psn,
            // Never more READs in flight than the peer's responder takes
            // (more would be NAKed as an invalid request).
            max_rd_atomic: o.max_rd_atomic.min(remote.rd_atom).max(1),
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Move to the error state: outstanding WRs complete with
    /// `IBV_WC_WR_FLUSH_ERR` and the NIC stops touching their buffers.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_modify_qp(ERR)`.
    pub fn set_error(&self) -> Result<(), VerbsError> {
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_ERR, ..Default::default() };
        self.modify(&mut a, IBV_QP_STATE, "ibv_modify_qp(ERR)")
    }

    /// Back to RESET (before reconnecting).
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_modify_qp(RESET)`.
    pub fn reset(&self) -> Result<(), VerbsError> {
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_RESET, ..Default::default() };
        self.modify(&mut a, IBV_QP_STATE, "ibv_modify_qp(RESET)")
    }

    /// Post a chained batch with one `post_send`.
    ///
    /// # Safety
    /// Every SGE's memory must be registered under its `lkey` and stay valid
    /// until its WR completes (or the QP is destroyed).
    ///
    /// # Errors
    /// `(index of the first WR not posted, error)`; WRs before it were posted.
    pub unsafe fn post_send(&mut self, batch: &mut WrBatch) -> Result<(), (usize, VerbsError)> {
        // SAFETY: live QP with this provider's post_send; the caller
        // guarantees the memory.
        unsafe { batch.post_raw(self.post_send, self.raw.as_ptr()) }
            .map_err(|(i, rc)| (i, VerbsError::call("ibv_post_send", rc)))
    }

    /// Post one receive of `len_bytes` into `[offset, offset + len_bytes)` of
    /// the buffer `mr` owns ([`MemoryRegion::alloc`]). The QP keeps `mr`
    /// alive until it is destroyed, so the NIC never writes freed memory.
    /// Read the bytes with [`MemoryRegion::read_owned`] once the receive
    /// completed.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_post_recv`; `EINVAL` when `mr` owns no
    /// buffer or the range does not fit in it.
    pub fn post_recv_owned(
        &mut self,
        wr_id: u64,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len_bytes: u32,
    ) -> Result<(), VerbsError> {
        let fits = offset.checked_add(len_bytes as usize).is_some_and(|end| end <= mr.len_bytes());
        if mr.owned_ptr().is_none() || !fits {
            return Err(VerbsError::call("ibv_post_recv (range outside the MR's own buffer)", libc::EINVAL));
        }
        if !self.recv_mrs.iter().any(|m| Arc::ptr_eq(m, mr)) {
            self.recv_mrs.push(mr.clone());
        }
        // SAFETY: the range lies in the buffer `mr` owns, registered under
        // its lkey, and `recv_mrs` keeps `mr` (and so the buffer) alive until
        // after the QP is destroyed (Drop destroys first, then fields drop).
        unsafe { self.post_recv(wr_id, mr.addr() + offset as u64, len_bytes, mr.lkey()) }
    }

    /// Post one receive of `len_bytes` into `addr`.
    ///
    /// # Safety
    /// `[addr, addr + len_bytes)` must be registered under `lkey` and stay
    /// valid until the receive completes or the QP is destroyed.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_post_recv`.
    pub unsafe fn post_recv(&mut self, wr_id: u64, addr: u64, len_bytes: u32, lkey: u32) -> Result<(), VerbsError> {
        let mut sge = ibv_sge { addr, length: len_bytes, lkey };
        let mut wr = ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; `wr`/`sge` live across the call; memory per caller.
        let rc = unsafe { (self.post_recv)(self.raw.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_post_recv", rc));
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: live QP, destroyed once; CQs and PD outlive it (Arcs).
        let rc = unsafe { (self.pd.ctx.lib.destroy_qp)(self.raw.as_ptr()) };
        if rc != 0 {
            record_drop_failure("ibv_destroy_qp", rc);
        }
    }
}

fn rand_u32() -> u32 {
    let b = uuid::Uuid::new_v4().into_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}
