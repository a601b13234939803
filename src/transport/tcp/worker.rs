//! The initiator side: one worker thread per connection to a peer, all
//! taking chunks of posted transfers from the peer's job queue. A worker
//! sends one request and waits for its answer (data for a READ, an
//! acknowledgement for a WRITE), so a connection carries one chunk at a time
//! and a peer with `conns_per_peer` connections has that many in flight.
//! The worker that finishes a transfer's last chunk sends its notification
//! on its own connection, after every chunk was acknowledged, and reports
//! the completion.

use std::io::{self, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{Receiver, Sender};

use super::io::{self as tio, Range};
use super::wire::{self, Header, Kind, SegmentDesc, Status};
use crate::transport::inflight::XferState;
use crate::transport::{Completion, Op, RemoteAccessKind, Segment, TransferFailure, XferId};

/// One connected peer, shared by the transport and its workers.
#[derive(Debug)]
pub(super) struct PeerShared {
    /// Agent name.
    pub name: String,
    /// Set once any connection to the peer failed; the peer is then unusable.
    pub dead: AtomicBool,
    /// Why it died.
    pub reason: Mutex<Option<TransferFailure>>,
    /// One per connection (worker), by index.
    pub slots: Vec<Slot>,
    /// Opens a connection again after a cancel cut it.
    pub dialer: super::Dialer,
    /// When a cancel's WRITE grace last ended with the peer's TCP
    /// acknowledging nothing (a stopped or silent target); cleared when a
    /// chunk to it completes. For [`STALL_TRUSTED`] after it a cancel cuts
    /// at once: releases one after the other to a stopped peer do not each
    /// wait the grace, and a peer that recovered is not taken for stalled
    /// for long.
    stalled: Mutex<Option<std::time::Instant>>,
    /// Connections to this target cut while a request may have been on
    /// the way, not yet fenced; shared with every other `connect` of this
    /// transport to the same target, so a reconnect fences what an earlier
    /// one cut. The next live chunk on any connection first sends a FENCE
    /// naming them ([`PeerShared::fence_cuts`]).
    fences: Arc<FenceList>,
}

/// Generations of connections to one target (named by its secret) that
/// a cancel or a disconnect cut while a request may have been on the way:
/// a late byte of a cancelled WRITE (or a notification) on one of them
/// could still reach the target's memory until it fences them.
#[derive(Debug, Default)]
pub(super) struct FenceList {
    generations: Mutex<Vec<u64>>,
    /// `generations` is not empty (checked without the lock on every chunk).
    due: AtomicBool,
}

impl FenceList {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.generations.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Note connection `generation` as cut (once: a peer's failure is seen
    /// by each of its workers). At most [`wire::MAX_FENCE_ENTRIES`] are
    /// kept (every connection of four connects at once to the target at the
    /// largest `conns_per_peer`; past that the oldest goes, with a warning).
    fn add(&self, generation: u64) {
        let mut list = self.list();
        if list.contains(&generation) {
            return;
        }
        if list.len() >= wire::MAX_FENCE_ENTRIES as usize {
            tracing::warn!("tcp: more cut connections to one target than a fence names; the oldest is not fenced");
            list.remove(0);
        }
        list.push(generation);
        self.due.store(true, Ordering::Release);
    }

    /// Whether no connection awaits a fence.
    pub(super) fn is_empty(&self) -> bool {
        !self.due.load(Ordering::Acquire)
    }

    /// The generations awaiting a fence, `None` when there are none (one
    /// atomic load on the way of every chunk).
    fn pending(&self) -> Option<Vec<u64>> {
        if self.is_empty() {
            return None;
        }
        Some(self.list().clone()).filter(|l| !l.is_empty())
    }

    /// The target fenced `cut`; connections cut meanwhile stay.
    fn fenced(&self, cut: &[u64]) {
        let mut list = self.list();
        list.retain(|g| !cut.contains(g));
        self.due.store(!list.is_empty(), Ordering::Release);
    }
}

/// What the transport knows of one worker's connection: a clone of it (to
/// wake the worker by shutting it down) and the transfer whose chunk it is
/// moving.
#[derive(Debug)]
pub(super) struct Slot(Mutex<SlotState>);

#[derive(Debug)]
struct SlotState {
    stream: TcpStream,
    /// The generation `stream` was opened with ([`super::next_generation`]).
    generation: u64,
    /// Id of the transfer whose chunk the worker is moving (none between
    /// chunks; 0 is a valid id).
    busy: Option<u64>,
    /// Shut down by a cancel; the worker opens it again (until then it is
    /// not probed: its end of stream is ours, not the peer's).
    cut: bool,
    /// The worker is opening the connection again: its chunk has sent no
    /// payload yet, so a cancel need not give it the WRITE grace.
    dialing: bool,
    /// The worker is fencing cut connections before its chunk: likewise no
    /// payload of the chunk is on the way yet.
    fencing: bool,
}

impl Slot {
    /// Connection `stream`, opened with `generation`.
    pub(super) fn new(stream: TcpStream, generation: u64) -> Self {
        Self(Mutex::new(SlotState { stream, generation, busy: None, cut: false, dialing: false, fencing: false }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl SlotState {
    /// Whether the worker is sending a chunk of `xfer` (inside it and not
    /// still reconnecting).
    fn sending(&self, xfer: XferId) -> bool {
        self.busy == Some(xfer.0) && !self.dialing && !self.fencing
    }

    /// Whether a request of the worker's chunk may be on the way (so the
    /// connection must be fenced once cut): inside a chunk and past the
    /// redial and the fence.
    fn in_request(&self) -> bool {
        self.busy.is_some() && !self.dialing && !self.fencing
    }
    /// Mark the connection cut by a cancel and shut it down (waking the
    /// worker blocked on it).
    fn cut(&mut self) {
        self.cut = true;
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// How long a stall seen by a cancel's grace is taken as still true.
const STALL_TRUSTED: std::time::Duration = std::time::Duration::from_secs(1);

impl PeerShared {
    /// A peer named `name` over `slots`, redialled with `dialer`; `fences`
    /// is the target's list of connections to fence (shared by every
    /// connect of this transport to it).
    pub(super) fn new(name: &str, slots: Vec<Slot>, dialer: super::Dialer, fences: Arc<FenceList>) -> Self {
        Self {
            name: name.to_string(),
            dead: AtomicBool::new(false),
            reason: Mutex::new(None),
            slots,
            dialer,
            stalled: Mutex::new(None),
            fences,
        }
    }

    /// Cut a connection (its state `st`, locked by the caller) and, when a
    /// request may have been on the way, note it for the next FENCE.
    fn cut_slot(&self, st: &mut SlotState) {
        if st.in_request() {
            self.fences.add(st.generation);
        }
        st.cut();
    }

    /// Before a live chunk goes out on `conn`: when a cancel cut
    /// connections of this peer since the last fence, send a FENCE naming
    /// them and wait for the answer. The target answers once none of them
    /// can write into its memory any more, so a late byte of a cancelled
    /// WRITE still on its way (in the target's receive buffer, or held by a
    /// stopped target or a middlebox) never lands after, and over, a later
    /// transfer's bytes. Several workers may fence the same cuts at once;
    /// a fence is idempotent. Worker `index` counts as not yet sending
    /// meanwhile (a cancel cuts it without the WRITE grace; that cut needs
    /// no fence).
    fn fence_cuts(&self, index: usize, conn: &mut Conn) -> Result<(), ReqError> {
        let Some(cut) = self.fences.pending() else { return Ok(()) };
        self.slots[index].state().fencing = true;
        let fenced = conn.fence(&cut);
        self.slots[index].state().fencing = false;
        fenced?;
        self.fences.fenced(&cut);
        Ok(())
    }

    /// Whether a cancel's grace found the peer stalled less than
    /// [`STALL_TRUSTED`] ago (and no chunk completed since).
    pub(super) fn stalled(&self) -> bool {
        self.stalled.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|at| at.elapsed() < STALL_TRUSTED)
    }

    /// Mark the peer stalled now (`true`) or not (`false`).
    pub(super) fn set_stalled(&self, stalled: bool) {
        *self.stalled.lock().unwrap_or_else(|p| p.into_inner()) = stalled.then(std::time::Instant::now);
    }

    /// Mark the peer dead for `why` and shut every connection down, which
    /// wakes the workers blocked on them.
    pub(super) fn kill(&self, why: TransferFailure) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
            if r.is_none() {
                *r = Some(why);
            }
        }
        self.dead.store(true, Ordering::SeqCst);
        for slot in &self.slots {
            let st = slot.state();
            // A request on the way (a disconnect mid-transfer): a later
            // connect to the same target fences it.
            if st.in_request() && !st.cut {
                self.fences.add(st.generation);
            }
            let _ = st.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Shut down the connections whose worker is inside a chunk of transfer
    /// `xfer` (just cancelled), so that a chunk blocked on a silent peer
    /// ends now rather than after `peer_timeout`. Such a connection is
    /// opened again ([`Dialer`](super::Dialer)) when its worker next moves
    /// a live chunk; the peer stays usable and other connections' chunks go
    /// on.
    pub(super) fn cut(&self, xfer: XferId) {
        for slot in &self.slots {
            let mut st = slot.state();
            if st.busy == Some(xfer.0) {
                self.cut_slot(&mut st);
            }
        }
    }

    /// Whether a worker is inside a chunk of transfer `xfer` that may have
    /// sent payload (not one still opening its connection again).
    pub(super) fn busy_with(&self, xfer: XferId) -> bool {
        self.slots.iter().any(|slot| slot.state().sending(xfer))
    }

    /// Whether a worker is inside a chunk of transfer `xfer` past opening
    /// its connection again: a cancel returns once none is. A worker still
    /// reconnecting ([`Self::redial`]) has read or written nothing of the
    /// transfer and checks it again once connected, before any byte or
    /// notification of it leaves (it is cancelled by then), so a cancel
    /// does not wait for its TCP connect, which a stopped peer whose listen
    /// backlog is full leaves pending (the worker notices the cancel
    /// within one `CONNECT_SLICE`). A redial that fails (the peer died
    /// meanwhile) may still run the transfer's last-chunk step after the
    /// cancel returned: it sends no notification (the transfer failed or
    /// is cancelled), and the completion it may queue names an id the
    /// cancel already removed, which the in-flight map drops.
    pub(super) fn inside(&self, xfer: XferId) -> bool {
        self.slots.iter().any(|slot| {
            let st = slot.state();
            st.busy == Some(xfer.0) && !st.dialing
        })
    }

    /// Bytes the peer's TCP has acknowledged so far on the connections
    /// whose worker is sending a chunk of `xfer` (Linux `TCP_INFO`'s
    /// `tcpi_bytes_acked`, summed): while it grows the target is taking the
    /// chunk. 0 where the kernel does not tell.
    pub(super) fn acked(&self, xfer: XferId) -> u64 {
        let mut sum = 0u64;
        for slot in &self.slots {
            let st = slot.state();
            if !st.sending(xfer) {
                continue;
            }
            // SAFETY: an all-zero `tcp_info` is a valid value of this plain
            // C struct.
            let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
            // SAFETY: getsockopt(2) on a socket this slot owns, writing at
            // most `len` bytes into `info`, which is that large.
            let rc = unsafe {
                libc::getsockopt(
                    st.stream.as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_INFO,
                    (&raw mut info).cast(),
                    &raw mut len,
                )
            };
            if rc == 0 {
                sum = sum.wrapping_add(info.tcpi_bytes_acked);
            }
        }
        sum
    }

    /// Check the connections without blocking: a connection the peer closed
    /// (end of stream with nothing left to read) or reset means the peer is
    /// dead. `MSG_PEEK` leaves any bytes for the worker reading them. A
    /// connection a cancel cut is skipped until it is open again.
    pub(super) fn probe(&self) -> Option<TransferFailure> {
        use nix::sys::socket::{MsgFlags, recv};
        let mut b = [0u8; 1];
        for slot in &self.slots {
            let st = slot.state();
            if st.cut {
                continue;
            }
            match recv(st.stream.as_raw_fd(), &mut b, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
                Ok(0) => return Some(TransferFailure::peer_died(format!("peer {} closed its connection", self.name))),
                Ok(_) | Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    let e = io::Error::from(e);
                    return Some(TransferFailure::from_io(&e, format!("peer {}", self.name)));
                }
            }
        }
        None
    }

    /// Worker `index` enters a chunk of `xfer` (before it checks whether
    /// the transfer is still live, so that a cancel either sees it here or
    /// it sees the cancel).
    fn enter(&self, index: usize, xfer: XferId) {
        self.slots[index].state().busy = Some(xfer.0);
    }

    /// Whether a cancel cut connection `index` (an error on it is then not
    /// the peer's).
    fn is_cut(&self, index: usize) -> bool {
        self.slots[index].state().cut
    }

    /// Worker `index` left its chunk (and the transfer's completion, when it
    /// was the last); true when a cancel cut its connection meanwhile.
    fn leave(&self, index: usize) -> bool {
        let mut st = self.slots[index].state();
        st.busy = None;
        st.dialing = false;
        st.fencing = false;
        st.cut
    }

    /// Open connection `index` again after a cut, for a chunk of `x`. The
    /// new connection is published before the handshake, so that a
    /// [`PeerShared::kill`] or a cancel of `x` meanwhile wakes it (a cancel
    /// leaves the slot cut: the error is then not the peer's).
    ///
    /// The TCP connect itself gives up as soon as the peer is closed or `x`
    /// is cancelled ([`Dialer::connect`](super::Dialer::connect)): a cancel
    /// or disconnect never waits on a peer that completes no handshake.
    fn redial(&self, index: usize, x: &XferState) -> io::Result<TcpStream> {
        let dead = || self.dead.load(Ordering::SeqCst);
        let stopped = || dead() || x.cancelled.load(Ordering::SeqCst);
        let interrupted = || {
            let what = if dead() { "peer closed while reconnecting" } else { "transfer cancelled while reconnecting" };
            io::Error::new(io::ErrorKind::NotConnected, what)
        };
        // No payload has left yet: a cancel meanwhile cuts at once.
        self.slots[index].state().dialing = true;
        let sock = match self.dialer.connect(stopped) {
            Ok(sock) => sock,
            // The slot stays cut (its old, shut connection): for a cancel
            // the error is then not the peer's; for a closed peer the
            // worker finds it dead.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(interrupted()),
            Err(e) => return Err(e),
        };
        let generation = super::next_generation();
        {
            let mut st = self.slots[index].state();
            st.stream = sock.try_clone()?;
            st.generation = generation;
            st.cut = false;
        }
        // After publishing: a kill or cancel that came before it is seen
        // here, one that comes after shuts the new connection down. Only a
        // cancel (not another chunk's failure) makes this a cut: the error
        // is then not the peer's.
        if stopped() {
            if dead() {
                let _ = sock.shutdown(std::net::Shutdown::Both);
            } else {
                self.cut_slot(&mut self.slots[index].state());
            }
            return Err(interrupted());
        }
        self.dialer.handshake(&sock, index, generation)?;
        self.slots[index].state().dialing = false;
        Ok(sock)
    }

    /// The failure message for transfers to a dead peer.
    pub(super) fn failure(&self) -> TransferFailure {
        let r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        r.clone().unwrap_or_else(|| TransferFailure::peer_died(format!("peer {} disconnected", self.name)))
    }
}

/// A posted transfer being moved.
#[derive(Debug)]
pub(super) struct XferShared {
    /// Id, op, notification, chunks not yet finished (one per [`Job`], at
    /// least one), cancel flag and first failure.
    pub core: XferState,
    /// The peer.
    pub peer: Arc<PeerShared>,
    /// Segments, split so that no chunk exceeds the wire limits.
    pub segments: Vec<Segment>,
    /// The local registrations the segments use, alive until the transfer
    /// is dropped (a deregistration meanwhile cannot free them).
    pub _local: Vec<Arc<dyn crate::transport::MemoryBacking>>,
}

impl AsRef<XferState> for XferShared {
    fn as_ref(&self) -> &XferState {
        &self.core
    }
}

/// A contiguous range of a transfer's segments: one request on the wire.
pub(super) struct Job {
    /// The transfer.
    pub xfer: Arc<XferShared>,
    /// Segment indices.
    pub range: std::ops::Range<usize>,
}

/// Why a request failed.
enum ReqError {
    /// The target refused it; the connection is still good.
    Remote(TransferFailure),
    /// The connection broke (peer died, silent past the timeout, protocol).
    Conn(io::Error),
}

impl From<io::Error> for ReqError {
    fn from(e: io::Error) -> Self {
        Self::Conn(e)
    }
}

/// The typed failure for a target's refusal, from its wire status alone
/// (the reason text is only the detail).
fn refusal(status: Status, reason: String) -> ReqError {
    let access = |k| ReqError::Remote(TransferFailure::remote_access(k, reason.clone()));
    match status {
        Status::UnknownKey => access(RemoteAccessKind::UnknownKey),
        Status::OutOfBounds => access(RemoteAccessKind::OutOfBounds),
        Status::Denied => access(RemoteAccessKind::Denied),
        Status::Overloaded => ReqError::Remote(TransferFailure::overloaded(reason)),
        _ => ReqError::Conn(io::Error::new(io::ErrorKind::InvalidData, format!("peer refused: {reason}"))),
    }
}

/// State a worker keeps across requests.
struct Conn {
    sock: TcpStream,
    next_id: u64,
    head: Vec<u8>,
    ranges: Vec<Range>,
}

impl Conn {
    fn new(sock: TcpStream) -> Self {
        Self { sock, next_id: 0, head: Vec::new(), ranges: Vec::new() }
    }

    /// Read a response header for request `id`; a refusal's reason as `Remote`.
    fn response(&mut self, id: u64) -> Result<Header, ReqError> {
        let mut b = [0u8; wire::HEADER_BYTES];
        tio::read_exact(&self.sock, &mut b)?;
        let h = Header::decode(&b).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if h.kind != Kind::Resp || h.id != id {
            return Err(ReqError::Conn(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected the response to request {id}, got {:?} {}", h.kind, h.id),
            )));
        }
        if h.status() != Status::Ok {
            let mut reason = vec![0u8; h.body_bytes()];
            tio::read_exact(&self.sock, &mut reason)?;
            let reason = String::from_utf8_lossy(&reason).into_owned();
            return Err(refusal(h.status(), reason));
        }
        Ok(h)
    }

    /// Move one chunk; Ok(true) once the peer acknowledged it, Ok(false)
    /// when there was nothing to send.
    fn transfer(&mut self, x: &XferShared, segs: &[Segment]) -> Result<bool, ReqError> {
        if segs.is_empty() {
            // An empty descriptor list moves nothing: only its notification
            // goes out (as shm and NIXL's notification-only transfers).
            return Ok(false);
        }
        self.next_id += 1;
        let id = self.next_id;
        let len: u64 = segs.iter().map(|s| s.len_bytes).sum();
        let kind = if x.core.op == Op::Write { Kind::Write } else { Kind::Read };
        let h = Header { kind, count: segs.len() as u32, id, len };
        self.head.clear();
        self.head.extend_from_slice(&h.encode());
        wire::encode_segments(
            segs.iter().map(|s| SegmentDesc { rkey: s.rkey.0, addr: s.remote_addr, len_bytes: s.len_bytes }),
            &mut self.head,
        );
        self.ranges.clear();
        self.ranges.extend(segs.iter().map(|s| (s.local_addr, s.len_bytes)));
        match x.core.op {
            Op::Write => {
                // SAFETY: the engine checked every local range against a live
                // registration and keeps it registered until this transfer is
                // terminal or cancelled; cancel waits while a worker is
                // inside this chunk.
                unsafe { tio::write_ranges(&self.sock, &self.head, &self.ranges, None)? };
                self.response(id)?;
            }
            Op::Read => {
                (&self.sock).write_all(&self.head)?;
                let r = self.response(id)?;
                if r.len != len {
                    return Err(ReqError::Conn(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("READ answered with {} bytes, asked {len}", r.len),
                    )));
                }
                // SAFETY: as above; the local ranges are registered memory
                // the application does not touch while the READ is in
                // progress, and `read_ranges` stops writing into them once
                // `cancelled` is set (cancel waits for this call to return).
                unsafe { tio::read_ranges(&self.sock, &self.ranges, &x.core.cancelled, true, None)? };
            }
        }
        Ok(true)
    }

    /// Send a FENCE naming the connections `cut` (by generation) and wait
    /// for its answer.
    fn fence(&mut self, cut: &[u64]) -> Result<(), ReqError> {
        let body: Vec<u8> = cut.iter().flat_map(|g| g.to_le_bytes()).collect();
        self.control(Kind::Fence, cut.len() as u32, &body)
    }

    fn notify(&mut self, payload: &[u8]) -> Result<(), ReqError> {
        self.control(Kind::Notify, payload.len() as u32, payload)
    }

    /// Send a request that carries no data (`count` and its `body`) and
    /// wait for its answer.
    fn control(&mut self, kind: Kind, count: u32, body: &[u8]) -> Result<(), ReqError> {
        self.next_id += 1;
        let id = self.next_id;
        let h = Header { kind, count, id, len: 0 };
        self.head.clear();
        self.head.extend_from_slice(&h.encode());
        self.head.extend_from_slice(body);
        (&self.sock).write_all(&self.head)?;
        self.response(id).map(|_| ())
    }
}

/// Run worker `index` of `peer` over `sock` until the job queue closes.
pub(super) fn run(sock: TcpStream, index: usize, peer: Arc<PeerShared>, jobs: Receiver<Job>, done: Sender<Completion>) {
    let mut conn = Conn::new(sock);
    // Set when a cancel cut the connection; it is opened again for the
    // next live chunk (not at once: chunks of cancelled transfers queued
    // behind must be skipped without waiting on a silent peer).
    let mut lost = false;
    for job in jobs.iter() {
        let x = &job.xfer;
        peer.enter(index, x.core.id);
        // Ok(true): the chunk went to the peer and was answered; Ok(false):
        // nothing was sent (skipped: cancelled or failed before it started;
        // or an empty, notification-only transfer).
        let moved = if !x.core.live() {
            Ok(false)
        } else if peer.dead.load(Ordering::Acquire) {
            Err(ReqError::Remote(peer.failure()))
        } else if lost {
            peer.redial(index, &x.core).map_err(ReqError::Conn).and_then(|sock| {
                (conn, lost) = (Conn::new(sock), false);
                if !x.core.live() {
                    return Ok(false); // failed by another chunk meanwhile: skipped
                }
                peer.fence_cuts(index, &mut conn)?;
                conn.transfer(x, &x.segments[job.range.clone()])
            })
        } else {
            peer.fence_cuts(index, &mut conn).and_then(|()| conn.transfer(x, &x.segments[job.range.clone()]))
        };
        // A cancel cut the connection inside the chunk: the transfer is
        // cancelled (nothing is reported), its error is not the peer's.
        let cut = peer.is_cut(index);
        lost |= cut;
        match moved {
            // A chunk moved: the peer takes bytes again.
            Ok(true) if !cut => peer.set_stalled(false),
            Ok(_) => {}
            Err(ReqError::Remote(why)) => x.core.fail(why),
            Err(ReqError::Conn(_)) if cut && x.core.cancelled.load(Ordering::Acquire) => {}
            Err(ReqError::Conn(e)) => {
                peer.kill(TransferFailure::from_io(&e, format!("peer {}", peer.name)));
                x.core.fail(peer.failure());
            }
        }
        // Last chunk. If every chunk succeeded, the notification goes out
        // on this connection (the peer still alive) before the completion.
        // The worker stays inside the transfer meanwhile: a cancel waits for
        // it, so no notification leaves after cancel returned.
        if x.core.chunk_done() {
            finish(x, &mut conn, index, &peer, &done);
        }
        lost |= peer.leave(index);
    }
}

/// Report transfer `x`'s completion after its last chunk, sending its
/// notification first on `conn` (connection `index` of `peer`).
fn finish(x: &XferShared, conn: &mut Conn, index: usize, peer: &PeerShared, done: &Sender<Completion>) {
    x.core.complete(done, || {
        let Some(payload) = &x.core.notification else { return Ok(()) };
        if peer.dead.load(Ordering::Acquire) {
            return Err(peer.failure());
        }
        conn.notify(payload).map_err(|e| {
            let why = match e {
                ReqError::Remote(r) => r,
                // Cut by a cancel of this transfer: not the peer's
                // fault (the completion is dropped anyway).
                ReqError::Conn(e) if peer.is_cut(index) && x.core.cancelled.load(Ordering::Acquire) => {
                    TransferFailure::cancelled(e.to_string())
                }
                ReqError::Conn(e) => {
                    peer.kill(TransferFailure::from_io(&e, format!("peer {}", peer.name)));
                    peer.failure()
                }
            };
            TransferFailure { detail: format!("notification not delivered: {}", why.detail), ..why }
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's failure is seen by each of its workers, which each record
    /// the busy connections: a generation is noted once, so the cap never
    /// pushes out a connection still to fence because of repeats.
    #[test]
    fn a_fence_list_notes_a_generation_once_and_keeps_the_newest_past_its_cap() {
        let l = FenceList::default();
        assert!(l.is_empty());
        for _ in 0..3 {
            for g in [7, 8, 9] {
                l.add(g);
            }
        }
        assert_eq!(*l.list(), vec![7, 8, 9]);
        assert!(!l.is_empty());
        // A fence of what was pending leaves what was cut meanwhile.
        assert_eq!(l.pending(), Some(vec![7, 8, 9]));
        l.fenced(&[7, 8]);
        assert_eq!(l.pending(), Some(vec![9]));
        l.fenced(&[9]);
        assert!(l.is_empty() && l.pending().is_none());
        for g in [7, 8, 9] {
            l.add(g);
        }
        for g in 100..100 + u64::from(wire::MAX_FENCE_ENTRIES) {
            l.add(g);
        }
        let list = l.list();
        assert_eq!(list.len(), wire::MAX_FENCE_ENTRIES as usize);
        assert_eq!(list[0], 100, "the three oldest went");
        assert_eq!(list[list.len() - 1], 99 + u64::from(wire::MAX_FENCE_ENTRIES));
    }
}
