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
//!   The target takes them from its receive completions by itself.
//! - Completion: a progress thread polls the CQ. An error completion fails
//!   its transfer with the status name (e.g. `IBV_WC_REM_ACCESS_ERR`) and
//!   puts the QP in error; once drained, the next post to that peer resets
//!   and reconnects it. A dead peer surfaces as `IBV_WC_RETRY_EXC_ERR`
//!   after the QP's `timeout` × `retry_cnt` budget.
//!
//! Options (`TransportConfig::options`): `device=rxe0`, `port=1`,
//! `gid_index=N` (default: RoCE v2 IPv4-mapped, LID routing on IB),
//! `qps_per_peer=N` (1), `timeout=EXP` (14: 4.096 µs × 2^14 ≈ 67 ms),
//! `retry_cnt=N` (7), `max_send_wr=N` (1024), `signal_every=N` (32),
//! `post_list=N` (64: most WRs chained into one `post_send`, as perftest's
//! `--post_list`), `post_bytes=N` (a batch also ends with the WR that brings
//! it to N bytes; 65536 on software devices (rxe, siw), where a `post_send`
//! is a system call that runs the requester on the posting thread, so
//! shorter batches spread that work over the CPUs; 0 = no limit on
//! hardware, see docs/PERFORMANCE.md), `cq_events=0|1` (1: when the CQ is
//! idle the progress thread blocks on a completion channel; 0: it sleep-polls), `poll_sleep_us=N` (50: the
//! progress thread's sleep on an idle CQ without completion events),
//! `idle_yields=N` (192: yields on an idle CQ, after 64 spins, before
//! blocking or sleeping),
//! `cq_size=N` (entries of the completion queue shared by every QP, at
//! least 128; default the device's `max_cqe` within 256..65536; WRs wait in software
//! rather than overrun it), `listen=IP` (default: the GID's IPv4 address).

mod conn;
mod progress;
mod state;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use serde::{Deserialize, Serialize};

use super::{
    Completion, LocalKey, MemoryBacking, MemoryKind, Notification, PeerId, PostRequest, Registration, RemoteKey,
    RemoteRegion, TransferFailure, Transport, TransportConfig, TransportError, TransportKind, XferId,
};
use crate::sidechannel::SideChannel;
use crate::verbs::ffi::IBV_LINK_LAYER_INFINIBAND;
use crate::verbs::{CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpOptions, QueuePair, VerbsError};
use state::{NOTIF_SLOT_BYTES, NotifSlab, PostLimits, SendQp, State, Xfer};

/// Notification slots per peer on the initiator (notifications in flight).
const NOTIF_SLOTS: u32 = 256;

/// Connection info published in the agent metadata.
#[derive(Debug, Serialize, Deserialize)]
struct VerbsInfo {
    /// TCP address of the listener (`ip:port`).
    addr: String,
}

pub(crate) struct Inner {
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) config: TransportConfig,
    pub(crate) qp_options: QpOptions,
    limits: PostLimits,
    state: Mutex<State>,
    pub(crate) stopping: AtomicBool,
    /// Threads other than the progress thread waiting for `state`.
    waiting: AtomicU32,
}

impl Inner {
    /// The shared state, for any thread but the progress thread.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        guard
    }
}

struct Peer {
    name: String,
    addr: String,
    qpns: Vec<u32>,
    /// Control connection: closing it tells the target to drop its QPs.
    ctrl: Option<SideChannel>,
}

/// The RDMA backend. See the module docs.
pub struct VerbsTransport {
    agent: String,
    inner: Arc<Inner>,
    listen_addr: SocketAddr,
    regions: HashMap<u32, MemoryRegion>,
    peers: HashMap<u32, Peer>,
    next_peer: u32,
    qps_per_peer: u32,
    threads: Vec<JoinHandle<()>>,
    /// Finished transfers from the progress thread (see `State::done`).
    done_rx: Receiver<Completion>,
    /// Drained from `done_rx` by `cancel` and not yet polled.
    done_held: Vec<Completion>,
    notif_rx: Receiver<Notification>,
}

fn opt<T: std::str::FromStr>(config: &TransportConfig, key: &str, default: T) -> Result<T, TransportError> {
    match config.option(key) {
        None => Ok(default),
        Some(v) => {
            v.parse().map_err(|_| TransportError::Unsupported(format!("verbs option {key}={v:?} is not a valid value")))
        }
    }
}

fn unsupported(e: VerbsError) -> TransportError {
    TransportError::Unsupported(e.to_string())
}

impl VerbsTransport {
    /// Open the device, create the PD and CQ, start the listener and the
    /// progress thread.
    ///
    /// # Errors
    /// [`TransportError::Unsupported`] when libibverbs or the device is
    /// missing, or an option is invalid; [`TransportError::Io`] for sockets.
    pub fn new(agent: &str, config: &TransportConfig) -> Result<Self, TransportError> {
        let ctx = Arc::new(Context::open(config.option("device")).map_err(unsupported)?);
        let port: u8 = opt(config, "port", 1)?;
        let pattr = ctx.query_port(port).map_err(unsupported)?;
        let gid_index = match config.option("gid_index") {
            Some(_) => Some(opt(config, "gid_index", 0u8)?),
            None if pattr.link_layer == IBV_LINK_LAYER_INFINIBAND => None,
            None => Some(ctx.auto_gid_index(port).map_err(unsupported)? as u8),
        };
        let init_rd_atom = ctx.attr().max_qp_init_rd_atom.clamp(1, 255) as u8;
        let dest_rd_atom = ctx.attr().max_qp_rd_atom.clamp(1, 255) as u8;
        let qp_options = QpOptions {
            port,
            gid_index,
            timeout: opt(config, "timeout", 14)?,
            retry_cnt: opt(config, "retry_cnt", 7)?,
            rnr_retry: 7,
            max_rd_atomic: init_rd_atom,
            max_dest_rd_atomic: dest_rd_atom,
            min_rnr_timer: 12,
        };
        let max_send_wr: u32 = opt::<u32>(config, "max_send_wr", 1024)?.clamp(1, ctx.attr().max_qp_wr.max(16) as u32);
        let limits = PostLimits {
            max_send_wr,
            signal_every: opt::<u32>(config, "signal_every", 32)?.clamp(1, max_send_wr),
            max_batch: opt::<u32>(config, "post_list", 64)?.clamp(1, 1024),
            batch_bytes: opt::<u64>(config, "post_bytes", if ctx.is_software() { 64 << 10 } else { 0 })?,
            poll_sleep_us: opt::<u32>(config, "poll_sleep_us", 50)?.clamp(1, 100_000),
            idle_yields: opt::<u32>(config, "idle_yields", 192)?.min(1_000_000),
        };
        let qps_per_peer = opt::<u32>(config, "qps_per_peer", 1)?.clamp(1, 64);
        let listen_ip = match config.option("listen") {
            Some(ip) => ip.to_string(),
            None => match gid_index.map(|i| ctx.query_gid(port, i32::from(i))) {
                Some(Ok(g)) if g.raw[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff] => {
                    std::net::Ipv4Addr::new(g.raw[12], g.raw[13], g.raw[14], g.raw[15]).to_string()
                }
                // No IP on the port (InfiniBand without IPoIB): loopback
                // unless `listen=` names a reachable address.
                _ => "127.0.0.1".to_string(),
            },
        };
        let listener =
            TcpListener::bind((listen_ip.as_str(), 0)).map_err(|e| TransportError::io("bind(verbs listener)", e))?;
        let listen_addr = listener.local_addr().map_err(|e| TransportError::io("getsockname", e))?;
        let max_cqe = ctx.attr().max_cqe.max(64);
        // At least 128: receives may hold half, and one QP posts 64.
        let num_cqe = opt::<i32>(config, "cq_size", max_cqe.clamp(256, 65536))?.clamp(128, max_cqe.max(128));
        let pd = ProtectionDomain::new(&ctx).map_err(unsupported)?;
        let cq_events = opt::<u8>(config, "cq_events", 1)? != 0;
        let cq = CompletionQueue::create(&ctx, num_cqe, cq_events).map_err(unsupported)?;
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let (notif_tx, notif_rx) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            pd,
            cq,
            config: config.clone(),
            qp_options,
            limits,
            state: Mutex::new(State::new(num_cqe as u32, done_tx, notif_tx)),
            stopping: AtomicBool::new(false),
            waiting: AtomicU32::new(0),
        });
        let mut threads = Vec::new();
        let i2 = inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name("kvwire-verbs-listen".into())
                .spawn(move || conn::accept_loop(i2, listener))
                .map_err(|e| TransportError::io("spawn", e))?,
        );
        let i3 = inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name("kvwire-verbs-progress".into())
                .spawn(move || progress::progress_loop(&i3))
                .map_err(|e| TransportError::io("spawn", e))?,
        );
        Ok(Self {
            agent: agent.to_string(),
            inner,
            listen_addr,
            regions: HashMap::new(),
            peers: HashMap::new(),
            next_peer: 1,
            qps_per_peer,
            threads,
            done_rx,
            done_held: Vec::new(),
            notif_rx,
        })
    }

    /// Create `n` send QPs, handshake with `addr`, bring them to RTS.
    fn open_qps(&self, addr: &str, n: u32) -> Result<(Vec<QueuePair>, SideChannel), String> {
        let o = &self.inner.qp_options;
        let mut qps = Vec::new();
        let mut eps = Vec::new();
        for _ in 0..n {
            let qp = QueuePair::new(&self.inner.pd, &self.inner.cq, &self.inner.cq, self.inner.limits.max_send_wr, 1)
                .map_err(|e| e.to_string())?;
            eps.push(qp.endpoint(o).map_err(|e| e.to_string())?);
            qps.push(qp);
        }
        let (remote, ch) = conn::handshake(addr, &self.agent, &eps, self.inner.config.peer_timeout)?;
        for ((qp, l), r) in qps.iter().zip(&eps).zip(&remote) {
            qp.connect(l, r, o).map_err(|e| e.to_string())?;
        }
        Ok((qps, ch))
    }

    /// Reset and reconnect a peer whose QP hit an error, once its work drained.
    fn recover(&mut self, peer: PeerId) -> Result<(), TransportError> {
        let p = self.peers.get(&peer.0).ok_or(TransportError::NotConnected(peer))?;
        let budget = self.inner.config.peer_timeout + Duration::from_secs(10);
        let deadline = Instant::now() + budget;
        loop {
            let st = self.inner.lock();
            // A QP of this peer may have been destroyed (a failed
            // `post_send`, `cancel`) while `qpns` still names it, and its
            // number may since belong to another peer's QP: only a QP of
            // this peer counts as one.
            let own = |q: &u32| st.send_qps.get(q).filter(|s| s.peer == peer.0);
            let busy = p.qpns.iter().any(|q| own(q).is_some_and(|s| s.outstanding > 0));
            // No QPs: an earlier reconnect failed; try again.
            let broken = p.qpns.is_empty() || p.qpns.iter().any(|q| own(q).is_none_or(|s| s.error.is_some()));
            drop(st);
            if !broken {
                return Ok(());
            }
            if !busy {
                break;
            }
            if Instant::now() > deadline {
                return Err(TransportError::PeerDisconnected(format!("{} (QP did not drain in {budget:?})", p.name)));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let (name, addr, old) = (p.name.clone(), p.addr.clone(), p.qpns.clone());
        {
            let mut st = self.inner.lock();
            for q in &old {
                st.remove_peer_qp(*q, peer.0, &self.inner.limits);
            }
        }
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.ctrl = None;
            p.qpns.clear();
        }
        let (qps, ch) = self
            .open_qps(&addr, self.qps_per_peer)
            .map_err(|why| TransportError::PeerDisconnected(format!("{name} (reconnect failed: {why})")))?;
        tracing::info!("verbs: reconnected to {name}");
        let qpns = self.install(peer.0, qps);
        if let Some(p) = self.peers.get_mut(&peer.0) {
            p.qpns = qpns;
            p.ctrl = Some(ch);
        }
        Ok(())
    }

    fn install(&self, peer: u32, qps: Vec<QueuePair>) -> Vec<u32> {
        let mut st = self.inner.lock();
        qps.into_iter()
            .map(|qp| {
                let qpn = qp.qp_num();
                st.send_qps.insert(
                    qpn,
                    SendQp {
                        qp,
                        peer,
                        outstanding: 0,
                        chunks: HashMap::new(),
                        queue: Default::default(),
                        error: None,
                        flush_reserved: 0,
                    },
                );
                qpn
            })
            .collect()
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn register(&mut self, backing: &dyn MemoryBacking) -> Result<Registration, TransportError> {
        let d = backing.desc();
        let len = usize::try_from(d.len_bytes).map_err(|_| TransportError::Registration("range too large".into()))?;
        let reg = |e: VerbsError| TransportError::Registration(e.to_string());
        let pd = &self.inner.pd;
        let mr = match d.kind {
            // GPU memory: dma-buf, then the plain pointer (nvidia-peermem),
            // else an error naming both causes (the chain of `cuda::register`).
            MemoryKind::Vram => {
                let dmabuf = backing.dmabuf_fd().ok_or_else(|| "the memory exports no dma-buf".to_string());
                crate::cuda::register_with_fallback(
                    d.addr,
                    d.len_bytes,
                    dmabuf,
                    // SAFETY: the engine keeps `backing` (which owns the
                    // memory and the dma-buf fd) alive until `deregister`,
                    // which drops (deregisters) the MR first.
                    |fd, off, _, iova| unsafe { MemoryRegion::register_dmabuf(pd, fd, off, len, iova) },
                    // SAFETY: as above.
                    |addr, _| unsafe { MemoryRegion::register(pd, addr, len) },
                )
                .map(|(mr, _path)| mr)
                .map_err(|e| TransportError::Registration(e.to_string()))?
            }
            // SAFETY: as above (host memory).
            MemoryKind::Dram => unsafe { MemoryRegion::register(pd, d.addr, len).map_err(reg)? },
        };
        let r = Registration { lkey: LocalKey(mr.lkey()), rkey: RemoteKey(mr.rkey()) };
        self.regions.insert(mr.lkey(), mr);
        Ok(r)
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), TransportError> {
        self.regions.remove(&lkey.0).map(drop).ok_or(TransportError::UnknownLocalKey(lkey))
    }

    fn connection_info(&self) -> Vec<u8> {
        postcard::to_allocvec(&VerbsInfo { addr: self.listen_addr.to_string() }).expect("plain data encodes")
    }

    fn connect(&mut self, peer_name: &str, info: &[u8], _regions: &[RemoteRegion]) -> Result<PeerId, TransportError> {
        let info: VerbsInfo =
            postcard::from_bytes(info).map_err(|e| TransportError::BadConnectionInfo(e.to_string()))?;
        let cerr = |reason: String| TransportError::Connect { peer: peer_name.to_string(), reason };
        let slab = MemoryRegion::alloc(&self.inner.pd, NOTIF_SLOTS as usize * NOTIF_SLOT_BYTES)
            .map_err(|e| TransportError::Registration(e.to_string()))?;
        let (qps, ch) = self.open_qps(&info.addr, self.qps_per_peer).map_err(cerr)?;
        let id = self.next_peer;
        self.next_peer += 1;
        let qpns = self.install(id, qps);
        self.inner.lock().slabs.insert(id, NotifSlab { mr: slab, free: (0..NOTIF_SLOTS).rev().collect() });
        self.peers.insert(id, Peer { name: peer_name.to_string(), addr: info.addr, qpns, ctrl: Some(ch) });
        Ok(PeerId(id))
    }

    fn disconnect(&mut self, peer: PeerId) {
        let Some(p) = self.peers.remove(&peer.0) else {
            return;
        };
        let mut st = self.inner.lock();
        for q in &p.qpns {
            st.remove_peer_qp(*q, peer.0, &self.inner.limits);
        }
        st.slabs.remove(&peer.0);
    }

    fn post(&mut self, req: PostRequest) -> Result<(), TransportError> {
        if !self.peers.contains_key(&req.peer.0) {
            return Err(TransportError::NotConnected(req.peer));
        }
        self.recover(req.peer)?;
        let p = &self.peers[&req.peer.0];
        if req.notification.as_ref().is_some_and(|n| n.len() > NOTIF_SLOT_BYTES) {
            return Err(TransportError::Post(format!("notification larger than {NOTIF_SLOT_BYTES} bytes")));
        }
        let limits = self.inner.limits;
        let mut st = self.inner.lock();
        let mut slot = None;
        if let Some(payload) = &req.notification {
            let slab = st.slabs.get_mut(&req.peer.0).ok_or(TransportError::NotConnected(req.peer))?;
            let s = slab.free.pop().ok_or_else(|| {
                TransportError::Post(format!("more than {NOTIF_SLOTS} notifications in flight to {}", p.name))
            })?;
            // Slot `s` is free: no WR reads it until we post one.
            let written = slab.mr.write_owned(s as usize * NOTIF_SLOT_BYTES, payload);
            debug_assert!(written, "the slab owns its buffer and payloads fit a slot");
            slot = Some((s, payload.len() as u32));
        }
        let qp0 = p.qpns[0];
        let multi = p.qpns.len() > 1;
        st.xfers.insert(
            req.xfer.0,
            Xfer {
                queued: 0,
                chunks: 0,
                error: None,
                cancelled: false,
                deferred_notify: slot.filter(|_| multi).map(|(s, l)| (qp0, s, l)),
                slot: slot.map(|(s, _)| (req.peer.0, s)),
            },
        );
        st.enqueue(req.xfer, req.op, &req.segments, &p.qpns, &limits);
        if let (Some((s, l)), false) = (slot, multi) {
            st.enqueue_notify(req.xfer.0, qp0, s, l, &limits);
        }
        st.try_finish(req.xfer.0, &limits);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.done_held);
        out.extend(self.done_rx.try_iter());
    }

    fn cancel(&mut self, xfer: XferId) {
        let limits = self.inner.limits;
        {
            let mut st = self.inner.lock();
            let Some(x) = st.xfers.get_mut(&xfer.0) else {
                // Finished already: its completion is not to be reported.
                drop(st);
                self.done_held.extend(self.done_rx.try_iter());
                self.done_held.retain(|c| c.xfer != xfer);
                return;
            };
            x.cancelled = true;
            x.deferred_notify = None;
            let mut dropped = 0;
            for sq in st.send_qps.values_mut() {
                let before = sq.queue.len();
                sq.queue.retain(|w| w.xfer() != xfer.0);
                dropped += before - sq.queue.len();
            }
            if let Some(x) = st.xfers.get_mut(&xfer.0) {
                x.queued = x.queued.saturating_sub(dropped as u32);
            }
            st.try_finish(xfer.0, &limits);
        }
        // Posted WRs finish (or fail after the QP's retry budget, or flush):
        // only then can the NIC no longer touch the buffers. Past
        // `peer_timeout`, move the QPs carrying them to the error state,
        // which flushes them at once (the next post reconnects); if one
        // still holds the transfer another `peer_timeout` later, destroy
        // it (after `ibv_destroy_qp` the NIC no longer touches its buffers).
        let flush_at = Instant::now() + self.inner.config.peer_timeout;
        let destroy_at = flush_at + self.inner.config.peer_timeout;
        let mut flushed = false;
        loop {
            {
                let mut st = self.inner.lock();
                if !st.xfers.contains_key(&xfer.0) {
                    break;
                }
                let now = Instant::now();
                if now > flush_at {
                    let carrying: Vec<u32> = st
                        .send_qps
                        .iter()
                        .filter(|(_, sq)| sq.chunks.values().any(|(x, _)| *x == xfer.0))
                        .map(|(&q, _)| q)
                        .collect();
                    if !flushed {
                        flushed = true;
                        for q in &carrying {
                            if let Some(sq) = st.send_qps.get_mut(q)
                                && sq.error.is_none()
                            {
                                tracing::warn!("verbs: cancel of {xfer:?} flushes QP {q}");
                                sq.error = Some(TransferFailure::cancelled(format!("QP flushed to cancel {xfer:?}")));
                                let _ = sq.qp.set_error();
                            }
                        }
                    } else if now > destroy_at {
                        for q in &carrying {
                            tracing::warn!("verbs: cancel of {xfer:?} destroys QP {q}, which did not drain");
                            st.remove_qp(*q, &limits);
                        }
                        if carrying.is_empty() {
                            // Nothing in flight on any QP: nothing can touch
                            // its buffers. Drop the record, giving its
                            // notification slot back.
                            st.drop_xfer(xfer.0);
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn take_notifications(&mut self, out: &mut Vec<Notification>) {
        out.extend(self.notif_rx.try_iter());
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        let ids: Vec<u64> = self.inner.lock().xfers.keys().copied().collect();
        for id in ids {
            self.cancel(XferId(id));
        }
        self.inner.stopping.store(true, Ordering::Release);
        // Wake the listener.
        let _ = std::net::TcpStream::connect_timeout(&self.listen_addr, Duration::from_millis(200));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let mut st = self.inner.lock();
        st.send_qps.clear();
        st.slabs.clear();
        st.recv_qps.clear();
    }
}
