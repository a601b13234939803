//! `SimNic`: a deterministic, seeded simulation of RC queue pairs on one
//! fabric, implementing [`Nic`](super::nic::Nic), [`NicQp`](super::nic::NicQp)
//! and [`NicSlab`](super::nic::NicSlab) (in `sim/nic.rs`) so that the verbs
//! state machine runs without RDMA hardware (unit and property tests, the
//! command-path bench).
//!
//! What it models: per-device completion queues of a fixed size (a CQE
//! pushed into a full CQ is an overrun, recorded and putting every QP of
//! that device in error, as `IBV_EVENT_CQ_ERR` does), send queues of a
//! fixed depth (`ENOMEM` from `post_send` beyond it, the WRs before it
//! posted), in-order issue and completion per QP, a seeded random interleaving
//! across QPs (completions of different QPs arrive reordered and delayed),
//! bytes moved between in-simulation memory (so data and notification
//! ordering is checkable) or, for memory registered with
//! [`SimFabric::register_host`] (the verbs transport over the simulator,
//! `VerbsTransport::on_sim`), the real bytes of this process's memory,
//! rkey/bounds checks (`IBV_WC_REM_ACCESS_ERR`), a responder in error
//! answering nothing (as a vanished one),
//! SENDs consuming posted receives (`IBV_WC_RNR_RETRY_EXC_ERR` when none
//! is posted, or waiting for one on a QP that retries RNR forever:
//! [`SimFabric::set_rnr_forever`]), error state with `IBV_WC_WR_FLUSH_ERR` for every WR after
//! the first error (signalled or not), QP numbers reused after destroy
//! (lowest free number first), and a device that disappears (its peers'
//! WRs end in `IBV_WC_RETRY_EXC_ERR`, or never complete with
//! [`World::infinite_retry`], as rxe at `retry_cnt=7`). Faults are
//! injected per QP ([`SimFabric::fail_next`]).
//!
//! READ depth: a QP has at most its negotiated `max_rd_atomic` RDMA READs
//! outstanding ([`SimFabric::connect_with_read_depth`]); a READ past it
//! waits at the head of the send queue, and so does any WR behind it.
//! Outstanding READs are answered in order. A WRITE or SEND behind them may
//! run before they are answered (its bytes reach the peer then, as an RC
//! requester may send it while the READ responses are still coming), unless
//! it carries `IBV_SEND_FENCE`, which holds it (and the WRs behind it) until
//! no READ is outstanding, or a WR ahead of it fails: the responder judges a
//! READ (peer, keys, bounds) when it is issued and executes nothing after a
//! request it refused. Completions stay in posting order per QP: a WR that
//! ran early reports its status after the READs ahead of it.
//!
//! Threads: with [`World::auto_step`] each `poll_cq` first runs that many
//! steps, so a progress thread drives the fabric by itself; with
//! [`World::events`] the NIC has a completion channel ([`Nic::wait_event`](super::nic::Nic::wait_event)
//! blocks on the wake fd, or returns at once when the CQ has entries).
//!
//! A held wire ([`SimFabric::hold_wire`]): what the QPs of a device send
//! from then on stays in the fabric (a link or PFC stall), never
//! completing, until [`SimFabric::release_wire`] delivers it. A WRITE's
//! bytes are taken from local memory when it goes on the wire and land
//! only at the responder QP it was sent to, if that QP is still the same
//! incarnation (a recreated QP number has another PSN) and not in error,
//! and the rkey and range still check: as an RC responder executes a late
//! but in-sequence packet, and drops it in the error state. A held READ or
//! SEND is lost with the wire. The requester flushes its held WRs when its
//! QP goes to error, as a real one does while its packets are still out;
//! one still held at the release completes as sent (its retries are not
//! modelled: release after the requester let go, as the tests do).
//!
//! Not modelled: timing (steps are the clock), partial WRs.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::verbs::ffi::{IBV_WC_RECV, IBV_WR_RDMA_READ, IBV_WR_SEND};
use crate::verbs::{WcStatus, WorkCompletion, WrView};

struct Region {
    dev: u32,
    addr: u64,
    mem: Mem,
}

/// Where a simulated region's bytes live.
enum Mem {
    /// The simulation's own bytes.
    Owned(Vec<u8>),
    /// `len` bytes of this process's memory at the region's address
    /// ([`SimFabric::register_host`]): WRs move the real bytes.
    Host { len: usize },
}

impl Region {
    fn len(&self) -> usize {
        match &self.mem {
            Mem::Owned(v) => v.len(),
            Mem::Host { len } => *len,
        }
    }

    /// A copy of `[off, off + len)`; None when out of range.
    fn load(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        if off.checked_add(len)? > self.len() {
            return None;
        }
        match &self.mem {
            Mem::Owned(v) => Some(v[off..off + len].to_vec()),
            Mem::Host { .. } => {
                let mut out = vec![0u8; len];
                // SAFETY: `register_host`'s caller keeps `[addr, addr +
                // len)` valid while the region is registered; the range was
                // checked to lie inside it. As a NIC's DMA, the copy does not
                // synchronise with the program's own accesses.
                unsafe {
                    std::ptr::copy_nonoverlapping((self.addr as usize + off) as *const u8, out.as_mut_ptr(), len)
                };
                Some(out)
            }
        }
    }

    /// Write `data` at `off`; false when out of range.
    fn store(&mut self, off: usize, data: &[u8]) -> bool {
        if off.checked_add(data.len()).is_none_or(|end| end > self.len()) {
            return false;
        }
        match &mut self.mem {
            Mem::Owned(v) => v[off..off + data.len()].copy_from_slice(data),
            // SAFETY: as in `load` (the range is inside the registered one).
            Mem::Host { .. } => unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), (self.addr as usize + off) as *mut u8, data.len());
            },
        }
        true
    }
}

/// A WR a simulated QP started and has not completed.
#[derive(Clone, Copy)]
struct Started {
    w: WrView,
    /// An RDMA READ waiting for its answer (its bytes move then).
    waiting: bool,
    /// The status it completes with: a waiting READ's verdict when it was
    /// issued (or an injected fault); a WR that ran early, its result.
    status: WcStatus,
}

/// A WRITE on a held wire: where it lands if it ever does, and its bytes.
struct HeldWrite {
    to: u32,
    /// The responder QP's incarnation ([`SimQpState::incarnation`]) when sent.
    incarnation: u64,
    rkey: u32,
    addr: u64,
    data: Vec<u8>,
}

/// How [`World::complete`] finds a WR's status.
#[derive(Clone, Copy)]
enum Outcome {
    /// Nothing was started ahead of it: an injected fault, or perform it now.
    Fresh,
    /// A READ answered after a good verdict: move its bytes now.
    Answer,
    /// Already known.
    Known(WcStatus),
}

struct SimQpState {
    dev: u32,
    peer: Option<u32>,
    error: bool,
    max_send_wr: u32,
    sq: VecDeque<WrView>,
    /// Negotiated READ depth (`max_rd_atomic`).
    rd_atomic: u32,
    /// WRs started and not yet completed, oldest first.
    started: VecDeque<Started>,
    /// Posted receives: (wr_id, slab key, offset, len).
    rq: VecDeque<(u64, u32, usize, u32)>,
    /// Status the next executed WR completes with (fault injection).
    fail_next: VecDeque<WcStatus>,
    /// `rnr_retry` = 7: a SEND finding no receive posted waits for one
    /// (retries forever) instead of failing `IBV_WC_RNR_RETRY_EXC_ERR`
    /// ([`SimFabric::set_rnr_forever`]).
    rnr_forever: bool,
    /// Incarnation of this QP number (a recreated number is another QP,
    /// as its new PSN makes it on a real fabric).
    incarnation: u64,
    /// Its requests stay on the wire ([`SimFabric::hold_wire`]).
    hold: bool,
}

/// The fabric's whole state (behind [`SimFabric`]'s lock: the simulated
/// hardware, not the transport's).
pub struct World {
    rng: u64,
    next_addr: u64,
    next_key: u32,
    next_qpn: u32,
    free_qpns: BTreeSet<u32>,
    regions: HashMap<u32, Region>,
    qps: HashMap<u32, SimQpState>,
    cqs: HashMap<u32, (VecDeque<WorkCompletion>, usize)>,
    dead: HashSet<u32>,
    /// WRs to a vanished peer never complete (rxe with `retry_cnt=7`).
    pub infinite_retry: bool,
    /// Devices whose CQ overran.
    pub overruns: Vec<u32>,
    /// Every memory access the NIC made: (step, key, offset, len).
    pub touches: Vec<(u64, u32, usize, usize)>,
    /// Steps executed so far (the simulation's clock).
    pub steps: u64,
    /// `post_send` fails with `EINVAL` at this WR index of the next call.
    pub fail_post_at: Option<usize>,
    /// Most READs seen outstanding at once, per QP.
    pub max_reads: HashMap<u32, usize>,
    /// Steps at which a QP's head READ waited because its READ depth was full.
    pub read_waits: u64,
    /// Fabric steps each `poll_cq` runs first (0: the test steps the fabric).
    pub auto_step: u32,
    /// The NICs have a completion channel (`Nic::has_events`).
    pub events: bool,
    /// `post_send` calls that queued WRs (one doorbell each).
    pub post_sends: u64,
    /// WRs those calls queued.
    pub posted_wrs: u64,
    /// Most WRs one `post_send` queued.
    pub max_chain: u64,
    /// Incarnations given to QPs so far.
    next_incarnation: u64,
    /// WRITEs held on the wire, oldest first ([`SimFabric::hold_wire`]).
    wire: Vec<HeldWrite>,
}

/// READ depth of QPs connected with [`SimFabric::connect`].
pub const DEFAULT_READ_DEPTH: u32 = 16;

/// A shared simulated fabric: devices, memory, QPs.
#[derive(Clone)]
pub struct SimFabric(Arc<Mutex<World>>);

impl SimFabric {
    /// An empty fabric whose interleaving follows `seed`.
    pub fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(World {
            rng: seed ^ 0x9e37_79b9_7f4a_7c15,
            next_addr: 0x10_0000,
            next_key: 1,
            next_qpn: 0x11,
            free_qpns: BTreeSet::new(),
            regions: HashMap::new(),
            qps: HashMap::new(),
            cqs: HashMap::new(),
            dead: HashSet::new(),
            infinite_retry: false,
            overruns: Vec::new(),
            touches: Vec::new(),
            steps: 0,
            fail_post_at: None,
            max_reads: HashMap::new(),
            read_waits: 0,
            auto_step: 0,
            events: false,
            post_sends: 0,
            posted_wrs: 0,
            max_chain: 0,
            next_incarnation: 0,
            wire: Vec::new(),
        })))
    }

    /// Live handles on the fabric (devices, QPs, memory and clones of this):
    /// 1 once only this one is left.
    pub fn handles(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// The world, locked.
    pub fn world(&self) -> MutexGuard<'_, World> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A device `dev` with a completion queue of `cqes` entries.
    pub fn device(&self, dev: u32, cqes: usize) -> SimNic {
        self.world().cqs.insert(dev, (VecDeque::new(), cqes));
        SimNic { fabric: self.clone(), dev }
    }

    /// A device with a number no other device of the fabric has, with a
    /// completion queue of `cqes` entries (for `VerbsTransport::on_sim`:
    /// one device per transport).
    pub fn new_device(&self, cqes: usize) -> SimNic {
        let mut w = self.world();
        let dev = w.cqs.keys().max().map_or(0, |d| d + 1);
        w.cqs.insert(dev, (VecDeque::new(), cqes));
        SimNic { fabric: self.clone(), dev }
    }

    /// Another handle to device `dev` made by [`device`](Self::device), its
    /// completion queue kept (to create QPs beside an engine that owns the
    /// first).
    pub fn handle(&self, dev: u32) -> SimNic {
        SimNic { fabric: self.clone(), dev }
    }

    /// Register `len` zeroed bytes on `dev`: `(address, key)` (lkey = rkey).
    pub fn alloc(&self, dev: u32, len: usize) -> (u64, u32) {
        self.world().alloc(dev, len)
    }

    /// Register `len` zeroed bytes on `dev` at address `addr` (as
    /// `ibv_reg_mr` of a range the caller chose): its key (lkey = rkey).
    /// The bytes are the simulation's own, whatever lives at `addr` in
    /// this process.
    pub fn alloc_at(&self, dev: u32, addr: u64, len: usize) -> u32 {
        let mut w = self.world();
        let key = w.next_key;
        w.next_key += 1;
        w.regions.insert(key, Region { dev, addr, mem: Mem::Owned(vec![0; len]) });
        key
    }

    /// Register `len` bytes of this process's memory at `addr` on `dev` (as
    /// `ibv_reg_mr` does): its key (lkey = rkey). WRs naming the key move
    /// the real bytes there; the bounds and key checks stay the
    /// simulator's.
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay valid, readable and writable memory
    /// until [`dealloc`](Self::dealloc) of the key.
    pub unsafe fn register_host(&self, dev: u32, addr: u64, len: usize) -> u32 {
        let mut w = self.world();
        let key = w.next_key;
        w.next_key += 1;
        w.regions.insert(key, Region { dev, addr, mem: Mem::Host { len } });
        key
    }

    /// Drop the region of `key` (deregister): later accesses fail.
    pub fn dealloc(&self, key: u32) {
        self.world().regions.remove(&key);
    }

    /// A copy of `len` bytes at `addr` of region `key`.
    pub fn read(&self, key: u32, addr: u64, len: usize) -> Option<Vec<u8>> {
        let w = self.world();
        let r = w.regions.get(&key)?;
        let off = usize::try_from(addr.checked_sub(r.addr)?).ok()?;
        r.load(off, len)
    }

    /// Write `data` at `addr` of region `key`; false when out of range.
    pub fn write(&self, key: u32, addr: u64, data: &[u8]) -> bool {
        let mut w = self.world();
        let Some(r) = w.regions.get_mut(&key) else { return false };
        let Some(off) = addr.checked_sub(r.addr).and_then(|o| usize::try_from(o).ok()) else { return false };
        r.store(off, data)
    }

    /// Connect QP `a` and QP `b` (RTS both ways), READ depth
    /// [`DEFAULT_READ_DEPTH`].
    pub fn connect(&self, a: u32, b: u32) {
        self.connect_with_read_depth(a, b, DEFAULT_READ_DEPTH);
    }

    /// Connect QP `a` and QP `b` with READ depth `depth` both ways (the
    /// negotiated `max_rd_atomic`: the initiator's depth lowered to the
    /// responder's `max_dest_rd_atomic`).
    pub fn connect_with_read_depth(&self, a: u32, b: u32, depth: u32) {
        let mut w = self.world();
        for (x, y) in [(a, b), (b, a)] {
            if let Some(q) = w.qps.get_mut(&x) {
                q.peer = Some(y);
                q.rd_atomic = depth.max(1);
            }
        }
    }

    /// QP `qpn` retries RNR forever (`rnr_retry` = 7, as the verbs
    /// transport connects its QPs): a SEND to a peer with no receive posted
    /// waits at the head of the send queue until one is posted.
    pub fn set_rnr_forever(&self, qpn: u32, forever: bool) {
        if let Some(q) = self.world().qps.get_mut(&qpn) {
            q.rnr_forever = forever;
        }
    }

    /// The next WR QP `qpn` starts (issues, for a READ; runs, for another
    /// WR) completes with `status` (and puts the QP in error when it
    /// completes, as any error completion does).
    pub fn fail_next(&self, qpn: u32, status: WcStatus) {
        if let Some(q) = self.world().qps.get_mut(&qpn) {
            q.fail_next.push_back(status);
        }
    }

    /// Device `dev` disappears (its process was killed): its QPs answer
    /// nothing from now on.
    pub fn kill(&self, dev: u32) {
        self.world().dead.insert(dev);
    }

    /// Hold the wire of every QP device `dev` has now: what they send from
    /// here on stays in the fabric until [`release_wire`](Self::release_wire)
    /// (see the module docs). QPs created later are not held.
    pub fn hold_wire(&self, dev: u32) {
        for q in self.world().qps.values_mut().filter(|q| q.dev == dev) {
            q.hold = true;
        }
    }

    /// WRITEs on a held wire now.
    pub fn on_wire(&self) -> usize {
        self.world().wire.len()
    }

    /// Deliver what the held wires carry, oldest first, and stop holding:
    /// `(landed, dropped)` WRITEs. One lands where a responder would execute
    /// it: its QP still the same incarnation, not in error, on a live
    /// device, its rkey and range valid.
    pub fn release_wire(&self) -> (usize, usize) {
        let mut w = self.world();
        for q in w.qps.values_mut() {
            q.hold = false;
        }
        let (mut landed, mut dropped) = (0, 0);
        for h in std::mem::take(&mut w.wire) {
            let dev = match w.responder(h.to) {
                Some(q) if q.incarnation == h.incarnation => q.dev,
                _ => {
                    dropped += 1;
                    continue;
                }
            };
            match w.check(dev, h.rkey, h.addr, h.data.len()) {
                Some(off) if w.regions.get_mut(&h.rkey).is_some_and(|r| r.store(off, &h.data)) => landed += 1,
                _ => dropped += 1,
            }
        }
        (landed, dropped)
    }

    /// Execute one WR of a QP picked at random among those with work; false
    /// when no QP can make progress.
    pub fn step(&self) -> bool {
        self.world().step()
    }
}

impl World {
    fn rand(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn alloc(&mut self, dev: u32, len: usize) -> (u64, u32) {
        let (addr, key) = (self.next_addr, self.next_key);
        self.next_addr += (len as u64).div_ceil(4096).max(1) * 4096 + 4096;
        self.next_key += 1;
        self.regions.insert(key, Region { dev, addr, mem: Mem::Owned(vec![0; len]) });
        (addr, key)
    }

    /// `[addr, addr + len)` of region `key` on `dev`: its offset, if inside.
    fn check(&self, dev: u32, key: u32, addr: u64, len: usize) -> Option<usize> {
        let r = self.regions.get(&key).filter(|r| r.dev == dev)?;
        let off = usize::try_from(addr.checked_sub(r.addr)?).ok()?;
        (off.checked_add(len)? <= r.len()).then_some(off)
    }

    fn copy(&mut self, from: (u32, usize), to: (u32, usize), len: usize) {
        let data = self.regions[&from.0].load(from.1, len).expect("checked");
        let stored = self.regions.get_mut(&to.0).expect("checked").store(to.1, &data);
        debug_assert!(stored, "checked");
        let s = self.steps;
        self.touches.push((s, from.0, from.1, len));
        self.touches.push((s, to.0, to.1, len));
    }

    fn push_cqe(&mut self, dev: u32, wc: WorkCompletion) {
        let Some((q, cap)) = self.cqs.get_mut(&dev) else { return };
        if q.len() >= *cap {
            // CQ overrun: the device reports a CQ error and every QP on the
            // CQ goes to the error state.
            self.overruns.push(dev);
            for qp in self.qps.values_mut().filter(|qp| qp.dev == dev) {
                qp.error = true;
            }
            return;
        }
        q.push_back(wc);
    }

    pub(super) fn step(&mut self) -> bool {
        let live: Vec<u32> = {
            let mut v: Vec<u32> = self
                .qps
                .iter()
                .filter(|(_, q)| {
                    (!q.sq.is_empty() || !q.started.is_empty()) && !self.dead.contains(&q.dev) && !self.stuck(q)
                })
                .map(|(&n, _)| n)
                .collect();
            v.sort_unstable();
            v
        };
        if live.is_empty() {
            return false;
        }
        self.steps += 1;
        let qpn = live[(self.rand() % live.len() as u64) as usize];
        self.exec(qpn);
        true
    }

    /// A QP whose head WR can never complete (peer gone or in error with
    /// infinite retries, or a SEND with no receive posted and infinite RNR retries).
    fn stuck(&self, q: &SimQpState) -> bool {
        if q.hold && !q.error {
            // Everything it issues stays on the wire; nothing completes.
            return q.sq.is_empty();
        }
        if q.error || !q.fail_next.is_empty() {
            return false;
        }
        match q.peer.and_then(|p| self.responder(p)) {
            None => self.infinite_retry,
            Some(p) => {
                (self.infinite_retry || q.rnr_forever)
                    && q.started.is_empty()
                    && q.sq.front().is_some_and(|w| w.opcode == IBV_WR_SEND && p.rq.is_empty())
            }
        }
    }

    fn exec(&mut self, qpn: u32) {
        if self.qps[&qpn].hold && !self.qps[&qpn].error {
            self.onto_wire(qpn);
            return;
        }
        let q = &self.qps[&qpn];
        let head = q.sq.front().copied();
        let reads_waiting = q.started.iter().filter(|s| s.waiting).count();
        // The responder executes nothing after a request it refused.
        let doomed = q.started.iter().any(|s| !s.status.is_success());
        let can_issue = match head {
            None => false,
            Some(w) if w.fence && reads_waiting > 0 => false,
            Some(w) if w.opcode == IBV_WR_RDMA_READ => reads_waiting < q.rd_atomic as usize,
            Some(_) if q.started.is_empty() => true,
            // A SEND that could only wait for a receive (infinite RNR
            // retries) stays at the head, as `stuck` expects.
            Some(w) if (self.infinite_retry || q.rnr_forever) && w.opcode == IBV_WR_SEND && self.no_receive(q) => false,
            Some(_) => !doomed,
        };
        let (error, started) = (q.error, !q.started.is_empty());
        if head.is_some_and(|w| w.opcode == IBV_WR_RDMA_READ) && !can_issue && !error {
            self.read_waits += 1;
        }
        // Complete the oldest started WR or start the head WR, when both could happen.
        let coin = started && can_issue && !error && self.rand().is_multiple_of(2);
        let q = self.qps.get_mut(&qpn).expect("live QP");
        if !q.started.is_empty() && (q.error || !can_issue || coin) {
            let s = q.started.pop_front().expect("a WR started");
            let how = if s.waiting && s.status.is_success() { Outcome::Answer } else { Outcome::Known(s.status) };
            self.complete(qpn, s.w, how);
            return;
        }
        let w = q.sq.pop_front().expect("has work");
        if q.error || q.started.is_empty() && w.opcode != IBV_WR_RDMA_READ {
            self.complete(qpn, w, Outcome::Fresh);
            return;
        }
        let fault = q.fail_next.pop_front();
        let (waiting, status) = if w.opcode == IBV_WR_RDMA_READ {
            // Issued: the responder judges it now, answers on a later step.
            (true, fault.unwrap_or_else(|| self.resolve(qpn, &w).err().unwrap_or(WcStatus::Success)))
        } else {
            // Runs now, behind READs still waiting: completes after them.
            (false, fault.unwrap_or_else(|| self.perform(qpn, &w)))
        };
        self.qps.get_mut(&qpn).expect("live QP").started.push_back(Started { w, waiting, status });
        if waiting {
            let m = self.max_reads.entry(qpn).or_default();
            *m = (*m).max(reads_waiting + 1);
        }
    }

    /// Issue the head WR of held QP `qpn` onto the wire: a WRITE's bytes
    /// (read from local memory now) wait there for
    /// [`SimFabric::release_wire`]; the WR completes only by a flush.
    fn onto_wire(&mut self, qpn: u32) {
        let q = self.qps.get_mut(&qpn).expect("live QP");
        let w = q.sq.pop_front().expect("has work");
        let (dev, peer) = (q.dev, q.peer);
        q.started.push_back(Started { w, waiting: false, status: WcStatus::Success });
        if w.opcode == IBV_WR_RDMA_READ || w.opcode == IBV_WR_SEND {
            return;
        }
        let len = w.len_bytes as usize;
        let data = self.check(dev, w.lkey, w.local_addr, len).and_then(|off| self.regions[&w.lkey].load(off, len));
        let to = peer.and_then(|p| self.qps.get(&p).map(|pq| (p, pq.incarnation)));
        if let (Some(data), Some((to, incarnation))) = (data, to) {
            self.wire.push(HeldWrite { to, incarnation, rkey: w.rkey, addr: w.remote_addr, data });
        }
    }

    /// QP `qpn` when it answers requests: it exists, is not in error, and
    /// its device is alive.
    fn responder(&self, qpn: u32) -> Option<&SimQpState> {
        self.qps.get(&qpn).filter(|q| !q.error && !self.dead.contains(&q.dev))
    }

    /// True when the peer of `q` has no receive posted.
    fn no_receive(&self, q: &SimQpState) -> bool {
        q.peer.and_then(|p| self.qps.get(&p)).is_none_or(|p| p.rq.is_empty())
    }

    /// Complete `w` of QP `qpn`: flushed on a QP in error, else with the
    /// status `how` finds (a failure puts the QP in error).
    fn complete(&mut self, qpn: u32, w: WrView, how: Outcome) {
        let q = self.qps.get_mut(&qpn).expect("live QP");
        let (dev, error) = (q.dev, q.error);
        let cqe = |status: WcStatus| WorkCompletion {
            wr_id: w.wr_id,
            status: status.raw(),
            qp_num: qpn,
            ..Default::default()
        };
        if error {
            self.push_cqe(dev, cqe(WcStatus::WrFlushErr));
            return;
        }
        let status = match how {
            Outcome::Known(s) => s,
            Outcome::Fresh => match q.fail_next.pop_front() {
                Some(s) => s,
                None => self.perform(qpn, &w),
            },
            Outcome::Answer => self.perform(qpn, &w),
        };
        if !status.is_success() {
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.error = true;
            }
            self.push_cqe(dev, cqe(status));
        } else if w.signaled {
            self.push_cqe(dev, WorkCompletion { byte_len: w.len_bytes, ..cqe(WcStatus::Success) });
        }
    }

    /// Where `w` (from QP `qpn`) touches memory: (peer QP, local offset,
    /// remote offset of an RDMA WR), or the status it fails with (peer gone
    /// or in error, bad local key or range, bad remote key or range).
    fn resolve(&self, qpn: u32, w: &WrView) -> Result<(u32, usize, Option<usize>), WcStatus> {
        let q = &self.qps[&qpn];
        let len = w.len_bytes as usize;
        // A responder gone, dead or in error answers nothing: the requester
        // retries until it gives up.
        let peer = q.peer.filter(|&p| self.responder(p).is_some()).ok_or(WcStatus::RetryExcErr)?;
        let loff = self.check(q.dev, w.lkey, w.local_addr, len).ok_or(WcStatus::LocProtErr)?;
        if w.opcode == IBV_WR_SEND {
            return Ok((peer, loff, None));
        }
        let roff = self.check(self.qps[&peer].dev, w.rkey, w.remote_addr, len).ok_or(WcStatus::RemAccessErr)?;
        Ok((peer, loff, Some(roff)))
    }

    /// Move the bytes of `w` (from QP `qpn`); its completion status.
    fn perform(&mut self, qpn: u32, w: &WrView) -> WcStatus {
        let (peer, loff, roff) = match self.resolve(qpn, w) {
            Ok(r) => r,
            Err(status) => return status,
        };
        let (len, pdev) = (w.len_bytes as usize, self.qps[&peer].dev);
        let Some(roff) = roff else {
            // A SEND: into the peer's next posted receive.
            let Some((rid, key, off, rlen)) = self.qps.get_mut(&peer).and_then(|p| p.rq.pop_front()) else {
                return WcStatus::RnrRetryExcErr;
            };
            if len > rlen as usize {
                return WcStatus::RemAccessErr;
            }
            self.copy((w.lkey, loff), (key, off), len);
            let wc = WorkCompletion {
                wr_id: rid,
                status: WcStatus::Success.raw(),
                opcode: IBV_WC_RECV,
                byte_len: len as u32,
                qp_num: peer,
                ..Default::default()
            };
            self.push_cqe(pdev, wc);
            return WcStatus::Success;
        };
        if w.opcode == IBV_WR_RDMA_READ {
            self.copy((w.rkey, roff), (w.lkey, loff), len);
        } else {
            self.copy((w.lkey, loff), (w.rkey, roff), len);
        }
        WcStatus::Success
    }

    /// WRs posted on QP `qpn` and not completed yet.
    pub fn queued(&self, qpn: u32) -> usize {
        self.qps.get(&qpn).map_or(0, |q| q.sq.len() + q.started.len())
    }

    /// True when QP `qpn` exists (is not destroyed).
    pub fn has_qp(&self, qpn: u32) -> bool {
        self.qps.contains_key(&qpn)
    }
}

mod nic;
mod relay;
mod transport;
pub use nic::{SimMr, SimNic, SimQp, SimSlab};
pub use relay::HandshakeRelay;
