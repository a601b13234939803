//! `tcp`: one-sided READ/WRITE over TCP sockets, for hosts without RDMA.
//!
//! Each agent listens on a TCP port ([`TransportConfig`] option
//! `listen=IP:PORT`, else the `KVWIRE_TCP_LISTEN` environment variable, else
//! `0.0.0.0:0` — or `127.0.0.1:0` on a host with no non-loopback address)
//! and publishes the address peers connect to in its
//! connection info ([`TcpConnectionInfo`]): option `advertise=IP[:PORT]`,
//! else the listen address, else — listening on `0.0.0.0`/`::` — the address
//! of the interface that routes to the default gateway, else the first
//! non-loopback address of an interface that is up ([`reachable_ip`]).
//! Loopback is advertised only when the listener listens only there; with no
//! reachable address creation fails, naming the fix.
//!
//! Every connection is authenticated: the transport draws an
//! [`AgentSecret`] at creation and publishes it in the connection info (the
//! agent metadata is the trust channel); the target sends a nonce on each
//! new connection and serves nothing until the initiator answers
//! [`auth::prove`] (wire v2, [`wire`]). A service thread per accepted
//! connection then answers requests against registered regions only
//! (`service.rs`): a bad key or range is refused with a typed status and
//! logged, nothing is accessed, and the initiator's transfer turns `Failed`
//! with [`FailureKind::RemoteAccess`](super::FailureKind) `UnknownKey`,
//! `OutOfBounds` or `Denied`.
//!
//! An initiator opens `conns_per_peer` connections to each peer (option,
//! default [`default_conns_per_peer`]: half the cores, 2..=8) with one worker thread each
//! (`worker.rs`). A posted transfer is cut into chunks of at most
//! [`CHUNK_BYTES`] and [`wire::MAX_SEGMENTS`] segments, streamed with
//! `sendmsg` (gathering, no SIGPIPE)/`readv` straight from/to registered memory. The notification
//! follows once every chunk is acknowledged. Sockets carry send and receive
//! timeouts of [`TransportConfig::peer_timeout`]: a dead peer (closed or
//! reset connection) or a silent one (no progress for that long) fails every
//! transfer to it, and later posts to it fail at once: `post` also checks
//! the peer's connections without blocking (a peer whose connections were
//! closed is dead) and refuses with [`TransportError::PeerDisconnected`].
//! A post with no segments moves nothing and delivers only its
//! notification (at most [`super::MAX_NOTIFICATION_BYTES`]).
//!
//! The wire format is in [`wire`]; every length is bounded.

mod io;
mod service;
pub mod wire;
mod worker;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use serde::{Deserialize, Serialize};
use service::{LocalRegion, NotifQueue, RegionTable, Service};
use worker::{Job, PeerShared, XferShared};

use super::auth::{self, AgentSecret, Nonce};
use super::inflight::{InFlight, XferState};
use super::{
    Completion, Dial, Dialed, LocalKey, MAX_NOTIFICATION_BYTES, MemoryBacking, MemoryKind, Notification, OptionSet,
    PeerId, PostRequest, Registration, RemoteKey, RemoteRegion, Segment, TransferFailure, Transport, TransportConfig,
    TransportError, TransportKind, XferId,
};

pub use crate::accept::DEFAULT_MAX_PREAUTH;

/// The fewest connections per peer by default: the default on hosts of up
/// to 5 cores ([`default_conns_per_peer`]). Measured on the 2-core
/// reference machine (docs/TCP.md): 2 connections beat 1 at every page
/// size; more only add threads.
pub const DEFAULT_CONNS_PER_PEER: usize = 2;
/// The most connections per peer by default, from 16 cores up
/// ([`default_conns_per_peer`]).
pub const DEFAULT_CONNS_PER_PEER_MAX: usize = 8;

/// Connections per peer unless option `conns_per_peer` says otherwise: half
/// the cores this process may run on (`available_parallelism`, which counts
/// its CPU affinity and cgroup quota), clamped to
/// [`DEFAULT_CONNS_PER_PEER`]..=[`DEFAULT_CONNS_PER_PEER_MAX`]. Each
/// connection is one worker thread here and one serving thread on the
/// target, and a TCP stream carries what about one core copies: on a
/// 16-core host a plain stream moved 4.9 / 9.2 / 16.4 / 28.9 GB/s over
/// 1 / 2 / 4 / 8 connections (docs/TCP.md, "Connections per peer").
pub fn default_conns_per_peer() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (cores / 2).clamp(DEFAULT_CONNS_PER_PEER, DEFAULT_CONNS_PER_PEER_MAX)
}
/// Largest chunk of a transfer carried by one request (bytes).
pub const CHUNK_BYTES: u64 = 4 << 20;
/// Most connections per peer accepted from the option.
pub const MAX_CONNS_PER_PEER: usize = 64;
/// How often a redial's pending TCP connect looks whether its transfer was
/// cancelled or its peer closed (the longest a cancel or disconnect waits
/// on one).
const CONNECT_SLICE: Duration = Duration::from_millis(50);
/// How long a cancel lets a WRITE's chunk on the wire go on with its peer's
/// TCP acknowledging no byte before it cuts the connection (at most
/// `peer_timeout`): a live target acknowledges within it, a stopped one is
/// cut after it (so is a reader too slow to drain its receive buffer in it:
/// docs/TCP.md, "cancel").
const CUT_GRACE: Duration = Duration::from_millis(500);

/// Connection info published in the agent metadata (postcard-encoded).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TcpConnectionInfo {
    /// Wire protocol version the agent speaks.
    pub version: u16,
    /// Address peers connect to (`IP:PORT`).
    pub addr: String,
    /// The secret a connecting peer must prove it knows.
    pub secret: AgentSecret,
}

impl TcpConnectionInfo {
    /// Decode what [`Transport::connection_info`] of a tcp agent returned.
    ///
    /// # Errors
    /// [`TransportError::BadConnectionInfo`].
    pub fn decode(info: &[u8]) -> Result<Self, TransportError> {
        postcard::from_bytes(info).map_err(|e| TransportError::BadConnectionInfo(format!("tcp: {e}")))
    }

    /// The bytes [`Transport::connection_info`] publishes.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("plain data encodes")
    }
}

/// An address of this host that a peer on another host can reach, for a
/// listener bound to the unspecified address of `family` (`0.0.0.0`/`::`):
/// the source address the kernel picks towards a public destination (the
/// interface of the default route; no packet is sent), else the first
/// non-loopback address of an interface that is up. `None` when the host
/// has only loopback.
///
/// Found once per process and family, then cached: the interface scan costs
/// time proportional to the host's interfaces (4 ms with 250 in a network
/// namespace), and agent start-up must not pay it again per agent (issue 29;
/// ai-dynamo/nixl#1668's 23 s on a host with 220 interfaces).
pub fn reachable_ip(v6: bool) -> Option<IpAddr> {
    static V4: std::sync::OnceLock<Option<IpAddr>> = std::sync::OnceLock::new();
    static V6: std::sync::OnceLock<Option<IpAddr>> = std::sync::OnceLock::new();
    *(if v6 { &V6 } else { &V4 }).get_or_init(|| find_reachable_ip(v6))
}

fn find_reachable_ip(v6: bool) -> Option<IpAddr> {
    let (bind, probe) = if v6 { ("[::]:0", "[2001:db8::1]:9") } else { ("0.0.0.0:0", "192.0.2.1:9") };
    let routed = UdpSocket::bind(bind)
        .and_then(|s| s.connect(probe).and_then(|()| s.local_addr()))
        .ok()
        .map(|a| a.ip())
        .filter(|ip| !ip.is_loopback() && !ip.is_unspecified());
    routed.or_else(|| {
        let addrs = nix::ifaddrs::getifaddrs().ok()?;
        addrs
            .filter(|i| {
                i.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP)
                    && !i.flags.contains(nix::net::if_::InterfaceFlags::IFF_LOOPBACK)
            })
            .filter_map(|i| {
                let a = i.address?;
                if v6 {
                    a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip()))
                } else {
                    a.as_sockaddr_in().map(|s| IpAddr::V4(s.ip()))
                }
            })
            .find(|ip| !ip.is_loopback() && !ip.is_unspecified() && !is_link_local(ip))
    })
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => (a.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// The address to publish for a listener bound to `local`, given option
/// `advertise` (`IP` or `IP:PORT`; a bare IP takes the listener's port).
fn advertised(local: SocketAddr, advertise: Option<&str>, opts: &OptionSet<'_>) -> Result<String, TransportError> {
    if let Some(a) = advertise {
        if let Ok(ip) = a.trim().parse::<IpAddr>() {
            return Ok(SocketAddr::new(ip, local.port()).to_string());
        }
        let ok = a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0));
        if !ok {
            return Err(opts.invalid("advertise", a, Some("needs a host and a nonzero port")));
        }
        return Ok(a.trim().to_string());
    }
    if !local.ip().is_unspecified() {
        return Ok(local.to_string());
    }
    match reachable_ip(local.is_ipv6()) {
        Some(ip) => Ok(SocketAddr::new(ip, local.port()).to_string()),
        None => Err(TransportError::InvalidConfig(format!(
            "tcp listens on {local} but this host has no non-loopback address a peer could reach; \
             listen on 127.0.0.1 for one host, or set option advertise=IP"
        ))),
    }
}

struct PeerConn {
    shared: Arc<PeerShared>,
    jobs: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

impl PeerConn {
    fn close(&mut self) {
        self.shared.kill(TransferFailure::peer_died(format!("peer {} disconnected", self.shared.name)));
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The TCP backend. See the module docs.
pub struct TcpTransport {
    agent: String,
    config: TransportConfig,
    conns_per_peer: usize,
    advertise: String,
    secret: AgentSecret,
    regions: RegionTable,
    next_key: u32,
    notifs: NotifQueue,
    service: Option<Service>,
    peers: HashMap<u32, PeerConn>,
    next_peer: u32,
    inflight: InFlight<XferShared>,
    /// Random, nonzero: sent (covered by the proof) in each hello so that a target lets
    /// only this transport's connections use our name while they live.
    session: u64,
    /// Per target (its secret, drawn per transport, names it whatever
    /// address reaches it): connections cut with a request
    /// on the way and not yet fenced, shared by every connect to it, so a
    /// `disconnect` + `connect` fences what the old peer cut
    /// ([`worker::FenceList`]). Pruned at each connect.
    fences: HashMap<AgentSecret, Arc<worker::FenceList>>,
    /// This transport in the connections it dials ([`Dialed`]).
    owner: u64,
}

/// Most targets whose fence lists are kept for a later connect (the
/// emptied ones and those of connected peers are not counted).
const MAX_FENCE_TARGETS: usize = 1024;

/// A target refused our hello because our agent name is connected there
/// under another session (carried inside an `io::Error`).
#[derive(Debug)]
struct NameInUse(String);

impl std::fmt::Display for NameInUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NameInUse {}

impl TcpTransport {
    /// Create the backend for agent `agent`: check the configuration, bind
    /// the listener, draw the agent secret and start the service thread.
    ///
    /// # Errors
    /// [`TransportError::InvalidConfig`] for a bad shared setting
    /// ([`TransportConfig::validate`]) or a listener on `0.0.0.0` with no
    /// reachable address to advertise; [`TransportError::InvalidOption`]
    /// for an unknown option or a bad `listen`, `advertise` or
    /// `conns_per_peer`; [`TransportError::Io`] when the socket cannot be
    /// bound; [`TransportError::Unsupported`] without OS randomness.
    pub fn new(agent: &str, config: &TransportConfig) -> Result<Self, TransportError> {
        config.validate()?;
        let opts = OptionSet::parse(TransportKind::Tcp, config)?;
        let conns_per_peer =
            opts.get_checked("conns_per_peer", default_conns_per_peer(), |n| (1..=MAX_CONNS_PER_PEER).contains(n))?;
        let env_listen = std::env::var("KVWIRE_TCP_LISTEN").ok();
        let listen_addr: SocketAddr = match opts.raw("listen").or(env_listen.as_deref()) {
            Some(listen) => listen.trim().parse().map_err(|_| {
                let from_env = opts.raw("listen").is_none();
                opts.invalid("listen", listen, from_env.then_some("from $KVWIRE_TCP_LISTEN"))
            })?,
            // Cross-host by default: every interface, advertising the
            // reachable one; loopback only on a host that has nothing else.
            None if reachable_ip(false).is_some() => SocketAddr::from(([0, 0, 0, 0], 0)),
            None => SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let listener = TcpListener::bind(listen_addr).map_err(|e| TransportError::io("bind", e))?;
        let local = listener.local_addr().map_err(|e| TransportError::io("getsockname", e))?;
        let advertise = advertised(local, opts.raw("advertise"), &opts)?;
        let secret = AgentSecret::random()?;
        let regions: RegionTable = Arc::default();
        let notifs: NotifQueue = Arc::new(super::notify::NotifQueue::new(
            TransportKind::Tcp,
            super::notify::NotifBounds::from_options(&opts)?,
        ));
        let max_preauth = opts.get_checked("max_preauth", DEFAULT_MAX_PREAUTH, |n| *n >= 1)?;
        let service = Service::start(
            listener,
            secret.clone(),
            regions.clone(),
            notifs.clone(),
            config.peer_timeout,
            max_preauth,
            crate::metrics::global()
                .link_counters(&TransportKind::Tcp.to_string(), &config.nic_label(TransportKind::Tcp)),
        )?;
        Ok(Self {
            agent: agent.to_string(),
            config: config.clone(),
            conns_per_peer,
            advertise,
            secret,
            regions,
            next_key: 1,
            notifs,
            service: Some(service),
            peers: HashMap::new(),
            next_peer: 1,
            inflight: InFlight::default(),
            session: {
                let mut b = [0u8; 8];
                getrandom::fill(&mut b).map_err(|e| TransportError::Unsupported(format!("no OS randomness: {e}")))?;
                u64::from_le_bytes(b).max(1)
            },
            fences: HashMap::new(),
            owner: super::next_owner(),
        })
    }

    /// The address peers connect to.
    pub fn listen_addr(&self) -> &str {
        &self.advertise
    }

    /// Connections opened to each peer.
    pub fn conns_per_peer(&self) -> usize {
        self.conns_per_peer
    }
}

/// What an initiator needs to open (and, after a cancel cut one, open
/// again) an authenticated connection to a peer: our agent name and
/// session, the peer's address and secret, and the timeout.
pub(super) struct Dialer {
    agent: String,
    session: u64,
    timeout: Duration,
    addr: SocketAddr,
    secret: AgentSecret,
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialer").field("agent", &self.agent).field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Dialer {
    /// A TCP connection to the peer, with the socket timeouts set; no byte
    /// exchanged yet (a caller may publish a clone, so that a shutdown
    /// wakes the [`Dialer::handshake`] that follows).
    ///
    /// The TCP handshake is waited for in slices of [`CONNECT_SLICE`], up
    /// to the peer timeout in all: `stop` is asked before each, and when it
    /// answers true the attempt is abandoned with
    /// [`ErrorKind::Interrupted`](std::io::ErrorKind::Interrupted), so that
    /// a cancel or a disconnect never waits on a peer whose listener does
    /// not complete handshakes (accept queue full, SYNs dropped). A peer
    /// silent past the timeout gives
    /// [`ErrorKind::TimedOut`](std::io::ErrorKind::TimedOut), as
    /// `TcpStream::connect_timeout`.
    pub(super) fn connect(&self, stop: impl Fn() -> bool) -> std::io::Result<TcpStream> {
        use nix::errno::Errno;
        use nix::poll::{PollFd, PollFlags, poll};
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrStorage, getsockopt, socket, sockopt};
        use std::os::fd::{AsFd, AsRawFd};
        let family = if self.addr.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
        let fd = socket(family, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
        match nix::sys::socket::connect(fd.as_raw_fd(), &SockaddrStorage::from(self.addr)) {
            Ok(()) => {}
            Err(Errno::EINPROGRESS) => {
                let deadline = std::time::Instant::now() + self.timeout;
                loop {
                    if stop() {
                        return Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "connect abandoned"));
                    }
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connection timed out"));
                    }
                    let slice_ms = left.min(CONNECT_SLICE).as_millis().clamp(1, u16::MAX.into()) as u16;
                    match poll(&mut [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)], slice_ms) {
                        Ok(0) | Err(Errno::EINTR) => {}
                        Ok(_) => break,
                        Err(e) => return Err(e.into()),
                    }
                }
                match getsockopt(&fd, sockopt::SocketError)? {
                    0 => {}
                    e => return Err(std::io::Error::from_raw_os_error(e)),
                }
            }
            Err(e) => return Err(e.into()),
        }
        let sock = TcpStream::from(fd);
        sock.set_nonblocking(false)?;
        sock.set_nodelay(true)?;
        sock.set_read_timeout(Some(self.timeout))?;
        sock.set_write_timeout(Some(self.timeout))?;
        Ok(sock)
    }

    /// Make `sock` connection `index`: answer the peer's challenge with a
    /// proof of its secret and wait for its acknowledgement, which must
    /// prove the same secret back over our own nonce (wire v3): a process
    /// that took over the peer's address (it died, another user bound the
    /// port) is refused before any request goes to it.
    ///
    /// `generation` ([`next_generation`]) tells the target which opening of
    /// connection `index` this is, so that a FENCE can name the ones a
    /// cancel cut.
    pub(super) fn handshake(&self, sock: &TcpStream, index: usize, generation: u64) -> std::io::Result<()> {
        let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
        let mut b = [0u8; wire::HEADER_BYTES];
        io::read_exact(sock, &mut b)?;
        let ch = wire::Header::decode(&b).map_err(|e| bad(e.to_string()))?;
        if ch.kind != wire::Kind::Challenge {
            return Err(bad(format!("expected a challenge, got {:?}", ch.kind)));
        }
        let mut nonce = Nonce([0; auth::NONCE_BYTES]);
        io::read_exact(sock, &mut nonce.0)?;
        let name = self.agent.as_bytes();
        let mut name = name[..name.len().min(wire::MAX_NAME_BYTES as usize)].to_vec();
        name.push(0);
        name.extend_from_slice(&self.session.to_le_bytes());
        let name = &name[..];
        let ours = Nonce::random().map_err(std::io::Error::other)?;
        let h = wire::Header {
            kind: wire::Kind::Hello,
            count: name.len() as u32,
            id: wire::MAGIC_VERSION,
            len: wire::hello_slot(index as u64, generation),
        };
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(name);
        frame.extend_from_slice(&auth::prove(&self.secret, &nonce, &wire::proof_context(name)));
        frame.extend_from_slice(&ours.0);
        std::io::Write::write_all(&mut &*sock, &frame)?;
        io::read_exact(sock, &mut b)?;
        match wire::Header::decode(&b) {
            Ok(a) if a.kind == wire::Kind::HelloAck => {
                let mut proof = [0u8; wire::PROOF_BYTES];
                io::read_exact(sock, &mut proof)?;
                if auth::verify(&self.secret, &ours, &wire::ack_context(name, &nonce), &proof) {
                    Ok(())
                } else {
                    Err(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        "refused (Impostor): the target did not prove the agent secret of its metadata \
                         (another process on its address?); no request was sent to it",
                    ))
                }
            }
            Ok(a) if a.kind == wire::Kind::Resp => {
                let mut reason = vec![0u8; a.body_bytes()];
                io::read_exact(sock, &mut reason)?;
                if a.status() == wire::Status::NameInUse {
                    let why = NameInUse(String::from_utf8_lossy(&reason).into_owned());
                    return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, why));
                }
                Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("refused ({:?}): {}", a.status(), String::from_utf8_lossy(&reason)),
                ))
            }
            Ok(a) => Err(bad(format!("expected a hello ack, got {:?}", a.kind))),
            Err(e) => Err(bad(e.to_string())),
        }
    }

    /// [`Dialer::connect`] then [`Dialer::handshake`]; the connection and
    /// its generation.
    fn open(&self, index: usize) -> std::io::Result<(TcpStream, u64)> {
        let sock = self.connect(|| false)?;
        let generation = next_generation();
        self.handshake(&sock, index, generation)?;
        Ok((sock, generation))
    }
}

/// A new connection generation: one process-wide counter, so a redial's
/// generation is larger than that of every connection it replaces, also
/// across a `disconnect` + `connect` of the same name (wire v4 hello, FENCE).
pub(super) fn next_generation() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Split segments so each chunk stays within [`CHUNK_BYTES`] and
/// [`wire::MAX_SEGMENTS`]; returns the segments and the chunk ranges.
fn plan_chunks(segments: Vec<Segment>) -> (Vec<Segment>, Vec<std::ops::Range<usize>>) {
    use crate::transport::split::{Fill, group, split_all};
    let out = split_all(segments, CHUNK_BYTES);
    let ranges = group(&out, Fill::AtMost { bytes: CHUNK_BYTES, segments: wire::MAX_SEGMENTS as usize });
    (out, ranges)
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn register(&mut self, backing: Arc<dyn MemoryBacking>) -> Result<Registration, TransportError> {
        let desc = backing.desc();
        if desc.kind != MemoryKind::Dram {
            return Err(TransportError::Unsupported("the tcp transport moves host (DRAM) memory only".into()));
        }
        let key = self.next_key;
        self.next_key += 1;
        self.regions.write().unwrap_or_else(|p| p.into_inner()).insert(key, Arc::new(LocalRegion::new(backing)));
        Ok(Registration { lkey: LocalKey(key), rkey: RemoteKey(key) })
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), TransportError> {
        // Out of the table first (new requests then fail with UnknownKey),
        // then wait for the requests inside the region: bounded by their
        // deadline (`service::request_limit`), never by a peer's pace.
        let region = self
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&lkey.0)
            .ok_or(TransportError::UnknownLocalKey(lkey))?;
        region.wait_idle();
        Ok(())
    }

    fn connection_info(&self) -> Vec<u8> {
        TcpConnectionInfo { version: wire::PROTOCOL_VERSION, addr: self.advertise.clone(), secret: self.secret.clone() }
            .encode()
    }

    /// Dial: resolve the peer's address and open `conns_per_peer`
    /// connections, each with its proven hello (bounded by `peer_timeout`).
    fn dial(&mut self, peer_name: &str, info: &[u8], _regions: &[RemoteRegion]) -> Result<Dial, TransportError> {
        let info = TcpConnectionInfo::decode(info)?;
        let cerr = |peer: &str, reason: String| TransportError::Connect { peer: peer.to_string(), reason };
        if info.version != wire::PROTOCOL_VERSION {
            return Err(cerr(
                peer_name,
                format!("peer speaks tcp wire version {}, we speak {}", info.version, wire::PROTOCOL_VERSION),
            ));
        }
        let (owner, agent, session, conns) = (self.owner, self.agent.clone(), self.session, self.conns_per_peer);
        let timeout = self.config.peer_timeout;
        let peer = peer_name.to_string();
        Ok(Dial::new(peer_name, move || {
            let addr = info
                .addr
                .to_socket_addrs()
                .map_err(|e| TransportError::BadConnectionInfo(format!("{}: {e}", info.addr)))?
                .next()
                .ok_or_else(|| TransportError::BadConnectionInfo(format!("{} resolves to nothing", info.addr)))?;
            let dialer = Dialer { agent, session, timeout, addr, secret: info.secret.clone() };
            let mut socks = Vec::with_capacity(conns);
            for i in 0..conns {
                socks.push(dialer.open(i).map_err(|e| {
                    if e.get_ref().is_some_and(|r| r.is::<NameInUse>()) {
                        TransportError::NameInUse { peer: peer.clone(), name: dialer.agent.clone() }
                    } else if TransportError::is_timeout_io(&e) {
                        TransportError::connect_timeout(&peer, timeout, format!("{addr}: {e}"))
                    } else {
                        cerr(&peer, format!("{addr}: {e}"))
                    }
                })?);
            }
            Ok(Dialed::new(owner, &peer, (dialer, socks)))
        }))
    }

    /// Install: the peer's worker threads start, one per connection.
    fn install(&mut self, dialed: Dialed) -> Result<PeerId, TransportError> {
        let (peer_name, (dialer, socks)) = dialed.take::<(Dialer, Vec<(TcpStream, u64)>)>(self.owner)?;
        let slots = socks
            .iter()
            .map(|(s, generation)| s.try_clone().map(|s| worker::Slot::new(s, *generation)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TransportError::io("dup", e))?;
        let fences = self.fence_list(&dialer.secret);
        let shared = Arc::new(PeerShared::new(&peer_name, slots, dialer, fences));
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut workers = Vec::with_capacity(socks.len());
        for (i, (sock, _)) in socks.into_iter().enumerate() {
            let (rx, done, peer) = (rx.clone(), self.inflight.sender(), shared.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("kvwire-tcp-{i}"))
                .spawn(move || worker::run(sock, i, peer, rx, done))
                .map_err(|e| TransportError::io("spawn", e));
            match spawned {
                Ok(h) => workers.push(h),
                Err(e) => {
                    PeerConn { shared, jobs: Some(tx), workers }.close();
                    return Err(e);
                }
            }
        }
        let id = self.next_peer;
        self.next_peer += 1;
        self.peers.insert(id, PeerConn { shared, jobs: Some(tx), workers });
        Ok(PeerId(id))
    }

    fn disconnect(&mut self, peer: PeerId) {
        if let Some(mut p) = self.peers.remove(&peer.0) {
            p.close();
        }
    }

    fn post(&mut self, req: PostRequest) -> Result<(), TransportError> {
        let peer = self.peers.get(&req.peer.0).ok_or(TransportError::NotConnected(req.peer))?;
        if !peer.shared.dead.load(Ordering::Acquire)
            && let Some(why) = peer.shared.probe()
        {
            peer.shared.kill(why);
        }
        if peer.shared.dead.load(Ordering::Acquire) {
            return Err(TransportError::PeerDisconnected(format!(
                "{} ({})",
                peer.shared.name,
                peer.shared.failure().kind
            )));
        }
        if req.notification.as_ref().is_some_and(|n| n.len() > MAX_NOTIFICATION_BYTES) {
            return Err(TransportError::Post(format!("notification larger than {MAX_NOTIFICATION_BYTES} bytes")));
        }
        let Some(jobs) = &peer.jobs else {
            return Err(TransportError::NotConnected(req.peer));
        };
        // The local check: the workers dereference `local_addr`, so it must
        // lie in memory we registered; the transfer keeps it alive.
        let local = {
            let table = self.regions.read().unwrap_or_else(|p| p.into_inner());
            super::check_local(&req.segments, |k| table.get(&k).map(|r| (r.backing.desc(), r.backing.clone())))?
        };
        let (segments, ranges) = plan_chunks(req.segments);
        let x = Arc::new(XferShared {
            core: XferState::new(req.xfer, req.op, req.notification, ranges.len().max(1)),
            peer: peer.shared.clone(),
            segments,
            _local: local,
        });
        self.inflight.insert(x.clone());
        if ranges.is_empty() {
            let _ = jobs.send(Job { xfer: x.clone(), range: 0..0 });
        }
        for range in ranges {
            let _ = jobs.send(Job { xfer: x.clone(), range });
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
        // Chunks still queued (behind other transfers' on the same
        // connections) are skipped whenever a worker reaches them: nothing
        // waits for them. A chunk on the wire is cut: its connection is
        // shut down, which ends the worker's syscall at once (a peer that
        // stopped answering would hold it for peer_timeout), and the worker
        // opens that connection again before its next chunk. A READ stops
        // writing into local memory at once either way.
        // A WRITE's chunks on the wire are first let end by themselves while
        // the target takes their bytes (its TCP acknowledges more within
        // each CUT_GRACE, at most peer_timeout in all): a live target then
        // has written its last byte and acknowledged it before cancel
        // returns (its memory is fenced, as on shm and verbs); only a chunk
        // stalled that long (a stopped or silent peer) is cut, and the peer
        // is marked stalled so that the next cancels cut at once for a while.
        // A worker still reconnecting for a chunk of it (its TCP connect
        // pending on a stopped peer whose listen backlog is full) is not
        // waited for: it has touched nothing of the transfer and skips it
        // once connected ([`worker::PeerShared::inside`]).
        let Some(x) = self.inflight.mark_cancelled(xfer) else { return };
        let (peer, id) = (&x.peer, x.core.id);
        if x.core.op == super::Op::Write && !peer.stalled() {
            self.grace(peer, id);
        }
        peer.cut(id);
        super::wait_until(|| !peer.inside(id));
    }

    fn take_notifications(&mut self, out: &mut Vec<Notification>) {
        self.notifs.drain_into(out);
    }
}

impl TcpTransport {
    /// The fence list of the target holding `secret`, shared with earlier
    /// connects to it. Drops lists no peer uses that are empty, and past
    /// [`MAX_FENCE_TARGETS`] other targets' unused ones, in no particular
    /// order (targets long gone).
    fn fence_list(&mut self, secret: &AgentSecret) -> Arc<worker::FenceList> {
        self.fences.retain(|_, l| Arc::strong_count(l) > 1 || !l.is_empty());
        if self.fences.len() >= MAX_FENCE_TARGETS {
            let unused: Vec<_> = self
                .fences
                .iter()
                .filter(|(k, l)| Arc::strong_count(l) == 1 && *k != secret)
                .map(|(k, _)| k.clone())
                .collect();
            for k in unused.into_iter().take(self.fences.len() + 1 - MAX_FENCE_TARGETS) {
                self.fences.remove(&k);
            }
        }
        self.fences.entry(secret.clone()).or_default().clone()
    }

    /// Wait while a worker sends a chunk of WRITE `id` to `peer` and the
    /// peer's TCP keeps acknowledging its bytes (progress at least once per
    /// [`CUT_GRACE`], looked at every millisecond), at most `peer_timeout`
    /// in all. A grace that ends on no progress marks the peer stalled.
    fn grace(&self, peer: &PeerShared, id: XferId) {
        let start = std::time::Instant::now();
        let window = CUT_GRACE.min(self.config.peer_timeout);
        let (mut last, mut moved, mut looked) = (peer.acked(id), start, start);
        super::wait_until(|| {
            if !peer.busy_with(id) {
                return true;
            }
            let now = std::time::Instant::now();
            if now.duration_since(start) >= self.config.peer_timeout {
                if now.duration_since(moved) >= window {
                    peer.set_stalled(true);
                }
                return true;
            }
            if now.duration_since(looked) < Duration::from_millis(1) {
                return false;
            }
            looked = now;
            let acked = peer.acked(id);
            if acked != last {
                (last, moved) = (acked, now);
            } else if now.duration_since(moved) >= window {
                peer.set_stalled(true);
                return true;
            }
            false
        });
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Peers first: closing one shuts its connections down, so workers
        // stuck on a silent peer return at once; then nothing is in a chunk.
        for (_, mut p) in self.peers.drain() {
            p.close();
        }
        self.inflight.cancel_all();
        self.service = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(local: u64, remote: u64, len: u64) -> Segment {
        Segment { local_addr: local, remote_addr: remote, len_bytes: len, lkey: LocalKey(1), rkey: RemoteKey(1) }
    }

    /// A target that takes the TCP connection but never sends its
    /// challenge is a `Timeout` (`op` `"connect"`) after `peer_timeout`, not
    /// a refusal; the same transport then connects to a real target.
    #[test]
    fn a_target_that_never_answers_the_handshake_is_a_connect_timeout() {
        let timeout = Duration::from_millis(300);
        let config = TransportConfig { peer_timeout: timeout, ..TransportConfig::default() };
        let mut a = TcpTransport::new("a", &config).unwrap();
        let t = TcpTransport::new("t", &config).unwrap();
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let held = std::thread::spawn({
            let silent = silent.try_clone().unwrap();
            move || silent.accept().map(|(s, _)| s)
        });
        let mut info = TcpConnectionInfo::decode(&t.connection_info()).unwrap();
        info.addr = silent.local_addr().unwrap().to_string();
        let started = std::time::Instant::now();
        match a.connect("t", &info.encode(), &[]) {
            Err(TransportError::Timeout { op: "connect", peer, timeout: got, .. }) => {
                assert_eq!((peer.as_str(), got), ("t", timeout));
            }
            other => panic!("expected a connect Timeout, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(20), "bounded by peer_timeout: {:?}", started.elapsed());
        drop(held.join());
        a.connect("t", &t.connection_info(), &[]).expect("the real target after a timed-out try");
    }

    #[test]
    fn chunks_respect_byte_and_segment_limits() {
        let (s, r) = plan_chunks(vec![seg(0, 0, CHUNK_BYTES * 2 + 5)]);
        assert_eq!(s.len(), 3);
        assert_eq!(r, vec![0..1, 1..2, 2..3]);
        let many: Vec<Segment> = (0..3000).map(|i| seg(i * 64, i * 64, 64)).collect();
        let (s, r) = plan_chunks(many);
        assert_eq!(s.len(), 3000);
        assert!(r.iter().all(|r| r.len() <= wire::MAX_SEGMENTS as usize));
        assert_eq!(r.iter().map(|r| r.len()).sum::<usize>(), 3000);
        let (_, r) = plan_chunks(Vec::new());
        assert!(r.is_empty());
    }
}
