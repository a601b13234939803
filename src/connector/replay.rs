//! Prefix reuse as `kvwire replay --connector host --host-tier-gib N` drives
//! it: per request, look the prefix's blocks up, load the hits into the
//! request's device blocks, "compute" the rest, offload the new full blocks.
//! Plus the hit rate a tier of unlimited size would reach on the same trace.
//!
//! Blocks are a trace's `hash_ids`: one `u64` per [`TRACE_BLOCK_TOKENS`]
//! tokens of the prompt, prefix-chained (equal ids mean equal prefixes), used
//! as ahash64-family [`BlockHash`]es. Every leaf of the connector is treated as
//! full attention and receives the same device block ids.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{
    BlockHash, BlockId, CompletedTransfer, ConnectorError, DevicePages, HostTierConnector,
    KVCacheGroupId, KVConnector, KVConnectorTransfer, KVTransfer, LeafId, PerLeaf,
};

/// Tokens per `hash_ids` block in the traces (Mooncake format).
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// Number of full blocks in a prompt of `input_tokens` tokens.
pub fn num_full_blocks(input_tokens: u64) -> usize {
    (input_tokens / TRACE_BLOCK_TOKENS) as usize
}

/// A host tier of `capacity_bytes` over one full-attention leaf `"full"` of
/// one replica: the replay's prefill engine.
///
/// # Errors
/// As [`HostTierConnector::new`].
pub fn host_tier_for(
    pages: Arc<dyn DevicePages>,
    capacity_bytes: u64,
) -> Result<HostTierConnector, ConnectorError> {
    let leaf = LeafId::from("full");
    HostTierConnector::new(
        BTreeMap::from([(leaf.clone(), KVCacheGroupId::full())]),
        vec![BTreeMap::from([(leaf, pages)])],
        capacity_bytes,
    )
}

/// What [`load_prefix`] did for one request.
#[derive(Debug)]
pub struct PrefixLoad {
    /// Blocks in the request (`hash_ids.len()`).
    pub num_blocks: usize,
    /// Leading blocks served from the tier, loaded into `block_ids[..hit_blocks]`.
    /// 0 when the tier refused the load (counted as a miss).
    pub hit_blocks: usize,
    /// The load; poll before reading `block_ids[..hit_blocks]`.
    pub transfer: Box<dyn KVTransfer>,
}

/// Look `hash_ids` up (replica `replica_idx`, no hint) and load the longest
/// prefix held on every leaf into `block_ids[..hit]`.
///
/// `block_ids[i]` is the request's device block for `hash_ids[i]`; extra ids
/// are ignored. A [`ConnectorError::LoadRefused`] becomes a miss
/// (`hit_blocks = 0`), as the KV cache manager treats it.
///
/// # Errors
/// [`ConnectorError::LengthMismatch`] when `block_ids` is shorter than
/// `hash_ids`; any other error of `lookup`/`load`.
pub fn load_prefix(
    connector: &dyn KVConnector,
    hash_ids: &[u64],
    block_ids: &[BlockId],
    replica_idx: usize,
) -> Result<PrefixLoad, ConnectorError> {
    let num_blocks = hash_ids.len();
    check_ids(connector, hash_ids.len(), block_ids.len())?;
    let hashes: Vec<BlockHash> = hash_ids.iter().map(|&h| BlockHash::from_u64(h)).collect();
    let masks = connector.lookup(&hashes, replica_idx, None)?;
    let hit = masks
        .values()
        .map(|m| m.iter().take_while(|&&p| p).count())
        .min()
        .unwrap_or(0);
    let miss = |transfer: Box<dyn KVTransfer>| PrefixLoad {
        num_blocks,
        hit_blocks: 0,
        transfer,
    };
    if hit == 0 {
        connector.load(&PerLeaf::new(), &PerLeaf::new(), replica_idx, None)?;
        return Ok(miss(Box::new(CompletedTransfer)));
    }
    let (ids, hs) = per_leaf(connector, &block_ids[..hit], &hashes[..hit]);
    match connector.load(&ids, &hs, replica_idx, None) {
        Ok(transfer) => Ok(PrefixLoad {
            num_blocks,
            hit_blocks: hit,
            transfer,
        }),
        Err(ConnectorError::LoadRefused { .. }) => Ok(miss(Box::new(CompletedTransfer))),
        Err(e) => Err(e),
    }
}

/// Offload blocks `from_block..min(num_full_blocks, hash_ids.len())` of a
/// request (the new full blocks it computed) from `block_ids` under
/// `hash_ids`. Keep the returned handle's `g0_blocks_per_leaf` unfreed and
/// unwritten until it completes.
///
/// # Errors
/// [`ConnectorError::LengthMismatch`] when `block_ids` is shorter than
/// `hash_ids`; any other error of `offload`.
pub fn offload_prefix(
    connector: &dyn KVConnector,
    hash_ids: &[u64],
    block_ids: &[BlockId],
    from_block: usize,
    num_full_blocks: usize,
    replica_idx: usize,
) -> Result<KVConnectorTransfer, ConnectorError> {
    check_ids(connector, hash_ids.len(), block_ids.len())?;
    let end = num_full_blocks.min(hash_ids.len());
    if from_block >= end {
        return Ok(KVConnectorTransfer::completed());
    }
    let hashes: Vec<BlockHash> = hash_ids[from_block..end]
        .iter()
        .map(|&h| BlockHash::from_u64(h))
        .collect();
    let (ids, hs) = per_leaf(connector, &block_ids[from_block..end], &hashes);
    connector.offload(&ids, &hs, replica_idx)
}

fn check_ids(
    connector: &dyn KVConnector,
    num_hashes: usize,
    num_ids: usize,
) -> Result<(), ConnectorError> {
    if num_ids < num_hashes {
        let leaf_id = connector
            .leaves()
            .keys()
            .next()
            .cloned()
            .unwrap_or_else(|| LeafId::from("full"));
        return Err(ConnectorError::LengthMismatch {
            leaf_id,
            num_block_ids: num_ids,
            num_block_hashes: num_hashes,
        });
    }
    Ok(())
}

fn per_leaf(
    connector: &dyn KVConnector,
    ids: &[BlockId],
    hashes: &[BlockHash],
) -> (PerLeaf<BlockId>, PerLeaf<BlockHash>) {
    let leaves = connector.leaves().keys();
    (
        leaves.clone().map(|l| (l.clone(), ids.to_vec())).collect(),
        leaves.map(|l| (l.clone(), hashes.to_vec())).collect(),
    )
}

/// Block-level prefix hit counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HitRate {
    /// Blocks served from the cache.
    pub hit_blocks: u64,
    /// Blocks referenced.
    pub total_blocks: u64,
}

impl HitRate {
    /// Add one request's counts.
    pub fn record(&mut self, hit_blocks: usize, total_blocks: usize) {
        self.hit_blocks += hit_blocks as u64;
        self.total_blocks += total_blocks as u64;
    }

    /// `hit_blocks / total_blocks`, 0 when nothing was referenced.
    pub fn rate(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.hit_blocks as f64 / self.total_blocks as f64
        }
    }
}

/// Hit rate of a tier of unlimited size over `requests`, each
/// `(hash_ids, num_full_blocks)` in arrival order: a request hits the longest
/// leading run of its `hash_ids` seen before (as [`load_prefix`] does), then
/// stores its first `num_full_blocks` blocks.
pub fn unlimited_tier_hit_rate<'a, I>(requests: I) -> HitRate
where
    I: IntoIterator<Item = (&'a [u64], usize)>,
{
    let mut held = HashSet::new();
    let mut rate = HitRate::default();
    for (hash_ids, num_full) in requests {
        let hit = hash_ids.iter().take_while(|h| held.contains(*h)).count();
        rate.record(hit, hash_ids.len());
        held.extend(hash_ids.iter().take(num_full).copied());
    }
    rate
}
