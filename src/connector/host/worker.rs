//! The host tier's copy worker: one thread that runs posted loads and
//! offloads in order, settles the tier's bookkeeping, then completes the
//! transfer's atomic state.
//!
//! Jobs run strictly in posting order on one thread, so an offload that reads
//! device block `b` has finished reading before any later load writes `b`:
//! pinned device blocks are never overwritten before their copy lands.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crossbeam_channel::Receiver;

use super::tier::{Key, Tier};
use crate::connector::transfer::TransferState;
use crate::connector::{BlockId, DevicePages, KVCacheMetrics};

/// State shared by the connector and its worker.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) tier: Mutex<Tier>,
    pub(crate) metrics: Mutex<KVCacheMetrics>,
    /// Number of live `WorkerPause` guards, and whether shutdown overrides them.
    pub(crate) pause: Mutex<(usize, bool)>,
    pub(crate) unpaused: Condvar,
}

/// One block of a load: host row `data` into `block` of `pages`.
#[derive(Debug)]
pub(crate) struct LoadItem {
    pub(crate) key: Key,
    pub(crate) data: Arc<[u8]>,
    pub(crate) pages: Arc<dyn DevicePages>,
    pub(crate) block: BlockId,
}

/// One block of an offload: `block` of `pages` into the pending entry `key`.
#[derive(Debug)]
pub(crate) struct OffloadItem {
    pub(crate) key: Key,
    pub(crate) pages: Arc<dyn DevicePages>,
    pub(crate) block: BlockId,
}

/// A posted copy.
#[derive(Debug)]
pub(crate) enum Job {
    Load {
        state: Arc<TransferState>,
        items: Vec<LoadItem>,
        posted: Instant,
    },
    Offload {
        state: Arc<TransferState>,
        items: Vec<OffloadItem>,
        posted: Instant,
    },
}

/// Run jobs until every sender is gone.
pub(crate) fn run(shared: Arc<Shared>, jobs: Receiver<Job>) {
    for job in jobs {
        wait_unpaused(&shared);
        match job {
            Job::Load {
                state,
                items,
                posted,
            } => {
                let outcome = guarded(|| copy_in(&items));
                settle_load(&shared, &items, &outcome, posted);
                state.finish(outcome.map(|_| ()));
            }
            Job::Offload {
                state,
                items,
                posted,
            } => {
                let outcome = guarded(|| copy_out(&items));
                let result = outcome.as_ref().map(|_| ()).map_err(Clone::clone);
                settle_offload(&shared, &items, outcome, posted);
                state.finish(result);
            }
        }
    }
}

fn wait_unpaused(shared: &Shared) {
    let mut g = shared.pause.lock().unwrap_or_else(|e| e.into_inner());
    while g.0 > 0 && !g.1 {
        g = shared.unpaused.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err("copy panicked".into()))
}

/// Write each row into its device block (broadcast to every shard of a
/// replicated leaf, split across shards otherwise). Stops at the first
/// failure, so nothing writes once it returns. Returns device bytes written.
fn copy_in(items: &[LoadItem]) -> Result<u64, String> {
    let mut written = 0u64;
    for it in items {
        let bpp = it.pages.bytes_per_page();
        for shard in 0..it.pages.num_shards() {
            let chunk = if it.pages.replicated() {
                &it.data[..]
            } else {
                &it.data[shard * bpp..(shard + 1) * bpp]
            };
            it.pages
                .write_page(shard, it.block, chunk)
                .map_err(|e| format!("H2D copy into block {} shard {shard}: {e}", it.block.0))?;
            written += bpp as u64;
        }
    }
    Ok(written)
}

/// Read each device block into a fresh host row (shard 0 only for a
/// replicated leaf).
fn copy_out(items: &[OffloadItem]) -> Result<Vec<Arc<[u8]>>, String> {
    items
        .iter()
        .map(|it| {
            let mut row = vec![0u8; it.pages.host_bytes_per_page()];
            let bpp = it.pages.bytes_per_page();
            for (shard, chunk) in row.chunks_mut(bpp).enumerate() {
                it.pages.read_page(shard, it.block, chunk).map_err(|e| {
                    format!("D2H copy from block {} shard {shard}: {e}", it.block.0)
                })?;
            }
            Ok(Arc::from(row))
        })
        .collect()
}

fn settle_load(
    shared: &Shared,
    items: &[LoadItem],
    outcome: &Result<u64, String>,
    posted: Instant,
) {
    let mut tier = shared.tier.lock().unwrap_or_else(|e| e.into_inner());
    for it in items {
        tier.unpin(&it.key);
    }
    drop(tier);
    let mut m = shared.metrics.lock().unwrap_or_else(|e| e.into_inner());
    match outcome {
        Ok(device_bytes) => {
            m.nixl_read_blocks += items.len() as u64;
            m.nixl_read_bytes += items.iter().map(|it| it.data.len() as u64).sum::<u64>();
            m.h2d_bytes_copied += device_bytes;
            m.record_read_latency(posted.elapsed().as_secs_f64() * 1e3);
        }
        Err(_) => m.connector_load_failures += 1,
    }
}

fn settle_offload(
    shared: &Shared,
    items: &[OffloadItem],
    outcome: Result<Vec<Arc<[u8]>>, String>,
    posted: Instant,
) {
    let mut tier = shared.tier.lock().unwrap_or_else(|e| e.into_inner());
    match outcome {
        Ok(rows) => {
            let bytes: u64 = rows.iter().map(|r| r.len() as u64).sum();
            for (it, row) in items.iter().zip(rows) {
                tier.install(&it.key, row);
            }
            drop(tier);
            let mut m = shared.metrics.lock().unwrap_or_else(|e| e.into_inner());
            m.nixl_write_blocks += items.len() as u64;
            m.nixl_write_bytes += bytes;
            m.d2h_bytes_copied += bytes;
            m.record_write_latency(posted.elapsed().as_secs_f64() * 1e3);
        }
        Err(_) => {
            for it in items {
                tier.abort(&it.key);
            }
            drop(tier);
            let mut m = shared.metrics.lock().unwrap_or_else(|e| e.into_inner());
            m.connector_offload_blocks_dropped += items.len() as u64;
        }
    }
}
