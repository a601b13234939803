//! Issue 27 (smaller items): a hung-but-alive peer and a dead one are told
//! apart, the same way on shm and tcp. Transfers to a target process that is
//! stopped (SIGSTOP) fail `PeerTimeout` after `peer_timeout`; transfers to
//! one that is killed fail `PeerDied`, and the next post to it raises
//! `TransportError::PeerDisconnected` at the call. Targets are child
//! processes (`common::ChildTarget`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ChildTarget, wait};
use kvwire::HostBuffer;
use kvwire::engine::{Desc, EngineError, TransferEngine, TransferHandle, TransferStatus};
use kvwire::transport::{FailureKind, Op, TransportConfig, TransportError, TransportKind};

#[test]
#[ignore = "child process entry point, started by the other tests"]
fn child_entry() {
    common::child_main();
}

fn setup(kind: TransportKind, timeout: Duration) -> (ChildTarget, TransferEngine, Arc<HostBuffer>) {
    let t = ChildTarget::spawn_on(kind, "target", &[(1 << 20, true)]);
    let cfg = TransportConfig { peer_timeout: timeout, ..TransportConfig::default() };
    let mut e = TransferEngine::new("initiator", kind, &cfg).unwrap();
    let buf = Arc::new(HostBuffer::new(1 << 20).unwrap());
    e.register(buf.clone()).unwrap();
    e.connect(&t.meta).unwrap();
    (t, e, buf)
}

fn post(e: &mut TransferEngine, t: &ChildTarget, buf: &HostBuffer, note: u8) -> Result<TransferHandle, EngineError> {
    let addr = t.meta.regions[0].addr;
    e.post(Op::Write, &[Desc::new(buf.addr(), 4096)], "target", &[Desc::new(addr, 4096)], Some(vec![note; 8]))
}

fn failed_kind(s: TransferStatus) -> FailureKind {
    match s {
        TransferStatus::Failed(why) => why.kind,
        other => panic!("expected a failed transfer, got {other:?}"),
    }
}

fn hung_times_out(kind: TransportKind) {
    let (t, mut e, buf) = setup(kind, Duration::from_millis(800));
    // Alive and answering first: the same post completes.
    let h = post(&mut e, &t, &buf, 0).unwrap();
    assert_eq!(wait(&mut e, h, Duration::from_secs(20)), TransferStatus::Done, "{kind}");
    t.signal(libc::SIGSTOP);
    let h = post(&mut e, &t, &buf, 1).unwrap();
    assert_eq!(
        failed_kind(wait(&mut e, h, Duration::from_secs(30))),
        FailureKind::PeerTimeout,
        "{kind}: stopped target"
    );
    t.signal(libc::SIGCONT);
}

fn dead_is_peer_died(kind: TransportKind) {
    let (mut t, mut e, buf) = setup(kind, Duration::from_secs(30));
    // Stopped first, so that the transfer is surely in flight when the
    // target dies (well inside the 30 s timeout).
    t.signal(libc::SIGSTOP);
    let h = post(&mut e, &t, &buf, 2).unwrap();
    assert_eq!(e.wait(h, Duration::from_millis(100)).unwrap(), TransferStatus::InProgress, "{kind}");
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    let began = Instant::now();
    assert_eq!(failed_kind(wait(&mut e, h, Duration::from_secs(20))), FailureKind::PeerDied, "{kind}: killed target");
    assert!(began.elapsed() < Duration::from_secs(20), "{kind}: a dead peer must not wait for the timeout");
    match post(&mut e, &t, &buf, 3) {
        Err(EngineError::Transport(TransportError::PeerDisconnected(_))) => {}
        other => panic!("{kind}: a post to a dead peer must raise PeerDisconnected, got {other:?}"),
    }
}

#[test]
fn shm_a_stopped_target_times_out() {
    hung_times_out(TransportKind::Shm);
}

#[test]
fn tcp_a_stopped_target_times_out() {
    hung_times_out(TransportKind::Tcp);
}

#[test]
fn shm_a_killed_target_is_peer_died() {
    dead_is_peer_died(TransportKind::Shm);
}

#[test]
fn tcp_a_killed_target_is_peer_died() {
    dead_is_peer_died(TransportKind::Tcp);
}

/// Releasing (cancelling) a transfer whose bytes are on the wire to a
/// stopped target returns once nothing can touch its buffers — at once, not
/// after `peer_timeout` (tcp used to wait in the worker's blocked syscall
/// for the whole timeout, holding the engine, and the `mooncake` package's
/// -2 with it). The peer stays usable: once the target resumes, the next
/// transfer to it completes (tcp opened the cut connection again).
fn cancel_to_a_stopped_target(kind: TransportKind) {
    let timeout = Duration::from_secs(60);
    let (t, mut e, buf) = setup(kind, timeout);
    let h = post(&mut e, &t, &buf, 4).unwrap();
    assert_eq!(wait(&mut e, h, Duration::from_secs(20)), TransferStatus::Done, "{kind}");
    t.signal(libc::SIGSTOP);
    let addr = t.meta.regions[0].addr;
    // 1 MiB with a notification: more than the socket buffers take, so a
    // tcp worker is blocked sending it, and on shm the notification waits
    // for the stopped target.
    let big = e
        .post(Op::Write, &[Desc::new(buf.addr(), 1 << 20)], "target", &[Desc::new(addr, 1 << 20)], Some(vec![7; 8]))
        .unwrap();
    let small = post(&mut e, &t, &buf, 5).unwrap();
    assert_eq!(e.wait(big, Duration::from_millis(200)).unwrap(), TransferStatus::InProgress, "{kind}");
    let began = Instant::now();
    e.release(big).unwrap();
    e.release(small).unwrap();
    let took = began.elapsed();
    t.signal(libc::SIGCONT);
    assert!(took < timeout / 2, "{kind}: release waited {took:?}, as if for the peer timeout ({timeout:?})");
    let h = post(&mut e, &t, &buf, 6).unwrap();
    assert_eq!(wait(&mut e, h, Duration::from_secs(30)), TransferStatus::Done, "{kind}: the peer after the cancel");
}

#[test]
fn shm_cancel_to_a_stopped_target_returns_at_once() {
    cancel_to_a_stopped_target(TransportKind::Shm);
}

#[test]
fn tcp_cancel_to_a_stopped_target_returns_at_once() {
    cancel_to_a_stopped_target(TransportKind::Tcp);
}
