//! Reconnection of a peer whose QPs failed, on a connection-manager thread
//! of its own, never on the caller's `post` thread.
//!
//! The first `post` that finds the peer broken (`PeerLink::broken`) sends
//! the engine [`Cmd::Reconnecting`] and starts a [`Reconnect`]; that post and
//! every later one to the peer queue in the engine behind it and `post`
//! returns at once. The thread waits (up to `peer_timeout` + 10 s) until the
//! old QPs drained ([`Cmd::Query`]), has them destroyed ([`Cmd::Unplug`]),
//! closes the old control connection, handshakes and connects new QPs and
//! hands them over ([`Cmd::Install`]: the held posts go on them). When any
//! step fails it tells the engine why ([`Cmd::Resume`]), which fails the held
//! posts with `PeerDied` naming it; the next post starts another attempt.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Inner;
use super::conn::{self, Liveness};
use super::device::Device;
use super::engine::{Cmd, PeerHealth};
use crate::transport::PeerId;
use crate::transport::auth::AgentSecret;

/// Who to dial: everything the thread needs of the transport and the peer.
pub(super) struct Dial {
    /// This transport's agent name (the hello's).
    pub(super) agent: String,
    /// The engine's number of the peer.
    pub(super) peer: PeerId,
    /// The peer's agent name.
    pub(super) name: String,
    /// The target's listener (`ip:port`) and connection secret.
    pub(super) addr: String,
    pub(super) secret: AgentSecret,
    /// QPs to open, and the send queue depth of each.
    pub(super) qps: u32,
    pub(super) max_send_wr: u32,
    /// The peer's current connection id, shared with its `Peer`: noted as
    /// cut once the old QPs are gone, replaced by the new connection's
    /// before it carries anything (the late-bytes fence, `conn.rs`).
    pub(super) conn: Arc<AtomicU64>,
}

/// What a finished reconnect leaves to its owner.
pub(super) struct Outcome {
    /// The watch over the new control connection (or the old one, kept,
    /// when the peer turned out not to need a reconnect).
    pub(super) live: Option<Liveness>,
    /// The old watch, stopped; to be joined (it ends within `WATCH_MS`).
    pub(super) retired: Option<JoinHandle<()>>,
}

/// A reconnect in progress on its own thread.
pub(super) struct Reconnect {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Outcome>,
}

impl Reconnect {
    /// Start reconnecting `dial.peer`, taking over its old watch `old`.
    ///
    /// # Errors
    /// The thread could not be spawned; `old` comes back with the error.
    pub(super) fn start<D: Device>(
        inner: &Arc<Inner<D>>,
        dial: Dial,
        old: Option<Liveness>,
    ) -> Result<Self, (std::io::Error, Option<Liveness>)> {
        let stop = Arc::new(AtomicBool::new(false));
        let (inner, stop2) = (inner.clone(), stop.clone());
        // The watch moves into the thread only once it runs: a failed spawn
        // hands it back.
        let (tx, rx) = crossbeam_channel::bounded::<Option<Liveness>>(1);
        let thread = std::thread::Builder::new().name("kvwire-verbs-redial".into()).spawn(move || {
            let old = rx.recv().ok().flatten();
            run(&inner, &dial, old, &stop2)
        });
        match thread {
            Ok(thread) => {
                let _ = tx.send(old);
                Ok(Self { stop, thread })
            }
            Err(e) => Err((e, old)),
        }
    }

    /// True once the thread ended ([`finish`](Self::finish) will not wait).
    pub(super) fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Wait for the thread (bounded: see the module docs) and take what it
    /// left.
    pub(super) fn finish(self) -> Outcome {
        self.thread.join().unwrap_or(Outcome { live: None, retired: None })
    }

    /// Ask the thread to give up (its peer was disconnected): it stops at
    /// its next step; [`finish`](Self::finish) still joins it.
    pub(super) fn abandon(&self) {
        // SeqCst, paired with `attempt`'s store of the new id before its
        // `stopped` check: either this side reads the new id or that side
        // sees the stop and installs nothing.
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn run<D: Device>(inner: &Arc<Inner<D>>, dial: &Dial, old: Option<Liveness>, stop: &AtomicBool) -> Outcome {
    let mut retired = None;
    let r = attempt(inner, dial, old, stop, &mut retired);
    match r {
        Ok(live) => Outcome { live, retired },
        Err(why) => {
            tracing::warn!("verbs: reconnect to {} failed: {why}", dial.name);
            inner.cmds.send(Cmd::Resume { peer: dial.peer, failed: Some(why) });
            Outcome { live: None, retired }
        }
    }
}

fn attempt<D: Device>(
    inner: &Arc<Inner<D>>,
    dial: &Dial,
    old: Option<Liveness>,
    stop: &AtomicBool,
    retired: &mut Option<JoinHandle<()>>,
) -> Result<Option<Liveness>, String> {
    let peer = dial.peer;
    let budget = inner.config.peer_timeout + Duration::from_secs(10);
    let deadline = Instant::now() + budget;
    let stopped = || stop.load(Ordering::SeqCst) || inner.stopping.load(Ordering::Acquire);
    let gone = PeerHealth { busy: false, broken: true, free_slots: 0 };
    loop {
        if stopped() {
            *retired = old.and_then(Liveness::retire);
            return Err("the peer was disconnected".into());
        }
        let h = inner.cmds.call(|reply| Cmd::Query { peer, reply }).unwrap_or(gone);
        if !h.broken {
            // Nothing to do after all: the held posts go on its QPs.
            inner.cmds.send(Cmd::Resume { peer, failed: None });
            return Ok(old);
        }
        if !h.busy {
            break;
        }
        if Instant::now() > deadline {
            *retired = old.and_then(Liveness::retire);
            return Err(format!("QP did not drain in {budget:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    inner.cmds.call::<()>(|done| Cmd::Unplug { peer, done });
    // Its flushed WRITEs may still be in the fabric: the next hello to the
    // target has it fence that connection.
    inner.cut.note(&dial.secret, dial.conn.load(Ordering::SeqCst));
    // Closing the old control connection tells the target to drop its QPs
    // (and give back their receive completions) before the new hello.
    *retired = old.and_then(Liveness::retire);
    let (qps, control) = open_qps(inner, &dial.agent, &dial.addr, &dial.secret, dial.qps, dial.max_send_wr)
        .map_err(|e| e.to_string())?;
    dial.conn.store(control.conn, Ordering::SeqCst);
    if stopped() {
        return Err("the peer was disconnected".into());
    }
    let live = Liveness::watch(inner, peer, &dial.name, control.ch)?;
    tracing::info!("verbs: reconnected to {}", dial.name);
    inner.cmds.send(Cmd::Install { peer, name: dial.name.clone(), qps, slab: None, link: None });
    Ok(Some(live))
}

/// Create `n` send QPs of depth `max_send_wr`, handshake with `addr` as
/// `agent` (proving `secret`, naming the connections to it that closed:
/// the fence, `conn.rs`), bring them to RTS; the QPs, the control
/// connection and its id.
pub(super) fn open_qps<D: Device>(
    inner: &Inner<D>,
    agent: &str,
    addr: &str,
    secret: &AgentSecret,
    n: u32,
    max_send_wr: u32,
) -> Result<(Vec<D::Qp>, conn::Control), conn::HandshakeError> {
    let o = &inner.qp_options;
    let mut qps = Vec::new();
    let mut eps = Vec::new();
    for _ in 0..n {
        let qp = inner.nic.create_qp(max_send_wr, 1).map_err(|e| e.to_string())?;
        eps.push(inner.nic.endpoint(&qp, o).map_err(|e| e.to_string())?);
        qps.push(qp);
    }
    let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
    let replaces = inner.cut.pending(secret);
    let caller = conn::Caller { agent, session: inner.session, conn: id, replaces: &replaces };
    let (remote, ch) = conn::handshake(addr, &caller, secret, &eps, inner.config.peer_timeout)?;
    // Answered: the target fenced what the hello named.
    inner.cut.fenced(secret, &replaces);
    for ((qp, l), r) in qps.iter().zip(&eps).zip(&remote) {
        inner.nic.connect(qp, l, r, o).map_err(|e| e.to_string())?;
    }
    Ok((qps, conn::Control { ch, conn: id }))
}
