//! Batches of send work requests: one WR per page range, one SGE each,
//! chained and handed to the provider with a single `post_send`.

use super::ffi::*;

/// A work-request id, returned in the [`super::WorkCompletion`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WrId(pub u64);

/// A reusable batch of send WRs. Pushing only writes plain data; the `next`
/// and `sg_list` pointers are linked when the batch is posted, so the
/// vectors may grow freely while it is built.
pub struct WrBatch {
    wrs: Vec<ibv_send_wr>,
    sges: Vec<ibv_sge>,
}

// SAFETY: the raw pointers inside the WRs are only set (to the batch's own
// vectors) during `post_raw` and never dereferenced outside it.
unsafe impl Send for WrBatch {}

impl Default for WrBatch {
    fn default() -> Self {
        Self::with_capacity(64)
    }
}

impl WrBatch {
    /// An empty batch with room for `n` WRs.
    pub fn with_capacity(n: usize) -> Self {
        Self { wrs: Vec::with_capacity(n), sges: Vec::with_capacity(n) }
    }

    /// Forget the WRs (keeps the allocation).
    pub fn clear(&mut self) {
        self.wrs.clear();
        self.sges.clear();
    }

    /// Number of WRs.
    pub fn len(&self) -> usize {
        self.wrs.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    fn push(&mut self, id: WrId, opcode: u32, signaled: bool, sge: ibv_sge, remote: ibv_send_wr_rdma) {
        self.sges.push(sge);
        self.wrs.push(ibv_send_wr {
            wr_id: id.0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 1,
            opcode,
            send_flags: if signaled { IBV_SEND_SIGNALED } else { 0 },
            imm_data: 0,
            wr: ibv_send_wr_wr { rdma: remote },
            qp_type: 0,
            _bind_mw_tso: [0; 6],
        });
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
    pub fn push_send(&mut self, id: WrId, signaled: bool, local_addr: u64, len_bytes: u32, lkey: u32) {
        self.push(
            id,
            IBV_WR_SEND,
            signaled,
            ibv_sge { addr: local_addr, length: len_bytes, lkey },
            ibv_send_wr_rdma::default(),
        );
    }

    /// Link the chain and post it with one call to `post_send`.
    /// On failure returns `(index of the first WR not posted, rc)`.
    ///
    /// # Safety
    /// `qp` must be a live QP whose provider's `post_send` is `post_send`,
    /// and every SGE must lie in memory registered with its `lkey` that
    /// stays valid until the WRs complete.
    pub(crate) unsafe fn post_raw(&mut self, post_send: PostSendFn, qp: *mut ibv_qp) -> Result<(), (usize, i32)> {
        let n = self.wrs.len();
        if n == 0 {
            return Ok(());
        }
        let base = self.wrs.as_mut_ptr();
        let sges = self.sges.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n = len of both vectors; the pointers stay valid
            // because neither vector is touched until post_send returns.
            unsafe {
                let wr = &mut *base.add(i);
                wr.sg_list = sges.add(i);
                wr.next = if i + 1 < n { base.add(i + 1) } else { std::ptr::null_mut() };
            }
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the caller guarantees `qp`/`post_send`; the chain is linked.
        let rc = unsafe { post_send(qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let idx = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into the chain we passed.
            (unsafe { bad.offset_from(base) }).clamp(0, n as isize) as usize
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
