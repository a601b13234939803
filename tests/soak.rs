//! Long-run soak, bounded for CI: connect/disconnect, register/deregister
//! and post/release cycles on each software backend (shm, tcp), with the
//! process's open fds, threads, memory mappings (`/proc/self/maps`) and
//! resident memory asserted flat (within a tolerance) between a warmed-up
//! baseline and the end. Counts are fixed (no timed assertions).
//! `KVWIRE_SOAK_CYCLES=N` runs longer locally.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferStatus};
use kvwire::transport::{Op, TransportConfig, TransportKind};

/// The two backends share the process: run them one at a time so each
/// one's counts are its own.
static SERIAL: Mutex<()> = Mutex::new(());

#[derive(Debug, Clone, Copy)]
struct Usage {
    fds: usize,
    threads: usize,
    maps: usize,
    rss_kib: usize,
}

fn usage() -> Usage {
    let count = |p: &str| std::fs::read_dir(p).map(|d| d.count()).unwrap_or(0);
    let maps = std::fs::read_to_string("/proc/self/maps").map(|s| s.lines().count()).unwrap_or(0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    Usage { fds: count("/proc/self/fd"), threads: count("/proc/self/task"), maps, rss_kib }
}

fn cycles() -> usize {
    std::env::var("KVWIRE_SOAK_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(600)
}

fn wait_done(e: &mut TransferEngine, h: kvwire::engine::TransferHandle) {
    let t0 = Instant::now();
    loop {
        match e.status(h).unwrap() {
            TransferStatus::InProgress if t0.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_micros(100))
            }
            s => {
                assert_eq!(s, TransferStatus::Done);
                return;
            }
        }
    }
}

/// One cycle on a long-lived initiator: register a buffer, connect, post a
/// WRITE with a notification and a READ, release them, disconnect and
/// deregister; the target registers and deregisters a scratch region.
/// The initiator is replaced during warm-up only, so anything a
/// connect/disconnect cycle leaks until the transport drops shows.
fn cycle(kind: TransportKind, init: &mut TransferEngine, target: &mut TransferEngine, dst: &Arc<HostBuffer>, i: usize) {
    if i.is_multiple_of(10) && i < 20 {
        *init = TransferEngine::new(&format!("soak-init-{i}"), kind, &config()).unwrap();
    }
    let src = Arc::new(HostBuffer::new(1 << 18).unwrap());
    src.fill_with(0, src.len(), |k| (k + i) as u8);
    let reg = init.register(src.clone()).unwrap();
    let scratch = target.register(Arc::new(HostBuffer::new(1 << 16).unwrap())).unwrap();
    init.connect(&target.metadata()).unwrap();
    let pages: Vec<Desc> = (0..16).map(|p| Desc::new(src.addr() + p * 16384, 16384)).collect();
    let remote: Vec<Desc> = (0..16).map(|p| Desc::new(dst.addr() + ((p * 5) % 16) * 16384, 16384)).collect();
    let h = init.post(Op::Write, &pages, "soak-target", &remote, Some(format!("w{i}").into_bytes())).unwrap();
    wait_done(init, h);
    init.release(h).unwrap();
    let h = init.post(Op::Read, &pages, "soak-target", &remote, None).unwrap();
    wait_done(init, h);
    init.release(h).unwrap();
    let _ = target.get_notifs();
    target.deregister(scratch).unwrap();
    init.disconnect("soak-target").unwrap();
    init.deregister(reg).unwrap();
}

fn config() -> TransportConfig {
    TransportConfig { peer_timeout: Duration::from_secs(5), ..Default::default() }
}

fn soak(kind: TransportKind) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut target = TransferEngine::new("soak-target", kind, &config()).unwrap();
    let mut init = TransferEngine::new("soak-init", kind, &config()).unwrap();
    let dst = Arc::new(HostBuffer::new(1 << 18).unwrap());
    target.register(dst.clone()).unwrap();
    for i in 0..20 {
        cycle(kind, &mut init, &mut target, &dst, i);
    }
    // Let threads of the warm-up cycles finish exiting.
    std::thread::sleep(Duration::from_millis(300));
    let before = usage();
    let n = cycles();
    for i in 20..20 + n {
        cycle(kind, &mut init, &mut target, &dst, i);
    }
    // Engines created, connected and dropped (the transport's own threads
    // and sockets must go with it).
    for i in 0..n / 4 {
        let mut e = TransferEngine::new(&format!("soak-short-{i}"), kind, &config()).unwrap();
        e.connect(&target.metadata()).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    let after = usage();
    eprintln!("{kind} soak, {n} cycles: {before:?} -> {after:?}");
    assert!(after.fds <= before.fds + 4, "{kind}: fds grew {} -> {} over {n} cycles", before.fds, after.fds);
    assert!(after.threads <= before.threads + 2, "{kind}: threads grew {} -> {}", before.threads, after.threads);
    assert!(after.maps <= before.maps + 16, "{kind}: mappings grew {} -> {}", before.maps, after.maps);
    assert!(
        after.rss_kib <= before.rss_kib + 32 * 1024,
        "{kind}: RSS grew {} -> {} KiB",
        before.rss_kib,
        after.rss_kib
    );
}

#[test]
fn tcp_connect_register_post_cycles_leave_usage_flat() {
    soak(TransportKind::Tcp);
}

#[test]
fn shm_connect_register_post_cycles_leave_usage_flat() {
    soak(TransportKind::Shm);
}
