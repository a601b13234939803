//! Two-process tests of the TransferEngine over the shm transport: the target
//! is a child process (see `common`), the test is the initiator.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ChildTarget, Cmd, Reply, fnv, pattern, wait};
use kvwire::HostBuffer;
use kvwire::engine::{Desc, EngineError, TransferEngine, TransferStatus};
use kvwire::transport::{FailureKind, Op, RemoteAccessKind, TransportConfig, TransportError, TransportKind, View};

const PAGE: u64 = 4096;

#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    common::child_main();
}

fn initiator(len: usize) -> (TransferEngine, Arc<HostBuffer>) {
    let mut e = TransferEngine::new("initiator", TransportKind::Shm, &TransportConfig::default()).unwrap();
    let b = Arc::new(HostBuffer::new(len).unwrap());
    e.register(b.clone()).unwrap();
    (e, b)
}

/// Page `i` of the local buffer goes to page `perm(i)` of the remote one.
fn scattered(local: &HostBuffer, remote_base: u64, pages: u64) -> (Vec<Desc>, Vec<Desc>, Vec<u64>) {
    let perm: Vec<u64> = (0..pages).map(|i| (i * 7 + 3) % pages).collect();
    let l = (0..pages).map(|i| Desc::new(local.addr() + i * PAGE, PAGE)).collect();
    let r = perm.iter().map(|&p| Desc::new(remote_base + p * PAGE, PAGE)).collect();
    (l, r, perm)
}

fn run_write_read(memfd: bool) {
    let pages = 64u64;
    let mut child = ChildTarget::spawn(&[((pages * PAGE) as usize, memfd)]);
    let (mut e, buf) = initiator((pages * PAGE) as usize);
    e.connect(&child.meta).unwrap();
    let remote = child.meta.regions[0].addr;
    buf.fill_with(0, buf.len(), |i| pattern(i as u64, 3, 1));
    let (l, r, perm) = scattered(&buf, remote, pages);
    let h = e.post(Op::Write, &l, "target", &r, Some(b"w1".to_vec())).unwrap();
    assert_eq!(wait(&mut e, h, Duration::from_secs(10)), TransferStatus::Done);
    e.release(h).unwrap();
    // every remote page holds the local page that maps to it
    for (i, &p) in perm.iter().enumerate() {
        let want = fnv(&buf.to_vec(i * PAGE as usize..(i + 1) * PAGE as usize));
        assert_eq!(
            child.call(&Cmd::Hash { region: 0, offset: p * PAGE, len: PAGE }),
            Reply::Hash(want, None),
            "page {i}"
        );
    }
    // READ it back into a zeroed buffer, reversing the permutation
    buf.fill_with(0, buf.len(), |_| 0);
    let h = e.post(Op::Read, &l, "target", &r, None).unwrap();
    assert_eq!(wait(&mut e, h, Duration::from_secs(10)), TransferStatus::Done);
    e.release(h).unwrap();
    assert!(buf.to_vec(..).iter().enumerate().all(|(i, &b)| b == pattern(i as u64, 3, 1)));
}

#[test]
fn write_and_read_scattered_pages_through_memfd_mappings() {
    run_write_read(true);
}

#[test]
fn write_and_read_plain_heap_memory_through_cross_memory_attach() {
    run_write_read(false);
}

#[test]
fn notification_arrives_after_data_without_initiator_polling() {
    let len = 8 << 20;
    let mut child = ChildTarget::spawn(&[(len, true)]);
    let (mut e, buf) = initiator(len);
    e.connect(&child.meta).unwrap();
    buf.fill_with(0, len, |i| pattern(i as u64, 5, 9));
    let want = fnv(&buf.to_vec(..));
    let remote = child.meta.regions[0].addr;
    // Post and never poll the initiator: the target must still get the
    // notification, and only once all 8 MiB are visible.
    let h = e
        .post(
            Op::Write,
            &[Desc::new(buf.addr(), len as u64)],
            "target",
            &[Desc::new(remote, len as u64)],
            Some(b"done-1".to_vec()),
        )
        .unwrap();
    let reply = child.call(&Cmd::WaitNotif { payload: b"done-1".to_vec(), region: 0, offset: 0, len: len as u64 });
    assert_eq!(reply, Reply::Hash(want, Some("initiator".into())));
    assert_eq!(wait(&mut e, h, Duration::from_secs(5)), TransferStatus::Done);
}

#[test]
fn releasing_an_in_flight_transfer_cancels_it_and_later_transfers_work() {
    let len = 256 << 20;
    let mut child = ChildTarget::spawn(&[(len, true)]);
    let (mut e, buf) = initiator(len);
    e.connect(&child.meta).unwrap();
    let remote = child.meta.regions[0].addr;
    let pages = len as u64 / PAGE;
    let (l, r, _) = scattered(&buf, remote, pages);
    let h = e.post(Op::Write, &l, "target", &r, Some(b"never".to_vec())).unwrap();
    e.release(h).unwrap();
    assert!(matches!(e.status(h), Err(EngineError::UnknownHandle(_))));
    assert!(matches!(e.release(h), Err(EngineError::UnknownHandle(_))));
    // a released transfer sends no notification...
    let reply = child.call(&Cmd::WaitNotif { payload: b"x".to_vec(), region: 0, offset: 0, len: 1 });
    assert!(matches!(reply, Reply::Err(_)));
    // ...and the registration is free again, the peer still usable
    buf.fill_with(0, 4096, |_| 0xab);
    let h = e.post(Op::Write, &[Desc::new(buf.addr(), PAGE)], "target", &[Desc::new(remote, PAGE)], None).unwrap();
    assert_eq!(wait(&mut e, h, Duration::from_secs(10)), TransferStatus::Done);
    assert_eq!(child.call(&Cmd::Hash { region: 0, offset: 0, len: PAGE }), Reply::Hash(fnv(&[0xab; 4096]), None));
}

#[test]
fn a_killed_peer_fails_transfers_within_the_timeout() {
    let len = 64 << 20;
    let mut child = ChildTarget::spawn(&[(len, true)]);
    let (mut e, buf) = initiator(len);
    e.connect(&child.meta).unwrap();
    let remote = child.meta.regions[0].addr;
    let (l, r, _) = scattered(&buf, remote, len as u64 / PAGE);
    let h = e.post(Op::Write, &l, "target", &r, Some(b"n".to_vec())).unwrap();
    child.child.kill().unwrap();
    child.child.wait().unwrap();
    let started = Instant::now();
    // The in-flight transfer resolves (it may have finished before the kill)...
    assert_ne!(wait(&mut e, h, Duration::from_secs(5)), TransferStatus::InProgress);
    // ...and from now on every transfer to the dead peer fails, never hangs.
    let failed = loop {
        match e.post(Op::Write, &l[..1], "target", &r[..1], Some(b"n".to_vec())) {
            // A peer found dead stays loaded and refuses posts at once (NIXL 1.5.1).
            Err(EngineError::Transport(err)) => {
                assert!(matches!(err, TransportError::PeerDisconnected(_)), "{err}");
                assert!(e.is_remote_loaded("target") && !e.is_connected("target"));
                break err.to_string();
            }
            Ok(h) => {
                if let TransferStatus::Failed(why) = wait(&mut e, h, Duration::from_secs(5)) {
                    assert_eq!(why.kind, FailureKind::PeerDied, "{why}");
                    break why.to_string();
                }
            }
            Err(other) => panic!("unexpected {other}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5), "dead peer not detected");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(failed.contains("disconnected") || failed.contains("failed"), "{failed}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn out_of_bounds_remote_access_fails_and_writes_nothing() {
    let len = 16 * PAGE as usize;
    let mut child = ChildTarget::spawn(&[(len, true)]);
    let (mut e, buf) = initiator(len);
    buf.fill_with(0, len, |_| 0x5a);
    let zero = child.call(&Cmd::Hash { region: 0, offset: 0, len: len as u64 });
    let region = child.meta.regions[0];
    // 1. the engine refuses a descriptor past the published region
    e.connect(&child.meta).unwrap();
    let err = e
        .post(
            Op::Write,
            &[Desc::new(buf.addr(), 2 * PAGE)],
            "target",
            &[Desc::new(region.addr + 15 * PAGE, 2 * PAGE)],
            None,
        )
        .unwrap_err();
    assert!(matches!(err, EngineError::RemoteOutOfBounds { index: 0, .. }), "{err}");
    e.disconnect("target").unwrap();
    // 2. forged metadata claiming a larger region: the transport checks the
    //    target's real table (as an HCA checks the rkey) and fails the transfer
    let mut forged = child.meta.clone();
    forged.regions[0].len_bytes *= 4;
    e.connect(&forged).unwrap();
    let h = e
        .post(
            Op::Write,
            &[Desc::new(buf.addr(), 2 * PAGE), Desc::new(buf.addr(), 2 * PAGE)],
            "target",
            &[Desc::new(region.addr, 2 * PAGE), Desc::new(region.addr + 20 * PAGE, 2 * PAGE)],
            None,
        )
        .unwrap();
    match wait(&mut e, h, Duration::from_secs(5)) {
        TransferStatus::Failed(why) => {
            assert_eq!(why.kind, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds), "{why}")
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    // not even the in-bounds first segment was written
    assert_eq!(child.call(&Cmd::Hash { region: 0, offset: 0, len: len as u64 }), zero);
    // 3. an unknown rkey
    e.disconnect("target").unwrap();
    let mut forged = child.meta.clone();
    forged.regions[0].rkey.0 += 1000;
    assert!(e.connect(&forged).is_err(), "connect with an rkey the target does not have must fail");
}

#[test]
fn deregister_is_refused_while_in_use_and_validation_errors_are_distinct() {
    let len = 64 << 20;
    let mut child = ChildTarget::spawn(&[(len, true)]);
    let mut e = TransferEngine::new("initiator", TransportKind::Shm, &TransportConfig::default()).unwrap();
    let buf = Arc::new(HostBuffer::new(len).unwrap());
    let reg = e.register(buf.clone()).unwrap();
    // The same range again is a registration of its own (NIXL accepts it).
    let again = e.register(buf.clone()).unwrap();
    e.deregister(again).unwrap();
    assert!(matches!(
        e.post(Op::Write, &[Desc::new(buf.addr(), 1)], "nobody", &[Desc::new(0, 1)], None),
        Err(EngineError::UnknownAgent(_))
    ));
    e.connect(&child.meta).unwrap();
    assert!(matches!(e.connect(&child.meta), Err(EngineError::AlreadyConnected(_))));
    let remote = child.meta.regions[0].addr;
    let (l, r, _) = scattered(&buf, remote, len as u64 / PAGE);
    assert!(matches!(e.post(Op::Write, &l, "target", &r[1..], None), Err(EngineError::DescCountMismatch { .. })));
    // Straddling two pages: no descriptor lies inside it, so the transfer
    // uses `reg` only.
    let straddle = e.register(Arc::new(View::new(buf.clone(), PAGE / 2, PAGE).unwrap())).unwrap();
    let h = e.post(Op::Write, &l, "target", &r, None).unwrap();
    // Refused through the overlap with `reg` (on shm, re-homing must not
    // race the copy), unless the copy already finished.
    match e.deregister(straddle) {
        Err(EngineError::RegistrationInUse { inflight: 1 }) => {
            assert_eq!(wait(&mut e, h, Duration::from_secs(10)), TransferStatus::Done);
            e.deregister(straddle).unwrap();
        }
        Ok(()) => assert_eq!(e.status(h).unwrap(), TransferStatus::Done),
        Err(other) => panic!("unexpected {other}"),
    }
    match e.deregister(reg) {
        Err(EngineError::RegistrationInUse { inflight: 1 }) => {
            assert_eq!(wait(&mut e, h, Duration::from_secs(10)), TransferStatus::Done);
            e.release(h).unwrap();
            e.deregister(reg).unwrap();
        }
        // Only legitimate if the copy already finished before deregister polled.
        Ok(()) => assert_eq!(e.status(h).unwrap(), TransferStatus::Done),
        Err(other) => panic!("unexpected {other}"),
    }
    assert!(matches!(e.deregister(reg), Err(EngineError::UnknownRegistration)));
    let _ = child.call(&Cmd::Hash { region: 0, offset: 0, len: 1 });
}

fn deregistered_region_is_never_written(memfd: bool) {
    let cfg = TransportConfig::default();
    let mut target = TransferEngine::new("target", TransportKind::Shm, &cfg).unwrap();
    let host = Arc::new(HostBuffer::new(1 << 20).unwrap());
    let heap = Arc::new(vec![0u8; 1 << 20]);
    let reg = if memfd {
        target.register(host.clone()).unwrap()
    } else {
        let desc = kvwire::transport::MemoryDesc {
            addr: heap.as_ptr() as u64,
            len_bytes: 1 << 20,
            kind: kvwire::transport::MemoryKind::Dram,
            device_id: 0,
        };
        // SAFETY: `heap` outlives the engines in this test.
        target.register(Arc::new(unsafe { kvwire::transport::RawMemory::new(desc) })).unwrap()
    };
    let dst = if memfd { host.addr() } else { heap.as_ptr() as u64 };
    let (mut e, buf) = initiator(1 << 20);
    e.connect(&target.metadata()).unwrap();
    buf.fill_with(0, 1 << 20, |_| 0xee);
    // a transfer before deregistration lands...
    let h = e.post(Op::Write, &[Desc::new(buf.addr(), PAGE)], "target", &[Desc::new(dst, PAGE)], None).unwrap();
    assert_eq!(wait(&mut e, h, Duration::from_secs(5)), TransferStatus::Done);
    // ...then, once deregister returned (the initiator confirmed), none may.
    target.deregister(reg).unwrap();
    let zero_from = PAGE as usize;
    for i in 1..20u64 {
        let h = e
            .post(Op::Write, &[Desc::new(buf.addr(), PAGE)], "target", &[Desc::new(dst + i * PAGE, PAGE)], None)
            .unwrap();
        match wait(&mut e, h, Duration::from_secs(5)) {
            TransferStatus::Failed(why) => {
                assert_eq!(why.kind, FailureKind::RemoteAccess(RemoteAccessKind::UnknownKey), "{why}")
            }
            other => panic!("post {i} after deregister: {other:?}"),
        }
    }
    let bytes = if memfd { host.to_vec(..) } else { heap.to_vec() };
    assert!(bytes[zero_from..].iter().all(|&b| b == 0), "a deregistered region was written");
}

#[test]
fn after_deregister_returns_no_access_lands_memfd() {
    deregistered_region_is_never_written(true);
}

#[test]
fn after_deregister_returns_no_access_lands_cross_memory_attach() {
    deregistered_region_is_never_written(false);
}
