//! Descriptor-count scale on verbs (issue 29): 112,000 descriptors (vLLM's
//! shape for large models) prepared and posted as one transfer through the
//! verbs engine on the simulated NIC (`SimNic`, no device), with:
//! - caller CPU per descriptor (`CLOCK_THREAD_CPUTIME_ID`) and caller wall
//!   time of the post: the engine's descriptor validation and coalescing
//!   (`build_segments`) plus the hand-off to the progress thread (what
//!   `TransferEngine::post` costs the caller on verbs);
//! - wall time until the simulated NIC completed every WR (the simulator's
//!   speed, not a device's);
//! - the fabric's doorbell count: `post_send` calls, WRs, and the longest
//!   chain (≤ 64 WRs per doorbell, `post_list`).
//!
//! `cargo bench --bench verbs_scale` (5 rounds of 112,000; `KVWIRE_SCALE_DESCS`
//! and `KVWIRE_SCALE_ROUNDS` override); under `cargo test` it runs one
//! round of 4,096 as a check. Targets (issue 29): ≤ 50 ns/desc, ≤ 5 ms.

use std::time::{Duration, Instant};

use kvwire::engine::Desc;
use kvwire::engine::desc::{LocalSpan, build_segments};
use kvwire::transport::verbs::sim_scale::{REGION_BYTES, ScaleRig};
use kvwire::transport::{LocalKey, MemoryKind, RemoteKey, RemoteRegion};

const PAGE: u64 = 4096;

fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32))
        .unwrap_or_default()
}

fn env(k: &str, default: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let n = env("KVWIRE_SCALE_DESCS", if bench { 112_000 } else { 4096 });
    let rounds = env("KVWIRE_SCALE_ROUNDS", if bench { 5 } else { 1 }).max(1);
    let mut rig = ScaleRig::default();
    let pages = REGION_BYTES / PAGE;
    let spans = [LocalSpan { addr: rig.src.0, end: rig.src.0 + REGION_BYTES, lkey: LocalKey(rig.src.1) }];
    let regions = [RemoteRegion {
        addr: rig.dst.0,
        len_bytes: REGION_BYTES,
        rkey: RemoteKey(rig.dst.1),
        kind: MemoryKind::Dram,
        device_id: 0,
    }];
    // The prepared lists (NIXL's prep_xfer_dlist), made once: 4 KiB pages
    // wrapping over the 1 MiB regions, destinations scattered by an odd
    // stride so that none coalesce.
    let t = Instant::now();
    let local: Vec<Desc> = (0..n).map(|i| Desc::new(rig.src.0 + (i % pages) * PAGE, PAGE)).collect();
    let remote: Vec<Desc> = (0..n).map(|i| Desc::new(rig.dst.0 + (i * 7919 % pages) * PAGE, PAGE)).collect();
    let prep = t.elapsed();
    println!("verbs_scale: {n} descriptors of 4 KiB, one WRITE per round, {rounds} rounds, simulated NIC");
    println!("  prepared lists: {:.2} ms (once)", prep.as_secs_f64() * 1e3);
    println!(
        "  {:>5} {:>16} {:>15} {:>14} {:>10} {:>9} {:>11}",
        "round", "caller CPU ns/desc", "caller wall ms", "done wall ms", "doorbells", "WRs", "max WRs/db"
    );
    let (mut cpu_ns, mut wall_ms) = (Vec::new(), Vec::new());
    let mut before = rig.doorbells();
    for r in 0..rounds {
        let mut segs = Vec::with_capacity(n as usize);
        let (c0, t0) = (thread_cpu(), Instant::now());
        build_segments(&local, &remote, &spans, &regions, "target", &mut segs).expect("valid descriptors");
        assert_eq!(segs.len() as u64, n, "descriptors coalesced: the bench wants one WR each");
        rig.post(segs);
        let (cpu, wall) = (thread_cpu() - c0, t0.elapsed());
        let (done, c) = rig.done_after(t0, Duration::from_secs(300)).expect("the transfer completed within 300 s");
        assert_eq!(c.result, Ok(()), "the simulated transfer failed");
        let now = rig.doorbells();
        let (db, wrs) = (now.post_sends - before.post_sends, now.wrs - before.wrs);
        // every descriptor is one WR, chained at most 64 to a doorbell
        assert_eq!(wrs, n, "WRs posted");
        assert!(now.max_chain <= 64 && db >= n.div_ceil(64), "{now:?}");
        before = now;
        let per = cpu.as_secs_f64() * 1e9 / n as f64;
        cpu_ns.push(per);
        wall_ms.push(wall.as_secs_f64() * 1e3);
        println!(
            "  {:>5} {:>18.1} {:>15.3} {:>14.1} {:>10} {:>9} {:>11}",
            r + 1,
            per,
            wall.as_secs_f64() * 1e3,
            done.as_secs_f64() * 1e3,
            db,
            wrs,
            now.max_chain
        );
    }
    println!(
        "  median: caller CPU {:.1} ns/desc (target <= 50), caller wall {:.3} ms (target <= 5)",
        median(cpu_ns),
        median(wall_ms)
    );
}
