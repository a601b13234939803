//! Unit tests of the KV engine: every validation rule, pairing, page→byte
//! mapping, completion, cleanup — two engines in one process over `shm`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::HostBuffer;
use crate::engine::EngineError;
use crate::transport::{TransportConfig, TransportError, TransportKind};

static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn uniq(base: &str) -> String {
    format!("{base}{}x{}", std::process::id(), NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// A group spec: (pages, bytes per page, replicated).
type G = (u64, u64, bool);

/// `[replica][group][shard]`
type Hosts = Vec<Vec<Vec<Arc<HostBuffer>>>>;

struct Eng {
    e: KVTransferEngine,
    hosts: Hosts,
}

fn memory(dp: usize, tp: usize, groups: &[G]) -> (Vec<Vec<KVCacheMemory>>, Hosts) {
    let mut mem = Vec::new();
    let mut hosts = Vec::new();
    for _ in 0..dp {
        let (mut mr, mut hr) = (Vec::new(), Vec::new());
        for &(pages, bpp, rep) in groups {
            let (m, h) = KVCacheMemory::new_host(tp, pages, bpp, rep && tp > 1).unwrap();
            mr.push(m);
            hr.push(h);
        }
        mem.push(mr);
        hosts.push(hr);
    }
    (mem, hosts)
}

fn make(base: &str, dp: usize, tp: usize, groups: &[G]) -> Eng {
    let (mem, hosts) = memory(dp, tp, groups);
    let ids = (0..groups.len()).map(|g| format!("leaf{g}")).collect();
    let e =
        KVTransferEngine::new(&uniq(base), mem, Some(ids), TransportKind::Shm, &TransportConfig::default()).unwrap();
    Eng { e, hosts }
}

fn byte(g: usize, s: usize, page: u64, i: u64) -> u8 {
    ((g as u64 * 131 + s as u64 * 31 + page * 7 + i) % 251) as u8 + 1
}

/// Fill every page of every source buffer; replicated groups get identical shards.
fn fill(x: &Eng, groups: &[G]) {
    for r in &x.hosts {
        for (g, shards) in r.iter().enumerate() {
            let (pages, bpp, rep) = groups[g];
            for (s, h) in shards.iter().enumerate() {
                let s_eff = if rep { 0 } else { s }; // replicated: identical shards
                h.fill_with(0, (pages * bpp) as usize, |i| byte(g, s_eff, i as u64 / bpp, i as u64 % bpp));
            }
        }
    }
}

fn page(h: &HostBuffer, p: u64, bpp: u64) -> Vec<u8> {
    h.to_vec((p * bpp) as usize..((p + 1) * bpp) as usize)
}

fn wait_both(a: &mut KVTransferEngine, b: &mut KVTransferEngine, req: &TransferReqData) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut da, mut db) = (false, false);
    while !(da && db) {
        da = da || a.is_complete(req).unwrap();
        db = db || b.is_complete(req).unwrap();
        assert!(Instant::now() < deadline, "transfer did not complete");
    }
    a.cleanup_transfer(req).unwrap();
    b.cleanup_transfer(req).unwrap();
}

fn cfg() -> TransportConfig {
    TransportConfig::default()
}

// ---------------------------------------------------------------- construction

#[test]
fn new_validates_in_max_order() {
    let c = cfg();
    let shm = TransportKind::Shm;
    let err = |mem, ids| KVTransferEngine::new(&uniq("v"), mem, ids, shm, &c).unwrap_err();
    assert!(matches!(KVTransferEngine::new("", vec![], None, shm, &c), Err(KvError::InvalidName(_))));
    assert!(matches!(err(vec![], None), KvError::NoReplicas));
    assert!(matches!(err(vec![vec![]], None), KvError::EmptyReplica { replica: 0 }));
    let (m, _) = memory(1, 1, &[(4, 64, false), (4, 64, false)]);
    assert!(matches!(err(m, Some(vec!["a".into()])), KvError::LeafIdCount { expected: 2, found: 1 }));
    let (m, _) = memory(1, 1, &[(4, 64, false), (4, 64, false)]);
    assert!(matches!(err(m, Some(vec!["a".into(), "a".into()])), KvError::DuplicateLeafId(_)));
    let (mut m, _) = memory(2, 1, &[(4, 64, false)]);
    m[1].clear();
    assert!(matches!(err(m, None), KvError::EmptyReplica { replica: 1 }));
    let (mut m, _) = memory(2, 1, &[(4, 64, false)]);
    let extra = m[1][0].clone();
    m[1].push(extra);
    assert!(matches!(err(m, None), KvError::GroupCountMismatch { replica: 1, expected: 1, found: 2 }));
    let (mut m, _) = memory(2, 1, &[(4, 64, false)]);
    m[1][0] = KVCacheMemory::new_host(1, 5, 64, false).unwrap().0;
    assert!(matches!(err(m, None), KvError::PageCountMismatch { replica: 1, group: 0, expected: 4, found: 5 }));
    let (mut m, _) = memory(2, 2, &[(4, 64, false)]);
    m[1][0] = KVCacheMemory::new_host(2, 4, 64, true).unwrap().0;
    assert!(matches!(err(m, None), KvError::ReplicationMismatch { replica: 1, group: 0, .. }));
    let (mut m, _) = memory(1, 2, &[(4, 64, false), (4, 64, false)]);
    m[0][1] = KVCacheMemory::new_host(1, 4, 64, false).unwrap().0;
    assert!(matches!(err(m, None), KvError::ShardCountMismatch { replica: 0, group: 1, expected: 2, found: 1 }));
    let (mut m, _) = memory(2, 1, &[(4, 64, false)]);
    m[1][0] = KVCacheMemory::new_host(1, 4, 32, false).unwrap().0;
    assert!(matches!(err(m, None), KvError::BytesPerPageMismatch { replica: 1, group: 0, expected: 64, found: 32 }));
    // rule order: a page-count mismatch is reported before a bytes-per-page one
    let (mut m, _) = memory(2, 1, &[(4, 64, false)]);
    m[1][0] = KVCacheMemory::new_host(1, 5, 32, false).unwrap().0;
    assert!(matches!(err(m, None), KvError::PageCountMismatch { .. }));
}

#[test]
fn mixed_device_kinds_are_refused() {
    use crate::transport::memory::RelabelledVram as FakeVram;
    let host = Arc::new(HostBuffer::new(256).unwrap());
    let vram = Arc::new(FakeVram(Arc::new(HostBuffer::new(256).unwrap())));
    let mixed = KVCacheMemory::new(false, vec![KvBuffer::new(host.clone(), 4, 64), KvBuffer::new(vram.clone(), 4, 64)]);
    let e = KVTransferEngine::new(&uniq("mx"), vec![vec![mixed.unwrap()]], None, TransportKind::Shm, &cfg());
    assert!(matches!(e, Err(KvError::MixedDeviceKinds { replica: 0, group: 0 })));
    let g0 = KVCacheMemory::new(false, vec![KvBuffer::new(host, 4, 64)]).unwrap();
    let g1 = KVCacheMemory::new(false, vec![KvBuffer::new(vram, 4, 64)]).unwrap();
    let e = KVTransferEngine::new(&uniq("mx"), vec![vec![g0, g1]], None, TransportKind::Shm, &cfg());
    assert!(matches!(e, Err(KvError::MixedMemoryTypes)));
}

#[test]
fn agents_and_metadata_follow_max() {
    let groups = [(4, 64, false), (8, 16, false)];
    let x = make("meta", 2, 2, &groups);
    let m = x.e.metadata();
    assert_eq!((m.dp(), m.tp()), (2, 2));
    assert_eq!(m.agents_meta[1][0].agent_name, format!("{}_1_0", x.e.name()));
    assert_eq!(m.leaf_ids, vec!["leaf0", "leaf1"]);
    assert_eq!(m.num_pages_per_group, vec![4, 8]);
    assert_eq!(m.bytes_per_group, vec![64, 16]);
    assert_eq!(m.replicated_per_group, vec![false, false]);
    assert_eq!(m.memory_type, MemoryType::Dram);
    assert_eq!(m.agents_meta[1][1].base_addrs, vec![x.hosts[1][0][1].addr(), x.hosts[1][1][1].addr()]);
    let back = KVTransferEngineMetadata::from_bytes(&m.to_bytes()).unwrap();
    assert_eq!(back, m);
    // default leaf ids
    let (mem, _) = memory(1, 1, &[(4, 64, false), (4, 64, false)]);
    let e = KVTransferEngine::new(&uniq("d"), mem, None, TransportKind::Shm, &cfg()).unwrap();
    assert_eq!(e.leaf_ids(), ["0", "1"]);
}

// ---------------------------------------------------------------- connect

#[test]
fn connect_errors() {
    let mut a = make("ca", 1, 2, &[(4, 64, false)]);
    let b = make("cb", 1, 2, &[(4, 64, false)]);
    a.e.connect(&b.e.metadata()).unwrap();
    assert!(matches!(a.e.connect(&b.e.metadata()), Err(KvError::AlreadyConnected(_))));
    assert_eq!(a.e.strategies(b.e.name()).unwrap(), [TransferStrategy::Direct]);
    // GATHER_SCATTER: sharded TP 2 -> TP 4
    let c = make("cc", 1, 4, &[(4, 64, false)]);
    assert!(matches!(a.e.connect(&c.e.metadata()), Err(KvError::Unsupported(_))));
    let d = make("cd", 1, 2, &[(4, 32, false)]);
    // MAX compares the total bytes per page first, then the per-group list.
    assert!(matches!(a.e.connect(&d.e.metadata()), Err(KvError::PageBytesMismatch { local: 64, remote: 32 })));
    let mut same_total = d.e.metadata();
    same_total.bytes_per_page = 64;
    assert!(matches!(a.e.connect(&same_total), Err(KvError::BytesPerGroupMismatch { .. })));
    // A TP change with replicated_per_group of another length: MAX's zip(strict=True) ValueError.
    let mut short = c.e.metadata();
    short.replicated_per_group = vec![];
    assert!(matches!(a.e.connect(&short), Err(KvError::ReplicationLengthMismatch { local: 1, remote: 0 })));
    let (mem, _) = memory(1, 2, &[(4, 64, false)]);
    let f = KVTransferEngine::new(&uniq("cf"), mem, Some(vec!["other".into()]), TransportKind::Shm, &cfg()).unwrap();
    assert!(matches!(a.e.connect(&f.metadata()), Err(KvError::LeafMismatch { .. })));
    let mut bad = d.e.metadata();
    bad.bytes_per_group = vec![64];
    bad.bytes_per_page = 64;
    bad.agents_meta[0][0].metadata = b"garbage".to_vec();
    assert!(matches!(a.e.connect(&bad), Err(KvError::BadMetadata(_))));
    let mut swapped = d.e.metadata();
    swapped.bytes_per_group = vec![64];
    swapped.bytes_per_page = 64;
    swapped.agents_meta[0].swap(0, 1);
    assert!(matches!(a.e.connect(&swapped), Err(KvError::BadMetadata(_))));
    let mut outside = d.e.metadata();
    outside.bytes_per_group = vec![64];
    outside.bytes_per_page = 64;
    outside.agents_meta[0][1].base_addrs[0] += 64;
    assert!(matches!(a.e.connect(&outside), Err(KvError::BadMetadata(_))));
    assert!(!a.e.is_connected(&d.e.metadata().name));
    let own = a.e.metadata();
    assert!(matches!(a.e.connect(&own), Err(KvError::Engine(_))));
    // disconnect, then the same name connects again
    assert!(matches!(a.e.disconnect("nobody"), Err(KvError::NotConnected(_))));
    a.e.disconnect(b.e.name()).unwrap();
    a.e.connect(&b.e.metadata()).unwrap();
}

// ---------------------------------------------------------------- initiate validation

#[test]
fn initiate_errors_each_rule() {
    let groups = [(4, 64, false), (6, 32, false)];
    let mut a = make("ia", 1, 1, &groups);
    let mut b = make("ib", 2, 1, &groups);
    let bm = b.e.metadata();
    let pl = |x: Vec<u64>, y: Vec<u64>| PageIdxs::per_leaf([("leaf0", x), ("leaf1", y)]);
    let ok = pl(vec![1], vec![2]);
    let e = a.e.initiate_send_transfer(&bm, &ok, &ok, 1, 0).unwrap_err();
    assert!(matches!(e, KvError::ReplicaOutOfRange { side: Side::Source, replica: 1, num_replicas: 1 }));
    let e = a.e.initiate_send_transfer(&bm, &ok, &ok, 0, 2).unwrap_err();
    assert!(matches!(e, KvError::ReplicaOutOfRange { side: Side::Destination, replica: 2, num_replicas: 2 }));
    assert!(matches!(a.e.initiate_send_transfer(&bm, &ok, &ok, 0, 0), Err(KvError::NotConnected(_))));
    a.e.connect(&bm).unwrap();
    let unknown = PageIdxs::per_leaf([("leaf0", vec![1]), ("leaf1", vec![2]), ("leafX", vec![])]);
    assert!(matches!(
        a.e.initiate_send_transfer(bm.name.as_str(), &unknown, &ok, 0, 0),
        Err(KvError::UnknownLeaf { side: Side::Source, .. })
    ));
    let missing = PageIdxs::per_leaf([("leaf0", vec![1])]);
    assert!(matches!(
        a.e.initiate_send_transfer(&bm, &ok, &missing, 0, 0),
        Err(KvError::MissingLeaf { side: Side::Destination, .. })
    ));
    // leaf1 has 6 pages: 5 is fine, 6 is not; leaf0 has 4
    assert!(matches!(
        a.e.initiate_send_transfer(&bm, &pl(vec![1], vec![6]), &ok, 0, 0),
        Err(KvError::PageOutOfRange { side: Side::Source, idx: 6, num_pages: 6, .. })
    ));
    assert!(matches!(
        a.e.initiate_send_transfer(&bm, &ok, &pl(vec![4], vec![5]), 0, 0),
        Err(KvError::PageOutOfRange { side: Side::Destination, idx: 4, num_pages: 4, .. })
    ));
    assert!(matches!(
        a.e.initiate_send_transfer(&bm, &pl(vec![1, 2], vec![2]), &ok, 0, 0),
        Err(KvError::PageCountLengthMismatch { src: 2, dst: 1, .. })
    ));
    assert!(matches!(
        a.e.initiate_send_transfer(&bm, &pl(vec![1, 2], vec![2]), &pl(vec![3, 3], vec![1]), 0, 0),
        Err(KvError::DuplicateDestinationPage { idx: 3, .. })
    ));
    // the same checks on a read (local = destination)
    let e = a.e.initiate_read_transfer(&bm, &ok, &ok, 0, 1).unwrap_err();
    assert!(matches!(e, KvError::ReplicaOutOfRange { side: Side::Destination, .. }));
    let e = a.e.initiate_read_transfer(&bm, &ok, &ok, 2, 0).unwrap_err();
    assert!(matches!(e, KvError::ReplicaOutOfRange { side: Side::Source, .. }));
    assert!(matches!(
        a.e.initiate_read_transfer(&bm, &ok, &pl(vec![2], vec![9]), 0, 0),
        Err(KvError::PageOutOfRange { side: Side::Destination, .. })
    ));
    assert!(matches!(
        a.e.initiate_read_transfer(&bm, &ok, &pl(vec![3, 3], vec![1]), 0, 0),
        Err(KvError::PageCountLengthMismatch { .. })
    ));
    assert_eq!(a.e.num_inflight(), 0);
    // nothing was posted by any failed call
    assert!(a.e.agents.iter().flatten().all(|x| x.engine.num_transfers() == 0));
    drop(b.hosts.pop());
}

#[test]
fn empty_page_lists_complete_at_once() {
    let g = [(4, 64, false)];
    let mut a = make("ea", 1, 2, &g);
    let mut b = make("eb", 1, 2, &g);
    a.e.connect(&b.e.metadata()).unwrap();
    let empty = PageIdxs::per_leaf([("leaf0", vec![])]);
    let req = a.e.initiate_send_transfer(b.e.name(), &empty, &empty, 0, 0).unwrap();
    assert!(req.transfer_ids.is_empty());
    assert!(a.e.is_complete(&req).unwrap());
    assert!(b.e.is_complete(&req).unwrap());
    a.e.sync_and_release(&req, Duration::from_secs(1)).unwrap();
    b.e.cleanup_transfer(&req).unwrap();
    let req = a.e.initiate_send_transfer(b.e.name(), &PageIdxs::Flat(vec![]), &PageIdxs::Flat(vec![]), 0, 0).unwrap();
    assert!(b.e.is_complete(&req).unwrap());
}

#[test]
fn requests_naming_other_engines_are_refused_and_names_must_match() {
    let g = [(8, 64, false)];
    let mut a = make("na", 1, 1, &g);
    let mut b = make("nb", 1, 1, &g);
    let mut c = make("nc", 1, 1, &g);
    a.e.connect(&b.e.metadata()).unwrap();
    let idx = PageIdxs::per_leaf([("leaf0", vec![1, 2])]);
    let req = a.e.initiate_send_transfer(b.e.name(), &idx, &idx, 0, 0).unwrap();
    // a third engine is neither source nor destination: an error, not a poll forever
    assert!(matches!(c.e.is_complete(&req), Err(KvError::NotOurTransfer { .. })));
    assert!(matches!(c.e.cancel_transfer(&req), Err(KvError::NotOurTransfer { .. })));
    assert!(matches!(c.e.sync_and_release(&req, Duration::from_millis(10)), Err(KvError::NotOurTransfer { .. })));
    // a request that reuses our transfer name between other engines must not
    // touch our in-flight transfer
    let mut forged = req.clone();
    forged.src_name = c.e.name().to_string();
    forged.dst_name = a.e.name().to_string();
    let before = a.e.num_inflight();
    a.e.cancel_transfer(&forged).unwrap();
    assert_eq!(a.e.num_inflight(), before, "a forged request released our transfer");
    wait_both(&mut a.e, &mut b.e, &req);
}

// ---------------------------------------------------------------- data movement

/// Send pages and verify every destination byte against the source shard
/// paired with it; check the recorded shard bookkeeping.
fn send_and_verify(sdp: usize, stp: usize, ddp: usize, dtp: usize, groups: &[G], read: bool) {
    let mut s = make("src", sdp, stp, groups);
    let mut d = make("dst", ddp, dtp, groups);
    fill(&s, groups);
    let (sm, dm) = (s.e.metadata(), d.e.metadata());
    let (sr, dr) = (sdp - 1, ddp - 1);
    // page lists of different lengths per leaf, destination non-contiguous
    let src_lists: Vec<(String, Vec<u64>)> = groups
        .iter()
        .enumerate()
        .map(|(g, &(pages, _, _))| (format!("leaf{g}"), (1..pages).step_by(g + 1).collect()))
        .collect();
    let dst_lists: Vec<(String, Vec<u64>)> = src_lists
        .iter()
        .zip(groups)
        .map(|((k, v), &(pages, _, _))| (k.clone(), v.iter().map(|&p| pages - p).collect()))
        .collect();
    let (src_idxs, dst_idxs) = (PageIdxs::PerLeaf(src_lists.clone()), PageIdxs::PerLeaf(dst_lists.clone()));
    let req = if read {
        d.e.connect(&sm).unwrap();
        d.e.initiate_read_transfer(&sm, &src_idxs, &dst_idxs, sr, dr).unwrap()
    } else {
        s.e.connect(&dm).unwrap();
        s.e.initiate_send_transfer(&dm, &src_idxs, &dst_idxs, sr, dr).unwrap()
    };
    let broadcast = stp != dtp;
    let pairs = topology::transfer_shard_pairing(broadcast, stp, dtp);
    assert_eq!(req.tp_shard_count, pairs.len());
    assert_eq!(req.transfer_ids.len(), pairs.len());
    let expect_used: Vec<usize> = pairs.iter().map(|&(a, b)| if read { b } else { a }).collect();
    assert_eq!(req.local_shards_used, expect_used);
    assert_eq!(req.is_read, read);
    // the record survives the wire
    let req = TransferReqData::from_json(&req.to_json()).unwrap();
    if read {
        wait_both(&mut d.e, &mut s.e, &req);
    } else {
        wait_both(&mut s.e, &mut d.e, &req);
    }
    for (g, &(pages, bpp, _)) in groups.iter().enumerate() {
        for &(ss, ds) in &pairs {
            let (src_h, dst_h) = (&s.hosts[sr][g][ss], &d.hosts[dr][g][ds]);
            let moved: Vec<(u64, u64)> = src_lists[g].1.iter().copied().zip(dst_lists[g].1.iter().copied()).collect();
            for &(sp, dp) in &moved {
                assert_eq!(page(dst_h, dp, bpp), page(src_h, sp, bpp), "group {g} shard {ss}->{ds} page {sp}->{dp}");
            }
            // untouched destination pages stay zero
            for p in 0..pages {
                if !moved.iter().any(|&(_, dp)| dp == p) {
                    assert!(page(dst_h, p, bpp).iter().all(|&b| b == 0), "page {p} of group {g} written");
                }
            }
        }
        // other replicas untouched
        for r in 0..ddp {
            if r != dr {
                assert!(d.hosts[r][g].iter().all(|h| h.to_vec(..).iter().all(|&b| b == 0)));
            }
        }
    }
    assert_eq!(s.e.num_inflight() + d.e.num_inflight(), 0);
    assert!(s.e.agents.iter().chain(&d.e.agents).flatten().all(|x| x.engine.num_transfers() == 0));
    s.e.cleanup().unwrap();
    d.e.cleanup().unwrap();
}

const THREE: [G; 3] = [(9, 256, false), (5, 64, false), (17, 8, false)];
const MLA: [G; 2] = [(9, 128, true), (5, 32, true)];

#[test]
fn direct_tp_1_2_4_dp_1_2_send() {
    for tp in [1, 2, 4] {
        for dp in [1, 2] {
            send_and_verify(dp, tp, dp, tp, &THREE, false);
        }
    }
}

#[test]
fn direct_read_and_dp_change() {
    send_and_verify(2, 2, 1, 2, &THREE, true);
    send_and_verify(1, 2, 2, 2, &THREE, false);
}

#[test]
fn broadcast_mla_tp1_to_tp4_and_back() {
    // TP1 source -> TP4 replicated destination: source shard 0 fans out
    send_and_verify(1, 1, 1, 4, &MLA, false);
    send_and_verify(1, 1, 2, 4, &MLA, true);
    // TP4 replicated source -> TP1 / TP2: the source flattens to shard 0
    send_and_verify(1, 4, 1, 1, &MLA, false);
    send_and_verify(2, 4, 1, 2, &MLA, false);
    send_and_verify(1, 2, 1, 4, &MLA, true);
}

#[test]
fn page_descs_are_group_major_then_page_order() {
    let mut out = Vec::new();
    let lists: [&[u64]; 3] = [&[2, 0], &[], &[5]];
    page_descs(&[0x1000, 0x8000, 0x9000], &[256, 64, 8], &lists, &mut out);
    assert_eq!(
        out,
        vec![
            crate::engine::Desc::new(0x1000 + 512, 256),
            crate::engine::Desc::new(0x1000, 256),
            crate::engine::Desc::new(0x9000 + 40, 8),
        ]
    );
}

#[test]
fn flat_page_lists_address_every_leaf() {
    let groups = [(6, 64, false), (6, 16, false)];
    let mut s = make("fs", 1, 1, &groups);
    let mut d = make("fd", 1, 1, &groups);
    fill(&s, &groups);
    s.e.connect(&d.e.metadata()).unwrap();
    let req = s.e.initiate_send_transfer(d.e.name(), &PageIdxs::Flat(vec![1, 2]), &PageIdxs::Flat(vec![4, 3]), 0, 0);
    let req = req.unwrap();
    assert!(matches!(req.src_idxs, PageIdxs::PerLeaf(_)));
    wait_both(&mut s.e, &mut d.e, &req);
    for (g, &(_, bpp, _)) in groups.iter().enumerate() {
        assert_eq!(page(&d.hosts[0][g][0], 4, bpp), page(&s.hosts[0][g][0], 1, bpp));
        assert_eq!(page(&d.hosts[0][g][0], 3, bpp), page(&s.hosts[0][g][0], 2, bpp));
    }
}

// ---------------------------------------------------------------- completion

#[test]
fn passive_side_banks_other_transfers_and_counts_unknown_engines() {
    let g = [(8, 64, false)];
    let mut a = make("na", 1, 2, &g);
    let mut b = make("nb", 1, 2, &g);
    // b never connects to a: a's notifications come from an unknown engine
    a.e.connect(&b.e.metadata()).unwrap();
    let one = |p| PageIdxs::per_leaf([("leaf0", vec![p])]);
    let r1 = a.e.initiate_send_transfer(b.e.name(), &one(1), &one(1), 0, 0).unwrap();
    let r2 = a.e.initiate_send_transfer(b.e.name(), &one(2), &one(2), 0, 0).unwrap();
    a.e.sync_and_release(&r1, Duration::from_secs(10)).unwrap();
    a.e.sync_and_release(&r2, Duration::from_secs(10)).unwrap();
    // polling r2 first banks r1's notifications
    let deadline = Instant::now() + Duration::from_secs(10);
    while !b.e.is_complete(&r2).unwrap() {
        assert!(Instant::now() < deadline);
    }
    assert!(b.e.is_complete(&r1).unwrap());
    assert!(b.e.num_unknown_notifications() >= 4);
    b.e.cleanup_transfer(&r1).unwrap();
    b.e.cleanup_transfer(&r2).unwrap();
    // a transfer that never happens is not complete and cannot be cleaned up
    let mut ghost = r1.clone();
    ghost.transfer_name = "ghost".into();
    assert!(!b.e.is_complete(&ghost).unwrap());
    assert!(matches!(b.e.cleanup_transfer(&ghost), Err(KvError::NotComplete(_))));
    assert!(matches!(b.e.sync_and_release(&ghost, Duration::from_millis(20)), Err(KvError::Timeout { .. })));
}

#[test]
fn timeout_cancels_and_leaks_nothing() {
    // large enough that the first poll finds it in progress
    let g = [(64, 1 << 20, false)];
    let mut a = make("ta", 1, 1, &g);
    let b = make("tb", 1, 1, &g);
    a.e.connect(&b.e.metadata()).unwrap();
    let all = PageIdxs::per_leaf([("leaf0", (0..64).collect())]);
    let req = a.e.initiate_send_transfer(b.e.name(), &all, &all, 0, 0).unwrap();
    match a.e.sync_and_release(&req, Duration::ZERO) {
        Ok(()) | Err(KvError::Timeout { .. }) => {}
        Err(e) => panic!("{e}"),
    }
    assert_eq!(a.e.num_inflight(), 0);
    assert_eq!(a.e.agents[0][0].engine.num_transfers(), 0);
    assert!(matches!(a.e.cleanup_transfer(&req), Err(KvError::UnknownTransfer(_))));
    a.e.cancel_transfer(&req).unwrap();
}

#[test]
fn failure_mid_posting_releases_what_was_posted() {
    let g = [(8, 4096, false)];
    let mut a = make("ma", 1, 2, &g);
    let b = make("mb", 1, 2, &g);
    a.e.connect(&b.e.metadata()).unwrap();
    // Corrupt the stored view of shard 1 so that its post fails after shard 0's succeeded.
    a.e.remotes.get_mut(b.e.name()).unwrap().meta.agents_meta[0][1].base_addrs[0] = 0x10;
    let pages = PageIdxs::per_leaf([("leaf0", vec![1, 2])]);
    let e = a.e.initiate_send_transfer(b.e.name(), &pages, &pages, 0, 0).unwrap_err();
    assert!(matches!(e, KvError::PostFailed { local_shard: 1, remote_shard: 1, .. }), "{e}");
    assert_eq!(a.e.num_inflight(), 0);
    assert!(a.e.agents.iter().flatten().all(|x| x.engine.num_transfers() == 0));
}

#[test]
fn disconnect_releases_inflight_and_cleanup_releases_everything() {
    let g = [(64, 1 << 20, false)];
    let mut a = make("xa", 1, 1, &g);
    let b = make("xb", 1, 1, &g);
    a.e.connect(&b.e.metadata()).unwrap();
    let all = PageIdxs::per_leaf([("leaf0", (0..64).collect())]);
    let _req = a.e.initiate_send_transfer(b.e.name(), &all, &all, 0, 0).unwrap();
    assert_eq!(a.e.num_inflight(), 1);
    a.e.disconnect(b.e.name()).unwrap();
    assert_eq!(a.e.num_inflight(), 0);
    assert_eq!(a.e.agents[0][0].engine.num_transfers(), 0);
    a.e.connect(&b.e.metadata()).unwrap();
    let _req = a.e.initiate_send_transfer(b.e.name(), &all, &all, 0, 0).unwrap();
    a.e.cleanup().unwrap();
    assert_eq!(a.e.num_inflight(), 0);
    assert!(!a.e.is_connected(b.e.name()));
}

#[test]
fn each_gpu_shard_gets_its_pcie_closest_nic_unless_a_device_is_named() {
    use super::engine::agent_config;
    use super::metadata::MemoryType;
    let nic = |gpu: u32| (gpu < 2).then(|| format!("mlx5_{gpu}"));
    let plain = TransportConfig::default();
    let verbs = TransportKind::Verbs;
    let dev = |c: &TransportConfig| c.option("device").map(str::to_string);
    assert_eq!(dev(&agent_config(&plain, verbs, MemoryType::Vram, 1, nic)), Some("mlx5_1".into()));
    assert_eq!(dev(&agent_config(&plain, verbs, MemoryType::Vram, 0, nic)), Some("mlx5_0".into()));
    // No NIC found for that GPU: the transport's own default.
    assert_eq!(dev(&agent_config(&plain, verbs, MemoryType::Vram, 7, nic)), None);
    // Host memory, another transport, or a device named by the caller: unchanged.
    assert_eq!(dev(&agent_config(&plain, verbs, MemoryType::Dram, 1, nic)), None);
    assert_eq!(dev(&agent_config(&plain, TransportKind::Tcp, MemoryType::Vram, 1, nic)), None);
    let mut named = TransportConfig::default();
    named.options.push(("device".into(), "rxe0".into()));
    let c = agent_config(&named, verbs, MemoryType::Vram, 1, nic);
    assert_eq!(c.options, named.options, "an explicit device wins and is not doubled");
}

// ---------------------------------------------------------------- dead peers

/// A peer engine that dies: transfers to it fail with a typed reason, it
/// stays connected (known) until the caller disconnects it, disconnecting
/// never errors, and a restarted engine under the same name connects and
/// moves bytes at once (issue 32, item 3; NIXL 1.5.1's dead-agent rule).
fn a_dead_peer_engine_fails_typed_and_stays_known_until_disconnected(kind: TransportKind) {
    let g = [(16, 4096, false)];
    let new = |name: &str| {
        let (mem, hosts) = memory(1, 1, &g);
        let e = KVTransferEngine::new(name, mem, Some(vec!["leaf0".into()]), kind, &cfg()).unwrap();
        Eng { e, hosts }
    };
    let bname = uniq("dead-b");
    let mut a = new(&uniq("dead-a"));
    let b = new(&bname);
    a.e.connect(&b.e.metadata()).unwrap();
    drop(b);
    let pages = PageIdxs::per_leaf([("leaf0", (0..16).collect())]);
    let is_dead = |e: &KvError| match e {
        KvError::PostFailed { source: EngineError::Transport(TransportError::PeerDisconnected(_)), .. } => true,
        KvError::TransferFailed { reason, .. } => {
            matches!(reason.kind, crate::transport::FailureKind::PeerDied | crate::transport::FailureKind::PeerTimeout)
        }
        _ => false,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut post_refused = 0;
    while post_refused < 3 {
        assert!(Instant::now() < deadline, "{kind}: the death was not noticed");
        match a.e.initiate_send_transfer(bname.as_str(), &pages, &pages, 0, 0) {
            Ok(req) => match a.e.sync_and_release(&req, Duration::from_secs(10)) {
                Ok(()) => panic!("{kind}: a transfer to a dead engine completed"),
                Err(e) => assert!(is_dead(&e), "{kind}: {e}"),
            },
            Err(e) => {
                assert!(
                    matches!(
                        &e,
                        KvError::PostFailed { source: EngineError::Transport(TransportError::PeerDisconnected(_)), .. }
                    ),
                    "{kind}: {e}"
                );
                post_refused += 1;
            }
        }
    }
    assert!(a.e.is_connected(&bname), "{kind}: a dead engine stays known until disconnected");
    assert_eq!(a.e.num_inflight(), 0);
    a.e.disconnect(&bname).unwrap();
    assert!(!a.e.is_connected(&bname));
    // restarted under the same name: connects and moves bytes at once
    let mut b2 = new(&bname);
    fill(&a, &g);
    a.e.connect(&b2.e.metadata()).unwrap();
    let req = a.e.initiate_send_transfer(bname.as_str(), &pages, &pages, 0, 0).unwrap();
    wait_both(&mut a.e, &mut b2.e, &req);
    assert_eq!(page(&b2.hosts[0][0][0], 5, 4096), page(&a.hosts[0][0][0], 5, 4096), "{kind}");
}

#[test]
fn a_dead_peer_engine_over_shm() {
    a_dead_peer_engine_fails_typed_and_stays_known_until_disconnected(TransportKind::Shm);
}

#[test]
fn a_dead_peer_engine_over_tcp() {
    a_dead_peer_engine_fails_typed_and_stays_known_until_disconnected(TransportKind::Tcp);
}
