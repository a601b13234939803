//! Two real processes move KV pages over the `shm` transport: this test
//! binary re-executes itself as the decode (destination) engine, selected by
//! the `KVWIRE_KV_CHILD` env var; metadata and `TransferReqData` travel over
//! a `SideChannel`. Every destination byte is checked.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvwire::kv::{
    HostLeafSpec, HostPages, KVTransferEngine, KVTransferEngineMetadata, KvError, PageIdxs, PagedCacheDesc,
    TransferReqData, topology,
};
use kvwire::sidechannel::SideChannel;
use kvwire::transport::{TransportConfig, TransportKind};
use serde::{Deserialize, Serialize};

const CHILD_ENV: &str = "KVWIRE_KV_CHILD";
const ADDR_ENV: &str = "KVWIRE_KV_ADDR";
const TIMEOUT: Duration = Duration::from_secs(30);

/// One scenario, shared by both processes through the env var.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Scenario {
    src_dp: usize,
    src_tp: usize,
    dst_dp: usize,
    dst_tp: usize,
    /// MLA: groups replicated across TP (on the TP>1 side).
    mla: bool,
    /// The destination pulls (`initiate_read_transfer`).
    read: bool,
    /// The child exits right after exchanging metadata (dead-peer test).
    die: bool,
}

#[derive(Debug, Serialize, Deserialize)]
enum Msg {
    Meta(String),
    Req(String),
    Verdict { pages_checked: u64, error: Option<String> },
    Done,
}

/// (pages, bytes per page) of each leaf: different page counts and strides.
const LEAVES: [(u64, u64); 3] = [(33, 4096), (17, 512), (65, 64)];

fn specs(tp: usize, mla: bool) -> Vec<HostLeafSpec> {
    LEAVES
        .iter()
        .enumerate()
        .map(|(g, &(pages, bpp))| HostLeafSpec {
            leaf_id: format!("layer{g}"),
            num_pages: pages,
            bytes_per_page: bpp,
            replicated: mla && tp > 1,
            scales_bytes_per_page: None,
        })
        .collect()
}

fn engine(name: &str, dp: usize, tp: usize, mla: bool) -> (KVTransferEngine, HostPages) {
    let (cache, hosts) = PagedCacheDesc::allocate_host(&specs(tp, mla), dp, tp).unwrap();
    let e = KVTransferEngine::from_paged_cache(name, &cache, TransportKind::Shm, &TransportConfig::default()).unwrap();
    (e, hosts)
}

/// The byte at offset `i` of page `page` of group `g` on source shard `shard`.
fn byte(g: usize, shard: usize, page: u64, i: u64) -> u8 {
    ((g as u64 * 131 + shard as u64 * 31 + page * 7 + i) % 251) as u8 + 1
}

/// Page lists: every other source page from 1 (null block skipped), into
/// destination pages in reverse order (non-contiguous), per leaf.
fn page_lists() -> (Vec<Vec<u64>>, Vec<Vec<u64>>) {
    let src: Vec<Vec<u64>> = LEAVES.iter().map(|&(pages, _)| (1..pages).step_by(2).collect()).collect();
    let dst = src.iter().zip(LEAVES).map(|(s, (pages, _))| s.iter().map(|&p| pages - p).collect()).collect();
    (src, dst)
}

fn per_leaf(lists: &[Vec<u64>]) -> PageIdxs {
    PageIdxs::per_leaf(lists.iter().enumerate().map(|(g, l)| (format!("layer{g}"), l.clone())))
}

fn poll(e: &mut KVTransferEngine, req: &TransferReqData) -> Result<(), KvError> {
    let deadline = Instant::now() + TIMEOUT;
    while !e.is_complete(req)? {
        assert!(Instant::now() < deadline, "transfer {} did not complete", req.transfer_name);
        std::thread::yield_now();
    }
    e.cleanup_transfer(req)
}

fn spawn_child(sc: Scenario, addr: &str, test: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "kv_child_role", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, serde_json::to_string(&sc).unwrap())
        .env(ADDR_ENV, addr)
        .env("KVWIRE_KV_TEST", test)
        .spawn()
        .unwrap()
}

/// The prefill (source) side; returns the pages the child verified.
fn run_parent(sc: Scenario, test: &str) -> u64 {
    let name = format!("prefill{}{test}", std::process::id());
    let (mut e, hosts) = engine(&name, sc.src_dp, sc.src_tp, sc.mla);
    for replica in &hosts {
        for (g, shards) in replica.iter().enumerate() {
            let (pages, bpp) = LEAVES[g];
            for (s, h) in shards.iter().enumerate() {
                let s_eff = if sc.mla && sc.src_tp > 1 { 0 } else { s };
                h.fill_with(0, (pages * bpp) as usize, |i| byte(g, s_eff, i as u64 / bpp, i as u64 % bpp));
            }
        }
    }
    let (listener, addr) = SideChannel::bind("127.0.0.1:0").unwrap();
    let mut child = spawn_child(sc, &addr.to_string(), test);
    let mut ch = SideChannel::accept(&listener).unwrap();
    ch.set_read_timeout(Some(TIMEOUT)).unwrap();
    ch.send(&Msg::Meta(String::from_utf8(e.metadata().to_bytes()).unwrap())).unwrap();
    let Msg::Meta(child_md) = ch.recv().unwrap() else { panic!("expected metadata") };
    let child_md = KVTransferEngineMetadata::from_json(&child_md).unwrap();
    let (src, dst) = page_lists();
    let (sr, dr) = (sc.src_dp - 1, sc.dst_dp - 1);
    if sc.die {
        e.connect(&child_md).unwrap();
        ch.send(&Msg::Done).unwrap();
        assert!(child.wait().unwrap().success());
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match e.initiate_send_transfer(&child_md, &per_leaf(&src), &per_leaf(&dst), sr, dr) {
                Err(KvError::PostFailed { .. }) => break,
                Err(other) => panic!("unexpected {other}"),
                Ok(req) => match e.sync_and_release(&req, TIMEOUT) {
                    Err(KvError::TransferFailed { .. }) => break,
                    Ok(()) => {} // death not noticed yet
                    Err(other) => panic!("unexpected {other}"),
                },
            }
            assert!(Instant::now() < deadline, "sends to a dead peer kept succeeding");
        }
        assert_eq!(e.num_inflight(), 0, "a handle leaked");
        e.cleanup().unwrap();
        return 0;
    }
    if sc.read {
        let Msg::Req(req) = ch.recv().unwrap() else { panic!("expected a request") };
        let req = TransferReqData::from_json(&req).unwrap();
        assert!(req.is_read);
        poll(&mut e, &req).unwrap();
    } else {
        e.connect(&child_md).unwrap();
        let req = e.initiate_send_transfer(&child_md, &per_leaf(&src), &per_leaf(&dst), sr, dr).unwrap();
        let pairs = topology::transfer_shard_pairing(sc.mla && sc.src_tp != sc.dst_tp, sc.src_tp, sc.dst_tp);
        assert_eq!(req.tp_shard_count, pairs.len());
        ch.send(&Msg::Req(req.to_json())).unwrap();
        poll(&mut e, &req).unwrap();
    }
    let Msg::Verdict { pages_checked, error } = ch.recv().unwrap() else { panic!("expected a verdict") };
    ch.send(&Msg::Done).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(error, None);
    assert_eq!(e.num_inflight(), 0);
    e.cleanup().unwrap();
    pages_checked
}

/// The decode (destination) side, in the child process.
fn run_child(sc: Scenario) {
    let addr = std::env::var(ADDR_ENV).unwrap();
    let test = std::env::var("KVWIRE_KV_TEST").unwrap();
    let name = format!("decode{}{test}", std::process::id());
    let (mut e, hosts) = engine(&name, sc.dst_dp, sc.dst_tp, sc.mla);
    let mut ch = SideChannel::connect(&addr, TIMEOUT).unwrap();
    ch.set_read_timeout(Some(TIMEOUT)).unwrap();
    let Msg::Meta(parent_md) = ch.recv().unwrap() else { panic!("expected metadata") };
    let parent_md = KVTransferEngineMetadata::from_json(&parent_md).unwrap();
    ch.send(&Msg::Meta(e.metadata().to_json())).unwrap();
    if sc.die {
        // exit (without cleanup) once the parent is connected
        let _: Msg = ch.recv().unwrap();
        std::process::exit(0);
    }
    let (src, dst) = page_lists();
    let (sr, dr) = (sc.src_dp - 1, sc.dst_dp - 1);
    let result = if sc.read {
        e.connect(&parent_md).unwrap();
        let req = e.initiate_read_transfer(&parent_md, &per_leaf(&src), &per_leaf(&dst), sr, dr).unwrap();
        ch.send(&Msg::Req(req.to_json())).unwrap();
        poll(&mut e, &req)
    } else {
        let Msg::Req(req) = ch.recv().unwrap() else { panic!("expected a request") };
        poll(&mut e, &TransferReqData::from_json(&req).unwrap())
    };
    let error = result.err().map(|e| e.to_string()).or_else(|| verify(sc, &hosts, &src, &dst).err());
    let pages_checked = if error.is_none() { count_pages(sc, &dst) } else { 0 };
    ch.send(&Msg::Verdict { pages_checked, error }).unwrap();
    let _: Msg = ch.recv().unwrap();
    e.cleanup().unwrap();
}

fn count_pages(sc: Scenario, dst: &[Vec<u64>]) -> u64 {
    (dst.iter().map(Vec::len).sum::<usize>() * sc.dst_tp) as u64
}

fn verify(sc: Scenario, hosts: &HostPages, src: &[Vec<u64>], dst: &[Vec<u64>]) -> Result<(), String> {
    let broadcast = sc.mla && sc.src_tp != sc.dst_tp;
    let pairs = topology::transfer_shard_pairing(broadcast, sc.src_tp, sc.dst_tp);
    let dr = sc.dst_dp - 1;
    for (r, replica) in hosts.iter().enumerate() {
        for (g, shards) in replica.iter().enumerate() {
            let (pages, bpp) = LEAVES[g];
            for (ds, h) in shards.iter().enumerate() {
                let data = h.to_vec(..);
                for p in 0..pages {
                    let got = &data[(p * bpp) as usize..((p + 1) * bpp) as usize];
                    let moved = dst[g].iter().position(|&d| d == p).filter(|_| r == dr);
                    match moved {
                        None => {
                            if got.iter().any(|&b| b != 0) {
                                return Err(format!("replica {r} group {g} shard {ds} page {p} was written"));
                            }
                        }
                        Some(k) => {
                            let ss = pairs.iter().find(|&&(_, d)| d == ds).map(|&(s, _)| s).unwrap();
                            let s_eff = if sc.mla && sc.src_tp > 1 { 0 } else { ss };
                            let sp = src[g][k];
                            if let Some(i) = (0..bpp).find(|&i| got[i as usize] != byte(g, s_eff, sp, i)) {
                                return Err(format!(
                                    "group {g} shard {ds} page {p} (from page {sp} of shard {ss}) differs at byte {i}"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn kv_child_role() {
    if let Ok(sc) = std::env::var(CHILD_ENV) {
        run_child(serde_json::from_str(&sc).unwrap());
    }
}

fn sc(src_dp: usize, src_tp: usize, dst_dp: usize, dst_tp: usize, mla: bool, read: bool) -> Scenario {
    Scenario { src_dp, src_tp, dst_dp, dst_tp, mla, read, die: false }
}

#[test]
fn tp2_send_between_processes() {
    assert!(run_parent(sc(1, 2, 1, 2, false, false), "tp2s") > 0);
}

#[test]
fn tp2_read_between_processes() {
    assert!(run_parent(sc(1, 2, 1, 2, false, true), "tp2r") > 0);
}

#[test]
fn dp2_send_between_processes() {
    // replica 1 -> replica 1, replica 0 stays untouched
    assert!(run_parent(sc(2, 2, 2, 2, false, false), "dp2") > 0);
}

#[test]
fn mla_broadcast_tp1_to_tp4_between_processes() {
    assert!(run_parent(sc(1, 1, 1, 4, true, false), "mla14") > 0);
    assert!(run_parent(sc(1, 1, 1, 4, true, true), "mla14r") > 0);
}

#[test]
fn dead_peer_fails_and_leaks_nothing() {
    let mut s = sc(1, 2, 1, 2, false, false);
    s.die = true;
    run_parent(s, "dead");
}
