//! The connector contract (MAX `kv_connector.py`, seed `NullConnector.txt`),
//! run against every connector: Null and the host tier.
//!
//! Each test states every connector's expected result. The host tier
//! enforces `KVConnector`'s rules (lookup before load, per-leaf shapes,
//! all-or-nothing loads); the `NullConnector` gives MAX 26.7's results:
//! it accepts any input, and every `load` and `offload` is an
//! already-completed transfer that moves nothing (checked by comparing
//! every device page before and after).

mod connector_util;

use connector_util::*;
use kvwire::connector::{BlockHash, ConnectorError, KVTransfer, LeafId, PerLeaf};

fn each(test: impl Fn(&Fixture)) {
    for f in all_fixtures() {
        test(&f);
    }
}

#[test]
fn names_and_leaves() {
    let fs = all_fixtures();
    assert_eq!(fs[0].conn.name(), "NullConnector");
    assert_eq!(fs[1].conn.name(), "HostTierConnector");
    for f in &fs {
        assert_eq!(f.conn.leaves(), &leaves());
    }
}

#[test]
fn hashes_are_8_or_32_canonical_bytes() {
    for len in [0, 1, 7, 9, 16, 31, 33, 64] {
        let e = BlockHash::from_bytes(&vec![0u8; len]).unwrap_err();
        assert!(matches!(e, ConnectorError::InvalidHashLength { len_bytes } if len_bytes == len), "{e}");
    }
    let h8 = BlockHash::from_bytes(&[0, 0, 0, 0, 0, 0, 1, 2]).unwrap();
    assert_eq!(h8, BlockHash::from_u64(0x0102), "8 bytes are big-endian");
    assert_eq!(h8.to_bytes(), vec![0, 0, 0, 0, 0, 0, 1, 2]);
    let d: Vec<u8> = (0..32).collect();
    let h32 = BlockHash::from_bytes(&d).unwrap();
    assert_eq!(h32.to_bytes(), d);
    assert_eq!(h32.seq_hash(), 0x0001_0203_0405_0607, "dKV truncates SHA-256 to its first 8 bytes");
    assert_ne!(h32, BlockHash::from_u64(h32.seq_hash()), "a SHA-256 is not its truncation");
}

#[test]
fn lookup_gives_one_mask_per_leaf_of_the_sequence_length() {
    each(|f| {
        for n in [0, 1, 5] {
            let masks = f.conn.lookup(&hs(&(0..n).collect::<Vec<_>>()), 0, None).unwrap();
            assert_eq!(masks.keys().cloned().collect::<Vec<_>>(), leaves().into_keys().collect::<Vec<_>>());
            assert!(masks.values().all(|m| m.len() == n as usize && m.iter().all(|&p| !p)), "fresh: all absent");
        }
    });
}

#[test]
fn load_must_follow_a_lookup_with_the_same_replica_and_hint_at_most_once() {
    each(|f| {
        let none = PerLeaf::new();
        if f.accepts_anything {
            // MAX's NullConnector: no pairing; every load is a completed transfer.
            for (replica, hint) in [(0, None), (1, Some(&b"{}"[..])), (0, None)] {
                assert!(f.conn.load(&none, &PerLeaf::new(), replica, hint).unwrap().is_complete().unwrap());
            }
            return;
        }
        let no_lookup = f.conn.load(&none, &PerLeaf::new(), 0, None).unwrap_err();
        assert!(matches!(no_lookup, ConnectorError::LoadWithoutLookup { replica_idx: 0 }), "{no_lookup}");

        f.conn.lookup(&hs(&[1]), 0, Some(b"{\"version\":2}")).unwrap();
        let wrong_hint = f.conn.load(&none, &PerLeaf::new(), 0, None).unwrap_err();
        assert!(matches!(wrong_hint, ConnectorError::LoadWithoutLookup { .. }));
        let wrong_replica = f.conn.load(&none, &PerLeaf::new(), 1, Some(b"{\"version\":2}")).unwrap_err();
        assert!(matches!(wrong_replica, ConnectorError::LoadWithoutLookup { replica_idx: 1 }));
        f.conn.load(&none, &PerLeaf::new(), 0, Some(b"{\"version\":2}")).unwrap();
        let second = f.conn.load(&none, &PerLeaf::new(), 0, Some(b"{\"version\":2}")).unwrap_err();
        assert!(matches!(second, ConnectorError::LoadWithoutLookup { .. }), "{second}");

        // Back-to-back lookups each allow one load.
        f.conn.lookup(&[], 1, None).unwrap();
        f.conn.lookup(&[], 1, None).unwrap();
        f.conn.load(&none, &PerLeaf::new(), 1, None).unwrap();
        f.conn.load(&none, &PerLeaf::new(), 1, None).unwrap();
        assert!(f.conn.load(&none, &PerLeaf::new(), 1, None).is_err());
    });
}

#[test]
fn load_of_nothing_is_a_completed_transfer_polled_safely_again() {
    each(|f| {
        f.conn.lookup(&hs(&[1, 2]), 0, None).unwrap();
        let t = f.conn.load(&every_leaf(vec![]), &every_leaf(vec![]), 0, None).unwrap();
        for _ in 0..3 {
            assert!(t.is_complete().unwrap());
            t.synchronize().unwrap();
        }
    });
}

#[test]
fn per_leaf_lengths_must_match_and_bad_arguments_do_not_consume_the_lookup() {
    each(|f| {
        f.conn.lookup(&hs(&[1, 2]), 0, None).unwrap();
        let (ids2, _) = args(&[1, 2], &[]);
        let (_, hashes1) = args(&[], &[1]);
        if f.accepts_anything {
            // MAX's NullConnector checks nothing and moves nothing.
            let before = f.snapshot(0);
            let mut unknown = PerLeaf::new();
            unknown.insert(LeafId::from("nope"), hs(&[1]));
            let (dup_ids, dup_hashes) = args(&[4, 4], &[1, 2]);
            for (i, hsh) in [(&ids2, &hashes1), (&PerLeaf::new(), &unknown), (&dup_ids, &dup_hashes)] {
                assert!(f.conn.load(i, hsh, 0, None).unwrap().is_complete().unwrap());
                let t = f.conn.offload(i, hsh, 0).unwrap();
                assert!(t.is_complete().unwrap() && t.g0_blocks_per_leaf().is_empty());
            }
            assert_eq!(f.snapshot(0), before, "NullConnector moved bytes");
            return;
        }
        let e = f.conn.load(&ids2, &hashes1, 0, None).unwrap_err();
        assert!(matches!(&e, ConnectorError::LengthMismatch { num_block_ids: 2, num_block_hashes: 1, .. }), "{e}");
        let e = f.conn.offload(&ids2, &hashes1, 0).unwrap_err();
        assert!(matches!(&e, ConnectorError::LengthMismatch { .. }), "{e}");

        // A leaf in one map only: its other list counts as empty.
        let mut only_ids = PerLeaf::new();
        only_ids.insert(LeafId::from("full"), ids(&[3]));
        let e = f.conn.load(&only_ids, &PerLeaf::new(), 0, None).unwrap_err();
        assert!(matches!(&e, ConnectorError::LengthMismatch { num_block_ids: 1, num_block_hashes: 0, .. }));

        let mut unknown = PerLeaf::new();
        unknown.insert(LeafId::from("nope"), hs(&[1]));
        let mut unknown_ids = PerLeaf::new();
        unknown_ids.insert(LeafId::from("nope"), ids(&[1]));
        let e = f.conn.load(&unknown_ids, &unknown, 0, None).unwrap_err();
        assert!(matches!(&e, ConnectorError::UnknownLeaf { leaf_id } if leaf_id.as_str() == "nope"));
        let e = f.conn.offload(&unknown_ids, &unknown, 0).unwrap_err();
        assert!(matches!(&e, ConnectorError::UnknownLeaf { .. }));

        let (dup_ids, dup_hashes) = args(&[4, 4], &[1, 2]);
        let e = f.conn.load(&dup_ids, &dup_hashes, 0, None).unwrap_err();
        assert!(matches!(&e, ConnectorError::DuplicateBlockId { .. }), "{e}");

        // The lookup is still open.
        f.conn.load(&PerLeaf::new(), &PerLeaf::new(), 0, None).unwrap();
    });
}

#[test]
fn load_refuses_before_anything_moves_when_a_block_is_not_held() {
    each(|f| {
        f.fill(0, 1, 10);
        f.fill(0, 5, 99);
        let (i, hsh) = args(&[1], &[10]);
        f.conn.offload(&i, &hsh, 0).unwrap().synchronize().unwrap();

        f.conn.lookup(&hs(&[10, 11]), 0, None).unwrap();
        // 10 may be held; 11 never is: all or nothing.
        let (i, hsh) = args(&[5, 6], &[10, 11]);
        if f.accepts_anything {
            // MAX's NullConnector: not refused, a completed transfer of nothing.
            let before = f.snapshot(0);
            let t = f.conn.load(&i, &hsh, 0, None).unwrap();
            assert!(t.is_complete().unwrap());
            t.synchronize().unwrap();
            assert_eq!(f.snapshot(0), before, "NullConnector moved bytes");
            f.assert_holds(0, 5, 99);
            return;
        }
        let e = f.conn.load(&i, &hsh, 0, None).unwrap_err();
        match &e {
            ConnectorError::LoadRefused { leaf_id, block_hash, .. } => {
                assert!(leaf_id.is_some());
                let want = if f.holds { h(11) } else { h(10) };
                assert_eq!(*block_hash, Some(want));
            }
            other => panic!("expected LoadRefused, got {other}"),
        }
        f.assert_holds(0, 5, 99);
    });
}

#[test]
fn offload_then_load_round_trips_bytes_or_stays_absent() {
    each(|f| {
        for (b, hash) in [(1, 100), (2, 101), (3, 102)] {
            f.fill(0, b, hash);
        }
        let (i, hsh) = args(&[1, 2, 3], &[100, 101, 102]);
        let t = f.conn.offload(&i, &hsh, 0).unwrap();
        if f.holds {
            assert_eq!(t.g0_blocks_per_leaf(), &i, "every block pinned until it lands");
        } else {
            assert!(t.g0_blocks_per_leaf().is_empty(), "nothing moved, pinned nowhere");
        }
        t.synchronize().unwrap();
        for _ in 0..3 {
            assert!(t.is_complete().unwrap());
        }
        let masks = f.conn.lookup(&hs(&[100, 101, 102, 103]), 1, None).unwrap();
        for m in masks.values() {
            assert_eq!(m, &vec![f.holds, f.holds, f.holds, false]);
        }
        let (i, hsh) = args(&[7, 8, 9], &[100, 101, 102]);
        let before = f.snapshot(1);
        match f.conn.load(&i, &hsh, 1, None) {
            Ok(t) => {
                assert!(f.holds || f.accepts_anything);
                t.synchronize().unwrap();
                for _ in 0..3 {
                    assert!(t.is_complete().unwrap());
                }
                if f.holds {
                    for (b, hash) in [(7, 100), (8, 101), (9, 102)] {
                        f.assert_holds(1, b, hash);
                    }
                } else {
                    assert_eq!(f.snapshot(1), before, "a connector that holds nothing moved bytes");
                }
            }
            Err(e) => assert!(!f.holds && matches!(e, ConnectorError::LoadRefused { .. }), "{e}"),
        }
    });
}

#[test]
fn offload_skips_hashes_already_held_and_leaves_may_differ_in_length() {
    each(|f| {
        f.fill(0, 1, 7);
        f.fill(0, 2, 8);
        let (i, hsh) = args(&[1], &[7]);
        f.conn.offload(&i, &hsh, 0).unwrap().synchronize().unwrap();
        // "swa" publishes only the last block (a window), the others both.
        let mut i = every_leaf(ids(&[1, 2]));
        let mut hsh = every_leaf(hs(&[7, 8]));
        i.insert(LeafId::from("swa"), ids(&[2]));
        hsh.insert(LeafId::from("swa"), hs(&[8]));
        let t = f.conn.offload(&i, &hsh, 0).unwrap();
        let pinned: Vec<_> = t.g0_blocks_per_leaf().iter().map(|(l, b)| (l.as_str().to_owned(), b.clone())).collect();
        if f.holds {
            let want: Vec<_> = ["full", "mla", "swa"].iter().map(|l| (l.to_string(), ids(&[2]))).collect();
            assert_eq!(pinned, want, "7 is held already on every leaf");
        } else {
            assert!(pinned.is_empty());
        }
        t.synchronize().unwrap();
    });
}

#[test]
fn touch_and_poll_never_fail() {
    each(|f| {
        f.conn.touch(&hs(&[1, 2, 3]), 0);
        f.conn.touch(&[], 1);
        f.conn.touch(&[BlockHash::Sha256([7; 32])], 5);
        f.conn.poll_transfers();
        f.conn.poll_transfers();
    });
}

#[test]
fn take_metrics_reads_and_clears_counters() {
    each(|f| {
        f.fill(0, 1, 5);
        let (i, hsh) = args(&[1], &[5]);
        f.conn.offload(&i, &hsh, 0).unwrap().synchronize().unwrap();
        f.conn.lookup(&hs(&[6]), 0, None).unwrap();
        let (i, hsh) = args(&[2], &[6]);
        assert_eq!(f.conn.load(&i, &hsh, 0, None).is_ok(), f.accepts_anything, "6 is not held");
        let m = f.conn.take_metrics();
        if f.holds {
            assert_eq!(m.nixl_write_blocks, 3);
            assert_eq!(m.d2h_bytes_copied, 128 + 64 + 64);
            assert_eq!(m.connector_loads_refused, 1);
        } else {
            assert_eq!(m, Default::default(), "NullConnector: empty metrics");
        }
        assert_eq!(f.conn.metrics(), Default::default());
        assert_eq!(f.conn.take_metrics(), Default::default());
    });
}

#[test]
fn byte_counts() {
    each(|f| {
        assert_eq!(f.conn.disk_byte_count().total, 0);
        let before = f.conn.host_byte_count();
        assert_eq!(before.used(), 0);
        f.fill(0, 1, 5);
        let (i, hsh) = args(&[1], &[5]);
        f.conn.offload(&i, &hsh, 0).unwrap().synchronize().unwrap();
        let after = f.conn.host_byte_count();
        if f.holds {
            assert_eq!(after.total, 16 * 256);
            assert_eq!(after.used(), 128 + 64 + 64, "replicated leaf stored once");
        } else {
            assert_eq!(after, Default::default());
        }
    });
}
