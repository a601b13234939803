//! `shm`: one-sided READ/WRITE between processes on the same host.
//!
//! Each agent listens on an abstract `SOCK_SEQPACKET` Unix socket. A process
//! that connects must run as an allowed uid (`SO_PEERCRED`) and prove it
//! knows the agent's secret from the metadata (the target module's docs and
//! `docs/SECURITY.md`); it then gets, per registered region, either the
//! region's sealed memfd ([`HostBuffer`] memory) which it maps after checking
//! its size and seals, so that a transfer is one `memcpy` by the initiator's
//! copy threads, or the target's pid for cross-memory attach
//! (`process_vm_readv/writev`) for any other memory (option `cma=deny`
//! refuses such registrations). The target's CPU copies nothing. Every
//! segment is checked against the region table the *target* reported (key
//! and bounds), as an HCA checks an rkey: a bad key or range fails the
//! transfer before any byte moves.
//!
//! Notifications travel on the socket after the data, never with a blocking
//! send from the shared copy threads (the peer module); a notified transfer is
//! `Done` once the target acknowledged the notification, `Failed(PeerDied)`
//! when the target goes away first and `Failed(PeerTimeout)` after
//! [`TransportConfig::peer_timeout`]. The largest notification is
//! [`super::MAX_NOTIFICATION_BYTES`]. A deregistered region is revoked and
//! unmapped in every connected initiator before `deregister` returns, and
//! when its memfd was handed out the owner's pages are re-homed into a new
//! memfd at the same address, so that a peer that kept its mapping reaches
//! nothing of them (issue 27 item 4, `docs/SECURITY.md`).

mod buffer;
mod copy;
mod peer;
mod stream;
mod target;
pub mod wire;

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

pub use buffer::{HostBuffer, available_host_bytes};
use copy::{CopyPool, Job, PeerShared, SpareSegments, XferShared};
pub use stream::stream_copy;
use target::{Accepted, AcceptedPeer, Acks, LocalRegion, NotifQueue, RegionTable, Shared};
use wire::{Listener, Msg, ShmInfo};

use super::auth::AgentSecret;
use super::inflight::{InFlight, XferState};
use super::options::OptionSet;
use super::{
    Completion, Dial, Dialed, LocalKey, MemoryBacking, Notification, PeerId, PostRequest, Registration, RemoteKey,
    RemoteRegion, Segment, Transport, TransportConfig, TransportError, TransportKind, XferId,
};

/// Bytes of work per copy job: large enough that queueing costs nothing,
/// small enough that two threads share a transfer.
const CHUNK_BYTES: u64 = 4 << 20;

/// Transfers of at most this many bytes are copied by `post` itself, on the
/// calling thread, as NIXL's UCX shared-memory transports do: handing one
/// page to a copy thread costs a wake-up (one-page 4 KiB WRITE latency p50
/// 5.4 µs through the pool vs 3.6–3.9 µs for NIXL 1.5.1, `nixl_api_bench.py`,
/// quiet 2-vCPU EPYC guest), and a 64 KiB copy takes about as long as the
/// wake-up (≈ 3–5 µs at 15–20 GB/s); measured after: 4 KiB page p50 1.2 µs
/// (`kvwire bench`, was 1.6–1.7). Larger transfers go to the pool so that
/// `post` returns at once and the copy threads share them.
const INLINE_BYTES: u64 = 64 << 10;

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// A target we connected to, and the thread that talks to it.
struct Connected {
    shared: Arc<PeerShared>,
    thread: Option<JoinHandle<()>>,
}

impl Connected {
    /// Stop the peer thread and wait for it (issue 18 item 7: a thread per
    /// connect/disconnect cycle used to stay until the transport dropped).
    fn close(&mut self) {
        self.shared.dead.store(true, Ordering::Release);
        self.shared.outbox.stop();
        self.shared.channel.shutdown();
        if let Some(h) = self.thread.take() {
            let _ = h.join();
        }
    }
}

/// The shared-memory backend. See the module docs.
pub struct ShmTransport {
    agent: String,
    socket_name: String,
    config: TransportConfig,
    regions: RegionTable,
    next_key: u32,
    listener: Arc<Listener>,
    service: Option<JoinHandle<()>>,
    stopping: Arc<AtomicBool>,
    notifs: NotifQueue,
    accepted: Accepted,
    acks: Arc<Acks>,
    peers: HashMap<u32, Connected>,
    next_peer: u32,
    secret: Arc<AgentSecret>,
    allow_cma: bool,
    inflight: InFlight<XferShared>,
    pool: CopyPool,
    spare: Arc<SpareSegments>,
    /// This transport in the connections it dials ([`Dialed`]).
    owner: u64,
}

static SOCKET_SEQ: AtomicUsize = AtomicUsize::new(0);

/// The `allow_uids` option: comma-separated uids, besides our own.
fn parse_uids(opts: &OptionSet<'_>) -> Result<Vec<u32>, TransportError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let mut uids = vec![unsafe { libc::geteuid() }];
    if let Some(v) = opts.raw("allow_uids") {
        for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            uids.push(part.parse().map_err(|_| opts.invalid("allow_uids", v, Some("not a uid")))?);
        }
    }
    Ok(uids)
}

impl ShmTransport {
    /// End registration `lkey` once no peer uses it any more (see
    /// `LocalRegion::retire`); on an error before anything moved it stays
    /// registered.
    fn retire(&self, lkey: LocalKey, removed: LocalRegion) -> Result<(), TransportError> {
        match removed.retire() {
            Ok(()) => Ok(()),
            Err((Some(removed), e)) => {
                self.regions.lock().unwrap_or_else(|p| p.into_inner()).insert(lkey.0, removed);
                Err(TransportError::io("re-home deregistered memory (it stays registered)", e))
            }
            Err((None, e)) => Err(TransportError::io(
                "re-home deregistered memory (deregistered; a peer that ignored the revocation may still \
                 reach the buffer)",
                e,
            )),
        }
    }

    /// Create the backend for agent `agent` and start its listener.
    /// Options (`key=value`, see [`crate::transport::options::SHM_OPTIONS`]):
    /// `allow_uids` (uids besides our own that may connect) and `cma`
    /// (`allow`/`deny` cross-memory attach for memory without a memfd).
    ///
    /// # Errors
    /// [`TransportError::InvalidConfig`] / [`TransportError::InvalidOption`]
    /// for bad settings, [`TransportError::Io`] when the socket cannot be bound.
    pub fn new(agent: &str, config: &TransportConfig) -> Result<Self, TransportError> {
        config.validate()?;
        let opts = OptionSet::parse(TransportKind::Shm, config)?;
        let allow_uids = Arc::new(parse_uids(&opts)?);
        let allow_cma = match opts.raw("cma").map(str::trim) {
            None | Some("allow") => true,
            Some("deny") => false,
            Some(v) => return Err(opts.invalid("cma", v, None)),
        };
        let secret = Arc::new(AgentSecret::random()?);
        let socket_name = format!(
            "kvwire-shm-{}-{}-{}",
            std::process::id(),
            SOCKET_SEQ.fetch_add(1, Ordering::Relaxed),
            uuid::Uuid::new_v4().simple()
        );
        let listener = Arc::new(Listener::bind(&socket_name)?);
        let regions: RegionTable = Arc::default();
        let notifs: NotifQueue = Arc::new(super::notify::NotifQueue::new(
            TransportKind::Shm,
            super::notify::NotifBounds::from_options(&opts)?,
        ));
        let stopping = Arc::new(AtomicBool::new(false));
        let accepted: Accepted = Arc::default();
        let acks: Arc<Acks> = Arc::default();
        let service = {
            let shared = Shared {
                regions: regions.clone(),
                notifs: notifs.clone(),
                accepted: accepted.clone(),
                acks: acks.clone(),
                timeout: config.peer_timeout,
                secret: secret.clone(),
                allow_uids,
            };
            let (listener, stopping) = (listener.clone(), stopping.clone());
            std::thread::Builder::new()
                .name("kvwire-shm-listen".into())
                .spawn(move || target::accept_loop(&listener, &stopping, &shared))
                .map_err(|e| TransportError::io("spawn", e))?
        };
        Ok(Self {
            agent: agent.to_string(),
            socket_name,
            config: config.clone(),
            regions,
            next_key: 1,
            listener,
            service: Some(service),
            stopping,
            notifs,
            accepted,
            acks,
            peers: HashMap::new(),
            next_peer: 1,
            secret,
            allow_cma,
            owner: super::next_owner(),
            inflight: InFlight::default(),
            pool: CopyPool::new(config.copy_threads).map_err(|e| TransportError::io("spawn", e))?,
            spare: Arc::default(),
        })
    }
}

/// Seals every exported memfd carries (issue 18 item 5): a peer holding
/// the fd can neither shrink it (the target would die of SIGBUS at its
/// next access) nor grow it, nor change the seals.
const EXPORT_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// The memfd to hand to peers for a registration of `len_bytes` at `offset`
/// of `fd`, or `None` when handing it out would expose more than the
/// registered bytes: the file must hold exactly the region (rounded up to
/// whole pages) and carry [`EXPORT_SEALS`] (added here if the file allows).
fn export_fd(fd: BorrowedFd<'_>, offset: u64, len_bytes: u64) -> Result<Option<(OwnedFd, u64)>, TransportError> {
    let st = nix::sys::stat::fstat(fd).map_err(|e| TransportError::io("fstat", std::io::Error::from(e)))?;
    let size = st.st_size as u64;
    let page = 4096u64;
    if offset != 0 || len_bytes > size || size > len_bytes.div_ceil(page) * page {
        return Ok(None); // a view inside a larger file
    }
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    let mut seals = fcntl(fd, FcntlArg::F_GET_SEALS).unwrap_or(-1);
    if seals >= 0 && seals & EXPORT_SEALS != EXPORT_SEALS {
        let want = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
        let _ = fcntl(fd, FcntlArg::F_ADD_SEALS(want));
        seals = fcntl(fd, FcntlArg::F_GET_SEALS).unwrap_or(-1);
    }
    if seals < 0 || seals & EXPORT_SEALS != EXPORT_SEALS {
        return Ok(None);
    }
    Ok(Some((fd.try_clone_to_owned().map_err(|e| TransportError::io("dup", e))?, 0)))
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn register(&mut self, backing: Arc<dyn MemoryBacking>) -> Result<Registration, TransportError> {
        let desc = backing.desc();
        if desc.kind != super::MemoryKind::Dram {
            return Err(TransportError::Unsupported("the shm transport moves host (DRAM) memory only".into()));
        }
        // Only a HostBuffer's own memfd is handed out, and to one
        // registration at a time: its pages are re-homed when that
        // registration ends (issue 27 item 4), which kvwire can do only for
        // memory it allocated.
        let (fd, claim) = match backing.shared_fd() {
            Some((fd, 0)) => match buffer::ExportClaim::claim(fd, desc.addr, desc.len_bytes) {
                Some(claim) => match export_fd(fd, 0, desc.len_bytes) {
                    Ok(Some(fd)) => (Some(fd), Some(claim)),
                    Ok(None) => {
                        claim.release();
                        (None, None)
                    }
                    Err(e) => {
                        claim.release();
                        return Err(e);
                    }
                },
                None => (None, None),
            },
            _ => (None, None),
        };
        if fd.is_none() && !self.allow_cma {
            return Err(TransportError::Registration(format!(
                "{:#x}+{} is not a whole HostBuffer that no other shm registration exports (plain memory, a view \
                 inside a larger buffer, or a buffer registered twice) and cross-memory attach is disabled \
                 (cma=deny); register a HostBuffer of exactly this range, once",
                desc.addr, desc.len_bytes
            )));
        }
        let key = self.next_key;
        self.next_key += 1;
        self.regions.lock().unwrap_or_else(|p| p.into_inner()).insert(
            key,
            LocalRegion {
                addr: desc.addr,
                len_bytes: desc.len_bytes,
                fd,
                claim,
                sent: AtomicBool::new(false),
                backing,
            },
        );
        Ok(Registration { lkey: LocalKey(key), rkey: RemoteKey(key) })
    }

    /// Forget a registration. Every connected initiator is told to revoke
    /// the key and must acknowledge that no access is in progress and none
    /// will start; then, if the region's memfd was handed to a peer and the
    /// memory lives on, its pages are re-homed (copied into a new memfd
    /// mapped over the same address; about 2 s/GiB, `docs/SECURITY.md`), so
    /// that a peer that kept its mapping reaches none of it. Only then does
    /// this return, as `ibv_dereg_mr` does (the caller may free the memory
    /// afterwards). Writes the owner makes to the region while this runs may
    /// be lost.
    ///
    /// # Errors
    /// [`TransportError::UnknownLocalKey`]; [`TransportError::Timeout`]
    /// (`op: "deregister"`) when a live initiator does not acknowledge
    /// within `peer_timeout` a region it reaches by cross-memory attach (a
    /// region handed out as a memfd does not wait for consent: an initiator
    /// silent past `peer_timeout` is cut off and the pages re-homed all the
    /// same); [`TransportError::Io`] when re-homing fails
    /// before anything moved — the registration then stays in place
    /// (deregister may be retried).
    fn deregister(&mut self, lkey: LocalKey) -> Result<(), TransportError> {
        let removed = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&lkey.0)
            .ok_or(TransportError::UnknownLocalKey(lkey))?;
        let peers: Vec<Arc<AcceptedPeer>> = self
            .accepted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|p| p.live.load(Ordering::Acquire) && p.admitted.load(Ordering::Acquire))
            .cloned()
            .collect();
        // Before any Revoke goes out, so that no acknowledgement is dropped.
        self.acks.revoking.lock().unwrap_or_else(|p| p.into_inner()).insert(lkey.0);
        for p in &peers {
            // A peer that cannot be told is gone (its socket is closed).
            let _ = p.channel.send(&Msg::Revoke { rkey: lkey.0 }, None);
        }
        let deadline = std::time::Instant::now() + self.config.peer_timeout;
        let mut got = self.acks.got.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let waiting: Vec<u64> = peers
                .iter()
                .filter(|p| p.live.load(Ordering::Acquire) && !got.contains(&(p.id, lkey.0)))
                .map(|p| p.id)
                .collect();
            if waiting.is_empty() {
                got.retain(|(_, k)| *k != lkey.0);
                self.acks.revoking.lock().unwrap_or_else(|p| p.into_inner()).remove(&lkey.0);
                drop(got);
                // Cooperating peers have let go; now take the pages from
                // those that did not (issue 27 item 4).
                return self.retire(lkey, removed);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                got.retain(|(_, k)| *k != lkey.0);
                self.acks.revoking.lock().unwrap_or_else(|p| p.into_inner()).remove(&lkey.0);
                drop(got);
                if removed.rehomeable() {
                    // Revocation needs no consent where re-homing takes the
                    // pages: a live initiator that did not confirm within
                    // `peer_timeout` is treated as hung and cut off (its
                    // connection closes, its transfers to us fail), and the
                    // owner's pages move all the same.
                    for p in peers.iter().filter(|p| waiting.contains(&p.id)) {
                        p.live.store(false, Ordering::Release);
                        p.channel.shutdown();
                    }
                    tracing::warn!(
                        "shm deregister: {} initiator(s) did not confirm revoking rkey {} within {:?}; cut off",
                        waiting.len(),
                        lkey.0,
                        self.config.peer_timeout
                    );
                    return self.retire(lkey, removed);
                }
                self.regions.lock().unwrap_or_else(|p| p.into_inner()).insert(lkey.0, removed);
                return Err(TransportError::Timeout {
                    op: "deregister",
                    peer: format!("{} initiator(s)", waiting.len()),
                    timeout: self.config.peer_timeout,
                    detail: format!("no confirmation of revoking rkey {}; the region stays registered", lkey.0),
                });
            }
            got = self.acks.changed.wait_timeout(got, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn connection_info(&self) -> Vec<u8> {
        ShmInfo { boot_id: boot_id(), socket: self.socket_name.clone(), secret: (*self.secret).clone() }.encode()
    }

    /// Dial: prove the target's secret (from `info`), receive its regions
    /// and map the memfds (after checking their size and seals). The whole
    /// handshake is bounded by `peer_timeout`.
    fn dial(&mut self, peer_name: &str, info: &[u8], regions: &[RemoteRegion]) -> Result<Dial, TransportError> {
        let info = ShmInfo::decode(info)?;
        if info.boot_id != boot_id() {
            return Err(TransportError::Unsupported(format!(
                "peer {peer_name} runs on another host; the shm transport is same-host only (use verbs or tcp)"
            )));
        }
        let (owner, agent, peer, timeout) =
            (self.owner, self.agent.clone(), peer_name.to_string(), self.config.peer_timeout);
        let regions = regions.to_vec();
        Ok(Dial::new(peer_name, move || {
            let dialed = peer::handshake(&agent, &peer, &info, &regions, timeout)?;
            Ok(Dialed::new(owner, &peer, dialed))
        }))
    }

    /// Install: the peer's monitor thread starts.
    fn install(&mut self, dialed: Dialed) -> Result<PeerId, TransportError> {
        let (name, (channel, peer_regions)) =
            dialed.take::<(wire::Channel, HashMap<u32, copy::PeerRegion>)>(self.owner)?;
        let shared = Arc::new(PeerShared {
            name,
            channel,
            regions: peer_regions,
            dead: AtomicBool::new(false),
            outbox: copy::Outbox::new(self.config.peer_timeout)?,
        });
        let watched = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvwire-shm-monitor".into())
            .spawn(move || peer::peer_thread(&watched))
            .map_err(|e| TransportError::io("spawn", e))?;
        let id = self.next_peer;
        self.next_peer += 1;
        self.peers.insert(id, Connected { shared, thread: Some(thread) });
        Ok(PeerId(id))
    }

    /// Drop a peer: its thread is stopped and joined, its mappings go with
    /// the last transfer that refers to it.
    fn disconnect(&mut self, peer: PeerId) {
        if let Some(mut p) = self.peers.remove(&peer.0) {
            p.close();
        }
    }

    fn post(&mut self, req: PostRequest) -> Result<(), TransportError> {
        let peer = &self.peers.get(&req.peer.0).ok_or(TransportError::NotConnected(req.peer))?.shared;
        if peer.dead.load(Ordering::Acquire) {
            return Err(TransportError::PeerDisconnected(peer.name.clone()));
        }
        if req.notification.as_ref().is_some_and(|n| n.len() > wire::MAX_NOTIFICATION) {
            return Err(TransportError::Post(format!("notification larger than {} bytes", wire::MAX_NOTIFICATION)));
        }
        // The local check: the copy threads dereference `local_addr`, so
        // it must lie in memory we registered; the transfer keeps it alive.
        let local = {
            let table = self.regions.lock().unwrap_or_else(|p| p.into_inner());
            super::check_local(&req.segments, |k| table.get(&k).map(|r| (r.backing.desc(), r.backing.clone())))?
        };
        // The HCA-style check (every segment inside a region the target
        // reported, by key and bounds, before a single byte moves) and the
        // cut into chunks, in one pass over the segments.
        let copy::Plan { segments, chunks, bytes } = match copy::plan(peer, req.segments) {
            Ok(plan) => plan,
            Err(why) => {
                let core = XferState::new(req.xfer, req.op, None, 1);
                core.fail(why);
                let x = Arc::new(XferShared {
                    core,
                    peer: peer.clone(),
                    segments: Vec::new(),
                    chunks: std::iter::once(0..0).collect(),
                    next_chunk: AtomicUsize::new(0),
                    spare: None,
                    _local: local,
                });
                self.inflight.insert(x.clone());
                self.pool.submit(Job { xfer: x, done: self.inflight.sender() });
                return Ok(());
            }
        };
        let helpers = chunks.len().min(self.config.copy_threads.max(1));
        let x = Arc::new(XferShared {
            core: XferState::new(req.xfer, req.op, req.notification, chunks.len()),
            peer: peer.clone(),
            segments,
            next_chunk: AtomicUsize::new(0),
            chunks,
            spare: Some(self.spare.clone()),
            _local: local,
        });
        self.inflight.insert(x.clone());
        if bytes <= INLINE_BYTES {
            copy::run_job(Job { xfer: x, done: self.inflight.sender() });
        } else {
            self.pool.submit_helpers(Job { xfer: x, done: self.inflight.sender() }, helpers);
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        self.inflight.poll(out);
    }

    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) {
        self.inflight.wait(out, timeout);
    }

    fn completion_signal(&self) -> Option<super::CompletionSignal> {
        Some(self.inflight.signal())
    }

    fn cancel(&mut self, xfer: XferId) {
        self.inflight.cancel(xfer);
    }

    fn take_notifications(&mut self, out: &mut Vec<Notification>) {
        self.notifs.drain_into(out);
    }

    fn spare_segments(&mut self) -> Option<Vec<Segment>> {
        self.spare.take()
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.inflight.cancel_all();
        self.stopping.store(true, Ordering::Release);
        self.listener.shutdown();
        if let Some(h) = self.service.take() {
            let _ = h.join();
        }
        for p in self.peers.values_mut() {
            p.close();
        }
        // Close the channels of peers connected to us: they see us gone.
        for p in self.accepted.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            p.channel.shutdown();
        }
        // Registrations still in place end here: a peer that kept a memfd
        // must not keep reaching memory the owner goes on using.
        let regions: Vec<LocalRegion> =
            self.regions.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, r)| r).collect();
        for r in regions {
            let (addr, len) = (r.addr, r.len_bytes);
            if let Err((r, e)) = r.retire() {
                tracing::error!(
                    "shm: could not re-home {addr:#x}+{len} on drop ({e}); a peer that kept its mapping may still \
                     reach it"
                );
                drop(r);
            }
        }
    }
}
