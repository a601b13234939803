//! `shm`: one-sided READ/WRITE between processes on the same host.
//!
//! Each agent listens on an abstract `SOCK_SEQPACKET` Unix socket. A peer
//! that connects says hello and gets, per registered region, either the
//! region's memfd ([`HostBuffer`] memory) which it maps, so that a transfer is
//! one `memcpy` by the initiator's copy threads, or the target's pid for
//! cross-memory attach (`process_vm_readv/writev`) for any other memory.
//! The target's CPU copies nothing. Every segment is checked against the
//! region table the *target* reported (key and bounds), as an HCA checks an
//! rkey: a bad key or range fails the transfer before any byte moves.
//! Notifications travel on the socket after the data. A peer whose socket
//! closes (it died) fails its transfers; socket sends time out after
//! [`TransportConfig::peer_timeout`].

mod buffer;
mod copy;
pub mod wire;

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use buffer::HostBuffer;
pub use copy::stream_copy;
use copy::{CopyPool, Job, PeerMem, PeerRegion, PeerShared, XferShared};
use serde::{Deserialize, Serialize};
use wire::{Access, Channel, Listener, Msg};

use super::inflight::{InFlight, XferState};
use super::{
    Completion, LocalKey, MemoryBacking, Notification, PeerId, PostRequest, Registration, RemoteKey, RemoteRegion,
    Transport, TransportConfig, TransportError, TransportKind, XferId,
};

/// Bytes of work per copy job: large enough that queueing costs nothing,
/// small enough that two threads share a transfer.
const CHUNK_BYTES: u64 = 4 << 20;

/// Connection info published in the agent metadata.
#[derive(Debug, Serialize, Deserialize)]
struct ShmInfo {
    /// `/proc/sys/kernel/random/boot_id`: equal only on the same host.
    boot_id: String,
    /// Abstract socket name.
    socket: String,
}

struct LocalRegion {
    addr: u64,
    len_bytes: u64,
    fd: Option<(OwnedFd, u64)>,
}

type RegionTable = Arc<Mutex<HashMap<u32, LocalRegion>>>;
type NotifQueue = Arc<Mutex<Vec<Notification>>>;
/// An initiator connected to us.
struct AcceptedPeer {
    id: u64,
    channel: Channel,
    /// False once its connection ended (it can no longer access anything).
    live: AtomicBool,
}

/// The initiators connected to us (closed on drop).
type Accepted = Arc<Mutex<Vec<Arc<AcceptedPeer>>>>;

/// Revocation acknowledgements `(peer id, rkey)`, and a condvar to wait on.
#[derive(Default)]
struct Acks {
    got: Mutex<std::collections::HashSet<(u64, u32)>>,
    changed: std::sync::Condvar,
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
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
    peers: HashMap<u32, Arc<PeerShared>>,
    monitors: Vec<JoinHandle<()>>,
    next_peer: u32,
    inflight: InFlight<XferShared>,
    pool: CopyPool,
}

static SOCKET_SEQ: AtomicUsize = AtomicUsize::new(0);
static PTRACER_SET: AtomicU32 = AtomicU32::new(0);

impl ShmTransport {
    /// Create the backend for agent `agent` and start its listener.
    ///
    /// # Errors
    /// [`TransportError::Io`] when the socket cannot be bound.
    pub fn new(agent: &str, config: &TransportConfig) -> Result<Self, TransportError> {
        let socket_name = format!(
            "kvwire-shm-{}-{}-{}",
            std::process::id(),
            SOCKET_SEQ.fetch_add(1, Ordering::Relaxed),
            uuid::Uuid::new_v4().simple()
        );
        let listener = Arc::new(Listener::bind(&socket_name)?);
        let regions: RegionTable = Arc::default();
        let notifs: NotifQueue = Arc::default();
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
            };
            let (listener, stopping) = (listener.clone(), stopping.clone());
            std::thread::Builder::new()
                .name("kvwire-shm-listen".into())
                .spawn(move || accept_loop(&listener, &stopping, &shared))
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
            monitors: Vec::new(),
            next_peer: 1,
            inflight: InFlight::default(),
            pool: CopyPool::new(config.copy_threads).map_err(|e| TransportError::io("spawn", e))?,
        })
    }
}

/// What the listener and its per-peer threads share with the transport.
#[derive(Clone)]
struct Shared {
    regions: RegionTable,
    notifs: NotifQueue,
    accepted: Accepted,
    acks: Arc<Acks>,
    timeout: Duration,
}

fn accept_loop(listener: &Listener, stopping: &AtomicBool, shared: &Shared) {
    let mut next_id = 0u64;
    while let Ok(channel) = listener.accept() {
        if stopping.load(Ordering::Acquire) {
            break;
        }
        next_id += 1;
        let peer = Arc::new(AcceptedPeer { id: next_id, channel, live: AtomicBool::new(true) });
        let mut list = shared.accepted.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|p| p.live.load(Ordering::Acquire)); // forget peers that left
        list.push(peer.clone());
        drop(list);
        let shared = shared.clone();
        let spawned = std::thread::Builder::new().name("kvwire-shm-peer".into()).spawn(move || {
            serve_peer(&peer, &shared);
            peer.live.store(false, Ordering::Release);
            // A deregister waiting for this peer's acknowledgement stops waiting.
            shared.acks.changed.notify_all();
        });
        if let Err(e) = spawned {
            tracing::warn!("shm: cannot serve a peer: {e}");
        }
    }
}

fn serve_peer(peer: &AcceptedPeer, shared: &Shared) {
    let ch = &peer.channel;
    if ch.set_timeouts(shared.timeout).is_err() {
        return;
    }
    let agent = match ch.recv() {
        Ok(Some((Msg::Hello { agent, rkeys }, _))) => {
            if let Err(e) = answer_hello(ch, &shared.regions, &rkeys) {
                tracing::warn!("shm: hello from {agent} failed: {e}");
                return;
            }
            agent
        }
        Ok(Some((other, _))) => {
            tracing::warn!("shm: expected hello, got {other:?}; dropping connection");
            return;
        }
        Ok(None) => return,
        Err(e) => {
            tracing::warn!("shm: bad hello: {e}");
            return;
        }
    };
    let _ = ch.block_receives();
    loop {
        match ch.recv() {
            Ok(Some((Msg::Notify { payload }, _))) => {
                shared
                    .notifs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Notification { from_agent: agent.clone(), payload });
            }
            Ok(Some((Msg::RevokeAck { rkey }, _))) => {
                shared.acks.got.lock().unwrap_or_else(|p| p.into_inner()).insert((peer.id, rkey));
                shared.acks.changed.notify_all();
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

fn answer_hello(ch: &Channel, regions: &RegionTable, rkeys: &[u32]) -> Result<(), TransportError> {
    for &rkey in rkeys {
        let (msg, fd) = {
            let table = regions.lock().unwrap_or_else(|p| p.into_inner());
            match table.get(&rkey) {
                None => (Msg::Region { rkey, addr: 0, len_bytes: 0, access: Access::Unknown }, None),
                Some(r) => match &r.fd {
                    Some((fd, offset)) => (
                        Msg::Region {
                            rkey,
                            addr: r.addr,
                            len_bytes: r.len_bytes,
                            access: Access::Fd { offset: *offset },
                        },
                        Some(fd.as_raw_fd()),
                    ),
                    None => (Msg::Region { rkey, addr: r.addr, len_bytes: r.len_bytes, access: Access::Cma }, None),
                },
            }
        };
        // The fd stays open while we send: regions are only removed from the
        // table by deregister, and the kernel duplicates it in sendmsg. Hold
        // the table lock across the send instead if that ever changes.
        ch.send(&msg, fd)?;
    }
    ch.send(&Msg::Ready { pid: std::process::id() }, None)
}

fn map_region(fd: OwnedFd, offset: u64, len_bytes: u64) -> Result<PeerMem, TransportError> {
    let page = 4096u64;
    let aligned = offset / page * page;
    let delta = (offset - aligned) as usize;
    let file = std::fs::File::from(fd);
    let map = memmap2::MmapOptions::new()
        .offset(aligned)
        .len(len_bytes as usize + delta)
        .map_raw(&file)
        .map_err(|e| TransportError::io("mmap(peer region)", e))?;
    let base = map.as_ptr() as usize + delta;
    Ok(PeerMem::Mapped { base, _map: Arc::new(map) })
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn register(&mut self, backing: &dyn MemoryBacking) -> Result<Registration, TransportError> {
        let desc = backing.desc();
        if desc.kind != super::MemoryKind::Dram {
            return Err(TransportError::Unsupported("the shm transport moves host (DRAM) memory only".into()));
        }
        let fd = match backing.shared_fd() {
            Some((fd, off)) => Some((fd.try_clone_to_owned().map_err(|e| TransportError::io("dup", e))?, off)),
            None => {
                if PTRACER_SET.swap(1, Ordering::AcqRel) == 0 {
                    // Let same-uid peers attach under Yama ptrace_scope=1.
                    // SAFETY: prctl with integer arguments; no memory is passed.
                    unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
                }
                None
            }
        };
        let key = self.next_key;
        self.next_key += 1;
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, LocalRegion { addr: desc.addr, len_bytes: desc.len_bytes, fd });
        Ok(Registration { lkey: LocalKey(key), rkey: RemoteKey(key) })
    }

    /// Forget a registration. Every connected initiator is told to revoke
    /// the key and must acknowledge that no access is in progress and none
    /// will start; only then does this return, as `ibv_dereg_mr` does (the
    /// caller may free the memory afterwards).
    ///
    /// # Errors
    /// [`TransportError::UnknownLocalKey`]; [`TransportError::Connect`] when
    /// a live initiator does not acknowledge within `peer_timeout` — the
    /// registration then stays in place (deregister may be retried).
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
            .filter(|p| p.live.load(Ordering::Acquire))
            .cloned()
            .collect();
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
                return Ok(());
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                got.retain(|(_, k)| *k != lkey.0);
                drop(got);
                self.regions.lock().unwrap_or_else(|p| p.into_inner()).insert(lkey.0, removed);
                return Err(TransportError::Connect {
                    peer: format!("{} initiator(s)", waiting.len()),
                    reason: format!(
                        "did not confirm revoking rkey {} within {:?}; the region stays registered",
                        lkey.0, self.config.peer_timeout
                    ),
                });
            }
            got = self.acks.changed.wait_timeout(got, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn connection_info(&self) -> Vec<u8> {
        postcard::to_allocvec(&ShmInfo { boot_id: boot_id(), socket: self.socket_name.clone() })
            .expect("plain data encodes")
    }

    fn connect(&mut self, peer_name: &str, info: &[u8], regions: &[RemoteRegion]) -> Result<PeerId, TransportError> {
        let info: ShmInfo = postcard::from_bytes(info).map_err(|e| TransportError::BadConnectionInfo(e.to_string()))?;
        if info.boot_id != boot_id() {
            return Err(TransportError::Unsupported(format!(
                "peer {peer_name} runs on another host; the shm transport is same-host only (use verbs or tcp)"
            )));
        }
        let cerr = |reason: String| TransportError::Connect { peer: peer_name.to_string(), reason };
        let ch = Channel::connect(&info.socket, self.config.peer_timeout).map_err(|e| cerr(e.to_string()))?;
        let rkeys: Vec<u32> = regions.iter().map(|r| r.rkey.0).collect();
        ch.send(&Msg::Hello { agent: self.agent.clone(), rkeys }, None).map_err(|e| cerr(e.to_string()))?;
        let mut table = HashMap::new();
        let mut fds = HashMap::new();
        let mut revoked_early = Vec::new();
        let pid = loop {
            match ch.recv().map_err(|e| cerr(e.to_string()))? {
                None => return Err(cerr("peer closed the connection during the handshake".into())),
                Some((Msg::Region { rkey, addr, len_bytes, access }, fd)) => {
                    if access == Access::Unknown {
                        return Err(cerr(format!("peer has no region with rkey {rkey} (stale metadata?)")));
                    }
                    if let (Access::Fd { offset }, Some(fd)) = (access, fd) {
                        fds.insert(rkey, (fd, offset));
                    }
                    table.insert(rkey, (addr, len_bytes));
                }
                Some((Msg::Ready { pid }, _)) => break pid as i32,
                Some((Msg::Revoke { rkey }, _)) => {
                    // Deregistered while we were connecting: never use it.
                    revoked_early.push(rkey);
                    ch.send(&Msg::RevokeAck { rkey }, None).map_err(|e| cerr(e.to_string()))?;
                }
                Some((other, _)) => return Err(cerr(format!("unexpected handshake message {other:?}"))),
            }
        };
        let mut peer_regions = HashMap::with_capacity(table.len());
        for (rkey, (addr, len_bytes)) in table {
            let mem = match fds.remove(&rkey) {
                Some((fd, offset)) => map_region(fd, offset, len_bytes)?,
                None => PeerMem::Cma { pid },
            };
            let revoked = AtomicBool::new(revoked_early.contains(&rkey));
            peer_regions.insert(rkey, PeerRegion { addr, len_bytes, mem, revoked, active: AtomicUsize::new(0) });
        }
        let peer = Arc::new(PeerShared {
            name: peer_name.to_string(),
            channel: ch,
            regions: peer_regions,
            dead: AtomicBool::new(false),
        });
        // After `Ready` the target only sends revocations; an end of stream
        // or an error means it closed the socket (died or disconnected).
        let _ = peer.channel.block_receives();
        let watched = peer.clone();
        let monitor = std::thread::Builder::new()
            .name("kvwire-shm-monitor".into())
            .spawn(move || {
                loop {
                    match watched.channel.recv() {
                        Ok(Some((Msg::Revoke { rkey }, _))) => {
                            if let Some(r) = watched.regions.get(&rkey) {
                                r.revoke();
                            }
                            let _ = watched.channel.send(&Msg::RevokeAck { rkey }, None);
                        }
                        Ok(Some((other, _))) => tracing::warn!("shm: unexpected message {other:?}"),
                        Ok(None) | Err(_) => break,
                    }
                }
                watched.dead.store(true, Ordering::Release);
            })
            .map_err(|e| TransportError::io("spawn", e))?;
        self.monitors.push(monitor);
        let id = self.next_peer;
        self.next_peer += 1;
        self.peers.insert(id, peer);
        Ok(PeerId(id))
    }

    fn disconnect(&mut self, peer: PeerId) {
        if let Some(p) = self.peers.remove(&peer.0) {
            p.dead.store(true, Ordering::Release);
            p.channel.shutdown();
        }
    }

    fn post(&mut self, req: PostRequest) -> Result<(), TransportError> {
        let peer = self.peers.get(&req.peer.0).ok_or(TransportError::NotConnected(req.peer))?;
        if peer.dead.load(Ordering::Acquire) {
            return Err(TransportError::PeerDisconnected(peer.name.clone()));
        }
        if req.notification.as_ref().is_some_and(|n| n.len() > wire::MAX_NOTIFICATION) {
            return Err(TransportError::Post(format!("notification larger than {} bytes", wire::MAX_NOTIFICATION)));
        }
        // The HCA-style check (every segment inside a region the target
        // reported, by key and bounds, before a single byte moves) and the
        // cut into chunks, in one pass over the segments.
        let (segments, chunks, violation) = match copy::plan(peer, req.segments) {
            Ok((segments, chunks)) => (segments, chunks, None),
            Err(why) => (Vec::new(), Vec::new(), Some(why)),
        };
        if let Some(why) = violation {
            let core = XferState::new(req.xfer, req.op, None, 1);
            core.fail(why);
            let x = Arc::new(XferShared {
                core,
                peer: peer.clone(),
                segments: Vec::new(),
                chunks: std::iter::once(0..0).collect(),
                next_chunk: AtomicUsize::new(0),
            });
            self.inflight.insert(x.clone());
            self.pool.submit(Job { xfer: x, done: self.inflight.sender() });
            return Ok(());
        }
        let helpers = chunks.len().min(self.config.copy_threads.max(1));
        let x = Arc::new(XferShared {
            core: XferState::new(req.xfer, req.op, req.notification, chunks.len()),
            peer: peer.clone(),
            segments,
            next_chunk: AtomicUsize::new(0),
            chunks,
        });
        self.inflight.insert(x.clone());
        self.pool.submit_helpers(Job { xfer: x, done: self.inflight.sender() }, helpers);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        self.inflight.poll(out);
    }

    fn cancel(&mut self, xfer: XferId) {
        self.inflight.cancel(xfer);
    }

    fn take_notifications(&mut self, out: &mut Vec<Notification>) {
        let mut q = self.notifs.lock().unwrap_or_else(|p| p.into_inner());
        out.append(&mut q);
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
        for p in self.peers.values() {
            p.channel.shutdown();
        }
        // Close the channels of peers connected to us: they see us gone.
        for p in self.accepted.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            p.channel.shutdown();
        }
        for m in self.monitors.drain(..) {
            let _ = m.join();
        }
    }
}
