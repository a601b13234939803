//! The verbs state machine, owned by the engine on the progress thread
//! (`engine.rs`) and driven by its commands and by work completions: send
//! QPs with their queues of work, transfers, target-side receive QPs and the
//! notifications they produced. I/O-free but for the [`NicQp`] calls.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, Ordering::Relaxed};
use std::time::Instant;

use crossbeam_channel::Sender;

use super::nic::{NicQp, NicSlab};
use super::wc::{post_failure, wc_failure};
use crate::metrics::LinkCounters;
use crate::transport::split::split;
use crate::transport::{Completion, Notification, Op, PeerId, Segment, TransferFailure, XferId};
use crate::verbs::{WcStatus, WorkCompletion, WrBatch, WrId};

/// Largest notification payload (bytes): one receive slot.
pub(super) const NOTIF_SLOT_BYTES: usize = 4096;
/// Notification slots per peer on the initiator (notifications in flight).
pub(super) const NOTIF_SLOTS: u32 = 256;
/// Largest single WR (bytes); longer segments are split.
pub(super) const MAX_WR_BYTES: u64 = 1 << 30;

/// A queue pair's number (`qp_num`), as this state keys its QPs. The NIC
/// calls and work completions carry it raw; it is wrapped where the state
/// takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Qpn(pub u32);

impl std::fmt::Display for Qpn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A signalled chunk's id: the wr_id of every WR of the chunk
/// ([`WrId`] on the NIC, the completion's `wr_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ChunkId(u64);

impl ChunkId {
    /// The id after this one.
    fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

/// One unit of queued work: an RDMA WR or a notification SEND.
#[derive(Debug, Clone, Copy)]
pub(super) enum Work {
    /// RDMA READ/WRITE of one segment (≤ [`MAX_WR_BYTES`]).
    Rdma { xfer: XferId, read: bool, seg: Segment },
    /// SEND of `len` bytes from notification slot `slot` of the peer slab;
    /// `fence`: posted with `IBV_SEND_FENCE`, so the NIC sends it only after
    /// the READs ahead of it on the QP completed (a READ's notification).
    Notify { xfer: XferId, slot: u32, len: u32, fence: bool },
}

impl Work {
    /// The transfer this work belongs to.
    pub(super) fn xfer(&self) -> XferId {
        match *self {
            Work::Rdma { xfer, .. } | Work::Notify { xfer, .. } => xfer,
        }
    }
}

/// An initiator-side QP: its queue of work not yet posted and the
/// signalled chunks in flight.
pub(super) struct SendQp<Q> {
    pub qp: Q,
    pub peer: PeerId,
    /// WRs posted and not yet covered by a polled completion.
    pub outstanding: u32,
    /// Chunk id (the wr_id of every WR of the chunk) → its chunk.
    pub chunks: HashMap<ChunkId, Chunk>,
    pub queue: VecDeque<Work>,
    /// Set by the first error completion: the QP needs a reset + reconnect.
    pub error: Option<TransferFailure>,
    /// CQEs still held for this QP after error completions: each WR of a
    /// failed chunk may still be flushed with a CQE of its own.
    pub flush_reserved: u32,
    /// When the QP last made progress: its first WR posted with none
    /// outstanding, or its last completion ([`State::expire`]).
    pub progress_at: Instant,
    /// When [`State::expire`] put the QP in error for want of progress.
    pub expired_at: Option<Instant>,
}

impl<Q> SendQp<Q> {
    /// A connected QP of `peer` with nothing queued or in flight.
    pub(super) fn new(qp: Q, peer: PeerId, now: Instant) -> Self {
        Self {
            qp,
            peer,
            outstanding: 0,
            chunks: HashMap::new(),
            queue: VecDeque::new(),
            error: None,
            flush_reserved: 0,
            progress_at: now,
            expired_at: None,
        }
    }
}

/// Signalled WRs posted together: one completion retires them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Chunk {
    /// The transfer they belong to.
    pub xfer: XferId,
    /// WRs in the chunk (its last one signalled).
    pub wrs: u32,
}

/// A chunk as `pump_now` builds a batch: its id, transfer and WRs.
#[derive(Debug, Clone, Copy)]
struct SignaledChunk {
    id: ChunkId,
    xfer: XferId,
    /// WRs in the chunk (its last one signalled).
    wrs: u32,
}

/// A notification SEND waiting for every WR of its transfer to complete
/// (multi-QP peers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DeferredNotify {
    /// The QP it goes on.
    pub qpn: Qpn,
    /// Its slot in the peer's slab, and its length in bytes.
    pub slot: u32,
    pub len: u32,
}

/// A notification slot taken by a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef {
    pub peer: PeerId,
    pub slot: u32,
}

/// A transfer in flight.
pub(super) struct Xfer {
    /// Work items queued but not yet posted.
    pub queued: u32,
    /// Signalled chunks posted and not yet completed.
    pub chunks: u32,
    pub error: Option<TransferFailure>,
    pub cancelled: bool,
    /// Notification to send once all data completed (multi-QP peers).
    pub deferred_notify: Option<DeferredNotify>,
    /// Notification slot to free at the end.
    pub slot: Option<SlotRef>,
}

/// A target-side QP receiving notifications from one initiator.
pub struct RecvQp<Q: NicQp> {
    pub qp: Q,
    pub agent: String,
    /// Receive slots; the QP also keeps it alive (`post_recv_owned`).
    pub slab: Arc<Q::Slab>,
    /// The count of its peer's notifications in the target's queue, shared
    /// by the peer's receive QPs.
    credit: Arc<NotifCredit>,
    /// Receives completed while the peer was at its bound: `(wr_id, bytes)`,
    /// oldest first. Each notification stays in its slot, neither delivered
    /// nor reposted, until the application took enough
    /// ([`State::release_held`]); with no receive posted, the peer's next
    /// SEND waits at its NIC (RNR, retried forever).
    held: VecDeque<(u64, u32)>,
    /// Receives posted whose completion has not been polled: each comes
    /// back as one CQE (a notification, or a flush once the QP is in error).
    posted: u32,
    /// Moved to the error state by the fence ([`State::fence_recv_qp`]):
    /// nothing is reposted; its posted receives come back flushed.
    fenced: bool,
    /// Removed while fenced receives were still to come back: the CQEs of
    /// its reservation to give back once they all did (then it is
    /// destroyed).
    draining: Option<u32>,
}

impl<Q: NicQp> RecvQp<Q> {
    /// A receive QP of the peer whose notifications `credit` counts, with
    /// `posted` receives posted.
    pub fn new(qp: Q, agent: String, slab: Arc<Q::Slab>, credit: Arc<NotifCredit>, posted: u32) -> Self {
        Self { qp, agent, slab, credit, held: VecDeque::new(), posted, fenced: false, draining: None }
    }

    /// Notifications held in its slots (the peer at its bound).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Deliver the notification of receive `wr_id` (`len` bytes) of a QP
    /// going away, over its peer's bound (the sender saw it succeed), and
    /// repost nothing.
    fn deliver_over_bound(&mut self, notifs: &Sender<HeldNotification>, wr_id: u64, len: u32) {
        self.credit.force_take(len);
        self.deliver(notifs, wr_id, len, false);
    }

    /// Deliver the notification of receive `wr_id` (`len` bytes, counted in
    /// the credit already) and, with `repost`, post the receive again.
    fn deliver(&mut self, notifs: &Sender<HeldNotification>, wr_id: u64, len: u32, repost: bool) {
        let slot = (wr_id & !RECV_BIT) as usize;
        // The receive completed: the NIC no longer writes the slot until it
        // is reposted below.
        let Some(payload) = self.slab.read(slot * NOTIF_SLOT_BYTES, len as usize) else {
            self.credit.give(len as usize);
            return;
        };
        let n = Notification { from_agent: self.agent.clone(), payload };
        if notifs.send(HeldNotification { n, credit: self.credit.clone() }).is_err() {
            self.credit.give(len as usize);
        }
        if !repost || self.fenced {
            return;
        }
        match self.qp.post_recv(wr_id, &self.slab, slot * NOTIF_SLOT_BYTES, NOTIF_SLOT_BYTES as u32) {
            Ok(()) => self.posted += 1,
            Err(e) => tracing::warn!("verbs: cannot repost a receive for {}: {e}", self.agent),
        }
    }
}

/// The notifications of one connected peer in the target's queue (delivered
/// by the engine, not yet taken by `take_notifications`) and their bounds.
/// One atomic word, count in the high half and bytes in the low half, so
/// delivering or taking one notification is one atomic add or subtract.
#[derive(Debug)]
pub struct NotifCredit {
    held: AtomicU64,
    max_count: u32,
    max_bytes: u32,
}

/// One notification in the held word.
const ONE: u64 = 1 << 32;

impl NotifCredit {
    /// Bounds of `count` notifications and `bytes` payload bytes (each at
    /// least 1, at most 2^31, so the word never overflows).
    pub fn new(count: usize, bytes: usize) -> Self {
        let cap = |v: usize| v.clamp(1, 1 << 31) as u32;
        Self { held: AtomicU64::new(0), max_count: cap(count), max_bytes: cap(bytes) }
    }

    /// Notifications and bytes held now.
    pub fn held(&self) -> (u32, u32) {
        let h = self.held.load(Ordering::Acquire);
        ((h >> 32) as u32, h as u32)
    }

    /// True when one more of `len` bytes fits: under both bounds, or the
    /// queue holds none of this peer's (a notification over the byte bound
    /// alone is still delivered, one at a time).
    fn fits(&self, prev: u64, len: u32) -> bool {
        let (n, b) = ((prev >> 32) as u32, prev as u32);
        n == 0 || (n < self.max_count && b.saturating_add(len) <= self.max_bytes)
    }

    /// Count a notification of `len` bytes in if it [fits](Self::fits):
    /// one atomic add (and a subtract when it does not fit).
    fn try_take(&self, len: u32) -> bool {
        let add = ONE | u64::from(len);
        let prev = self.held.fetch_add(add, Ordering::AcqRel);
        if self.fits(prev, len) {
            return true;
        }
        self.held.fetch_sub(add, Ordering::AcqRel);
        false
    }

    /// Would a notification of `len` bytes fit now (a load).
    fn has_room(&self, len: u32) -> bool {
        self.fits(self.held.load(Ordering::Acquire), len)
    }

    /// Count one in regardless of the bounds.
    fn force_take(&self, len: u32) {
        self.held.fetch_add(ONE | u64::from(len), Ordering::AcqRel);
    }

    /// A notification of `len` bytes left the queue (taken).
    pub fn give(&self, len: usize) {
        self.held.fetch_sub(ONE | len as u64, Ordering::AcqRel);
    }
}

/// A received notification in the target's channel with its peer's credit,
/// given back when `take_notifications` hands it out.
#[derive(Debug)]
pub struct HeldNotification {
    pub n: Notification,
    pub credit: Arc<NotifCredit>,
}

impl HeldNotification {
    /// The notification, its credit given back.
    pub fn take(self) -> Notification {
        self.credit.give(self.n.payload.len());
        self.n
    }
}

/// Notification slots of one peer (a registered slab on the initiator).
struct NotifSlab<S> {
    mr: S,
    free: Vec<u32>,
}

/// Why no notification slot could be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotRefusal {
    /// The peer has no slab (unknown or disconnected).
    NoSlab,
    /// All [`NOTIF_SLOTS`] of the peer are in flight.
    Full,
}

/// The notification slots of every peer: the one count of them (a slot is
/// taken by a notified post and given back when its transfer ends).
pub struct NotifSlots<S> {
    slabs: HashMap<PeerId, NotifSlab<S>>,
}

impl<S: NicSlab> NotifSlots<S> {
    fn new() -> Self {
        Self { slabs: HashMap::new() }
    }

    /// Give `peer` the slab `mr` of [`NOTIF_SLOTS`] slots, all free.
    pub fn install(&mut self, peer: PeerId, mr: S) {
        self.slabs.insert(peer, NotifSlab { mr, free: (0..NOTIF_SLOTS).rev().collect() });
    }

    /// Forget `peer`'s slab (disconnect).
    pub fn remove(&mut self, peer: PeerId) {
        self.slabs.remove(&peer);
    }

    /// Free slots of `peer` (0 for a peer without a slab).
    pub fn free(&self, peer: PeerId) -> u32 {
        self.slabs.get(&peer).map_or(0, |s| s.free.len() as u32)
    }

    /// Take a slot of `peer` and write `payload` (≤ [`NOTIF_SLOT_BYTES`])
    /// into it.
    ///
    /// # Errors
    /// [`SlotRefusal`] when the peer has no slab or no free slot.
    pub fn take(&mut self, peer: PeerId, payload: &[u8]) -> Result<SlotRef, SlotRefusal> {
        let slab = self.slabs.get_mut(&peer).ok_or(SlotRefusal::NoSlab)?;
        let slot = slab.free.pop().ok_or(SlotRefusal::Full)?;
        // Slot `slot` is free: no WR reads it until one is posted.
        let written = slab.mr.write(slot as usize * NOTIF_SLOT_BYTES, payload);
        debug_assert!(written, "payloads fit a slot");
        Ok(SlotRef { peer, slot })
    }

    /// Give a slot back (its transfer ended).
    fn give(&mut self, r: SlotRef) {
        if let Some(s) = self.slabs.get_mut(&r.peer) {
            s.free.push(r.slot);
        }
    }

    /// The SGE of `slot` of `peer`: `(address, lkey)`, `(0, 0)` without a
    /// slab (the WR then fails on the NIC).
    fn sge(&self, peer: PeerId, slot: u32) -> (u64, u32) {
        self.slabs
            .get(&peer)
            .map(|s| (s.mr.addr() + u64::from(slot) * NOTIF_SLOT_BYTES as u64, s.mr.lkey()))
            .unwrap_or((0, 0))
    }
}

/// The CQE budget of the shared completion queue: what it can still take,
/// and how much of it the posted receives hold. No WR is posted beyond it,
/// so the CQ never overruns (an overrun would put every QP on it in error).
#[derive(Debug)]
pub struct CqBudget {
    /// CQEs the CQ can still take: its size less one per posted send WR
    /// (signalled ones complete with a CQE, and after an error every WR is
    /// flushed with one) and one per posted receive.
    free: u32,
    /// A QP stopped posting for want of CQEs: completions then pump every
    /// QP with queued work.
    starved: bool,
    /// CQEs held for posted receives, at most `recv_cap` (half the CQ).
    recv_reserved: u32,
    recv_cap: u32,
}

impl CqBudget {
    /// The budget of an empty CQ of `cqes` entries.
    pub fn new(cqes: u32) -> Self {
        Self { free: cqes, starved: false, recv_reserved: 0, recv_cap: cqes / 2 }
    }

    /// CQEs the CQ can still take.
    pub fn free(&self) -> u32 {
        self.free
    }

    /// CQEs held for posted receives.
    pub fn recv_reserved(&self) -> u32 {
        self.recv_reserved
    }

    /// Hold `n` CQEs for receives; false when they do not fit (receives
    /// take at most half of the CQ).
    fn reserve_recv(&mut self, n: u32) -> bool {
        let ok = self.recv_reserved + n <= self.recv_cap && self.free >= n;
        if ok {
            self.free -= n;
            self.recv_reserved += n;
        }
        ok
    }

    /// Give back `n` CQEs held for receives.
    fn unreserve_recv(&mut self, n: u32) {
        self.recv_reserved = self.recv_reserved.saturating_sub(n);
        self.release(n);
    }

    /// Give back `n` CQEs held by posted WRs.
    fn release(&mut self, n: u32) {
        self.free = self.free.saturating_add(n);
    }

    /// Hold `n` CQEs for WRs just posted (at most [`free`](Self::free)).
    fn take(&mut self, n: u32) {
        self.free -= n;
    }

    /// A QP stopped posting for want of CQEs.
    fn starve(&mut self) {
        self.starved = true;
    }

    /// True (once) when a QP starved and CQEs are free again: the waiting
    /// QPs are to be pumped.
    fn wake_starved(&mut self) -> bool {
        let wake = self.starved && self.free > 0;
        if wake {
            self.starved = false;
        }
        wake
    }

    /// Pretend the CQ is full (tests of starvation).
    #[cfg(test)]
    pub fn exhaust(&mut self) {
        self.free = 0;
    }
}

/// Everything the engine owns, behind walls: its fields are private to
/// this module (and its `ops` and `deadline` parts); the engine and the
/// tests go through the methods.
pub struct State<Q: NicQp> {
    send_qps: HashMap<Qpn, SendQp<Q>>,
    xfers: HashMap<XferId, Xfer>,
    /// Notification slots per peer: the one count of them.
    slots: NotifSlots<Q::Slab>,
    /// Per peer, what the caller sees of it ([`PeerLink`]): QPs broken. Absent in tests that drive the state directly.
    links: HashMap<PeerId, Arc<PeerLink>>,
    /// Finished transfers, to the transport's `poll` without this state's
    /// lock, so a scheduler polling `status` never waits for the progress
    /// thread.
    done: Sender<Completion>,
    recv_qps: HashMap<Qpn, RecvQp<Q>>,
    /// Receive QPs holding notifications in their slots (their peer at its
    /// bound; usually empty): [`release_held`](Self::release_held).
    holding: Vec<Qpn>,
    /// Received notifications, to `take_notifications` likewise.
    notifs: Sender<HeldNotification>,
    next_chunk: ChunkId,
    batch: WrBatch,
    /// The CQE budget of the shared completion queue.
    cq: CqBudget,
    /// Steps waiting to be handled, and whether a handler runs
    /// ([`State::settle`]).
    events: VecDeque<Event>,
    settling: bool,
    /// The time the caller last set (the state reads no clock itself, so a
    /// simulation drives it): stamps QP progress for [`State::expire`].
    now: Instant,
    /// Where doorbells and work requests are counted, if anywhere.
    counters: Option<Arc<LinkCounters>>,
}

/// Posting parameters.
#[derive(Debug, Clone, Copy)]
pub struct PostLimits {
    /// Send queue depth per QP.
    pub max_send_wr: u32,
    /// Signal every Nth WR (and the last of each transfer and batch).
    pub signal_every: u32,
    /// WRs per `post_send` call.
    pub max_batch: u32,
    /// A batch also ends once it carries this many bytes (0: no limit).
    pub batch_bytes: u64,
    /// Microseconds the progress thread sleeps between polls of an idle
    /// completion queue (after spinning and yielding).
    pub poll_sleep_us: u32,
    /// `sched_yield`s of the progress thread on an idle CQ (after 64 spins)
    /// before it blocks on completion events or sleeps.
    pub idle_yields: u32,
}

/// How many WRs from the front of `queue` the next `post_send` chains: at
/// most `room` and `limits.max_batch`, and ending with the WR that brings
/// the batch to `limits.batch_bytes` bytes (when non-zero). At least one
/// when the queue and `room` are non-empty.
pub(super) fn batch_len(queue: &VecDeque<Work>, room: usize, limits: &PostLimits) -> usize {
    let n = room.min(limits.max_batch as usize).min(queue.len());
    if limits.batch_bytes == 0 {
        return n;
    }
    let mut bytes = 0u64;
    for (k, w) in queue.iter().take(n).enumerate() {
        bytes += match *w {
            Work::Rdma { seg, .. } => seg.len_bytes,
            Work::Notify { len, .. } => u64::from(len),
        };
        if bytes >= limits.batch_bytes {
            return k + 1;
        }
    }
    n
}

/// A step of the state machine that another step caused, handled at the top
/// ([`State::settle`]) rather than inside the step that caused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// Post what fits of the QP's queue (or fail it, the QP in error).
    Pump(Qpn),
    /// Report the transfer if nothing of it is queued or in flight.
    Finish(XferId),
    /// CQEs came back: pump the QPs that waited for them, but `skip`.
    PumpStarved { skip: Option<Qpn> },
}

/// Receive chunk ids have the top bit set; the rest is the slot.
pub(super) const RECV_BIT: u64 = 1 << 63;

#[path = "deadline.rs"]
mod deadline;
#[path = "ops.rs"]
mod ops;

impl<Q: NicQp> State<Q> {
    /// Set the time (the state reads no clock itself).
    pub fn set_now(&mut self, now: Instant) {
        self.now = now;
    }

    /// The notification slots.
    pub fn slots(&self) -> &NotifSlots<Q::Slab> {
        &self.slots
    }

    /// The notification slots, to give a peer its slab or take it away.
    pub fn slots_mut(&mut self) -> &mut NotifSlots<Q::Slab> {
        &mut self.slots
    }

    /// The CQE budget.
    pub fn cq(&self) -> &CqBudget {
        &self.cq
    }

    /// The CQE budget, for tests that starve it.
    #[cfg(test)]
    pub fn cq_mut(&mut self) -> &mut CqBudget {
        &mut self.cq
    }

    /// CQEs held by the send QPs' posted WRs and expected flushes.
    pub fn send_cqes_held(&self) -> u32 {
        self.send_qps.values().map(|q| q.outstanding + q.flush_reserved).sum()
    }

    /// Add connected send QP `qp` of `peer`, nothing queued or in flight.
    pub fn add_send_qp(&mut self, qp: Q, peer: PeerId) {
        self.send_qps.insert(Qpn(qp.qp_num()), SendQp::new(qp, peer, self.now));
    }

    /// True while `qpn` is a send QP here.
    pub fn has_send_qp(&self, qpn: Qpn) -> bool {
        self.send_qps.contains_key(&qpn)
    }

    /// Add a target-side receive QP (receives posted).
    pub fn add_recv_qp(&mut self, r: RecvQp<Q>) {
        self.recv_qps.insert(Qpn(r.qp.qp_num()), r);
    }

    /// Destroy receive QP `qpn`, whose reservation holds `share` CQEs; how
    /// many of them the caller must not give back yet. The notifications it
    /// still held in its slots (its peer was at its bound) are delivered
    /// now, over the bound: their sender saw them succeed. A fenced QP whose
    /// flushed receives have not all come back is destroyed only once they
    /// did, and gives its `share` back then ([`on_recv`](Self::on_recv)):
    /// until then they may still be written to the CQ.
    pub fn remove_recv_qp(&mut self, qpn: Qpn, share: u32) -> u32 {
        let mut kept = 0;
        if let Some(r) = self.recv_qps.get_mut(&qpn).filter(|r| r.draining.is_none()) {
            while let Some((wr_id, len)) = r.held.pop_front() {
                r.deliver_over_bound(&self.notifs, wr_id, len);
            }
            if r.fenced && r.posted > 0 {
                r.draining = Some(share);
                kept = share;
            } else {
                self.recv_qps.remove(&qpn);
            }
        }
        self.holding.retain(|q| *q != qpn);
        kept
    }

    /// Move receive QP `qpn` to the error state: an RC responder drops
    /// every request that still arrives for it (a replaced connection's
    /// late WRITE packets: the fence, `conn.rs`). Its posted receives come
    /// back flushed (within its reservation, which
    /// [`remove_recv_qp`](Self::remove_recv_qp) keeps until they did) and
    /// are not reposted; notifications it holds are still delivered. False
    /// when the QP could not be moved to error (a QP that is gone already
    /// is fenced: nothing lands through it).
    pub fn fence_recv_qp(&mut self, qpn: Qpn) -> bool {
        let Some(r) = self.recv_qps.get_mut(&qpn) else { return true };
        if r.fenced {
            return true;
        }
        match r.qp.set_error() {
            Ok(()) => {
                r.fenced = true;
                true
            }
            Err(e) => {
                tracing::warn!("verbs: fencing the receive QP {} of {}: {e}", qpn.0, r.agent);
                false
            }
        }
    }

    /// True while receive QP `qpn` waits for its flushes after its removal.
    #[cfg(test)]
    pub fn draining(&self, qpn: Qpn) -> bool {
        self.recv_qps.get(&qpn).is_some_and(|r| r.draining.is_some())
    }

    /// True while a receive QP holds notifications in its slots.
    #[cfg(test)]
    pub fn holds_back(&self) -> bool {
        !self.holding.is_empty()
    }

    /// True when a held notification fits its peer's bound again (the
    /// application took some): [`release_held`](Self::release_held) would
    /// deliver it. Loads only.
    pub fn can_release(&self) -> bool {
        self.holding.iter().any(|q| {
            self.recv_qps.get(q).is_some_and(|r| r.held.front().is_some_and(|&(_, len)| r.credit.has_room(len)))
        })
    }

    /// Deliver the held notifications that fit their peer's bound again, in
    /// order, reposting their receives; true when any was.
    pub fn release_held(&mut self) -> bool {
        if self.holding.is_empty() {
            return false;
        }
        let State { recv_qps, holding, notifs, .. } = self;
        let mut any = false;
        holding.retain(|q| {
            let Some(r) = recv_qps.get_mut(q) else {
                return false;
            };
            while let Some(&(wr_id, len)) = r.held.front() {
                if !r.credit.has_room(len) || !r.credit.try_take(len) {
                    break;
                }
                r.held.pop_front();
                r.deliver(notifs, wr_id, len, true);
                any = true;
            }
            !r.held.is_empty()
        });
        any
    }

    /// Notifications held in the slots of receive QP `qpn`.
    #[cfg(test)]
    pub fn held_in(&self, qpn: Qpn) -> usize {
        self.recv_qps.get(&qpn).map_or(0, RecvQp::held)
    }

    /// Numbers of the receive QPs.
    pub fn recv_qpns(&self) -> Vec<Qpn> {
        self.recv_qps.keys().copied().collect()
    }

    /// WRs waiting in the software queues of every QP (not yet posted).
    pub fn queued_wrs(&self) -> usize {
        self.send_qps.values().map(|sq| sq.queue.len()).sum()
    }

    /// The transfers in flight.
    pub fn xfer_ids(&self) -> Vec<XferId> {
        self.xfers.keys().copied().collect()
    }

    /// Give `peer` the link its caller watches, or take it away (`None`).
    pub fn set_link(&mut self, peer: PeerId, link: Option<Arc<PeerLink>>) {
        match link {
            Some(l) => self.links.insert(peer, l),
            None => self.links.remove(&peer),
        };
    }

    /// Set or clear `peer`'s broken flag.
    pub fn set_broken(&mut self, peer: PeerId, broken: bool) {
        if let Some(l) = self.links.get(&peer) {
            l.broken.store(broken, std::sync::atomic::Ordering::Release);
        }
    }

    /// Report `x` as failed with `why` without it ever having been a
    /// transfer here (refused, or held behind a failed reconnect).
    pub fn report_failed(&self, x: XferId, why: TransferFailure) {
        let _ = self.done.send(Completion { xfer: x, result: Err(why) });
    }

    /// How `peer`'s QPs `qpns` stand. A QP number the peer kept may since
    /// name another peer's QP (reused): only a QP of this peer counts.
    pub fn peer_state(&self, peer: PeerId, qpns: &[Qpn]) -> PeerQpState {
        let own = |q: &Qpn| self.send_qps.get(q).filter(|s| s.peer == peer);
        PeerQpState {
            busy: qpns.iter().any(|q| own(q).is_some_and(|s| s.outstanding > 0)),
            broken: qpns.is_empty() || qpns.iter().any(|q| own(q).is_none_or(|s| s.error.is_some())),
        }
    }

    /// Empty state for a completion queue of `cqes` entries.
    pub fn new(cqes: u32, done: Sender<Completion>, notifs: Sender<HeldNotification>) -> Self {
        Self {
            send_qps: HashMap::new(),
            xfers: HashMap::new(),
            slots: NotifSlots::new(),
            links: HashMap::new(),
            done,
            recv_qps: HashMap::new(),
            holding: Vec::new(),
            notifs,
            next_chunk: ChunkId(0),
            batch: WrBatch::default(),
            cq: CqBudget::new(cqes),
            events: VecDeque::new(),
            settling: false,
            now: Instant::now(),
            counters: None,
        }
    }

    /// Count every `post_send` (one doorbell) and the work requests it
    /// queued into `c` from now on (the metrics' `kvwire_doorbells_total`
    /// and `kvwire_work_requests_total`).
    pub fn count_posts_into(&mut self, c: Arc<LinkCounters>) {
        self.counters = Some(c);
    }

    /// Hold `n` CQEs for receives about to be posted; false when they do not
    /// fit. Receives take at most half of the CQ, so that sends always have
    /// room (receives stay posted for as long as their initiator is
    /// connected, and sends waiting for them would wait as long).
    pub fn reserve_recv_cqes(&mut self, n: u32) -> bool {
        self.cq.reserve_recv(n)
    }

    /// Give back `n` CQEs held by [`reserve_recv_cqes`](Self::reserve_recv_cqes)
    /// and post the work that waited for them.
    pub fn release_recv_cqes(&mut self, n: u32, limits: &PostLimits) {
        self.cq.unreserve_recv(n);
        self.pump_starved(limits);
    }

    /// Give back `n` CQEs held by receives or by
    /// posted WRs. Callers then [`pump_starved`](Self::pump_starved): work
    /// that waits for CQEs is posted only from there.
    pub fn release_cqes(&mut self, n: u32) {
        self.cq.release(n);
    }

    /// After CQEs were given back: post the work of every QP that stopped
    /// for want of them (nothing else would, when none of its WRs is in
    /// flight).
    pub fn pump_starved(&mut self, limits: &PostLimits) {
        self.pump_starved_except(None, limits);
    }

    /// [`pump_starved`](Self::pump_starved) but for `skip`, which the caller pumps next.
    fn pump_starved_except(&mut self, skip: Option<Qpn>, limits: &PostLimits) {
        self.events.push_back(Event::PumpStarved { skip });
        self.settle(limits);
    }

    /// Handle events until none is left, unless a handler is running
    /// already (then it returns at once and the loop below takes the new
    /// events after that handler returned). So a handler never runs inside
    /// another: work a step causes (posting a QP's queue, reporting a
    /// transfer, the QPs waiting for CQEs) is an event, handled in order
    /// at the top.
    fn settle(&mut self, limits: &PostLimits) {
        if self.settling {
            return;
        }
        self.settling = true;
        while let Some(e) = self.events.pop_front() {
            match e {
                Event::Pump(q) => self.pump_now(q, limits),
                Event::Finish(x) => self.finish_now(x, limits),
                Event::PumpStarved { skip } => self.pump_starved_now(skip, limits),
            }
        }
        self.settling = false;
    }

    fn pump_starved_now(&mut self, skip: Option<Qpn>, limits: &PostLimits) {
        if !self.cq.wake_starved() {
            return;
        }
        let waiting: Vec<Qpn> =
            self.send_qps.iter().filter(|&(&q, sq)| !sq.queue.is_empty() && Some(q) != skip).map(|(&q, _)| q).collect();
        for q in waiting {
            self.pump(q, limits);
        }
    }

    /// Queue `segments` of `xfer` round-robin over `qpns` (by runs of
    /// `stripe` segments) and post what fits.
    pub fn enqueue(&mut self, xfer: XferId, op: Op, segments: &[Segment], qpns: &[Qpn], limits: &PostLimits) {
        let read = op == Op::Read;
        let stripe = 64usize;
        let mut queued = 0u32;
        for (i, s) in segments.iter().enumerate() {
            let q = qpns[(i / stripe) % qpns.len()];
            let Some(sq) = self.send_qps.get_mut(&q) else {
                if let Some(x) = self.xfers.get_mut(&xfer) {
                    x.error.get_or_insert_with(|| TransferFailure::peer_died(format!("no QP {q} to post on")));
                }
                continue;
            };
            for seg in split(*s, MAX_WR_BYTES) {
                sq.queue.push_back(Work::Rdma { xfer, read, seg });
                queued += 1;
            }
        }
        if let Some(x) = self.xfers.get_mut(&xfer) {
            x.queued += queued;
        }
        for q in qpns {
            self.pump(*q, limits);
        }
    }

    /// Queue a notification SEND on `qpn` (`fence`: see [`Work::Notify`]).
    pub fn enqueue_notify(&mut self, xfer: XferId, qpn: Qpn, slot: u32, len: u32, fence: bool, limits: &PostLimits) {
        if let Some(sq) = self.send_qps.get_mut(&qpn) {
            sq.queue.push_back(Work::Notify { xfer, slot, len, fence });
            if let Some(x) = self.xfers.get_mut(&xfer) {
                x.queued += 1;
            }
            self.pump(qpn, limits);
        } else if let Some(x) = self.xfers.get_mut(&xfer) {
            x.error.get_or_insert_with(|| TransferFailure::peer_died(format!("notification not sent: no QP {qpn}")));
            self.try_finish(xfer, limits);
        }
    }

    /// Fail the work queued on `qpn` (in error: nothing more is posted
    /// there) and report the transfers that then have nothing in flight.
    pub fn fail_queue(&mut self, qpn: Qpn, limits: &PostLimits) {
        let Some(sq) = self.send_qps.get_mut(&qpn) else {
            return;
        };
        let why = sq.error.clone().unwrap_or_else(|| TransferFailure::peer_died(format!("QP {qpn} closed")));
        let mut failed: Vec<XferId> = sq.queue.drain(..).map(|w| w.xfer()).collect();
        for x in &failed {
            if let Some(xf) = self.xfers.get_mut(x) {
                xf.queued = xf.queued.saturating_sub(1);
                xf.error.get_or_insert_with(|| why.clone());
            }
        }
        failed.dedup();
        for x in failed {
            self.try_finish(x, limits);
        }
    }

    /// Drop `qpn` (disconnect or reconnect), failing its queued work and
    /// giving back the CQEs its WRs held.
    ///
    /// Chunks still in flight fail too, once the QP is destroyed (dropped
    /// here), since from then on the NIC can no longer touch their buffers.
    pub fn remove_qp(&mut self, qpn: Qpn, limits: &PostLimits) {
        self.fail_queue(qpn, limits);
        let Some(sq) = self.send_qps.remove(&qpn) else {
            return;
        };
        self.mark_broken(sq.peer);
        self.release_cqes(sq.outstanding + sq.flush_reserved);
        let in_flight: Vec<XferId> = sq.chunks.values().map(|c| c.xfer).collect();
        drop(sq);
        self.pump_starved(limits);
        for x in in_flight {
            if let Some(xf) = self.xfers.get_mut(&x) {
                xf.chunks = xf.chunks.saturating_sub(1);
                xf.error.get_or_insert_with(|| {
                    TransferFailure::peer_died(format!("QP {qpn} closed with the transfer in flight"))
                });
            }
            self.try_finish(x, limits);
        }
    }

    /// [`remove_qp`](Self::remove_qp) when `qpn` is a QP of `peer`: a number
    /// a peer kept for a QP destroyed since may name another peer's QP now.
    pub fn remove_peer_qp(&mut self, qpn: Qpn, peer: PeerId, limits: &PostLimits) {
        if self.send_qps.get(&qpn).is_some_and(|sq| sq.peer == peer) {
            self.remove_qp(qpn, limits);
        }
    }

    /// Forget transfer `x` without reporting it, freeing its notification slot.
    pub fn drop_xfer(&mut self, x: XferId) {
        self.take_xfer(x);
    }

    /// Remove transfer `x`'s record, giving its notification slot back.
    fn take_xfer(&mut self, x: XferId) -> Option<Xfer> {
        let xf = self.xfers.remove(&x)?;
        if let Some(r) = xf.slot {
            self.slots.give(r);
        }
        Some(xf)
    }

    /// Post as much of `qpn`'s queue as the send queue has room for (as an
    /// event: see [`settle`](Self::settle)).
    pub fn pump(&mut self, qpn: Qpn, limits: &PostLimits) {
        self.events.push_back(Event::Pump(qpn));
        self.settle(limits);
    }

    fn pump_now(&mut self, qpn: Qpn, limits: &PostLimits) {
        if self.send_qps.get(&qpn).is_some_and(|sq| sq.error.is_some()) {
            // Work queued on a QP in error (e.g. a deferred notification)
            // would wait forever: fail it.
            self.fail_queue(qpn, limits);
            return;
        }
        let State { send_qps, xfers, slots, batch, next_chunk, cq, now, counters, .. } = self;
        let Some(sq) = send_qps.get_mut(&qpn) else {
            return;
        };
        while !sq.queue.is_empty() && sq.outstanding < limits.max_send_wr {
            if cq.free() == 0 {
                cq.starve();
                break;
            }
            let room = ((limits.max_send_wr - sq.outstanding) as usize).min(cq.free() as usize);
            let n = batch_len(&sq.queue, room, limits);
            batch.clear();
            let mut records: Vec<SignaledChunk> = Vec::new();
            let mut chunk = *next_chunk;
            let mut in_chunk = 0u32;
            for k in 0..n {
                let w = sq.queue[k];
                let last = k + 1 == n || sq.queue[k + 1].xfer() != w.xfer();
                in_chunk += 1;
                let signaled = last || in_chunk >= limits.signal_every;
                match w {
                    Work::Rdma { read, seg, .. } => batch.push_rdma(
                        WrId(chunk.0),
                        read,
                        signaled,
                        seg.local_addr,
                        seg.len_bytes as u32,
                        seg.lkey.0,
                        seg.remote_addr,
                        seg.rkey.0,
                    ),
                    Work::Notify { slot, len, fence, .. } => {
                        let (addr, lkey) = slots.sge(sq.peer, slot);
                        batch.push_send(WrId(chunk.0), signaled, fence, addr, len, lkey);
                    }
                }
                if signaled {
                    records.push(SignaledChunk { id: chunk, xfer: w.xfer(), wrs: in_chunk });
                    chunk = chunk.next();
                    in_chunk = 0;
                }
            }
            *next_chunk = chunk;
            // SAFETY: every SGE lies in memory registered with its lkey: user
            // regions the engine keeps registered (and alive) until the
            // transfer is released, which waits for these WRs (cancel), or a
            // notification slab owned by this state.
            let posted = unsafe { sq.qp.post_send(batch) };
            let ok_upto = match &posted {
                Ok(()) => n,
                Err((i, _)) => *i,
            };
            // Track every posted WR: whole chunks, and after a failed
            // post_send the posted head of the chunk it cut (those WRs are
            // flushed with its wr_id once the QP is put in error below).
            let mut covered = 0usize;
            for SignaledChunk { id, xfer: x, wrs: cnt } in records {
                if covered >= ok_upto {
                    break;
                }
                let cnt = cnt.min((ok_upto - covered) as u32);
                covered += cnt as usize;
                sq.chunks.insert(id, Chunk { xfer: x, wrs: cnt });
                if let Some(xf) = xfers.get_mut(&x) {
                    xf.chunks += 1;
                }
            }
            cq.take(covered as u32);
            if let Some(c) = counters.as_ref().filter(|_| covered > 0) {
                c.doorbells.fetch_add(1, Relaxed);
                c.work_requests.fetch_add(covered as u64, Relaxed);
            }
            if sq.outstanding == 0 && covered > 0 {
                sq.progress_at = *now;
            }
            let why = posted.as_ref().err().map(|(_, e)| post_failure(e));
            let mut unposted = Vec::new();
            for (k, w) in sq.queue.drain(..n).enumerate() {
                if let Some(xf) = xfers.get_mut(&w.xfer()) {
                    xf.queued = xf.queued.saturating_sub(1);
                    // Not posted.
                    if let Some(why) = why.as_ref().filter(|_| k >= covered) {
                        xf.error.get_or_insert_with(|| why.clone());
                        unposted.push(w.xfer());
                    }
                }
            }
            sq.outstanding += covered as u32;
            if let Some(why) = why {
                // Rare (the queue is sized to fit). The posted head of a cut
                // chunk may run without a completion (its last WR is not
                // signalled), so waiting for the QP to drain could wait
                // forever: destroy it now (the NIC then no longer touches
                // any of its buffers), fail what it carried or queued; the
                // next post to the peer reconnects.
                tracing::error!("verbs: {why} on QP {qpn}");
                sq.error = Some(why);
                self.remove_qp(qpn, limits);
                unposted.dedup();
                for x in unposted {
                    self.try_finish(x, limits);
                }
                return;
            }
        }
    }

    /// Handle one work completion.
    pub fn on_completion(&mut self, wc: &WorkCompletion, limits: &PostLimits) {
        // Receive wr_ids carry RECV_BIT; the opcode is not defined on error
        // completions (a flushed SEND may show a stale receive opcode).
        if wc.wr_id & RECV_BIT != 0 {
            self.on_recv(wc, limits);
            return;
        }
        let qpn = Qpn(wc.qp_num);
        let Some(sq) = self.send_qps.get_mut(&qpn) else {
            return;
        };
        let Some(Chunk { xfer: x, wrs: cnt }) = sq.chunks.remove(&ChunkId(wc.wr_id)) else {
            // Another flushed WR of a chunk already reported.
            if wc.wc_status() != Some(WcStatus::Success) && sq.flush_reserved > 0 {
                sq.flush_reserved -= 1;
                self.release_cqes(1);
                self.pump_starved(limits);
            }
            return;
        };
        sq.outstanding = sq.outstanding.saturating_sub(cnt);
        sq.progress_at = self.now;
        // A good chunk completes with one CQE and no more; after an error
        // each of its other WRs may still be flushed with a CQE.
        let freed = if wc.wc_status() == Some(WcStatus::Success) {
            cnt
        } else {
            sq.flush_reserved += cnt - 1;
            1
        };
        self.release_cqes(freed);
        let Some(sq) = self.send_qps.get_mut(&qpn) else {
            return;
        };
        if wc.wc_status() != Some(WcStatus::Success) {
            let why = match &sq.error {
                Some(first) if wc.wc_status() == Some(WcStatus::WrFlushErr) => TransferFailure {
                    detail: format!("{} (after {first} on this QP)", wc.status_name()),
                    ..first.clone()
                },
                _ => wc_failure(wc),
            };
            if sq.error.is_none() {
                tracing::warn!("verbs: {why}");
                sq.error = Some(why.clone());
                let _ = sq.qp.set_error();
                let peer = sq.peer;
                self.mark_broken(peer);
            }
            if let Some(xf) = self.xfers.get_mut(&x) {
                xf.error.get_or_insert(why);
            }
        }
        if let Some(xf) = self.xfers.get_mut(&x) {
            xf.chunks = xf.chunks.saturating_sub(1);
        }
        // QPs that waited for CQEs go first: the QP that completed would
        // otherwise take every freed CQE for as long as it has work queued.
        self.pump_starved_except(Some(qpn), limits);
        // On a QP in error this fails (and reports) what is still queued.
        self.pump(qpn, limits);
        self.try_finish(x, limits);
    }

    /// Report `x` when nothing of it is queued or in flight (as an event:
    /// see [`settle`](Self::settle)).
    pub fn try_finish(&mut self, x: XferId, limits: &PostLimits) {
        self.events.push_back(Event::Finish(x));
        self.settle(limits);
    }

    fn finish_now(&mut self, x: XferId, limits: &PostLimits) {
        let Some(xf) = self.xfers.get_mut(&x) else {
            return;
        };
        if xf.queued > 0 || xf.chunks > 0 {
            return;
        }
        if xf.error.is_none()
            && let Some(DeferredNotify { qpn, slot, len }) = xf.deferred_notify.take()
        {
            // Every WR of `x` completed: nothing left to fence.
            self.enqueue_notify(x, qpn, slot, len, false, limits);
            return;
        }
        let Some(xf) = self.take_xfer(x) else {
            return;
        };
        if !xf.cancelled {
            // The transport owns the receiver for as long as this state.
            let _ = self.done.send(Completion { xfer: x, result: xf.error.map_or(Ok(()), Err) });
        }
    }

    /// A notification arrived: into the target's queue while its peer is
    /// under its bound (one atomic add on the peer's credit) and its receive
    /// reposted; otherwise held in its slot, the receive not reposted, until
    /// [`release_held`](Self::release_held).
    fn on_recv(&mut self, wc: &WorkCompletion, limits: &PostLimits) {
        let qpn = Qpn(wc.qp_num);
        let Some(r) = self.recv_qps.get_mut(&qpn) else {
            return;
        };
        r.posted = r.posted.saturating_sub(1);
        if let Some(share) = r.draining {
            // Removed, fenced: each CQE is a flush (or a notification from
            // before the fence, delivered). The last one gives the
            // reservation back and destroys it.
            if wc.wc_status() == Some(WcStatus::Success) {
                r.deliver_over_bound(&self.notifs, wc.wr_id, wc.byte_len.min(NOTIF_SLOT_BYTES as u32));
            }
            if r.posted == 0 {
                self.recv_qps.remove(&qpn);
                self.release_recv_cqes(share, limits);
            }
            return;
        }
        if wc.wc_status() != Some(WcStatus::Success) {
            if wc.wc_status() != Some(WcStatus::WrFlushErr) {
                tracing::warn!("verbs: receive from {} failed: {}", r.agent, wc.status_name());
            }
            return;
        }
        let len = wc.byte_len.min(NOTIF_SLOT_BYTES as u32);
        // Behind held ones it waits too (order per QP).
        if r.held.is_empty() && r.credit.try_take(len) {
            r.deliver(&self.notifs, wc.wr_id, len, true);
            return;
        }
        if r.held.is_empty() {
            self.holding.push(qpn);
        }
        r.held.push_back((wc.wr_id, len));
    }
}

/// How a peer's QPs stand ([`State::peer_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerQpState {
    /// A QP of the peer still has WRs posted.
    pub busy: bool,
    /// No QPs, or one missing or in error: the peer needs a reconnect.
    pub broken: bool,
}

/// What the user thread and the engine both see of one connected peer: one
/// atomic, no lock. (Notification slots are counted by the engine alone:
/// its [`NotifSlab`] free list.)
#[derive(Debug, Default)]
pub struct PeerLink {
    /// A QP of the peer failed or was removed: the next post reconnects.
    /// Set by the engine, cleared when it installs new QPs.
    pub broken: AtomicBool,
}
