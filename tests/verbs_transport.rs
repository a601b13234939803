//! The verbs transport on real RDMA devices (Soft-RoCE in CI: rxe0 ↔ rxe1).
//!
//! Each test needs a device and is `#[ignore]`d with that reason, so a plain
//! `cargo test` reports it as ignored, never as passed;
//! `scripts/softroce-tests.sh` runs them with `--include-ignored` in the
//! Soft-RoCE guest (where a missing device still prints `skipped` and
//! returns). The state machine itself is tested without hardware on the
//! simulated NIC (`src/transport/verbs/tests.rs`). The guest is slow (20-60 MB/s, ms round trips): data is
//! small and completions get seconds.

mod verbs_util;

use verbs_util::{WAIT, config, wait};

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{AgentMetadata, Desc, TransferEngine, TransferStatus};
use kvwire::transport::{
    self, FailureKind, FailureSource, LocalKey, MemoryBacking, Notification, Op, PostRequest, RemoteAccessKind,
    RemoteKey, RemoteRegion, Segment, TransportConfig, TransportKind, XferId,
};

fn engine(name: &str, device: &str) -> TransferEngine {
    TransferEngine::new(name, TransportKind::Verbs, &config(device, &[])).expect("verbs engine")
}

fn wait_notifs(e: &mut TransferEngine, from: &str, n: usize) -> Vec<Vec<u8>> {
    let t0 = Instant::now();
    let mut got = Vec::new();
    while got.len() < n && t0.elapsed() < WAIT {
        if let Some(v) = e.get_notifs().remove(from) {
            got.extend(v);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    got
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_write_read_and_notification() {
    let (tdev, idev) = need_devices!();
    let mut target = engine("decode", &tdev);
    let mut init = engine("prefill", &idev);
    let dst = Arc::new(HostBuffer::new(1 << 16).unwrap());
    let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
    src.fill_with(0, 1 << 16, |i| (i * 7 + 3) as u8);
    target.register(dst.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();

    let h = init
        .post(
            Op::Write,
            &[Desc::new(src.addr(), 40_000)],
            "decode",
            &[Desc::new(dst.addr() + 100, 40_000)],
            Some(b"w1".to_vec()),
        )
        .unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    assert_eq!(wait_notifs(&mut target, "prefill", 1), vec![b"w1".to_vec()]);
    assert_eq!(dst.to_vec(100..40_100), src.to_vec(..40_000));

    // READ it back into another part of the initiator's buffer.
    let h = init
        .post(Op::Read, &[Desc::new(src.addr() + 50_000, 8_000)], "decode", &[Desc::new(dst.addr() + 100, 8_000)], None)
        .unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    assert_eq!(src.to_vec(50_000..58_000), src.to_vec(..8_000));

    // A READ with a notification: on one QP its SEND carries
    // IBV_SEND_FENCE, so the NIC sends it once the READ's data arrived.
    src.fill_with(60_000, 4_000, |_| 0);
    let h = init
        .post(
            Op::Read,
            &[Desc::new(src.addr() + 60_000, 4_000)],
            "decode",
            &[Desc::new(dst.addr() + 100, 4_000)],
            Some(b"r1".to_vec()),
        )
        .unwrap();
    assert_eq!(wait(&mut init, h), TransferStatus::Done);
    init.release(h).unwrap();
    assert_eq!(wait_notifs(&mut target, "prefill", 1), vec![b"r1".to_vec()]);
    assert_eq!(src.to_vec(60_000..64_000), src.to_vec(..4_000));
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_notifications_arrive_in_order_after_their_data() {
    let (tdev, idev) = need_devices!();
    let mut target = engine("t-order", &tdev);
    let mut init = engine("i-order", &idev);
    let n = 16usize;
    let page = 4096usize;
    let dst = Arc::new(HostBuffer::new(n * page).unwrap());
    let src = Arc::new(HostBuffer::new(n * page).unwrap());
    src.fill_with(0, n * page, |i| (i / page + 1) as u8);
    target.register(dst.clone()).unwrap();
    init.register(src.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    let mut handles = Vec::new();
    for i in 0..n {
        let off = (i * page) as u64;
        let h = init
            .post(
                Op::Write,
                &[Desc::new(src.addr() + off, page as u64)],
                "t-order",
                &[Desc::new(dst.addr() + off, page as u64)],
                Some(format!("n{i}").into_bytes()),
            )
            .unwrap();
        handles.push(h);
    }
    // As each notification arrives, its page must already be visible.
    let t0 = Instant::now();
    let mut seen = 0usize;
    while seen < n && t0.elapsed() < WAIT {
        for p in target.get_notifs().remove("i-order").unwrap_or_default() {
            assert_eq!(p, format!("n{seen}").into_bytes(), "notifications out of order");
            assert!(
                dst.to_vec(seen * page..(seen + 1) * page).iter().all(|&b| b == (seen + 1) as u8),
                "notification {seen} before its data"
            );
            seen += 1;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(seen, n);
    for h in handles {
        assert_eq!(wait(&mut init, h), TransferStatus::Done);
        init.release(h).unwrap();
    }
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_thousand_scattered_pages_byte_exact() {
    let (tdev, idev) = need_devices!();
    for qps in ["1", "2"] {
        let mut target =
            TransferEngine::new("t-pages", TransportKind::Verbs, &config(&tdev, &[("qps_per_peer", qps)])).unwrap();
        let mut init =
            TransferEngine::new("i-pages", TransportKind::Verbs, &config(&idev, &[("qps_per_peer", qps)])).unwrap();
        let pages = 1000usize;
        let page = 1024usize;
        let dst = Arc::new(HostBuffer::new(2 * pages * page).unwrap());
        let src = Arc::new(HostBuffer::new(pages * page).unwrap());
        src.fill_with(0, pages * page, |i| (i.wrapping_mul(2654435761) >> 13) as u8);
        target.register(dst.clone()).unwrap();
        init.register(src.clone()).unwrap();
        init.connect(&target.metadata()).unwrap();
        // Source page i → destination slot perm(i), every other slot: no two
        // neighbours coalesce.
        let perm = |i: usize| (i * 389 + 17) % pages;
        let local: Vec<Desc> = (0..pages).map(|i| Desc::new(src.addr() + (i * page) as u64, page as u64)).collect();
        let remote: Vec<Desc> =
            (0..pages).map(|i| Desc::new(dst.addr() + (2 * perm(i) * page) as u64, page as u64)).collect();
        let t0 = Instant::now();
        let h = init.post(Op::Write, &local, "t-pages", &remote, Some(b"pages".to_vec())).unwrap();
        assert_eq!(wait(&mut init, h), TransferStatus::Done, "qps_per_peer={qps}");
        init.release(h).unwrap();
        eprintln!("1000 x {page} B scattered WRITE, qps_per_peer={qps}: {:?}", t0.elapsed());
        assert_eq!(wait_notifs(&mut target, "i-pages", 1), vec![b"pages".to_vec()]);
        for i in 0..pages {
            let d = 2 * perm(i) * page;
            assert_eq!(dst.to_vec(d..d + page), src.to_vec(i * page..(i + 1) * page), "page {i}");
            assert!(dst.to_vec(d + page..d + 2 * page).iter().all(|&b| b == 0), "gap after page {i} written");
        }
        // And READ them back scattered into a fresh buffer.
        let back = Arc::new(HostBuffer::new(pages * page).unwrap());
        init.register(back.clone()).unwrap();
        let local: Vec<Desc> = (0..pages).map(|i| Desc::new(back.addr() + (i * page) as u64, page as u64)).collect();
        let h = init.post(Op::Read, &local, "t-pages", &remote, None).unwrap();
        assert_eq!(wait(&mut init, h), TransferStatus::Done);
        init.release(h).unwrap();
        assert_eq!(back.to_vec(..), src.to_vec(..));
    }
}

use verbs_util::wait_completion;

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_wrong_rkey_fails_with_remote_access_error_then_recovers() {
    let (tdev, idev) = need_devices!();
    let mut target = transport::create(TransportKind::Verbs, "t-rkey", &config(&tdev, &[])).unwrap();
    let mut init = transport::create(TransportKind::Verbs, "i-rkey", &config(&idev, &[])).unwrap();
    let dst = std::sync::Arc::new(HostBuffer::new(1 << 14).unwrap());
    let src = std::sync::Arc::new(HostBuffer::new(1 << 14).unwrap());
    src.fill_with(0, 1 << 14, |_| 0xab);
    let treg = target.register(dst.clone()).unwrap();
    let ireg = init.register(src.clone()).unwrap();
    // The target's region as its metadata gives it, and one that claims a
    // page more than it has (to reach the HCA's own check below).
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: treg.rkey, kind: d.kind, device_id: 0 };
    let peer = init.connect("t-rkey", &target.connection_info(), &[region]).unwrap();
    let seg = |rkey: RemoteKey| Segment {
        local_addr: src.addr(),
        remote_addr: dst.addr(),
        len_bytes: 4096,
        lkey: ireg.lkey,
        rkey,
    };
    // A key that names no region: UnknownKey, as on shm and tcp (issue 27),
    // refused before any WR is posted.
    let bad = RemoteKey(treg.rkey.0 ^ 0x5a5a00);
    init.post(PostRequest {
        xfer: XferId(1),
        op: Op::Write,
        peer,
        segments: vec![seg(bad)],
        notification: Some(b"x".to_vec()),
    })
    .unwrap();
    let c = wait_completion(&mut init, XferId(1));
    let err = c.result.expect_err("a wrong rkey must fail");
    assert_eq!(err.kind, FailureKind::RemoteAccess(RemoteAccessKind::UnknownKey), "got {err:?}");
    assert!(dst.to_vec(..).iter().all(|&b| b == 0), "bytes written through a wrong rkey");
    let mut n: Vec<Notification> = Vec::new();
    target.take_notifications(&mut n);
    assert!(n.is_empty(), "notification delivered for a failed transfer");

    // Past the end of a region the initiator believes larger: the HCA
    // refuses it (IBV_WC_REM_ACCESS_ERR, OutOfBounds) and the QP errors.
    init.disconnect(peer);
    let lying = RemoteRegion { len_bytes: d.len_bytes + 4096, ..region };
    let peer = init.connect("t-rkey", &target.connection_info(), &[lying]).unwrap();
    init.post(PostRequest {
        xfer: XferId(3),
        op: Op::Write,
        peer,
        segments: vec![Segment { remote_addr: dst.addr() + d.len_bytes, ..seg(treg.rkey) }],
        notification: Some(b"y".to_vec()),
    })
    .unwrap();
    let c = wait_completion(&mut init, XferId(3));
    let err = c.result.expect_err("an access past the region must fail");
    assert!(matches!(err.source, FailureSource::WorkCompletion { status: 10, .. }), "got {err:?}");
    assert_eq!(err.kind, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds), "got {err:?}");
    assert!(dst.to_vec(..).iter().all(|&b| b == 0), "bytes written past the region");
    target.take_notifications(&mut n);
    assert!(n.is_empty(), "notification delivered for a failed transfer");

    // The QP is reset and reconnected by the next post on that peer.
    init.post(PostRequest {
        xfer: XferId(2),
        op: Op::Write,
        peer,
        segments: vec![seg(treg.rkey)],
        notification: Some(b"ok".to_vec()),
    })
    .unwrap();
    let c = wait_completion(&mut init, XferId(2));
    assert_eq!(c.result, Ok(()));
    assert!(dst.to_vec(..4096).iter().all(|&b| b == 0xab));
    let t0 = Instant::now();
    while n.is_empty() && t0.elapsed() < WAIT {
        target.take_notifications(&mut n);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].payload, b"ok");
    let _ = init.deregister(LocalKey(ireg.lkey.0));
}

const CHILD_ENV: &str = "KVWIRE_VERBS_CHILD_DEVICE";
const CHILD_META_ENV: &str = "KVWIRE_VERBS_CHILD_META";

/// The target process of the kill test (does nothing unless spawned by it).
#[test]
#[ignore = "the kill test's target process (it spawns this test itself)"]
fn verbs_child_target_process() {
    let Ok(dev) = std::env::var(CHILD_ENV) else {
        return;
    };
    eprintln!("child: opening {dev}");
    let mut target = engine("t-killed", &dev);
    let dst = Arc::new(HostBuffer::new(8 << 20).unwrap());
    target.register(dst).unwrap();
    eprintln!("child: registered");
    let path = std::env::var(CHILD_META_ENV).unwrap();
    std::fs::write(format!("{path}.tmp"), target.metadata().to_json()).unwrap();
    std::fs::rename(format!("{path}.tmp"), &path).unwrap();
    eprintln!("child: metadata written");
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_peer_killed_mid_transfer_fails_in_bounded_time_with_default_options() {
    let (tdev, idev) = need_devices!();
    eprintln!("kill test: waiting for the child's metadata");
    let (mut child, meta) = spawn_target(&tdev);
    // Default options (issue: rxe at retry_cnt=7 retried forever): the
    // liveness channel's close fails the QPs at once; else the progress
    // deadline (2 × peer_timeout) or the finite default retry_cnt does.
    let cfg = config(&idev, &[]);
    let mut init = TransferEngine::new("i-kill", TransportKind::Verbs, &cfg).unwrap();
    let src = Arc::new(HostBuffer::new(8 << 20).unwrap());
    init.register(src.clone()).unwrap();
    init.connect(&meta).unwrap();
    eprintln!("kill test: connected");
    let base = meta.regions[0].addr;
    let pages = 512u64;
    let page = 16u64 << 10;
    let local: Vec<Desc> = (0..pages).map(|i| Desc::new(src.addr() + i * page, page)).collect();
    let remote: Vec<Desc> = (0..pages).map(|i| Desc::new(base + i * page, page)).collect();
    let h = init.post(Op::Write, &local, "t-killed", &remote, Some(b"never".to_vec())).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    child.kill().unwrap();
    child.wait().unwrap();
    eprintln!("kill test: child killed, status now {:?}", init.status(h).unwrap());
    let killed = Instant::now();
    let s = wait(&mut init, h);
    let took = killed.elapsed();
    eprintln!("peer killed: {s:?} after {took:?}");
    match s {
        TransferStatus::Failed(why) => {
            assert!(matches!(why.kind, FailureKind::PeerDied | FailureKind::PeerTimeout), "{why:?}")
        }
        TransferStatus::Done => eprintln!("note: the transfer finished before the kill landed"),
        TransferStatus::InProgress => {
            panic!("transfer still in progress {took:?} after the peer died")
        }
    }
    assert!(took < Duration::from_secs(30), "failure took {took:?}");
    init.release(h).unwrap();
    // Later posts to the dead peer fail fast (reconnect refused), never hang.
    let r = init.post(Op::Write, &local[..1], "t-killed", &remote[..1], None);
    match r {
        Err(e) => eprintln!("post to dead peer: {e}"),
        Ok(h2) => {
            let s = wait(&mut init, h2);
            assert!(matches!(s, TransferStatus::Failed(_)), "{s:?}");
        }
    }
}

/// Spawn the kill test's target process on `tdev`; it and its metadata.
fn spawn_target(tdev: &str) -> (std::process::Child, AgentMetadata) {
    let exe = std::env::current_exe().unwrap();
    let meta_path = std::env::temp_dir().join(format!("kvwire-verbs-stop-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&meta_path);
    let mut child = std::process::Command::new(exe)
        .args(["verbs_child_target_process", "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, tdev)
        .env(CHILD_META_ENV, &meta_path)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let meta = loop {
        if let Ok(j) = std::fs::read_to_string(&meta_path) {
            break AgentMetadata::from_json(&j).unwrap();
        }
        assert!(t0.elapsed() < WAIT, "child never published its metadata");
        assert!(child.try_wait().unwrap().is_none(), "child exited early");
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = std::fs::remove_file(&meta_path);
    (child, meta)
}

/// A stopped (SIGSTOP) peer keeps its liveness channel open, and rxe's
/// kernel responder still acknowledges WRITEs, but its process no longer
/// reposts receives: once its 64 posted receives are used, the next
/// notification SEND is NAKed (RNR) forever (`rnr_retry` 7 is infinite).
/// Only the progress deadline can end that transfer, and the ones behind it:
/// `PeerTimeout` within it.
#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_stopped_peer_stalled_on_rnr_fails_by_the_progress_deadline() {
    let (tdev, idev) = need_devices!();
    let (mut child, meta) = spawn_target(&tdev);
    let cfg = config(&idev, &[("progress_timeout_ms", "3000")]);
    let mut init = TransferEngine::new("i-stop", TransportKind::Verbs, &cfg).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 20).unwrap());
    init.register(src.clone()).unwrap();
    init.connect(&meta).unwrap();
    let stop = std::process::Command::new("kill").args(["-STOP", &child.id().to_string()]).status().unwrap();
    assert!(stop.success(), "kill -STOP failed");
    let base = meta.regions[0].addr;
    let t0 = Instant::now();
    let handles: Vec<_> = (0..100u64)
        .map(|i| {
            let (l, r) = ([Desc::new(src.addr() + i * 64, 64)], [Desc::new(base + i * 64, 64)]);
            init.post(Op::Write, &l, "t-killed", &r, Some(format!("n{i}").into_bytes())).unwrap()
        })
        .collect();
    let statuses: Vec<TransferStatus> = handles.iter().map(|&h| wait(&mut init, h)).collect();
    let took = t0.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    let done = statuses.iter().filter(|s| **s == TransferStatus::Done).count();
    let timed_out = statuses
        .iter()
        .filter(|s| matches!(s, TransferStatus::Failed(w) if w.kind == FailureKind::PeerTimeout))
        .count();
    eprintln!("stopped peer: {done} done, {timed_out} PeerTimeout, all ended after {took:?}");
    assert!(statuses.iter().all(|s| *s != TransferStatus::InProgress), "a transfer never ended: {statuses:?}");
    assert!(timed_out > 0, "expected the RNR stall to end by the deadline: {statuses:?}");
    assert!(done <= 64, "more notifications than posted receives: {done}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

/// The connection secret from verbs connection info (postcard: the address
/// string, then the 16 secret bytes last) with one bit flipped.
fn with_wrong_secret(info: &[u8]) -> Vec<u8> {
    let mut v = info.to_vec();
    *v.last_mut().unwrap() ^= 1;
    v
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_initiator_without_the_secret_is_refused_before_any_qp() {
    let (tdev, idev) = need_devices!();
    let target = transport::create(TransportKind::Verbs, "t-auth", &config(&tdev, &[])).unwrap();
    let mut init = transport::create(TransportKind::Verbs, "i-auth", &config(&idev, &[])).unwrap();
    let info = target.connection_info();
    let e = init.connect("t-auth", &with_wrong_secret(&info), &[]).unwrap_err();
    assert!(e.to_string().contains("authentication failed"), "{e}");
    // The right secret still connects.
    init.connect("t-auth", &info, &[]).unwrap();
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_hello_without_a_proof_gets_no_qp_numbers() {
    use std::io::{Read, Write};
    let (tdev, _) = need_devices!();
    let target = transport::create(TransportKind::Verbs, "t-raw", &config(&tdev, &[])).unwrap();
    let info = target.connection_info();
    // postcard: varint length (< 128 here), then the address.
    let addr = std::str::from_utf8(&info[1..1 + info[0] as usize]).unwrap().to_string();
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let frame = |s: &mut std::net::TcpStream, json: &str| {
        s.write_all(&(json.len() as u32).to_le_bytes()).unwrap();
        s.write_all(json.as_bytes()).unwrap();
    };
    let read = |s: &mut std::net::TcpStream| -> Option<String> {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).ok()?;
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut body).ok()?;
        Some(String::from_utf8_lossy(&body).into_owned())
    };
    let qp = r#"{"qpn":1,"psn":1,"lid":0,"gid":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],"mtu":3,"rd_atom":1}"#;
    // version: HANDSHAKE_VERSION in src/transport/verbs/conn.rs
    let nonce = vec!["7"; 16].join(",");
    frame(
        &mut s,
        &format!(r#"{{"Hello":{{"version":6,"agent":"mallory","session":1,"qps":[{qp}],"nonce":[{nonce}]}}}}"#),
    );
    let challenge = read(&mut s).expect("a challenge");
    assert!(challenge.contains("Challenge"), "{challenge}");
    frame(&mut s, &format!(r#"{{"Proof":{{"proof":[{}]}}}}"#, vec!["0"; 32].join(",")));
    let answer = read(&mut s).unwrap_or_default();
    assert!(!answer.contains("Accept"), "QP numbers given to a peer without the secret: {answer}");
    assert!(answer.contains("authentication failed"), "{answer}");
}

#[test]
fn verbs_missing_device_is_a_clear_error() {
    // Asserts on every host (it used to return without asserting where
    // libibverbs loads but lists no device): without the library the error
    // names it; with it, a device that does not exist is named, whether the
    // host has other devices or none.
    if !kvwire::verbs::available() {
        let e = TransferEngine::new("x", TransportKind::Verbs, &TransportConfig::default()).unwrap_err();
        assert!(e.to_string().contains("libibverbs.so.1"), "{e}");
        return;
    }
    let e = TransferEngine::new("x", TransportKind::Verbs, &config("no_such_dev9", &[])).unwrap_err();
    assert!(e.to_string().contains("no RDMA device named \"no_such_dev9\""), "{e}");
}

#[allow(dead_code)]
fn _backing_is_object_safe(b: &dyn MemoryBacking) -> u64 {
    b.desc().addr
}

/// Names (`comm`, at most 15 bytes) of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .map(|s| s.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_dropping_the_transport_ends_every_thread_and_closes_the_device() {
    let (tdev, idev) = need_devices!();
    // A first open and drop, so that what libibverbs keeps for the process
    // (loaded providers) is in the baseline.
    drop(engine("t-warm", &tdev));
    let fds = open_fds();
    assert!(!thread_names().iter().any(|n| n.starts_with("kvwire-verbs")), "{:?}", thread_names());
    {
        let mut target = engine("t-drop", &tdev);
        let mut init = engine("i-drop", &idev);
        let dst = Arc::new(HostBuffer::new(1 << 16).unwrap());
        let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
        target.register(dst.clone()).unwrap();
        init.register(src.clone()).unwrap();
        init.connect(&target.metadata()).unwrap();
        let post = |init: &mut TransferEngine, n: &str| {
            let (s, d) = ([Desc::new(src.addr(), 1 << 16)], [Desc::new(dst.addr(), 1 << 16)]);
            init.post(Op::Write, &s, "t-drop", &d, Some(n.as_bytes().to_vec())).unwrap()
        };
        let h = post(&mut init, "one");
        assert_eq!(wait(&mut init, h), TransferStatus::Done);
        assert_eq!(wait_notifs(&mut target, "i-drop", 1), vec![b"one".to_vec()]);
        // Progress, listener, one peer server (target), one liveness watcher.
        let names = thread_names();
        assert!(names.iter().filter(|n| n.starts_with("kvwire-verbs")).count() >= 5, "{names:?}");
        // Dropped with a transfer possibly still in flight.
        let _ = post(&mut init, "two");
    }
    let names = thread_names();
    assert!(!names.iter().any(|n| n.starts_with("kvwire-verbs")), "threads left: {names:?}");
    assert_eq!(open_fds(), fds, "descriptors left open (device context, sockets, completion channels)");
}
