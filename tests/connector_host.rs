//! Host tier behaviour beyond the shared contract: LRU by bytes, pins under
//! pressure, concurrency, replicated leaves, failures, shutdown.

mod connector_util;

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use connector_util::*;
use kvwire::connector::{
    BlockId, ConnectorError, DevicePages, HostTierConnector, KVCacheGroupId, KVConnector, KVTransfer, LeafId, PerLeaf,
};
use kvwire::kv::KVCacheMemory;

/// Bytes of one block on every test leaf (128 + 64 + 64).
const BLOCK_BYTES: u64 = 256;

fn offload_sync(f: &Fixture, block: u32, hash: u64) {
    f.fill(0, block, hash);
    let (i, hsh) = args(&[block], &[hash]);
    f.conn.offload(&i, &hsh, 0).unwrap().synchronize().unwrap();
}

fn present(f: &Fixture, hashes: &[u64]) -> Vec<bool> {
    let masks = f.conn.lookup(&hs(hashes), 0, None).unwrap();
    // Keep the ledger balanced: every lookup here is followed by an empty load.
    f.conn.load(&PerLeaf::new(), &PerLeaf::new(), 0, None).unwrap();
    let full = &masks[&LeafId::from("full")];
    assert!(masks.values().all(|m| m == full), "leaves agree");
    full.clone()
}

#[test]
fn lru_evicts_least_recently_used_and_touch_refreshes() {
    let (_c, f) = host_fixture(3 * BLOCK_BYTES, 1);
    for (b, hash) in [(1, 1), (2, 2), (3, 3)] {
        offload_sync(&f, b, hash);
    }
    f.conn.touch(&hs(&[1]), 0);
    offload_sync(&f, 4, 4);
    assert_eq!(present(&f, &[1, 2, 3, 4]), vec![true, false, true, true], "2 was least recently used");
    assert_eq!(f.conn.host_byte_count().used(), 3 * BLOCK_BYTES);
}

#[test]
fn one_call_keeps_the_root_most_recent_so_tails_go_first() {
    let (_c, f) = host_fixture(3 * BLOCK_BYTES, 1);
    for (b, hash) in [(1, 10), (2, 11), (3, 12)] {
        f.fill(0, b, hash);
    }
    let (i, hsh) = args(&[1, 2, 3], &[10, 11, 12]);
    f.conn.offload(&i, &hsh, 0).unwrap().synchronize().unwrap();
    offload_sync(&f, 4, 20);
    assert_eq!(present(&f, &[10, 11, 12, 20]), vec![true, true, false, true]);
}

#[test]
fn offload_drops_what_does_not_fit_and_reports_it() {
    let (_c, f) = host_fixture(2 * BLOCK_BYTES + 10, 1);
    for (b, hash) in [(1, 1), (2, 2), (3, 3)] {
        f.fill(0, b, hash);
    }
    let (i, hsh) = args(&[1, 2, 3], &[1, 2, 3]);
    let t = f.conn.offload(&i, &hsh, 0).unwrap();
    // Blocks of one call are pending, so none evicts another: the root fits.
    assert_eq!(t.g0_blocks_per_leaf(), &every_leaf(ids(&[1, 2])));
    t.synchronize().unwrap();
    assert_eq!(f.conn.take_metrics().connector_offload_blocks_dropped, 3);
    assert_eq!(present(&f, &[1, 2, 3]), vec![true, true, false]);

    let (_c, tiny) = host_fixture(100, 1);
    tiny.fill(0, 1, 1);
    let (i, hsh) = args(&[1], &[1]);
    let t = tiny.conn.offload(&i, &hsh, 0).unwrap();
    assert_eq!(t.num_pinned_blocks(), 0, "a block's rows are stored together or not at all");
    assert_eq!(tiny.conn.take_metrics().connector_offload_blocks_dropped, 3);
}

#[test]
fn eviction_under_pressure_never_drops_a_block_a_pending_load_reads() {
    let (c, f) = host_fixture(2 * BLOCK_BYTES, 1);
    offload_sync(&f, 1, 1);
    offload_sync(&f, 2, 2);
    f.conn.lookup(&hs(&[1]), 0, None).unwrap();
    let pause = c.pause_worker();
    let (i, hsh) = args(&[10], &[1]);
    let load = f.conn.load(&i, &hsh, 0, None).unwrap();
    assert!(!load.is_complete().unwrap());

    // Pressure: 3 new blocks for room of 2. 2 is evicted; 1 is pinned by the
    // load; the rest is dropped.
    for (b, hash) in [(3, 3), (4, 4), (5, 5)] {
        f.fill(0, b, hash);
    }
    let (i, hsh) = args(&[3, 4, 5], &[3, 4, 5]);
    let off = f.conn.offload(&i, &hsh, 0).unwrap();
    assert_eq!(off.g0_blocks_per_leaf(), &every_leaf(ids(&[3])));
    assert_eq!(f.conn.host_byte_count().free, 0);
    assert!(!load.is_complete().unwrap(), "still paused");
    drop(pause);
    load.synchronize().unwrap();
    off.synchronize().unwrap();
    f.assert_holds(0, 10, 1);
    assert_eq!(present(&f, &[1, 2, 3]), vec![true, false, true]);

    // Once landed, 1 is evictable again (and older than 3).
    offload_sync(&f, 6, 6);
    assert_eq!(present(&f, &[1, 3, 6]), vec![false, true, true]);
}

#[test]
fn offload_and_load_of_the_same_hash_in_flight() {
    let (c, f) = host_fixture(16 * BLOCK_BYTES, 1);
    // An offload in flight is invisible: lookup says absent, load refuses.
    let pause = c.pause_worker();
    f.fill(0, 1, 7);
    let (i, hsh) = args(&[1], &[7]);
    let off = f.conn.offload(&i, &hsh, 0).unwrap();
    assert_eq!(present(&f, &[7]), vec![false]);
    f.conn.lookup(&hs(&[7]), 0, None).unwrap();
    let (i2, hsh2) = args(&[2], &[7]);
    assert!(matches!(f.conn.load(&i2, &hsh2, 0, None), Err(ConnectorError::LoadRefused { .. })));
    // A second offload of it is skipped.
    assert_eq!(f.conn.offload(&i2, &hsh2, 0).unwrap().num_pinned_blocks(), 0);
    drop(pause);
    off.synchronize().unwrap();

    // A load in flight pins the entry; an offload of the same hash from other
    // bytes is skipped, and the load delivers the original bytes.
    f.conn.lookup(&hs(&[7]), 0, None).unwrap();
    let pause = c.pause_worker();
    let load = f.conn.load(&i2, &hsh2, 0, None).unwrap();
    f.fill(0, 3, 999);
    let (i3, hsh3) = args(&[3], &[7]);
    assert_eq!(f.conn.offload(&i3, &hsh3, 0).unwrap().num_pinned_blocks(), 0);
    drop(pause);
    load.synchronize().unwrap();
    f.assert_holds(0, 2, 7);
}

#[test]
fn a_pinned_device_block_is_read_before_a_later_load_overwrites_it() {
    let (c, f) = host_fixture(16 * BLOCK_BYTES, 1);
    offload_sync(&f, 1, 1);
    let pause = c.pause_worker();
    f.fill(0, 5, 50);
    let (i, hsh) = args(&[5], &[50]);
    let off = f.conn.offload(&i, &hsh, 0).unwrap();
    f.conn.lookup(&hs(&[1]), 0, None).unwrap();
    let (i, hsh) = args(&[5], &[1]);
    let load = f.conn.load(&i, &hsh, 0, None).unwrap();
    drop(pause);
    off.synchronize().unwrap();
    load.synchronize().unwrap();
    f.assert_holds(0, 5, 1);
    f.conn.lookup(&hs(&[50]), 0, None).unwrap();
    let (i, hsh) = args(&[6], &[50]);
    f.conn.load(&i, &hsh, 0, None).unwrap().synchronize().unwrap();
    f.assert_holds(0, 6, 50);
}

#[test]
fn threads_offload_and_load_overlapping_hashes() {
    let (c, f) = host_fixture(12 * BLOCK_BYTES, 4);
    let f = Arc::new(f);
    std::thread::scope(|s| {
        for r in 0..4usize {
            let f = f.clone();
            let c = c.clone();
            s.spawn(move || {
                let hint = format!("thread-{r}").into_bytes();
                for round in 0..50u64 {
                    let hash = (round * 7 + r as u64) % 20;
                    let src = 1 + (round % 10) as u32;
                    f.fill(r, src, hash);
                    let (i, hsh) = (every_leaf(ids(&[src])), every_leaf(hs(&[hash])));
                    c.offload(&i, &hsh, r).unwrap().synchronize().unwrap();
                    let want = (round * 3 + 1) % 20;
                    let masks = c.lookup(&hs(&[want]), r, Some(&hint)).unwrap();
                    let dst = 20 + (round % 10) as u32;
                    let held = masks.values().all(|m| m[0]);
                    let (i, hsh) = if held { args(&[dst], &[want]) } else { args(&[], &[]) };
                    match c.load(&i, &hsh, r, Some(&hint)) {
                        Ok(t) => {
                            t.synchronize().unwrap();
                            if held {
                                f.assert_holds(r, dst, want);
                            }
                        }
                        Err(ConnectorError::LoadRefused { .. }) => {} // evicted since the lookup
                        Err(e) => panic!("{e}"),
                    }
                }
            });
        }
    });
    assert!(c.host_byte_count().used() <= 12 * BLOCK_BYTES);
}

#[test]
fn replicated_leaf_is_stored_once_and_broadcast_to_every_shard_and_replica() {
    let (c, f) = host_fixture(16 * BLOCK_BYTES, 2);
    assert_eq!(c.host_bytes_per_block("mla"), Some(64));
    assert_eq!(c.host_bytes_per_block("full"), Some(128));
    offload_sync(&f, 1, 42);
    f.conn.lookup(&hs(&[42]), 1, None).unwrap();
    let (i, hsh) = args(&[9], &[42]);
    f.conn.load(&i, &hsh, 1, None).unwrap().synchronize().unwrap();
    f.assert_holds(1, 9, 42);
    assert_eq!(f.page(1, "mla", 0, 9), f.page(1, "mla", 1, 9));
    assert_ne!(f.page(1, "full", 0, 9), f.page(1, "full", 1, 9), "TP shards split");
    let m = f.conn.take_metrics();
    assert_eq!((m.nixl_read_blocks, m.nixl_read_bytes), (3, 256));
    assert_eq!(m.h2d_bytes_copied, 128 + 128 + 64, "every shard written");
    assert_eq!((m.nixl_read_latency_count, m.nixl_write_latency_count), (1, 1));
    assert!(m.nixl_read_latency_max_ms >= 0.0 && m.nixl_read_latency_max_ms <= m.nixl_read_latency_total_ms);
}

#[test]
fn argument_errors() {
    let (_c, f) = host_fixture(16 * BLOCK_BYTES, 1);
    let e = f.conn.lookup(&hs(&[1]), 3, None).unwrap_err();
    assert!(matches!(e, ConnectorError::NoSuchReplica { replica_idx: 3, num_replicas: 1 }));
    let (i, hsh) = args(&[PAGES as u32], &[1]);
    let e = f.conn.offload(&i, &hsh, 0).unwrap_err();
    assert!(matches!(e, ConnectorError::BlockOutOfRange { num_pages: PAGES, .. }), "{e}");
    let e = f.conn.offload(&every_leaf(ids(&[1])), &every_leaf(hs(&[1])), 1).unwrap_err();
    assert!(matches!(e, ConnectorError::NoSuchReplica { .. }));
    let mut wrong = BTreeMap::new();
    wrong.insert(LeafId::from("full"), f.pages[0][&LeafId::from("full")].clone() as Arc<dyn DevicePages>);
    let e = HostTierConnector::new(leaves(), vec![wrong], 1024).unwrap_err();
    assert!(matches!(e, ConnectorError::InvalidPages { .. }));
    assert!(HostTierConnector::new(leaves(), vec![], 1024).is_err());
}

/// Device pages whose copies fail after `ok_copies` successes.
#[derive(Debug)]
struct Failing(Arc<dyn DevicePages>, std::sync::atomic::AtomicUsize);

impl DevicePages for Failing {
    fn num_shards(&self) -> usize {
        self.0.num_shards()
    }
    fn replicated(&self) -> bool {
        self.0.replicated()
    }
    fn bytes_per_page(&self) -> usize {
        self.0.bytes_per_page()
    }
    fn num_pages(&self) -> usize {
        self.0.num_pages()
    }
    fn read_page(&self, shard: usize, page: BlockId, out: &mut [u8]) -> io::Result<()> {
        self.tick()?;
        self.0.read_page(shard, page, out)
    }
    fn write_page(&self, shard: usize, page: BlockId, data: &[u8]) -> io::Result<()> {
        self.tick()?;
        self.0.write_page(shard, page, data)
    }
}

impl Failing {
    fn tick(&self) -> io::Result<()> {
        let left = self.1.load(std::sync::atomic::Ordering::SeqCst);
        if left == 0 {
            return Err(io::Error::other("injected copy fault"));
        }
        self.1.store(left - 1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn failed_copies_surface_from_the_transfer_and_leave_nothing_behind() {
    let pages = Arc::new(kvwire::connector::HostPages::alloc(1, false, 8, 64).unwrap());
    let failing = Arc::new(Failing(pages.clone(), 1.into()));
    let leaf = LeafId::from("full");
    let c = HostTierConnector::new(
        BTreeMap::from([(leaf.clone(), KVCacheGroupId::full())]),
        vec![BTreeMap::from([(leaf.clone(), failing.clone() as Arc<dyn DevicePages>)])],
        1024,
    )
    .unwrap();
    let one =
        |b: u32, hash: u64| (PerLeaf::from([(leaf.clone(), ids(&[b]))]), PerLeaf::from([(leaf.clone(), hs(&[hash]))]));
    let (i, hsh) = one(1, 1);
    c.offload(&i, &hsh, 0).unwrap().synchronize().unwrap(); // uses the one good copy
    let (i, hsh) = one(2, 2);
    let off = c.offload(&i, &hsh, 0).unwrap();
    let e = off.synchronize().unwrap_err();
    assert!(matches!(e, ConnectorError::OffloadFailed { .. }), "{e}");
    assert!(off.is_complete().is_err(), "failure is sticky");
    assert_eq!(c.host_byte_count().used(), 64, "the failed block is not kept");

    c.lookup(&hs(&[1]), 0, None).unwrap();
    let (i, hsh) = one(3, 1);
    let load = c.load(&i, &hsh, 0, None).unwrap();
    for _ in 0..3 {
        let e = load.synchronize().unwrap_err();
        assert!(matches!(e, ConnectorError::LoadFailed { .. }), "{e}");
        assert!(matches!(load.is_complete(), Err(ConnectorError::LoadFailed { .. })));
    }
    let m = c.take_metrics();
    assert_eq!((m.connector_load_failures, m.connector_offload_blocks_dropped), (1, 1));
    // The failed load released its pin: the block can be evicted and reset.
    c.reset_prefix_cache();
    assert_eq!(c.host_byte_count().used(), 0);
}

#[test]
fn kv_cache_memory_serves_as_device_pages() {
    let (mem, bufs) = KVCacheMemory::new_host(2, 8, 32, false).unwrap();
    let mem: Arc<dyn DevicePages> = Arc::new(mem);
    assert_eq!(mem.host_bytes_per_page(), 64);
    bufs[0].fill_with(32 * 3, 32, |i| i as u8);
    bufs[1].fill_with(32 * 3, 32, |i| 100 + i as u8);
    let c = kvwire::connector::replay::host_tier_for(mem, 1 << 20).unwrap();
    let leaf = LeafId::from("full");
    c.offload(&PerLeaf::from([(leaf.clone(), ids(&[3]))]), &PerLeaf::from([(leaf.clone(), hs(&[9]))]), 0)
        .unwrap()
        .synchronize()
        .unwrap();
    c.lookup(&hs(&[9]), 0, None).unwrap();
    c.load(&PerLeaf::from([(leaf.clone(), ids(&[5]))]), &PerLeaf::from([(leaf, hs(&[9]))]), 0, None)
        .unwrap()
        .synchronize()
        .unwrap();
    assert_eq!(bufs[0].to_vec(32 * 5..32 * 6), bufs[0].to_vec(32 * 3..32 * 4));
    assert_eq!(bufs[1].to_vec(32 * 5..32 * 6), bufs[1].to_vec(32 * 3..32 * 4));
    assert_eq!(bufs[1].to_vec(32 * 5..=32 * 5), [100]);
}

#[test]
fn shutdown_finishes_posted_copies_then_refuses_work() {
    let (c, f) = host_fixture(16 * BLOCK_BYTES, 1);
    let pause = c.pause_worker();
    f.fill(0, 1, 1);
    let (i, hsh) = args(&[1], &[1]);
    let off = f.conn.offload(&i, &hsh, 0).unwrap();
    f.conn.shutdown();
    assert!(off.is_complete().unwrap(), "shutdown drained the queue despite the pause");
    drop(pause);
    f.conn.shutdown();
    assert!(matches!(f.conn.lookup(&hs(&[1]), 0, None), Err(ConnectorError::ShutDown)));
    assert!(matches!(f.conn.offload(&i, &hsh, 0), Err(ConnectorError::ShutDown)));
    f.conn.touch(&hs(&[1]), 0);
    f.conn.poll_transfers();
}

#[test]
fn reset_drops_everything_once_loads_land() {
    let (c, f) = host_fixture(16 * BLOCK_BYTES, 1);
    offload_sync(&f, 1, 1);
    offload_sync(&f, 2, 2);
    f.conn.lookup(&hs(&[1]), 0, None).unwrap();
    let pause = c.pause_worker();
    let (i, hsh) = args(&[5], &[1]);
    let load = f.conn.load(&i, &hsh, 0, None).unwrap();
    f.conn.reset_prefix_cache();
    assert_eq!(present(&f, &[1, 2]), vec![false, false]);
    assert_eq!(f.conn.host_byte_count().used(), BLOCK_BYTES, "1 stays until its load lands");
    drop(pause);
    load.synchronize().unwrap();
    f.assert_holds(0, 5, 1);
    assert_eq!(f.conn.host_byte_count().used(), 0);
}
