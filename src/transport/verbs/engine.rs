//! The verbs progress engine: the one owner of every queue pair, the CQE
//! budget, the transfers and the notification slots (`State`, state.rs). It runs on
//! the progress thread (`progress::run`); every other thread talks
//! to it with [`Cmd`]s over a channel ([`Handle`]), and it reports finished
//! transfers and received notifications over the `done` / `notifs`
//! channels, so nothing is shared under a lock.
//!
//! Which commands answer (the caller waits on a reply channel):
//! - `Post`: none. What `post` refuses synchronously is decided on the
//!   caller's side without the engine: an unknown peer, a notification over
//!   a slot. Anything else the engine finds fails the transfer through
//!   `done`, as a NIC error does: more than `NOTIF_SLOTS` (256)
//!   notifications in flight to the peer (`FailureKind::Overloaded`; the
//!   engine is the only counter of the slots), a peer gone
//!   (`FailureKind::PeerDied`).
//! - `Cancel`, `Disconnect`, `Unplug`: the reply channel closes when the NIC
//!   can no longer touch the buffers involved (QPs drained or destroyed).
//! - `Query`, `ReserveRecv`: the answer.
//! - `FenceRecv`: whether those receive QPs are in the error state now
//!   (the target answers the fencing hello only then).
//! - `AddRecv`: the reply channel closes once the engine holds the receive
//!   QPs, so the target answers the handshake only then: a notification
//!   arriving before would find its QP unknown and be lost (the channel
//!   orders commands, not commands against completions; found by the
//!   transport contract over the simulated NIC).
//! - `Install`, `Reconnecting`, `Resume`, `RemoveRecv`, `FailPeer`, `Stop`:
//!   none (the channel keeps their order ahead of any later command).
//!
//! Reconnection runs on a connection-manager thread (`reconnect.rs`), never
//! on the caller's: the caller sends `Reconnecting` and starts it; from then
//! on the engine holds the peer's posts, in order, until the thread hands
//! over new QPs (`Install`: the held posts go on them) or gives up
//! (`Resume` with the reason: they fail with `PeerDied` naming it).

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::nic::{Nic, NicQp};
use super::state::{HeldNotification, PeerLink, PeerQpState, PostLimits, Qpn, RecvQp, State};
use crate::transport::{Completion, PeerId, PostRequest, TransferFailure, XferId};

/// The engine stops taking commands while this many WRs (all QPs together)
/// wait in its software queues for room on the send queues or the CQ; it
/// takes them again as completions drain the queues (the default of
/// `Engine::queued_wr_limit`; `progress::CMD_CAPACITY` bounds the channel).
pub(super) const QUEUED_WR_LIMIT: usize = 1 << 16;

/// Whether a peer's QPs can take work ([`Cmd::Query`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerHealth {
    /// A QP of the peer still has WRs posted.
    pub busy: bool,
    /// No QPs, or one missing or in error: the peer needs a reconnect.
    pub broken: bool,
    /// Notification slots free (of `NOTIF_SLOTS`; 0 for an unknown peer).
    pub free_slots: u32,
}

/// A command to the engine (see the module docs for which ones answer).
pub enum Cmd<Q: NicQp> {
    /// Queue a transfer and post what fits.
    Post(PostRequest),
    /// Cancel one transfer (`Some`) or every transfer (`None`, on drop).
    Cancel { xfer: Option<XferId>, done: Sender<()> },
    /// Hand over a peer's connected QPs: a new peer with its name,
    /// notification slab and link, or new QPs of a known peer (reconnect).
    Install { peer: PeerId, name: String, qps: Vec<Q>, slab: Option<Q::Slab>, link: Option<Arc<PeerLink>> },
    /// A reconnect of the peer started: hold its posts until `Install` or
    /// `Resume`.
    Reconnecting { peer: PeerId },
    /// The reconnect ended without new QPs: with `failed`, the held posts
    /// fail with it; without, they go on the peer's QPs.
    Resume { peer: PeerId, failed: Option<String> },
    /// How the peer's QPs stand.
    Query { peer: PeerId, reply: Sender<PeerHealth> },
    /// Destroy the peer's QPs (before a reconnect), failing what they carried.
    Unplug { peer: PeerId, done: Sender<()> },
    /// Forget the peer: its QPs, slab and link.
    Disconnect { peer: PeerId, done: Sender<()> },
    /// The peer's liveness channel closed: fail its QPs now.
    FailPeer { peer: PeerId, why: TransferFailure },
    /// Hold CQEs for the receives of a new initiator (target side).
    ReserveRecv { cqes: u32, reply: Sender<bool> },
    /// Give back CQEs held by `ReserveRecv` that were not used.
    ReleaseRecv { cqes: u32 },
    /// Receive QPs of an initiator, receives posted; `done` closes once held.
    AddRecv { qps: Vec<RecvQp<Q>>, done: Sender<()> },
    /// The initiator left: destroy its receive QPs and give back their CQEs.
    RemoveRecv { qpns: Vec<Qpn>, cqes: u32 },
    /// A later connection of the same initiator session replaces these
    /// receive QPs: move them to the error state (the late-bytes fence,
    /// `conn.rs`); `done` gets whether every one is (or is gone).
    FenceRecv { qpns: Vec<Qpn>, done: Sender<bool> },
    /// Cancel nothing, destroy everything, end the progress thread.
    Stop,
}

/// The engine's record of a peer.
struct EnginePeer {
    name: String,
    qpns: Vec<Qpn>,
    /// `Some` while a reconnect is in progress: the posts held behind it.
    held: Option<Vec<PostRequest>>,
}

/// A cancel waiting for the NIC to let go of a transfer.
struct PendingCancel {
    xfer: XferId,
    flush_at: Instant,
    destroy_at: Instant,
    flushed: bool,
    /// Closed (dropped) when the cancel is done; the caller waits for that.
    _done: Sender<()>,
}

/// The one owner: a NIC, the state machine over its QPs, and the commands
/// in progress.
pub struct Engine<N: Nic> {
    pub nic: N,
    pub st: State<N::Qp>,
    pub limits: PostLimits,
    /// A QP with WRs in flight and no completion for this long fails.
    pub progress_timeout: Duration,
    /// A cancel flushes the QPs still carrying its transfer after this long,
    /// and destroys them another `peer_timeout` later.
    pub peer_timeout: Duration,
    /// How long the progress thread blocks on the completion channel at a
    /// time (a command wakes it at once).
    pub event_wait_ms: i32,
    /// The progress thread takes no command while this many WRs wait in
    /// the software queues ([`QUEUED_WR_LIMIT`]).
    pub queued_wr_limit: usize,
    peers: HashMap<PeerId, EnginePeer>,
    cancels: Vec<PendingCancel>,
}

impl<N: Nic> Engine<N> {
    /// An engine over `nic` whose shared CQ has `cqes` entries.
    pub fn new(
        nic: N,
        cqes: u32,
        limits: PostLimits,
        done: Sender<Completion>,
        notifs: Sender<HeldNotification>,
    ) -> Self {
        Self {
            nic,
            st: State::new(cqes, done, notifs),
            limits,
            progress_timeout: Duration::from_secs(10),
            peer_timeout: Duration::from_secs(5),
            event_wait_ms: 20,
            queued_wr_limit: QUEUED_WR_LIMIT,
            peers: HashMap::new(),
            cancels: Vec::new(),
        }
    }

    /// WRs waiting in the software queues of every QP (not yet posted).
    pub fn queued_wrs(&self) -> usize {
        self.st.queued_wrs()
    }

    /// True while a cancel waits (the loop then looks at its deadlines).
    pub fn cancelling(&self) -> bool {
        !self.cancels.is_empty()
    }

    /// Carry out `cmd` at time `now`; false for [`Cmd::Stop`].
    pub fn command(&mut self, cmd: Cmd<N::Qp>, now: Instant) -> bool {
        self.st.set_now(now);
        let limits = self.limits;
        match cmd {
            Cmd::Post(req) => self.post(req),
            Cmd::Cancel { xfer, done } => {
                // Posts held behind a reconnect never reached the NIC.
                for p in self.peers.values_mut() {
                    if let Some(h) = p.held.as_mut() {
                        h.retain(|r| xfer.is_some_and(|x| r.xfer != x));
                    }
                }
                let ids: Vec<XferId> = match xfer {
                    Some(x) => vec![x],
                    None => self.st.xfer_ids(),
                };
                let flush_at = now + self.peer_timeout;
                for x in ids {
                    if self.st.cancel_start(x, &limits) {
                        let destroy_at = flush_at + self.peer_timeout;
                        let _done = done.clone();
                        self.cancels.push(PendingCancel { xfer: x, flush_at, destroy_at, flushed: false, _done });
                    }
                }
                self.check_cancels(now);
            }
            Cmd::Install { peer, name, qps, slab, link } => {
                if link.is_none() && !self.peers.contains_key(&peer) {
                    // A reconnect that finished after its peer was
                    // disconnected: the QPs are dropped (destroyed) here.
                    return true;
                }
                let qpns: Vec<Qpn> = qps.iter().map(|q| Qpn(q.qp_num())).collect();
                for qp in qps {
                    self.st.add_send_qp(qp, peer);
                }
                if let Some(mr) = slab {
                    self.st.slots_mut().install(peer, mr);
                }
                if let Some(l) = link {
                    self.st.set_link(peer, Some(l));
                }
                self.st.set_broken(peer, qpns.is_empty());
                let p = self.peers.entry(peer).or_insert_with(|| EnginePeer { name, qpns: Vec::new(), held: None });
                p.qpns = qpns;
                self.resume(peer, None);
            }
            Cmd::Reconnecting { peer } => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.held.get_or_insert_with(Vec::new);
                }
            }
            Cmd::Resume { peer, failed } => self.resume(peer, failed),
            Cmd::Query { peer, reply } => {
                let _ = reply.send(self.health(peer));
            }
            Cmd::Unplug { peer, done: _done } => {
                let qpns = self.peers.get_mut(&peer).map(|p| std::mem::take(&mut p.qpns)).unwrap_or_default();
                for q in qpns {
                    self.st.remove_peer_qp(q, peer, &limits);
                }
            }
            Cmd::Disconnect { peer, done: _done } => {
                self.resume(peer, Some("disconnected".into()));
                if let Some(p) = self.peers.remove(&peer) {
                    for q in p.qpns {
                        self.st.remove_peer_qp(q, peer, &limits);
                    }
                }
                self.st.slots_mut().remove(peer);
                self.st.set_link(peer, None);
            }
            Cmd::FailPeer { peer, why } => self.st.fail_peer(peer, &why, &limits),
            Cmd::ReserveRecv { cqes, reply } => {
                let _ = reply.send(self.st.reserve_recv_cqes(cqes));
            }
            Cmd::ReleaseRecv { cqes } => self.st.release_recv_cqes(cqes, &limits),
            Cmd::AddRecv { qps, done: _done } => {
                for r in qps {
                    self.st.add_recv_qp(r);
                }
            }
            Cmd::RemoveRecv { qpns, cqes } => {
                let share = cqes.checked_div(qpns.len() as u32).unwrap_or(0);
                let kept: u32 = qpns.into_iter().map(|q| self.st.remove_recv_qp(q, share)).sum();
                self.st.release_recv_cqes(cqes - kept, &limits);
            }
            Cmd::FenceRecv { qpns, done } => {
                // Every QP is tried, whatever an earlier one answered.
                let failed = qpns.into_iter().filter(|&q| !self.st.fence_recv_qp(q)).count();
                let all = failed == 0;
                let _ = done.send(all);
            }
            Cmd::Stop => return false,
        }
        true
    }

    /// End the hold of `peer`'s posts: post them (`failed` is `None`) or
    /// fail them with `PeerDied` naming the reason.
    fn resume(&mut self, peer: PeerId, failed: Option<String>) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let Some(held) = p.held.take() else {
            return;
        };
        let name = p.name.clone();
        for req in held {
            match &failed {
                None => self.post(req),
                Some(why) => {
                    let f = TransferFailure::peer_died(format!("{name} (reconnect failed: {why})"));
                    self.st.report_failed(req.xfer, f);
                }
            }
        }
    }

    fn post(&mut self, req: PostRequest) {
        if let Some(held) = self.peers.get_mut(&req.peer).and_then(|p| p.held.as_mut()) {
            held.push(req);
            return;
        }
        let (xfer, peer) = (req.xfer, req.peer);
        let result = match self.peers.get(&peer) {
            Some(p) => self.st.post(&req, &p.qpns, &p.name, &self.limits),
            None => Err(crate::transport::TransportError::NotConnected(req.peer)),
        };
        if let Err(e) = result {
            let why = match e {
                // Every notification slot of the peer is in flight.
                crate::transport::TransportError::Post(m) => TransferFailure::overloaded(m),
                // The caller checked what it could; the peer went away since.
                e => TransferFailure::peer_died(e.to_string()),
            };
            self.st.report_failed(xfer, why);
        }
    }

    /// `peer`'s QPs as `VerbsTransport::post` needs to know them before a
    /// reconnect. A QP number the peer kept may since name another peer's
    /// QP (reused): only a QP of this peer counts.
    pub fn health(&self, peer: PeerId) -> PeerHealth {
        let qpns = self.peers.get(&peer).map(|p| p.qpns.as_slice()).unwrap_or_default();
        let PeerQpState { busy, broken } = self.st.peer_state(peer, qpns);
        PeerHealth { busy, broken, free_slots: self.st.slots().free(peer) }
    }

    /// Hand completions to the state machine.
    pub fn on_completions(&mut self, wcs: &[crate::verbs::WorkCompletion], now: Instant) {
        self.st.set_now(now);
        for wc in wcs {
            self.st.on_completion(wc, &self.limits);
        }
        self.check_cancels(now);
    }

    /// Deliver the notifications receive QPs hold in their slots that fit
    /// their peer's bound again (the application took some), reposting
    /// their receives; true when any was. Costs a length check while none
    /// is held.
    pub fn release_held(&mut self) -> bool {
        self.st.release_held()
    }

    /// The progress deadlines (every few ms) and the cancels' deadlines.
    pub fn tick(&mut self, now: Instant) {
        self.st.set_now(now);
        self.st.expire(self.progress_timeout, &self.limits);
        self.check_cancels(now);
    }

    /// Close the reply of every cancel whose transfer the NIC let go of.
    fn check_cancels(&mut self, now: Instant) {
        if self.cancels.is_empty() {
            return;
        }
        let mut cancels = std::mem::take(&mut self.cancels);
        cancels.retain_mut(|c| {
            let (flush, destroy) = (now > c.flush_at, now > c.destroy_at);
            !self.st.cancel_step(c.xfer, flush, destroy, &mut c.flushed, &self.limits)
        });
        self.cancels = cancels;
    }
}

/// Wakes the progress thread when it blocks on the completion channel: a
/// socket pair polled together with the channel's fd. A byte is written
/// only when the thread said it is about to block (`sleeping`), so a post
/// to a busy engine costs no system call.
pub struct Wake {
    sleeping: AtomicBool,
    tx: UnixStream,
    rx: UnixStream,
}

impl Wake {
    pub(super) fn new() -> std::io::Result<Self> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(Self { sleeping: AtomicBool::new(false), tx, rx })
    }

    /// Called after sending a command: wake the thread if it blocks.
    pub(super) fn after_send(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            let _ = std::io::Write::write(&mut &self.tx, &[1]);
        }
    }

    /// The progress thread is about to block: true when `rx` is still
    /// empty (it may block; a later command will write a byte).
    pub(super) fn prepare_sleep<T>(&self, rx: &Receiver<T>) -> bool {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if rx.is_empty() {
            return true;
        }
        self.sleeping.store(false, Ordering::SeqCst);
        false
    }

    /// The progress thread woke: clear the flag and the bytes written.
    pub(super) fn woke(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
        let mut buf = [0u8; 64];
        while matches!(std::io::Read::read(&mut &self.rx, &mut buf), Ok(n) if n > 0) {}
    }

    /// The fd polled with the completion channel.
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.rx.as_fd()
    }
}
