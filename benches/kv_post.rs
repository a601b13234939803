//! KV-layer hot paths: page index → byte range mapping of a 1,000-page
//! request on 8 TP shards, and the whole `initiate_send_transfer` of such a
//! request (validation, mapping, one engine post per shard pair) to an
//! in-process peer over shm (timed up to the return of the call; the
//! transfer is then cancelled, untimed).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvwire::kv::{KVCacheMemory, KVTransferEngine, PageIdxs, page_descs};
use kvwire::transport::{TransportConfig, TransportKind};

const TP: usize = 8;
const PAGES: u64 = 1000;
const POOL: u64 = 4096;
const BPP: u64 = 4096;

fn scattered() -> Vec<u64> {
    (0..PAGES).map(|i| (i * 2654435761) % (POOL - 1) + 1).collect()
}

fn mapping(c: &mut Criterion) {
    let idx = scattered();
    let bases: Vec<[u64; 2]> = (0..TP as u64).map(|s| [0x1000_0000 * (s + 1), 0x8000_0000 * (s + 1)]).collect();
    let bytes = [BPP, 256];
    let mut out = Vec::new();
    let mut g = c.benchmark_group("kv_page_mapping");
    g.throughput(Throughput::Elements(PAGES * TP as u64 * 2));
    g.bench_function("tp8_1000_pages_2_leaves", |b| {
        b.iter(|| {
            for base in &bases {
                page_descs(base, &bytes, &[&idx, &idx], &mut out);
                black_box(&out);
            }
        })
    });
    g.finish();
}

fn engine(name: &str) -> KVTransferEngine {
    let (m, _hosts) = KVCacheMemory::new_host(TP, POOL, BPP, false).unwrap();
    KVTransferEngine::new(name, vec![vec![m]], None, TransportKind::Shm, &TransportConfig::default()).unwrap()
}

fn initiate(c: &mut Criterion) {
    let mut src = engine("bench-prefill");
    let dst = engine("bench-decode");
    src.connect(&dst.metadata()).unwrap();
    let idx = PageIdxs::Flat(scattered());
    let mut g = c.benchmark_group("kv_initiate_send");
    g.throughput(Throughput::Elements(PAGES * TP as u64));
    // Only the initiate call is timed; the cancel after it (which waits for
    // a copy thread to finish its current chunk) is not.
    g.bench_function("tp8_1000_scattered_pages", |b| {
        b.iter_custom(|iters| {
            let mut spent = std::time::Duration::ZERO;
            for _ in 0..iters {
                let t0 = std::time::Instant::now();
                let req = src.initiate_send_transfer("bench-decode", &idx, &idx, 0, 0).unwrap();
                spent += t0.elapsed();
                src.cancel_transfer(&req).unwrap();
            }
            spent
        })
    });
    g.finish();
}

criterion_group!(benches, mapping, initiate);
criterion_main!(benches);
