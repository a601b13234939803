//! `NullConnector`: no external cache (MAX
//! `max.pipelines.kv_cache.connectors.NullConnector`).

use std::collections::BTreeMap;

use super::{
    BlockHash, BlockId, CompletedTransfer, ConnectorError, KVCacheGroupId, KVCacheMetrics, KVConnector,
    KVConnectorTransfer, KVTransfer, LeafId, PerLeaf,
};

/// No-op connector for when external caching is disabled, as MAX 26.7's
/// `NullConnector`: holds nothing, so every lookup says absent; every
/// `load` and `offload` returns an already-completed transfer that moved
/// nothing (a load is not refused, whatever it asks for); metrics stay
/// empty.
///
/// Like MAX's, it accepts any input: no lookup-before-load pairing, no
/// per-leaf length, leaf or destination checks (it reads and writes
/// nothing, so no argument can make it do harm). The interface's argument
/// rules are those of [`KVConnector`], enforced by connectors that move
/// bytes ([`super::HostTierConnector`]).
#[derive(Debug)]
pub struct NullConnector {
    leaves: BTreeMap<LeafId, KVCacheGroupId>,
}

impl Default for NullConnector {
    /// Serves one full-attention leaf, `"full"` (MAX's `NullConnector.leaves`).
    fn default() -> Self {
        Self::new(BTreeMap::from([(LeafId::from("full"), KVCacheGroupId::full())]))
    }
}

impl NullConnector {
    /// A null connector reporting `leaves`.
    pub fn new(leaves: BTreeMap<LeafId, KVCacheGroupId>) -> Self {
        Self { leaves }
    }
}

impl KVConnector for NullConnector {
    fn name(&self) -> &str {
        "NullConnector"
    }

    fn leaves(&self) -> &BTreeMap<LeafId, KVCacheGroupId> {
        &self.leaves
    }

    /// Holds nothing, so every block is absent: one all-`false` mask of
    /// `block_hashes.len()` per leaf.
    fn lookup(
        &self,
        block_hashes: &[BlockHash],
        _replica_idx: usize,
        _hint: Option<&[u8]>,
    ) -> Result<PerLeaf<bool>, ConnectorError> {
        Ok(self.leaves.keys().map(|l| (l.clone(), vec![false; block_hashes.len()])).collect())
    }

    /// A [`CompletedTransfer`], whatever is asked for (MAX: `return
    /// CompletedTransfer()`): nothing moves, the destination blocks keep
    /// their bytes. Never fails.
    fn load(
        &self,
        _block_ids: &PerLeaf<BlockId>,
        _block_hashes: &PerLeaf<BlockHash>,
        _replica_idx: usize,
        _hint: Option<&[u8]>,
    ) -> Result<Box<dyn KVTransfer>, ConnectorError> {
        Ok(Box::new(CompletedTransfer))
    }

    /// Stores nothing: a completed transfer that pins nothing. Never fails.
    fn offload(
        &self,
        _block_ids: &PerLeaf<BlockId>,
        _block_hashes: &PerLeaf<BlockHash>,
        _replica_idx: usize,
    ) -> Result<KVConnectorTransfer, ConnectorError> {
        Ok(KVConnectorTransfer::completed())
    }

    fn metrics(&self) -> KVCacheMetrics {
        KVCacheMetrics::default()
    }

    fn take_metrics(&self) -> KVCacheMetrics {
        KVCacheMetrics::default()
    }
}
