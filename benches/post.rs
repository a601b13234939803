//! Hot paths that need no peer: descriptor validation + coalescing, and the
//! engine's whole prep+post of a scattered page list over shm (posted to an
//! in-process peer and released at once), timed both in wall-clock and in
//! the posting thread's CPU time.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// CPU time this thread has used, `CLOCK_THREAD_CPUTIME_ID`: on a shared
/// machine the wall time of a 1 ms post is mostly other processes' time
/// slices, its CPU time is not.
fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32))
        .unwrap_or_default()
}

fn engine_post(c: &mut Criterion) {
    let cfg = TransportConfig::default();
    let mut g = c.benchmark_group("engine_prep_post");
    // 4,096 pages (16 MiB) and the live bench's 65,536 (256 MiB).
    for n in [4096u64, 65_536] {
        let mut target = TransferEngine::new("target", TransportKind::Shm, &cfg).unwrap();
        let mut initiator = TransferEngine::new("initiator", TransportKind::Shm, &cfg).unwrap();
        let dst = Arc::new(HostBuffer::new((n * PAGE) as usize).unwrap());
        let src = Arc::new(HostBuffer::new((n * PAGE) as usize).unwrap());
        target.register(dst.clone()).unwrap();
        initiator.register(src.clone()).unwrap();
        initiator.connect(&target.metadata()).unwrap();
        let (l, r) = scattered(n, src.addr(), dst.addr());
        let mut segs = Vec::new();
        g.throughput(Throughput::Elements(n));
        // Only prep+post is timed; the release that cancels the copy (waiting
        // for a copy thread to finish its current chunk) is not.
        for (clock, now) in [("wall", wall as fn() -> Duration), ("thread_cpu", thread_cpu)] {
            let id = BenchmarkId::new(format!("shm_write_scattered_4KiB_pages_{clock}"), n);
            g.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let t0 = now();
                        let h = initiator.post_with(Op::Write, &l, "target", &r, None, &mut segs).unwrap();
                        spent += now().saturating_sub(t0);
                        initiator.release(h).unwrap();
                    }
                    spent
                })
            });
        }
    }
    g.finish();
}

/// Monotonic time since the first call (for the `wall` variant).
fn wall() -> Duration {
    static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    T0.get_or_init(Instant::now).elapsed()
}

criterion_group!(benches, validate_and_coalesce, engine_post);
criterion_main!(benches);
