//! Engine tests of the NIXL-API additions (standalone notifications,
//! metadata re-load, prep-time checks, telemetry, dead peers, loopback,
//! agent names), each on the shm and the tcp transport, with both agents in
//! this process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::transport::TransportError;
use crate::transport::shm::HostBuffer;

fn config(kind: TransportKind) -> TransportConfig {
    let mut c = TransportConfig { peer_timeout: Duration::from_secs(2), ..TransportConfig::default() };
    if kind == TransportKind::Tcp {
        c.options.push(("listen".into(), "127.0.0.1:0".into()));
    }
    c
}

fn agent(name: &str, kind: TransportKind, len: usize) -> (TransferEngine, Arc<HostBuffer>) {
    let mut e = TransferEngine::new(name, kind, &config(kind)).unwrap();
    let b = Arc::new(HostBuffer::new(len).unwrap());
    e.register(b.clone()).unwrap();
    (e, b)
}

fn pair(kind: TransportKind, len: usize) -> ((TransferEngine, Arc<HostBuffer>), (TransferEngine, Arc<HostBuffer>)) {
    let (mut a, ab) = agent("a", kind, len);
    let (b, bb) = agent("b", kind, len);
    a.connect(&b.metadata()).unwrap();
    ((a, ab), (b, bb))
}

fn wait(e: &mut TransferEngine, h: TransferHandle) -> TransferStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = e.status(h).unwrap();
        if s != TransferStatus::InProgress || Instant::now() > deadline {
            return s;
        }
        std::thread::yield_now();
    }
}

/// Wait for `n` notifications at `e`; returns them per sender.
fn notifs(e: &mut TransferEngine, n: usize) -> HashMap<String, Vec<Vec<u8>>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    while got.values().map(Vec::len).sum::<usize>() < n && Instant::now() < deadline {
        for (k, v) in e.get_notifs() {
            got.entry(k).or_default().extend(v);
        }
        std::thread::yield_now();
    }
    got
}

fn standalone_notification_is_binary_safe_and_follows_earlier_data(kind: TransportKind) {
    let len = 8 << 20;
    let ((mut a, ab), (mut b, bb)) = pair(kind, len);
    ab.fill_with(0, len, |i| (i % 251) as u8);
    let d = [Desc::new(ab.addr(), len as u64)];
    let r = [Desc::new(bb.addr(), len as u64)];
    let h = a.post(Op::Write, &d, "b", &r, None).unwrap();
    a.notify("b", b"n\0tification".to_vec()).unwrap();
    a.notify("b", b"second".to_vec()).unwrap();
    // The sender keeps polling its own transfer, as NIXL users do.
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}");
    let got = notifs(&mut b, 1);
    // The first notification is seen only once the whole WRITE is visible.
    assert!(bb.to_vec(..).iter().enumerate().all(|(i, &x)| x == (i % 251) as u8), "{kind}: data before notif");
    let mut all = got.get("a").cloned().unwrap_or_default();
    all.extend(notifs(&mut b, 2 - all.len()).remove("a").unwrap_or_default());
    assert_eq!(all, vec![b"n\0tification".to_vec(), b"second".to_vec()], "{kind}");
    assert!(matches!(a.notify("nobody", b"x".to_vec()), Err(EngineError::UnknownAgent(_))));
    assert!(a.notify("b", vec![0; peers::MAX_NOTIFY_BYTES + 1]).is_err());
    // Nothing in flight: the notification leaves at once, with no more polling by the sender.
    a.notify("b", Vec::new()).unwrap();
    assert_eq!(notifs(&mut b, 1).remove("a"), Some(vec![Vec::new()]), "{kind}: empty payload");
}

fn reloading_a_known_agent_updates_regions_and_refuses_changed_connection_info(kind: TransportKind) {
    let ((mut a, ab), (mut b, _bb)) = pair(kind, 1 << 16);
    assert_eq!(a.load_remote(&b.metadata()).unwrap(), LoadOutcome::Unchanged);
    let extra = Arc::new(HostBuffer::new(1 << 16).unwrap());
    b.register(extra.clone()).unwrap();
    let r = [Desc::new(extra.addr(), 4096)];
    assert!(matches!(a.check_remote("b", &r), Err(EngineError::RemoteOutOfBounds { .. })));
    assert_eq!(a.load_remote(&b.metadata()).unwrap(), LoadOutcome::Updated, "{kind}");
    a.check_remote("b", &r).unwrap();
    ab.fill_with(0, 4096, |_| 0x5a);
    let h = a.post(Op::Write, &[Desc::new(ab.addr(), 4096)], "b", &r, Some(b"after-update".to_vec())).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}");
    assert!(extra.to_vec(..4096).iter().all(|&x| x == 0x5a));
    assert_eq!(notifs(&mut b, 1).remove("a"), Some(vec![b"after-update".to_vec()]));
    a.release(h).unwrap();
    // The same name at another address is refused until removed.
    let (other, _ob) = agent("c", kind, 4096);
    let mut moved = b.metadata();
    moved.connection_info = other.metadata().connection_info;
    assert!(matches!(a.load_remote(&moved), Err(EngineError::MetadataConflict(n)) if n == "b"), "{kind}");
    assert!(a.is_remote_loaded("b"));
    a.disconnect("b").unwrap();
    assert!(!a.is_remote_loaded("b"));
    assert_eq!(a.load_remote(&b.metadata()).unwrap(), LoadOutcome::Connected);
}

fn a_load_in_three_steps_is_checked_again_when_it_finishes(kind: TransportKind) {
    let (mut a, ab) = agent("a", kind, 1 << 16);
    let (b, bb) = agent("b", kind, 1 << 16);
    // Two dials of one agent: the first to finish connects, the second is
    // dropped (its connection closes) and the first one's connection works.
    let LoadStep::Dial(first) = a.begin_load(&b.metadata()).unwrap() else { panic!("{kind}: new agent must dial") };
    let LoadStep::Dial(second) = a.begin_load(&b.metadata()).unwrap() else { panic!("{kind}: still not loaded") };
    assert_eq!(first.name(), "b");
    let (first, second) = (first.dial().unwrap(), second.dial().unwrap());
    assert!(!a.is_remote_loaded("b"), "{kind}: a dial alone loads nothing");
    assert_eq!(a.finish_load(first).unwrap(), LoadOutcome::Connected, "{kind}");
    assert_eq!(a.finish_load(second).unwrap(), LoadOutcome::Unchanged, "{kind}");
    ab.fill_with(0, 4096, |_| 0xa5);
    let h = a.post(Op::Write, &[Desc::new(ab.addr(), 4096)], "b", &[Desc::new(bb.addr(), 4096)], None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}");
    assert!(bb.to_vec(..4096).iter().all(|&x| x == 0xa5), "{kind}");
    a.release(h).unwrap();
    // Loaded meanwhile under other connection info: refused, nothing kept.
    let (c, _cb) = agent("c", kind, 4096);
    let mut moved = c.metadata();
    moved.name = "b".into();
    a.disconnect("b").unwrap();
    let LoadStep::Dial(stale) = a.begin_load(&moved).unwrap() else { panic!("{kind}: removed agent must dial") };
    let stale = stale.dial().unwrap();
    assert_eq!(a.load_remote(&b.metadata()).unwrap(), LoadOutcome::Connected, "{kind}");
    assert!(matches!(a.finish_load(stale), Err(EngineError::MetadataConflict(n)) if n == "b"), "{kind}");
    let h = a.post(Op::Write, &[Desc::new(ab.addr(), 4096)], "b", &[Desc::new(bb.addr(), 4096)], None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}: the first load still stands");
    a.release(h).unwrap();
    // A dial made by another engine is refused by this one's transport.
    let (mut a2, _a2b) = agent("a2", kind, 4096);
    let LoadStep::Dial(foreign) = a.begin_load(&c.metadata()).unwrap() else { panic!("{kind}: c is new") };
    let foreign = foreign.dial().unwrap();
    assert!(
        matches!(a2.finish_load(foreign), Err(EngineError::Transport(TransportError::Unsupported(_)))),
        "{kind}: a foreign dial must be refused"
    );
    assert!(!a2.is_remote_loaded("c"), "{kind}");
}

fn descriptors_are_checked_without_posting(kind: TransportKind) {
    let ((a, ab), (b, bb)) = pair(kind, 1 << 16);
    let base = ab.addr();
    a.check_local(&[Desc::new(base, 1 << 16), Desc::new(base + 100, 8)]).unwrap();
    assert!(matches!(
        a.check_local(&[Desc::new(base, 8), Desc::new(base + (1 << 16) - 4, 8)]),
        Err(EngineError::LocalOutOfBounds { index: 1, .. })
    ));
    assert!(matches!(a.check_local(&[Desc::new(base, 0)]), Err(EngineError::EmptyDescriptor { index: 0 })));
    a.check_remote("b", &[Desc::new(bb.addr(), 1 << 16)]).unwrap();
    assert!(matches!(
        a.check_remote("b", &[Desc::new(bb.addr() + 1, 1 << 16)]),
        Err(EngineError::RemoteOutOfBounds { index: 0, .. })
    ));
    assert!(matches!(a.check_remote("zz", &[]), Err(EngineError::UnknownAgent(_))));
    // Own name: checked against this agent's registrations.
    a.check_remote("a", &[Desc::new(base, 64)]).unwrap();
    assert!(matches!(a.check_remote("a", &[Desc::new(bb.addr(), 64)]), Err(EngineError::RemoteOutOfBounds { .. })));
    assert_eq!(a.num_transfers(), 0, "{kind}: checks post nothing");
    drop(b);
}

fn telemetry_counts_user_descriptors_and_never_reports_zero_durations(kind: TransportKind) {
    let ((mut a, ab), (_b, bb)) = pair(kind, 1 << 16);
    // Two adjacent 64-byte halves, as NIXL's test_nixl_api.py posts them.
    let l = [Desc::new(ab.addr(), 64), Desc::new(ab.addr() + 64, 64)];
    let r = [Desc::new(bb.addr(), 64), Desc::new(bb.addr() + 64, 64)];
    let h = a.post(Op::Write, &l, "b", &r, None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done);
    let t = a.telemetry(h).unwrap();
    assert_eq!((t.desc_count, t.bytes), (2, 128), "{kind}");
    assert!(t.post_us > 0 && t.xfer_us >= t.post_us, "{kind}: {t:?}");
    let now = telemetry::unix_us();
    assert!(t.start_us <= now && now - t.start_us < 60_000_000, "{kind}: start {t:?}");
    a.release(h).unwrap();
    assert!(matches!(a.telemetry(h), Err(EngineError::UnknownHandle(_))));
}

fn a_dead_peer_fails_fast_and_stays_known_until_removed(kind: TransportKind) {
    let ((mut a, ab), (b, bb)) = pair(kind, 1 << 20);
    let (l, r) = ([Desc::new(ab.addr(), 1 << 20)], [Desc::new(bb.addr(), 1 << 20)]);
    drop(b);
    // The peer's death shows up either at post or as the transfer's failure.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut cause = None;
    while a.is_connected("b") && Instant::now() < deadline {
        match a.post(Op::Write, &l, "b", &r, None) {
            Ok(h) => {
                if let TransferStatus::Failed(_) = wait(&mut a, h) {
                    cause = a.failure_cause(h).unwrap();
                }
                a.release(h).unwrap();
            }
            Err(EngineError::Transport(TransportError::PeerDisconnected(_))) => {}
            Err(e) => panic!("{kind}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!a.is_connected("b"), "{kind}: death not noticed");
    assert!(cause.is_none() || cause == Some(FailureCause::PeerLost), "{kind}: {cause:?}");
    // Known, dead: loaded, prep-time checks pass, posts and notifications
    // fail fast with the typed reason (NIXL 1.5.1's REMOTE_DISCONNECT).
    assert!(a.is_remote_loaded("b"), "{kind}: a dead peer stays loaded until removed");
    assert!(a.remote_dead_reason("b").is_some());
    a.check_remote("b", &r).unwrap();
    for _ in 0..3 {
        assert!(
            matches!(
                a.post(Op::Write, &l, "b", &r, None),
                Err(EngineError::Transport(TransportError::PeerDisconnected(_)))
            ),
            "{kind}"
        );
        assert!(
            matches!(a.notify("b", b"HB".to_vec()), Err(EngineError::Transport(TransportError::PeerDisconnected(_)))),
            "{kind}"
        );
    }
    assert_eq!(a.num_transfers(), 0, "{kind}: nothing was left in flight");
    // Removing it never errors; removing it twice is an unknown agent.
    a.disconnect("b").unwrap();
    assert!(!a.is_remote_loaded("b"));
    assert!(matches!(a.disconnect("b"), Err(EngineError::UnknownAgent(_))));
    // A restarted peer of the same name loads again and works at once.
    let (mut b2, b2b) = agent("b", kind, 4096);
    assert_eq!(a.load_remote(&b2.metadata()).unwrap(), LoadOutcome::Connected, "{kind}");
    ab.fill_with(0, 4096, |i| (i * 3) as u8);
    let h = a
        .post(Op::Write, &[Desc::new(ab.addr(), 4096)], "b", &[Desc::new(b2b.addr(), 4096)], Some(b"x".to_vec()))
        .unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}");
    assert_eq!(b2b.to_vec(..), ab.to_vec(..4096));
    assert_eq!(notifs(&mut b2, 1).remove("a"), Some(vec![b"x".to_vec()]));
}

fn a_restarted_peer_replaces_a_dead_one_without_removal(kind: TransportKind) {
    let ((mut a, ab), (b, bb)) = pair(kind, 1 << 16);
    let (l, r) = ([Desc::new(ab.addr(), 1 << 16)], [Desc::new(bb.addr(), 1 << 16)]);
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.is_connected("b") && Instant::now() < deadline {
        if let Ok(h) = a.post(Op::Write, &l, "b", &r, None) {
            wait(&mut a, h);
            a.release(h).unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(a.is_remote_loaded("b") && !a.is_connected("b"), "{kind}");
    // add_remote_agent of the restarted peer (new connection info) replaces it.
    let (_b2, b2b) = agent("b", kind, 4096);
    assert_eq!(a.load_remote(&_b2.metadata()).unwrap(), LoadOutcome::Connected, "{kind}");
    assert!(a.is_connected("b"));
    b2b.fill_with(0, 4096, |_| 0x77);
    let h = a.post(Op::Read, &[Desc::new(ab.addr(), 4096)], "b", &[Desc::new(b2b.addr(), 4096)], None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}");
    assert!(ab.to_vec(..4096).iter().all(|&x| x == 0x77));
}

fn transfers_and_notifications_to_the_own_name_are_loopback(kind: TransportKind) {
    let (mut a, ab) = agent("self", kind, 1 << 16);
    ab.fill_with(0, 4096, |i| (i * 7) as u8);
    let h = a
        .post(
            Op::Write,
            &[Desc::new(ab.addr(), 4096)],
            "self",
            &[Desc::new(ab.addr() + 8192, 4096)],
            Some(b"lb".to_vec()),
        )
        .unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}");
    assert_eq!(ab.to_vec(..4096), ab.to_vec(8192..8192 + 4096));
    // A registration made after the first loopback post is reachable too.
    let extra = Arc::new(HostBuffer::new(4096).unwrap());
    a.register(extra.clone()).unwrap();
    let h = a.post(Op::Read, &[Desc::new(extra.addr(), 4096)], "self", &[Desc::new(ab.addr(), 4096)], None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{kind}");
    assert_eq!(extra.to_vec(..), ab.to_vec(..4096));
    a.notify("self", b"me".to_vec()).unwrap();
    let got = notifs(&mut a, 2).remove("self").unwrap_or_default();
    assert_eq!(got, vec![b"lb".to_vec(), b"me".to_vec()], "{kind}");
    assert!(!a.is_remote_loaded("self"));
}

fn wait_blocks_until_the_transfer_ends(kind: TransportKind) {
    let len = 64 << 20;
    let ((mut a, ab), (_b, bb)) = pair(kind, len);
    ab.fill_with(0, len, |i| (i % 253) as u8);
    let (l, r) = ([Desc::new(ab.addr(), len as u64)], [Desc::new(bb.addr(), len as u64)]);
    let h = a.post(Op::Write, &l, "b", &r, None).unwrap();
    let cpu0 = thread_cpu();
    let t0 = Instant::now();
    assert_eq!(a.wait(h, Duration::from_secs(30)).unwrap(), TransferStatus::Done, "{kind}");
    let (wall, cpu) = (t0.elapsed(), thread_cpu() - cpu0);
    assert!(bb.to_vec(..).iter().enumerate().all(|(i, &x)| x == (i % 253) as u8), "{kind}: data");
    // Terminal states stick: a second wait answers at once.
    assert_eq!(a.wait(h, Duration::ZERO).unwrap(), TransferStatus::Done, "{kind}");
    a.release(h).unwrap();
    assert!(matches!(a.wait(h, Duration::from_secs(1)), Err(EngineError::UnknownHandle(_))), "{kind}");
    // The waiting thread slept on the completion channel: it used a fraction
    // of the wall time (a polling loop used 30-55 % of it here, sharing two cores
    // with the copy threads; this wait 0.6 %). Only a wait long
    // enough to tell the two apart is judged.
    if wall > Duration::from_millis(5) {
        assert!(cpu < wall / 5, "{kind}: the waiter spun: {cpu:?} of CPU in {wall:?}");
    }
}

fn a_notification_queued_behind_a_waited_transfer_leaves_without_more_calls(kind: TransportKind) {
    let len = 64 << 20;
    let ((mut a, ab), (mut b, bb)) = pair(kind, len);
    let (l, r) = ([Desc::new(ab.addr(), len as u64)], [Desc::new(bb.addr(), len as u64)]);
    let h = a.post(Op::Write, &l, "b", &r, None).unwrap();
    // Queued behind `h` (in flight), sent once `h` is done.
    a.notify("b", b"after".to_vec()).unwrap();
    assert_eq!(a.wait(h, Duration::from_secs(30)).unwrap(), TransferStatus::Done, "{kind}");
    // `a` makes no further call: `wait` itself must have sent it.
    assert_eq!(notifs(&mut b, 1).remove("a"), Some(vec![b"after".to_vec()]), "{kind}");
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).map(Duration::from).unwrap()
}

#[test]
fn agent_names_must_be_1_to_255_bytes() {
    let c = TransportConfig::default();
    assert!(matches!(
        TransferEngine::new("", TransportKind::Shm, &c),
        Err(EngineError::BadAgentName { reason, .. }) if reason.contains("empty")
    ));
    let long = "x".repeat(256);
    assert!(matches!(
        TransferEngine::new(&long, TransportKind::Tcp, &config(TransportKind::Tcp)),
        Err(EngineError::BadAgentName { reason, .. }) if reason.contains("255")
    ));
    TransferEngine::new(&"y".repeat(255), TransportKind::Shm, &c).unwrap();
}

/// One `#[test]` per transport for each test body above.
macro_rules! per_transport {
    ($($name:ident),* $(,)?) => {
        mod shm {
            $(#[test] fn $name() { super::$name(super::TransportKind::Shm) })*
        }
        mod tcp {
            $(#[test] fn $name() { super::$name(super::TransportKind::Tcp) })*
        }
    };
}

per_transport!(
    standalone_notification_is_binary_safe_and_follows_earlier_data,
    reloading_a_known_agent_updates_regions_and_refuses_changed_connection_info,
    a_load_in_three_steps_is_checked_again_when_it_finishes,
    descriptors_are_checked_without_posting,
    telemetry_counts_user_descriptors_and_never_reports_zero_durations,
    a_dead_peer_fails_fast_and_stays_known_until_removed,
    a_restarted_peer_replaces_a_dead_one_without_removal,
    transfers_and_notifications_to_the_own_name_are_loopback,
    wait_blocks_until_the_transfer_ends,
    a_notification_queued_behind_a_waited_transfer_leaves_without_more_calls,
);
