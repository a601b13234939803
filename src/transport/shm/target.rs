//! The target's side: the listener, access control for each connecting
//! process, and the per-initiator thread that hands out regions and
//! receives notifications.
//!
//! Before anything is sent, a connecting process must (1) run as a uid
//! this agent allows (`SO_PEERCRED`; its own uid unless the `allow_uids`
//! option adds others) and (2) prove it knows this agent's secret, which
//! travels only in the agent metadata: the target sends a random
//! [`Nonce`], the initiator answers `auth::prove(secret, nonce, "shm:" ‖ agent)`.
//! Either failing gets a [`Msg::Refused`] and the connection is closed; no
//! descriptor was sent. NIXL's and Mooncake's shared-memory paths check
//! neither.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::wire::{self, Access, Channel, Listener, Msg, PeerCred};
use crate::accept::{AcceptBackoff, AfterError};
use crate::transport::Notification;
use crate::transport::auth::{self, AgentSecret, Nonce};

/// One registered region as the target keeps it.
pub(super) struct LocalRegion {
    /// Start address (bytes).
    pub addr: u64,
    /// Length (bytes).
    pub len_bytes: u64,
    /// The sealed memfd holding exactly this region, and the region's
    /// offset in it; `None` for memory reached with cross-memory attach.
    pub fd: Option<(OwnedFd, u64)>,
    /// The right to re-home the `HostBuffer` whose memfd `fd` is, when this
    /// registration ends (`Some` exactly when `fd` is).
    pub claim: Option<super::buffer::ExportClaim>,
    /// Whether `fd` was ever handed to a peer (else no peer can map it, and
    /// ending the registration moves nothing).
    pub sent: AtomicBool,
    /// The memory, kept alive while registered (and by each transfer that
    /// uses it as its local side).
    pub backing: Arc<dyn crate::transport::MemoryBacking>,
}

impl LocalRegion {
    /// Whether peers reach this region only through its memfd, which
    /// re-homing takes from them (else through cross-memory attach, which
    /// only the peer's acknowledgement can fence).
    pub(super) fn rehomeable(&self) -> bool {
        self.claim.is_some()
    }

    /// End the registration: when its memfd was handed to a peer and the
    /// owner keeps the memory, re-home the owner's pages so that no mapping
    /// a peer kept reaches them (issue 27 item 4). On an error before
    /// anything moved the region comes back unchanged, to stay registered
    /// (`None` when this was the last reference to its backing).
    pub(super) fn retire(mut self) -> Result<(), (Option<Self>, std::io::Error)> {
        let Some(claim) = self.claim.take() else { return Ok(()) };
        if !self.sent.load(Ordering::Acquire) {
            claim.release(); // never handed out: no peer can map it
            return Ok(());
        }
        if Arc::get_mut(&mut self.backing).is_some() {
            // Our reference is the last one to the backing: let it go first.
            // The buffer itself may live on (a `View` covering it whose
            // parent someone else holds): then it is re-homed all the same;
            // if it went with the backing, nothing of the owner's is left
            // (`rehome` finds it gone). On an error there is no registration
            // to put back.
            let LocalRegion { fd, backing, .. } = self;
            drop(backing);
            let Some((old, _)) = fd else { return Ok(()) };
            return claim.rehome(std::os::fd::AsFd::as_fd(&old)).map_err(|(claim, e)| {
                claim.release();
                (None, e)
            });
        }
        let Some((old, _)) = &self.fd else {
            claim.release();
            return Ok(());
        };
        match claim.rehome(std::os::fd::AsFd::as_fd(old)) {
            Ok(()) => Ok(()),
            Err((claim, e)) => {
                self.claim = Some(claim);
                Err((Some(self), e))
            }
        }
    }
}

/// Regions by key.
pub(super) type RegionTable = Arc<Mutex<HashMap<u32, LocalRegion>>>;
/// Notifications received, for `take_notifications`.
pub(super) type NotifQueue = Arc<crate::transport::notify::NotifQueue>;

/// An initiator connected to us.
pub(super) struct AcceptedPeer {
    /// Our number for it.
    pub id: u64,
    /// Its socket.
    pub channel: Channel,
    /// False once its connection ended (it can no longer access anything).
    pub live: AtomicBool,
    /// Set once it proved the secret and got its regions: only these are
    /// sent revocations and waited for.
    pub admitted: AtomicBool,
    /// Once admitted: the agent name it proved and its pid (SO_PEERCRED).
    pub ident: Mutex<Option<(String, i32)>>,
}

/// The initiators connected to us (closed on drop).
pub(super) type Accepted = Arc<Mutex<Vec<Arc<AcceptedPeer>>>>;

/// Revocation acknowledgements `(peer id, rkey)`, and a condvar to wait on.
#[derive(Default)]
pub(super) struct Acks {
    /// Keys a `deregister` is waiting for. Acknowledgements of other keys
    /// are dropped, so a peer cannot grow `got` by sending them.
    pub revoking: Mutex<HashSet<u32>>,
    /// Acknowledgements received (of keys in `revoking`).
    pub got: Mutex<HashSet<(u64, u32)>>,
    /// Signalled on each acknowledgement and when a peer leaves.
    pub changed: Condvar,
}

/// What the listener and its per-peer threads share with the transport.
#[derive(Clone)]
pub(super) struct Shared {
    /// Registered regions.
    pub regions: RegionTable,
    /// Received notifications.
    pub notifs: NotifQueue,
    /// Connected initiators.
    pub accepted: Accepted,
    /// Revocation acknowledgements.
    pub acks: Arc<Acks>,
    /// `peer_timeout`.
    pub timeout: Duration,
    /// This agent's secret.
    pub secret: Arc<AgentSecret>,
    /// Uids allowed to connect.
    pub allow_uids: Arc<Vec<u32>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Accept connections until the listener is shut down. Running out of
/// descriptors or memory does not end it (see [`AcceptBackoff`]).
pub(super) fn accept_loop(listener: &Listener, stopping: &AtomicBool, shared: &Shared) {
    let mut next_id = 0u64;
    let mut backoff = AcceptBackoff::new("shm listener");
    loop {
        let accepted = listener.accept();
        if stopping.load(Ordering::Acquire) {
            break;
        }
        let channel = match accepted {
            Ok(ch) => {
                backoff.accepted();
                ch
            }
            Err(crate::transport::TransportError::Io { source, .. }) => match backoff.failed(&source) {
                AfterError::Retry => continue,
                AfterError::Stop => break,
            },
            Err(_) => break,
        };
        next_id += 1;
        let peer = Arc::new(AcceptedPeer {
            id: next_id,
            channel,
            live: AtomicBool::new(true),
            admitted: AtomicBool::new(false),
            ident: Mutex::new(None),
        });
        let mut list = lock(&shared.accepted);
        list.retain(|p| p.live.load(Ordering::Acquire)); // forget peers that left
        list.push(peer.clone());
        drop(list);
        let shared = shared.clone();
        let spawned = std::thread::Builder::new().name("kvwire-shm-peer".into()).spawn(move || {
            serve_peer(&peer, &shared);
            peer.live.store(false, Ordering::Release);
            peer.channel.shutdown();
            // Out of the list now, not at the next accept: its socket closes
            // when the last holder (this thread, or a waiting deregister) lets go.
            lock(&shared.accepted).retain(|p| !Arc::ptr_eq(p, &peer));
            // A deregister waiting for this peer's acknowledgement stops waiting.
            shared.acks.changed.notify_all();
        });
        if let Err(e) = spawned {
            tracing::warn!("shm: cannot serve a peer: {e}");
        }
    }
}

/// Start of the refusal reason for a name held by another connected process
/// (the initiator turns it into `TransportError::NameInUse`).
pub(super) const NAME_IN_USE: &str = "name in use";

fn refuse(ch: &Channel, cred: &PeerCred, reason: String) {
    tracing::warn!("shm: refused a connection from pid {} uid {}: {reason}", cred.pid, cred.uid);
    let _ = ch.send(&Msg::Refused { reason }, None);
}

/// Check who connected (uid, secret), answer its hello, then receive its
/// notifications and revocation acknowledgements until it leaves.
fn serve_peer(peer: &AcceptedPeer, shared: &Shared) {
    let ch = &peer.channel;
    if ch.set_timeouts(shared.timeout).is_err() {
        return;
    }
    let Ok(cred) = ch.peer_cred() else { return };
    if !shared.allow_uids.contains(&cred.uid) {
        return refuse(ch, &cred, format!("uid {} is not allowed to connect (allow_uids)", cred.uid));
    }
    let Ok(nonce) = Nonce::random() else { return };
    if ch.send(&Msg::Challenge { nonce }, None).is_err() {
        return;
    }
    let agent = match ch.recv() {
        Ok(Some((Msg::Hello { agent, rkeys, proof, nonce: theirs }, _))) => {
            if !auth::verify(&shared.secret, &nonce, &wire::proof_context(&agent), &proof) {
                return refuse(ch, &cred, format!("agent {agent:?} did not prove the target's secret"));
            }
            // One process holds a name while it is connected: another
            // process claiming it (to send notifications as that peer) is
            // refused. (Checked and recorded under the list's lock.)
            {
                let list = lock(&shared.accepted);
                let clash = list.iter().any(|p| {
                    p.id != peer.id
                        && p.live.load(Ordering::Acquire)
                        && lock(&p.ident).as_ref().is_some_and(|(n, pid)| *n == agent && *pid != cred.pid)
                });
                if clash {
                    drop(list);
                    return refuse(ch, &cred, format!("{NAME_IN_USE}: agent name {agent:?} is already connected"));
                }
                *lock(&peer.ident) = Some((agent.clone(), cred.pid));
            }
            peer.admitted.store(true, Ordering::Release);
            let ready = auth::prove(&shared.secret, &theirs, &wire::ready_context(&agent, &nonce)).to_vec();
            if let Err(e) = answer_hello(ch, &shared.regions, &rkeys, cred.pid, ready) {
                tracing::warn!("shm: hello from {agent} failed: {e}");
                return;
            }
            agent
        }
        Ok(Some((other, _))) => {
            return refuse(ch, &cred, format!("expected hello, got {other:?}"));
        }
        Ok(None) => return,
        Err(e) => {
            tracing::warn!("shm: bad hello from pid {}: {e}", cred.pid);
            return;
        }
    };
    let _ = ch.block_receives();
    loop {
        match ch.recv() {
            Ok(Some((Msg::Notify { payload }, _))) => {
                // A full queue refuses (the sender's transfer fails
                // `Overloaded`) instead of growing.
                let answer = match shared.notifs.push(Notification { from_agent: agent.clone(), payload }) {
                    Ok(()) => Msg::NotifyAck,
                    Err(reason) => Msg::NotifyRefused { reason },
                };
                // Waits at most peer_timeout for room; an initiator that
                // does not read loses its connection.
                if let Err(e) = ch.send(&answer, None) {
                    tracing::warn!("shm: acknowledging a notification to {agent} failed: {e}");
                    return;
                }
            }
            Ok(Some((Msg::RevokeAck { rkey }, _))) => {
                // (`revoking` is released before `got` is taken: deregister
                // takes them the other way round.)
                let pending = lock(&shared.acks.revoking).contains(&rkey);
                if pending {
                    lock(&shared.acks.got).insert((peer.id, rkey));
                    shared.acks.changed.notify_all();
                }
            }
            Ok(Some((other, _))) => tracing::warn!("shm: unexpected message from {agent}: {other:?}"),
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("shm: connection from {agent} failed: {e}");
                return;
            }
        }
    }
}

/// Allow `pid` (and only it) to attach with `process_vm_readv/writev`
/// under Yama `ptrace_scope=1`; each call replaces the previous pid, so
/// with several peers reaching cross-memory-attach regions only the last
/// one connected may attach there (documented in docs/SECURITY.md).
fn allow_ptracer(pid: i32) {
    // SAFETY: prctl with integer arguments; no memory is passed.
    let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, pid as libc::c_ulong, 0, 0, 0) };
    if r != 0 {
        // EINVAL without Yama: nothing to do, ordinary ptrace rules apply.
        tracing::debug!("shm: PR_SET_PTRACER({pid}): {}", std::io::Error::last_os_error());
    }
}

fn answer_hello(
    ch: &Channel,
    regions: &RegionTable,
    rkeys: &[u32],
    pid: i32,
    proof: Vec<u8>,
) -> Result<(), crate::transport::TransportError> {
    let mut cma = false;
    for &rkey in rkeys {
        let (msg, fd) = {
            let table = lock(regions);
            match table.get(&rkey) {
                None => (Msg::Region { rkey, addr: 0, len_bytes: 0, access: Access::Unknown }, None),
                Some(r) => match &r.fd {
                    // A duplicate, so that neither a concurrent deregister
                    // closing the original nor a slow peer holding up the
                    // send involves the table lock.
                    Some((fd, offset)) => (
                        {
                            r.sent.store(true, Ordering::Release);
                            Msg::Region {
                                rkey,
                                addr: r.addr,
                                len_bytes: r.len_bytes,
                                access: Access::Fd { offset: *offset },
                            }
                        },
                        Some(fd.try_clone().map_err(|e| crate::transport::TransportError::io("dup", e))?),
                    ),
                    None => {
                        cma = true;
                        (Msg::Region { rkey, addr: r.addr, len_bytes: r.len_bytes, access: Access::Cma }, None)
                    }
                },
            }
        };
        ch.send(&msg, fd.as_ref().map(|f| f.as_raw_fd()))?;
    }
    if cma {
        // Only where cross-memory attach is used, and only for this peer.
        allow_ptracer(pid);
    }
    ch.send(&Msg::Ready { pid: std::process::id(), proof }, None)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::transport::auth;
    use crate::transport::shm::ShmTransport;
    use crate::transport::shm::wire::{self, Channel, Msg, ShmInfo};
    use crate::transport::{Transport, TransportConfig};

    /// Issue 27: the uid check must be exercised without root too (the
    /// integration test needs root to run a child as another uid). A target
    /// that allows only another uid refuses us before any challenge; the
    /// same target allowing our uid challenges us, so the check is real.
    #[test]
    fn a_uid_not_allowed_is_refused_without_root() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};

        use super::{Shared, accept_loop};
        use crate::transport::TransportKind;
        use crate::transport::auth::AgentSecret;
        use crate::transport::notify::{NotifBounds, NotifQueue};
        use crate::transport::shm::wire::Listener;

        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        for (allowed, refused) in [(me.wrapping_add(1), true), (me, false)] {
            let name = format!("kvwire-uidtest-{}-{allowed}", std::process::id());
            let listener = Listener::bind(&name).unwrap();
            let shared = Shared {
                regions: Arc::default(),
                notifs: Arc::new(NotifQueue::new(TransportKind::Shm, NotifBounds::default())),
                accepted: Arc::default(),
                acks: Arc::default(),
                timeout: Duration::from_secs(2),
                secret: Arc::new(AgentSecret::random().unwrap()),
                allow_uids: Arc::new(vec![allowed]),
            };
            let stopping = AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| accept_loop(&listener, &stopping, &shared));
                let ch = Channel::connect(&name, Duration::from_secs(2)).unwrap();
                let first = ch.recv();
                if refused {
                    assert!(
                        matches!(&first, Ok(Some((Msg::Refused { reason }, None))) if reason.contains("allow_uids")),
                        "uid {me} not in [{allowed}]: {first:?}"
                    );
                } else {
                    assert!(matches!(&first, Ok(Some((Msg::Challenge { .. }, _)))), "{first:?}");
                }
                stopping.store(true, Ordering::Release);
                listener.shutdown();
            });
        }
    }

    /// A peer that proved the secret used to grow the target's
    /// acknowledgement set by one entry per `RevokeAck` of any key.
    #[test]
    fn acknowledgements_of_keys_nobody_revokes_are_dropped() {
        let t = ShmTransport::new("target", &TransportConfig::default()).unwrap();
        let info = ShmInfo::decode(&t.connection_info()).unwrap();
        let ch = Channel::connect(&info.socket, Duration::from_secs(5)).unwrap();
        let Ok(Some((Msg::Challenge { nonce }, _))) = ch.recv() else { panic!("no challenge") };
        let proof = auth::prove(&info.secret, &nonce, &wire::proof_context("p")).to_vec();
        ch.send(&Msg::Hello { agent: "p".into(), rkeys: vec![], proof, nonce }, None).unwrap();
        assert!(matches!(ch.recv(), Ok(Some((Msg::Ready { .. }, _)))));
        for rkey in 0..1000 {
            ch.send(&Msg::RevokeAck { rkey }, None).unwrap();
        }
        // Acknowledged after every RevokeAck before it was handled.
        ch.send(&Msg::Notify { payload: b"x".to_vec() }, None).unwrap();
        assert!(matches!(ch.recv(), Ok(Some((Msg::NotifyAck, _)))));
        assert!(super::lock(&t.acks.got).is_empty());
    }
}
