//! A TP=2 KV transfer through `KVTransferEngine` over the verbs transport,
//! decode on the first device (rxe0), prefill on the second (rxe1), both in
//! this process: a WRITE (`initiate_send_transfer`) and a READ
//! (`initiate_read_transfer`), `is_complete` polled on both sides, every byte
//! of both shards checked (moved pages equal their source page, all other
//! pages untouched).
//!
//! Runs only where a device exists (`SOFTROCE_DEVS`, or any device libibverbs
//! lists); elsewhere prints `skipped: no RDMA device (...)` and returns.
//! `scripts/softroce-tests.sh` runs it in the Soft-RoCE guest.

mod verbs_util;

use verbs_util::WAIT;

use std::time::{Duration, Instant};

use std::sync::Arc;

use kvwire::HostBuffer;
use kvwire::kv::{KVCacheMemory, KVTransferEngine, PageIdxs, TransferReqData};
use kvwire::transport::TransportKind;

const TP: usize = 2;
/// (pages, bytes per page) of each leaf: a 4 KiB leaf and a small one.
const LEAVES: [(u64, u64); 2] = [(24, 4096), (40, 256)];

/// A TP=2 engine with the two leaves; `[leaf][shard]` buffers.
fn engine(name: &str, device: &str) -> (KVTransferEngine, Vec<Vec<Arc<HostBuffer>>>) {
    let mut groups = Vec::new();
    let mut bufs = Vec::new();
    for &(pages, bpp) in &LEAVES {
        let (mem, b) = KVCacheMemory::new_host(TP, pages, bpp, false).unwrap();
        groups.push(mem);
        bufs.push(b);
    }
    let leaf_ids = (0..LEAVES.len()).map(|g| format!("layer{g}")).collect();
    let e = KVTransferEngine::new(
        name,
        vec![groups],
        Some(leaf_ids),
        TransportKind::Verbs,
        &verbs_util::config(device, &[]),
    )
    .expect("verbs KV engine");
    (e, bufs)
}

/// The byte at offset `i` of page `page` of leaf `g`, shard `shard`.
fn byte(g: usize, shard: usize, page: u64, i: u64) -> u8 {
    ((g as u64 * 131 + shard as u64 * 31 + page * 7 + i) % 251) as u8 + 1
}

fn fill(bufs: &[Vec<Arc<HostBuffer>>]) {
    for (g, shards) in bufs.iter().enumerate() {
        let (pages, bpp) = LEAVES[g];
        for (s, b) in shards.iter().enumerate() {
            b.fill_with(0, (pages * bpp) as usize, |i| byte(g, s, i as u64 / bpp, i as u64 % bpp));
        }
    }
}

/// Source pages (every other one from 1) and destination pages (reversed,
/// non-contiguous), per leaf.
fn page_lists() -> (Vec<Vec<u64>>, Vec<Vec<u64>>) {
    let src: Vec<Vec<u64>> = LEAVES.iter().map(|&(pages, _)| (1..pages).step_by(2).collect()).collect();
    let dst = src.iter().zip(LEAVES).map(|(s, (pages, _))| s.iter().map(|&p| pages - p).collect()).collect();
    (src, dst)
}

fn per_leaf(lists: &[Vec<u64>]) -> PageIdxs {
    PageIdxs::per_leaf(lists.iter().enumerate().map(|(g, l)| (format!("layer{g}"), l.clone())))
}

/// Poll `is_complete` on both engines until both say done, then clean up.
fn complete_both(a: &mut KVTransferEngine, b: &mut KVTransferEngine, req: &TransferReqData) {
    let t0 = Instant::now();
    let (mut da, mut db) = (false, false);
    while !(da && db) {
        da = da || a.is_complete(req).unwrap();
        db = db || b.is_complete(req).unwrap();
        assert!(t0.elapsed() < WAIT, "{} not complete after {WAIT:?} ({da}, {db})", req.transfer_name);
        std::thread::sleep(Duration::from_micros(200));
    }
    a.cleanup_transfer(req).unwrap();
    b.cleanup_transfer(req).unwrap();
}

/// Every byte of every shard of `dst`: pages in `dst_pages` equal their
/// source page (shard s from shard s), all others are zero. Returns the
/// number of pages checked.
fn verify(dst: &[Vec<Arc<HostBuffer>>], src_pages: &[Vec<u64>], dst_pages: &[Vec<u64>]) -> usize {
    let mut moved = 0;
    for (g, shards) in dst.iter().enumerate() {
        let (pages, bpp) = LEAVES[g];
        for (s, b) in shards.iter().enumerate() {
            let data = b.to_vec(..);
            assert_eq!(data.len() as u64, pages * bpp);
            for p in 0..pages {
                let got = &data[(p * bpp) as usize..((p + 1) * bpp) as usize];
                match dst_pages[g].iter().position(|&d| d == p) {
                    None => assert!(got.iter().all(|&x| x == 0), "leaf {g} shard {s} page {p} was written"),
                    Some(k) => {
                        let sp = src_pages[g][k];
                        if let Some(i) = (0..bpp).find(|&i| got[i as usize] != byte(g, s, sp, i)) {
                            panic!("leaf {g} shard {s} page {p} (from page {sp}) differs at byte {i}");
                        }
                        moved += 1;
                    }
                }
            }
        }
    }
    moved
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_kv_tp2_send_and_read() {
    let (ddev, pdev) = need_devices!();
    let (src, dst) = page_lists();
    let expected: usize = dst.iter().map(Vec::len).sum::<usize>() * TP;

    // WRITE: prefill (rxe1) pushes into decode (rxe0).
    let (mut decode, dbufs) = engine("decode", &ddev);
    let (mut prefill, pbufs) = engine("prefill", &pdev);
    fill(&pbufs);
    prefill.connect(&decode.metadata()).unwrap();
    let req = prefill.initiate_send_transfer(&decode.metadata(), &per_leaf(&src), &per_leaf(&dst), 0, 0).unwrap();
    assert_eq!(req.tp_shard_count, TP);
    // The decode side learns of the request as it would over the wire.
    let req = TransferReqData::from_json(&req.to_json()).unwrap();
    complete_both(&mut prefill, &mut decode, &req);
    assert_eq!(verify(&dbufs, &src, &dst), expected);
    assert_eq!(prefill.num_inflight(), 0);
    assert_eq!(decode.num_inflight(), 0);
    prefill.cleanup().unwrap();
    decode.cleanup().unwrap();
    eprintln!("verbs_kv: send {ddev} <- {pdev}: {expected} pages over {TP} shards verified");

    // READ: a fresh decode (rxe0) pulls from a fresh prefill (rxe1).
    let (mut decode, dbufs) = engine("decode-r", &ddev);
    let (mut prefill, pbufs) = engine("prefill-r", &pdev);
    fill(&pbufs);
    decode.connect(&prefill.metadata()).unwrap();
    let req = decode.initiate_read_transfer(&prefill.metadata(), &per_leaf(&src), &per_leaf(&dst), 0, 0).unwrap();
    assert!(req.is_read);
    assert_eq!(req.tp_shard_count, TP);
    let req = TransferReqData::from_json(&req.to_json()).unwrap();
    complete_both(&mut decode, &mut prefill, &req);
    assert_eq!(verify(&dbufs, &src, &dst), expected);
    assert_eq!(prefill.num_inflight(), 0);
    assert_eq!(decode.num_inflight(), 0);
    prefill.cleanup().unwrap();
    decode.cleanup().unwrap();
    eprintln!("verbs_kv: read {ddev} <- {pdev}: {expected} pages over {TP} shards verified");
}
