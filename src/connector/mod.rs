//! KV connectors: move KV blocks between an engine's device pages and an
//! external tier, keyed by block hash (MAX `kv_connector.py` and
//! `max/nn/kv_cache/metrics.py`).
//!
//! - [`KVConnector`]: the interface the KV cache manager drives.
//! - [`NullConnector`]: no external cache.
//! - [`HostTierConnector`]: a host-memory tier sized in bytes, LRU by
//!   `(leaf, hash)`, copying on a worker thread.
//! - [`replay`]: prefix reuse for `kvwire replay` (look up, load hits, offload
//!   new full blocks) and the hit rate of an unlimited tier.
//!
//! # Shapes and units
//! A leaf's device side is, per DP replica, one `[num_pages, bytes_per_page]`
//! byte buffer per TP shard ([`DevicePages`]). Its host row is
//! `bytes_per_page * (1 if replicated else num_shards)` bytes: replicated
//! (MLA) leaves are stored once and broadcast on load. Tier sizes are bytes.
//!
//! # Order of calls (per scheduler step)
//! `lookup` → `load` (at most once per lookup, same replica and hint) →
//! `offload` → the model runs. There is no barrier: the caller waits on the
//! returned handles before reading loaded blocks or freeing offloaded ones.
//!
//! # Thread safety
//! Connectors are `Send + Sync` and take `&self`; transfer handles are
//! `Send + Sync`. Copies of the host tier run on its own worker thread.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

mod error;
pub(crate) mod host;
mod ledger;
mod null;
mod pages;
pub mod replay;
mod transfer;
mod types;
#[cfg(feature = "cuda")]
mod vram;

#[cfg(test)]
mod tests;

/// Defined with the metrics registry that exports it (a connector reports
/// into [`crate::metrics`], never the other way round).
pub use crate::metrics::KVCacheMetrics;
pub use error::ConnectorError;
pub use host::{HostTierConnector, WorkerPause};
pub use null::NullConnector;
pub use pages::{DevicePages, HostPages};
pub use transfer::{CompletedTransfer, KVConnectorTransfer, KVTransfer};
pub use types::{BlockCount, BlockHash, BlockId, ByteCount, KVCacheGroupId, KVCacheGroupKind, LeafId, PerLeaf};
#[cfg(feature = "cuda")]
pub use vram::VramPages;

/// The interface between a KV cache manager and an external KV tier (MAX
/// `KVConnector` protocol).
///
/// Block hashes are [`BlockHash`]es, i.e. canonical bytes (8 big-endian or 32
/// bytes) already validated. `replica_idx` selects the DP replica whose device
/// pages are read or written; the tier itself is replica-agnostic.
pub trait KVConnector: Send + Sync {
    /// Name for logs (`"NullConnector"`, `"HostTierConnector"`).
    fn name(&self) -> &str;

    /// Leaves served: `leaf_id -> group id` (kind and window).
    fn leaves(&self) -> &BTreeMap<LeafId, KVCacheGroupId>;

    /// Presence only: per served leaf, a mask of `block_hashes.len()` where
    /// `true` means every TP shard of that leaf is held. Advisory: reserves
    /// nothing, and the caller may never load. `hint` is the request's raw
    /// JSON `dkv_cache_hint` (opaque here) and must be the one later passed to
    /// `load`.
    ///
    /// # Errors
    /// [`ConnectorError::NoSuchReplica`]; [`ConnectorError::ShutDown`].
    fn lookup(
        &self,
        block_hashes: &[BlockHash],
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<PerLeaf<bool>, ConnectorError>;

    /// Read `block_hashes[leaf][i]` into device block `block_ids[leaf][i]`, all
    /// or nothing. Leaves may differ in length (a window holds fewer); null
    /// slots are the caller's and never appear here. Returns
    /// [`CompletedTransfer`] when nothing moved, else a handle the caller polls
    /// before reading the blocks.
    ///
    /// Checks run in this order: shapes (nothing consumed), then the lookup
    /// pairing (consumes one lookup), then whether every block can be served.
    ///
    /// # Errors
    /// - [`ConnectorError::UnknownLeaf`], [`ConnectorError::LengthMismatch`],
    ///   [`ConnectorError::DuplicateBlockId`], [`ConnectorError::BlockOutOfRange`],
    ///   [`ConnectorError::NoSuchReplica`]: bad arguments;
    /// - [`ConnectorError::LoadWithoutLookup`]: no unconsumed `lookup` with
    ///   this `replica_idx` and `hint` (MAX: "must follow a lookup() with the
    ///   same replica_idx and hint, at most once");
    /// - [`ConnectorError::LoadRefused`] (`KVLoadRefused`): some block cannot be
    ///   served; nothing moved;
    /// - [`ConnectorError::LoadFailed`] (`KVLoadFailed`): posting failed;
    ///   nothing writes into the destination.
    fn load(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<Box<dyn KVTransfer>, ConnectorError>;

    /// Write device block `block_ids[leaf][i]` under `block_hashes[leaf][i]`.
    /// Hashes already held (or in flight) and blocks there is no room for are
    /// skipped; the returned handle's
    /// [`g0_blocks_per_leaf`](KVConnectorTransfer::g0_blocks_per_leaf) lists the
    /// device blocks the caller must keep pinned until it lands. Leaves may
    /// differ in length (recurrent leaves publish at checkpoints).
    ///
    /// # Errors
    /// [`ConnectorError::UnknownLeaf`], [`ConnectorError::LengthMismatch`],
    /// [`ConnectorError::BlockOutOfRange`], [`ConnectorError::NoSuchReplica`],
    /// [`ConnectorError::ShutDown`].
    fn offload(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
    ) -> Result<KVConnectorTransfer, ConnectorError>;

    /// Refresh the recency of blocks served from device memory. Pass the whole
    /// root-anchored sequence (full attention: the sequence; sliding: the
    /// window): a partial touch inverts eviction order. Fire and forget;
    /// never fails. No-op by default.
    fn touch(&self, _block_hashes: &[BlockHash], _replica_idx: usize) {}

    /// Reclaim what settled or dropped transfers left behind. Cheap; never
    /// fails. No-op by default.
    fn poll_transfers(&self) {}

    /// Finish in-flight copies and stop; on connectors with a copy worker,
    /// later lookups, loads and offloads fail with
    /// [`ConnectorError::ShutDown`]. Idempotent. No-op by default.
    fn shutdown(&self) {}

    /// Drop every block held (blocks a pending load reads go when it lands).
    /// No-op by default.
    fn reset_prefix_cache(&self) {}

    /// Metrics of the current window.
    fn metrics(&self) -> KVCacheMetrics;

    /// Metrics of the current window, clearing its counters (gauges stay).
    fn take_metrics(&self) -> KVCacheMetrics;

    /// Host tier occupancy in bytes; `0/0` by default.
    fn host_byte_count(&self) -> ByteCount {
        ByteCount::default()
    }

    /// Disk tier occupancy in bytes; `0/0` by default.
    fn disk_byte_count(&self) -> ByteCount {
        ByteCount::default()
    }
}

/// A shared connector is a connector (one connector serves every DP replica).
impl<T: KVConnector + ?Sized> KVConnector for std::sync::Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn leaves(&self) -> &BTreeMap<LeafId, KVCacheGroupId> {
        (**self).leaves()
    }

    fn lookup(
        &self,
        block_hashes: &[BlockHash],
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<PerLeaf<bool>, ConnectorError> {
        (**self).lookup(block_hashes, replica_idx, hint)
    }

    fn load(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<Box<dyn KVTransfer>, ConnectorError> {
        (**self).load(block_ids, block_hashes, replica_idx, hint)
    }

    fn offload(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
    ) -> Result<KVConnectorTransfer, ConnectorError> {
        (**self).offload(block_ids, block_hashes, replica_idx)
    }

    fn touch(&self, block_hashes: &[BlockHash], replica_idx: usize) {
        (**self).touch(block_hashes, replica_idx)
    }

    fn poll_transfers(&self) {
        (**self).poll_transfers()
    }

    fn shutdown(&self) {
        (**self).shutdown()
    }

    fn reset_prefix_cache(&self) {
        (**self).reset_prefix_cache()
    }

    fn metrics(&self) -> KVCacheMetrics {
        (**self).metrics()
    }

    fn take_metrics(&self) -> KVCacheMetrics {
        (**self).take_metrics()
    }

    fn host_byte_count(&self) -> ByteCount {
        (**self).host_byte_count()
    }

    fn disk_byte_count(&self) -> ByteCount {
        (**self).disk_byte_count()
    }
}
