//! Property tests of agent-metadata decoding: untrusted bytes never panic,
//! and every valid value round-trips through both encodings.

use kvwire::engine::AgentMetadata;
use kvwire::transport::{MemoryKind, RemoteKey, RemoteRegion, TransportKind};
use proptest::prelude::*;

fn metadata() -> impl Strategy<Value = AgentMetadata> {
    (
        "[a-z0-9_-]{1,40}",
        "[a-z0-9.-]{0,40}",
        any::<u64>(),
        proptest::collection::vec(any::<u8>(), 0..64),
        proptest::collection::vec((1u64..1 << 20, 1u64..1 << 16), 0..8),
    )
        .prop_map(|(name, hostname, generation, connection_info, sizes)| {
            let mut addr = 0x1000u64;
            let regions = sizes
                .into_iter()
                .enumerate()
                .map(|(i, (gap, len))| {
                    addr += gap;
                    let r = RemoteRegion {
                        addr,
                        len_bytes: len,
                        rkey: RemoteKey(i as u32 + 1),
                        kind: MemoryKind::Dram,
                        device_id: 0,
                    };
                    addr += len;
                    r
                })
                .collect();
            AgentMetadata { name, hostname, transport: TransportKind::Shm, generation, connection_info, regions }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = AgentMetadata::from_bytes(&bytes);
        let mut framed = b"KVWM\x01\x00".to_vec();
        framed.extend_from_slice(&bytes);
        let _ = AgentMetadata::from_bytes(&framed);
        let _ = AgentMetadata::from_json(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn valid_metadata_round_trips(m in metadata()) {
        prop_assert_eq!(AgentMetadata::from_bytes(&m.to_bytes()).unwrap(), m.clone());
        prop_assert_eq!(AgentMetadata::from_json(&m.to_json()).unwrap(), m);
    }

    #[test]
    fn corrupted_metadata_is_rejected_or_still_valid(m in metadata(), pos in any::<usize>(), flip in 1u8..=255) {
        let mut b = m.to_bytes();
        let i = pos % b.len();
        b[i] ^= flip;
        if let Ok(decoded) = AgentMetadata::from_bytes(&b) {
            prop_assert!(decoded.validate().is_ok());
        }
    }

    #[test]
    fn huge_declared_lengths_do_not_allocate(len in 1u64 << 40..u64::MAX) {
        // a varint length prefix claiming terabytes, followed by nothing
        let mut b = b"KVWM\x01\x00".to_vec();
        let mut v = len;
        while v >= 0x80 { b.push((v as u8) | 0x80); v >>= 7; }
        b.push(v as u8);
        prop_assert!(AgentMetadata::from_bytes(&b).is_err());
    }
}
