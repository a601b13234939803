//! `NullConnector`: no external cache (MAX
//! `max.pipelines.kv_cache.connectors.NullConnector`).

use std::collections::BTreeMap;

use super::ledger::{LookupLedger, check_distinct_destinations, check_per_leaf, nothing_to_move};
use super::{
    BlockHash, BlockId, CompletedTransfer, ConnectorError, KVCacheGroupId, KVCacheMetrics,
    KVConnector, KVConnectorTransfer, KVTransfer, LeafId, PerLeaf,
};

/// No-op connector for when external caching is disabled: holds nothing, so
/// every lookup says absent; a load of nothing and every offload return a
/// completed transfer; metrics stay empty.
///
/// It still enforces the interface's argument rules (hash lengths via
/// [`BlockHash`], per-leaf lengths, lookup before load), so a caller that is
/// correct against it is correct against any connector.
#[derive(Debug)]
pub struct NullConnector {
    leaves: BTreeMap<LeafId, KVCacheGroupId>,
    ledger: LookupLedger,
}

impl Default for NullConnector {
    /// Serves one full-attention leaf, `"full"` (as one MAX generation does).
    fn default() -> Self {
        Self::new(BTreeMap::from([(
            LeafId::from("full"),
            KVCacheGroupId::full(),
        )]))
    }
}

impl NullConnector {
    /// A null connector reporting `leaves`.
    pub fn new(leaves: BTreeMap<LeafId, KVCacheGroupId>) -> Self {
        Self {
            leaves,
            ledger: LookupLedger::default(),
        }
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
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<PerLeaf<bool>, ConnectorError> {
        self.ledger.record_lookup(replica_idx, hint);
        Ok(self
            .leaves
            .keys()
            .map(|l| (l.clone(), vec![false; block_hashes.len()]))
            .collect())
    }

    /// [`CompletedTransfer`] when no block is asked for; otherwise
    /// [`ConnectorError::LoadRefused`] naming the first block (it holds none).
    fn load(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<Box<dyn KVTransfer>, ConnectorError> {
        check_per_leaf(&self.leaves, block_ids, block_hashes)?;
        check_distinct_destinations(block_ids)?;
        self.ledger.consume(replica_idx, hint)?;
        if nothing_to_move(block_hashes) {
            return Ok(Box::new(CompletedTransfer));
        }
        let (leaf_id, hashes) = block_hashes
            .iter()
            .find(|(_, h)| !h.is_empty())
            .expect("a non-empty leaf");
        Err(ConnectorError::LoadRefused {
            leaf_id: Some(leaf_id.clone()),
            block_hash: Some(hashes[0]),
            reason: "NullConnector holds no blocks".into(),
        })
    }

    /// Stores nothing: a completed transfer that pins nothing.
    fn offload(
        &self,
        block_ids: &PerLeaf<BlockId>,
        block_hashes: &PerLeaf<BlockHash>,
        _replica_idx: usize,
    ) -> Result<KVConnectorTransfer, ConnectorError> {
        check_per_leaf(&self.leaves, block_ids, block_hashes)?;
        Ok(KVConnectorTransfer::completed())
    }

    fn metrics(&self) -> KVCacheMetrics {
        KVCacheMetrics::default()
    }

    fn take_metrics(&self) -> KVCacheMetrics {
        KVCacheMetrics::default()
    }
}
