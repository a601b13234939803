//! An initiator and its targets on one simulated fabric, driven step by
//! step: the connection setup of `conn.rs` (QPs connected, receives posted,
//! CQEs reserved), the commands of `ops.rs`, and the progress loop's
//! completion handling, with the invariants the property test checks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, unbounded};

use crate::transport::verbs::conn::RECVS_PER_QP;
use crate::transport::verbs::nic::{Nic, NicQp};
use crate::transport::verbs::sim::{DEFAULT_READ_DEPTH, SimFabric, SimNic, SimQp};
use crate::transport::verbs::state::NOTIF_SLOTS;
use crate::transport::verbs::state::{
    HeldNotification, NOTIF_SLOT_BYTES, NotifCredit, PostLimits, Qpn, RECV_BIT, RecvQp, State,
};
use crate::transport::{
    Completion, LocalKey, Notification, Op, PeerId, PostRequest, RemoteKey, Segment, TransferFailure, TransportError,
    XferId,
};
use crate::verbs::WorkCompletion;

/// Bytes per test page.
pub(super) const PAGE: u64 = 4096;
/// Bytes of each target's region (the source has twice as many).
const REGION: usize = 4 << 20;

/// Shape of the pair (the transport options of the same names).
#[derive(Debug, Clone, Copy)]
pub(super) struct Opts {
    pub qps: u32,
    pub max_send_wr: u32,
    pub post_list: u32,
    pub signal_every: u32,
    /// Initiator CQ entries.
    pub cq: usize,
    /// Target CQ entries.
    pub cq_target: usize,
    /// Negotiated READ depth (`max_rd_atomic`) of each QP pair.
    pub rd_atomic: u32,
    /// The target's bounds on each peer's notifications in its queue
    /// (count, bytes): `notif_queue_count`, `notif_queue_bytes`.
    pub notif_bound: (usize, usize),
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            qps: 1,
            max_send_wr: 256,
            post_list: 64,
            signal_every: 32,
            cq: 1024,
            cq_target: 1024,
            rd_atomic: DEFAULT_READ_DEPTH,
            notif_bound: (1 << 20, 1 << 30),
        }
    }
}

/// One side: its device and state machine.
pub(super) struct Side {
    pub nic: SimNic,
    pub st: State<SimQp>,
    done: Receiver<Completion>,
    notifs: Receiver<HeldNotification>,
}

fn side(fabric: &SimFabric, dev: u32, cqes: usize) -> Side {
    let (dtx, done) = unbounded();
    let (ntx, notifs) = unbounded();
    Side { nic: fabric.device(dev, cqes), st: State::new(cqes as u32, dtx, ntx), done, notifs }
}

struct Remote {
    t: Side,
    dst: (u64, u32),
    qpns: Vec<u32>,
}

/// The state's numbers of the QPs `qpns` (as the NIC numbered them).
pub(super) fn typed(qpns: &[u32]) -> Vec<Qpn> {
    qpns.iter().map(|&q| Qpn(q)).collect()
}

/// A transfer's target region (address, key) and its (offset, bytes) segments.
type Moved = ((u64, u32), Vec<(u64, u64)>);

/// The initiator `i`, its first target `t` (peer `peer`) and more targets.
pub(super) struct Pair {
    pub fabric: SimFabric,
    pub i: Side,
    pub t: Side,
    pub peer: PeerId,
    pub qpns: Vec<u32>,
    pub limits: PostLimits,
    pub src: (u64, u32),
    pub dst: (u64, u32),
    pub src_len: u64,
    pub dst_len: u64,
    opts: Opts,
    others: HashMap<PeerId, Remote>,
    now: Instant,
    results: HashMap<u64, Result<(), TransferFailure>>,
    duplicates: Vec<u64>,
    got: Vec<Vec<u8>>,
    /// The transfer (a key of `moves`) whose data must have moved (WRITE:
    /// to the target; READ: to the initiator) when the notification with
    /// this payload arrives.
    expect: HashMap<Vec<u8>, u64>,
    late_data: Vec<Vec<u8>>,
    /// Every transfer posted: its target region (address, key) and
    /// segments, checked when it reports `Done`.
    moves: HashMap<u64, Moved>,
    early_done: Vec<u64>,
    /// The first target's application takes no notification while set
    /// (they stay in its queue, counted against the peer's bound).
    pub hold_notifs: bool,
}

impl Pair {
    /// A connected pair on a fabric seeded with `seed`.
    pub(super) fn new(seed: u64, opts: Opts) -> Self {
        let fabric = SimFabric::new(seed);
        let i = side(&fabric, 0, opts.cq);
        let t = side(&fabric, 1, opts.cq_target);
        let src = fabric.alloc(0, 2 * REGION);
        let dst = fabric.alloc(1, REGION);
        let limits = PostLimits {
            max_send_wr: opts.max_send_wr.max(1),
            signal_every: opts.signal_every.clamp(1, opts.max_send_wr.max(1)),
            max_batch: opts.post_list.max(1),
            batch_bytes: 64 << 10,
            poll_sleep_us: 50,
            idle_yields: 0,
        };
        let mut p = Self {
            fabric,
            i,
            t,
            peer: PeerId(1),
            qpns: Vec::new(),
            limits,
            src,
            dst,
            src_len: 2 * REGION as u64,
            dst_len: REGION as u64,
            opts,
            others: HashMap::new(),
            now: Instant::now(),
            results: HashMap::new(),
            duplicates: Vec::new(),
            got: Vec::new(),
            expect: HashMap::new(),
            late_data: Vec::new(),
            moves: HashMap::new(),
            early_done: Vec::new(),
            hold_notifs: false,
        };
        let slab = p.i.nic.alloc_slab(NOTIF_SLOTS as usize * NOTIF_SLOT_BYTES).unwrap();
        p.i.st.slots_mut().install(p.peer, slab);
        p.qpns = connect(&p.fabric, &mut p.i, &mut p.t, p.peer, opts, p.now);
        p
    }

    /// Connect another target (a device of its own); its peer id.
    pub(super) fn add_peer(&mut self) -> PeerId {
        let id = 2 + self.others.len() as u32;
        let mut t = side(&self.fabric, id, self.opts.cq_target);
        let dst = self.fabric.alloc(id, REGION);
        let slab = self.i.nic.alloc_slab(NOTIF_SLOTS as usize * NOTIF_SLOT_BYTES).unwrap();
        self.i.st.slots_mut().install(PeerId(id), slab);
        let qpns = connect(&self.fabric, &mut self.i, &mut t, PeerId(id), self.opts, self.now);
        self.others.insert(PeerId(id), Remote { t, dst, qpns });
        PeerId(id)
    }

    /// The QPs of peer `peer`.
    pub(super) fn peer_qpns(&self, peer: PeerId) -> Vec<u32> {
        if peer == self.peer { self.qpns.clone() } else { self.others[&peer].qpns.clone() }
    }

    /// Replace the first peer's QPs (the transport's `recover`).
    pub(super) fn reconnect(&mut self) {
        for q in self.qpns.clone() {
            self.i.st.remove_peer_qp(Qpn(q), self.peer, &self.limits);
        }
        let recv: Vec<Qpn> = self.t.st.recv_qpns().into_iter().filter(|&q| !self.t.st.draining(q)).collect();
        for q in recv {
            let kept = self.t.st.remove_recv_qp(q, RECVS_PER_QP);
            self.t.st.release_recv_cqes(RECVS_PER_QP - kept, &self.limits);
        }
        self.qpns = connect(&self.fabric, &mut self.i, &mut self.t, self.peer, self.opts, self.now);
    }

    fn segs(&self, dst: (u64, u32), rkey: u32, segs: &[(u64, u64)]) -> Vec<Segment> {
        segs.iter()
            .map(|&(off, len)| Segment {
                local_addr: self.src.0 + off,
                lkey: LocalKey(self.src.1),
                remote_addr: dst.0 + off,
                rkey: RemoteKey(rkey),
                len_bytes: len,
            })
            .collect()
    }

    /// Post transfer `x` to peer `peer`: `segs` are (offset, bytes), the
    /// same offset in the source and the target's region.
    pub(super) fn post_to(
        &mut self,
        peer: PeerId,
        x: u64,
        op: Op,
        segs: &[(u64, u64)],
        notif: Option<&[u8]>,
    ) -> Result<(), TransportError> {
        let (dst, qpns) = if peer == self.peer {
            (self.dst, self.qpns.clone())
        } else {
            (self.others[&peer].dst, self.others[&peer].qpns.clone())
        };
        let req = PostRequest {
            xfer: XferId(x),
            op,
            peer,
            segments: self.segs(dst, dst.1, segs),
            notification: notif.map(<[u8]>::to_vec),
        };
        self.i.st.set_now(self.now);
        self.i.st.post(&req, &typed(&qpns), "target", &self.limits)?;
        // Either way the bytes at `segs` of the source and the destination
        // are equal once the transfer moved them.
        self.moves.insert(x, (dst, segs.to_vec()));
        if let (Some(n), true) = (notif, peer == self.peer) {
            self.expect.insert(n.to_vec(), x);
        }
        Ok(())
    }

    /// [`post_to`](Self::post_to) the first peer.
    pub(super) fn post(
        &mut self,
        x: u64,
        op: Op,
        segs: &[(u64, u64)],
        notif: Option<&[u8]>,
    ) -> Result<(), TransportError> {
        self.post_to(self.peer, x, op, segs, notif)
    }

    /// Post to the first peer with a forged `rkey`.
    pub(super) fn post_with_rkey(
        &mut self,
        x: u64,
        op: Op,
        segs: &[(u64, u64)],
        rkey: u32,
    ) -> Result<(), TransportError> {
        let req = PostRequest {
            xfer: XferId(x),
            op,
            peer: self.peer,
            segments: self.segs(self.dst, rkey, segs),
            notification: None,
        };
        self.i.st.post(&req, &typed(&self.qpns), "target", &self.limits)
    }

    /// Move the clock on by `d`.
    pub(super) fn advance(&mut self, d: Duration) {
        self.now += d;
        self.i.st.set_now(self.now);
    }

    /// Hand every queued completion to its side's state machine.
    pub(super) fn drain_cqs(&mut self) -> bool {
        let mut any = false;
        let mut wcs = vec![WorkCompletion::default(); 16];
        loop {
            let n = self.i.nic.poll_cq(&mut wcs).unwrap();
            for wc in &wcs[..n] {
                self.i.st.on_completion(wc, &self.limits);
            }
            let mut m = self.t.nic.poll_cq(&mut wcs).unwrap();
            for wc in &wcs[..m] {
                self.t.st.on_completion(wc, &self.limits);
            }
            for r in self.others.values_mut() {
                let k = r.t.nic.poll_cq(&mut wcs).unwrap();
                for wc in &wcs[..k] {
                    r.t.st.on_completion(wc, &self.limits);
                }
                m += k;
            }
            if n + m == 0 {
                break;
            }
            any = true;
        }
        self.collect();
        // As the progress loop does: receives held back for a peer at its
        // bound are reposted once the application took enough.
        any |= self.t.st.release_held();
        for r in self.others.values_mut() {
            any |= r.t.st.release_held();
        }
        any
    }

    fn collect(&mut self) {
        let reported: Vec<Completion> = self.i.done.try_iter().collect();
        for c in reported {
            // `Done` promises the data moved (WRITE: at the target; READ: here).
            if c.result.is_ok() && !self.moved(c.xfer.0) {
                self.early_done.push(c.xfer.0);
            }
            if self.results.insert(c.xfer.0, c.result).is_some() {
                self.duplicates.push(c.xfer.0);
            }
        }
        if self.hold_notifs {
            return;
        }
        let arrived: Vec<Notification> = self.t.notifs.try_iter().map(HeldNotification::take).collect();
        for n in arrived {
            if self.expect.get(&n.payload).is_some_and(|&x| !self.moved(x)) {
                self.late_data.push(n.payload.clone());
            }
            self.got.push(n.payload);
        }
    }

    /// True when the bytes at every segment of transfer `x` are the same at
    /// the source and at its destination (the transfer moved them), or `x`
    /// is not tracked.
    fn moved(&self, x: u64) -> bool {
        self.moves.get(&x).is_none_or(|(dst, segs)| {
            segs.iter().all(|&(off, len)| {
                self.fabric.read(dst.1, dst.0 + off, len as usize)
                    == self.fabric.read(self.src.1, self.src.0 + off, len as usize)
            })
        })
    }

    /// One step of the fabric, then the completions; false when nothing moved.
    pub(super) fn pump(&mut self) -> bool {
        let stepped = self.fabric.step();
        self.advance(Duration::from_micros(10));
        self.drain_cqs() || stepped
    }

    /// `n` pumps.
    pub(super) fn steps(&mut self, n: usize) {
        for _ in 0..n {
            self.pump();
        }
    }

    /// Pump until nothing moves.
    pub(super) fn run(&mut self) {
        for _ in 0..10_000_000 {
            if !self.pump() {
                return;
            }
        }
        panic!("the simulation did not settle");
    }

    /// Cancel `x` as the engine does for `Cmd::Cancel`, pumping the fabric while
    /// it waits (flush after 50 pumps, destroy after 100); the fabric step at
    /// which it returned.
    pub(super) fn cancel(&mut self, x: u64) -> u64 {
        let started = self.fabric.world().steps;
        if self.i.st.cancel_start(XferId(x), &self.limits) {
            let mut flushed = false;
            for k in 0.. {
                let (flush, destroy) = (k > 50, k > 100);
                if self.i.st.cancel_step(XferId(x), flush, destroy, &mut flushed, &self.limits) {
                    break;
                }
                self.pump();
                assert!(k < 1_000_000, "cancel never returned");
            }
        }
        let at = self.fabric.world().steps;
        assert!(at >= started);
        at
    }

    /// The result of `x`, once reported.
    pub(super) fn result(&self, x: u64) -> Option<Result<(), TransferFailure>> {
        self.results.get(&x).cloned()
    }

    /// Notifications in the first target's queue, not taken.
    pub(super) fn t_queued(&self) -> usize {
        self.t.notifs.len()
    }

    /// Notification payloads the first target received so far.
    pub(super) fn notifs(&mut self) -> Vec<Vec<u8>> {
        self.collect();
        self.got.clone()
    }

    /// Fill the source with `f(byte index)`.
    pub(super) fn fill_src(&self, f: impl Fn(usize) -> u8) {
        let data: Vec<u8> = (0..2 * REGION).map(f).collect();
        assert!(self.fabric.write(self.src.1, self.src.0, &data));
    }

    /// Fill the first target's region with `f(offset)` (the data a READ pulls).
    pub(super) fn fill_dst(&self, f: impl Fn(usize) -> u8) {
        let data: Vec<u8> = (0..REGION).map(f).collect();
        assert!(self.fabric.write(self.dst.1, self.dst.0, &data));
    }

    /// The first target's region.
    pub(super) fn dst_bytes(&self) -> Vec<u8> {
        self.fabric.read(self.dst.1, self.dst.0, REGION).unwrap()
    }

    /// Source and first target agree on `segs`.
    pub(super) fn assert_same(&self, segs: &[(u64, u64)]) {
        for &(off, len) in segs {
            let a = self.fabric.read(self.src.1, self.src.0 + off, len as usize);
            let b = self.fabric.read(self.dst.1, self.dst.0 + off, len as usize);
            assert_eq!(a, b, "bytes at {off}+{len}");
        }
    }

    /// What must hold at any time: no transfer reported twice, no CQ overrun,
    /// the CQE budget adds up, no notification ahead of its data, no WRITE
    /// `Done` before its data landed.
    pub(super) fn invariants(&mut self) {
        self.collect();
        assert!(self.duplicates.is_empty(), "reported more than once: {:?}", self.duplicates);
        assert!(self.fabric.world().overruns.is_empty(), "CQ overrun");
        assert!(self.late_data.is_empty(), "notification before its data: {:?}", self.late_data);
        assert!(self.early_done.is_empty(), "Done before the data landed: {:?}", self.early_done);
        for (s, cq) in [(&self.i.st, self.opts.cq), (&self.t.st, self.opts.cq_target)] {
            let held: u32 = s.send_cqes_held();
            assert_eq!(s.cq().free() + s.cq().recv_reserved() + held, cq as u32, "CQE budget");
        }
    }
}

/// Connect `opts.qps` QP pairs between `i` and `t` as `conn.rs` does.
fn connect(fabric: &SimFabric, i: &mut Side, t: &mut Side, peer: PeerId, opts: Opts, now: Instant) -> Vec<u32> {
    let mut qpns = Vec::new();
    let credit = Arc::new(NotifCredit::new(opts.notif_bound.0, opts.notif_bound.1));
    for _ in 0..opts.qps {
        let iq = i.nic.create_qp(opts.max_send_wr.max(1), 1).unwrap();
        let mut tq = t.nic.create_qp(4, RECVS_PER_QP).unwrap();
        fabric.connect_with_read_depth(iq.qp_num(), tq.qp_num(), opts.rd_atomic);
        assert!(t.st.reserve_recv_cqes(RECVS_PER_QP), "target CQ full");
        let slab = Arc::new(t.nic.alloc_slab(RECVS_PER_QP as usize * NOTIF_SLOT_BYTES).unwrap());
        for slot in 0..RECVS_PER_QP {
            let off = slot as usize * NOTIF_SLOT_BYTES;
            tq.post_recv(RECV_BIT | u64::from(slot), &slab, off, NOTIF_SLOT_BYTES as u32).unwrap();
        }
        t.st.add_recv_qp(RecvQp::new(tq, "initiator".into(), slab, credit.clone(), RECVS_PER_QP));
        qpns.push(iq.qp_num());
        i.st.set_now(now);
        i.st.add_send_qp(iq, peer);
    }
    qpns
}
