//! `HostTierConnector`: a host-memory KV tier sized in bytes, LRU by
//! `(leaf, hash)`, with copies on a worker thread (the role of MAX's
//! `RustTierConnector` host level, and of the deleted `LocalConnector`).

pub(crate) mod tier;
mod worker;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::Sender;

use self::tier::{Admit, Key, Tier};
use self::worker::{Job, LoadItem, OffloadItem, Shared};
use super::ledger::{LookupLedger, check_distinct_destinations, check_per_leaf, nothing_to_move};
use super::transfer::{Direction, PendingTransfer, TransferState};
use super::{
    BlockHash, BlockId, ByteCount, CompletedTransfer, ConnectorError, DevicePages, KVCacheGroupId,
    KVCacheMetrics, KVConnector, KVConnectorTransfer, KVTransfer, LeafId, PerLeaf,
};

/// A host-memory tier of `capacity_bytes` in front of one engine's device
/// pages (every DP replica's).
///
/// - Keyed by `(leaf, hash)`; one row per key of the leaf's
///   [`host_bytes_per_page`](DevicePages::host_bytes_per_page) bytes, so a
///   replicated (MLA) leaf is stored once and broadcast to every shard on load.
/// - Eviction is least recently used, and never takes a block that an offload
///   is still writing or a pending load is still reading (those are pinned
///   until their copy lands). Offload, load and touch refresh recency; within
///   one call position 0 (the root) ends most recent, so a sequence's tail is
///   evicted before its prefix. Lookup does not refresh.
/// - An offload gives room block by block in prefix order, a block's rows on
///   every leaf together: all of them are stored, or all dropped (counted in
///   `connector_offload_blocks_dropped`, one per row).
/// - Copies run in posting order on one worker thread; transfer handles
///   complete through an atomic that the worker sets after settling the
///   table, so a completed load has already released its pins.
#[derive(Debug)]
pub struct HostTierConnector {
    leaves: BTreeMap<LeafId, KVCacheGroupId>,
    /// `[replica][leaf index]`, leaves in name order.
    replicas: Vec<Vec<Arc<dyn DevicePages>>>,
    /// Host row width per leaf index (bytes).
    row_bytes: Vec<u64>,
    shared: Arc<Shared>,
    ledger: LookupLedger,
    jobs: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// While alive, the host tier's worker starts no new copy (the one running
/// finishes). For tests and benchmarks that need transfers to stay pending.
/// Shutdown overrides it.
#[derive(Debug)]
#[must_use = "the worker resumes when the guard is dropped"]
pub struct WorkerPause {
    shared: Arc<Shared>,
}

impl Drop for WorkerPause {
    fn drop(&mut self) {
        let mut g = self.shared.pause.lock().unwrap_or_else(|e| e.into_inner());
        g.0 -= 1;
        self.shared.unpaused.notify_all();
    }
}

impl HostTierConnector {
    /// A tier of `capacity_bytes` serving `leaves`, whose device pages are
    /// `replicas[replica_idx][leaf_id]` (MAX `replica_kv_memory`).
    ///
    /// # Errors
    /// [`ConnectorError::InvalidPages`] when there is no replica, a replica's
    /// leaves differ from `leaves`, a leaf's row shape (shards, stride,
    /// replication) differs between replicas, or a stride is 0.
    pub fn new(
        leaves: BTreeMap<LeafId, KVCacheGroupId>,
        replicas: Vec<BTreeMap<LeafId, Arc<dyn DevicePages>>>,
        capacity_bytes: u64,
    ) -> Result<Self, ConnectorError> {
        let invalid = |reason: String| Err(ConnectorError::InvalidPages { reason });
        if replicas.is_empty() {
            return invalid("no replica".into());
        }
        let mut by_replica = Vec::with_capacity(replicas.len());
        for (r, pages) in replicas.into_iter().enumerate() {
            if !pages.keys().eq(leaves.keys()) {
                return invalid(format!(
                    "replica {r} has leaves {:?}, expected {:?}",
                    pages.keys(),
                    leaves.keys()
                ));
            }
            by_replica.push(pages.into_values().collect::<Vec<_>>());
        }
        let shape = |p: &Arc<dyn DevicePages>| (p.num_shards(), p.bytes_per_page(), p.replicated());
        for (i, leaf_id) in leaves.keys().enumerate() {
            let first = shape(&by_replica[0][i]);
            if first.0 == 0 || first.1 == 0 {
                return invalid(format!(
                    "leaf {leaf_id}: {} shards of {} bytes per page",
                    first.0, first.1
                ));
            }
            if by_replica.iter().any(|r| shape(&r[i]) != first) {
                return invalid(format!(
                    "leaf {leaf_id}: row shape differs between replicas"
                ));
            }
        }
        let row_bytes = by_replica[0]
            .iter()
            .map(|p| p.host_bytes_per_page() as u64)
            .collect();
        let shared = Arc::new(Shared {
            tier: Mutex::new(Tier::new(capacity_bytes)),
            metrics: Mutex::new(KVCacheMetrics::default()),
            pause: Mutex::new((0, false)),
            unpaused: Condvar::new(),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let w = shared.clone();
        let worker = std::thread::Builder::new()
            .name("kvwire-host-tier".into())
            .spawn(move || worker::run(w, rx))
            .map_err(|e| ConnectorError::InvalidPages {
                reason: format!("spawning the copy worker: {e}"),
            })?;
        Ok(Self {
            leaves,
            replicas: by_replica,
            row_bytes,
            shared,
            ledger: LookupLedger::default(),
            jobs: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Host row width of `leaf_id` in bytes, `None` for an unknown leaf.
    pub fn host_bytes_per_block(&self, leaf_id: &str) -> Option<u64> {
        self.leaves
            .keys()
            .position(|l| l.as_str() == leaf_id)
            .map(|i| self.row_bytes[i])
    }

    /// Hold the worker before its next copy until the guard drops.
    pub fn pause_worker(&self) -> WorkerPause {
        self.shared
            .pause
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0 += 1;
        WorkerPause {
            shared: self.shared.clone(),
        }
    }

    fn tier(&self) -> std::sync::MutexGuard<'_, Tier> {
        self.shared.tier.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn leaf_index(&self, leaf_id: &LeafId) -> u32 {
        self.leaves
            .keys()
            .position(|l| l == leaf_id)
            .expect("leaf checked") as u32
    }

    fn replica(&self, replica_idx: usize) -> Result<&[Arc<dyn DevicePages>], ConnectorError> {
        self.replicas
            .get(replica_idx)
            .map(Vec::as_slice)
            .ok_or(ConnectorError::NoSuchReplica {
                replica_idx,
                num_replicas: self.replicas.len(),
            })
    }

    fn sender(&self) -> Result<Sender<Job>, ConnectorError> {
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(ConnectorError::ShutDown)
    }

    /// Shared checks of `load`/`offload`: leaves, lengths, replica, bounds.
    fn check_args(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
    ) -> Result<&[Arc<dyn DevicePages>], ConnectorError> {
        check_per_leaf(&self.leaves, block_ids, block_hashes)?;
        let pages = self.replica(replica_idx)?;
        for (leaf_id, ids) in block_ids {
            let num_pages = pages[self.leaf_index(leaf_id) as usize].num_pages();
            if let Some(&block_id) = ids.iter().find(|b| b.index() >= num_pages) {
                return Err(ConnectorError::BlockOutOfRange {
                    leaf_id: leaf_id.clone(),
                    block_id,
                    num_pages,
                });
            }
        }
        Ok(pages)
    }

    /// The rows of a load or offload grouped by block, in prefix order:
    /// position by position, leaves in name order within a position; rows of
    /// one hash on several leaves form one block (the position where the hash
    /// first appears). With `dedup`, a `(leaf, hash)` repeated in the call
    /// appears once (an offload stores it once; a load writes every copy).
    fn blocks_in_prefix_order(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        dedup: bool,
    ) -> Vec<Vec<Row>> {
        let max_len = block_hashes.values().map(Vec::len).max().unwrap_or(0);
        let mut blocks: Vec<Vec<Row>> = Vec::new();
        let mut by_hash: HashMap<BlockHash, usize> = HashMap::new();
        let mut seen: HashSet<Key> = HashSet::new();
        for i in 0..max_len {
            for (leaf_id, hashes) in block_hashes {
                let (Some(&hash), Some(&block)) = (hashes.get(i), block_ids[leaf_id].get(i)) else {
                    continue;
                };
                let key: Key = (self.leaf_index(leaf_id), hash);
                if !seen.insert(key) && dedup {
                    continue;
                }
                let g = *by_hash.entry(hash).or_insert_with(|| {
                    blocks.push(Vec::new());
                    blocks.len() - 1
                });
                blocks[g].push(Row {
                    leaf_id: leaf_id.clone(),
                    key,
                    block,
                });
            }
        }
        blocks
    }

    fn metrics_mut(&self) -> std::sync::MutexGuard<'_, KVCacheMetrics> {
        self.shared
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// One leaf's row of one block in a call.
#[derive(Debug)]
struct Row {
    leaf_id: LeafId,
    key: Key,
    block: BlockId,
}

impl KVConnector for HostTierConnector {
    fn name(&self) -> &str {
        "HostTierConnector"
    }

    fn leaves(&self) -> &BTreeMap<LeafId, KVCacheGroupId> {
        &self.leaves
    }

    fn lookup(
        &self,
        block_hashes: &[BlockHash],
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<PerLeaf<bool>, ConnectorError> {
        self.replica(replica_idx)?;
        self.sender()?;
        self.ledger.record_lookup(replica_idx, hint);
        let tier = self.tier();
        Ok(self
            .leaves
            .keys()
            .enumerate()
            .map(|(i, l)| {
                (
                    l.clone(),
                    block_hashes
                        .iter()
                        .map(|h| tier.is_ready(&(i as u32, *h)))
                        .collect(),
                )
            })
            .collect())
    }

    fn load(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<Box<dyn KVTransfer>, ConnectorError> {
        let pages = self.check_args(block_ids, block_hashes, replica_idx)?;
        check_distinct_destinations(block_ids)?;
        let jobs = self.sender()?;
        self.ledger.consume(replica_idx, hint)?;
        if nothing_to_move(block_hashes) {
            return Ok(Box::new(CompletedTransfer));
        }
        let mut items = Vec::new();
        let mut tier = self.tier();
        for (leaf_id, hashes) in block_hashes {
            let li = self.leaf_index(leaf_id);
            if let Some(h) = hashes.iter().find(|h| !tier.is_ready(&(li, **h))) {
                drop(tier);
                self.metrics_mut().connector_loads_refused += 1;
                return Err(ConnectorError::LoadRefused {
                    leaf_id: Some(leaf_id.clone()),
                    block_hash: Some(*h),
                    reason:
                        "block not held by the host tier (evicted since lookup, or never offloaded)"
                            .into(),
                });
            }
        }
        let rows: Vec<Row> = self
            .blocks_in_prefix_order(block_ids, block_hashes, false)
            .into_iter()
            .flatten()
            .collect();
        let tick = tier.ticks(rows.len());
        for (k, r) in rows.into_iter().enumerate() {
            let data = tier.pin(&r.key).expect("checked ready under the same lock");
            tier.touch(&r.key, tick(k));
            items.push(LoadItem {
                key: r.key,
                data,
                pages: pages[r.key.0 as usize].clone(),
                block: r.block,
            });
        }
        drop(tier);
        let state = TransferState::new(Direction::Load);
        let job = Job::Load {
            state: state.clone(),
            items,
            posted: Instant::now(),
        };
        if let Err(crossbeam_channel::SendError(Job::Load { items, .. })) = jobs.send(job) {
            let mut tier = self.tier();
            items.iter().for_each(|it| tier.unpin(&it.key));
            drop(tier);
            self.metrics_mut().connector_load_failures += 1;
            return Err(ConnectorError::LoadFailed {
                reason: "the copy worker is gone".into(),
            });
        }
        Ok(Box::new(PendingTransfer(state)))
    }

    fn offload(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
    ) -> Result<KVConnectorTransfer, ConnectorError> {
        let pages = self.check_args(block_ids, block_hashes, replica_idx)?;
        let jobs = self.sender()?;
        let mut items = Vec::new();
        let mut g0 = PerLeaf::new();
        let mut dropped = 0u64;
        let blocks = self.blocks_in_prefix_order(block_ids, block_hashes, true);
        let mut tier = self.tier();
        let tick = tier.ticks(blocks.iter().map(Vec::len).sum());
        let mut k = 0;
        for rows in blocks {
            let admit: Vec<_> = rows
                .iter()
                .map(|r| {
                    k += 1;
                    (r.key, self.row_bytes[r.key.0 as usize], tick(k - 1))
                })
                .collect();
            for (r, a) in rows.into_iter().zip(tier.admit_group(&admit)) {
                match a {
                    Admit::AlreadyHeld => {}
                    Admit::NoRoom => dropped += 1,
                    Admit::Admitted => {
                        g0.entry(r.leaf_id.clone())
                            .or_insert_with(Vec::new)
                            .push(r.block);
                        items.push(OffloadItem {
                            key: r.key,
                            pages: pages[r.key.0 as usize].clone(),
                            block: r.block,
                        });
                    }
                }
            }
        }
        drop(tier);
        self.metrics_mut().connector_offload_blocks_dropped += dropped;
        if items.is_empty() {
            return Ok(KVConnectorTransfer::completed());
        }
        let state = TransferState::new(Direction::Offload);
        let job = Job::Offload {
            state: state.clone(),
            items,
            posted: Instant::now(),
        };
        if let Err(crossbeam_channel::SendError(Job::Offload { items, .. })) = jobs.send(job) {
            let mut tier = self.tier();
            items.iter().for_each(|it| tier.abort(&it.key));
            return Err(ConnectorError::OffloadFailed {
                reason: "the copy worker is gone".into(),
            });
        }
        Ok(KVConnectorTransfer::new(
            g0,
            Box::new(PendingTransfer(state)),
        ))
    }

    /// Refresh every served leaf's entries for `block_hashes` (position 0
    /// ends most recent). Unknown hashes are ignored.
    fn touch(&self, block_hashes: &[BlockHash], _replica_idx: usize) {
        let num_leaves = self.leaves.len();
        let mut tier = self.tier();
        let tick = tier.ticks(block_hashes.len() * num_leaves);
        for (i, h) in block_hashes.iter().enumerate() {
            for li in 0..num_leaves {
                tier.touch(&(li as u32, *h), tick(i * num_leaves + li));
            }
        }
    }

    /// Nothing to reclaim: the worker settles each transfer before marking it
    /// complete, and dropped handles leave nothing behind.
    fn poll_transfers(&self) {}

    /// Stop accepting work, let the worker finish every posted copy (a
    /// [`WorkerPause`] no longer holds it), and join it. Idempotent.
    fn shutdown(&self) {
        drop(self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take());
        {
            let mut g = self.shared.pause.lock().unwrap_or_else(|e| e.into_inner());
            g.1 = true;
            self.shared.unpaused.notify_all();
        }
        if let Some(w) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
    }

    fn reset_prefix_cache(&self) {
        self.tier().reset();
    }

    fn metrics(&self) -> KVCacheMetrics {
        self.metrics_mut().clone()
    }

    fn take_metrics(&self) -> KVCacheMetrics {
        self.metrics_mut().take_counters()
    }

    fn host_byte_count(&self) -> ByteCount {
        let tier = self.tier();
        ByteCount {
            free: tier.capacity_bytes() - tier.used_bytes(),
            total: tier.capacity_bytes(),
        }
    }
}

impl Drop for HostTierConnector {
    fn drop(&mut self) {
        self.shutdown();
    }
}
