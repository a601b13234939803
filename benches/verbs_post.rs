//! Cost of building and posting RDMA WRITE work requests per page, against
//! a fake provider op table (no device): the CPU side of `VerbsTransport::post`.
//! Target: ≤ 30 ns per page.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvwire::verbs::wr::FakeQueuePair;
use kvwire::verbs::{WrBatch, WrId};

fn post_pages(c: &mut Criterion) {
    let mut g = c.benchmark_group("verbs_post");
    for &pages in &[64usize, 1024] {
        g.throughput(Throughput::Elements(pages as u64));
        g.bench_with_input(BenchmarkId::new("write_chain_64", pages), &pages, |b, &pages| {
            let mut qp = FakeQueuePair::default();
            let mut batch = WrBatch::with_capacity(64);
            b.iter(|| {
                let mut i = 0usize;
                while i < pages {
                    batch.clear();
                    let n = (pages - i).min(64);
                    for k in 0..n {
                        let p = (i + k) as u64;
                        batch.push_rdma(
                            WrId(p / 32),
                            false,
                            k + 1 == n || k % 32 == 31,
                            0x10_0000 + p * 4096,
                            4096,
                            7,
                            0x90_0000 + p * 8192,
                            9,
                        );
                    }
                    qp.post(&mut batch);
                    i += n;
                }
            });
        });
    }
    g.finish();
}

criterion_group!(benches, post_pages);
criterion_main!(benches);
