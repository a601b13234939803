//! Hot paths that need no peer: descriptor validation + coalescing, and the
//! engine's whole prep+post of a scattered page list over shm (posted to an
//! in-process peer and released at once).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvwire::HostBuffer;
use kvwire::engine::desc::{LocalSpan, build_segments};
use kvwire::engine::{Desc, TransferEngine};
use kvwire::transport::{LocalKey, MemoryKind, Op, RemoteKey, RemoteRegion, TransportConfig, TransportKind};

const PAGE: u64 = 4096;

fn scattered(n: u64, local_base: u64, remote_base: u64) -> (Vec<Desc>, Vec<Desc>) {
    // A fixed odd stride scatters destination pages across the region.
    let l = (0..n).map(|i| Desc::new(local_base + i * PAGE, PAGE)).collect();
    let r = (0..n).map(|i| Desc::new(remote_base + (i * 7919 % n) * PAGE, PAGE)).collect();
    (l, r)
}

fn validate_and_coalesce(c: &mut Criterion) {
    let mut g = c.benchmark_group("validate_coalesce");
    for n in [1_000u64, 65_536] {
        let spans = [LocalSpan { addr: 0x1000_0000, end: 0x1000_0000 + n * PAGE, lkey: LocalKey(1) }];
        let regions = [RemoteRegion {
            addr: 0x9000_0000,
            len_bytes: n * PAGE,
            rkey: RemoteKey(2),
            kind: MemoryKind::Dram,
            device_id: 0,
        }];
        let (l, r) = scattered(n, 0x1000_0000, 0x9000_0000);
        let mut out = Vec::new();
        g.throughput(Throughput::Elements(n));
        g.bench_with_input(BenchmarkId::new("scattered_4KiB_pages", n), &n, |b, _| {
            b.iter(|| build_segments(black_box(&l), black_box(&r), &spans, &regions, "peer", &mut out).unwrap())
        });
    }
    g.finish();
}

fn engine_post(c: &mut Criterion) {
    let n = 4096u64;
    let cfg = TransportConfig::default();
    let mut target = TransferEngine::new("target", TransportKind::Shm, &cfg).unwrap();
    let mut initiator = TransferEngine::new("initiator", TransportKind::Shm, &cfg).unwrap();
    let dst = Arc::new(HostBuffer::new((n * PAGE) as usize).unwrap());
    let src = Arc::new(HostBuffer::new((n * PAGE) as usize).unwrap());
    target.register(dst.clone()).unwrap();
    initiator.register(src.clone()).unwrap();
    initiator.connect(&target.metadata()).unwrap();
    let (l, r) = scattered(n, src.addr(), dst.addr());
    let mut segs = Vec::new();
    let mut g = c.benchmark_group("engine_prep_post");
    g.throughput(Throughput::Elements(n));
    // Only prep+post is timed; the release that cancels the copy (waiting
    // for a copy thread to finish its current chunk) is not.
    g.bench_function("shm_write_4096_scattered_4KiB_pages", |b| {
        b.iter_custom(|iters| {
            let mut spent = std::time::Duration::ZERO;
            for _ in 0..iters {
                let t0 = std::time::Instant::now();
                let h = initiator.post_with(Op::Write, &l, "target", &r, None, &mut segs).unwrap();
                spent += t0.elapsed();
                initiator.release(h).unwrap();
            }
            spent
        })
    });
    g.finish();
}

criterion_group!(benches, validate_and_coalesce, engine_post);
criterion_main!(benches);
