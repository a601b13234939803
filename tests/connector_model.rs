//! Property test: the host tier against a simple model, an LRU of byte size
//! with the tier's documented rules (prefix-order admission of whole blocks,
//! root most recent within a call, pinned rows not evictable during their
//! own offload call).

mod connector_util;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use connector_util::{content, fill_page};
use kvwire::connector::{
    BlockHash, BlockId, ConnectorError, DevicePages, HostPages, HostTierConnector, KVCacheGroupId, KVConnector,
    KVTransfer, LeafId, PerLeaf,
};
use proptest::prelude::*;

const LEAVES: [&str; 2] = ["a", "b"];
const ROW: [u64; 2] = [64, 128];
const UNIVERSE: u64 = 12;

#[derive(Debug, Clone)]
enum Op {
    /// Offload `hashes` on leaf a and their first `b_len` on leaf b.
    Offload(Vec<u64>, usize),
    Touch(Vec<u64>),
    Load(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = || prop::collection::vec(0..UNIVERSE, 0..6);
    prop_oneof![
        3 => (hashes(), 0..6usize).prop_map(|(h, b)| Op::Offload(h, b)),
        1 => hashes().prop_map(Op::Touch),
        2 => hashes().prop_map(Op::Load),
    ]
}

#[derive(Default)]
struct Model {
    capacity: u64,
    used: u64,
    /// `(leaf, hash)` → (bytes, tick).
    entries: HashMap<(usize, u64), (u64, u64)>,
    tick: u64,
}

impl Model {
    fn ticks(&mut self, n: usize) -> impl Fn(usize) -> u64 + use<> {
        let base = self.tick;
        self.tick += n as u64;
        move |i| base + (n - 1 - i) as u64
    }

    /// Refresh recency. Ticks only grow across calls; within one call a hash
    /// named twice keeps the recency of its first (most recent) position, as
    /// the tier does ("the first block of the sequence ends up most recent").
    fn touch(&mut self, key: (usize, u64), tick: u64) {
        if let Some(e) = self.entries.get_mut(&key) {
            e.1 = e.1.max(tick);
        }
    }

    fn offload(&mut self, per_leaf: &[Vec<u64>; 2]) {
        // Rows position by position, grouped by hash, each (leaf, hash) once.
        let mut groups: Vec<Vec<(usize, u64)>> = Vec::new();
        let mut by_hash = HashMap::new();
        let mut seen = HashSet::new();
        for i in 0..per_leaf[0].len().max(per_leaf[1].len()) {
            for (leaf, hashes) in per_leaf.iter().enumerate() {
                let Some(&h) = hashes.get(i) else { continue };
                if !seen.insert((leaf, h)) {
                    continue;
                }
                let g = *by_hash.entry(h).or_insert_with(|| {
                    groups.push(Vec::new());
                    groups.len() - 1
                });
                groups[g].push((leaf, h));
            }
        }
        let tick = self.ticks(groups.iter().map(Vec::len).sum());
        let mut k = 0;
        let mut pending = HashSet::new();
        for g in groups {
            let mut new = Vec::new();
            for key in g {
                if self.entries.contains_key(&key) {
                    self.touch(key, tick(k));
                } else {
                    new.push((key, tick(k)));
                }
                k += 1;
            }
            let needed: u64 = new.iter().map(|(key, _)| ROW[key.0]).sum();
            let evictable: u64 = self.entries.iter().filter(|(key, _)| !pending.contains(*key)).map(|(_, e)| e.0).sum();
            if needed > self.capacity - self.used + evictable {
                continue;
            }
            for (key, t) in new {
                while self.capacity - self.used < ROW[key.0] {
                    let victim = *self
                        .entries
                        .iter()
                        .filter(|(key, _)| !pending.contains(*key))
                        .min_by_key(|(_, e)| e.1)
                        .unwrap()
                        .0;
                    self.used -= self.entries.remove(&victim).unwrap().0;
                }
                self.used += ROW[key.0];
                self.entries.insert(key, (ROW[key.0], t));
                pending.insert(key);
            }
        }
    }

    fn holds_all(&self, hashes: &[u64]) -> bool {
        hashes.iter().all(|&h| (0..2).all(|l| self.entries.contains_key(&(l, h))))
    }

    fn load(&mut self, hashes: &[u64]) {
        let tick = self.ticks(hashes.len() * 2);
        for (i, &h) in hashes.iter().enumerate() {
            for l in 0..2 {
                self.touch((l, h), tick(i * 2 + l));
            }
        }
    }
}

fn per_leaf<T: Clone>(a: Vec<T>, b: Vec<T>) -> PerLeaf<T> {
    PerLeaf::from([(LeafId::from("a"), a), (LeafId::from("b"), b)])
}

fn bh(v: &[u64]) -> Vec<BlockHash> {
    v.iter().map(|&h| BlockHash::from_u64(h)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn host_tier_matches_an_lru_of_byte_size(capacity in 0u64..1200, ops in prop::collection::vec(op(), 1..40)) {
        let pages = [
            Arc::new(HostPages::alloc(1, false, 40, 64).unwrap()),
            Arc::new(HostPages::alloc(2, false, 40, 64).unwrap()),
        ];
        let leaves: BTreeMap<_, _> = LEAVES.iter().map(|&l| (LeafId::from(l), KVCacheGroupId::full())).collect();
        let replica = LEAVES.iter().zip(&pages).map(|(&l, p)| (LeafId::from(l), p.clone() as Arc<dyn DevicePages>)).collect();
        let conn = HostTierConnector::new(leaves, vec![replica], capacity).unwrap();
        let mut model = Model { capacity, ..Default::default() };

        for op in ops {
            match op {
                Op::Offload(hashes, b_len) => {
                    let b: Vec<u64> = hashes[..b_len.min(hashes.len())].to_vec();
                    for (i, &h) in hashes.iter().enumerate() {
                        for (l, p) in LEAVES.iter().zip(&pages) {
                            fill_page(p, l, 1 + i as u32, h);
                        }
                    }
                    let src = |n: usize| (1..=n as u32).map(BlockId).collect::<Vec<_>>();
                    let t = conn.offload(&per_leaf(src(hashes.len()), src(b.len())), &per_leaf(bh(&hashes), bh(&b)), 0).unwrap();
                    t.synchronize().unwrap();
                    model.offload(&[hashes, b]);
                }
                Op::Touch(hashes) => {
                    conn.touch(&bh(&hashes), 0);
                    let tick = model.ticks(hashes.len() * 2);
                    for (i, &h) in hashes.iter().enumerate() {
                        for l in 0..2 {
                            model.touch((l, h), tick(i * 2 + l));
                        }
                    }
                }
                Op::Load(hashes) => {
                    conn.lookup(&bh(&hashes), 0, None).unwrap();
                    let dst: Vec<BlockId> = (0..hashes.len() as u32).map(|i| BlockId(20 + i)).collect();
                    let r = conn.load(&per_leaf(dst.clone(), dst.clone()), &per_leaf(bh(&hashes), bh(&hashes)), 0, None);
                    if model.holds_all(&hashes) {
                        r.unwrap().synchronize().unwrap();
                        model.load(&hashes);
                        for (i, &h) in hashes.iter().enumerate() {
                            prop_assert_eq!(pages[0].page(0, dst[i]), &content(h, "a", 0)[..]);
                            prop_assert_eq!(pages[1].page(1, dst[i]), &content(h, "b", 1)[..]);
                        }
                    } else {
                        let refused = matches!(r, Err(ConnectorError::LoadRefused { .. }));
                        prop_assert!(refused);
                    }
                }
            }
            let all: Vec<u64> = (0..UNIVERSE).collect();
            let masks = conn.lookup(&bh(&all), 0, None).unwrap();
            for (l, leaf) in LEAVES.iter().enumerate() {
                let want: Vec<bool> = all.iter().map(|&h| model.entries.contains_key(&(l, h))).collect();
                prop_assert_eq!(&masks[&LeafId::from(*leaf)], &want, "leaf {}", leaf);
            }
            prop_assert_eq!(conn.host_byte_count().used(), model.used);
            prop_assert!(model.used <= capacity);
        }
    }
}
