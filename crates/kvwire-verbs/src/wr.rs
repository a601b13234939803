//! Batches of send work requests: one WR per page range, one SGE each,
//! chained and handed to the provider with a single `post_send`.

use super::ffi::*;

/// A work-request id, returned in the [`super::WorkCompletion`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WrId(pub u64);

/// A reusable batch of send WRs, preallocated and pre-linked: WR `i`'s
/// `sg_list` points at SGE `i` and its `next` at WR `i + 1` from the moment
/// the storage is allocated (heap slices, so moving the batch keeps the
/// links valid), and the fields no WR here changes (`num_sge`, `imm_data`,
/// ...) are written once. Pushing writes only the per-WR fields; posting
/// cuts the chain after the last WR for the call and restores that one link
/// afterwards, so there is no per-post linking pass. The storage doubles
/// (and is re-linked) when a push finds it full.
pub struct WrBatch {
    wrs: Box<[ibv_send_wr]>,
    sges: Box<[ibv_sge]>,
    len: usize,
}

// SAFETY: the raw pointers inside the WRs point only into the batch's own
// heap slices (which move with it) and are dereferenced only by the
// provider during `post_raw`.
unsafe impl Send for WrBatch {}

impl Default for WrBatch {
    fn default() -> Self {
        Self::with_capacity(64)
    }
}

impl WrBatch {
    /// An empty batch with room for `n` WRs (at least 1) before it grows.
    pub fn with_capacity(n: usize) -> Self {
        let n = n.max(1);
        let blank = ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 1,
            opcode: IBV_WR_RDMA_WRITE,
            send_flags: 0,
            imm_data: 0,
            wr: ibv_send_wr_wr { rdma: ibv_send_wr_rdma::default() },
            qp_type: 0,
            _bind_mw_tso: [0; 6],
        };
        let mut b = Self {
            wrs: vec![blank; n].into_boxed_slice(),
            sges: vec![ibv_sge { addr: 0, length: 0, lkey: 0 }; n].into_boxed_slice(),
            len: 0,
        };
        b.link();
        b
    }

    /// Point every WR at its SGE and at the next WR (the last at null).
    fn link(&mut self) {
        let n = self.wrs.len();
        let base = self.wrs.as_mut_ptr();
        let sges = self.sges.as_mut_ptr();
        for (i, wr) in self.wrs.iter_mut().enumerate() {
            // `wrapping_add` stays inside (or one past) the allocations.
            wr.sg_list = sges.wrapping_add(i);
            wr.next = if i + 1 < n { base.wrapping_add(i + 1) } else { std::ptr::null_mut() };
        }
    }

    #[cold]
    fn grow(&mut self) {
        let mut bigger = Self::with_capacity(self.wrs.len() * 2);
        for i in 0..self.len {
            let (next, sg) = (bigger.wrs[i].next, bigger.wrs[i].sg_list);
            bigger.wrs[i] = self.wrs[i];
            bigger.wrs[i].next = next;
            bigger.wrs[i].sg_list = sg;
            bigger.sges[i] = self.sges[i];
        }
        bigger.len = self.len;
        *self = bigger;
    }

    /// Forget the WRs (keeps the storage and its links).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Number of WRs.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// WRs the batch holds before it grows.
    pub fn capacity(&self) -> usize {
        self.wrs.len()
    }

    #[inline(always)]
    fn push(&mut self, id: WrId, opcode: u32, signaled: bool, sge: ibv_sge, remote: ibv_send_wr_rdma) {
        if self.len == self.wrs.len() {
            self.grow();
        }
        let i = self.len;
        self.sges[i] = sge;
        let wr = &mut self.wrs[i];
        wr.wr_id = id.0;
        wr.opcode = opcode;
        wr.send_flags = if signaled { IBV_SEND_SIGNALED } else { 0 };
        wr.wr = ibv_send_wr_wr { rdma: remote };
        self.len = i + 1;
    }

    /// An RDMA WRITE (`read == false`) or READ of `len_bytes` between local
    /// `local_addr` (key `lkey`) and remote `remote_addr` (key `rkey`).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn push_rdma(
        &mut self,
        id: WrId,
        read: bool,
        signaled: bool,
        local_addr: u64,
        len_bytes: u32,
        lkey: u32,
        remote_addr: u64,
        rkey: u32,
    ) {
        let opcode = if read { IBV_WR_RDMA_READ } else { IBV_WR_RDMA_WRITE };
        self.push(
            id,
            opcode,
            signaled,
            ibv_sge { addr: local_addr, length: len_bytes, lkey },
            ibv_send_wr_rdma { remote_addr, rkey },
        );
    }

    /// A SEND of `len_bytes` from `local_addr` (the notification path).
    /// `fence` sets `IBV_SEND_FENCE` (`ibv_post_send(3)`'s fence
    /// indicator): the NIC starts the SEND only once every RDMA READ (and
    /// atomic) posted before it on the QP has completed. Without it an RC
    /// QP may run a SEND while READs ahead of it still wait for their data.
    pub fn push_send(&mut self, id: WrId, signaled: bool, fence: bool, local_addr: u64, len_bytes: u32, lkey: u32) {
        self.push(
            id,
            IBV_WR_SEND,
            signaled,
            ibv_sge { addr: local_addr, length: len_bytes, lkey },
            ibv_send_wr_rdma::default(),
        );
        if fence {
            self.wrs[self.len - 1].send_flags |= IBV_SEND_FENCE;
        }
    }

    /// Post the chain with one call to `post_send` (no linking pass: the
    /// chain is cut after the last WR and that link restored afterwards).
    /// On failure returns `(index of the first WR not posted, rc)`.
    ///
    /// # Safety
    /// `qp` must be a live QP whose provider's `post_send` is `post_send`,
    /// and every SGE must lie in memory registered with its `lkey` that
    /// stays valid until the WRs complete.
    pub(crate) unsafe fn post_raw(&mut self, post_send: PostSendFn, qp: *mut ibv_qp) -> Result<(), (usize, i32)> {
        let n = self.len;
        if n == 0 {
            return Ok(());
        }
        let base = self.wrs.as_mut_ptr();
        let saved = std::mem::replace(&mut self.wrs[n - 1].next, std::ptr::null_mut());
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the caller guarantees `qp`/`post_send`; WRs 0..n are linked
        // to their SGEs and to each other (`link`), WR n-1 ends the chain,
        // and the storage is not touched until post_send returns.
        let rc = unsafe { post_send(qp, base, &mut bad) };
        self.wrs[n - 1].next = saved;
        if rc == 0 {
            return Ok(());
        }
        let idx = if bad.is_null() {
            0
        } else {
            // Pointer arithmetic only (no dereference): `bad` points into the
            // chain we passed.
            ((bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<ibv_send_wr>()).min(n)
        };
        Err((idx, rc))
    }
}

/// A queue pair with a fake operation table and no device, for measuring the
/// cost of building and posting WRs (the criterion bench) and for tests.
#[doc(hidden)]
pub struct FakeQueuePair {
    ctx: Box<ibv_context>,
    qp: Box<ibv_qp>,
}

unsafe extern "C" fn fake_post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, _bad: *mut *mut ibv_send_wr) -> i32 {
    // Walk the chain as a provider would (it reads every WR and SGE), and
    // count WRs in `events_completed`.
    let mut n = 0u32;
    let mut p = wr;
    let mut sum = 0u64;
    while !p.is_null() {
        // SAFETY: the chain was linked by WrBatch::post_raw.
        unsafe {
            sum = sum.wrapping_add((*(*p).sg_list).addr);
            p = (*p).next;
        }
        n += 1;
    }
    std::hint::black_box(sum);
    // SAFETY: `qp` is the FakeQueuePair's boxed QP.
    unsafe { (*qp).events_completed = (*qp).events_completed.wrapping_add(n) };
    0
}

impl Default for FakeQueuePair {
    fn default() -> Self {
        // SAFETY: all-zero is valid for these C structs (null pointers,
        // zero integers, zeroed pthread objects are never used).
        let mut ctx: Box<ibv_context> = Box::new(unsafe { std::mem::zeroed() });
        ctx.ops.post_send = Some(fake_post_send);
        // SAFETY: as above.
        let mut qp: Box<ibv_qp> = Box::new(unsafe { std::mem::zeroed() });
        qp.context = &mut *ctx;
        Self { ctx, qp }
    }
}

impl FakeQueuePair {
    /// Post `batch` through the fake op table; returns WRs seen so far.
    pub fn post(&mut self, batch: &mut WrBatch) -> u32 {
        let post = self.ctx.ops.post_send.expect("set in Default");
        // SAFETY: the fake post_send only reads the chain and writes the QP.
        let _ = unsafe { batch.post_raw(post, &mut *self.qp) };
        self.qp.events_completed
    }
}

/// One WR of a [`WrBatch`] as plain values (what a provider reads from the
/// chain): for simulated NICs and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrView {
    /// The WR's id.
    pub wr_id: u64,
    /// `IBV_WR_RDMA_WRITE`, `IBV_WR_RDMA_READ` or `IBV_WR_SEND`.
    pub opcode: u32,
    /// `IBV_SEND_SIGNALED` was set.
    pub signaled: bool,
    /// `IBV_SEND_FENCE` was set.
    pub fence: bool,
    /// Local address of the one SGE.
    pub local_addr: u64,
    /// Bytes of the one SGE.
    pub len_bytes: u32,
    /// Local key of the SGE.
    pub lkey: u32,
    /// Remote address (RDMA WRs; 0 for SEND).
    pub remote_addr: u64,
    /// Remote key (RDMA WRs; 0 for SEND).
    pub rkey: u32,
}

impl WrBatch {
    /// WR `i` of the batch, `None` past its end.
    pub fn view(&self, i: usize) -> Option<WrView> {
        if i >= self.len {
            return None;
        }
        let (wr, sge) = (&self.wrs[i], &self.sges[i]);
        // SAFETY: every push writes the `rdma` member of the union (zeroed
        // for SEND), so that is the member read here.
        let rdma = unsafe { wr.wr.rdma };
        Some(WrView {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            signaled: wr.send_flags & IBV_SEND_SIGNALED != 0,
            fence: wr.send_flags & IBV_SEND_FENCE != 0,
            local_addr: sge.addr,
            len_bytes: sge.length,
            lkey: sge.lkey,
            remote_addr: rdma.remote_addr,
            rkey: rdma.rkey,
        })
    }
}
