//! Fixtures shared by the connector tests: every connector over the same
//! leaves, host-memory device pages with recognizable bytes.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use kvwire::connector::{
    BlockHash, BlockId, DevicePages, HostPages, HostTierConnector, KVCacheGroupId, KVConnector, LeafId, NullConnector,
    PerLeaf,
};

/// Bytes per page of every test leaf.
pub(crate) const BPP: usize = 64;
/// Pages per shard (block 0 is the null block and never used).
pub(crate) const PAGES: usize = 32;

/// `(leaf, group, num_shards, replicated)`: a TP=2 full-attention leaf, a
/// replicated (MLA) one, and a one-shard sliding-window leaf.
pub(crate) fn leaf_specs() -> Vec<(&'static str, KVCacheGroupId, usize, bool)> {
    vec![
        ("full", KVCacheGroupId::full(), 2, false),
        ("mla", KVCacheGroupId::full(), 2, true),
        ("swa", KVCacheGroupId::sliding_window(1024), 1, false),
    ]
}

/// Host row bytes per leaf: full 128, mla 64, swa 64.
pub(crate) fn row_bytes(leaf: &str) -> u64 {
    match leaf {
        "full" => 2 * BPP as u64,
        _ => BPP as u64,
    }
}

pub(crate) fn leaves() -> BTreeMap<LeafId, KVCacheGroupId> {
    leaf_specs().into_iter().map(|(l, g, _, _)| (LeafId::from(l), g)).collect()
}

/// A connector under test plus the device pages it serves (`pages[replica][leaf]`).
pub(crate) struct Fixture {
    pub conn: Box<dyn KVConnector>,
    pub pages: Vec<BTreeMap<LeafId, Arc<HostPages>>>,
    /// Whether offloaded blocks can be loaded back (false for Null).
    pub holds: bool,
    /// Whether every call succeeds whatever its arguments, moving nothing
    /// (MAX 26.7's `NullConnector`: `load`/`offload` return
    /// `CompletedTransfer()`); otherwise the argument and lookup rules of
    /// `KVConnector` are enforced.
    pub accepts_anything: bool,
}

impl Fixture {
    pub(crate) fn page(&self, replica: usize, leaf: &str, shard: usize, block: u32) -> Vec<u8> {
        self.pages[replica][leaf].page(shard, BlockId(block)).to_vec()
    }

    /// Write `content(hash, leaf, shard)` into `block` on every leaf of `replica`.
    pub(crate) fn fill(&self, replica: usize, block: u32, hash: u64) {
        for (leaf, p) in &self.pages[replica] {
            fill_page(p, leaf.as_str(), block, hash);
        }
    }

    /// Every page of every leaf and shard of `replica`.
    pub(crate) fn snapshot(&self, replica: usize) -> Vec<Vec<u8>> {
        let mut all = Vec::new();
        for p in self.pages[replica].values() {
            for shard in 0..p.num_shards() {
                all.extend((0..PAGES as u32).map(|b| p.page(shard, BlockId(b))));
            }
        }
        all
    }

    /// Assert `block` on every leaf of `replica` holds `content(hash, ..)`.
    pub(crate) fn assert_holds(&self, replica: usize, block: u32, hash: u64) {
        for (leaf, p) in &self.pages[replica] {
            for shard in 0..p.num_shards() {
                let want = content(hash, leaf.as_str(), if p.replicated() { 0 } else { shard });
                assert_eq!(p.page(shard, BlockId(block)), &want[..], "leaf {leaf} shard {shard} block {block}");
            }
        }
    }
}

/// Recognizable page bytes for `hash` on `leaf`/`shard`.
pub(crate) fn content(hash: u64, leaf: &str, shard: usize) -> Vec<u8> {
    let salt = leaf.bytes().fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(b as u64));
    (0..BPP)
        .map(|i| (hash.wrapping_mul(131).wrapping_add(salt * 7 + shard as u64 * 13 + i as u64) % 251) as u8)
        .collect()
}

/// Fill `block` of `pages` with `content(hash, leaf, shard)` (shard 0's bytes on
/// every shard of a replicated leaf).
pub(crate) fn fill_page(pages: &HostPages, leaf: &str, block: u32, hash: u64) {
    for shard in 0..pages.num_shards() {
        let c = content(hash, leaf, if pages.replicated() { 0 } else { shard });
        pages.write_page(shard, BlockId(block), &c).unwrap();
    }
}

fn alloc_pages(num_replicas: usize) -> Vec<BTreeMap<LeafId, Arc<HostPages>>> {
    (0..num_replicas)
        .map(|_| {
            leaf_specs()
                .into_iter()
                .map(|(l, _, shards, rep)| {
                    (LeafId::from(l), Arc::new(HostPages::alloc(shards, rep, PAGES, BPP).unwrap()))
                })
                .collect()
        })
        .collect()
}

/// A host tier of `capacity_bytes` over `num_replicas` replicas of the test leaves.
pub(crate) fn host_fixture(capacity_bytes: u64, num_replicas: usize) -> (Arc<HostTierConnector>, Fixture) {
    let pages = alloc_pages(num_replicas);
    let dyn_pages =
        pages.iter().map(|r| r.iter().map(|(l, p)| (l.clone(), p.clone() as Arc<dyn DevicePages>)).collect()).collect();
    let conn = Arc::new(HostTierConnector::new(leaves(), dyn_pages, capacity_bytes).unwrap());
    let fixture = Fixture { conn: Box::new(conn.clone()), pages, holds: true, accepts_anything: false };
    (conn, fixture)
}

/// A null connector over the test leaves (pages allocated for symmetry).
pub(crate) fn null_fixture(num_replicas: usize) -> Fixture {
    Fixture {
        conn: Box::new(NullConnector::new(leaves())),
        pages: alloc_pages(num_replicas),
        holds: false,
        accepts_anything: true,
    }
}

/// Every connector, each with 2 replicas and (host) room for 16 blocks of every leaf.
pub(crate) fn all_fixtures() -> Vec<Fixture> {
    vec![null_fixture(2), host_fixture(16 * 256, 2).1]
}

pub(crate) fn h(v: u64) -> BlockHash {
    BlockHash::from_u64(v)
}

pub(crate) fn hs(vs: &[u64]) -> Vec<BlockHash> {
    vs.iter().map(|&v| h(v)).collect()
}

pub(crate) fn ids(vs: &[u32]) -> Vec<BlockId> {
    vs.iter().map(|&v| BlockId(v)).collect()
}

/// The same list on every test leaf.
pub(crate) fn every_leaf<T: Clone>(v: Vec<T>) -> PerLeaf<T> {
    leaves().into_keys().map(|l| (l, v.clone())).collect()
}

/// `(block_ids, block_hashes)` on every leaf.
pub(crate) fn args(blocks: &[u32], hashes: &[u64]) -> (PerLeaf<BlockId>, PerLeaf<BlockHash>) {
    (every_leaf(ids(blocks)), every_leaf(hs(hashes)))
}
