//! The replay's prefix-reuse API over the host tier and the null connector.

use std::sync::Arc;

use kvwire::connector::replay::{
    HitRate, host_tier_for, load_prefix, num_full_blocks, offload_prefix, unlimited_tier_hit_rate,
};
use kvwire::connector::{
    BlockId, ConnectorError, DevicePages, HostPages, KVConnector, KVTransfer, NullConnector,
};

fn blocks(from: u32, n: usize) -> Vec<BlockId> {
    (from..from + n as u32).map(BlockId).collect()
}

#[test]
fn prefix_hits_are_loaded_and_new_full_blocks_offloaded() {
    let pages = Arc::new(HostPages::alloc(1, false, 64, 128).unwrap());
    let conn = host_tier_for(pages.clone() as Arc<dyn DevicePages>, 1 << 20).unwrap();
    // Request 1: 3 blocks, 2 of them full. Nothing held yet.
    let r1 = [10u64, 11, 12];
    let b1 = blocks(1, 3);
    for (i, b) in b1.iter().enumerate() {
        pages.write_page(0, *b, &[i as u8 + 1; 128]).unwrap();
    }
    let l = load_prefix(&conn, &r1, &b1, 0).unwrap();
    assert_eq!((l.num_blocks, l.hit_blocks), (3, 0));
    assert!(l.transfer.is_complete().unwrap());
    let off = offload_prefix(
        &conn,
        &r1,
        &b1,
        l.hit_blocks,
        num_full_blocks(2 * 512 + 100),
        0,
    )
    .unwrap();
    assert_eq!(off.num_pinned_blocks(), 2);
    off.synchronize().unwrap();

    // Request 2 shares the first two blocks.
    let r2 = [10u64, 11, 20, 21];
    let b2 = blocks(10, 4);
    let l = load_prefix(&conn, &r2, &b2, 0).unwrap();
    assert_eq!(l.hit_blocks, 2);
    l.transfer.synchronize().unwrap();
    assert_eq!(pages.page(0, BlockId(10)), &[1u8; 128][..]);
    assert_eq!(pages.page(0, BlockId(11)), &[2u8; 128][..]);
    let off = offload_prefix(&conn, &r2, &b2, 2, num_full_blocks(4 * 512), 0).unwrap();
    assert_eq!(
        off.g0_blocks_per_leaf().values().next().unwrap(),
        &blocks(12, 2)
    );
    off.synchronize().unwrap();

    let m = conn.take_metrics();
    assert_eq!((m.nixl_read_blocks, m.nixl_write_blocks), (2, 4));
    assert!(matches!(
        load_prefix(&conn, &r2, &b2[..2], 0),
        Err(ConnectorError::LengthMismatch { .. })
    ));
}

#[test]
fn null_connector_never_hits() {
    let conn = NullConnector::default();
    let l = load_prefix(&conn, &[1, 2], &blocks(1, 2), 0).unwrap();
    assert_eq!(l.hit_blocks, 0);
    assert_eq!(
        offload_prefix(&conn, &[1, 2], &blocks(1, 2), 0, 2, 0)
            .unwrap()
            .num_pinned_blocks(),
        0
    );
    assert_eq!(conn.take_metrics(), Default::default());
}

#[test]
fn unlimited_tier_counts_leading_repeats() {
    let reqs: Vec<(Vec<u64>, usize)> = vec![
        (vec![1, 2, 3], 2),    // 0 hits; stores 1, 2
        (vec![1, 2, 3, 4], 4), // 1, 2 hit (3 was partial); stores 1..4
        (vec![1, 2, 3, 4], 3), // 4 hits
        (vec![9, 2], 2),       // 0: a different root
    ];
    let r = unlimited_tier_hit_rate(reqs.iter().map(|(h, n)| (h.as_slice(), *n)));
    assert_eq!(
        r,
        HitRate {
            hit_blocks: 6,
            total_blocks: 13
        }
    );
    assert!((r.rate() - 6.0 / 13.0).abs() < 1e-12);
    assert_eq!(HitRate::default().rate(), 0.0);
}
