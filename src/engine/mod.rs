//! The NIXL-style transfer engine: one named agent over one transport.
//!
//! An agent registers memory, publishes [`AgentMetadata`], connects to peers
//! from theirs, and posts one-sided READ/WRITE transfers between descriptor
//! lists. Each post returns a [`TransferHandle`] whose [`TransferStatus`] is
//! `InProgress` until the transport resolves it to `Done` or `Failed`.
//! A notification, when given, reaches the peer only after all of the
//! transfer's data is visible in its memory.
//!
//! # Threading
//! Not thread-safe by design (`&mut self`, `!Sync`): one scheduler thread
//! drives an engine, as MAX's does. Transports run their own progress
//! threads, so data moves and notifications are delivered without the
//! initiator having to keep polling.
#![forbid(unsafe_code)]

pub mod desc;
pub mod error;
pub mod metadata;
mod peers;
mod telemetry;
#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use desc::Desc;
use desc::{LocalSpan, build_segments};
pub use error::{EngineError, MetadataError};
pub use metadata::AgentMetadata;
pub use peers::{DialedLoad, LoadOutcome, LoadStep, PendingLoad};
pub use telemetry::{FailureCause, XferTelemetry};

use crate::transport::{
    self, Completion, LocalKey, MemoryBacking, MemoryDesc, Notification, Op, PeerId, PostRequest, Registration,
    Segment, TransferFailure, Transport, TransportConfig, TransportKind, XferId,
};

/// Longest single block of [`TransferEngine::wait`] on the transport before
/// it looks at the transfer (and the engine's other duties) again.
const WAIT_SLICE: Duration = Duration::from_millis(10);
/// Status polls of [`TransferEngine::wait`] before it blocks: about 5 µs on
/// this project's 2-vCPU machine, longer than a one-page `shm` transfer
/// (page p50 1.7 µs, docs/perf-shm.md), so single pages keep their latency.
pub const WAIT_SPINS: u32 = 64;

/// A registration returned by [`TransferEngine::register`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegistrationHandle(LocalKey);

/// A posted transfer, valid until [`TransferEngine::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferHandle(pub u64);

/// Status of a transfer, as NIXL's `IN_PROG` / `SUCCESS` / error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferStatus {
    /// Still moving.
    InProgress,
    /// Every byte landed and the notification (if any) was sent.
    Done,
    /// Terminal failure, with its typed reason ([`TransferFailure::kind`]
    /// is what a scheduler branches on).
    Failed(TransferFailure),
}

struct LocalRegistration {
    desc: MemoryDesc,
    reg: Registration,
    _backing: Arc<dyn MemoryBacking>,
    inflight: u32,
}

struct RemoteAgent {
    peer: PeerId,
    meta: AgentMetadata,
    /// Set once the peer was found dead: why. The agent stays known (its
    /// metadata loaded, prep-time checks pass) and every post or
    /// notification to it fails fast with
    /// [`TransportError::PeerDisconnected`](transport::TransportError::PeerDisconnected)
    /// until the caller removes it or loads a restarted peer's metadata, as
    /// NIXL 1.5.1 keeps a disconnected agent's metadata until
    /// `invalidateRemoteMD`.
    dead: Option<String>,
}

struct TransferState {
    status: TransferStatus,
    remote: String,
    peer: PeerId,
    lkeys: Vec<LocalKey>,
    bytes: u64,
    /// Descriptors the caller passed (before coalescing).
    descs: u64,
    /// Wall clock at post start, µs since the Unix epoch.
    start_us: u64,
    posted: Instant,
    post_duration: Duration,
    /// Post start to the moment the engine saw the completion.
    xfer_duration: Option<Duration>,
    cause: Option<FailureCause>,
    /// A standalone notification: no user handle, dropped once terminal.
    internal: bool,
}

/// One NIXL-style agent. See the module docs.
pub struct TransferEngine {
    name: String,
    hostname: String,
    transport: Box<dyn Transport>,
    generation: u64,
    regs: Vec<LocalRegistration>,
    spans: Vec<LocalSpan>,
    remotes: HashMap<String, RemoteAgent>,
    transfers: HashMap<u64, TransferState>,
    next_xfer: u64,
    notifications: HashMap<String, Vec<Vec<u8>>>,
    /// Transport peers replaced by a metadata update or a loopback refresh,
    /// disconnected once no transfer of theirs is in progress.
    retired: Vec<PeerId>,
    /// This agent connected to itself, for transfers to its own name.
    loopback: Option<RemoteAgent>,
    /// Standalone notifications waiting for earlier transfers to that peer.
    pending_notifs: Vec<peers::PendingNotif>,
    scratch_completions: Vec<Completion>,
    scratch_notifs: Vec<Notification>,
    /// This agent's series in the process's metrics registry.
    stats: crate::metrics::AgentHandle,
    _not_sync: PhantomData<Cell<()>>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("name", &self.name)
            .field("transport", &self.transport.kind())
            .field("registrations", &self.regs.len())
            .field("remotes", &self.remotes.len())
            .field("transfers", &self.transfers.len())
            .finish()
    }
}

impl TransferEngine {
    /// Create agent `name` over a new transport of `kind`.
    ///
    /// `name` must be 1..=[`metadata::MAX_NAME_BYTES`] (255) bytes, the bound
    /// [`AgentMetadata`] enforces on the wire (NIXL refuses an empty name).
    ///
    /// # Errors
    /// [`EngineError::BadAgentName`]; [`EngineError::Transport`] when the
    /// backend is unavailable here.
    pub fn new(name: &str, kind: TransportKind, config: &TransportConfig) -> Result<Self, EngineError> {
        peers::check_agent_name(name)?;
        let started = Instant::now();
        let transport = transport::create(kind, name, config)?;
        Ok(Self::build(name, transport, &config.nic_label(kind), started))
    }

    /// Create agent `name` over an existing transport.
    pub fn with_transport(name: &str, transport: Box<dyn Transport>) -> Self {
        let nic = transport.kind().to_string();
        Self::build(name, transport, &nic, Instant::now())
    }

    fn build(name: &str, transport: Box<dyn Transport>, nic: &str, started: Instant) -> Self {
        let stats = crate::metrics::global().agent(name, &transport.kind().to_string(), nic, started.elapsed());
        Self {
            stats,
            name: name.to_string(),
            hostname: metadata::hostname(),
            transport,
            generation: 0,
            regs: Vec::new(),
            spans: Vec::new(),
            remotes: HashMap::new(),
            transfers: HashMap::new(),
            next_xfer: 1,
            notifications: HashMap::new(),
            retired: Vec::new(),
            loopback: None,
            pending_notifs: Vec::new(),
            scratch_completions: Vec::new(),
            scratch_notifs: Vec::new(),
            _not_sync: PhantomData,
        }
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The transport backend in use.
    pub fn transport_kind(&self) -> TransportKind {
        self.transport.kind()
    }

    /// Register memory for transfers. The engine keeps `backing` alive until
    /// [`TransferEngine::deregister`].
    ///
    /// Registrations may overlap, be contained in one another or repeat an
    /// earlier one exactly, as NIXL 1.5.1's `registerMem` accepts them
    /// (`nixlLocalSection::addDescList` keeps each one, unchecked, in its
    /// sorted list). Each is its own registration with its own handle and
    /// bounds: a descriptor must lie inside one registration, so one that
    /// spans two overlapping registrations without lying inside either is
    /// [`EngineError::LocalOutOfBounds`] (or, on the peer's side,
    /// [`EngineError::RemoteOutOfBounds`]), as for any unregistered byte.
    /// Memory stays registered while any registration covering it lives.
    ///
    /// # Errors
    /// [`EngineError::EmptyRegistration`]; [`EngineError::Transport`] when
    /// the backend refuses it (on shm with `cma=deny`, a range that is not
    /// a whole `HostBuffer` no other registration exports).
    pub fn register(&mut self, backing: Arc<dyn MemoryBacking>) -> Result<RegistrationHandle, EngineError> {
        Ok(self.register_batch(vec![backing])?.remove(0))
    }

    /// Register a list (NIXL's `registerMem` of a descriptor list), all or
    /// nothing; the handles come back in the order given, each
    /// deregistrable on its own. The transport sees the whole list at once
    /// ([`Transport::register_batch`]): on verbs, views of a few
    /// allocations become one memory region per allocation. Work: O(k log k)
    /// for k ranges plus one pass over the registration table. Ranges may
    /// overlap one another and earlier registrations, as in
    /// [`TransferEngine::register`].
    ///
    /// # Errors
    /// As [`TransferEngine::register`], for the first range at fault.
    pub fn register_batch(
        &mut self,
        backings: Vec<Arc<dyn MemoryBacking>>,
    ) -> Result<Vec<RegistrationHandle>, EngineError> {
        let mut descs: Vec<MemoryDesc> = Vec::with_capacity(backings.len());
        for b in &backings {
            let desc = b.desc();
            desc.end().filter(|_| desc.len_bytes > 0).ok_or(EngineError::EmptyRegistration { addr: desc.addr })?;
            descs.push(desc);
        }
        let began = Instant::now();
        let regs = self.transport.register_batch(backings.clone())?;
        let took = began.elapsed();
        let bytes: u64 = descs.iter().map(|d| d.len_bytes).sum();
        crate::metrics::global().registered_many(&self.stats, descs.len() as u64, bytes, took);
        let handles = regs.iter().map(|r| RegistrationHandle(r.lkey)).collect();
        let mut added: Vec<LocalRegistration> = backings
            .into_iter()
            .zip(regs)
            .map(|(b, reg)| LocalRegistration { desc: b.desc(), reg, _backing: b, inflight: 0 })
            .collect();
        if added.len() == 1 {
            // After every registration starting at or below it: equal starts
            // keep registration order.
            let pos = self.regs.partition_point(|r| r.desc.addr <= added[0].desc.addr);
            let r = added.remove(0);
            let span = LocalSpan { addr: r.desc.addr, end: r.desc.addr + r.desc.len_bytes, lkey: r.reg.lkey };
            self.regs.insert(pos, r);
            self.spans.insert(pos, span);
        } else {
            self.regs.append(&mut added);
            // Stable: equal starts keep registration order.
            self.regs.sort_by_key(|r| r.desc.addr);
            self.rebuild_spans();
        }
        self.registrations_changed();
        Ok(handles)
    }

    /// Deregister memory. Bytes that another registration also covers stay
    /// registered through it (an overlapping or identical registration, or
    /// on verbs a memory region it shares); NIXL's `deregisterMem` likewise
    /// removes exactly the one registration named.
    ///
    /// # Errors
    /// [`EngineError::UnknownRegistration`], [`EngineError::RegistrationInUse`]
    /// while a transfer that uses it, or uses a registration overlapping it,
    /// is not terminal (on shm, ending a registration whose buffer was
    /// handed to a peer re-homes the buffer's pages, which a copy through an
    /// overlapping registration must not race).
    pub fn deregister(&mut self, handle: RegistrationHandle) -> Result<(), EngineError> {
        self.progress();
        let pos = self.regs.iter().position(|r| r.reg.lkey == handle.0).ok_or(EngineError::UnknownRegistration)?;
        let (addr, end) = (self.regs[pos].desc.addr, self.regs[pos].desc.addr + self.regs[pos].desc.len_bytes);
        // `regs` is sorted by start: those starting before `end` may overlap.
        let busy: Vec<LocalKey> = self.regs[..self.regs.partition_point(|r| r.desc.addr < end)]
            .iter()
            .filter(|r| r.desc.addr + r.desc.len_bytes > addr && r.inflight > 0)
            .map(|r| r.reg.lkey)
            .collect();
        if !busy.is_empty() {
            let inflight = self
                .transfers
                .values()
                .filter(|t| t.status == TransferStatus::InProgress && t.lkeys.iter().any(|k| busy.contains(k)))
                .count();
            return Err(EngineError::RegistrationInUse { inflight: u32::try_from(inflight).unwrap_or(u32::MAX) });
        }
        self.transport.deregister(handle.0)?;
        self.regs.remove(pos);
        self.spans.remove(pos);
        self.registrations_changed();
        Ok(())
    }

    /// Registrations and memory regions now (on verbs, several
    /// registrations may share one memory region; elsewhere the two are
    /// equal). Their ratio is the coalescing ratio.
    pub fn region_counts(&self) -> (usize, usize) {
        (self.regs.len(), self.transport.memory_regions().unwrap_or(self.regs.len()))
    }

    fn registrations_changed(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        let (regs, mrs) = self.region_counts();
        self.stats.regions.store(regs as u64, Relaxed);
        self.stats.memory_regions.store(mrs as u64, Relaxed);
        self.generation += 1;
    }

    fn rebuild_spans(&mut self) {
        self.spans = self
            .regs
            .iter()
            .map(|r| LocalSpan { addr: r.desc.addr, end: r.desc.addr + r.desc.len_bytes, lkey: r.reg.lkey })
            .collect();
    }

    /// This agent's metadata, to hand to peers (take it after registering).
    pub fn metadata(&self) -> AgentMetadata {
        AgentMetadata {
            name: self.name.clone(),
            hostname: self.hostname.clone(),
            transport: self.transport.kind(),
            generation: self.generation,
            connection_info: self.transport.connection_info(),
            regions: self
                .regs
                .iter()
                .map(|r| transport::RemoteRegion {
                    addr: r.desc.addr,
                    len_bytes: r.desc.len_bytes,
                    rkey: r.reg.rkey,
                    kind: r.desc.kind,
                    device_id: r.desc.device_id,
                })
                .collect(),
        }
    }

    /// Connect to a peer from its metadata (NIXL `loadRemoteMD` + connection).
    ///
    /// # Errors
    /// [`EngineError::Metadata`], [`EngineError::SelfConnect`],
    /// [`EngineError::AlreadyConnected`], [`EngineError::TransportMismatch`],
    /// [`EngineError::Transport`] (connection refused, other host for `shm`).
    pub fn connect(&mut self, meta: &AgentMetadata) -> Result<(), EngineError> {
        meta.validate()?;
        if self.remotes.get(&meta.name).is_some_and(|r| r.dead.is_none()) {
            return Err(EngineError::AlreadyConnected(meta.name.clone()));
        }
        self.check_connectable(meta)?;
        let peer = self.transport.connect(&meta.name, &meta.connection_info, &meta.regions)?;
        // A dead peer of that name is replaced (its transport peer was
        // disconnected when it was found dead).
        self.remotes.insert(meta.name.clone(), RemoteAgent { peer, meta: meta.clone(), dead: None });
        Ok(())
    }

    /// `meta` names another agent on this engine's transport.
    fn check_connectable(&self, meta: &AgentMetadata) -> Result<(), EngineError> {
        if meta.name == self.name {
            return Err(EngineError::SelfConnect(meta.name.clone()));
        }
        if meta.transport != self.transport.kind() {
            return Err(EngineError::TransportMismatch {
                peer: meta.name.clone(),
                local: self.transport.kind().to_string(),
                remote: meta.transport.to_string(),
            });
        }
        Ok(())
    }

    /// True when `name` is connected and not found dead.
    pub fn is_connected(&self, name: &str) -> bool {
        self.remotes.get(name).is_some_and(|r| r.dead.is_none())
    }

    /// Disconnect a peer: in-flight transfers to it are cancelled (they turn
    /// `Failed`), and `connect` accepts the name again afterwards. A peer
    /// found dead is removed the same way, without error (NIXL 1.5.1's
    /// `invalidateRemoteMD` of a disconnected agent succeeds).
    ///
    /// # Errors
    /// [`EngineError::UnknownAgent`] when `name` was never loaded or was
    /// already removed.
    pub fn disconnect(&mut self, name: &str) -> Result<(), EngineError> {
        let remote = self.remotes.remove(name).ok_or_else(|| EngineError::UnknownAgent(name.to_string()))?;
        if remote.dead.is_some() {
            // Its transfers already failed and its transport peer is gone.
            self.pending_notifs.retain(|n| n.agent != name);
            self.disconnect_idle_retired();
            return Ok(());
        }
        let ids: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.remote == name && t.status == TransferStatus::InProgress)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.transport.cancel(XferId(id));
            self.finish(
                id,
                Err(TransferFailure::cancelled(format!("{}: agent {name} was removed", telemetry::REMOVED))),
            );
        }
        self.pending_notifs.retain(|n| n.agent != name);
        self.transport.disconnect(remote.peer);
        self.disconnect_idle_retired();
        Ok(())
    }

    /// Post a one-sided transfer between `local` and `remote` descriptor lists
    /// (paired by index) to `remote_agent`, with an optional notification
    /// delivered to that agent after all data is visible there.
    ///
    /// # Errors
    /// [`EngineError::UnknownAgent`], [`EngineError::DescCountMismatch`],
    /// [`EngineError::LengthMismatch`], [`EngineError::EmptyDescriptor`],
    /// [`EngineError::LocalOutOfBounds`], [`EngineError::RemoteOutOfBounds`],
    /// [`EngineError::Transport`]. Nothing moves when an error is returned.
    pub fn post(
        &mut self,
        op: Op,
        local: &[Desc],
        remote_agent: &str,
        remote: &[Desc],
        notification: Option<Vec<u8>>,
    ) -> Result<TransferHandle, EngineError> {
        let mut segments = Vec::new();
        self.post_with(op, local, remote_agent, remote, notification, &mut segments)
    }

    /// [`TransferEngine::post`] building the coalesced segments in the caller's
    /// buffer, whose allocation then moves to the transport with the request
    /// (`segments` is left empty); callers that keep a buffer of the right
    /// capacity around save the reallocations while it grows.
    ///
    /// # Errors
    /// As [`TransferEngine::post`].
    pub fn post_with(
        &mut self,
        op: Op,
        local: &[Desc],
        remote_agent: &str,
        remote: &[Desc],
        notification: Option<Vec<u8>>,
        segments: &mut Vec<Segment>,
    ) -> Result<TransferHandle, EngineError> {
        self.post_inner(op, local, remote_agent, remote, notification, segments, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn post_inner(
        &mut self,
        op: Op,
        local: &[Desc],
        remote_agent: &str,
        remote: &[Desc],
        notification: Option<Vec<u8>>,
        segments: &mut Vec<Segment>,
        internal: bool,
    ) -> Result<TransferHandle, EngineError> {
        let posted = Instant::now();
        let start_us = telemetry::unix_us();
        if remote_agent == self.name {
            self.ensure_loopback()?;
        }
        if segments.capacity() < local.len()
            && let Some(spare) = self.transport.spare_segments()
        {
            *segments = spare;
        }
        let agent = self.remote_ref(remote_agent)?;
        build_segments(local, remote, &self.spans, &agent.meta.regions, remote_agent, segments)?;
        let peer = agent.peer;
        let id = self.next_xfer;
        let mut lkeys: Vec<LocalKey> = Vec::with_capacity(1);
        let nsegs = segments.len() as u64;
        let mut bytes = 0u64;
        for s in segments.iter() {
            bytes += s.len_bytes;
            if !lkeys.contains(&s.lkey) {
                lkeys.push(s.lkey);
            }
        }
        let posted_ok = self.transport.post(PostRequest {
            xfer: XferId(id),
            op,
            peer,
            segments: std::mem::take(segments),
            notification,
        });
        if let Err(e) = posted_ok {
            if matches!(e, transport::TransportError::PeerDisconnected(_)) {
                self.drop_dead_peer(remote_agent, peer);
            }
            return Err(e.into());
        }
        let post_duration = posted.elapsed();
        if !internal {
            self.stats.link.posted(local.len() as u64, nsegs, bytes);
        }
        self.next_xfer += 1;
        for k in &lkeys {
            if let Some(r) = self.regs.iter_mut().find(|r| r.reg.lkey == *k) {
                r.inflight += 1;
            }
        }
        self.transfers.insert(
            id,
            TransferState {
                status: TransferStatus::InProgress,
                remote: remote_agent.to_string(),
                peer,
                lkeys,
                bytes,
                descs: local.len() as u64,
                start_us,
                posted,
                post_duration,
                xfer_duration: None,
                cause: None,
                internal,
            },
        );
        Ok(TransferHandle(id))
    }

    fn finish(&mut self, id: u64, result: Result<(), TransferFailure>) {
        let Some(t) = self.transfers.get_mut(&id) else { return };
        if t.status != TransferStatus::InProgress {
            return;
        }
        t.xfer_duration = Some(t.posted.elapsed());
        let mut lost = None;
        t.status = match result {
            Ok(()) => TransferStatus::Done,
            Err(reason) => {
                let cause = telemetry::classify(&reason);
                if reason.kind == transport::FailureKind::PeerTimeout {
                    self.stats.link.stalls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                if cause == FailureCause::PeerLost {
                    lost = Some((t.remote.clone(), t.peer));
                }
                t.cause = Some(cause);
                TransferStatus::Failed(reason)
            }
        };
        for k in &t.lkeys {
            if let Some(r) = self.regs.iter_mut().find(|r| r.reg.lkey == *k) {
                r.inflight = r.inflight.saturating_sub(1);
            }
        }
        if let Some((name, peer)) = lost {
            self.drop_dead_peer(&name, peer);
        }
    }

    /// Drain transport completions and notifications. Called by every status
    /// and notification query; never blocks.
    pub fn progress(&mut self) {
        self.drain_transport();
        self.transfers.retain(|_, t| !(t.internal && t.status != TransferStatus::InProgress));
        self.send_ready_notifs();
        self.disconnect_idle_retired();
    }

    /// Take the transport's completions (with those [`TransferEngine::wait`]
    /// left in the scratch list) and notifications.
    fn drain_transport(&mut self) {
        let mut done = std::mem::take(&mut self.scratch_completions);
        self.transport.poll(&mut done);
        for c in done.drain(..) {
            self.finish(c.xfer.0, c.result);
        }
        self.scratch_completions = done;
        let mut notifs = std::mem::take(&mut self.scratch_notifs);
        self.transport.take_notifications(&mut notifs);
        for n in notifs.drain(..) {
            self.notifications.entry(n.from_agent).or_default().push(n.payload);
        }
        self.scratch_notifs = notifs;
    }

    /// Status of a transfer (NIXL `getXferStatus`). Terminal states stick.
    ///
    /// # Errors
    /// [`EngineError::UnknownHandle`].
    pub fn status(&mut self, handle: TransferHandle) -> Result<TransferStatus, EngineError> {
        if let Some(t) = self.transfers.get(&handle.0)
            && t.status != TransferStatus::InProgress
        {
            return Ok(t.status.clone());
        }
        self.progress();
        self.transfers.get(&handle.0).map(|t| t.status.clone()).ok_or(EngineError::UnknownHandle(handle.0))
    }

    /// Wait until a transfer leaves [`TransferStatus::InProgress`] or
    /// `timeout` passes, and return its status (`InProgress` on timeout; the
    /// handle stays yours to release). It polls [`status`](Self::status)
    /// [`WAIT_SPINS`] times (a one-page transfer is done within them), then
    /// sleeps on the transport's completion channel ([`Transport::wait`])
    /// between checks instead of spinning, so where cores are few (the Soft-RoCE guest, a
    /// 2-core host) they stay with the progress and copy threads doing the
    /// work. NIXL has no such call (its callers poll `getXferStatus`, which
    /// [`status`](Self::status) is); MAX's `sync_and_release` is this wait
    /// followed by the release. `timeout` is wall time; zero checks once,
    /// [`Duration::MAX`] waits without limit.
    ///
    /// # Errors
    /// [`EngineError::UnknownHandle`].
    pub fn wait(&mut self, handle: TransferHandle, timeout: Duration) -> Result<TransferStatus, EngineError> {
        let deadline = Instant::now().checked_add(timeout);
        let mut spins = 0;
        loop {
            let status = self.status(handle)?;
            let now = Instant::now();
            let left = deadline.map_or(WAIT_SLICE, |d| d.saturating_duration_since(now));
            if status != TransferStatus::InProgress || left.is_zero() {
                return Ok(status);
            }
            if spins < WAIT_SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            // What arrives stays in the scratch list: the next `status` call
            // (the transfer is still in progress in the table) runs
            // `progress`, which finishes it with whatever else the transport
            // has and sends the notifications queued behind those transfers.
            self.transport.wait(&mut self.scratch_completions, left.min(WAIT_SLICE));
        }
    }

    /// A [`CompletionSignal`](transport::CompletionSignal) on this
    /// engine's transport, for a caller that shares the engine between
    /// threads behind a lock: check [`status`](Self::status) under the lock,
    /// then, still in progress, sleep on the signal with the lock released
    /// (bounded slices: a wake is a hint, and failures found only by
    /// [`progress`](Self::progress) ring nothing), so that other threads
    /// post and poll meanwhile. [`wait`](Self::wait) is the same for a
    /// caller that owns the engine. `None` for a transport without a
    /// completion channel (sleep briefly between checks instead).
    pub fn completion_signal(&self) -> Option<transport::CompletionSignal> {
        self.transport.completion_signal()
    }

    /// Bytes a transfer moves.
    ///
    /// # Errors
    /// [`EngineError::UnknownHandle`].
    pub fn transfer_bytes(&self, handle: TransferHandle) -> Result<u64, EngineError> {
        self.transfers.get(&handle.0).map(|t| t.bytes).ok_or(EngineError::UnknownHandle(handle.0))
    }

    /// Release a handle. An in-progress transfer is cancelled first, and this
    /// returns only once nothing can still touch its buffers (some data may
    /// have landed; no notification is sent).
    ///
    /// # Errors
    /// [`EngineError::UnknownHandle`].
    pub fn release(&mut self, handle: TransferHandle) -> Result<(), EngineError> {
        let in_progress = match self.transfers.get(&handle.0) {
            None => return Err(EngineError::UnknownHandle(handle.0)),
            Some(t) => t.status == TransferStatus::InProgress,
        };
        if in_progress {
            self.transport.cancel(XferId(handle.0));
            self.finish(
                handle.0,
                Err(TransferFailure::cancelled(format!("{}: released while in progress", telemetry::RELEASED))),
            );
        }
        self.transfers.remove(&handle.0);
        Ok(())
    }

    /// Take the notifications received so far, per sender agent (NIXL `getNotifs`).
    pub fn get_notifs(&mut self) -> HashMap<String, Vec<Vec<u8>>> {
        self.progress();
        std::mem::take(&mut self.notifications)
    }

    /// Number of handles not yet released.
    pub fn num_transfers(&self) -> usize {
        self.transfers.len()
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        crate::metrics::global().agent_dropped(&self.stats);
        // Cancel what is still moving so no copy outlives the registrations.
        let ids: Vec<u64> =
            self.transfers.iter().filter(|(_, t)| t.status == TransferStatus::InProgress).map(|(id, _)| *id).collect();
        for id in ids {
            self.transport.cancel(XferId(id));
        }
        // Let go of the backings before the transport ends its
        // registrations: memory nobody else holds is then freed with them,
        // not re-homed first (shm, issue 27 item 4; the transport keeps its
        // own reference until then).
        self.regs.clear();
    }
}
