//! Property tests of the frame decoder: arbitrary bytes never panic, every
//! accepted header respects its limits, and encoding round-trips.

use proptest::prelude::*;

use super::*;

fn kind_strategy() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Hello),
        Just(Kind::HelloAck),
        Just(Kind::Write),
        Just(Kind::Read),
        Just(Kind::Notify),
        Just(Kind::Resp),
        Just(Kind::Challenge),
        Just(Kind::Fence),
    ]
}

proptest! {
    #[test]
    fn arbitrary_headers_never_panic_and_respect_limits(bytes in proptest::array::uniform24(any::<u8>())) {
        if let Ok(h) = Header::decode(&bytes) {
            prop_assert!(h.body_bytes() <= MAX_NOTIFICATION_BYTES as usize);
            match h.kind {
                Kind::Write | Kind::Read => {
                    prop_assert!(h.count >= 1 && h.count <= MAX_SEGMENTS);
                    prop_assert!(h.len <= MAX_REQUEST_BYTES);
                }
                Kind::Hello => prop_assert!(h.count >= 1 && h.count <= MAX_NAME_BYTES),
                Kind::Notify => prop_assert!(h.count <= MAX_NOTIFICATION_BYTES),
                Kind::Resp => prop_assert!(h.len <= MAX_REQUEST_BYTES),
                Kind::HelloAck => prop_assert!(h.count as usize == PROOF_BYTES && h.len == 0),
                Kind::Challenge => prop_assert!(h.count == NONCE_BYTES && h.len == 0),
                Kind::Fence => prop_assert!(h.count >= 1 && h.count <= MAX_FENCE_ENTRIES && h.len == 0),
            }
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn headers_round_trip(kind in kind_strategy(), count in 0u32..2000, id: u64, len in 0u64..(1 << 27)) {
        let id = if matches!(kind, Kind::Hello | Kind::HelloAck | Kind::Challenge) { MAGIC_VERSION } else { id };
        let h = Header { kind, count, id, len };
        // Either it decodes to itself or it is refused; never anything else.
        if let Ok(d) = Header::decode(&h.encode()) {
            prop_assert_eq!(d, h);
        }
    }

    #[test]
    fn segment_lists_round_trip_or_are_refused(
        segs in proptest::collection::vec((any::<u32>(), any::<u64>(), 0u64..(1 << 20)), 1..64),
        bump in 0u64..2,
    ) {
        let descs: Vec<SegmentDesc> = segs.iter().map(|&(rkey, addr, len_bytes)| SegmentDesc { rkey, addr, len_bytes }).collect();
        let sum: u64 = descs.iter().map(|s| s.len_bytes).sum();
        let mut body = Vec::new();
        encode_segments(descs.iter().copied(), &mut body);
        let h = Header { kind: Kind::Write, count: descs.len() as u32, id: 7, len: sum + bump };
        let mut out = Vec::new();
        let r = decode_segments(&h, &body, &mut out);
        if bump == 0 && descs.iter().all(|s| s.len_bytes > 0) {
            prop_assert_eq!(r, Ok(()));
            prop_assert_eq!(out, descs);
        } else {
            prop_assert!(r.is_err());
        }
    }

    #[test]
    fn arbitrary_segment_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..400), count in 1u32..24, len: u64) {
        let h = Header { kind: Kind::Read, count, id: 1, len };
        let mut out = Vec::new();
        if decode_segments(&h, &body, &mut out).is_ok() {
            prop_assert_eq!(out.iter().map(|s| s.len_bytes).sum::<u64>(), len);
        }
    }
}

#[test]
fn hostile_headers_are_refused() {
    let h = |kind: u8, count: u32, id: u64, len: u64| {
        let mut b = [0u8; HEADER_BYTES];
        b[0] = kind;
        b[4..8].copy_from_slice(&count.to_le_bytes());
        b[8..16].copy_from_slice(&id.to_le_bytes());
        b[16..24].copy_from_slice(&len.to_le_bytes());
        Header::decode(&b)
    };
    assert!(matches!(h(3, MAX_SEGMENTS + 1, 1, 10), Err(WireError::Limit { .. })));
    assert!(matches!(h(3, 1, 1, MAX_REQUEST_BYTES + 1), Err(WireError::Limit { .. })));
    assert!(matches!(h(5, u32::MAX, 1, 0), Err(WireError::Limit { .. })));
    assert!(matches!(h(1, 5, 0xdead, 0), Err(WireError::Version(0xdead))));
    assert!(matches!(h(6, 1, 1, u64::MAX), Err(WireError::Limit { .. })));
    assert!(matches!(h(6, 9, 1, 0), Err(WireError::Limit { .. })));
    assert!(matches!(h(0, 0, 0, 0), Err(WireError::UnknownKind(0))));
    assert!(h(4, 3, 9, 4096).is_ok());
    assert!(matches!(h(7, 15, MAGIC_VERSION, 0), Err(WireError::Limit { .. })), "short nonce");
    assert!(matches!(h(7, NONCE_BYTES, 1, 0), Err(WireError::Version(1))));
    assert_eq!(
        h(1, 4, MAGIC_VERSION, 0).unwrap().body_bytes(),
        4 + PROOF_BYTES + NONCE_BYTES as usize,
        "a hello carries its proof and the initiator's nonce"
    );
    assert_eq!(h(2, PROOF_BYTES as u32, MAGIC_VERSION, 0).unwrap().body_bytes(), PROOF_BYTES, "an ack, its proof");
    assert!(matches!(h(2, 0, MAGIC_VERSION, 0), Err(WireError::Limit { .. })), "an ack without a proof (v2)");
    for (v, st) in [(1, Status::UnknownKey), (2, Status::Protocol), (3, Status::OutOfBounds), (4, Status::Denied)] {
        assert_eq!(h(6, v, 1, 0).unwrap().status(), st, "typed status {v}");
    }
    assert!(h(6, Status::MAX + 1, 1, 0).is_err());
    // v4: a hello's len is generation << 16 | index; the index is bounded
    // by the connections a peer may have, the generation is free.
    assert!(h(1, 4, MAGIC_VERSION, hello_slot(63, u64::MAX >> 16)).is_ok());
    assert!(matches!(h(1, 4, MAGIC_VERSION, hello_slot(64, 1)), Err(WireError::Limit { .. })));
    assert_eq!(split_slot(hello_slot(5, 1 << 40)), (5, 1 << 40));
    // A fence names 1..=MAX_FENCE_ENTRIES connections (by generation) and nothing else.
    assert_eq!(h(8, 3, 1, 0).unwrap().body_bytes(), 3 * FENCE_ENTRY_BYTES);
    assert!(matches!(h(8, 0, 1, 0), Err(WireError::Limit { .. })), "an empty fence");
    assert!(matches!(h(8, MAX_FENCE_ENTRIES + 1, 1, 0), Err(WireError::Limit { .. })));
    assert!(matches!(h(8, 1, 1, 8), Err(WireError::Limit { .. })), "a fence with data");
}
