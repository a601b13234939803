//! `verbs`: one-sided RDMA READ/WRITE over RC queue pairs (InfiniBand and
//! RoCE) through libibverbs, loaded at run time.
//!
//! - Connection setup: a TCP listener thread per transport (its address is
//!   the connection info). The initiator says hello with the handshake
//!   version, its agent name and one QP endpoint (QPN, PSN, GID, LID, MTU,
//!   responder READ depth) per QP; the target creates
//!   matching QPs with receives posted for notifications; both go RESET →
//!   INIT → RTR → RTS with the path MTU from the ports' active MTUs.
//! - Posting: one WR per segment (one SGE), chained, one `post_send` per
//!   batch, selective signalling (every `signal_every`-th WR and the last of
//!   each transfer) within the send queue depth; segments of a transfer are
//!   striped over `qps_per_peer` QPs.
//! - Notifications: a SEND after the data on the same QP (RC ordering makes
//!   the data visible first); with several QPs, after all data completed.
//!   The target takes them from its receive completions by itself, up to
//!   each peer's bound (`notif_queue_count`, `notif_queue_bytes`; below).
//! - One owner: the progress thread's engine (`engine.rs`) owns every QP,
//!   the CQE budget and the transfers; `post`, `cancel`, `connect`,
//!   `disconnect` and the connection threads send it commands over a
//!   channel (see docs/VERBS.md, "Structure").
//! - Completion: the progress thread polls the CQ. An error completion fails
//!   its transfer with the status name (e.g. `IBV_WC_REM_ACCESS_ERR`) and
//!   puts the QP in error; once drained, the next post to that peer resets
//!   and reconnects it.
//! - A dead peer fails its transfers in bounded time with the default
//!   options: its liveness channel closing fails its QPs at once
//!   (`PeerDied`); a QP with WRs in flight and no completion for
//!   `progress_timeout_ms` is put in error (`PeerTimeout`, its WRs flushed);
//!   and the default `retry_cnt` is finite (rxe retries forever at 7,
//!   `rxe_comp.c`), so the NIC also gives up with `IBV_WC_RETRY_EXC_ERR`
//!   after `timeout` × (`retry_cnt` + 1).
//! - Connections are authenticated: the connection info carries this
//!   transport's random `AgentSecret`, and the target serves only an
//!   initiator that proves it knows it (`conn`).
//!
//! Options (`TransportConfig::options`, checked by `OptionSet::parse`
//! against `transport::options::VERBS_OPTIONS`): `device=rxe0`, `port=1`,
//! `gid_index=N` (default: RoCE v2 IPv4-mapped, LID routing on IB),
//! `qps_per_peer=N` (1), `timeout=EXP` (14: 4.096 µs × 2^14 ≈ 67 ms; 18,
//! ≈ 1 s, on software devices),
//! `retry_cnt=N` (6), `progress_timeout_ms=N` (2 × `peer_timeout`),
//! `max_send_wr=N` (1024), `signal_every=N` (32),
//! `post_list=N` (64: most WRs chained into one `post_send`, as perftest's
//! `--post_list`), `post_bytes=N` (a batch also ends with the WR that brings
//! it to N bytes; 65536 on software devices (rxe, siw), where a `post_send`
//! is a system call that runs the requester on the posting thread, so
//! shorter batches spread that work over the CPUs; 0 = no limit on
//! hardware, see docs/PERFORMANCE.md), `cq_events=0|1` (1: when the CQ is
//! idle the progress thread blocks on a completion channel and its wake fd; 0: it polls
//! every `poll_sleep_us`), `poll_sleep_us=N` (50: how long the progress
//! thread waits on its command channel between polls of an idle CQ without
//! completion events),
//! `idle_yields=N` (yields on an idle CQ, after 64 spins, before blocking
//! or sleeping; 192, and 5000 on software devices, where waking a blocked
//! progress thread for the next post is slow),
//! `cq_size=N` (entries of the completion queue shared by every QP, at
//! least 128; default the device's `max_cqe` within 256..65536; WRs wait in software
//! rather than overrun it), `listen=IP` (default: the GID's IPv4 address),
//! `coalesce=0|1` (1: registrations inside a live memory region, or
//! overlapping/abutting in one `register_batch` list, share one MR,
//! reference-counted; 0: one MR per registration; `regions.rs`),
//! `notif_queue_count=N` (1024) and `notif_queue_bytes=N` (4 MiB): per
//! connected peer, the most notifications and payload bytes of it this
//! target holds until `take_notifications` (0 or not a number:
//! `InvalidOption`). At the bound the engine stops reposting the peer's
//! receives: its notifications wait in their receive slots (64 per QP), its
//! next SENDs wait at its NIC (RNR, retried forever), its notified posts
//! past its 256 slots fail `Overloaded`, and if the target takes none for
//! `progress_timeout_ms` its QP is put in error and the waiting transfers
//! end `PeerTimeout`. Nothing is dropped; other peers keep their own
//! bound. Cost: one atomic add per notification delivered, one subtract
//! per notification taken (docs/VERBS.md, "Notification bound").
//! `max_preauth=N` (64): handshake connections that have not proved the
//! secret, at most, per listener; a new one over that closes the oldest
//! (0 or not a number: `InvalidOption`). An agent name is held by one
//! session at a time: a proven hello under the name of a peer connected
//! now from another transport is refused (`TransportError::NameInUse`;
//! `conn`).

/// Default `idle_yields` on software devices (rxe, siw); measured where `VerbsTransport::new` applies it.
const SOFTWARE_IDLE_YIELDS: u32 = 5000;

mod conn;
pub mod device;
#[doc(hidden)]
pub mod engine;
pub mod gpu;
mod keys;
pub mod nic;
mod progress;
mod reconnect;
mod regions;
#[doc(hidden)]
#[cfg(any(test, feature = "sim"))]
pub mod sim;
/// Benches of the engine over the simulated NIC (`benches/verbs_command.rs`).
#[cfg(any(test, feature = "sim"))]
#[doc(hidden)]
pub mod sim_bench;
/// The 112,000-descriptor scale bench on the simulated NIC (`benches/verbs_scale.rs`).
#[cfg(any(test, feature = "sim"))]
#[doc(hidden)]
pub mod sim_scale;
/// The registration table alone (`benches/registration.rs`).
#[cfg(any(test, feature = "sim"))]
#[doc(hidden)]
pub use regions::bench as regions_bench;
mod state;
#[cfg(test)]
mod tests;
mod wc;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::RecvTimeoutError;
use serde::{Deserialize, Serialize};

use super::auth::AgentSecret;
use super::notify::NotifBounds;
use super::options::OptionSet;
use super::{
    Completion, Dial, Dialed, LocalKey, MemoryBacking, Notification, PeerId, PostRequest, Registration, RemoteKey,
    RemoteRegion, Transport, TransportConfig, TransportError, TransportKind, XferId,
};
use crate::verbs::ffi::IBV_LINK_LAYER_INFINIBAND;
use crate::verbs::{CompletionQueue, Context, ProtectionDomain, QpOptions, VerbsError};
use conn::Liveness;
use device::Device;
use engine::Cmd;
use nic::RealNic;
use progress::{Core, Handle};
use reconnect::Reconnect;
use state::NOTIF_SLOTS;
use state::PeerLink;
use state::{NOTIF_SLOT_BYTES, PostLimits};

/// Default of option `notif_queue_count` on verbs: notifications of one
/// connected peer held in the target's queue until `take_notifications`.
pub const DEFAULT_NOTIF_QUEUE_COUNT: usize = 1024;

pub use crate::accept::DEFAULT_MAX_PREAUTH;
/// Default of option `notif_queue_bytes` on verbs: payload bytes of one
/// connected peer held likewise (4 MiB).
pub const DEFAULT_NOTIF_QUEUE_BYTES: usize = 4 << 20;

/// Default `retry_cnt`: finite (7 means "forever" on rxe).
pub const DEFAULT_RETRY_CNT: u8 = 6;

/// Connection info published in the agent metadata.
#[derive(Debug, Serialize, Deserialize)]
struct VerbsInfo {
    /// TCP address of the listener (`ip:port`).
    addr: String,
    /// The secret an initiator proves it knows before the target serves it.
    secret: AgentSecret,
}

/// What the transport shares with its connection threads (listener, peer
/// servers, liveness watchers): configuration, the device, and a handle
/// to send the engine commands. No QP or transfer state: the progress
/// thread's engine owns all of that.
pub(crate) struct Inner<D: Device> {
    /// The device (PD + shared CQ), to create QPs and memory; the engine
    /// owns a clone of it.
    pub(crate) nic: D,
    pub(crate) config: TransportConfig,
    pub(crate) qp_options: QpOptions,
    /// This transport's connection secret (published in its info).
    secret: AgentSecret,
    pub(crate) stopping: AtomicBool,
    /// Bounds of each connected peer's notifications in this target's
    /// queue (`notif_queue_count`, `notif_queue_bytes`).
    pub(crate) notif_bounds: NotifBounds,
    /// Commands to the engine.
    pub(crate) cmds: Handle<D::Qp>,
    /// This transport's session (random), sent in every hello: a target
    /// holds an agent name for one session at a time.
    session: u64,
    /// Names of the peers connected to this target now, with their sessions.
    names: conn::Names,
    /// Handshake connections that have not proved the secret (`max_preauth`).
    preauth: Arc<conn::PreAuth>,
    /// Target side: receive QPs per served connection (the fence).
    served: conn::Served,
    /// Initiator side: the next connection id (per transport).
    next_conn: AtomicU64,
    /// Initiator side: per target, the connections to fence (`replaces`).
    cut: Arc<conn::CutLists>,
    /// This (transport, device)'s counters (`fenced` counted here).
    counters: Arc<crate::metrics::LinkCounters>,
}

struct Peer {
    name: String,
    addr: String,
    /// The target's connection secret (from its connection info).
    secret: AgentSecret,
    /// The broken flag, shared with the engine (an atomic).
    link: Arc<PeerLink>,
    /// Watch over the control connection, which it owns: closing it tells
    /// the target to drop its QPs; the target's side closing fails ours.
    /// Moves into a reconnect while one runs.
    live: Option<Liveness>,
    /// The target's regions (given to `connect`): an rkey outside them
    /// fails `UnknownKey` before anything is posted.
    keys: keys::RemoteKeys,
    /// The reconnect in progress, on its own thread (`reconnect.rs`).
    redial: Option<Reconnect>,
    /// Its current connection id (a reconnect replaces it): noted as cut
    /// on `disconnect` (the late-bytes fence, `conn.rs`).
    conn: Arc<AtomicU64>,
}

/// The RDMA backend. See the module docs.
///
/// `D` is the device: libibverbs ([`RealNic`], from [`new`](Self::new)),
/// or, with the `sim` feature (tests and benches only), the simulated NIC
/// ([`on_sim`](Self::on_sim)).
pub struct VerbsTransport<D: Device = RealNic> {
    agent: String,
    inner: Arc<Inner<D>>,
    listen_addr: SocketAddr,
    /// Registrations by their own key, each mapped to a shared,
    /// reference-counted MR (`regions.rs`; option `coalesce`).
    regions: regions::Regions<D::Mr>,
    peers: HashMap<u32, Peer>,
    next_peer: u32,
    qps_per_peer: u32,
    /// Send queue depth of the initiator QPs.
    max_send_wr: u32,
    /// The listener thread.
    threads: Vec<JoinHandle<()>>,
    /// Liveness watchers of peers disconnected or reconnected (each ends
    /// within `conn::WATCH_MS`); reaped on connect, joined on drop.
    retired: Vec<JoinHandle<()>>,
    /// Reconnects of peers disconnected while they ran (abandoned: each
    /// ends at its next step); reaped on connect, joined on drop.
    redials: Vec<Reconnect>,
    /// The engine: its progress thread (joined on drop), its command
    /// handle, and the channels of finished transfers and notifications.
    core: Core<D::Qp>,
    /// Drained from `core.done` by `cancel` and not yet polled.
    done_held: Vec<Completion>,
    /// This transport in the connections it dials ([`Dialed`]).
    owner: u64,
}

/// A verbs connection dialled and not yet installed: its QPs are in RTS,
/// nothing was posted on them.
struct VerbsDialed<D: Device> {
    info: VerbsInfo,
    keys: keys::RemoteKeys,
    slab: D::Slab,
    qps: Vec<D::Qp>,
    control: conn::Control,
}

/// The options given to the backend, parsed and range-checked without
/// touching a device (defaults that depend on the device stay `None`).
struct Given {
    device: Option<String>,
    port: u8,
    gid_index: Option<u8>,
    timeout: Option<u8>,
    retry_cnt: u8,
    progress_timeout_ms: Option<u64>,
    max_send_wr: u32,
    signal_every: u32,
    post_list: u32,
    post_bytes: Option<u64>,
    poll_sleep_us: u32,
    idle_yields: Option<u32>,
    qps_per_peer: u32,
    cq_size: Option<i32>,
    cq_events: bool,
    listen: Option<String>,
    coalesce: bool,
    /// Per connected peer: `notif_queue_count`, `notif_queue_bytes`.
    notif_bounds: NotifBounds,
    /// Handshake connections that have not proved the secret, at most.
    max_preauth: usize,
}

impl Given {
    fn parse(config: &TransportConfig) -> Result<Self, TransportError> {
        let o = OptionSet::parse(TransportKind::Verbs, config)?;
        let timeout = match o.get::<u8>("timeout")? {
            Some(v) if v > 31 => {
                return Err(o.invalid("timeout", o.raw("timeout").unwrap_or_default(), Some("out of range")));
            }
            v => v,
        };
        let listen = match o.raw("listen").map(str::trim) {
            Some(ip) if ip.parse::<std::net::IpAddr>().is_err() => return Err(o.invalid("listen", ip, None)),
            ip => ip.map(str::to_string),
        };
        Ok(Self {
            device: o.raw("device").map(str::to_string),
            port: o.get("port")?.unwrap_or(1),
            gid_index: o.get("gid_index")?,
            timeout,
            retry_cnt: o.get_checked("retry_cnt", DEFAULT_RETRY_CNT, |v| *v <= 7)?,
            progress_timeout_ms: match o.get_checked::<u64>("progress_timeout_ms", 0, |v| *v > 0)? {
                0 => None,
                ms => Some(ms),
            },
            max_send_wr: o.get("max_send_wr")?.unwrap_or(1024),
            signal_every: o.get("signal_every")?.unwrap_or(32),
            post_list: o.get("post_list")?.unwrap_or(64),
            post_bytes: o.get("post_bytes")?,
            poll_sleep_us: o.get("poll_sleep_us")?.unwrap_or(50),
            idle_yields: o.get("idle_yields")?,
            qps_per_peer: o.get("qps_per_peer")?.unwrap_or(1),
            cq_size: o.get("cq_size")?,
            cq_events: o.get::<u8>("cq_events")?.unwrap_or(1) != 0,
            listen,
            coalesce: o.get::<u8>("coalesce")?.unwrap_or(1) != 0,
            notif_bounds: NotifBounds::from_options_or(
                &o,
                NotifBounds { count: DEFAULT_NOTIF_QUEUE_COUNT, bytes: DEFAULT_NOTIF_QUEUE_BYTES },
            )?,
            max_preauth: o.get_checked("max_preauth", DEFAULT_MAX_PREAUTH, |n| *n >= 1)?,
        })
    }
}

/// A verbs error met while setting up (device, port, PD, CQ, QPs): a
/// failing verb stays typed, as [`TransportError::Io`] naming the call with
/// its errno as the source (`ibv_create_cq: Cannot allocate memory (os error
/// 12)`); a missing library, device, port or provider op is
/// [`TransportError::Unsupported`].
pub(super) fn setup_err(e: VerbsError) -> TransportError {
    match e {
        VerbsError::Call { call, source } => TransportError::Io { call, source },
        other => TransportError::Unsupported(other.to_string()),
    }
}

impl VerbsTransport<RealNic> {
    /// Open the device, create the PD and CQ, start the listener and the
    /// progress thread.
    ///
    /// # Errors
    /// [`TransportError::Unsupported`] when libibverbs or the device is
    /// missing, or an option is invalid; [`TransportError::Io`] naming the
    /// verb (`ibv_open_device`, `ibv_query_port`, `ibv_alloc_pd`,
    /// `ibv_create_cq`, ...) and its errno when one fails, and for sockets.
    pub fn new(agent: &str, config: &TransportConfig) -> Result<Self, TransportError> {
        config.validate()?;
        // Every given option is checked before any device is opened, so a
        // misspelt key or a bad value is reported even where no device is.
        let o = Given::parse(config)?;
        let secret = AgentSecret::random()?;
        let ctx = Arc::new(Context::open(o.device.as_deref()).map_err(setup_err)?);
        let port = o.port;
        let pattr = ctx.query_port(port).map_err(setup_err)?;
        let gid_index = match o.gid_index {
            Some(i) => Some(i),
            None if pattr.link_layer == IBV_LINK_LAYER_INFINIBAND => None,
            None => Some(ctx.auto_gid_index(port).map_err(setup_err)? as u8),
        };
        let init_rd_atom = ctx.attr().max_qp_init_rd_atom.clamp(1, 255) as u8;
        let dest_rd_atom = ctx.attr().max_qp_rd_atom.clamp(1, 255) as u8;
        let qp_options = QpOptions {
            port,
            gid_index,
            // Software devices (rxe, siw) answer late under CPU load: with a
            // finite retry_cnt, 67 ms ACK timeouts failed READs of a busy
            // Soft-RoCE guest with IBV_WC_RETRY_EXC_ERR; 2^18 × 4.096 µs ≈ 1 s.
            timeout: o.timeout.unwrap_or(if ctx.is_software() { 18 } else { 14 }),
            // 7 would mean "retry forever" on rxe (`rxe_comp.c` never
            // decrements it): a finite default everywhere.
            retry_cnt: o.retry_cnt,
            rnr_retry: 7,
            max_rd_atomic: init_rd_atom,
            max_dest_rd_atomic: dest_rd_atom,
            min_rnr_timer: 12,
        };
        let max_send_wr: u32 = o.max_send_wr.clamp(1, ctx.attr().max_qp_wr.max(16) as u32);
        let limits = PostLimits {
            max_send_wr,
            signal_every: o.signal_every.clamp(1, max_send_wr),
            max_batch: o.post_list.clamp(1, 1024),
            batch_bytes: o.post_bytes.unwrap_or(if ctx.is_software() { 64 << 10 } else { 0 }),
            poll_sleep_us: o.poll_sleep_us.clamp(1, 100_000),
            // On a software NIC a progress thread that blocked between two
            // transfers must be woken for the next post (a cross-CPU wake-up,
            // slow in the Soft-RoCE guest): staying awake longer pays there.
            // Soft-RoCE A/B, one build, 8 rounds, 192 / 5000 yields: medians
            // of per-round ratios to perftest WRITE 4 KiB 100.2 / 101.4 %,
            // 64 KiB 99.7 / 108.4 %, READ 4 KiB 98.0 / 106.4 %, 64 KiB 94.9 /
            // 98.1 % (docs/PERFORMANCE.md, verbs). A yield gives way to any
            // runnable thread, so the rxe work this core owes goes first.
            idle_yields: o
                .idle_yields
                .unwrap_or(if ctx.is_software() { SOFTWARE_IDLE_YIELDS } else { 192 })
                .min(1_000_000),
        };
        let qps_per_peer = o.qps_per_peer.clamp(1, 64);
        let progress_timeout = match o.progress_timeout_ms {
            None => config.peer_timeout.saturating_mul(2),
            Some(ms) => Duration::from_millis(ms),
        };
        let listen_ip = match &o.listen {
            Some(ip) => ip.clone(),
            None => match gid_index.map(|i| ctx.query_gid(port, i32::from(i))) {
                Some(Ok(g)) if g.raw[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff] => {
                    std::net::Ipv4Addr::new(g.raw[12], g.raw[13], g.raw[14], g.raw[15]).to_string()
                }
                // No IP on the port (InfiniBand without IPoIB): loopback
                // unless `listen=` names a reachable address.
                _ => "127.0.0.1".to_string(),
            },
        };
        let max_cqe = ctx.attr().max_cqe.max(64);
        // At least 128: receives may hold half, and one QP posts 64.
        let num_cqe = o.cq_size.unwrap_or(max_cqe.clamp(256, 65536)).clamp(128, max_cqe.max(128));
        let pd = ProtectionDomain::new(&ctx).map_err(setup_err)?;
        let cq = CompletionQueue::create(&ctx, num_cqe, o.cq_events).map_err(setup_err)?;
        let nic = RealNic { pd, cq };
        let setup = Setup {
            nic,
            secret,
            qp_options,
            limits,
            num_cqe: num_cqe as u32,
            listen_ip,
            progress_timeout,
            qps_per_peer,
            max_send_wr,
            coalesce: o.coalesce,
            notif_bounds: o.notif_bounds,
            max_preauth: o.max_preauth,
        };
        VerbsTransport::start(agent, config, setup)
    }
}

/// What `VerbsTransport::start` needs of a device-specific constructor.
struct Setup<D> {
    nic: D,
    secret: AgentSecret,
    qp_options: QpOptions,
    limits: PostLimits,
    /// Entries of the shared CQ.
    num_cqe: u32,
    listen_ip: String,
    progress_timeout: Duration,
    qps_per_peer: u32,
    max_send_wr: u32,
    coalesce: bool,
    notif_bounds: NotifBounds,
    max_preauth: usize,
}

impl<D: Device> VerbsTransport<D> {
    /// Start the listener and the progress thread over `s.nic`.
    fn start(agent: &str, config: &TransportConfig, s: Setup<D>) -> Result<Self, TransportError> {
        let session = {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).map_err(|e| TransportError::Unsupported(format!("no OS randomness: {e}")))?;
            u64::from_le_bytes(b).max(1)
        };
        let listener =
            TcpListener::bind((s.listen_ip.as_str(), 0)).map_err(|e| TransportError::io("bind(verbs listener)", e))?;
        let listen_addr = listener.local_addr().map_err(|e| TransportError::io("getsockname", e))?;
        let (peer_timeout, progress_timeout) = (config.peer_timeout, s.progress_timeout);
        let counters = crate::metrics::global()
            .link_counters(&TransportKind::Verbs.to_string(), &config.nic_label(TransportKind::Verbs));
        let c2 = counters.clone();
        let core = Core::start(s.nic.clone(), s.num_cqe, s.limits, |e| {
            e.progress_timeout = progress_timeout;
            e.peer_timeout = peer_timeout;
            e.st.count_posts_into(c2);
        })
        .map_err(|e| TransportError::io("spawn(verbs progress)", e))?;
        let inner = Arc::new(Inner {
            nic: s.nic,
            config: config.clone(),
            qp_options: s.qp_options,
            secret: s.secret,
            stopping: AtomicBool::new(false),
            notif_bounds: s.notif_bounds,
            cmds: core.handle.clone(),
            session,
            names: conn::Names::default(),
            preauth: Arc::new(conn::PreAuth::new(s.max_preauth)),
            served: conn::Served::default(),
            next_conn: AtomicU64::new(1),
            cut: Arc::default(),
            counters,
        });
        let i2 = inner.clone();
        let threads = vec![
            std::thread::Builder::new()
                .name("kvwire-verbs-listen".into())
                .spawn(move || conn::accept_loop(i2, listener))
                .map_err(|e| TransportError::io("spawn", e))?,
        ];
        Ok(Self {
            agent: agent.to_string(),
            inner,
            listen_addr,
            regions: regions::Regions::new(s.coalesce),
            peers: HashMap::new(),
            next_peer: 1,
            qps_per_peer: s.qps_per_peer,
            max_send_wr: s.max_send_wr,
            threads,
            retired: Vec::new(),
            redials: Vec::new(),
            core,
            done_held: Vec::new(),
            owner: super::next_owner(),
        })
    }

    /// Reset and reconnect a peer whose QP hit an error, without waiting
    /// for it. Costs nothing while the peer's [`PeerLink::broken`] is
    /// clear; otherwise it starts a reconnect on its own thread
    /// ([`Reconnect`]) unless one runs, and the engine holds this post and
    /// the peer's later ones behind it (`Cmd::Reconnecting`).
    ///
    /// # Errors
    /// [`TransportError::NotConnected`] for an unknown peer;
    /// [`TransportError::PeerDisconnected`] when the reconnect thread cannot
    /// be started.
    fn recover(&mut self, peer: PeerId) -> Result<(), TransportError> {
        let p = self.peers.get_mut(&peer.0).ok_or(TransportError::NotConnected(peer))?;
        if p.redial.as_ref().is_some_and(Reconnect::is_finished)
            && let Some(r) = p.redial.take()
        {
            let o = r.finish();
            if let Some(l) = o.live {
                p.live = Some(l);
            }
            self.retired.extend(o.retired);
        }
        if p.redial.is_some() || !p.link.broken.load(Ordering::Acquire) {
            return Ok(());
        }
        self.core.handle.send(Cmd::Reconnecting { peer });
        let dial = reconnect::Dial {
            agent: self.agent.clone(),
            peer,
            name: p.name.clone(),
            addr: p.addr.clone(),
            secret: p.secret.clone(),
            qps: self.qps_per_peer,
            max_send_wr: self.max_send_wr,
            conn: p.conn.clone(),
        };
        match Reconnect::start(&self.inner, dial, p.live.take()) {
            Ok(r) => {
                p.redial = Some(r);
                Ok(())
            }
            Err((e, old)) => {
                p.live = old;
                let why = format!("cannot start its reconnect: {e}");
                self.core.handle.send(Cmd::Resume { peer, failed: Some(why.clone()) });
                Err(TransportError::PeerDisconnected(format!("{} ({why})", p.name)))
            }
        }
    }

    /// Join the reconnects of disconnected peers that ended (`all`: every
    /// one, waiting), and join or retire what they left.
    fn reap_redials(&mut self, all: bool) {
        let (done, live): (Vec<_>, Vec<_>) = self.redials.drain(..).partition(|r| all || r.is_finished());
        self.redials = live;
        for r in done {
            let o = r.finish();
            self.retired.extend(o.live.and_then(Liveness::retire));
            self.retired.extend(o.retired);
        }
    }
}

impl<D: Device> Transport for VerbsTransport<D> {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn register(&mut self, backing: Arc<dyn MemoryBacking>) -> Result<Registration, TransportError> {
        Ok(self.register_batch(vec![backing])?.remove(0))
    }

    /// Registers the list as few memory regions as it can (`regions.rs`):
    /// ranges inside a live MR take a reference on it; the others are
    /// sorted and merged into maximal contiguous runs (overlapping or
    /// abutting ranges), one `ibv_reg_mr` each. Each registration keeps its
    /// own key and range; those of one MR share its rkey.
    fn register_batch(&mut self, backings: Vec<Arc<dyn MemoryBacking>>) -> Result<Vec<Registration>, TransportError> {
        let nic = &self.inner.nic;
        let make = |run: &regions::Run<'_>| -> Result<(D::Mr, u32, u32), TransportError> {
            // SAFETY: the run is the union of backings that each promise
            // their range (`MemoryBacking`); the regions table keeps every
            // one of them alive until it drops (deregisters) the MR, which
            // it does first. The run's bytes all lie in the ranges of its
            // parts, which overlap or abut.
            let r = unsafe { nic.register(&run.desc, run.first)? };
            Ok((r.mr, r.lkey, r.rkey))
        };
        let keys = self.regions.register_batch(backings, make)?;
        Ok(keys.into_iter().map(|k| Registration { lkey: k.lkey, rkey: RemoteKey(k.rkey) }).collect())
    }

    fn memory_regions(&self) -> Option<usize> {
        Some(self.regions.memory_regions())
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), TransportError> {
        self.regions.deregister(lkey)
    }

    fn connection_info(&self) -> Vec<u8> {
        let info = VerbsInfo { addr: self.listen_addr.to_string(), secret: self.inner.secret.clone() };
        postcard::to_allocvec(&info).expect("plain data encodes")
    }

    /// Dial: create `qps_per_peer` send QPs and the peer's notification
    /// slab, handshake over the target's listener (bounded by
    /// `peer_timeout`) and bring the QPs to RTS.
    fn dial(&mut self, peer_name: &str, info: &[u8], regions: &[RemoteRegion]) -> Result<Dial, TransportError> {
        let info: VerbsInfo =
            postcard::from_bytes(info).map_err(|e| TransportError::BadConnectionInfo(e.to_string()))?;
        self.reap_redials(false);
        let (done, live): (Vec<_>, Vec<_>) = self.retired.drain(..).partition(|t| t.is_finished());
        self.retired = live;
        done.into_iter().for_each(|t| drop(t.join()));
        // A peer of ours to the same target whose QPs failed and were not
        // recovered since may have WRITEs still in the fabric: this hello
        // fences its connection too (the late-bytes fence, `conn.rs`).
        for p in self.peers.values().filter(|p| p.secret == info.secret && p.link.broken.load(Ordering::Acquire)) {
            self.inner.cut.note(&p.secret, p.conn.load(Ordering::SeqCst));
        }
        let (owner, inner, agent, peer) = (self.owner, self.inner.clone(), self.agent.clone(), peer_name.to_string());
        let (n, max_send_wr) = (self.qps_per_peer, self.max_send_wr);
        let keys = keys::RemoteKeys::new(regions);
        Ok(Dial::new(peer_name, move || {
            let slab = inner
                .nic
                .alloc_slab(NOTIF_SLOTS as usize * NOTIF_SLOT_BYTES)
                .map_err(|e| TransportError::Registration(e.to_string()))?;
            let (qps, control) = reconnect::open_qps(&inner, &agent, &info.addr, &info.secret, n, max_send_wr)
                .map_err(|e| match e {
                    conn::HandshakeError::NameInUse => {
                        TransportError::NameInUse { peer: peer.clone(), name: agent.clone() }
                    }
                    conn::HandshakeError::TimedOut(why) => {
                        TransportError::connect_timeout(&peer, inner.config.peer_timeout, why)
                    }
                    conn::HandshakeError::Failed(reason) => TransportError::Connect { peer: peer.clone(), reason },
                })?;
            Ok(Dialed::new(owner, &peer, VerbsDialed::<D> { info, keys, slab, qps, control }))
        }))
    }

    /// Install: the peer's liveness watch starts and the engine takes its
    /// QPs.
    fn install(&mut self, dialed: Dialed) -> Result<PeerId, TransportError> {
        let (name, VerbsDialed { info, keys, slab, qps, control }) = dialed.take::<VerbsDialed<D>>(self.owner)?;
        let id = self.next_peer;
        self.next_peer += 1;
        let conn = Arc::new(AtomicU64::new(control.conn));
        let live = Liveness::watch(&self.inner, PeerId(id), &name, control.ch)
            .map_err(|reason| TransportError::Connect { peer: name.clone(), reason })?;
        let link = Arc::new(PeerLink::default());
        let peer = PeerId(id);
        self.core.handle.send(Cmd::Install {
            peer,
            name: name.clone(),
            qps,
            slab: Some(slab),
            link: Some(link.clone()),
        });
        let peer =
            Peer { name, addr: info.addr, secret: info.secret, link, live: Some(live), keys, redial: None, conn };
        self.peers.insert(id, peer);
        Ok(PeerId(id))
    }

    fn disconnect(&mut self, peer: PeerId) {
        let Some(mut p) = self.peers.remove(&peer.0) else {
            return;
        };
        // Stop the watch (and any reconnect) first: the QPs go away on
        // purpose. A reconnect that still installs QPs after the
        // `Disconnect` below finds the peer gone and drops them.
        self.retired.extend(p.live.take().and_then(Liveness::retire));
        if let Some(r) = p.redial.take() {
            r.abandon();
            self.redials.push(r);
        }
        // The connection carrying its WRITEs now (after the abandon: a
        // reconnect that already has its new connection stored its id, one
        // that has not installs nothing) is fenced by the next hello.
        self.inner.cut.note(&p.secret, p.conn.load(Ordering::SeqCst));
        // Returns once the engine destroyed the peer's QPs.
        self.core.handle.call::<()>(|done| Cmd::Disconnect { peer, done });
    }

    /// Refuses here, on the caller's thread, what must be refused at once:
    /// an unknown peer, a notification over a slot, a peer that cannot be
    /// reconnected. Then the request goes to the engine without waiting for
    /// an answer; whatever else goes wrong fails the transfer in `poll`
    /// (more than `NOTIF_SLOTS` (256) notifications in flight to the peer:
    /// `FailureKind::Overloaded`, counted by the engine alone).
    fn post(&mut self, mut req: PostRequest) -> Result<(), TransportError> {
        if !self.peers.contains_key(&req.peer.0) {
            return Err(TransportError::NotConnected(req.peer));
        }
        if req.notification.as_ref().is_some_and(|n| n.len() > NOTIF_SLOT_BYTES) {
            return Err(TransportError::Post(format!("notification larger than {NOTIF_SLOT_BYTES} bytes")));
        }
        // The HCA checks each lkey and range; checking here too gives the
        // same typed error as shm and tcp before anything is queued.
        // Then each registration's key becomes its MR's hardware lkey.
        self.regions.resolve(&mut req.segments)?;
        self.recover(req.peer)?;
        // The remote check, with the same kinds as shm and tcp: the transfer
        // fails (reported by `poll`) before a WR is posted.
        if let Err(why) = self.peers[&req.peer.0].keys.check(&req.segments) {
            self.done_held.push(Completion { xfer: req.xfer, result: Err(why) });
            return Ok(());
        }
        self.core.handle.send(Cmd::Post(req));
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.done_held);
        out.extend(self.core.done.try_iter());
    }

    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) {
        let before = out.len();
        self.poll(out);
        if out.len() == before {
            match self.core.done.recv_timeout(timeout) {
                Ok(c) => {
                    out.push(c);
                    out.extend(self.core.done.try_iter());
                }
                Err(RecvTimeoutError::Timeout) => {}
                // The progress thread is gone (it only ends on drop): nothing
                // will complete; sleep rather than return at once to a caller
                // that waits again.
                Err(RecvTimeoutError::Disconnected) => std::thread::sleep(timeout),
            }
        }
    }

    fn completion_signal(&self) -> Option<super::CompletionSignal> {
        Some(super::CompletionSignal::new(self.core.done.clone()))
    }

    /// Returns once the NIC can no longer touch the transfer's buffers: the
    /// engine drops its queued work and closes the reply once its posted
    /// WRs completed or flushed (it moves the QPs carrying them to the
    /// error state after `peer_timeout`, and destroys any that still hold
    /// it another `peer_timeout` later).
    fn cancel(&mut self, xfer: XferId) {
        self.core.handle.call::<()>(|done| Cmd::Cancel { xfer: Some(xfer), done });
        // Finished before the cancel reached the engine: its completion is
        // not to be reported.
        self.done_held.extend(self.core.done.try_iter());
        self.done_held.retain(|c| c.xfer != xfer);
    }

    /// Gives each notification's credit back to its peer (one atomic
    /// subtract) and, when it took any, wakes the progress thread, which
    /// reposts the receives it held back for peers at their bound.
    fn take_notifications(&mut self, out: &mut Vec<Notification>) {
        let before = out.len();
        out.extend(self.core.notifs.try_iter().map(state::HeldNotification::take));
        if out.len() > before {
            self.core.handle.wake();
        }
    }
}

impl<D: Device> Drop for VerbsTransport<D> {
    /// Cancels every transfer, ends every thread (listener and its peer
    /// threads, liveness watchers, then the progress thread, which destroys
    /// every QP); the device context goes with the last of them.
    fn drop(&mut self) {
        self.core.handle.call::<()>(|done| Cmd::Cancel { xfer: None, done });
        self.inner.stopping.store(true, Ordering::Release);
        // Wake the listener.
        let _ = std::net::TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(200));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for p in self.peers.values_mut() {
            if let Some(l) = p.live.take() {
                l.join();
            }
            // Ends at its next step (`stopping`), its handshake bounded by
            // `peer_timeout`; the engine still runs for its commands.
            if let Some(r) = p.redial.take() {
                r.abandon();
                self.redials.push(r);
            }
        }
        self.reap_redials(true);
        for t in self.retired.drain(..) {
            let _ = t.join();
        }
        self.core.stop();
    }
}
