//! Transfers and completion of [`KVTransferEngine`] (MAX `transfer_engine.py`'s
//! `initiate_send_transfer`, `is_complete`, `sync_and_release`).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::engine::{KVTransferEngine, RemoteEngine, Telemetry};
use super::error::{KvError, Side};
use super::metadata::engine_of_agent;
use super::reqdata::{PageIdxs, TransferReqData};
use super::topology::transfer_shard_pairing;
use crate::engine::{Desc, TransferHandle, TransferStatus};
use crate::metrics::MetricOp;
use crate::transport::Op;

/// Longest single sleep of [`KVTransferEngine::sync_and_release`] on one
/// shard's transport before it checks every shard (and the deadline) again.
const WAIT_STEP: Duration = Duration::from_millis(10);
/// The deadline used when a timeout does not fit an `Instant` (a year).
const NO_LIMIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Resolve one side's page lists to one list per group, checking the leaf set.
fn leaf_lists<'a>(idxs: &'a PageIdxs, leaf_ids: &[String], side: Side) -> Result<Vec<&'a [u64]>, KvError> {
    if let PageIdxs::PerLeaf(m) = idxs {
        for (k, _) in m {
            if !leaf_ids.contains(k) {
                return Err(KvError::UnknownLeaf { side, leaf: k.clone() });
            }
        }
    }
    leaf_ids.iter().map(|l| idxs.get(l).ok_or_else(|| KvError::MissingLeaf { side, leaf: l.clone() })).collect()
}

fn check_range(lists: &[&[u64]], leaf_ids: &[String], num_pages: &[u64], side: Side) -> Result<(), KvError> {
    for (g, list) in lists.iter().enumerate() {
        if let Some(&idx) = list.iter().find(|&&i| i >= num_pages[g]) {
            return Err(KvError::PageOutOfRange { side, leaf: leaf_ids[g].clone(), idx, num_pages: num_pages[g] });
        }
    }
    Ok(())
}

/// Page descriptors of one shard: group-major, then page order;
/// page `idx` of group `g` is `bytes_per_group[g]` bytes at `base_addrs[g] + idx * bytes_per_group[g]`.
pub fn page_descs(base_addrs: &[u64], bytes_per_group: &[u64], lists: &[&[u64]], out: &mut Vec<Desc>) {
    out.clear();
    for (g, list) in lists.iter().enumerate() {
        let bpp = bytes_per_group[g];
        if bpp == 0 {
            continue; // a group of zero-byte pages moves nothing
        }
        out.extend(list.iter().map(|&idx| Desc::new(base_addrs[g] + idx * bpp, bpp)));
    }
}

impl KVTransferEngine {
    /// Push pages `src_idxs` of local replica `src_replica_idx` into pages
    /// `dst_idxs` of replica `dst_replica_idx` of the connected engine
    /// `remote` (its name or metadata). The same indices apply on every TP
    /// shard. One request is posted per `(src_shard, dst_shard)` pair of the
    /// connection's pairing, each notifying the destination agent with the
    /// new `transfer_name` (a UUID v4) once its data is in place.
    ///
    /// Page lists: a [`PageIdxs::PerLeaf`] map naming exactly the engine's
    /// leaves, or a [`PageIdxs::Flat`] list applied to every leaf. When no
    /// page is named, nothing is posted and the transfer is complete at once.
    ///
    /// # Errors
    /// As MAX, in its order: [`KvError::ReplicaOutOfRange`] (source, then
    /// destination), [`KvError::NotConnected`], [`KvError::UnknownLeaf`] /
    /// [`KvError::MissingLeaf`] then [`KvError::PageOutOfRange`] of the
    /// source, then the same of the destination, [`KvError::PageCountLengthMismatch`],
    /// [`KvError::DuplicateDestinationPage`]; [`KvError::PostFailed`] when a
    /// shard request cannot be posted (e.g. the peer died) — the requests
    /// already posted are released first, so no handle leaks.
    pub fn initiate_send_transfer<R: RemoteEngine + ?Sized>(
        &mut self,
        remote: &R,
        src_idxs: &PageIdxs,
        dst_idxs: &PageIdxs,
        src_replica_idx: usize,
        dst_replica_idx: usize,
    ) -> Result<TransferReqData, KvError> {
        self.initiate(remote, src_idxs, dst_idxs, src_replica_idx, dst_replica_idx, false)
    }

    /// Pull pages `src_idxs` of replica `src_replica_idx` of the connected
    /// engine `remote` into local pages `dst_idxs` of replica
    /// `dst_replica_idx` (`is_read = true`; the source is notified). The
    /// symmetric checks of [`KVTransferEngine::initiate_send_transfer`]
    /// apply (destination replica first, as the local one).
    ///
    /// # Errors
    /// As [`KVTransferEngine::initiate_send_transfer`].
    pub fn initiate_read_transfer<R: RemoteEngine + ?Sized>(
        &mut self,
        remote: &R,
        src_idxs: &PageIdxs,
        dst_idxs: &PageIdxs,
        src_replica_idx: usize,
        dst_replica_idx: usize,
    ) -> Result<TransferReqData, KvError> {
        self.initiate(remote, src_idxs, dst_idxs, src_replica_idx, dst_replica_idx, true)
    }

    fn initiate<R: RemoteEngine + ?Sized>(
        &mut self,
        remote: &R,
        src_idxs: &PageIdxs,
        dst_idxs: &PageIdxs,
        src_replica_idx: usize,
        dst_replica_idx: usize,
        is_read: bool,
    ) -> Result<TransferReqData, KvError> {
        let remote_name = remote.engine_name();
        let (local_side, local_replica, remote_side, remote_replica) = if is_read {
            (Side::Destination, dst_replica_idx, Side::Source, src_replica_idx)
        } else {
            (Side::Source, src_replica_idx, Side::Destination, dst_replica_idx)
        };
        // 1. replica ranges
        if local_replica >= self.dp {
            return Err(KvError::ReplicaOutOfRange { side: local_side, replica: local_replica, num_replicas: self.dp });
        }
        let remote_dp =
            remote.engine_metadata().map(|m| m.dp()).or_else(|| self.remotes.get(remote_name).map(|c| c.meta.dp()));
        if let Some(n) = remote_dp
            && remote_replica >= n
        {
            return Err(KvError::ReplicaOutOfRange { side: remote_side, replica: remote_replica, num_replicas: n });
        }
        // 2. connected; from here on the stored metadata is used.
        let conn = self.remotes.get(remote_name).ok_or_else(|| KvError::NotConnected(remote_name.to_string()))?;
        let remote_dp = conn.meta.dp();
        if remote_replica >= remote_dp {
            return Err(KvError::ReplicaOutOfRange {
                side: remote_side,
                replica: remote_replica,
                num_replicas: remote_dp,
            });
        }
        // 3. leaf sets, index ranges, pairs
        // As MAX's `_page_idxs_per_group`: the source side whole (leaf set,
        // then ranges), then the destination side.
        let (src_pages, dst_pages) = if is_read {
            (&conn.meta.num_pages_per_group, &self.num_pages_per_group)
        } else {
            (&self.num_pages_per_group, &conn.meta.num_pages_per_group)
        };
        let src = leaf_lists(src_idxs, &self.leaf_ids, Side::Source)?;
        check_range(&src, &self.leaf_ids, src_pages, Side::Source)?;
        let dst = leaf_lists(dst_idxs, &conn.meta.leaf_ids, Side::Destination)?;
        check_range(&dst, &self.leaf_ids, dst_pages, Side::Destination)?;
        let mut seen = HashSet::new();
        for (g, (s, d)) in src.iter().zip(&dst).enumerate() {
            if s.len() != d.len() {
                return Err(KvError::PageCountLengthMismatch {
                    leaf: self.leaf_ids[g].clone(),
                    src: s.len(),
                    dst: d.len(),
                });
            }
            seen.clear();
            if let Some(&idx) = d.iter().find(|&&i| !seen.insert(i)) {
                return Err(KvError::DuplicateDestinationPage { leaf: self.leaf_ids[g].clone(), idx });
            }
        }
        let mut req = TransferReqData {
            dst_name: if is_read { self.name.clone() } else { remote_name.to_string() },
            src_name: if is_read { remote_name.to_string() } else { self.name.clone() },
            transfer_name: uuid::Uuid::new_v4().to_string(),
            transfer_ids: Vec::new(),
            src_idxs: PageIdxs::PerLeaf(self.leaf_ids.iter().cloned().zip(src.iter().map(|s| s.to_vec())).collect()),
            dst_idxs: PageIdxs::PerLeaf(self.leaf_ids.iter().cloned().zip(dst.iter().map(|d| d.to_vec())).collect()),
            src_replica_idx,
            dst_replica_idx,
            is_read,
            tp_shard_count: 0,
            local_shards_used: Vec::new(),
        };
        if src.iter().all(|l| l.is_empty()) {
            // Nothing to move: complete at once on both sides (see is_complete).
            return Ok(req);
        }
        // 4. one request per shard pair
        let (source_tp, dest_tp) = if is_read { (conn.meta.tp(), self.tp) } else { (self.tp, conn.meta.tp()) };
        let pairing = transfer_shard_pairing(conn.broadcast, source_tp, dest_tp);
        let (local_lists, remote_lists) = if is_read { (&dst, &src) } else { (&src, &dst) };
        let op = if is_read { Op::Read } else { Op::Write };
        let remote_agents = conn.meta.agents_meta[remote_replica].clone();
        let (mut local_descs, mut remote_descs) = (Vec::new(), Vec::new());
        let mut segments = Vec::new();
        for (src_shard, dst_shard) in pairing {
            let (local_shard, remote_shard) = if is_read { (dst_shard, src_shard) } else { (src_shard, dst_shard) };
            let ra = &remote_agents[remote_shard];
            let agent = &mut self.agents[local_replica][local_shard];
            page_descs(&agent.base_addrs, &self.bytes_per_group, local_lists, &mut local_descs);
            page_descs(&ra.base_addrs, &self.bytes_per_group, remote_lists, &mut remote_descs);
            let posted = agent.engine.post_with(
                op,
                &local_descs,
                &ra.agent_name,
                &remote_descs,
                Some(req.transfer_name.clone().into_bytes()),
                &mut segments,
            );
            match posted {
                Ok(h) => {
                    req.transfer_ids.push(h.0);
                    req.local_shards_used.push(local_shard);
                }
                Err(source) => {
                    self.release_handles(&req, local_replica);
                    return Err(KvError::PostFailed { local_shard, remote_shard, source });
                }
            }
        }
        req.tp_shard_count = req.transfer_ids.len();
        let page_bytes: u64 = local_lists.iter().zip(&self.bytes_per_group).map(|(l, &bpp)| l.len() as u64 * bpp).sum();
        self.telemetry.insert(
            req.transfer_name.clone(),
            Telemetry {
                started: Instant::now(),
                op: if is_read { MetricOp::Read } else { MetricOp::Write },
                peer: remote_name.to_string(),
                bytes: page_bytes * req.tp_shard_count as u64,
                counted: false,
            },
        );
        let map = if is_read { &mut self.inflight_read } else { &mut self.inflight_send };
        map.insert(req.transfer_name.clone(), req.clone());
        Ok(req)
    }

    /// Whether a transfer has completed, as MAX's `is_complete`. Never blocks
    /// and does not drive the data; both engines must keep polling.
    ///
    /// - Initiator (a send from here, or a read from here): checks each of
    ///   its shard requests.
    /// - Passive side: drains the notifications of every agent of the local
    ///   replica (the destination replica of a send, the source replica of a
    ///   read), counts them per (remote engine, transfer name), and reports
    ///   complete once `tp_shard_count` (0: this engine's TP) equal to the
    ///   `transfer_name` arrived from the remote engine. Notifications of other
    ///   transfers are kept for later calls. A notification from an engine
    ///   never connected is counted and logged (MAX raises `KeyError`).
    /// - A transfer of no pages is complete at once.
    ///
    /// # Errors
    /// [`KvError::TransferFailed`] with the transport's reason (the
    /// initiator's handles stay held: call [`KVTransferEngine::cleanup_transfer`]
    /// or [`KVTransferEngine::cancel_transfer`]); [`KvError::ReplicaOutOfRange`]
    /// (passive side, a replica this engine lacks); [`KvError::UnknownTransfer`]
    /// (a transfer this engine initiated and already cleaned up or cancelled).
    pub fn is_complete(&mut self, req: &TransferReqData) -> Result<bool, KvError> {
        self.check_ours(req)?;
        if req.is_empty() {
            return Ok(true);
        }
        if let Some((replica, handles)) = self.owned(req) {
            for (tid, shard) in handles {
                let agent = &mut self.agents[replica][shard];
                match agent.engine.status(TransferHandle(tid))? {
                    TransferStatus::Done => {}
                    TransferStatus::InProgress => return Ok(false),
                    TransferStatus::Failed(reason) => {
                        if let Some(t) = self.telemetry.get_mut(&req.transfer_name).filter(|t| !t.counted) {
                            t.counted = true;
                            crate::metrics::global().record_failure(t.op, &t.peer);
                        }
                        return Err(KvError::TransferFailed {
                            transfer_name: req.transfer_name.clone(),
                            shard,
                            reason,
                        });
                    }
                }
            }
            if let Some(t) = self.telemetry.get_mut(&req.transfer_name).filter(|t| !t.counted) {
                t.counted = true;
                crate::metrics::global().record_transfer(t.op, &t.peer, t.bytes, t.started.elapsed());
            }
            return Ok(true);
        }
        let initiator = if req.is_read { &req.dst_name } else { &req.src_name };
        if *initiator == self.name {
            // Ours, but no longer in flight (cleaned up or cancelled).
            return Err(KvError::UnknownTransfer(req.transfer_name.clone()));
        }
        let replica = if req.is_read { req.src_replica_idx } else { req.dst_replica_idx };
        if replica >= self.dp {
            return Err(KvError::ReplicaOutOfRange {
                side: if req.is_read { Side::Source } else { Side::Destination },
                replica,
                num_replicas: self.dp,
            });
        }
        self.drain_notifications(replica);
        let remote = if req.is_read { &req.dst_name } else { &req.src_name };
        let expected = if req.tp_shard_count == 0 { self.tp } else { req.tp_shard_count };
        let got = self.completed_recv.get(remote).and_then(|m| m.get(&req.transfer_name)).copied().unwrap_or(0);
        Ok(got >= expected)
    }

    /// For a transfer this engine initiated and still holds: the owning
    /// replica and its `(handle, shard)` pairs, from the stored record (not
    /// the caller's copy, which may have crossed a process boundary).
    /// [`KvError::NotOurTransfer`] unless `req` names this engine on one side.
    fn check_ours(&self, req: &TransferReqData) -> Result<(), KvError> {
        if req.src_name == self.name || req.dst_name == self.name {
            return Ok(());
        }
        Err(KvError::NotOurTransfer {
            transfer_name: req.transfer_name.clone(),
            src_name: req.src_name.clone(),
            dst_name: req.dst_name.clone(),
            engine: self.name.clone(),
        })
    }

    /// The in-flight request this engine initiated that `req` denotes: same
    /// transfer name *and* the same engines (a name alone could collide).
    fn owned(&self, req: &TransferReqData) -> Option<(usize, Vec<(u64, usize)>)> {
        let map = if req.is_read { &self.inflight_read } else { &self.inflight_send };
        let own = map.get(&req.transfer_name).filter(|o| o.src_name == req.src_name && o.dst_name == req.dst_name)?;
        let replica = if own.is_read { own.dst_replica_idx } else { own.src_replica_idx };
        let handles = own
            .transfer_ids
            .iter()
            .enumerate()
            .map(|(i, &tid)| (tid, own.local_shards_used.get(i).copied().unwrap_or(i)))
            .collect();
        Some((replica, handles))
    }

    /// Block until the first unfinished shard transfer of `req` that this
    /// engine posted ends or `limit` passes, sleeping on its transport
    /// ([`TransferEngine::wait`](crate::engine::TransferEngine::wait))
    /// rather than spinning. False when `req` has no such transfer here (a
    /// request this side did not post): the caller sleeps instead.
    fn wait_some(&mut self, req: &TransferReqData, limit: Duration) -> Result<bool, KvError> {
        let Some((replica, handles)) = self.owned(req) else {
            return Ok(false);
        };
        for (tid, shard) in handles {
            let engine = &mut self.agents[replica][shard].engine;
            if engine.status(TransferHandle(tid))? == TransferStatus::InProgress {
                engine.wait(TransferHandle(tid), limit)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn drain_notifications(&mut self, replica: usize) {
        for shard in 0..self.tp {
            let notifs = self.agents[replica][shard].engine.get_notifs();
            for (agent, payloads) in notifs {
                let engine = match self.remote_agent_to_engine.get(&agent) {
                    Some(e) => e.clone(),
                    None => {
                        let e = engine_of_agent(&agent).unwrap_or(&agent).to_string();
                        self.num_unknown_notifs += payloads.len() as u64;
                        tracing::warn!(
                            engine = %self.name, from_agent = %agent, count = payloads.len(),
                            "notification from an agent of an engine that was never connected; counted under {e:?}"
                        );
                        e
                    }
                };
                let per = self.completed_recv.entry(engine).or_default();
                for p in payloads {
                    *per.entry(String::from_utf8_lossy(&p).into_owned()).or_insert(0) += 1;
                }
            }
        }
    }

    /// Forget a completed transfer, as MAX's `cleanup_transfer`: the
    /// initiator releases its handles, the passive side drops its counter.
    /// A transfer whose request failed is released too (its error was
    /// reported by [`KVTransferEngine::is_complete`]).
    ///
    /// # Errors
    /// [`KvError::NotComplete`] (nothing is released; use
    /// [`KVTransferEngine::cancel_transfer`] to abandon it);
    /// [`KvError::Engine`] when a release fails.
    pub fn cleanup_transfer(&mut self, req: &TransferReqData) -> Result<(), KvError> {
        match self.is_complete(req) {
            Ok(true) | Err(KvError::TransferFailed { .. }) => {}
            Ok(false) => return Err(KvError::NotComplete(req.transfer_name.clone())),
            Err(e) => return Err(e),
        }
        self.forget(req)
    }

    /// Abandon a transfer in any state: the initiator cancels and releases
    /// every shard request (returning only once no copy can touch the
    /// buffers; some pages may have landed, and no notification is sent for
    /// a request cancelled before it finished); the passive side drops its
    /// counter (notifications arriving later are banked as unknown transfers).
    ///
    /// # Errors
    /// [`KvError::Engine`] when a release fails (the rest are still released).
    pub fn cancel_transfer(&mut self, req: &TransferReqData) -> Result<(), KvError> {
        self.forget(req)
    }

    fn forget(&mut self, req: &TransferReqData) -> Result<(), KvError> {
        self.check_ours(req)?;
        let map = if req.is_read { &mut self.inflight_read } else { &mut self.inflight_send };
        let same = |o: &TransferReqData| o.src_name == req.src_name && o.dst_name == req.dst_name;
        if map.get(&req.transfer_name).is_some_and(same)
            && let Some(own) = map.remove(&req.transfer_name)
        {
            self.telemetry.remove(&req.transfer_name);
            let replica = if own.is_read { own.dst_replica_idx } else { own.src_replica_idx };
            return self.release_handles(&own, replica).map_or(Ok(()), Err);
        }
        let remote = if req.is_read { &req.dst_name } else { &req.src_name };
        if let Some(m) = self.completed_recv.get_mut(remote) {
            m.remove(&req.transfer_name);
        }
        Ok(())
    }

    /// Wait for a transfer and clean it up, as MAX's `sync_and_release`
    /// (poll [`KVTransferEngine::is_complete`], then
    /// [`KVTransferEngine::cleanup_transfer`]); between polls it sleeps on
    /// the transport of a shard still in progress
    /// ([`TransferEngine::wait`](crate::engine::TransferEngine::wait), at
    /// most 10 ms at a time). Unlike MAX, a timeout or a
    /// failure **cancels** the transfer ([`KVTransferEngine::cancel_transfer`])
    /// before returning, so no handle or buffer stays in use.
    ///
    /// # Errors
    /// [`KvError::Timeout`] (MAX: `TimeoutError`), [`KvError::TransferFailed`],
    /// and those of [`KVTransferEngine::cleanup_transfer`].
    pub fn sync_and_release(&mut self, req: &TransferReqData, timeout: Duration) -> Result<(), KvError> {
        // Far enough for "no limit" when `timeout` does not fit an Instant.
        let deadline = Instant::now().checked_add(timeout).unwrap_or_else(|| Instant::now() + NO_LIMIT);
        let mut spins = 0u32;
        loop {
            match self.is_complete(req) {
                Ok(true) => return self.cleanup_transfer(req),
                Ok(false) if Instant::now() >= deadline => {
                    self.cancel_transfer(req)?;
                    return Err(KvError::Timeout { transfer_name: req.transfer_name.clone(), timeout });
                }
                Ok(false) => {
                    spins += 1;
                    if spins < 64 {
                        std::thread::yield_now();
                    } else {
                        let step = deadline.saturating_duration_since(Instant::now()).min(WAIT_STEP);
                        match self.wait_some(req, step) {
                            Ok(true) => {}
                            Ok(false) => std::thread::sleep(Duration::from_micros(200)),
                            Err(e) => {
                                let _ = self.cancel_transfer(req);
                                return Err(e);
                            }
                        }
                    }
                }
                Err(e) => {
                    let _ = self.cancel_transfer(req);
                    return Err(e);
                }
            }
        }
    }
}
