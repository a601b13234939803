//! The verbs command path on the simulated NIC (`SimNic`, no device):
//! - `post_to_nic`: a post of N pages through the state machine (transfer
//!   record, queueing, WR building, `post_send`) until its WRs are handed to
//!   the NIC, on the calling thread;
//! - `channel_to_nic`: the same post sent as a command over the channel to
//!   the engine on its progress thread, until the NIC holds all its WRs (the
//!   hand-off between threads included).
//!
//! The simulated completion after each post is not timed. Reported per
//! page; compare with `verbs_post` (WR building and `post_send` alone) in
//! the same run.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvwire::transport::verbs::sim_bench::{ChannelBench, CommandBench};

fn command_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("verbs_command");
    for &pages in &[1u64, 64, 1024] {
        g.throughput(Throughput::Elements(pages));
        g.bench_with_input(BenchmarkId::new("post_to_nic", pages), &pages, |b, &pages| {
            let mut bench = CommandBench::default();
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let t0 = Instant::now();
                    std::hint::black_box(bench.post_pages(pages));
                    spent += t0.elapsed();
                    bench.finish();
                }
                spent
            });
        });
    }
    for &pages in &[1u64, 64, 1024] {
        g.throughput(Throughput::Elements(pages));
        g.bench_with_input(BenchmarkId::new("channel_to_nic", pages), &pages, |b, &pages| {
            let mut bench = ChannelBench::default();
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let t0 = Instant::now();
                    bench.post_pages(pages);
                    spent += t0.elapsed();
                    bench.finish();
                }
                spent
            });
        });
    }
    g.finish();
}

criterion_group!(benches, command_path);
criterion_main!(benches);
