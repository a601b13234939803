//! Edge cases of the verbs transport on real RDMA devices (Soft-RoCE in CI):
//! odd option values, tiny queues, many notifications, release while in
//! flight, forged bounds, a notification whose QP failed, a peer that is gone.
//!
//! Like `verbs_transport.rs`, each test is `#[ignore]`d as needing a device
//! (a plain `cargo test` reports them ignored); `scripts/softroce-tests.sh`
//! runs them with `--include-ignored`. Each also has a simulated-NIC
//! counterpart in `src/transport/verbs/tests.rs` that runs everywhere.

mod verbs_util;

use verbs_util::{WAIT, config, wait};

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferStatus};
use kvwire::transport::{
    self, Completion, FailureKind, FailureSource, MemoryBacking, MemoryDesc, MemoryKind, Notification, Op, PostRequest,
    RawMemory, RemoteAccessKind, RemoteKey, RemoteRegion, Segment, TransportKind, XferId,
};

fn engine(name: &str, device: &str, extra: &[(&str, &str)]) -> TransferEngine {
    TransferEngine::new(name, TransportKind::Verbs, &config(device, extra)).expect("verbs engine")
}

fn wait_completion(
    t: &mut Box<dyn transport::Transport>,
    out: &mut Vec<Completion>,
    x: XferId,
    within: Duration,
) -> Option<Completion> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        t.poll(out);
        if let Some(c) = out.iter().find(|c| c.xfer == x) {
            return Some(c.clone());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_invalid_option_values_are_errors_or_clamped_never_panics() {
    let (_, idev) = need_devices!();
    for (k, v, must_fail) in [
        ("max_send_wr", "0", false),
        ("max_send_wr", "1", false),
        ("post_list", "0", false),
        ("signal_every", "0", false),
        ("qps_per_peer", "0", false),
        ("post_bytes", "abc", true),
        ("max_send_wr", "-1", true),
        ("retry_cnt", "8", true),
        ("timeout", "32", true),
        ("progress_timeout_ms", "0", true),
        ("no_such_option", "1", true),
    ] {
        let cfg = config(&idev, &[(k, v)]);
        let r = std::panic::catch_unwind(|| TransferEngine::new("opts", TransportKind::Verbs, &cfg).map(drop));
        let r = r.unwrap_or_else(|_| panic!("{k}={v} panicked"));
        assert_eq!(r.is_err(), must_fail, "{k}={v}: {r:?}");
    }
}

/// Descriptors of mixed sizes around the 64 KiB batch limit, 8 bytes apart
/// (so that nothing coalesces): `(offset, len)`.
fn mixed_descs(n: usize) -> (Vec<(u64, u64)>, u64) {
    let sizes = [4096u64, 61_440, 65_536, 65_537, 1, 131_072, 4095, 65_535];
    let mut off = 0;
    let v = (0..n)
        .map(|i| {
            let d = (off, sizes[i % sizes.len()]);
            off += d.1 + 8;
            d
        })
        .collect();
    (v, off)
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_tiny_queue_odd_batches_three_qps_move_every_byte() {
    let (tdev, idev) = need_devices!();
    let opts = [("max_send_wr", "5"), ("post_list", "3"), ("signal_every", "2"), ("qps_per_peer", "3")];
    let mut target = engine("t-odd", &tdev, &opts);
    let mut init = engine("i-odd", &idev, &opts);
    let (descs, total) = mixed_descs(200);
    let dst = Arc::new(HostBuffer::new(total as usize).unwrap());
    let src = Arc::new(HostBuffer::new(total as usize).unwrap());
    src.fill_with(0, total as usize, |i| (i * 31 + i / 4096) as u8);
    target.register(dst.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    let l: Vec<Desc> = descs.iter().map(|&(o, n)| Desc::new(src.addr() + o, n)).collect();
    let r: Vec<Desc> = descs.iter().map(|&(o, n)| Desc::new(dst.addr() + o, n)).collect();
    let h = init.post(Op::Write, &l, "t-odd", &r, Some(b"odd".to_vec())).unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    for &(o, n) in &descs {
        let (o, n) = (o as usize, n as usize);
        assert_eq!(dst.to_vec(o..o + n), src.to_vec(o..o + n), "WRITE at {o}+{n}");
    }
    // READ back over the same shapes into a cleared source.
    src.fill_with(0, total as usize, |_| 0);
    let h = init.post(Op::Read, &l, "t-odd", &r, None).unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    for &(o, n) in &descs {
        let (o, n) = (o as usize, n as usize);
        assert_eq!(src.to_vec(o..o + n), dst.to_vec(o..o + n), "READ at {o}+{n}");
    }
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_many_transfers_with_notifications_to_one_peer() {
    let (tdev, idev) = need_devices!();
    let mut target = engine("t-many", &tdev, &[]);
    let mut init = engine("i-many", &idev, &[("qps_per_peer", "2")]);
    let (n, page) = (300usize, 4096usize);
    let dst = Arc::new(HostBuffer::new(n * page).unwrap());
    let src = Arc::new(HostBuffer::new(n * page).unwrap());
    src.fill_with(0, n * page, |i| (i / page) as u8 ^ 0x5a);
    target.register(dst.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    let mut handles = Vec::new();
    let mut refused = 0;
    for i in 0..n {
        let off = (i * page) as u64;
        let l = [Desc::new(src.addr() + off, page as u64)];
        let r = [Desc::new(dst.addr() + off, page as u64)];
        match init.post(Op::Write, &l, "t-many", &r, Some(format!("m{i}").into_bytes())) {
            Ok(h) => handles.push((i, h)),
            Err(e) => {
                assert!(e.to_string().contains("notifications in flight"), "{e}");
                refused += 1;
            }
        }
    }
    eprintln!("{} posted, {refused} refused (notification slots)", handles.len());
    for &(i, h) in &handles {
        assert_eq!(wait(&mut init, h), TransferStatus::Done, "transfer {i}");
        init.release(h).unwrap();
    }
    let mut got = Vec::new();
    let t0 = Instant::now();
    while got.len() < handles.len() && t0.elapsed() < WAIT {
        got.extend(target.get_notifs().remove("i-many").unwrap_or_default());
        std::thread::sleep(Duration::from_millis(1));
    }
    got.sort();
    let mut want: Vec<Vec<u8>> = handles.iter().map(|(i, _)| format!("m{i}").into_bytes()).collect();
    want.sort();
    assert_eq!(got, want);
    for &(i, _) in &handles {
        let o = i * page;
        assert_eq!(dst.to_vec(o..o + page), src.to_vec(o..o + page), "page {i}");
    }
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_release_in_flight_read_then_nothing_lands_and_deregister_works() {
    let (tdev, idev) = need_devices!();
    let mut target = engine("t-rel", &tdev, &[]);
    // A short send queue keeps post() quick (the rest waits in software),
    // so the transfer is surely still in flight when released, with WRs both
    // posted and queued.
    let mut init = engine("i-rel", &idev, &[("qps_per_peer", "2"), ("max_send_wr", "64")]);
    let (pages, page) = (4096u64, 8u64 << 10);
    let dst = Arc::new(HostBuffer::new((pages * page) as usize).unwrap());
    let src = Arc::new(HostBuffer::new((pages * page) as usize).unwrap());
    dst.fill_with(0, (pages * page) as usize, |_| 0xee);
    target.register(dst.clone()).unwrap();
    let reg = init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    let l: Vec<Desc> = (0..pages).map(|i| Desc::new(src.addr() + i * page, page)).collect();
    let r: Vec<Desc> = (0..pages).map(|i| Desc::new(dst.addr() + (pages - 1 - i) * page, page)).collect();
    let h = init.post(Op::Read, &l, "t-rel", &r, Some(b"no".to_vec())).unwrap();
    assert_eq!(init.status(h).unwrap(), TransferStatus::InProgress, "finished before the release");
    let t0 = Instant::now();
    init.release(h).unwrap();
    eprintln!("release of a 32 MiB READ in flight took {:?}", t0.elapsed());
    // Nothing may land after release returned.
    src.fill_with(0, (pages * page) as usize, |_| 0);
    std::thread::sleep(Duration::from_millis(500));
    assert!(src.to_vec(..).iter().all(|&b| b == 0), "the NIC wrote after release returned");
    init.deregister(reg).unwrap();
    assert!(target.get_notifs().is_empty(), "notification of a released transfer");
}

/// A region of the first `len` bytes of `buf` (the rest is a canary).
fn prefix(buf: &Arc<HostBuffer>, len: u64) -> Arc<RawMemory> {
    let d = MemoryDesc { addr: buf.addr(), len_bytes: len, kind: MemoryKind::Dram, device_id: 0 };
    // SAFETY: the range lies in `buf`, which the test keeps alive (and
    // unfreed) past both engines.
    Arc::new(unsafe { RawMemory::new(d) })
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_forged_bounds_and_rkeys_fail_without_writing() {
    let (tdev, idev) = need_devices!();
    let mut target = engine("t-forge", &tdev, &[]);
    let mut init = engine("i-forge", &idev, &[]);
    let buf = Arc::new(HostBuffer::new(1 << 17).unwrap());
    target.register(prefix(&buf, 1 << 16)).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 17).unwrap());
    src.fill_with(0, 1 << 17, |_| 0xab);
    init.register(src.clone()).unwrap();
    let mut meta = target.metadata();
    meta.regions[0].len_bytes = 1 << 17; // claims the canary half too
    init.connect(&meta).unwrap();
    let h = init
        .post(Op::Write, &[Desc::new(src.addr(), 8192)], "t-forge", &[Desc::new(buf.addr() + 65536 - 4096, 8192)], None)
        .unwrap();
    let s = wait(&mut init, h);
    assert!(
        matches!(&s, TransferStatus::Failed(w) if w.kind == FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds)
            && matches!(w.source, FailureSource::WorkCompletion { status: 10, .. })),
        "{s:?}"
    );
    init.release(h).unwrap();
    assert!(buf.to_vec(65536..).iter().all(|&b| b == 0), "wrote past the registered region");
    init.disconnect("t-forge").unwrap();
    let mut meta = target.metadata();
    meta.regions[0].rkey = RemoteKey(meta.regions[0].rkey.0.wrapping_add(0x100));
    init.connect(&meta).unwrap();
    let h =
        init.post(Op::Write, &[Desc::new(src.addr(), 4096)], "t-forge", &[Desc::new(buf.addr(), 4096)], None).unwrap();
    let s = wait(&mut init, h);
    assert!(
        matches!(&s, TransferStatus::Failed(w) if w.kind == FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds)
            && matches!(w.source, FailureSource::WorkCompletion { status: 10, .. })),
        "{s:?}"
    );
    assert!(buf.to_vec(..).iter().all(|&b| b == 0), "wrote through a forged rkey");
}

/// Two QPs: transfer A's first 64 segments go to QP 0, the next 64 (larger)
/// to QP 1, and its notification waits for both. B (one segment, QP 0, a
/// stale rkey) puts QP 0 in error after A's part there completed; A's
/// notification must then not be left queued forever on the failed QP.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_deferred_notification_on_a_failed_qp_completes() {
    let (tdev, idev) = need_devices!();
    let mut target = transport::create(TransportKind::Verbs, "t-defer", &config(&tdev, &[])).unwrap();
    let cfg = config(&idev, &[("qps_per_peer", "2")]);
    let mut init = transport::create(TransportKind::Verbs, "i-defer", &cfg).unwrap();
    let (small, big) = (64u64, 1u64 << 20);
    let len = 64 * (small + big);
    let dst = std::sync::Arc::new(HostBuffer::new(len as usize).unwrap());
    let gone = std::sync::Arc::new(HostBuffer::new(4096).unwrap());
    let src = std::sync::Arc::new(HostBuffer::new(len as usize).unwrap());
    src.fill_with(0, len as usize, |i| i as u8);
    let treg = target.register(dst.clone()).unwrap();
    let stale = target.register(gone.clone()).unwrap();
    target.deregister(stale.lkey).unwrap();
    let ireg = init.register(src.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: treg.rkey, kind: d.kind, device_id: 0 };
    // Metadata taken before `gone` was deregistered: its stale rkey passes
    // the initiator's key check and reaches the HCA, which refuses it.
    let old = RemoteRegion { addr: gone.addr(), len_bytes: 4096, rkey: stale.rkey, ..region };
    let peer = init.connect("t-defer", &target.connection_info(), &[region, old]).unwrap();
    let seg = |off: u64, n: u64| Segment {
        local_addr: src.addr() + off,
        remote_addr: dst.addr() + off,
        len_bytes: n,
        lkey: ireg.lkey,
        rkey: treg.rkey,
    };
    let mut segs: Vec<Segment> = (0..64).map(|i| seg(i * small, small)).collect();
    segs.extend((0..64).map(|i| seg(64 * small + i * big, big)));
    let a = PostRequest { xfer: XferId(1), op: Op::Read, peer, segments: segs, notification: Some(b"A".to_vec()) };
    let mut done = Vec::new();
    init.post(a).unwrap();
    let bad = Segment { remote_addr: gone.addr(), rkey: stale.rkey, ..seg(0, 64) };
    init.post(PostRequest { xfer: XferId(2), op: Op::Read, peer, segments: vec![bad], notification: None }).unwrap();
    let t0 = Instant::now();
    let b = wait_completion(&mut init, &mut done, XferId(2), WAIT).expect("B completes");
    eprintln!("B: {:?} after {:?}; A done: {}", b.result, t0.elapsed(), done.iter().any(|c| c.xfer == XferId(1)));
    assert!(b.result.is_err(), "{b:?}");
    let a = wait_completion(&mut init, &mut done, XferId(1), Duration::from_secs(20)).expect("A never completed");
    eprintln!("A: {:?}", a.result);
    if a.result.is_ok() {
        let mut n: Vec<Notification> = Vec::new();
        let t0 = Instant::now();
        while n.is_empty() && t0.elapsed() < WAIT {
            target.take_notifications(&mut n);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(n.len(), 1, "A succeeded, so its notification must arrive");
    }
    // The peer recovers.
    init.post(PostRequest { xfer: XferId(3), op: Op::Write, peer, segments: vec![seg(0, 4096)], notification: None })
        .unwrap();
    assert_eq!(wait_completion(&mut init, &mut done, XferId(3), WAIT).expect("C completes").result, Ok(()));
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_posts_to_a_peer_that_cannot_be_reconnected_fail_never_panic() {
    let (tdev, idev) = need_devices!();
    let mut target = engine("t-gone", &tdev, &[]);
    let mut init = engine("i-gone", &idev, &[("timeout", "8"), ("retry_cnt", "1")]);
    let dst = Arc::new(HostBuffer::new(1 << 16).unwrap());
    let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
    target.register(dst.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    drop(target);
    let l = [Desc::new(src.addr(), 4096)];
    let r = [Desc::new(dst.addr(), 4096)];
    for i in 0..4 {
        match init.post(Op::Write, &l, "t-gone", &r, Some(b"x".to_vec())) {
            Err(e) => eprintln!("post {i}: {e}"),
            Ok(h) => {
                let s = wait(&mut init, h);
                eprintln!("post {i}: {s:?}");
                assert!(matches!(s, TransferStatus::Failed(_)), "{s:?}");
                init.release(h).unwrap();
            }
        }
    }
}

/// With a send queue of 4, B is a failing READ and three large ones, and
/// transfer Y waits in the software queue behind them: when B's first WR
/// fails, Y must fail too, not wait forever.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_transfer_queued_behind_a_failed_wr_is_reported() {
    let (tdev, idev) = need_devices!();
    let mut target = transport::create(TransportKind::Verbs, "t-behind", &config(&tdev, &[])).unwrap();
    let cfg = config(&idev, &[("max_send_wr", "4"), ("signal_every", "1")]);
    let mut init = transport::create(TransportKind::Verbs, "i-behind", &cfg).unwrap();
    let big = 4u64 << 20;
    let dst = std::sync::Arc::new(HostBuffer::new(4 * big as usize).unwrap());
    let src = std::sync::Arc::new(HostBuffer::new(4 * big as usize).unwrap());
    let treg = target.register(dst.clone()).unwrap();
    let ireg = init.register(src.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: treg.rkey, kind: d.kind, device_id: 0 };
    let peer = init.connect("t-behind", &target.connection_info(), &[region]).unwrap();
    let seg = |i: u64, len_bytes: u64, rkey: RemoteKey| Segment {
        local_addr: src.addr() + i * big,
        remote_addr: dst.addr() + i * big,
        len_bytes,
        lkey: ireg.lkey,
        rkey,
    };
    let bad = RemoteKey(treg.rkey.0 ^ 0x5a5a00);
    let mut b = vec![seg(3, 4096, bad)];
    b.extend((0..3).map(|i| seg(i, big, treg.rkey)));
    init.post(PostRequest { xfer: XferId(1), op: Op::Read, peer, segments: b, notification: None }).unwrap();
    let y = vec![seg(3, 4096, treg.rkey)];
    init.post(PostRequest { xfer: XferId(2), op: Op::Read, peer, segments: y, notification: Some(b"y".to_vec()) })
        .unwrap();
    let mut done = Vec::new();
    let b = wait_completion(&mut init, &mut done, XferId(1), WAIT).expect("B completes");
    eprintln!("B: {:?}", b.result);
    assert!(b.result.is_err(), "{b:?}");
    let y = wait_completion(&mut init, &mut done, XferId(2), Duration::from_secs(10)).expect("Y never completed");
    eprintln!("Y: {:?}", y.result);
}

/// Far more signalled WRs in flight (4 QPs × 256, every WR signalled) than a
/// 128-entry completion queue holds: the transport must hold work back
/// instead of overrunning the CQ, and move every byte both ways.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_small_completion_queue_holds_work_back_instead_of_overrunning() {
    let (tdev, idev) = need_devices!();
    let mut target = engine("t-cq", &tdev, &[("qps_per_peer", "4")]);
    let opts = [("cq_size", "128"), ("max_send_wr", "256"), ("signal_every", "1"), ("qps_per_peer", "4")];
    let mut init = engine("i-cq", &idev, &opts);
    const PAGES: u64 = 2000;
    const PAGE: u64 = 1024;
    let dst = Arc::new(HostBuffer::new((PAGES * PAGE * 2) as usize).unwrap());
    let src = Arc::new(HostBuffer::new((PAGES * PAGE) as usize).unwrap());
    src.fill_with(0, (PAGES * PAGE) as usize, |i| (i * 7 + i / 1024) as u8);
    target.register(dst.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    // Every other remote page, so that nothing coalesces.
    let l: Vec<Desc> = (0..PAGES).map(|i| Desc::new(src.addr() + i * PAGE, PAGE)).collect();
    let r: Vec<Desc> = (0..PAGES).map(|i| Desc::new(dst.addr() + 2 * i * PAGE, PAGE)).collect();
    let h = init.post(Op::Write, &l, "t-cq", &r, Some(b"cq".to_vec())).unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    for i in 0..PAGES as usize {
        let (s, d) = (i * PAGE as usize, 2 * i * PAGE as usize);
        assert_eq!(dst.to_vec(d..d + PAGE as usize), src.to_vec(s..s + PAGE as usize), "page {i}");
    }
    src.fill_with(0, (PAGES * PAGE) as usize, |_| 0);
    let h = init.post(Op::Read, &l, "t-cq", &r, None).unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    for i in 0..PAGES as usize {
        let (s, d) = (i * PAGE as usize, 2 * i * PAGE as usize);
        assert_eq!(src.to_vec(s..s + PAGE as usize), dst.to_vec(d..d + PAGE as usize), "READ page {i}");
    }
}

/// A target whose completion queue cannot take the receives of another
/// initiator's QPs refuses the connection with a clear reason.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_target_refuses_connections_its_completion_queue_cannot_take() {
    let (tdev, idev) = need_devices!();
    let target = engine("t-full", &tdev, &[("cq_size", "128")]);
    let mut init = engine("i-full", &idev, &[("qps_per_peer", "2")]);
    let err = init.connect(&target.metadata()).expect_err("2 QPs x 64 receives exceed half of 128 CQEs");
    assert!(err.to_string().contains("completion queue full"), "{err}");
}

/// Receives a target keeps posted for its initiators hold at most half of
/// its completion queue: a connection beyond that is refused, and the
/// target's own sends are never left waiting for CQEs that only come back
/// when an initiator goes away.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_receives_hold_at_most_half_the_cq_so_sends_keep_room() {
    let (tdev, idev) = need_devices!();
    // `x` (128 CQEs) is the target of `w`, whose one QP holds 64 of them
    // for receives, as many as receives may hold: a second initiator is
    // refused, and `x` still posts its own WRITE while `w` stays connected.
    let mut x = engine("x-room", &tdev, &[("cq_size", "128")]);
    let mut w = engine("w-room", &idev, &[]);
    w.connect(&x.metadata()).unwrap();
    let mut w2 = engine("w2-room", &idev, &[]);
    let err = w2.connect(&x.metadata()).expect_err("another 64 receives exceed half of 128 CQEs");
    assert!(err.to_string().contains("completion queue full"), "{err}");
    let mut y = engine("y-room", &idev, &[]);
    let (n, page) = (256u64, 4096u64);
    let dst = Arc::new(HostBuffer::new((n * page) as usize).unwrap());
    let src = Arc::new(HostBuffer::new((n * page) as usize).unwrap());
    src.fill_with(0, (n * page) as usize, |i| (i * 13 + 1) as u8);
    y.register(dst.clone()).unwrap();
    x.register(src.clone()).unwrap();
    x.connect(&y.metadata()).unwrap();
    // In descending order, so that nothing coalesces: 256 WRs, more than
    // the 64 CQEs left for sends.
    let l: Vec<Desc> = (0..n).rev().map(|i| Desc::new(src.addr() + i * page, page)).collect();
    let r: Vec<Desc> = (0..n).rev().map(|i| Desc::new(dst.addr() + i * page, page)).collect();
    let h = x.post(Op::Write, &l, "y-room", &r, None).unwrap();
    assert_eq!(wait(&mut x, h), TransferStatus::Done, "the WRITE waited for receives' CQEs");
    x.release(h).unwrap();
    assert_eq!(dst.to_vec(..), src.to_vec(..));
    drop(w);
}

/// With the completion queue, not the send queues, as the limit, the QP
/// whose chunk completed must not take every freed CQE while another QP's
/// work waits: a small transfer to a second peer finishes long before a
/// large one to the first.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_cq_budget_is_shared_between_qps_waiting_for_it() {
    let (tdev, idev) = need_devices!();
    let mut t1 = engine("t1-fair", &tdev, &[]);
    let mut t2 = engine("t2-fair", &tdev, &[]);
    let opts = [("cq_size", "128"), ("max_send_wr", "256"), ("signal_every", "32")];
    let mut init = engine("i-fair", &idev, &opts);
    const PAGES: u64 = 4000;
    const PAGE: u64 = 1024;
    let dst1 = Arc::new(HostBuffer::new((PAGES * PAGE * 2) as usize).unwrap());
    let dst2 = Arc::new(HostBuffer::new((16 * PAGE) as usize).unwrap());
    let src = Arc::new(HostBuffer::new((PAGES * PAGE) as usize).unwrap());
    src.fill_with(0, (PAGES * PAGE) as usize, |i| (i * 5 + 3) as u8);
    t1.register(dst1.clone()).unwrap();
    t2.register(dst2.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&t1.metadata()).unwrap();
    init.connect(&t2.metadata()).unwrap();
    // Every other remote page, so that nothing coalesces.
    let l: Vec<Desc> = (0..PAGES).map(|i| Desc::new(src.addr() + i * PAGE, PAGE)).collect();
    let r: Vec<Desc> = (0..PAGES).map(|i| Desc::new(dst1.addr() + 2 * i * PAGE, PAGE)).collect();
    let big = init.post(Op::Write, &l, "t1-fair", &r, None).unwrap();
    let l: Vec<Desc> = (0..16).map(|i| Desc::new(src.addr() + i * PAGE, PAGE)).collect();
    let r: Vec<Desc> = (0..16).map(|i| Desc::new(dst2.addr() + i * PAGE, PAGE)).collect();
    let small = init.post(Op::Write, &l, "t2-fair", &r, None).unwrap();
    assert_eq!(wait(&mut init, small), TransferStatus::Done);
    let big_then = init.status(big).unwrap();
    assert_eq!(wait(&mut init, big), TransferStatus::Done);
    assert_eq!(big_then, TransferStatus::InProgress, "the small transfer waited for all of the large one");
    init.release(big).unwrap();
    init.release(small).unwrap();
}

/// A post with no segments and a notification delivers the notification
/// and ends `Done` (the nixl helper's standalone notification); the
/// connection survives it.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_empty_post_with_a_notification_is_done_and_delivered() {
    let (tdev, idev) = need_devices!();
    let mut target = transport::create(TransportKind::Verbs, "t-empty", &config(&tdev, &[])).unwrap();
    let mut init = transport::create(TransportKind::Verbs, "i-empty", &config(&idev, &[])).unwrap();
    let dst = std::sync::Arc::new(HostBuffer::new(4096).unwrap());
    let src = std::sync::Arc::new(HostBuffer::new(4096).unwrap());
    let treg = target.register(dst.clone()).unwrap();
    let ireg = init.register(src.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: treg.rkey, kind: d.kind, device_id: 0 };
    let peer = init.connect("t-empty", &target.connection_info(), &[region]).unwrap();
    let mut done = Vec::new();
    let req = PostRequest { xfer: XferId(1), op: Op::Write, peer, segments: vec![], notification: Some(b"n".to_vec()) };
    init.post(req).unwrap();
    let c = wait_completion(&mut init, &mut done, XferId(1), WAIT).expect("completes");
    assert_eq!(c.result, Ok(()));
    let mut n: Vec<Notification> = Vec::new();
    let t0 = Instant::now();
    while n.is_empty() && t0.elapsed() < WAIT {
        target.take_notifications(&mut n);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].payload, b"n");
    let seg =
        Segment { local_addr: src.addr(), lkey: ireg.lkey, remote_addr: dst.addr(), rkey: treg.rkey, len_bytes: 64 };
    init.post(PostRequest { xfer: XferId(2), op: Op::Write, peer, segments: vec![seg], notification: None }).unwrap();
    let c = wait_completion(&mut init, &mut done, XferId(2), WAIT).expect("completes");
    assert_eq!(c.result, Ok(()), "the connection survives an empty post");
}

/// Issue 27 item 5 on a real device: a second transport (another session)
/// under the name of a connected peer is refused `NameInUse`; the honest
/// peer keeps working; once it is gone the name is free. The simulated-NIC
/// counterpart: `transport::verbs::tests::listener_rules`.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_a_connected_name_is_refused_to_another_session() {
    let (tdev, idev) = need_devices!();
    let mut t = transport::create(TransportKind::Verbs, "t-names", &config(&tdev, &[])).unwrap();
    let info = t.connection_info();
    let mut a = transport::create(TransportKind::Verbs, "a-names", &config(&idev, &[])).unwrap();
    let pa = a.connect("t-names", &info, &[]).unwrap();
    let mut spoof = transport::create(TransportKind::Verbs, "a-names", &config(&idev, &[])).unwrap();
    let e = spoof.connect("t-names", &info, &[]).unwrap_err();
    assert!(matches!(&e, transport::TransportError::NameInUse { .. }), "{e:?}");
    // The honest peer still notifies.
    a.post(PostRequest {
        xfer: XferId(1),
        op: Op::Write,
        peer: pa,
        segments: vec![],
        notification: Some(b"a".to_vec()),
    })
    .unwrap();
    let mut done = Vec::new();
    let c = wait_completion(&mut a, &mut done, XferId(1), WAIT).expect("the honest peer's notification completes");
    assert!(c.result.is_ok(), "{c:?}");
    let mut got: Vec<Notification> = Vec::new();
    let t0 = Instant::now();
    while got.is_empty() && t0.elapsed() < WAIT {
        t.take_notifications(&mut got);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(got.first().map(|n| n.from_agent.as_str()), Some("a-names"));
    // Once the honest peer is gone, the name is free.
    drop(a);
    let t0 = Instant::now();
    loop {
        match spoof.connect("t-names", &info, &[]) {
            Ok(_) => break,
            Err(transport::TransportError::NameInUse { .. }) if t0.elapsed() < WAIT => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("the name stayed held after its peer left: {e:?}"),
        }
    }
}
