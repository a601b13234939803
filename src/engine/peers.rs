//! Peer lifecycle beyond `connect`/`disconnect`: re-loading a known agent's
//! metadata, loopback to the agent's own name, dropping a peer found dead,
//! standalone notifications, and descriptor checks without posting.
//!
//! These are what NIXL's `nixlAgent` offers and its Python users rely on
//! (ai-dynamo/nixl `src/core/nixl_agent.cpp`: `loadRemoteMD`, `genNotif`,
//! `prepXferDlist`; vLLM's `NixlConnector`, SGLang's NIXL backend).

use std::time::{Duration, Instant};

use super::desc::{check_local_descs, check_remote_descs};
use super::metadata::MAX_NAME_BYTES;
use super::{AgentMetadata, Desc, EngineError, RemoteAgent, TransferEngine, TransferStatus, XferId};
use crate::transport::{Dial, Dialed, Op, PeerId, TransferFailure, TransportError};

/// Largest standalone notification payload (bytes): the smallest limit of
/// the transports (tcp's `MAX_NOTIFICATION_BYTES`, 64 KiB).
pub(super) const MAX_NOTIFY_BYTES: usize = 64 << 10;

/// How long `notify` waits for an earlier standalone notification to the
/// same agent before posting the next one anyway.
const NOTIFY_ORDER_WAIT: Duration = Duration::from_secs(30);

/// What [`TransferEngine::load_remote`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    /// A new agent: connected.
    Connected,
    /// A known agent with the same connection info and new regions: its
    /// regions were replaced by the newer list (kvwire metadata is always a
    /// full snapshot, so this is NIXL's merge).
    Updated,
    /// A known agent, nothing new (same regions, or an older generation).
    Unchanged,
}

/// What [`TransferEngine::begin_load`] found.
#[derive(Debug)]
#[must_use = "a dial does nothing until it is run and finished"]
pub enum LoadStep {
    /// Nothing to connect: the outcome (always [`LoadOutcome::Unchanged`]).
    Done(LoadOutcome),
    /// A connection is needed: run [`PendingLoad::dial`], then
    /// [`TransferEngine::finish_load`].
    Dial(PendingLoad),
}

/// A load waiting for its handshake, which runs without the engine.
#[derive(Debug)]
pub struct PendingLoad {
    meta: AgentMetadata,
    dial: Dial,
}

impl PendingLoad {
    /// The agent being loaded.
    pub fn name(&self) -> &str {
        &self.meta.name
    }

    /// Run the handshake on this thread (at most the transport's
    /// `peer_timeout`).
    ///
    /// # Errors
    /// [`EngineError::Transport`]: `Connect`, `NameInUse`, `Timeout` (with
    /// `op` `"connect"`); nothing is kept, a retry may succeed.
    pub fn dial(self) -> Result<DialedLoad, EngineError> {
        Ok(DialedLoad { dialed: self.dial.run()?, meta: self.meta })
    }
}

/// A load whose handshake finished, for [`TransferEngine::finish_load`].
/// Dropping it closes the connection.
#[derive(Debug)]
pub struct DialedLoad {
    meta: AgentMetadata,
    dialed: Dialed,
}

/// A standalone notification waiting for earlier transfers to its agent.
pub(super) struct PendingNotif {
    pub agent: String,
    payload: Vec<u8>,
    /// Transfers to `agent` that were in progress when it was sent.
    after: Vec<u64>,
}

/// The rule [`TransferEngine::new`] applies to agent names.
pub(super) fn check_agent_name(name: &str) -> Result<(), EngineError> {
    let reason = if name.is_empty() {
        "agent name is empty".to_string()
    } else if name.len() > MAX_NAME_BYTES {
        format!("agent name is {} bytes, the limit is {MAX_NAME_BYTES}", name.len())
    } else {
        return Ok(());
    };
    Err(EngineError::BadAgentName { name: name.chars().take(64).collect(), reason })
}

impl TransferEngine {
    /// Load a peer's metadata (NIXL `loadRemoteMD`): connect a new agent, or
    /// update a known one.
    ///
    /// For a known agent whose transport and connection info are unchanged,
    /// the regions are replaced by the newer list (NIXL merges; vLLM
    /// re-publishes after re-registering). Transfers already posted finish on
    /// the old connection; new posts use the new regions. Metadata of an
    /// older generation than the one loaded is ignored.
    ///
    /// This is [`TransferEngine::begin_load`], [`PendingLoad::dial`] and
    /// [`TransferEngine::finish_load`] in one call, so the engine is held
    /// while the peer answers its handshake; callers that share the engine
    /// behind a lock use the three steps and dial outside the lock.
    ///
    /// # Errors
    /// [`EngineError::MetadataConflict`] when the known agent's connection
    /// info or transport changed (NIXL's `NIXL_ERR_NOT_ALLOWED`: remove it
    /// first); as [`TransferEngine::connect`] otherwise.
    pub fn load_remote(&mut self, meta: &AgentMetadata) -> Result<LoadOutcome, EngineError> {
        match self.begin_load(meta)? {
            LoadStep::Done(outcome) => Ok(outcome),
            LoadStep::Dial(pending) => self.finish_load(pending.dial()?),
        }
    }

    /// The first step of [`TransferEngine::load_remote`]: check `meta`
    /// against what is loaded and, when a connection is needed, return the
    /// handshake to run without the engine ([`LoadStep::Dial`]). Nothing
    /// changes in the engine.
    ///
    /// Two dials of the same agent may both succeed; the second to finish
    /// is then dropped by [`TransferEngine::finish_load`] (its connection
    /// closes) unless it brings newer regions. Callers that dial from
    /// several threads dial one agent at a time to spare that work.
    ///
    /// # Errors
    /// As [`TransferEngine::load_remote`], less the handshake's own errors
    /// (those come from [`PendingLoad::dial`]).
    pub fn begin_load(&mut self, meta: &AgentMetadata) -> Result<LoadStep, EngineError> {
        meta.validate()?;
        if self.load_plan(meta)? == LoadOutcome::Unchanged {
            return Ok(LoadStep::Done(LoadOutcome::Unchanged));
        }
        let dial = self.transport.dial(&meta.name, &meta.connection_info, &meta.regions)?;
        Ok(LoadStep::Dial(PendingLoad { meta: meta.clone(), dial }))
    }

    /// The last step of [`TransferEngine::load_remote`]: install the
    /// connection of a [`DialedLoad`]. What is loaded is checked again, as
    /// it may have changed while the handshake ran: when another load of the
    /// agent finished first with the same or newer regions, this one's
    /// connection is closed and the answer is [`LoadOutcome::Unchanged`].
    ///
    /// # Errors
    /// [`EngineError::MetadataConflict`] when the agent was loaded meanwhile
    /// with other connection info; [`EngineError::Transport`]
    /// (`Unsupported`) when `dialed` comes from another engine; as
    /// [`TransferEngine::connect`] otherwise. Nothing is kept.
    pub fn finish_load(&mut self, dialed: DialedLoad) -> Result<LoadOutcome, EngineError> {
        let DialedLoad { meta, dialed } = dialed;
        let outcome = self.load_plan(&meta)?;
        if outcome == LoadOutcome::Unchanged {
            return Ok(outcome);
        }
        let peer = self.transport.install(dialed)?;
        // A dead peer of that name is replaced (its transport peer was
        // disconnected when it was found dead); a live one's connection
        // retires once its transfers end.
        if let Some(old) = self.remotes.insert(meta.name.clone(), RemoteAgent { peer, meta, dead: None })
            && old.dead.is_none()
        {
            self.retired.push(old.peer);
        }
        self.disconnect_idle_retired();
        Ok(outcome)
    }

    /// What loading `meta` would do now: `Connected` for a new agent or one
    /// found dead (a restarted peer under a dead one's name, or the dead
    /// one's metadata again: connect afresh, as NIXL reconnects on
    /// `loadRemoteMD` after the disconnect), `Updated` for newer regions of
    /// a live one, `Unchanged` otherwise.
    fn load_plan(&self, meta: &AgentMetadata) -> Result<LoadOutcome, EngineError> {
        let Some(known) = self.remotes.get(&meta.name).filter(|r| r.dead.is_none()) else {
            self.check_connectable(meta)?;
            return Ok(LoadOutcome::Connected);
        };
        if known.meta.connection_info != meta.connection_info || known.meta.transport != meta.transport {
            return Err(EngineError::MetadataConflict(meta.name.clone()));
        }
        if meta.generation < known.meta.generation || known.meta.regions == meta.regions {
            return Ok(LoadOutcome::Unchanged);
        }
        Ok(LoadOutcome::Updated)
    }

    /// The metadata loaded for `name`, if it is connected.
    pub fn remote_metadata(&self, name: &str) -> Option<&AgentMetadata> {
        self.remotes.get(name).map(|r| &r.meta)
    }

    /// True when `name`'s metadata is loaded (NIXL `checkRemoteMD` without
    /// descriptors). Stays true after the peer is found dead, until
    /// [`TransferEngine::disconnect`] removes it or a restarted peer's
    /// metadata replaces it (NIXL 1.5.1: `check_remote_metadata` of a dead
    /// agent is `True`).
    pub fn is_remote_loaded(&self, name: &str) -> bool {
        self.remotes.contains_key(name)
    }

    /// Why `name` was found dead, or `None` while it is alive (or unknown).
    pub fn remote_dead_reason(&self, name: &str) -> Option<&str> {
        self.remotes.get(name).and_then(|r| r.dead.as_deref())
    }

    /// Check that every descriptor lies inside one local registration,
    /// without posting (NIXL `prepXferDlist` on the local side).
    ///
    /// # Errors
    /// [`EngineError::EmptyDescriptor`], [`EngineError::LocalOutOfBounds`] —
    /// the first offending descriptor.
    pub fn check_local(&self, descs: &[Desc]) -> Result<(), EngineError> {
        check_local_descs(descs, &self.spans)
    }

    /// Check that every descriptor lies inside one region `agent` published
    /// (this agent's own registrations when `agent` is its own name), without
    /// posting (NIXL `prepXferDlist` on the remote side).
    ///
    /// # Errors
    /// [`EngineError::UnknownAgent`], [`EngineError::EmptyDescriptor`],
    /// [`EngineError::RemoteOutOfBounds`].
    pub fn check_remote(&self, agent: &str, descs: &[Desc]) -> Result<(), EngineError> {
        if agent == self.name {
            return check_local_descs(descs, &self.spans).map_err(|e| match e {
                EngineError::LocalOutOfBounds { index, addr, len_bytes } => {
                    EngineError::RemoteOutOfBounds { index, addr, len_bytes, agent: agent.to_string() }
                }
                other => other,
            });
        }
        let remote = self.remotes.get(agent).ok_or_else(|| EngineError::UnknownAgent(agent.to_string()))?;
        check_remote_descs(descs, &remote.meta.regions, agent)
    }

    /// Send a standalone notification to `agent` (NIXL `genNotif`): not tied
    /// to a transfer, binary-safe, at most 64 KiB (`MAX_NOTIFY_BYTES`).
    ///
    /// It reaches `agent` after the data of every transfer to it that is in
    /// progress now, and after earlier notifications to it. When such
    /// transfers are still moving, it is queued and sent by a later
    /// [`TransferEngine::progress`] (every status and notification query runs
    /// one) once they are done. `agent` may be this agent's own name.
    ///
    /// # Errors
    /// [`EngineError::UnknownAgent`]; [`EngineError::Transport`] when the
    /// payload is too large or the peer is gone.
    pub fn notify(&mut self, agent: &str, payload: Vec<u8>) -> Result<(), EngineError> {
        if payload.len() > MAX_NOTIFY_BYTES {
            return Err(crate::transport::TransportError::Post(format!(
                "notification of {} bytes exceeds the {MAX_NOTIFY_BYTES}-byte limit",
                payload.len()
            ))
            .into());
        }
        if agent == self.name {
            self.ensure_loopback()?;
        }
        self.remote_ref(agent)?;
        self.progress();
        let after: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, t)| !t.internal && t.remote == agent && t.status == TransferStatus::InProgress)
            .map(|(id, _)| *id)
            .collect();
        if !after.is_empty() || self.pending_notifs.iter().any(|p| p.agent == agent) {
            self.pending_notifs.push(PendingNotif { agent: agent.to_string(), payload, after });
            return Ok(());
        }
        self.wait_internal(agent);
        self.post_inner(Op::Write, &[], agent, &[], Some(payload), &mut Vec::new(), true).map(|_| ())
    }

    /// Wait (bounded) until earlier standalone notifications to `agent` are
    /// sent: one small message each, so this is short; it keeps them in order
    /// on transports that copy with several threads.
    fn wait_internal(&mut self, agent: &str) {
        let deadline = Instant::now() + NOTIFY_ORDER_WAIT;
        while self.internal_in_flight(agent) && Instant::now() < deadline {
            std::thread::yield_now();
            self.drain_transport();
        }
    }

    fn internal_in_flight(&self, agent: &str) -> bool {
        self.transfers.values().any(|t| t.internal && t.remote == agent && t.status == TransferStatus::InProgress)
    }

    /// Post the queued notifications whose earlier transfers are done.
    pub(super) fn send_ready_notifs(&mut self) {
        if self.pending_notifs.is_empty() {
            return;
        }
        let mut blocked: Vec<String> = Vec::new();
        let mut i = 0;
        while i < self.pending_notifs.len() {
            let p = &self.pending_notifs[i];
            let waiting =
                p.after.iter().any(|id| self.transfers.get(id).is_some_and(|t| t.status == TransferStatus::InProgress));
            if blocked.contains(&p.agent) || waiting {
                blocked.push(p.agent.clone());
                i += 1;
                continue;
            }
            let p = self.pending_notifs.remove(i);
            self.wait_internal(&p.agent);
            let sent = self.post_inner(Op::Write, &[], &p.agent, &[], Some(p.payload), &mut Vec::new(), true);
            if let Err(e) = sent {
                tracing::warn!("queued notification to {} dropped: {e}", p.agent);
            }
        }
    }

    /// The connected agent `name`, or the loopback connection for our own name.
    ///
    /// # Errors
    /// [`EngineError::UnknownAgent`]; [`TransportError::PeerDisconnected`]
    /// (as [`EngineError::Transport`]) when `name` was found dead.
    pub(super) fn remote_ref(&self, name: &str) -> Result<&RemoteAgent, EngineError> {
        let found = if name == self.name { self.loopback.as_ref() } else { self.remotes.get(name) };
        let r = found.ok_or_else(|| EngineError::UnknownAgent(name.to_string()))?;
        match &r.dead {
            Some(why) => Err(TransportError::PeerDisconnected(format!("agent {name}: {why}")).into()),
            None => Ok(r),
        }
    }

    /// Connect this agent to itself, or refresh that connection after the
    /// registrations changed (NIXL: `prepXferDlist(own name)` is loopback).
    pub(super) fn ensure_loopback(&mut self) -> Result<(), EngineError> {
        if self.loopback.as_ref().is_some_and(|l| l.meta.generation == self.generation) {
            return Ok(());
        }
        let meta = self.metadata();
        let peer = self.transport.connect(&self.name, &meta.connection_info, &meta.regions)?;
        if let Some(old) = self.loopback.replace(RemoteAgent { peer, meta, dead: None }) {
            self.retired.push(old.peer);
        }
        self.disconnect_idle_retired();
        Ok(())
    }

    /// Mark `name` dead after its transport `peer` was found dead: the rest
    /// of its in-progress transfers fail, queued notifications to it are
    /// dropped, its transport connection is closed, and later posts and
    /// notifications to it fail fast with `PeerDisconnected`. Its metadata
    /// stays loaded (`is_remote_loaded(name)` stays true) until the caller
    /// removes it with [`TransferEngine::disconnect`] or loads a restarted
    /// peer's metadata, as NIXL 1.5.1 does: vLLM's cleanup path checks
    /// `check_remote_metadata` and then calls `remove_remote_agent`, which
    /// must not fail. A no-op when `name` was re-loaded since or is already
    /// marked.
    pub(super) fn drop_dead_peer(&mut self, name: &str, peer: PeerId) {
        let current = if name == self.name { self.loopback.as_ref() } else { self.remotes.get(name) };
        if current.is_none_or(|r| r.peer != peer || r.dead.is_some()) {
            return;
        }
        if name == self.name {
            self.loopback = None;
        } else if let Some(r) = self.remotes.get_mut(name) {
            r.dead = Some("peer disconnected".to_string());
        }
        tracing::warn!("agent {name}: peer lost; transfers to it fail until it is removed or re-loaded");
        self.stats.link.disconnects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ids: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.peer == peer && t.status == TransferStatus::InProgress)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.transport.cancel(XferId(id));
            self.finish(id, Err(TransferFailure::peer_died(format!("peer {name} disconnected"))));
        }
        self.pending_notifs.retain(|n| n.agent != name);
        self.transport.disconnect(peer);
    }

    /// Disconnect retired transport peers that no transfer still uses.
    pub(super) fn disconnect_idle_retired(&mut self) {
        if self.retired.is_empty() {
            return;
        }
        let busy: Vec<PeerId> =
            self.transfers.values().filter(|t| t.status == TransferStatus::InProgress).map(|t| t.peer).collect();
        let (keep, idle): (Vec<PeerId>, Vec<PeerId>) = self.retired.drain(..).partition(|p| busy.contains(p));
        self.retired = keep;
        for p in idle {
            self.transport.disconnect(p);
        }
    }
}
