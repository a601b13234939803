//! Unit tests of the connector layer's internals.

use std::sync::Arc;

use super::host::tier::{Admit, Tier};
use super::*;

fn key(leaf: u32, h: u64) -> (u32, BlockHash) {
    (leaf, BlockHash::from_u64(h))
}

#[test]
fn tier_admits_blocks_whole_and_evicts_oldest_unpinned() {
    let mut t = Tier::new(300);
    let tick = t.ticks(2);
    assert_eq!(
        t.admit_group(&[(key(0, 1), 100, tick(0)), (key(1, 1), 50, tick(1))]),
        vec![Admit::Admitted; 2]
    );
    assert!(!t.is_ready(&key(0, 1)), "pending until installed");
    t.install(&key(0, 1), Arc::from(vec![1u8; 100]));
    t.install(&key(1, 1), Arc::from(vec![2u8; 50]));
    assert!(t.is_ready(&key(0, 1)));
    let tick = t.ticks(1);
    assert_eq!(
        t.admit_group(&[(key(0, 2), 100, tick(0))]),
        vec![Admit::Admitted]
    );
    // 250 used, 50 free; 150 evictable (block 1); 201 needed: nothing fits, nothing evicted.
    let tick = t.ticks(2);
    let big = [(key(0, 3), 100, tick(0)), (key(1, 3), 101, tick(1))];
    assert_eq!(t.admit_group(&big), vec![Admit::NoRoom; 2]);
    assert_eq!(t.used_bytes(), 250);
    // Pin block 1 on leaf 0; installing block 2 makes it evictable.
    let data = t.pin(&key(0, 1)).unwrap();
    assert_eq!(data.len(), 100);
    t.install(&key(0, 2), Arc::from(vec![3u8; 100]));
    let tick = t.ticks(1);
    assert_eq!(
        t.admit_group(&[(key(0, 4), 150, tick(0))]),
        vec![Admit::Admitted]
    );
    assert!(t.is_ready(&key(0, 1)), "pinned survives");
    assert!(
        !t.is_ready(&key(1, 1)) && !t.is_ready(&key(0, 2)),
        "oldest unpinned went"
    );
    assert_eq!(t.used_bytes(), 250);
    t.unpin(&key(0, 1));
    t.abort(&key(0, 4));
    assert_eq!(t.used_bytes(), 100);
    t.reset();
    assert_eq!(t.used_bytes(), 0);
}

#[test]
fn tier_already_held_refreshes_and_doomed_entries_leave_when_released() {
    let mut t = Tier::new(1000);
    let tick = t.ticks(1);
    t.admit_group(&[(key(0, 1), 10, tick(0))]);
    let tick = t.ticks(1);
    assert_eq!(
        t.admit_group(&[(key(0, 1), 10, tick(0))]),
        vec![Admit::AlreadyHeld],
        "pending counts as held"
    );
    t.reset();
    assert_eq!(
        t.used_bytes(),
        10,
        "pending entry stays until its copy ends"
    );
    t.install(&key(0, 1), Arc::from(vec![0u8; 10]));
    assert_eq!(t.used_bytes(), 0);
}

#[test]
fn metrics_sum_take_and_derive() {
    let mut a = KVCacheMetrics {
        cache_tokens: 30,
        input_tokens: 70,
        dkv_total_clients: 2,
        ..Default::default()
    };
    a.record_read_latency(2.0);
    a.record_read_latency(6.0);
    a.nixl_read_bytes = 1 << 30;
    assert_eq!(a.nixl_read_latency_avg_ms(), 4.0);
    assert_eq!(a.nixl_read_latency_max_ms, 6.0);
    assert!((a.nixl_read_gib_per_s() - 125.0).abs() < 1e-9);
    assert!((a.cache_hit_rate() - 0.3).abs() < 1e-12);
    assert!(a.dkv_degraded());
    let mut b = KVCacheMetrics::default();
    b.record_read_latency(9.0);
    let s = a.clone() + b;
    assert_eq!(
        (s.nixl_read_latency_count, s.nixl_read_latency_max_ms),
        (3, 9.0),
        "max combines with max"
    );
    let taken = a.take_counters();
    assert_eq!(taken.cache_tokens, 30);
    assert_eq!(
        a,
        KVCacheMetrics {
            dkv_total_clients: 2,
            ..Default::default()
        },
        "gauges stay"
    );
    assert_eq!(KVCacheMetrics::default().cache_hit_rate(), 0.0);
}

#[test]
fn occupancy_percentages() {
    let b = ByteCount {
        free: 25,
        total: 100,
    };
    assert_eq!((b.used(), b.used_pct(), b.free_pct()), (75, 75.0, 25.0));
    assert_eq!(ByteCount::default().used_pct(), 0.0);
    assert_eq!(BlockCount { free: 1, total: 4 }.used_pct(), 75.0);
}

#[test]
fn lookup_ledger_is_bounded() {
    let l = ledger::LookupLedger::default();
    for i in 0..5000u32 {
        l.record_lookup(0, Some(&i.to_be_bytes()));
    }
    assert!(
        l.consume(0, Some(&0u32.to_be_bytes())).is_err(),
        "oldest key forgotten"
    );
    assert!(l.consume(0, Some(&4999u32.to_be_bytes())).is_ok());
}
