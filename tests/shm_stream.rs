//! Transfers larger than the last-level cache, which the shm copy core moves
//! with streaming (non-temporal) stores: every byte lands where it belongs,
//! at page lengths and offsets that are not multiples of the 64-byte line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferHandle, TransferStatus};
use kvwire::transport::{Op, TransportConfig, TransportKind};

/// The largest CPU cache sysfs reports (the copy core's threshold), else 32 MiB.
fn largest_cache_bytes() -> u64 {
    (0..8)
        .filter_map(|i| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok())
        .filter_map(|s| {
            let s = s.trim();
            let (n, mul) = match s.strip_suffix('K') {
                Some(n) => (n, 1u64 << 10),
                None => (s.strip_suffix('M').unwrap_or(s), if s.ends_with('M') { 1 << 20 } else { 1 }),
            };
            n.parse::<u64>().ok().map(|n| n * mul)
        })
        .max()
        .unwrap_or(32 << 20)
}

fn wait(e: &mut TransferEngine, h: TransferHandle) -> TransferStatus {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = e.status(h).unwrap();
        if s != TransferStatus::InProgress || Instant::now() > deadline {
            return s;
        }
        std::thread::yield_now();
    }
}

#[test]
fn transfers_past_the_llc_move_every_byte_at_odd_offsets() {
    // Not a multiple of 64: remote pages start at every offset within a line.
    let page: u64 = 64 * 1024 - 24;
    // Twice the threshold, so the transfer streams; capped for machines with huge caches.
    let total = (2 * largest_cache_bytes()).clamp(64 << 20, 512 << 20);
    let pages = total / page;
    let cfg = TransportConfig::default();
    let mut target = TransferEngine::new("target", TransportKind::Shm, &cfg).unwrap();
    let mut init = TransferEngine::new("initiator", TransportKind::Shm, &cfg).unwrap();
    let dst = Arc::new(HostBuffer::new((pages * page) as usize).unwrap());
    let src = Arc::new(HostBuffer::new((pages * page) as usize + 8).unwrap());
    target.register(dst.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    // Every byte a function of its offset (all four bytes of it), so a page
    // landing in the wrong slot or shifted by any amount fails the check.
    src.fill_with(0, src.len(), |i| (i ^ (i >> 8) ^ (i >> 16) ^ (i >> 24) ^ 0x5a) as u8);
    // Local pages start 8 bytes in (misaligned source too); page i goes to page perm(i).
    let perm: Vec<u64> = (0..pages).map(|i| (i * 7 + 3) % pages).collect();
    assert!(!pages.is_multiple_of(7), "perm must be a permutation");
    let local: Vec<Desc> = (0..pages).map(|i| Desc::new(src.addr() + 8 + i * page, page)).collect();
    let remote: Vec<Desc> = perm.iter().map(|&p| Desc::new(dst.addr() + p * page, page)).collect();

    let h = init.post(Op::Write, &local, "target", &remote, None).unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    let (s, d) = (src.to_vec(..), dst.to_vec(..));
    for (i, &p) in perm.iter().enumerate() {
        let (from, to) = (8 + i * page as usize, (p * page) as usize);
        assert!(d[to..to + page as usize] == s[from..from + page as usize], "WRITE: page {i} → {p}");
    }

    // READ back into the zeroed source buffer, undoing the permutation.
    src.fill_with(0, src.len(), |_| 0);
    let h = init.post(Op::Read, &local, "target", &remote, None).unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    let s = src.to_vec(..);
    for (i, &p) in perm.iter().enumerate() {
        let (to, from) = (8 + i * page as usize, (p * page) as usize);
        assert!(s[to..to + page as usize] == d[from..from + page as usize], "READ: page {p} → {i}");
    }
    assert!(s[..8].iter().all(|&b| b == 0), "READ wrote before the first page");
}
