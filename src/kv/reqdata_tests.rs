use super::*;
use crate::kv::KvError;
use crate::kv::msgspec::MsgInt;
use crate::kv::{WireIdxs, WireTransferReqData};

/// Written by hand from the seed's field list and msgspec's rules.
const FULL: &str = concat!(
    r#"{"type":"TransferReqData","dst_name":"decode","src_name":"prefill","#,
    r#""transfer_name":"6f1c2a7e-0d3b-4c55-9a8e-2b1f3c4d5e6f","transfer_ids":[7,8],"#,
    r#""src_idxs":{"0":[1,2,3],"0/scales":[1]},"dst_idxs":{"0":[4,5,6],"0/scales":[9]},"#,
    r#""src_replica_idx":0,"dst_replica_idx":1,"is_read":true,"tp_shard_count":2,"#,
    r#""local_shards_used":[0,0]}"#
);

fn full() -> TransferReqData {
    TransferReqData {
        dst_name: "decode".into(),
        src_name: "prefill".into(),
        transfer_name: "6f1c2a7e-0d3b-4c55-9a8e-2b1f3c4d5e6f".into(),
        transfer_ids: vec![7, 8],
        src_idxs: PageIdxs::per_leaf([("0", vec![1, 2, 3]), ("0/scales", vec![1])]),
        dst_idxs: PageIdxs::per_leaf([("0", vec![4, 5, 6]), ("0/scales", vec![9])]),
        src_replica_idx: 0,
        dst_replica_idx: 1,
        is_read: true,
        tp_shard_count: 2,
        local_shards_used: vec![0, 0],
    }
}

#[test]
fn encodes_exactly_like_msgspec() {
    assert_eq!(full().to_json(), FULL);
    assert_eq!(TransferReqData::from_json(FULL).unwrap(), full());
}

#[test]
fn omits_defaults_and_decodes_without_them() {
    let mut r = full();
    r.is_read = false;
    r.tp_shard_count = 0;
    r.local_shards_used.clear();
    let j = r.to_json();
    assert!(j.starts_with(r#"{"type":"TransferReqData","dst_name""#));
    assert!(j.ends_with(r#""src_replica_idx":0,"dst_replica_idx":1}"#), "{j}");
    assert_eq!(TransferReqData::from_json(&j).unwrap(), r);
}

#[test]
fn the_flat_list_form_encodes_but_does_not_decode() {
    // MAX 26.7 declares `src_idxs: dict[str, list[int]]`: msgspec refuses a
    // list ("Expected `object`, got `array`").
    let j = r#"{"type":"TransferReqData","dst_name":"d","src_name":"s","transfer_name":"t",
        "transfer_ids":[1],"src_idxs":[3,4],"dst_idxs":[5,6],"src_replica_idx":0,"dst_replica_idx":0}"#;
    assert!(matches!(TransferReqData::from_json(j), Err(KvError::Validation(_))));
    let mut r = full();
    r.src_idxs = PageIdxs::Flat(vec![3, 4]);
    assert!(r.to_json().contains(r#""src_idxs":[3,4]"#));
}

#[test]
fn tag_may_come_anywhere_and_unknown_fields_are_ignored() {
    let j = r#"{"dst_name":"d","src_name":"s","transfer_name":"t","transfer_ids":[],"src_idxs":{},
        "dst_idxs":{},"src_replica_idx":0,"dst_replica_idx":0,"extra":{"x":1},"type":"TransferReqData"}"#;
    let r = TransferReqData::from_json(j).unwrap();
    assert!(r.is_empty());
}

#[test]
fn decodes_what_msgspec_decodes() {
    // No tag, a key twice (last wins, also inside src_idxs), 2^64-1 ids.
    let j = r#"{"dst_name":"x","dst_name":"d","src_name":"s","transfer_name":"t",
        "transfer_ids":[18446744073709551615],"src_idxs":{"0":[1],"1":[],"0":[2]},"dst_idxs":{},
        "src_replica_idx":0,"dst_replica_idx":0}"#;
    let r = TransferReqData::from_json(j).unwrap();
    assert_eq!(r.dst_name, "d");
    assert_eq!(r.transfer_ids, vec![u64::MAX]);
    assert_eq!(r.src_idxs, PageIdxs::per_leaf([("0", vec![2]), ("1", vec![])]));
    // A negative replica decodes (msgspec: `int`) and is refused at use.
    let neg = j.replace(r#""src_replica_idx":0"#, r#""src_replica_idx":-1"#);
    let w = WireTransferReqData::from_json(neg.as_bytes()).unwrap();
    assert_eq!(w.src_replica_idx, MsgInt(-1));
    assert!(matches!(TransferReqData::try_from(&w), Err(KvError::InvalidRequest(_))));
    assert!(matches!(TransferReqData::from_json(&neg), Err(KvError::InvalidRequest(_))));
}

/// `msgspec.msgpack.encode` of MAX 26.7's struct (msgspec 0.23), written down.
const FULL_MSGPACK: &str = concat!(
    "8ca474797065af5472616e7366657252657144617461a86473745f6e616d65a164a87372635f6e616d65a173",
    "ad7472616e736665725f6e616d65a174ac7472616e736665725f69647393cfffffffffffffffffcd012cce00011170",
    "a87372635f6964787381a1309101a86473745f6964787381a1309102af7372635f7265706c6963615f696478ff",
    "af6473745f7265706c6963615f69647805a769735f72656164c3ae74705f73686172645f636f756e7402",
    "b16c6f63616c5f7368617264735f75736564920001"
);

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn msgpack_is_byte_identical_to_msgspec() {
    let w = WireTransferReqData {
        dst_name: "d".into(),
        src_name: "s".into(),
        transfer_name: "t".into(),
        transfer_ids: vec![MsgInt(MsgInt::MAX), MsgInt(300), MsgInt(70000)],
        src_idxs: WireIdxs::PerLeaf(vec![("0".into(), vec![MsgInt(1)])]),
        dst_idxs: WireIdxs::PerLeaf(vec![("0".into(), vec![MsgInt(2)])]),
        src_replica_idx: MsgInt(-1),
        dst_replica_idx: MsgInt(5),
        is_read: true,
        tp_shard_count: MsgInt(2),
        local_shards_used: vec![MsgInt(0), MsgInt(1)],
    };
    assert_eq!(w.to_msgpack(), hex(FULL_MSGPACK));
    assert_eq!(WireTransferReqData::from_msgpack(&hex(FULL_MSGPACK)).unwrap(), w);
    // The engine's own record round-trips through msgpack.
    assert_eq!(TransferReqData::from_msgpack(&full().to_msgpack()).unwrap(), full());
    // Defaults omitted: a 9-entry map.
    let mut r = full();
    r.is_read = false;
    r.tp_shard_count = 0;
    r.local_shards_used.clear();
    assert_eq!(r.to_msgpack()[0], 0x89);
    // Truncated and trailing data are DecodeErrors; a wrong type a ValidationError.
    let b = hex(FULL_MSGPACK);
    assert!(matches!(WireTransferReqData::from_msgpack(&b[..b.len() - 1]), Err(KvError::Decode(_))));
    let mut t = b.clone();
    t.push(0xc0);
    assert!(matches!(WireTransferReqData::from_msgpack(&t), Err(KvError::Decode(_))));
    assert!(matches!(WireTransferReqData::from_msgpack(&[0x91, 0x01]), Err(KvError::Validation(_))));
}

#[test]
fn hostile_json_is_an_error_not_a_panic() {
    let good = FULL;
    let validation: Vec<String> = vec![
        "null".into(),
        "[]".into(),
        "{}".into(),
        good.replace("TransferReqData", "KVTransferEngineMetadata"),
        good.replace(r#""type":"TransferReqData""#, r#""type":7"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[184467440737095516160]"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[1e300]"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[1.0]"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[true]"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":"7""#),
        good.replace(r#""src_idxs":{"0":[1,2,3],"0/scales":[1]}"#, r#""src_idxs":{"0":"x"}"#),
        good.replace(r#""src_idxs":{"0":[1,2,3],"0/scales":[1]}"#, r#""src_idxs":5"#),
        good.replace(r#""src_idxs":{"0":[1,2,3],"0/scales":[1]}"#, r#""src_idxs":[[1]]"#),
        good.replace(r#""src_replica_idx":0"#, r#""src_replica_idx":99999999999999999999999"#),
        good.replace(r#""is_read":true"#, r#""is_read":"yes""#),
        good.replace(r#""is_read":true"#, r#""is_read":1"#),
        good.replace(r#""dst_name":"decode","#, ""),
        format!("{}{}", "[".repeat(10_000), "]".repeat(10_000)),
    ];
    for c in validation {
        assert!(
            matches!(TransferReqData::from_json(&c), Err(KvError::Validation(_))),
            "not a validation error: {}",
            &c[..c.len().min(200)]
        );
    }
    let decode: Vec<String> = vec![String::new(), good[..good.len() - 1].to_string(), format!("{good} x")];
    for c in decode {
        assert!(
            matches!(TransferReqData::from_json(&c), Err(KvError::Decode(_))),
            "not a decode error: {}",
            &c[..c.len().min(200)]
        );
    }
    // Decoded, then refused at use.
    for c in [
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[-1,8]"#),
        good.replace(r#""local_shards_used":[0,0]"#, r#""local_shards_used":[0]"#),
    ] {
        assert!(matches!(TransferReqData::from_json(&c), Err(KvError::InvalidRequest(_))), "{c}");
    }
    assert!(TransferReqData::from_bytes(&[0xff, 0xfe]).is_err());
    let deep = format!(r#"{{"x":{}{}}}"#, "[".repeat(10_000), "]".repeat(10_000));
    assert!(TransferReqData::from_json(&deep).is_err());
}

#[test]
fn page_idxs_helpers() {
    let p = PageIdxs::per_leaf([("a", vec![1, 2]), ("b", vec![])]);
    assert_eq!(p.num_pages(), 2);
    assert!(!p.is_empty());
    assert_eq!(p.get("b"), Some(&[][..]));
    assert_eq!(p.get("c"), None);
    assert!(PageIdxs::per_leaf([("a", vec![])]).is_empty());
    assert!(PageIdxs::from(vec![]).is_empty());
}
