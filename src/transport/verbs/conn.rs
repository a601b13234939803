//! Connection management over TCP: the target's listener thread, the
//! initiator's handshake, and the liveness channel both sides keep open.
//!
//! The initiator says hello with its agent name, its session (random per
//! transport) and one [`QpEndpoint`] per QP; the target answers with a
//! random [`Nonce`] and requires [`auth::prove`]`(secret, nonce,
//! "<initiator agent>/verbs/<session>")` with the secret it published in its
//! connection info before it creates any QP or answers with QP numbers (a
//! wrong or missing proof is refused and logged); it then creates matching
//! QPs with posted receives for notifications, brings them to RTS and
//! answers with its own endpoints and its own proof of the secret over the
//! nonce the hello carried (version 5), which the initiator checks before it
//! connects a QP: a process that took over a dead target's handshake port
//! without its secret is refused (`refused (Impostor)`).
//!
//! The late-bytes fence (version 6): each hello carries a connection id
//! (`conn`, per initiator transport) and the ids of that initiator's
//! earlier connections to this target that closed while their WRITEs may
//! still be in the fabric (`replaces`: the initiator's [`CutLists`]). Before
//! it answers, the target moves the receive QPs of those connections of
//! the *same agent and session* to the error state ([`Served`],
//! `Cmd::FenceRecv`), where an RC responder drops every request that still
//! arrives: a flushed WRITE's late packets can no longer land over a
//! transfer that goes over the new QPs. Ids of other agents or sessions are
//! ignored.
//!
//! Two rules hold at the listener. A name is held by one session at a
//! time: while a peer's receive QPs are installed here, a proven hello
//! under its name from another session is refused with
//! [`Handshake::NameInUse`] (the initiator's `connect` fails
//! `TransportError::NameInUse`); the same session reconnecting is served,
//! and the name is free again once the peer's QPs are removed. And at most
//! `max_preauth` connections wait for their proof at once: a new one over
//! that closes the oldest still waiting ([`PreAuth`]).
//! The TCP connection stays open as the liveness channel: when it closes
//! (initiator gone, disconnected or reconnecting), the target destroys those
//! QPs; when the target's side closes (its process died), the initiator's
//! [`Liveness`] watcher fails that peer's QPs at once.
//!
//! Every thread here is owned: the listener joins the peer threads it
//! started (each looks at `stopping` at least every [`WATCH_MS`]), the
//! transport joins the listener and its watchers on drop. None of them
//! touches the QP state: they hand QPs to the engine and tell it what
//! happened with commands (`engine::Cmd`).

use std::collections::{HashMap, VecDeque};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Inner;
use super::device::Device;
use super::engine::Cmd;
use super::nic::{Nic, NicQp};
use super::progress::Handle;
use super::state::{NOTIF_SLOT_BYTES, NotifCredit, Qpn, RECV_BIT, RecvQp};
use crate::sidechannel::{SideChannel, SideChannelError};
use crate::transport::auth::{self, AgentSecret, Nonce};
use crate::transport::{PeerId, TransferFailure, TransportError};
use crate::verbs::QpEndpoint;

/// Receives posted per target QP (notifications in flight per QP; more
/// make the initiator's NIC retry on RNR, never lose one).
pub(super) const RECVS_PER_QP: u32 = 64;

/// Version of the handshake below; a target refuses any other. 2: QP
/// endpoints carry the responder READ depth (`QpEndpoint::rd_atom`); 3: the
/// target challenges the initiator ([`Handshake::Challenge`]); 4: the
/// hello carries the initiator's session, the proof covers it, and a name
/// held by another session is refused ([`Handshake::NameInUse`]); 5: the
/// hello carries the initiator's nonce and the accept the target's proof
/// over it ([`accept_context`]); 6: the hello carries its connection id
/// and the ids it replaces (the late-bytes fence, module docs).
pub(super) const HANDSHAKE_VERSION: u32 = 6;

/// Most connection ids one hello may name in `replaces` (and the most an
/// initiator keeps per target, the newest).
pub(crate) const MAX_REPLACES: usize = 256;

/// Targets an initiator keeps cut lists for ([`CutLists`]).
const MAX_CUT_TARGETS: usize = 1024;

/// How often (ms) a thread blocked on a liveness channel looks at its stop flag.
pub(super) const WATCH_MS: u64 = 100;

/// What the initiator proves knowledge of the target's secret for: its
/// name and its session.
fn auth_context(initiator: &str, session: u64) -> Vec<u8> {
    format!("{initiator}/verbs/{session:016x}").into_bytes()
}

/// What the target's proof in [`Handshake::Accept`] covers: the
/// initiator's name and session and the target's own challenge, so an
/// accept answers one hello.
fn accept_context(initiator: &str, session: u64, challenge: &Nonce) -> Vec<u8> {
    let mut c = format!("{initiator}/verbs-accept/{session:016x}/").into_bytes();
    c.extend_from_slice(&challenge.0);
    c
}

/// Handshake messages.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Handshake {
    /// Initiator → target.
    Hello {
        /// [`HANDSHAKE_VERSION`] of the initiator.
        version: u32,
        /// Initiator agent name.
        agent: String,
        /// One per QP.
        qps: Vec<QpEndpoint>,
        /// The initiator transport's session (random, the same on each of
        /// its connections; 0 from a version 3 initiator, refused anyway).
        #[serde(default)]
        session: u64,
        /// The initiator's nonce, for the target's proof in
        /// [`Handshake::Accept`] (absent before version 5, refused anyway).
        #[serde(default)]
        nonce: Option<Nonce>,
        /// This connection's id among the initiator session's (version 6).
        #[serde(default)]
        conn: u64,
        /// Ids of the session's earlier connections to this target whose
        /// receive QPs the target must fence before it answers (version 6).
        /// More than [`MAX_REPLACES`] fail the parse, before anything is
        /// allocated for them: the hello is dropped.
        #[serde(default, deserialize_with = "at_most_max_replaces")]
        replaces: Vec<u64>,
    },
    /// Target → initiator, after a hello: prove you know my secret.
    Challenge {
        /// Fresh random challenge.
        nonce: Nonce,
    },
    /// Initiator → target: [`auth::prove`] over the challenge.
    Proof {
        /// HMAC-SHA256 ([`auth::PROOF_BYTES`] bytes).
        proof: Vec<u8>,
    },
    /// Target → initiator: matching endpoints, same order, and
    /// [`auth::prove`]`(secret, hello nonce, accept_context(..))`.
    Accept {
        /// One per QP.
        qps: Vec<QpEndpoint>,
        /// The target's proof of its secret.
        #[serde(default)]
        proof: Vec<u8>,
    },
    /// Target → initiator: refused.
    Refuse {
        /// Why.
        reason: String,
    },
    /// Target → initiator, after a valid proof: refused because a peer
    /// under this agent name is connected now from another session.
    NameInUse {
        /// The agent name claimed.
        name: String,
    },
}

/// `Hello::replaces`, refusing more than [`MAX_REPLACES`] ids while
/// parsing (the hello is parsed before its proof).
fn at_most_max_replaces<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    struct Ids;
    impl<'de> serde::de::Visitor<'de> for Ids {
        type Value = Vec<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "at most {MAX_REPLACES} connection ids")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
            let mut ids = Vec::new();
            while let Some(id) = seq.next_element::<u64>()? {
                if ids.len() == MAX_REPLACES {
                    return Err(serde::de::Error::invalid_length(MAX_REPLACES + 1, &self));
                }
                ids.push(id);
            }
            Ok(ids)
        }
    }
    d.deserialize_seq(Ids)
}

/// Why the initiator's handshake failed.
#[derive(Debug)]
pub(super) enum HandshakeError {
    /// The target holds our name for another session now.
    NameInUse,
    /// The target took the connection but did not answer in time (a
    /// receive or send on the side channel timed out): may be retried.
    TimedOut(String),
    /// Anything else, in words.
    Failed(String),
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NameInUse => f.write_str("target refused: our agent name is connected there from another session"),
            Self::TimedOut(why) | Self::Failed(why) => f.write_str(why),
        }
    }
}

impl From<String> for HandshakeError {
    fn from(why: String) -> Self {
        Self::Failed(why)
    }
}

/// The agent names of the peers connected to this target now, each with
/// the session that holds it and how many of its connections have (or are
/// installing) receive QPs here: a reconnecting session may briefly hold
/// two.
#[derive(Default)]
pub(super) struct Names {
    held: std::sync::Mutex<HashMap<String, (u64, usize)>>,
}

impl Names {
    /// Hold `name` for `session`; `None` when another session holds it.
    fn claim<'a>(&'a self, name: &str, session: u64) -> Option<NameHold<'a>> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        match held.get_mut(name) {
            Some((s, _)) if *s != session => return None,
            Some((_, n)) => *n += 1,
            None => {
                held.insert(name.to_string(), (session, 1));
            }
        }
        Some(NameHold { names: self, name: name.to_string() })
    }

    /// Connections served now under `name`.
    #[cfg(test)]
    pub(super) fn connections(&self, name: &str) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).get(name).map_or(0, |&(_, n)| n)
    }
}

/// One connection's hold on its agent name; released on drop.
struct NameHold<'a> {
    names: &'a Names,
    name: String,
}

impl Drop for NameHold<'_> {
    fn drop(&mut self) {
        let mut held = self.names.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, n)) = held.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.name);
            }
        }
    }
}

/// Target side: the receive QPs of each connection served now, by the
/// initiator's agent name and session, for the fence a later hello of the
/// same agent and session asks for (`replaces`, module docs). A fence's
/// lookup and its `FenceRecv`, and a removal's `RemoveRecv` and its
/// forgetting, each happen under the one lock: a fence that finds a
/// connection reaches the engine before that connection's removal, so
/// before any QP that reuses its numbers exists.
#[derive(Default)]
pub(super) struct Served {
    by: Mutex<ServedMap>,
}

/// (agent, session) → its connections served now.
type ServedMap = HashMap<(String, u64), Vec<ServedConn>>;

/// One connection served now: its id (`Hello::conn`), its receive QPs,
/// whether they were fenced already (a retried hello fences and counts
/// them once), and a handle to its control socket (a fence shuts it, so
/// its thread removes the QPs and gives their CQEs back at once, also when
/// the initiator's close is held in the network).
struct ServedConn {
    conn: u64,
    qpns: Vec<Qpn>,
    fenced: bool,
    control: Option<SideChannel>,
}

impl Served {
    fn lock(&self) -> std::sync::MutexGuard<'_, ServedMap> {
        self.by.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connection `conn` of `agent`'s `session` has receive QPs `qpns` here
    /// (`control`: a handle to its control socket).
    fn add(&self, agent: &str, session: u64, conn: u64, qpns: &[Qpn], control: Option<SideChannel>) {
        let c = ServedConn { conn, qpns: qpns.to_vec(), fenced: false, control };
        self.lock().entry((agent.to_string(), session)).or_default().push(c);
    }

    /// Connection `conn` (receive QPs `qpns`, holding `cqes` CQEs) ended:
    /// have the engine remove its QPs and forget it.
    fn remove<Q: NicQp>(&self, cmds: &Handle<Q>, (agent, session): (&str, u64), conn: u64, qpns: Vec<Qpn>, cqes: u32) {
        let mut by = self.lock();
        let key = (agent.to_string(), session);
        if let Some(v) = by.get_mut(&key) {
            v.retain(|c| (c.conn, &c.qpns) != (conn, &qpns));
            if v.is_empty() {
                by.remove(&key);
            }
        }
        cmds.send(Cmd::RemoveRecv { qpns, cqes });
    }

    /// Have the engine fence the receive QPs of the connections `ids` of
    /// `agent`'s `session` and shut their control sockets; how many
    /// connections, and the channel on which the engine answers whether
    /// every QP is in error now (none when there were none).
    fn fence<Q: NicQp>(
        &self,
        cmds: &Handle<Q>,
        (agent, session): (&str, u64),
        ids: &[u64],
    ) -> (u64, Option<crossbeam_channel::Receiver<bool>>) {
        let mut by = self.lock();
        let Some(v) = by.get_mut(&(agent.to_string(), session)) else {
            return (0, None);
        };
        let (mut qpns, mut conns) = (Vec::new(), 0);
        for c in v.iter_mut().filter(|c| !c.fenced && ids.contains(&c.conn)) {
            c.fenced = true;
            qpns.extend_from_slice(&c.qpns);
            conns += 1;
            if let Some(s) = &c.control {
                s.shutdown();
            }
        }
        if conns == 0 {
            return (0, None);
        }
        let (done, rx) = crossbeam_channel::bounded(1);
        cmds.send(Cmd::FenceRecv { qpns, done });
        (conns, Some(rx))
    }

    /// The fence of `ids` failed: a later hello naming them tries again.
    fn unfence(&self, (agent, session): (&str, u64), ids: &[u64]) {
        if let Some(v) = self.lock().get_mut(&(agent.to_string(), session)) {
            v.iter_mut().filter(|c| ids.contains(&c.conn)).for_each(|c| c.fenced = false);
        }
    }
}

/// Initiator side: per target (by its connection secret), the ids of this
/// transport's connections to it that it cut (a reconnect, once the old QPs
/// are destroyed; a `disconnect`, also one that lands while a reconnect
/// runs) while their WRITEs may still be in the fabric; the next hello to that
/// target names them (`replaces`) and they are dropped once it was
/// answered. At most [`MAX_REPLACES`] per target (the newest) and
/// [`MAX_CUT_TARGETS`] targets. Shared by every connect of the transport,
/// so a `disconnect` + `connect` fences what the old connection left.
#[derive(Default)]
pub(super) struct CutLists {
    by: Mutex<HashMap<AgentSecret, VecDeque<u64>>>,
}

impl CutLists {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AgentSecret, VecDeque<u64>>> {
        self.by.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connection `conn` to `target` was cut (its QPs destroyed or about to
    /// be, on purpose); noted once.
    pub(super) fn note(&self, target: &AgentSecret, conn: u64) {
        let mut by = self.lock();
        if by.get(target).is_some_and(|l| l.contains(&conn)) {
            return;
        }
        if !by.contains_key(target) && by.len() >= MAX_CUT_TARGETS {
            // Past the bound an arbitrary other target's list goes: its
            // next hello fences nothing (the state before version 6).
            if let Some(k) = by.keys().next().cloned() {
                by.remove(&k);
            }
        }
        let list = by.entry(target.clone()).or_default();
        list.push_back(conn);
        while list.len() > MAX_REPLACES {
            list.pop_front();
        }
    }

    /// The ids the next hello to `target` names.
    pub(super) fn pending(&self, target: &AgentSecret) -> Vec<u64> {
        self.lock().get(target).map(|l| l.iter().copied().collect()).unwrap_or_default()
    }

    /// `target` answered a hello naming `ids`: it fenced them.
    pub(super) fn fenced(&self, target: &AgentSecret, ids: &[u64]) {
        let mut by = self.lock();
        if let Some(list) = by.get_mut(target) {
            list.retain(|c| !ids.contains(c));
            if list.is_empty() {
                by.remove(target);
            }
        }
    }
}

/// The listener's connections that have not yet proved the secret, oldest
/// first, each with a handle to its socket: at most `max` of them; a new
/// one over that shuts the oldest down (its thread then ends).
pub(super) struct PreAuth {
    max: usize,
    waiting: std::sync::Mutex<VecDeque<(u64, SideChannel)>>,
    next: std::sync::atomic::AtomicU64,
}

impl PreAuth {
    pub(super) fn new(max: usize) -> Self {
        Self { max: max.max(1), waiting: Default::default(), next: Default::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, SideChannel)>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Count a new connection (`sock`: a handle to its socket) as waiting
    /// for its proof, closing the oldest waiting ones past the bound.
    fn admit(self: &Arc<Self>, sock: SideChannel) -> Waiting {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut waiting = self.lock();
        while waiting.len() >= self.max {
            if let Some((_, old)) = waiting.pop_front() {
                tracing::debug!("verbs: closing a handshake still unauthenticated (max_preauth)");
                old.shutdown();
            }
        }
        waiting.push_back((id, sock));
        Waiting { list: self.clone(), id }
    }
}

/// A connection counted in [`PreAuth`] until it proved the secret or ended.
struct Waiting {
    list: Arc<PreAuth>,
    id: u64,
}

impl Waiting {
    /// Leave the waiting list; false when this connection was closed for a
    /// newer one meanwhile.
    fn leave(&self) -> bool {
        let mut waiting = self.list.lock();
        match waiting.iter().position(|(id, _)| *id == self.id) {
            Some(i) => {
                waiting.remove(i);
                true
            }
            None => false,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.leave();
    }
}

/// Accept handshakes until the transport stops. Running out of descriptors
/// or memory sleeps with a bounded backoff instead of spinning
/// ([`AcceptBackoff`]), and the loop recovers when they return.
pub(super) fn accept_loop<D: Device>(inner: Arc<Inner<D>>, listener: TcpListener) {
    let mut peers: Vec<JoinHandle<()>> = Vec::new();
    let mut backoff = crate::accept::AcceptBackoff::new("verbs handshake listener");
    loop {
        let conn = SideChannel::accept(&listener);
        if inner.stopping.load(Ordering::Acquire) {
            break;
        }
        // Reap the threads of initiators that left.
        let (done, live): (Vec<_>, Vec<_>) = peers.drain(..).partition(|t| t.is_finished());
        peers = live;
        done.into_iter().for_each(|t| drop(t.join()));
        let ch = match conn {
            Ok(ch) => {
                backoff.accepted();
                ch
            }
            // `accept` itself failed: back off on resource errors.
            Err(SideChannelError::Io { call: "accept", source }) => match backoff.failed(&source) {
                crate::accept::AfterError::Retry => continue,
                crate::accept::AfterError::Stop => break,
            },
            // Setting up the accepted socket failed: that connection only.
            Err(_) => continue,
        };
        // Counted until it proves the secret (`max_preauth`); a connection
        // whose socket cannot be duplicated is not served.
        let Ok(handle) = ch.try_clone() else {
            continue;
        };
        let waiting = inner.preauth.admit(handle);
        let inner = inner.clone();
        let spawned = std::thread::Builder::new().name("kvwire-verbs-peer".into()).spawn(move || {
            serve(&inner, ch, waiting);
        });
        match spawned {
            Ok(t) => peers.push(t),
            Err(e) => tracing::warn!("verbs: cannot serve a peer: {e}"),
        }
    }
    for t in peers {
        let _ = t.join();
    }
}

/// True for a receive that timed out (the channel is still open).
fn timed_out(e: &SideChannelError) -> bool {
    matches!(e, SideChannelError::Io { source, .. }
        if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

/// Challenge the initiator `agent` of `session`; the challenge when it
/// proved it knows our secret.
fn authenticate<D: Device>(inner: &Inner<D>, ch: &mut SideChannel, agent: &str, session: u64) -> Option<Nonce> {
    let Ok(nonce) = Nonce::random() else {
        let _ = ch.send(&Handshake::Refuse { reason: "no randomness for a challenge".into() });
        return None;
    };
    if ch.send(&Handshake::Challenge { nonce }).is_err() {
        return None;
    }
    let ok = match ch.recv::<Handshake>() {
        Ok(Handshake::Proof { proof }) => auth::verify(&inner.secret, &nonce, &auth_context(agent, session), &proof),
        _ => false,
    };
    if !ok {
        tracing::warn!("verbs: refusing {agent}: wrong or missing proof of the connection secret");
        let _ = ch.send(&Handshake::Refuse { reason: "authentication failed".into() });
    }
    ok.then_some(nonce)
}

/// Serve one handshake connection, counted in the pre-auth list (`waiting`,
/// which holds a handle to its socket and drops it when the connection
/// leaves the list) until it proved the secret.
fn serve<D: Device>(inner: &Inner<D>, mut ch: SideChannel, waiting: Waiting) {
    let _ = ch.set_read_timeout(Some(inner.config.peer_timeout));
    let (agent, remote, session, theirs, conn, replaces) = match ch.recv::<Handshake>() {
        Ok(Handshake::Hello { version, agent, .. }) if version != HANDSHAKE_VERSION => {
            let reason = format!("handshake version {version}, this side speaks {HANDSHAKE_VERSION}");
            tracing::warn!("verbs: refusing {agent}: {reason}");
            let _ = ch.send(&Handshake::Refuse { reason });
            return;
        }
        Ok(Handshake::Hello { agent, nonce: None, .. }) => {
            tracing::warn!("verbs: refusing {agent}: a version {HANDSHAKE_VERSION} hello without its nonce");
            let _ = ch.send(&Handshake::Refuse { reason: "hello without the initiator's nonce".into() });
            return;
        }
        Ok(Handshake::Hello { agent, qps, session, nonce: Some(n), conn, replaces, .. }) => {
            (agent, qps, session, n, conn, replaces)
        }
        Ok(Handshake::Proof { .. }) => {
            tracing::warn!("verbs: refusing a peer that sent a proof before its hello");
            return;
        }
        Ok(other) => {
            tracing::warn!("verbs: expected hello, got {other:?}");
            return;
        }
        Err(e) => {
            tracing::debug!("verbs: bad hello: {e}");
            return;
        }
    };
    let proven = authenticate(inner, &mut ch, &agent, session);
    // Closed for a newer connection while it proved: nothing more to say.
    let (true, Some(challenge)) = (waiting.leave(), proven) else {
        return;
    };
    drop(waiting);
    if remote.len() > MAX_QPS_PER_HELLO {
        let reason = format!("{} QPs asked for, at most {MAX_QPS_PER_HELLO}", remote.len());
        tracing::warn!("verbs: refusing {agent}: {reason}");
        let _ = ch.send(&Handshake::Refuse { reason });
        return;
    }
    // One session holds the name at a time: while this hold lives (until
    // our receive QPs for it are removed), another session's is refused.
    let Some(_name) = inner.names.claim(&agent, session) else {
        tracing::warn!("verbs: refusing {agent}: the name is connected here now from another session");
        let _ = ch.send(&Handshake::NameInUse { name: agent });
        return;
    };
    // The fence: the session's replaced connections drop whatever still
    // arrives for them before this one is answered.
    if let (conns, Some(done)) = inner.served.fence(&inner.cmds, (&agent, session), &replaces) {
        tracing::info!("verbs: {agent}: fencing {conns} replaced connection(s)");
        if done.recv() != Ok(true) {
            // Not answered: the initiator keeps the ids and names them
            // again (their QPs are gone once their threads saw the close).
            inner.served.unfence((&agent, session), &replaces);
            let reason = "cannot move the replaced connections' receive QPs to the error state".to_string();
            tracing::warn!("verbs: refusing {agent}: {reason}");
            let _ = ch.send(&Handshake::Refuse { reason });
            return;
        }
        inner.counters.fenced.fetch_add(conns, Ordering::Relaxed);
    }
    let mut qpns = Vec::new();
    let mut mine = Vec::new();
    let mut built = Vec::new();
    // Every posted receive can complete with a CQE on the shared CQ. An
    // initiator that reconnects closes its old connection just before, and
    // its old receives come back only once that connection's thread saw it
    // close: give them a moment before refusing.
    let cqes = RECVS_PER_QP * remote.len() as u32;
    let patience = Instant::now() + inner.config.peer_timeout.min(Duration::from_secs(2));
    let reserve = || inner.cmds.call(|reply| Cmd::ReserveRecv { cqes, reply }).unwrap_or(false);
    let mut reserved = reserve();
    while !reserved && Instant::now() < patience {
        std::thread::sleep(Duration::from_millis(10));
        reserved = reserve();
    }
    if !reserved {
        let reason = format!(
            "completion queue full: no room for {cqes} more receive completions (receives may hold half of it)"
        );
        tracing::warn!("verbs: refusing {agent}: {reason}");
        let _ = ch.send(&Handshake::Refuse { reason });
        return;
    }
    let result = (|| -> Result<(), TransportError> {
        for r in &remote {
            let (qp, ep, slab) = inner.new_recv_qp()?;
            inner.nic.connect(&qp, &ep, r, &inner.qp_options).map_err(super::setup_err)?;
            mine.push(ep);
            built.push((qp, slab));
        }
        Ok(())
    })();
    if let Err(e) = result {
        drop(built);
        inner.cmds.send(Cmd::ReleaseRecv { cqes });
        let _ = ch.send(&Handshake::Refuse { reason: e.to_string() });
        return;
    }
    // Receives are posted here, before the QPs go to the engine (which
    // reposts each after its completion).
    let mut recv = Vec::new();
    // One count for this peer's receive QPs: at most `notif_queue_count`
    // notifications (`notif_queue_bytes` bytes) of it in our queue; past
    // that the engine holds its receives back and its SENDs wait (RNR).
    let credit = Arc::new(NotifCredit::new(inner.notif_bounds.count, inner.notif_bounds.bytes));
    for (mut qp, slab) in built {
        let mut posted = 0;
        for slot in 0..RECVS_PER_QP {
            let (wr_id, len) = (RECV_BIT | u64::from(slot), NOTIF_SLOT_BYTES as u32);
            match qp.post_recv(wr_id, &slab, slot as usize * NOTIF_SLOT_BYTES, len) {
                Ok(()) => posted += 1,
                Err(e) => tracing::warn!("verbs: post_recv for {agent}: {e}"),
            }
        }
        qpns.push(Qpn(qp.qp_num()));
        recv.push(RecvQp::new(qp, agent.clone(), slab, credit.clone(), posted));
    }
    // Answered only once the engine holds the QPs: the initiator's first
    // notification may complete on our CQ as soon as it has our answer.
    inner.cmds.call::<()>(|done| Cmd::AddRecv { qps: recv, done });
    inner.served.add(&agent, session, conn, &qpns, ch.try_clone().ok());
    let proof = auth::prove(&inner.secret, &theirs, &accept_context(&agent, session, &challenge)).to_vec();
    if ch.send(&Handshake::Accept { qps: mine, proof }).is_ok() {
        // Wait until the initiator goes away (or this transport stops).
        let _ = ch.set_read_timeout(Some(Duration::from_millis(WATCH_MS)));
        while !inner.stopping.load(Ordering::Acquire) {
            match ch.recv::<Handshake>() {
                Ok(_) => {}
                Err(e) if timed_out(&e) => {}
                Err(_) => break,
            }
        }
    }
    inner.served.remove(&inner.cmds, (&agent, session), conn, qpns, cqes);
}

/// Most QPs one hello may ask for (`qps_per_peer` is at most 64).
pub(super) const MAX_QPS_PER_HELLO: usize = 64;

/// An initiator's open control connection and its id (`Hello::conn`).
pub(super) struct Control {
    pub(super) ch: SideChannel,
    pub(super) conn: u64,
}

/// Who says hello: the initiator's agent name and session, this
/// connection's id, and the ids it replaces (the fence, module docs).
#[derive(Clone, Copy)]
pub(super) struct Caller<'a> {
    pub(super) agent: &'a str,
    pub(super) session: u64,
    pub(super) conn: u64,
    pub(super) replaces: &'a [u64],
}

/// Initiator side: hello to `addr` with `local` endpoints, answering the
/// target's challenge with `secret` (from its connection info); returns the
/// target's endpoints and the open control connection.
pub(super) fn handshake(
    addr: &str,
    caller: &Caller<'_>,
    secret: &AgentSecret,
    local: &[QpEndpoint],
    timeout: Duration,
) -> Result<(Vec<QpEndpoint>, SideChannel), HandshakeError> {
    let Caller { agent, session, conn, replaces } = *caller;
    let fail = |e: SideChannelError| {
        if timed_out(&e) {
            HandshakeError::TimedOut(format!("handshake: {e}"))
        } else {
            HandshakeError::Failed(e.to_string())
        }
    };
    let mut ch = SideChannel::connect(addr, timeout).map_err(|e| e.to_string())?;
    ch.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let ours = Nonce::random().map_err(|e| e.to_string())?;
    let hello = Handshake::Hello {
        version: HANDSHAKE_VERSION,
        agent: agent.to_string(),
        qps: local.to_vec(),
        session,
        nonce: Some(ours),
        conn,
        replaces: replaces.to_vec(),
    };
    ch.send(&hello).map_err(fail)?;
    let mut answer = ch.recv::<Handshake>().map_err(fail)?;
    let mut challenge = None;
    if let Handshake::Challenge { nonce } = answer {
        let proof = auth::prove(secret, &nonce, &auth_context(agent, session)).to_vec();
        ch.send(&Handshake::Proof { proof }).map_err(fail)?;
        challenge = Some(nonce);
        answer = ch.recv::<Handshake>().map_err(fail)?;
    }
    match answer {
        // No QP is connected to an answer that does not prove the secret
        // of the connection info we dialled (another process on its port).
        Handshake::Accept { proof, .. }
            if !challenge.is_some_and(|c| auth::verify(secret, &ours, &accept_context(agent, session, &c), &proof)) =>
        {
            Err("refused (Impostor): the target did not prove the agent secret of its connection info \
                 (another process on its handshake port?)"
                .to_string()
                .into())
        }
        Handshake::Accept { qps, .. } if qps.len() == local.len() => Ok((qps, ch)),
        Handshake::Accept { qps, .. } => Err(format!("target answered {} QPs for {}", qps.len(), local.len()).into()),
        Handshake::Refuse { reason } => Err(format!("target refused: {reason}").into()),
        Handshake::NameInUse { .. } => Err(HandshakeError::NameInUse),
        other => Err(format!("unexpected {other:?} from the target").into()),
    }
}

/// The initiator's watch over one peer's liveness channel: a thread that
/// blocks on it and, when the target's side closes (its process died),
/// fails that peer's QPs at once ([`Cmd::FailPeer`]) instead of waiting
/// for the QPs' retries or the progress deadline. Dropping it stops the
/// watch (within [`WATCH_MS`]) and closes the channel; [`Liveness::join`]
/// waits for the thread.
pub(super) struct Liveness {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Liveness {
    /// Watch `ch` (the control connection of peer `peer`, named `name`).
    pub(super) fn watch<D: Device>(
        inner: &Arc<Inner<D>>,
        peer: PeerId,
        name: &str,
        mut ch: SideChannel,
    ) -> Result<Self, String> {
        ch.set_read_timeout(Some(Duration::from_millis(WATCH_MS))).map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let (inner, stop2, name) = (inner.clone(), stop.clone(), name.to_string());
        let thread = std::thread::Builder::new()
            .name("kvwire-verbs-live".into())
            .spawn(move || {
                let why = loop {
                    if stop2.load(Ordering::Acquire) || inner.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    match ch.recv::<Handshake>() {
                        Ok(_) => {}
                        Err(e) if timed_out(&e) => {}
                        Err(e) => break e,
                    }
                };
                if stop2.load(Ordering::Acquire) {
                    return;
                }
                tracing::warn!("verbs: liveness channel to {name} closed ({why}): failing its QPs");
                let f = TransferFailure::peer_died(format!("{name}: liveness channel closed ({why})"));
                inner.cmds.send(Cmd::FailPeer { peer, why: f });
            })
            .map_err(|e| e.to_string())?;
        Ok(Self { stop, thread: Some(thread) })
    }

    /// Stop watching and wait for the thread (at most about [`WATCH_MS`]).
    pub(super) fn join(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Stop watching; the thread ends (and closes the channel) on its own.
    /// Returns its handle for the owner to join later.
    pub(super) fn retire(mut self) -> Option<JoinHandle<()>> {
        self.stop.store(true, Ordering::Release);
        self.thread.take()
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// A target QP, its endpoint for the initiator and the slab its receives land in.
type RecvParts<D> = (<D as Nic>::Qp, QpEndpoint, Arc<<D as Nic>::Slab>);

impl<D: Device> Inner<D> {
    fn new_recv_qp(&self) -> Result<RecvParts<D>, TransportError> {
        let qp = self.nic.create_qp(4, RECVS_PER_QP).map_err(super::setup_err)?;
        let ep = self.nic.endpoint(&qp, &self.qp_options).map_err(super::setup_err)?;
        let slab = self
            .nic
            .alloc_slab(RECVS_PER_QP as usize * NOTIF_SLOT_BYTES)
            .map_err(|e| TransportError::Registration(e.to_string()))?;
        Ok((qp, ep, Arc::new(slab)))
    }
}

#[cfg(test)]
mod impostor_tests {
    use std::net::TcpListener;
    use std::time::Duration;

    use super::{Handshake, HandshakeError, accept_context, auth_context, handshake};
    use crate::sidechannel::SideChannel;
    use crate::transport::auth::{self, AgentSecret};
    use crate::verbs::QpEndpoint;

    /// A handshake port that answers one hello as a target would, with an
    /// accept whose proof is `proof(the real secret, agent, session,
    /// challenge, hello nonce)`; `handshake`'s result against it.
    fn against(
        proof: impl Fn(&AgentSecret, &str, u64, &auth::Nonce, &auth::Nonce) -> Vec<u8> + Send + 'static,
    ) -> Result<(), HandshakeError> {
        let secret = AgentSecret::random().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let real = secret.clone();
        let fake = std::thread::spawn(move || {
            let mut ch = SideChannel::accept(&l).unwrap();
            let Ok(Handshake::Hello { agent, qps, session, nonce: Some(theirs), .. }) = ch.recv::<Handshake>() else {
                panic!("no v5 hello");
            };
            let challenge = auth::Nonce::random().unwrap();
            ch.send(&Handshake::Challenge { nonce: challenge }).unwrap();
            let Ok(Handshake::Proof { proof: p }) = ch.recv::<Handshake>() else { panic!("no proof") };
            // the initiator proved the real secret: a target would serve it
            assert!(auth::verify(&real, &challenge, &auth_context(&agent, session), &p));
            let proof = proof(&real, &agent, session, &challenge, &theirs);
            ch.send(&Handshake::Accept { qps, proof }).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let local = vec![QpEndpoint { qpn: 7, psn: 1, gid: [0; 16], lid: 1, mtu: 3, rd_atom: 16 }; 2];
        let caller = super::Caller { agent: "init", session: 42, conn: 1, replaces: &[] };
        let r = handshake(&addr, &caller, &secret, &local, Duration::from_secs(5)).map(|_| ());
        fake.join().unwrap();
        r
    }

    /// The raw hello `tests/verbs_transport.rs` sends in the Soft-RoCE
    /// guest (`verbs_hello_without_a_proof_gets_no_qp_numbers`) is a
    /// version-6 hello with its nonce, so the refusal it sees is the proof
    /// check's, not a parse or version error.
    #[test]
    fn the_guest_tests_raw_hello_is_a_current_hello() {
        let qp = r#"{"qpn":1,"psn":1,"lid":0,"gid":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],"mtu":3,"rd_atom":1}"#;
        let nonce = vec!["7"; 16].join(",");
        let json =
            format!(r#"{{"Hello":{{"version":6,"agent":"mallory","session":1,"qps":[{qp}],"nonce":[{nonce}]}}}}"#);
        match serde_json::from_str::<Handshake>(&json).unwrap() {
            Handshake::Hello { version, nonce: Some(n), .. } => {
                assert_eq!(version, super::HANDSHAKE_VERSION);
                assert_eq!(n.0, [7; 16]);
            }
            other => panic!("{other:?}"),
        }
    }

    /// `replaces` past [`super::MAX_REPLACES`] fails the parse itself (the
    /// hello is parsed before its proof: nothing is allocated for more).
    #[test]
    fn a_hello_naming_more_than_max_replaces_does_not_parse() {
        let hello = |n: usize| {
            let ids: Vec<String> = (0..n).map(|i| i.to_string()).collect();
            let nonce = vec!["7"; 16].join(",");
            format!(
                r#"{{"Hello":{{"version":6,"agent":"a","session":1,"qps":[],"nonce":[{nonce}],"conn":9,"replaces":[{}]}}}}"#,
                ids.join(",")
            )
        };
        match serde_json::from_str::<Handshake>(&hello(super::MAX_REPLACES)).unwrap() {
            Handshake::Hello { conn: 9, replaces, .. } => assert_eq!(replaces.len(), super::MAX_REPLACES),
            other => panic!("{other:?}"),
        }
        let e = serde_json::from_str::<Handshake>(&hello(super::MAX_REPLACES + 1)).unwrap_err();
        assert!(e.to_string().contains("at most 256 connection ids"), "{e}");
        // A version 5 hello (no `conn`, no `replaces`) still parses (and is
        // refused by version).
        let v5 = r#"{"Hello":{"version":5,"agent":"a","session":1,"qps":[]}}"#;
        assert!(matches!(serde_json::from_str::<Handshake>(v5).unwrap(), Handshake::Hello { version: 5, .. }));
    }

    #[test]
    fn an_accept_that_does_not_prove_the_secret_connects_no_qp() {
        let other = AgentSecret::random().unwrap();
        for case in 0..2 {
            let other = other.clone();
            let r = against(move |_real, agent, session, challenge, theirs| match case {
                0 => vec![0; auth::PROOF_BYTES],
                _ => auth::prove(&other, theirs, &accept_context(agent, session, challenge)).to_vec(),
            });
            match r {
                Err(e) => assert!(e.to_string().contains("Impostor"), "case {case}: {e}"),
                Ok(()) => panic!("case {case}: an impostor's accept was taken"),
            }
        }
        // The control: the same fake proving the real secret is accepted.
        against(|real, agent, session, challenge, theirs| {
            auth::prove(real, theirs, &accept_context(agent, session, challenge)).to_vec()
        })
        .expect("a target holding the secret is accepted");
    }
}

#[cfg(test)]
mod cut_list_tests {
    use super::{CutLists, MAX_CUT_TARGETS, MAX_REPLACES};
    use crate::transport::auth::AgentSecret;

    fn target(n: u32) -> AgentSecret {
        let mut b = [0u8; crate::transport::auth::SECRET_BYTES];
        b[..4].copy_from_slice(&n.to_le_bytes());
        AgentSecret::from_bytes(b)
    }

    #[test]
    fn an_id_is_noted_once_and_leaves_when_fenced() {
        let cut = CutLists::default();
        let (a, b) = (target(1), target(2));
        cut.note(&a, 7);
        cut.note(&a, 9);
        cut.note(&a, 7);
        cut.note(&b, 7);
        assert_eq!(cut.pending(&a), [7, 9]);
        assert_eq!(cut.pending(&b), [7]);
        // a hello naming 7 was answered by `a`: `b`'s 7 stays
        cut.fenced(&a, &[7]);
        assert_eq!(cut.pending(&a), [9]);
        assert_eq!(cut.pending(&b), [7]);
        // ids the list does not hold, and an unknown target: nothing moves
        cut.fenced(&a, &[100]);
        cut.fenced(&target(3), &[9]);
        assert_eq!(cut.pending(&a), [9]);
        cut.fenced(&a, &[9]);
        assert!(cut.pending(&a).is_empty());
        assert!(!cut.lock().contains_key(&a), "an empty list is dropped");
    }

    #[test]
    fn a_target_keeps_its_newest_max_replaces_ids() {
        let cut = CutLists::default();
        let a = target(1);
        let n = MAX_REPLACES as u64 + 44;
        for id in 0..n {
            cut.note(&a, id);
        }
        let pending = cut.pending(&a);
        assert_eq!(pending.len(), MAX_REPLACES);
        assert_eq!(pending, (44..n).collect::<Vec<_>>(), "the oldest go first");
        // an id noted again while still listed does not move or repeat
        cut.note(&a, n - 1);
        assert_eq!(cut.pending(&a), (44..n).collect::<Vec<_>>());
    }

    #[test]
    fn at_most_max_cut_targets_lists_are_kept() {
        let cut = CutLists::default();
        for t in 0..MAX_CUT_TARGETS as u32 + 10 {
            cut.note(&target(t), u64::from(t));
            assert!(cut.lock().len() <= MAX_CUT_TARGETS);
        }
        assert_eq!(cut.lock().len(), MAX_CUT_TARGETS);
        // the target noted last is always kept, with its id
        let last = MAX_CUT_TARGETS as u32 + 9;
        assert_eq!(cut.pending(&target(last)), [u64::from(last)]);
        // a target already listed adds to its list without evicting another
        cut.note(&target(last), 1);
        assert_eq!(cut.lock().len(), MAX_CUT_TARGETS);
        assert_eq!(cut.pending(&target(last)), [u64::from(last), 1]);
    }
}
