//! The [`Nic`]/[`NicQp`]/[`NicSlab`] face of the simulated fabric: one
//! [`SimNic`] per device, its QPs and notification memory (see the parent
//! module for what the simulation models).

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::{DEFAULT_READ_DEPTH, SimFabric, SimQpState, World};
use crate::transport::verbs::device::{Device, Registered};
use crate::transport::verbs::nic::{Nic, NicQp, NicSlab};
use crate::transport::{MemoryBacking, MemoryDesc, MemoryKind, TransportError};
use crate::verbs::{QpEndpoint, QpOptions, VerbsError, WcStatus, WorkCompletion, WrBatch};

/// One simulated device: its completion queue and QP factory (clones are
/// handles to the same device).
#[derive(Clone)]
pub struct SimNic {
    pub(super) fabric: SimFabric,
    pub(super) dev: u32,
}

impl SimNic {
    /// The fabric it sits on.
    pub fn fabric(&self) -> &SimFabric {
        &self.fabric
    }

    /// Its device number on the fabric (for [`SimFabric::kill`]).
    pub fn dev(&self) -> u32 {
        self.dev
    }
}

/// Host memory registered on a simulated device ([`Device::register`]);
/// dropping it deregisters it.
pub struct SimMr {
    fabric: SimFabric,
    key: u32,
}

impl Drop for SimMr {
    fn drop(&mut self) {
        self.fabric.dealloc(self.key);
    }
}

/// The MTU a simulated endpoint reports (`IBV_MTU_4096`; the simulator
/// moves whole WRs, so it changes nothing).
const SIM_MTU: u32 = 5;

impl Device for SimNic {
    type Mr = SimMr;

    /// Host memory only: the WRs naming it move its real bytes
    /// ([`SimFabric::register_host`]).
    unsafe fn register(
        &self,
        d: &MemoryDesc,
        _first: &Arc<dyn MemoryBacking>,
    ) -> Result<Registered<SimMr>, TransportError> {
        if d.kind != MemoryKind::Dram {
            return Err(TransportError::Registration("the simulated NIC registers host memory only".into()));
        }
        let len = usize::try_from(d.len_bytes).map_err(|_| TransportError::Registration("range too large".into()))?;
        // SAFETY: the caller keeps the range valid until the `SimMr`
        // drops, which deregisters the key (this function's contract).
        let key = unsafe { self.fabric.register_host(self.dev, d.addr, len) };
        Ok(Registered { mr: SimMr { fabric: self.fabric.clone(), key }, lkey: key, rkey: key })
    }

    fn endpoint(&self, qp: &SimQp, o: &QpOptions) -> Result<QpEndpoint, VerbsError> {
        Ok(QpEndpoint { qpn: qp.qpn, psn: 0, gid: [0; 16], lid: 0, mtu: SIM_MTU, rd_atom: o.max_dest_rd_atomic })
    }

    /// Connects the two QPs by the numbers the handshake exchanged, READ
    /// depth as the hardware negotiates it (ours, lowered to the
    /// responder's), RNR retried forever when `o.rnr_retry` is 7; `EINVAL`
    /// when either QP does not exist on the fabric.
    fn connect(&self, qp: &SimQp, _local: &QpEndpoint, remote: &QpEndpoint, o: &QpOptions) -> Result<(), VerbsError> {
        let depth = u32::from(o.max_rd_atomic.min(remote.rd_atom)).max(1);
        {
            let w = self.fabric.world();
            if !w.has_qp(qp.qpn) || !w.has_qp(remote.qpn) {
                return Err(einval("ibv_modify_qp (RTR: no such QP on the fabric)"));
            }
        }
        self.fabric.connect_with_read_depth(qp.qpn, remote.qpn, depth);
        // rnr_retry 7 = retry forever (IB spec), as the transport sets it.
        self.fabric.set_rnr_forever(qp.qpn, o.rnr_retry == 7);
        Ok(())
    }
}

/// A simulated QP; dropping it destroys it (its posted WRs vanish without
/// completions, its number becomes free for reuse).
pub struct SimQp {
    fabric: SimFabric,
    qpn: u32,
    /// Slabs its receives land in, kept alive as a real QP does.
    slabs: Vec<Arc<SimSlab>>,
}

impl Drop for SimQp {
    fn drop(&mut self) {
        let mut w = self.fabric.world();
        w.qps.remove(&self.qpn);
        w.free_qpns.insert(self.qpn);
    }
}

/// Simulated registered memory owned by the transport.
pub struct SimSlab {
    fabric: SimFabric,
    addr: u64,
    key: u32,
    len: usize,
}

impl Drop for SimSlab {
    fn drop(&mut self) {
        self.fabric.dealloc(self.key);
    }
}

fn einval(call: &'static str) -> VerbsError {
    VerbsError::call(call, libc::EINVAL)
}

impl NicSlab for SimSlab {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn len_bytes(&self) -> usize {
        self.len
    }
    fn write(&mut self, offset: usize, data: &[u8]) -> bool {
        self.fabric.write(self.key, self.addr + offset as u64, data)
    }
    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        self.fabric.read(self.key, self.addr + offset as u64, len)
    }
}

impl NicQp for SimQp {
    type Slab = SimSlab;
    fn qp_num(&self) -> u32 {
        self.qpn
    }
    unsafe fn post_send(&mut self, batch: &mut WrBatch) -> Result<(), (usize, VerbsError)> {
        let mut w = self.fabric.world();
        let fail_at = w.fail_post_at.take();
        let q = w.qps.get_mut(&self.qpn).ok_or((0, einval("ibv_post_send (destroyed QP)")))?;
        for i in 0..batch.len() {
            if fail_at == Some(i) {
                return Err((i, einval("ibv_post_send")));
            }
            if q.sq.len() >= q.max_send_wr as usize {
                return Err((i, VerbsError::call("ibv_post_send", libc::ENOMEM)));
            }
            q.sq.push_back(batch.view(i).expect("in range"));
        }
        let n = batch.len() as u64;
        if n > 0 {
            w.post_sends += 1;
            w.posted_wrs += n;
            w.max_chain = w.max_chain.max(n);
        }
        Ok(())
    }
    fn post_recv(&mut self, wr_id: u64, slab: &Arc<SimSlab>, offset: usize, len_bytes: u32) -> Result<(), VerbsError> {
        if offset + len_bytes as usize > slab.len {
            return Err(einval("ibv_post_recv (range outside the slab)"));
        }
        if !self.slabs.iter().any(|s| Arc::ptr_eq(s, slab)) {
            self.slabs.push(slab.clone());
        }
        let mut w = self.fabric.world();
        let q = w.qps.get_mut(&self.qpn).ok_or_else(|| einval("ibv_post_recv (destroyed QP)"))?;
        if q.error {
            // Posted in the error state: flushed at once.
            let dev = q.dev;
            w.push_cqe(dev, self.flushed_recv(wr_id));
            return Ok(());
        }
        q.rq.push_back((wr_id, slab.key, offset, len_bytes));
        Ok(())
    }
    fn set_error(&self) -> Result<(), VerbsError> {
        let mut w = self.fabric.world();
        let q = w.qps.get_mut(&self.qpn).ok_or_else(|| einval("ibv_modify_qp (destroyed QP)"))?;
        q.error = true;
        // Started WRs (READs waiting, WRs that ran early) are flushed first
        // (step order), then the queue.
        // Posted receives are flushed too.
        let dev = q.dev;
        let flushed: Vec<u64> = q.rq.drain(..).map(|r| r.0).collect();
        for wr_id in flushed {
            w.push_cqe(dev, self.flushed_recv(wr_id));
        }
        Ok(())
    }
}

impl SimQp {
    /// The completion of receive `wr_id` flushed by the error state.
    fn flushed_recv(&self, wr_id: u64) -> WorkCompletion {
        WorkCompletion { wr_id, status: WcStatus::WrFlushErr.raw(), qp_num: self.qpn, ..Default::default() }
    }
}

impl Nic for SimNic {
    type Qp = SimQp;
    type Slab = SimSlab;
    fn poll_cq(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        let mut w = self.fabric.world();
        for _ in 0..w.auto_step {
            if !w.step() {
                break;
            }
        }
        let Some((q, _)) = w.cqs.get_mut(&self.dev) else { return Ok(0) };
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }
    fn req_notify(&self) -> Result<(), VerbsError> {
        Ok(())
    }
    fn has_events(&self) -> bool {
        self.fabric.world().events
    }
    fn wait_event(&self, wake: BorrowedFd<'_>, timeout_ms: i32) -> Result<bool, VerbsError> {
        let ready = |w: &World| w.cqs.get(&self.dev).is_some_and(|(q, _)| !q.is_empty());
        if ready(&self.fabric.world()) {
            return Ok(true);
        }
        let mut fds = [PollFd::new(wake, PollFlags::POLLIN)];
        let timeout = PollTimeout::try_from(timeout_ms.max(0)).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(ready(&self.fabric.world())),
            Err(e) => Err(VerbsError::call("poll(sim wake)", e as i32)),
        }
    }
    fn create_qp(&self, max_send_wr: u32, _max_recv_wr: u32) -> Result<SimQp, VerbsError> {
        let mut w = self.fabric.world();
        let qpn = match w.free_qpns.pop_first() {
            Some(n) => n,
            None => {
                w.next_qpn += 1;
                w.next_qpn - 1
            }
        };
        let st = SimQpState {
            dev: self.dev,
            peer: None,
            error: false,
            max_send_wr: max_send_wr.max(1),
            sq: VecDeque::new(),
            rd_atomic: DEFAULT_READ_DEPTH,
            started: VecDeque::new(),
            rq: VecDeque::new(),
            fail_next: VecDeque::new(),
            rnr_forever: false,
            incarnation: w.next_incarnation,
            hold: false,
        };
        w.next_incarnation += 1;
        w.qps.insert(qpn, st);
        Ok(SimQp { fabric: self.fabric.clone(), qpn, slabs: Vec::new() })
    }
    fn alloc_slab(&self, len_bytes: usize) -> Result<SimSlab, VerbsError> {
        let (addr, key) = self.fabric.alloc(self.dev, len_bytes);
        Ok(SimSlab { fabric: self.fabric.clone(), addr, key, len: len_bytes })
    }
}
