//! Prefix reuse through a KV connector (`--connector host`): per request,
//! look the prompt's full pages up in the host tier, load the hits, compute
//! only the rest, offload the new full pages.
//!
//! The trace's `hash_ids` name 512-token blocks; a page holds `page_tokens`
//! tokens, so each block splits into `512 / page_tokens` page hashes. A
//! page's bytes are a function of its hash (prefix pages) or of the request
//! (the rest), so a page loaded from the tier is byte-identical to a
//! computed one and decode checks both the same way.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Result, bail};
use kvwire::connector::replay::{load_prefix, offload_prefix, unlimited_tier_hit_rate};
use kvwire::connector::{
    BlockId, DevicePages, HostTierConnector, KVCacheGroupId, KVConnector, KVConnectorTransfer, KVTransfer, LeafId,
};
use kvwire::kv::KVTransferEngine;
use serde::Serialize;

use super::trace::TraceRequest;
use crate::pattern::mix;

/// Leaf id of the one KV group.
pub(super) const LEAF: &str = "kv";

/// Tokens per `hash_ids` block in Mooncake traces.
pub(super) const TRACE_BLOCK_TOKENS: u64 = 512;

/// Hashes of the full pages of a prompt that its `hash_ids` cover.
pub(super) fn page_hashes(r: &TraceRequest, page_tokens: u64) -> Vec<u64> {
    let per_block = (TRACE_BLOCK_TOKENS / page_tokens).max(1);
    let full_pages = r.input_length / page_tokens;
    let covered = (r.hash_ids.len() as u64 * per_block).min(full_pages);
    (0..covered)
        .map(|j| mix(r.hash_ids[(j / per_block) as usize].wrapping_mul(0x9E37).wrapping_add(j % per_block)))
        .collect()
}

/// Content key of page `j` of request `id`: its hash when the prefix covers it.
pub(super) fn page_content_key(id: u64, j: usize, hashes: &[u64]) -> u64 {
    hashes.get(j).copied().unwrap_or_else(|| mix(id.wrapping_mul(0x1_0000_0001) ^ ((j as u64) << 1) ^ 1))
}

/// Prefix-reuse figures for the report.
#[derive(Debug, Default, Clone, Serialize)]
pub(super) struct PrefixStats {
    /// Full prompt pages covered by `hash_ids` (candidates for reuse).
    pub prefix_pages: u64,
    /// Of those, served from the tier.
    pub pages_loaded: u64,
    /// Pages "computed" (filled) by prefill.
    pub pages_computed: u64,
    /// Bytes loaded from the tier (all shards).
    pub bytes_loaded: u64,
    /// Bytes computed (all shards).
    pub bytes_computed: u64,
    /// `pages_loaded / prefix_pages`.
    pub prefix_hit_rate: f64,
    /// The same rule with a tier of unlimited size.
    pub unlimited_tier_hit_rate: f64,
}

/// The host tier the prefill engine offloads to and loads from.
pub(super) struct PrefixTier {
    connector: HostTierConnector,
    /// Running figures.
    pub stats: PrefixStats,
}

impl PrefixTier {
    /// A tier of `capacity_bytes` over every replica of `engine`'s one group.
    ///
    /// # Errors
    /// `page_tokens` not dividing 512; connector construction errors.
    pub(super) fn new(engine: &KVTransferEngine, capacity_bytes: u64, page_tokens: u64) -> Result<Self> {
        if page_tokens > TRACE_BLOCK_TOKENS || !TRACE_BLOCK_TOKENS.is_multiple_of(page_tokens) {
            bail!("--connector needs --page-tokens dividing {TRACE_BLOCK_TOKENS} (the trace's hash block)");
        }
        let leaf = LeafId::from(LEAF);
        let replicas = engine
            .memory()
            .iter()
            .map(|groups| {
                let pages: Arc<dyn DevicePages> = Arc::new(groups[0].clone());
                BTreeMap::from([(leaf.clone(), pages)])
            })
            .collect();
        let connector =
            HostTierConnector::new(BTreeMap::from([(leaf, KVCacheGroupId::full())]), replicas, capacity_bytes)?;
        Ok(Self { connector, stats: PrefixStats::default() })
    }

    /// Load the longest held prefix of `hashes` into `pages` (waits for the
    /// copy); returns how many leading pages were served.
    ///
    /// # Errors
    /// Connector errors other than a refusal (which counts as a miss).
    pub(super) fn load(&mut self, hashes: &[u64], pages: &[u64], replica: usize) -> Result<usize> {
        let ids: Vec<BlockId> = pages[..hashes.len()].iter().map(|&p| BlockId(p as u32)).collect();
        let l = load_prefix(&self.connector, hashes, &ids, replica)?;
        l.transfer.synchronize()?;
        Ok(l.hit_blocks)
    }

    /// Offload `pages[from..hashes.len()]` under their hashes; the pages stay
    /// pinned until the returned transfer completes.
    ///
    /// # Errors
    /// Connector errors.
    pub(super) fn offload(
        &self,
        hashes: &[u64],
        pages: &[u64],
        from: usize,
        replica: usize,
    ) -> Result<KVConnectorTransfer> {
        let ids: Vec<BlockId> = pages[..hashes.len()].iter().map(|&p| BlockId(p as u32)).collect();
        Ok(offload_prefix(&self.connector, hashes, &ids, from, hashes.len(), replica)?)
    }

    /// Record one request: `hit` of `prefix` pages loaded, `total` pages, `page_bytes` per page (all shards).
    pub(super) fn record(&mut self, hit: usize, prefix: usize, total: usize, page_bytes: u64) {
        let s = &mut self.stats;
        s.prefix_pages += prefix as u64;
        s.pages_loaded += hit as u64;
        s.pages_computed += (total - hit) as u64;
        s.bytes_loaded += hit as u64 * page_bytes;
        s.bytes_computed += (total - hit) as u64 * page_bytes;
    }

    /// Final figures, with the unlimited-tier rate of the same page hashes.
    pub(super) fn finish(mut self, all_hashes: &[Vec<u64>]) -> PrefixStats {
        self.connector.shutdown();
        let unlimited = unlimited_tier_hit_rate(all_hashes.iter().map(|h| (h.as_slice(), h.len())));
        self.stats.unlimited_tier_hit_rate = unlimited.rate();
        self.stats.prefix_hit_rate = if self.stats.prefix_pages == 0 {
            0.0
        } else {
            self.stats.pages_loaded as f64 / self.stats.prefix_pages as f64
        };
        self.stats
    }
}

/// A pinned offload: is it done? (errors count as done: the tier dropped it).
pub(super) fn offload_landed(t: &KVConnectorTransfer) -> bool {
    t.is_complete().unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(input: u64, hashes: Vec<u64>) -> TraceRequest {
        TraceRequest { timestamp: 0, input_length: input, output_length: 1, hash_ids: hashes }
    }

    #[test]
    fn blocks_split_into_page_hashes_only_for_full_pages() {
        // 1300 tokens: 2 full 512-token blocks + a partial one; 10 full pages of 128
        let r = req(1300, vec![7, 8, 9]);
        let h = page_hashes(&r, 128);
        assert_eq!(h.len(), 10);
        let again = page_hashes(&req(2000, vec![7, 8]), 128);
        assert_eq!(&h[..8], &again[..8], "same blocks, same page hashes");
        assert_ne!(h[0], h[1]);
        assert_eq!(page_hashes(&req(100, vec![7]), 128).len(), 0);
        assert_eq!(page_content_key(5, 3, &h), h[3]);
        assert_ne!(page_content_key(5, 10, &h), page_content_key(6, 10, &h));
    }
}
