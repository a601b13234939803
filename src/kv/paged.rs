//! Building a [`KVTransferEngine`] from a paged-cache description, as MAX's
//! `KVTransferEngine.from_paged_kv_cache`.

use std::sync::Arc;

use super::engine::KVTransferEngine;
use super::error::KvError;
use super::memory::KVCacheMemory;
use crate::HostBuffer;
use crate::transport::{TransportConfig, TransportKind};

/// Suffix of the group holding a leaf's quantization scales (MAX: `leaf_id + "/scales"`).
pub const SCALES_SUFFIX: &str = "/scales";

/// What a cache leaf keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeafKind {
    /// Paged attention KV (values, optionally FP8 scales).
    Attention,
    /// Recurrent (Mamba-style) state: no page count in common with attention
    /// groups; not transferable (MAX: `NotImplementedError`).
    RecurrentState,
}

/// One leaf of a paged cache (a child cache such as target or draft, or a
/// sliding/global window), as its producer authors it.
#[derive(Debug, Clone)]
pub struct CacheLeaf {
    /// Leaf id; transfers address pages by it.
    pub leaf_id: String,
    /// Attention or recurrent state.
    pub kind: LeafKind,
    /// Values, one [`KVCacheMemory`] per DP replica.
    pub values: Vec<KVCacheMemory>,
    /// Quantization scales (FP8 caches), one per DP replica; registered as
    /// their own group `{leaf_id}/scales`, right after the values.
    pub scales: Option<Vec<KVCacheMemory>>,
}

/// A paged KV cache: its leaves in declared order (MAX: `params.leaves()`).
#[derive(Debug, Clone, Default)]
pub struct PagedCacheDesc {
    /// Leaves, in declared order.
    pub leaves: Vec<CacheLeaf>,
}

/// Geometry of one leaf for [`PagedCacheDesc::allocate_host`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLeafSpec {
    /// Leaf id.
    pub leaf_id: String,
    /// Pages per shard, null block included.
    pub num_pages: u64,
    /// Bytes per page of one shard.
    pub bytes_per_page: u64,
    /// Identical bytes on every shard (MLA); needs TP ≥ 2.
    pub replicated: bool,
    /// Bytes per page of the FP8 scales group, if the leaf is quantized.
    pub scales_bytes_per_page: Option<u64>,
}

/// Host buffers of an allocated cache, `[replica][group][shard]`, groups in
/// engine order (each leaf's values, then its scales).
pub type HostPages = Vec<Vec<Vec<Arc<HostBuffer>>>>;

impl PagedCacheDesc {
    /// The groups, `[replica][group]`, and their leaf ids: each leaf's
    /// values, then its scales, in declared order.
    ///
    /// # Errors
    /// [`KvError::Unsupported`] when a leaf keeps recurrent state.
    pub fn to_memory(&self) -> Result<(Vec<Vec<KVCacheMemory>>, Vec<String>), KvError> {
        if let Some(l) = self.leaves.iter().find(|l| l.kind == LeafKind::RecurrentState) {
            return Err(KvError::Unsupported(format!(
                "leaf {:?} keeps recurrent state, which has no page count in common with attention groups",
                l.leaf_id
            )));
        }
        let dp = self.leaves.iter().map(|l| l.values.len()).max().unwrap_or(0);
        let mut memory: Vec<Vec<KVCacheMemory>> = vec![Vec::new(); dp];
        let mut ids = Vec::new();
        for l in &self.leaves {
            ids.push(l.leaf_id.clone());
            for (r, m) in l.values.iter().enumerate() {
                memory[r].push(m.clone());
            }
            if let Some(scales) = &l.scales {
                ids.push(format!("{}{SCALES_SUFFIX}", l.leaf_id));
                for (r, m) in scales.iter().enumerate() {
                    if r < dp {
                        memory[r].push(m.clone());
                    }
                }
            }
        }
        Ok((memory, ids))
    }

    /// Allocate a host-memory cache: `dp` replicas of `tp` shards for each
    /// leaf in `specs` (attention leaves). Returns the description and its
    /// host buffers.
    ///
    /// # Errors
    /// [`KvError::Alloc`] and the rules of [`KVCacheMemory::new`].
    pub fn allocate_host(specs: &[HostLeafSpec], dp: usize, tp: usize) -> Result<(Self, HostPages), KvError> {
        let mut hosts: HostPages = vec![Vec::new(); dp];
        let mut leaves = Vec::with_capacity(specs.len());
        for s in specs {
            let mut values = Vec::with_capacity(dp);
            let mut scales = s.scales_bytes_per_page.map(|_| Vec::with_capacity(dp));
            for h in hosts.iter_mut() {
                let (m, hb) = KVCacheMemory::new_host(tp, s.num_pages, s.bytes_per_page, s.replicated)?;
                values.push(m);
                h.push(hb);
                if let (Some(bpp), Some(sc)) = (s.scales_bytes_per_page, scales.as_mut()) {
                    let (m, hb) = KVCacheMemory::new_host(tp, s.num_pages, bpp, s.replicated)?;
                    sc.push(m);
                    h.push(hb);
                }
            }
            leaves.push(CacheLeaf { leaf_id: s.leaf_id.clone(), kind: LeafKind::Attention, values, scales });
        }
        Ok((Self { leaves }, hosts))
    }
}

impl KVTransferEngine {
    /// Build an engine from a paged cache, as MAX's `from_paged_kv_cache`:
    /// one group per leaf in declared order, plus a separate group
    /// `{leaf_id}/scales` after each quantized leaf; `replicated_per_group`
    /// is carried from the groups.
    ///
    /// # Errors
    /// [`KvError::Unsupported`] when the cache keeps recurrent state (MAX:
    /// `NotImplementedError`); then those of [`KVTransferEngine::new`]
    /// (e.g. [`KvError::DuplicateLeafId`], [`KvError::GroupCountMismatch`]
    /// when leaves disagree on the replica count).
    pub fn from_paged_cache(
        name: &str,
        cache: &PagedCacheDesc,
        transport: TransportKind,
        cfg: &TransportConfig,
    ) -> Result<Self, KvError> {
        let (memory, ids) = cache.to_memory()?;
        Self::new(name, memory, Some(ids), transport, cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: &str, pages: u64, bpp: u64, scales: Option<u64>) -> HostLeafSpec {
        HostLeafSpec {
            leaf_id: id.into(),
            num_pages: pages,
            bytes_per_page: bpp,
            replicated: false,
            scales_bytes_per_page: scales,
        }
    }

    #[test]
    fn groups_follow_declared_leaves_with_scales_after_values() {
        let specs = [spec("target", 10, 512, Some(16)), spec("draft", 4, 64, None)];
        let (cache, hosts) = PagedCacheDesc::allocate_host(&specs, 2, 2).unwrap();
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1].len(), 3);
        assert_eq!(hosts[1][1].len(), 2);
        let e =
            KVTransferEngine::from_paged_cache("pc", &cache, TransportKind::Shm, &TransportConfig::default()).unwrap();
        assert_eq!(e.leaf_ids(), ["target", "target/scales", "draft"]);
        assert_eq!(e.bytes_per_group(), [512, 16, 64]);
        assert_eq!(e.num_pages_per_group(), [10, 10, 4]);
        assert_eq!(e.replicated_per_group(), [false, false, false]);
        assert_eq!((e.dp(), e.tp()), (2, 2));
    }

    #[test]
    fn recurrent_state_is_unsupported_and_clashes_are_caught() {
        let (mut cache, _) = PagedCacheDesc::allocate_host(&[spec("a", 4, 64, None)], 1, 1).unwrap();
        let mut state = cache.leaves[0].clone();
        state.leaf_id = "ssm".into();
        state.kind = LeafKind::RecurrentState;
        cache.leaves.push(state);
        let cfg = TransportConfig::default();
        assert!(matches!(
            KVTransferEngine::from_paged_cache("pc2", &cache, TransportKind::Shm, &cfg),
            Err(KvError::Unsupported(_))
        ));
        let (mut cache, _) =
            PagedCacheDesc::allocate_host(&[spec("a", 4, 64, Some(8)), spec("b", 4, 64, None)], 1, 1).unwrap();
        cache.leaves[1].leaf_id = "a/scales".into();
        assert!(matches!(
            KVTransferEngine::from_paged_cache("pc3", &cache, TransportKind::Shm, &cfg),
            Err(KvError::DuplicateLeafId(_))
        ));
        let (mut cache, _) =
            PagedCacheDesc::allocate_host(&[spec("a", 4, 64, None), spec("b", 4, 64, None)], 2, 1).unwrap();
        cache.leaves[1].values.pop();
        assert!(matches!(
            KVTransferEngine::from_paged_cache("pc4", &cache, TransportKind::Shm, &cfg),
            Err(KvError::GroupCountMismatch { replica: 1, .. })
        ));
    }
}
