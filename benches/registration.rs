//! Registration at scale (issue 29 item 2); a benchmark, not a test.
//!
//! - vLLM's shape: 1,265 tensors carved out of 4 allocations of 64 MiB (per
//!   layer K and V views), registered as one list (`register_batch`, what
//!   NIXL's `register_memory(list)` becomes) and one call per tensor: wall
//!   time and (registrations, memory regions) on shm, tcp, and the verbs
//!   registration table alone (`verbs-table`: its own work, over token MRs
//!   that cost nothing, as on the simulated NIC, which has no `ibv_reg_mr`
//!   cost) with coalescing on and off, and on a real verbs device when
//!   `KVWIRE_BENCH_DEVICE` names one (rxe0 in the Soft-RoCE guest).
//! - 1,000 register/deregister cycles of one 1 MiB buffer beside those
//!   1,265 registrations: median µs per cycle over the first and last 100.
//!
//! `cargo bench --bench registration` prints one line per case.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::TransferEngine;
use kvwire::transport::verbs::regions_bench::TableBench;
use kvwire::transport::{MemoryBacking, TransportConfig, TransportKind, View};

const TENSORS: usize = 1265;
const ALLOCS: usize = 4;
const ALLOC_BYTES: usize = 64 << 20;
const CYCLES: usize = 1000;

/// The 1,265 views (K and V per layer, in layer order across the buffers).
fn tensors(bufs: &[Arc<HostBuffer>]) -> Vec<Arc<dyn MemoryBacking>> {
    let per = TENSORS.div_ceil(ALLOCS);
    let step = (ALLOC_BYTES / per) as u64 & !4095;
    let mut out = Vec::with_capacity(TENSORS);
    for b in bufs {
        for i in 0..per as u64 {
            if out.len() == TENSORS {
                break;
            }
            out.push(Arc::new(View::new(b.clone(), i * step, step).unwrap()) as Arc<dyn MemoryBacking>);
        }
    }
    out
}

fn cycles(mut once: impl FnMut()) -> (f64, f64) {
    let mut t = Vec::with_capacity(CYCLES);
    for _ in 0..CYCLES {
        let t0 = Instant::now();
        once();
        t.push(t0.elapsed());
    }
    // Medians: robust to a cycle preempted on a shared machine.
    let median = |s: &[Duration]| {
        let mut v = s.to_vec();
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e6
    };
    (median(&t[..100]), median(&t[CYCLES - 100..]))
}

fn report(case: &str, how: &str, took: Duration, counts: (usize, usize), cyc: (f64, f64)) {
    println!(
        "{case:<18} {how:<10} register_1265_ms={:>8.3} registrations={} memory_regions={} \
         cycle_us_first100={:.2} cycle_us_last100={:.2}",
        took.as_secs_f64() * 1e3,
        counts.0,
        counts.1,
        cyc.0,
        cyc.1
    );
}

fn engine_case(
    case: &str,
    kind: TransportKind,
    cfg: &TransportConfig,
    bufs: &[Arc<HostBuffer>],
    one: &Arc<HostBuffer>,
) {
    for list in [true, false] {
        let mut e = match TransferEngine::new(&format!("bench-{case}-{list}"), kind, cfg) {
            Ok(e) => e,
            Err(err) => {
                println!("{case:<18} skipped: {err}");
                return;
            }
        };
        let parts = tensors(bufs);
        let t0 = Instant::now();
        if list {
            e.register_batch(parts).unwrap();
        } else {
            for p in parts {
                e.register(p).unwrap();
            }
        }
        let took = t0.elapsed();
        let counts = e.region_counts();
        let cyc = cycles(|| {
            let h = e.register(one.clone()).unwrap();
            e.deregister(h).unwrap();
        });
        report(case, if list { "list" } else { "per-tensor" }, took, counts, cyc);
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("registration: bench");
        return;
    }
    let bufs: Vec<Arc<HostBuffer>> = (0..ALLOCS).map(|_| Arc::new(HostBuffer::new(ALLOC_BYTES).unwrap())).collect();
    let one = Arc::new(HostBuffer::new(1 << 20).unwrap());
    let cfg = TransportConfig::default();
    engine_case("shm", TransportKind::Shm, &cfg, &bufs, &one);
    engine_case("tcp", TransportKind::Tcp, &cfg, &bufs, &one);
    for coalesce in [true, false] {
        for list in [true, false] {
            let mut t = TableBench::new(coalesce);
            let parts = tensors(&bufs);
            let took = if list {
                t.register_batch(parts).unwrap()
            } else {
                parts.into_iter().map(|p| t.register_batch(vec![p]).unwrap()).sum()
            };
            let counts = t.counts();
            let one: Arc<dyn MemoryBacking> = one.clone();
            let cyc = cycles(|| {
                t.register_batch(vec![one.clone()]).unwrap();
                t.deregister_last(1);
            });
            let case = if coalesce { "verbs-table" } else { "verbs-table coalesce=0" };
            report(case, if list { "list" } else { "per-tensor" }, took, counts, cyc);
        }
    }
    if let Ok(dev) = std::env::var("KVWIRE_BENCH_DEVICE") {
        for coalesce in ["1", "0"] {
            let mut c = TransportConfig::default();
            c.options.push(("device".into(), dev.clone()));
            c.options.push(("coalesce".into(), coalesce.into()));
            if let Ok(i) = std::env::var("SOFTROCE_GID_IDX") {
                c.options.push(("gid_index".into(), i));
            }
            engine_case(&format!("verbs {dev} coalesce={coalesce}"), TransportKind::Verbs, &c, &bufs, &one);
        }
    }
}
