use super::*;

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
fn decodes_the_flat_list_form_of_the_seed() {
    let j = r#"{"type":"TransferReqData","dst_name":"d","src_name":"s","transfer_name":"t",
        "transfer_ids":[1],"src_idxs":[3,4],"dst_idxs":[5,6],"src_replica_idx":0,"dst_replica_idx":0}"#;
    let r = TransferReqData::from_json(j).unwrap();
    assert_eq!(r.src_idxs, PageIdxs::Flat(vec![3, 4]));
    assert_eq!(r.dst_idxs.get("any-leaf"), Some(&[5u64, 6][..]));
    assert!(!r.is_read);
    assert_eq!(r.tp_shard_count, 0);
}

#[test]
fn tag_may_come_anywhere_and_unknown_fields_are_ignored() {
    let j = r#"{"dst_name":"d","src_name":"s","transfer_name":"t","transfer_ids":[],"src_idxs":{},
        "dst_idxs":{},"src_replica_idx":0,"dst_replica_idx":0,"extra":{"x":1},"type":"TransferReqData"}"#;
    let r = TransferReqData::from_json(j).unwrap();
    assert!(r.is_empty());
}

#[test]
fn hostile_json_is_an_error_not_a_panic() {
    let good = FULL;
    let cases: Vec<String> = vec![
        String::new(),
        "null".into(),
        "[]".into(),
        "{}".into(),
        good.replace(r#""type":"TransferReqData","#, ""),
        good.replace("TransferReqData", "KVTransferEngineMetadata"),
        good.replace(r#""type":"TransferReqData""#, r#""type":7"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[-1,8]"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[184467440737095516160]"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":[1e300]"#),
        good.replace(r#""transfer_ids":[7,8]"#, r#""transfer_ids":"7""#),
        good.replace(r#""src_idxs":{"0":[1,2,3],"0/scales":[1]}"#, r#""src_idxs":{"0":[1],"0":[2]}"#),
        good.replace(r#""src_idxs":{"0":[1,2,3],"0/scales":[1]}"#, r#""src_idxs":{"0":"x"}"#),
        good.replace(r#""src_idxs":{"0":[1,2,3],"0/scales":[1]}"#, r#""src_idxs":5"#),
        good.replace(r#""src_idxs":{"0":[1,2,3],"0/scales":[1]}"#, r#""src_idxs":[[1]]"#),
        good.replace(r#""src_replica_idx":0"#, r#""src_replica_idx":99999999999999999999999"#),
        good.replace(r#""is_read":true"#, r#""is_read":"yes""#),
        good.replace(r#""local_shards_used":[0,0]"#, r#""local_shards_used":[0]"#),
        good.replace(r#""dst_name":"decode","#, ""),
        good[..good.len() - 1].to_string(),
        format!("{}{}", "[".repeat(10_000), "]".repeat(10_000)),
    ];
    for c in cases {
        assert!(
            matches!(TransferReqData::from_json(&c), Err(KvError::Decode(_))),
            "accepted: {}",
            &c[..c.len().min(200)]
        );
    }
    assert!(TransferReqData::from_bytes(&[0xff, 0xfe]).is_err());
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
