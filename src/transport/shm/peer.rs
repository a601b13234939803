//! The initiator's side of one connected target: the handshake that proves
//! the target's secret and maps its regions (checked before mapping), and
//! the per-peer thread that sends notifications, collects their
//! acknowledgements and answers revocations.
//!
//! The copy threads are shared by every peer of the process, so they never
//! wait for one: a notification is sent with a non-blocking `sendmsg` when
//! the socket has room and nothing is queued before it, else queued for
//! this peer's thread. A transfer with a notification is reported `Done`
//! only when the target acknowledged it ([`Msg::NotifyAck`]); a target that
//! dies first fails it with `PeerDied`, one that does not answer within
//! `peer_timeout` with `PeerTimeout`. A hung target delays only its own
//! transfers.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::copy::{Out, PeerMem, PeerRegion, PeerShared, Pending, XferShared};
use super::wire::{self, Access, Channel, Msg, Received, ShmInfo};
use crate::transport::auth::{self, Nonce};
use crate::transport::{Completion, RemoteRegion, TransferFailure, TransportError};

fn notify_failure(e: &TransportError, peer: &str) -> TransferFailure {
    let detail = format!("notification to {peer} not delivered");
    match e {
        TransportError::Io { source, .. } => TransferFailure::from_io(source, detail),
        other => TransferFailure::peer_died(format!("{detail}: {other}")),
    }
}

impl PeerShared {
    /// Send `xfer`'s notification (its data is in place) and report the
    /// transfer when the target acknowledged it. Called by a copy thread:
    /// never waits for the peer.
    pub(super) fn notify(&self, xfer: Arc<XferShared>, done: Sender<Completion>) {
        let p = Pending { xfer, done, deadline: Instant::now() + self.outbox.timeout };
        let mut st = self.outbox.lock();
        if st.closed {
            drop(st);
            p.finish(Err(TransferFailure::peer_died(format!("peer {} disconnected", self.name))));
            return;
        }
        if st.queued.is_empty() {
            let payload = p.xfer.core.notification.clone().unwrap_or_default();
            match self.channel.try_send(&Msg::Notify { payload }) {
                Ok(true) => {
                    // The peer thread sleeps without a deadline when nothing
                    // else is waiting: wake it to time this one.
                    let idle = st.unacked.iter().all(Option::is_none);
                    st.unacked.push_back(Some(p));
                    drop(st);
                    if idle {
                        self.outbox.wake();
                    }
                    return;
                }
                Ok(false) => {}
                Err(e) => {
                    drop(st);
                    p.finish(Err(notify_failure(&e, &self.name)));
                    return;
                }
            }
        }
        st.queued.push_back(Out::Notify(p));
        drop(st);
        self.outbox.wake();
    }
}

/// Body of the per-peer thread: runs until the target closes the
/// connection or `disconnect` stops it, then fails what is still pending.
pub(super) fn peer_thread(peer: &PeerShared) {
    let why = serve(peer);
    peer.dead.store(true, Ordering::Release);
    let (queued, unacked) = {
        let mut st = peer.outbox.lock();
        st.closed = true;
        (std::mem::take(&mut st.queued), std::mem::take(&mut st.unacked))
    };
    for o in queued {
        if let Out::Notify(p) = o {
            p.finish(Err(why.clone()));
        }
    }
    for p in unacked.into_iter().flatten() {
        p.finish(Err(why.clone()));
    }
}

fn serve(peer: &PeerShared) -> TransferFailure {
    let ob = &peer.outbox;
    loop {
        if ob.stop.load(Ordering::Acquire) {
            return TransferFailure::peer_died(format!("disconnected from peer {}", peer.name));
        }
        let (want_out, deadline) = {
            let st = ob.lock();
            let q = st.queued.iter().find_map(|o| if let Out::Notify(p) = o { Some(p.deadline) } else { None });
            let u = st.unacked.iter().find_map(|p| p.as_ref().map(|p| p.deadline));
            (!st.queued.is_empty(), q.into_iter().chain(u).min())
        };
        let timeout_ms = deadline.map_or(-1, |d| {
            d.saturating_duration_since(Instant::now()).as_millis().saturating_add(1).min(i32::MAX as u128) as i32
        });
        let sock_events = libc::POLLIN | if want_out { libc::POLLOUT } else { 0 };
        let mut fds = [
            libc::pollfd { fd: peer.channel.as_fd().as_raw_fd(), events: sock_events, revents: 0 },
            libc::pollfd { fd: ob.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: `fds` is a live array of 2 pollfds of descriptors we own.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return TransferFailure::from_io(&e, format!("poll on peer {}", peer.name));
            }
        }
        if fds[1].revents != 0 {
            ob.drain_wake();
        }
        if let Err(f) = receive(peer) {
            return f;
        }
        if let Err(f) = send_queued(peer) {
            return f;
        }
        expire(peer);
    }
}

/// Handle every packet the target sent.
fn receive(peer: &PeerShared) -> Result<(), TransferFailure> {
    loop {
        match peer.channel.try_recv() {
            Ok(Received::Empty) => return Ok(()),
            Ok(Received::Closed) => {
                return Err(TransferFailure::peer_died(format!("peer {} closed the connection", peer.name)));
            }
            Ok(Received::Msg(Msg::NotifyAck, _)) => match peer.outbox.lock().unacked.pop_front() {
                Some(Some(p)) => p.finish(Ok(())),
                Some(None) => {} // failed by its deadline already
                None => return Err(TransferFailure::protocol(format!("peer {} acknowledged too much", peer.name))),
            },
            Ok(Received::Msg(Msg::NotifyRefused { reason }, _)) => match peer.outbox.lock().unacked.pop_front() {
                Some(Some(p)) => p.finish(Err(TransferFailure::overloaded(format!(
                    "notification not delivered: peer {}: {reason}",
                    peer.name
                )))),
                Some(None) => {}
                None => return Err(TransferFailure::protocol(format!("peer {} refused too much", peer.name))),
            },
            Ok(Received::Msg(Msg::Revoke { rkey }, _)) => {
                if let Some(r) = peer.regions.get(&rkey) {
                    r.revoke();
                }
                peer.outbox.lock().queued.push_back(Out::RevokeAck(rkey));
            }
            Ok(Received::Msg(other, _)) => tracing::warn!("shm: unexpected message from {}: {other:?}", peer.name),
            Err(TransportError::Io { source, .. }) => {
                return Err(TransferFailure::from_io(&source, format!("connection to {}", peer.name)));
            }
            Err(e) => return Err(TransferFailure::protocol(format!("peer {}: {e}", peer.name))),
        }
    }
}

/// Send what is queued until the socket is full.
fn send_queued(peer: &PeerShared) -> Result<(), TransferFailure> {
    let mut st = peer.outbox.lock();
    while let Some(front) = st.queued.front() {
        let msg = match front {
            Out::Notify(p) if p.xfer.core.cancelled.load(Ordering::Acquire) => {
                st.queued.pop_front(); // released: no completion, no notification
                continue;
            }
            Out::Notify(p) => Msg::Notify { payload: p.xfer.core.notification.clone().unwrap_or_default() },
            Out::RevokeAck(rkey) => Msg::RevokeAck { rkey: *rkey },
        };
        match peer.channel.try_send(&msg) {
            Ok(true) => {
                if let Some(Out::Notify(p)) = st.queued.pop_front() {
                    st.unacked.push_back(Some(p));
                }
            }
            Ok(false) => return Ok(()),
            Err(e) => return Err(notify_failure(&e, &peer.name)),
        }
    }
    Ok(())
}

/// Fail the notifications whose deadline passed with `PeerTimeout`.
fn expire(peer: &PeerShared) {
    let now = Instant::now();
    let mut expired = Vec::new();
    {
        let mut st = peer.outbox.lock();
        let mut keep = VecDeque::with_capacity(st.queued.len());
        for o in st.queued.drain(..) {
            match o {
                Out::Notify(p) if p.deadline <= now => expired.push(p),
                o => keep.push_back(o),
            }
        }
        st.queued = keep;
        for slot in st.unacked.iter_mut() {
            if slot.as_ref().is_some_and(|p| p.deadline <= now) {
                expired.extend(slot.take());
            }
        }
    }
    for p in expired {
        let why = format!("peer {} did not take the notification within {:?}", peer.name, peer.outbox.timeout);
        p.finish(Err(TransferFailure::peer_timeout(why)));
    }
}

/// Connect to a target, prove its secret, and map the regions it reports.
/// The whole handshake is bounded by `timeout`.
///
/// # Errors
/// [`TransportError::Connect`] when the target refuses us or answers
/// malformed or lying region replies (a memfd smaller than the region, or
/// not sealed against shrinking); [`TransportError::Timeout`] (`op`
/// `"connect"`) when it does not answer within `timeout`.
pub(super) fn handshake(
    agent: &str,
    peer_name: &str,
    info: &ShmInfo,
    regions: &[RemoteRegion],
    timeout: Duration,
) -> Result<(Channel, HashMap<u32, PeerRegion>), TransportError> {
    let cerr = |reason: String| TransportError::Connect { peer: peer_name.to_string(), reason };
    // A socket timeout (a full backlog at `connect`, a target that does not
    // answer in time) is `Timeout`, which may be retried; anything else is
    // `Connect`.
    let fail = |e: TransportError| match e {
        TransportError::Io { call, source } if TransportError::is_timeout_io(&source) => {
            TransportError::connect_timeout(
                peer_name,
                timeout,
                format!("handshake ({call}): no answer from the target"),
            )
        }
        e => cerr(e.to_string()),
    };
    let deadline = Instant::now() + timeout;
    let ch = Channel::connect(&info.socket, timeout).map_err(fail)?;
    let recv = |ch: &Channel| -> Result<(Msg, Option<OwnedFd>), TransportError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TransportError::connect_timeout(peer_name, timeout, "the handshake did not finish"));
        }
        ch.set_timeouts(left)?;
        match ch.recv().map_err(fail)? {
            None => Err(cerr("peer closed the connection during the handshake".into())),
            Some((Msg::Refused { reason }, _)) if reason.starts_with(super::target::NAME_IN_USE) => {
                Err(TransportError::NameInUse { peer: peer_name.to_string(), name: agent.to_string() })
            }
            Some((Msg::Refused { reason }, _)) => Err(cerr(format!("refused by the target: {reason}"))),
            Some(m) => Ok(m),
        }
    };
    let nonce = match recv(&ch)? {
        (Msg::Challenge { nonce }, _) => nonce,
        (other, _) => return Err(cerr(format!("expected a challenge, got {other:?}"))),
    };
    let proof = auth::prove(&info.secret, &nonce, &wire::proof_context(agent)).to_vec();
    let rkeys: Vec<u32> = regions.iter().map(|r| r.rkey.0).collect();
    let ours = Nonce::random()?;
    let asked: std::collections::HashSet<u32> = rkeys.iter().copied().collect();
    ch.send(&Msg::Hello { agent: agent.to_string(), rkeys, proof, nonce: ours }, None).map_err(fail)?;
    let mut table = HashMap::new();
    let mut fds = HashMap::new();
    let mut revoked_early = Vec::new();
    let pid = loop {
        match recv(&ch)? {
            (Msg::Region { rkey, addr, len_bytes, access }, fd) => {
                // One answer per key asked for: a target cannot make us
                // hold more descriptors than that (each region's memfd).
                if !asked.contains(&rkey) {
                    return Err(cerr(format!("the target answered region {rkey}, which was not asked for")));
                }
                if access == Access::Unknown {
                    return Err(cerr(format!("peer has no region with rkey {rkey} (stale metadata?)")));
                }
                if addr.checked_add(len_bytes).is_none() {
                    return Err(cerr(format!("region {rkey}: {addr:#x}+{len_bytes} overflows")));
                }
                match (access, fd) {
                    (Access::Fd { offset }, Some(fd)) => {
                        fds.insert(rkey, (fd, offset));
                    }
                    (Access::Fd { .. }, None) => return Err(cerr(format!("region {rkey}: memfd missing"))),
                    _ => {}
                }
                table.insert(rkey, (addr, len_bytes));
            }
            (Msg::Ready { pid, proof }, _) => {
                // Nothing received so far is used unless the target proves
                // the secret of the metadata we dialled (module docs).
                if !auth::verify(&info.secret, &ours, &wire::ready_context(agent, &nonce), &proof) {
                    return Err(cerr(
                        "refused (Impostor): the target did not prove the agent secret of its metadata \
                         (another process on its socket name?); none of its regions was mapped"
                            .into(),
                    ));
                }
                break pid as i32;
            }
            (Msg::Revoke { rkey }, _) => {
                // Deregistered while we were connecting: never use it.
                revoked_early.push(rkey);
                ch.send(&Msg::RevokeAck { rkey }, None).map_err(fail)?;
            }
            (other, _) => return Err(cerr(format!("unexpected handshake message {other:?}"))),
        }
    };
    let mut peer_regions = HashMap::with_capacity(table.len());
    for (rkey, (addr, len_bytes)) in table {
        let mem = match fds.remove(&rkey) {
            Some((fd, offset)) => map_region(fd, offset, len_bytes).map_err(|e| cerr(format!("region {rkey}: {e}")))?,
            None => PeerMem::Cma { pid },
        };
        let revoked = AtomicBool::new(revoked_early.contains(&rkey));
        peer_regions.insert(rkey, PeerRegion { addr, len_bytes, mem, revoked, active: AtomicUsize::new(0) });
    }
    Ok((ch, peer_regions))
}

/// Seals an exported memfd must carry: nobody (a third party holding the
/// fd, or the target) can shrink it under our mapping (SIGBUS) or grow it.
const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Map `len_bytes` at `offset` of a target's memfd, after checking that
/// the file really holds them (`fstat`) and is sealed against shrinking,
/// so that no later access can fault (issue 18 item 6).
fn map_region(fd: OwnedFd, offset: u64, len_bytes: u64) -> Result<PeerMem, String> {
    let st = nix::sys::stat::fstat(&fd).map_err(|e| format!("fstat: {e}"))?;
    let size = st.st_size as u64;
    let end = offset.checked_add(len_bytes).ok_or("offset + length overflows")?;
    if end > size || len_bytes == 0 {
        return Err(format!("the reply claims bytes {offset}..{end} but the memfd holds {size}"));
    }
    let seals = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GET_SEALS).unwrap_or(-1);
    if seals < 0 || seals & REQUIRED_SEALS != REQUIRED_SEALS {
        return Err("the memfd is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW)".into());
    }
    let page = 4096u64;
    let aligned = offset / page * page;
    let delta = (offset - aligned) as usize;
    let len = usize::try_from(len_bytes).map_err(|_| "region too large")? + delta;
    let file = std::fs::File::from(fd);
    let map = memmap2::MmapOptions::new()
        .offset(aligned)
        .len(len)
        .map_raw(&file)
        .map_err(|e| format!("mmap(peer region): {e}"))?;
    let base = map.as_ptr() as usize + delta;
    Ok(PeerMem::Mapped { base, _map: Arc::new(map) })
}
