//! Argument checks every connector shares: the lookup → load pairing rule and
//! the per-leaf shape of `load`/`offload` arguments.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use super::{BlockHash, BlockId, ConnectorError, KVCacheGroupId, LeafId, PerLeaf};

/// Distinct `(replica_idx, hint)` keys remembered; the least recently used
/// key is forgotten past this, which bounds the state back-to-back lookups
/// without loads leave (MAX: stateful connectors must bound it).
const MAX_LOOKUP_KEYS: usize = 1024;

/// Tracks lookups not yet followed by their load.
///
/// Rule (MAX `KVConnector.load`: "must follow a lookup() with the same
/// replica_idx and hint, at most once"): every `load` consumes one earlier,
/// unconsumed `lookup` with the same `replica_idx` and `hint`. Lookups that
/// are never loaded are fine (lookups are advisory).
#[derive(Debug, Default)]
pub(crate) struct LookupLedger {
    inner: Mutex<LedgerInner>,
}

/// `(replica_idx, hint)`.
type LookupKey = (usize, Option<Vec<u8>>);

#[derive(Debug, Default)]
struct LedgerInner {
    /// `(replica_idx, hint)` → (unconsumed lookups, last use tick).
    open: HashMap<LookupKey, (u64, u64)>,
    tick: u64,
}

impl LookupLedger {
    /// Record a lookup.
    pub(crate) fn record_lookup(&self, replica_idx: usize, hint: Option<&[u8]>) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.tick += 1;
        let tick = g.tick;
        let e = g
            .open
            .entry((replica_idx, hint.map(<[u8]>::to_vec)))
            .or_insert((0, 0));
        e.0 += 1;
        e.1 = tick;
        if g.open.len() > MAX_LOOKUP_KEYS {
            let oldest = g
                .open
                .iter()
                .min_by_key(|(_, v)| v.1)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                g.open.remove(&k);
            }
        }
    }

    /// Consume one lookup for a load.
    ///
    /// # Errors
    /// [`ConnectorError::LoadWithoutLookup`] when none is open.
    pub(crate) fn consume(
        &self,
        replica_idx: usize,
        hint: Option<&[u8]>,
    ) -> Result<(), ConnectorError> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = (replica_idx, hint.map(<[u8]>::to_vec));
        match g.open.get_mut(&key) {
            Some(e) if e.0 > 0 => {
                e.0 -= 1;
                if e.0 == 0 {
                    g.open.remove(&key);
                }
                Ok(())
            }
            _ => Err(ConnectorError::LoadWithoutLookup { replica_idx }),
        }
    }
}

/// Check `load`/`offload` arguments: every leaf named is served, and each
/// leaf's ids and hashes have equal length (a leaf absent from one map counts
/// as length 0).
///
/// # Errors
/// [`ConnectorError::UnknownLeaf`], [`ConnectorError::LengthMismatch`].
pub(crate) fn check_per_leaf(
    leaves: &BTreeMap<LeafId, KVCacheGroupId>,
    block_ids: &PerLeaf<BlockId>,
    block_hashes: &PerLeaf<BlockHash>,
) -> Result<(), ConnectorError> {
    for leaf_id in block_ids.keys().chain(block_hashes.keys()) {
        if !leaves.contains_key(leaf_id) {
            return Err(ConnectorError::UnknownLeaf {
                leaf_id: leaf_id.clone(),
            });
        }
        let num_block_ids = block_ids.get(leaf_id).map_or(0, Vec::len);
        let num_block_hashes = block_hashes.get(leaf_id).map_or(0, Vec::len);
        if num_block_ids != num_block_hashes {
            return Err(ConnectorError::LengthMismatch {
                leaf_id: leaf_id.clone(),
                num_block_ids,
                num_block_hashes,
            });
        }
    }
    Ok(())
}

/// Check that no leaf names the same destination block twice in one load.
///
/// # Errors
/// [`ConnectorError::DuplicateBlockId`].
pub(crate) fn check_distinct_destinations(
    block_ids: &PerLeaf<BlockId>,
) -> Result<(), ConnectorError> {
    for (leaf_id, ids) in block_ids {
        let mut seen = HashSet::with_capacity(ids.len());
        if let Some(&block_id) = ids.iter().find(|&&id| !seen.insert(id)) {
            return Err(ConnectorError::DuplicateBlockId {
                leaf_id: leaf_id.clone(),
                block_id,
            });
        }
    }
    Ok(())
}

/// True when every leaf's list is empty.
pub(crate) fn nothing_to_move<T>(per_leaf: &PerLeaf<T>) -> bool {
    per_leaf.values().all(Vec::is_empty)
}
