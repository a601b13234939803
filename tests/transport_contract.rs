//! The transport contract (issue 28 item 2): one body of rules every backend
//! keeps, run over shm, tcp and verbs. Each rule is a function taking a
//! [`Backend`]; the macro at the end makes one test per rule and backend.
//! Verbs needs an RDMA device (the Soft-RoCE guest of
//! `scripts/softroce-tests.sh` runs this binary there); elsewhere its tests
//! print `<test>: skipped: <reason>` and, with `KVWIRE_REQUIRE_RDMA=1`, fail.
//! `verbs_sim` runs every rule in plain `cargo test` over the same
//! `VerbsTransport` on the simulated NIC (`VerbsTransport::on_sim`): both
//! agents in this process on one `SimFabric`, connected by the normal
//! handshake, the simulator moving the real bytes of the registered
//! buffers. The dead peer is the target's engine dropped, as on the other
//! backends: its QPs vanish from the fabric and its liveness channel closes.
//!
//! Rules: descriptors outside a peer's regions are refused before anything
//! moves (one error kind everywhere); a forged rkey is `UnknownKey` and a
//! known key out of range `OutOfBounds` on every backend; a range the
//! target never registered, claimed by its metadata, is refused by the
//! target's side (`OutOfBounds`); a notification is delivered only after
//! its transfer's data; standalone notifications keep their order; a dead
//! peer fails transfers within the peer timeout and is refused fast after;
//! release of an in-flight transfer fences the memory (no byte lands after
//! it returns); deregistering memory a transfer still uses is refused; a
//! removed peer reconnects and moves bytes again; overlapping registrations
//! are accepted, each with its own bounds; a completion signal wakes a
//! waiter that holds no engine and takes nothing from the channel.

mod verbs_util;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{AgentMetadata, Desc, EngineError, LoadOutcome, LoadStep, TransferEngine, TransferStatus};
use kvwire::transport::shm::wire::ShmInfo;
use kvwire::transport::tcp::TcpConnectionInfo;
use kvwire::transport::verbs::VerbsTransport;
use kvwire::transport::verbs::sim::{SimFabric, SimNic};
use kvwire::transport::{
    FailureKind, MemoryBacking, MemoryKind, Op, PostRequest, RemoteAccessKind, RemoteKey, RemoteRegion, Segment,
    TransferFailure, Transport, TransportConfig, TransportError, TransportKind, View, XferId,
};

#[derive(Clone, Copy, Debug)]
enum Backend {
    Shm,
    Tcp,
    Verbs,
    /// `VerbsTransport` over the simulated NIC.
    VerbsSim,
}

/// Fabric steps each `poll_cq` of a progress thread runs (the simulated
/// NIC moves only when stepped).
const SIM_STEPS_PER_POLL: u32 = 64;

/// The peer timeout of the simulated pairs.
const SIM_PEER_TIMEOUT: Duration = Duration::from_secs(2);

/// Two verbs transports on one new simulated fabric, seeded by the test.
fn sim_transports(
    test: &str,
    extra: &[(&str, &str)],
    peer_timeout: Duration,
) -> (String, String, VerbsTransport<SimNic>, VerbsTransport<SimNic>) {
    let seed = test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let fabric = SimFabric::new(seed);
    fabric.world().auto_step = SIM_STEPS_PER_POLL;
    let mut c = TransportConfig { peer_timeout, ..Default::default() };
    for (k, v) in extra {
        c.options.push((k.to_string(), v.to_string()));
    }
    let tag = format!("{test}-{}", std::process::id());
    let (an, bn) = (format!("a-{tag}"), format!("b-{tag}"));
    let a = VerbsTransport::on_sim(&an, &c, &fabric).unwrap();
    let b = VerbsTransport::on_sim(&bn, &c, &fabric).unwrap();
    (an, bn, a, b)
}

/// Engines `a` (initiator) and `b` (target) of `backend`, or why not.
fn pair(backend: Backend, test: &str, extra: &[(&str, &str)]) -> Option<(TransferEngine, TransferEngine)> {
    pair_timing_out(backend, test, extra, None)
}

/// [`pair`] with `peer_timeout` on both sides instead of the backend's
/// default for these tests.
fn pair_timing_out(
    backend: Backend,
    test: &str,
    extra: &[(&str, &str)],
    peer_timeout: Option<Duration>,
) -> Option<(TransferEngine, TransferEngine)> {
    if let Backend::VerbsSim = backend {
        let (an, bn, a, b) = sim_transports(test, extra, peer_timeout.unwrap_or(SIM_PEER_TIMEOUT));
        return Some((
            TransferEngine::with_transport(&an, Box::new(a)),
            TransferEngine::with_transport(&bn, Box::new(b)),
        ));
    }
    let (kind, mut ca, mut cb, tag) = configs(backend, test, extra)?;
    if let Some(t) = peer_timeout {
        (ca.peer_timeout, cb.peer_timeout) = (t, t);
    }
    let a = TransferEngine::new(&format!("a-{tag}"), kind, &ca).unwrap();
    let b = TransferEngine::new(&format!("b-{tag}"), kind, &cb).unwrap();
    Some((a, b))
}

/// Initiator, target and the target's agent name.
type RawPair = (Box<dyn Transport>, Box<dyn Transport>, String);

/// Bare transports `a` (initiator) and `b` (target, with its name) of
/// `backend`, for rules the engine's own checks would hide (forged keys).
fn raw_pair(backend: Backend, test: &str) -> Option<RawPair> {
    raw_pair_with(backend, test, &[])
}

/// [`raw_pair`] with `extra` options on both sides.
fn raw_pair_with(backend: Backend, test: &str, extra: &[(&str, &str)]) -> Option<RawPair> {
    if let Backend::VerbsSim = backend {
        let (_, bn, a, b) = sim_transports(test, extra, SIM_PEER_TIMEOUT);
        return Some((Box::new(a), Box::new(b), bn));
    }
    let (kind, ca, cb, tag) = configs(backend, test, extra)?;
    let a = kvwire::transport::create(kind, &format!("a-{tag}"), &ca).unwrap();
    let b = kvwire::transport::create(kind, &format!("b-{tag}"), &cb).unwrap();
    Some((a, b, format!("b-{tag}")))
}

/// The transport kind and the initiator's and target's configurations.
fn configs(
    backend: Backend,
    test: &str,
    extra: &[(&str, &str)],
) -> Option<(TransportKind, TransportConfig, TransportConfig, String)> {
    let tag = format!("{test}-{}", std::process::id());
    let (kind, ca, cb) = match backend {
        Backend::Shm | Backend::Tcp => {
            let mut c = TransportConfig { peer_timeout: Duration::from_secs(2), ..Default::default() };
            for (k, v) in extra {
                c.options.push((k.to_string(), v.to_string()));
            }
            let kind = if matches!(backend, Backend::Shm) { TransportKind::Shm } else { TransportKind::Tcp };
            (kind, c.clone(), c)
        }
        Backend::VerbsSim => unreachable!("built by sim_transports"),
        Backend::Verbs => match verbs_util::devices() {
            Ok((tdev, idev)) => {
                let mut ca = verbs_util::config(&idev, extra);
                let mut cb = verbs_util::config(&tdev, extra);
                ca.peer_timeout = Duration::from_secs(5);
                cb.peer_timeout = Duration::from_secs(5);
                (TransportKind::Verbs, ca, cb)
            }
            Err(why) => {
                if std::env::var("KVWIRE_REQUIRE_RDMA").as_deref() == Ok("1") {
                    panic!("{test}: no RDMA device ({why}) and KVWIRE_REQUIRE_RDMA=1");
                }
                eprintln!("{test}: skipped: no RDMA device ({why})");
                return None;
            }
        },
    };
    Some((kind, ca, cb, tag))
}

fn buf(len: usize, seed: u8) -> Arc<HostBuffer> {
    let b = Arc::new(HostBuffer::new(len).unwrap());
    b.fill_with(0, len, |i| (i as u8).wrapping_mul(31).wrapping_add(seed));
    b
}

fn wait(e: &mut TransferEngine, h: kvwire::engine::TransferHandle) -> TransferStatus {
    e.wait(h, Duration::from_secs(60)).unwrap()
}

fn notifs(e: &mut TransferEngine, from: &str, n: usize) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < n {
        assert!(Instant::now() < deadline, "{n} notifications expected, got {}", got.len());
        got.extend(e.get_notifs().remove(from).unwrap_or_default());
    }
    got
}

fn out_of_bounds_is_refused_before_anything_moves(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "bounds", &[]) else { return };
    let (src, dst) = (buf(1 << 16, 1), buf(1 << 16, 0));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    a.connect(&b.metadata()).unwrap();
    let bn = b.name().to_string();
    let l = [Desc::new(src.addr(), 4096)];
    // past the end, before the start, straddling the end: one kind everywhere
    for r in [dst.addr() + (1 << 16), dst.addr() - 4096, dst.addr() + (1 << 16) - 100] {
        let e = a.post(Op::Write, &l, &bn, &[Desc::new(r, 4096)], None).unwrap_err();
        assert!(matches!(e, EngineError::RemoteOutOfBounds { .. }), "{be:?}: {e}");
    }
    // an unregistered local range: the local check, one kind everywhere
    let stray = buf(4096, 9);
    let e = a.post(Op::Write, &[Desc::new(stray.addr(), 4096)], &bn, &[Desc::new(dst.addr(), 4096)], None).unwrap_err();
    assert!(matches!(e, EngineError::LocalOutOfBounds { .. }), "{be:?}: {e}");
    assert_eq!(a.num_transfers(), 0);
    let zeros = buf(1 << 16, 0);
    assert_eq!(dst.to_vec(..), zeros.to_vec(..), "{be:?}: nothing moved");
}

/// A key that names no region is `RemoteAccess(UnknownKey)` on every
/// backend, a known key with a range outside its region `OutOfBounds`
/// (issue 27: verbs said `OutOfBounds` for both); neither moves a byte or
/// delivers the notification, and the link still works after. Bare
/// transports: the engine never posts a key outside the peer's metadata.
fn a_forged_rkey_is_an_unknown_key(be: Backend) {
    let Some((mut a, mut b, bn)) = raw_pair(be, "rkey") else { return };
    let (src, dst) = (buf(1 << 16, 6), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    let ireg = a.register(src.clone()).unwrap();
    let treg = b.register(dst.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: treg.rkey, kind: d.kind, device_id: 0 };
    let peer = a.connect(&bn, &b.connection_info(), &[region]).unwrap();
    let seg = |rkey: RemoteKey, remote_addr: u64| Segment {
        local_addr: src.addr(),
        remote_addr,
        len_bytes: 4096,
        lkey: ireg.lkey,
        rkey,
    };
    let forged = RemoteKey(treg.rkey.0 ^ 0x5a5a00);
    let cases = [
        (1, forged, dst.addr(), RemoteAccessKind::UnknownKey),
        (2, treg.rkey, dst.addr() + (1 << 16) - 100, RemoteAccessKind::OutOfBounds),
    ];
    for (x, rkey, at, want) in cases {
        let segments = vec![seg(rkey, at)];
        a.post(PostRequest { xfer: XferId(x), op: Op::Write, peer, segments, notification: Some(vec![x as u8]) })
            .unwrap();
        let why = result_of(&mut a, be, x).expect_err("a forged access must fail");
        assert_eq!(why.kind, FailureKind::RemoteAccess(want), "{be:?}: {why}");
    }
    assert!(dst.to_vec(..).iter().all(|&b| b == 0), "{be:?}: bytes moved through a forged access");
    let segments = vec![seg(treg.rkey, dst.addr())];
    a.post(PostRequest { xfer: XferId(3), op: Op::Write, peer, segments, notification: Some(vec![3]) }).unwrap();
    assert_eq!(result_of(&mut a, be, 3), Ok(()), "{be:?}");
    assert_eq!(dst.to_vec(..4096), src.to_vec(..4096), "{be:?}");
    only_notification_is(&mut b, be, &[3]);
}

/// Wait (up to 60 s) for transfer `x`'s completion on `a`; its result.
fn result_of(a: &mut Box<dyn Transport>, be: Backend, x: u64) -> Result<(), TransferFailure> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    loop {
        a.wait(&mut out, Duration::from_millis(50));
        if let Some(c) = out.iter().find(|c| c.xfer == XferId(x)) {
            return c.result.clone();
        }
        assert!(Instant::now() < deadline, "{be:?}: transfer {x} never completed");
    }
}

/// The target `b` receives exactly one notification, `want` (waits up to
/// 30 s for the first, then 50 ms for any other).
fn only_notification_is(b: &mut Box<dyn Transport>, be: Backend, want: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.is_empty() && Instant::now() < deadline {
        b.take_notifications(&mut got);
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    b.take_notifications(&mut got);
    let payloads: Vec<Vec<u8>> = got.into_iter().map(|n| n.payload).collect();
    assert_eq!(payloads, vec![want.to_vec()], "{be:?}: only the valid transfer's notification arrives");
}

/// Metadata claiming more than the target registered (a stale or forged
/// region) passes the initiator's own checks; the target's side then refuses
/// the access (shm and tcp: the target's table; verbs: the HCA, or the
/// simulator, with `IBV_WC_REM_ACCESS_ERR`): `RemoteAccess(OutOfBounds)`, no
/// byte written (not even the part inside), no notification, and the link
/// works again after (on verbs, through a reconnect of the failed QP).
fn the_targets_own_check_refuses_what_it_never_registered(be: Backend) {
    let Some((mut a, mut b, bn)) = raw_pair(be, "claim") else { return };
    let src = buf(1 << 16, 8);
    // The target registers the first half; the second half is a canary.
    let dst = Arc::new(HostBuffer::new(1 << 17).unwrap());
    let ireg = a.register(src.clone()).unwrap();
    let treg = b.register(Arc::new(View::new(dst.clone(), 0, 1 << 16).unwrap())).unwrap();
    let claimed =
        RemoteRegion { addr: dst.addr(), len_bytes: 1 << 17, rkey: treg.rkey, kind: MemoryKind::Dram, device_id: 0 };
    let peer = a.connect(&bn, &b.connection_info(), &[claimed]).unwrap();
    let post = |a: &mut Box<dyn Transport>, x: u64, remote_addr: u64, len_bytes: u64| {
        let segments =
            vec![Segment { local_addr: src.addr(), remote_addr, len_bytes, lkey: ireg.lkey, rkey: treg.rkey }];
        a.post(PostRequest { xfer: XferId(x), op: Op::Write, peer, segments, notification: Some(vec![x as u8]) })
            .unwrap();
        result_of(a, be, x)
    };
    // Straddling the end of the registration, then wholly past it.
    for (x, at) in [(1, dst.addr() + (1 << 16) - 4096), (2, dst.addr() + (1 << 16))] {
        let why = post(&mut a, x, at, 8192).expect_err("an access outside the registration must fail");
        assert_eq!(why.kind, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds), "{be:?}: {why}");
    }
    assert!(dst.to_vec(..).iter().all(|&b| b == 0), "{be:?}: bytes written outside the registration");
    assert_eq!(post(&mut a, 3, dst.addr(), 4096), Ok(()), "{be:?}: the link works after");
    assert_eq!(dst.to_vec(..4096), src.to_vec(..4096), "{be:?}");
    only_notification_is(&mut b, be, &[3]);
}

fn a_notification_arrives_after_its_data(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "notifdata", &[]) else { return };
    let len = 8 << 20;
    let (src, dst) = (buf(len, 7), Arc::new(HostBuffer::new(len).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    a.connect(&b.metadata()).unwrap();
    let an = a.name().to_string();
    for round in 0..3u8 {
        src.fill_with(0, len, |i| (i as u8).wrapping_add(round.wrapping_mul(17)));
        // scattered pages, so the data moves as many segments
        let pages = len / 4096;
        let l: Vec<Desc> = (0..pages).map(|p| Desc::new(src.addr() + (p * 4096) as u64, 4096)).collect();
        let r: Vec<Desc> = (0..pages).map(|p| Desc::new(dst.addr() + ((pages - 1 - p) * 4096) as u64, 4096)).collect();
        let h = a.post(Op::Write, &l, b.name(), &r, Some(vec![round])).unwrap();
        // the moment the target sees the notification, every byte is there
        assert_eq!(notifs(&mut b, &an, 1), vec![vec![round]], "{be:?}");
        for p in (0..pages).step_by(97) {
            let want = src.to_vec(p * 4096..(p + 1) * 4096);
            let at = (pages - 1 - p) * 4096;
            assert_eq!(dst.to_vec(at..at + 4096), want, "{be:?}: page {p} not there at the notification");
        }
        assert_eq!(wait(&mut a, h), TransferStatus::Done);
        a.release(h).unwrap();
    }
}

fn standalone_notifications_keep_their_order(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "notiforder", &[]) else { return };
    a.connect(&b.metadata()).unwrap();
    let an = a.name().to_string();
    let sent: Vec<Vec<u8>> = (0..200u32).map(|i| i.to_le_bytes().to_vec()).collect();
    for m in &sent {
        a.notify(b.name(), m.clone()).unwrap();
        a.progress();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < sent.len() {
        assert!(Instant::now() < deadline, "{be:?}: {} of {}", got.len(), sent.len());
        a.progress();
        got.extend(b.get_notifs().remove(&an).unwrap_or_default());
    }
    assert_eq!(got, sent, "{be:?}");
}

/// Issue 27 item 3: a target that takes no notification holds at most its
/// bound of one peer's (`notif_queue_count`); past it the sender's
/// transfers fail `Overloaded` (shm, tcp: each one past the bound; verbs:
/// the SENDs wait at the NIC, and posts past the sender's 256 notification
/// slots fail); once the target takes them, every notification not refused
/// arrives exactly once (in order on verbs, tested there: transfers posted
/// bare over tcp's `conns_per_peer` connections are not ordered).
fn a_target_that_takes_nothing_holds_its_bound_and_loses_none(be: Backend) {
    let bound = 8usize;
    let Some((mut a, mut t, tn)) = raw_pair_with(be, "notifbound", &[("notif_queue_count", "8")]) else { return };
    let peer = a.connect(&tn, &t.connection_info(), &[]).unwrap();
    let total = 400u64;
    for x in 0..total {
        let notification = Some(x.to_le_bytes().to_vec());
        a.post(PostRequest { xfer: XferId(x), op: Op::Write, peer, segments: vec![], notification }).unwrap();
    }
    let mut done = Vec::new();
    let mut quiet = Instant::now();
    // Until the sender has gone quiet: held SENDs wait at the NIC, the rest
    // were refused. A real (emulated) rxe delivers slowly: a longer window.
    let settle = Duration::from_millis(if matches!(be, Backend::Verbs) { 1500 } else { 300 });
    while quiet.elapsed() < settle {
        let n = done.len();
        a.wait(&mut done, Duration::from_millis(10));
        if done.len() > n {
            quiet = Instant::now();
        }
    }
    let mut got = Vec::new();
    t.take_notifications(&mut got);
    assert_eq!(got.len(), bound, "{be:?}: the target's queue holds the peer's bound");
    let deadline = Instant::now() + Duration::from_secs(30);
    let refused = |done: &[kvwire::transport::Completion]| done.iter().filter(|c| c.result.is_err()).count();
    while done.len() < total as usize || got.len() < total as usize - refused(&done) {
        assert!(Instant::now() < deadline, "{be:?}: {} notifications, {} completions", got.len(), done.len());
        a.wait(&mut done, Duration::from_millis(1));
        t.take_notifications(&mut got);
    }
    t.take_notifications(&mut got);
    let failed: Vec<_> = done.iter().filter_map(|c| c.result.as_ref().err().map(|f| (c.xfer.0, f))).collect();
    assert!(!failed.is_empty(), "{be:?}: {total} notifications to a target that took none, none refused");
    assert!(failed.iter().all(|(_, f)| f.kind == FailureKind::Overloaded), "{be:?}: {failed:?}");
    let want: Vec<Vec<u8>> =
        (0..total).filter(|x| !failed.iter().any(|(y, _)| y == x)).map(|x| x.to_le_bytes().to_vec()).collect();
    assert!(got.iter().all(|n| n.from_agent == a_name(&tn)), "{be:?}");
    let mut got: Vec<Vec<u8>> = got.into_iter().map(|n| n.payload).collect();
    got.sort_by_key(|p| u64::from_le_bytes(p[..8].try_into().unwrap()));
    assert_eq!(got, want, "{be:?}: each once");
}

/// The initiator's name for a target named `b-<tag>` (`raw_pair`).
fn a_name(target: &str) -> String {
    format!("a-{}", target.strip_prefix("b-").unwrap_or(target))
}

fn a_dead_peer_fails_within_the_timeout_then_fast(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "deadpeer", &[]) else { return };
    let (src, dst) = (buf(1 << 20, 3), Arc::new(HostBuffer::new(1 << 20).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    a.connect(&b.metadata()).unwrap();
    let bn = b.name().to_string();
    drop(b);
    let (l, r) = ([Desc::new(src.addr(), 1 << 20)], [Desc::new(dst.addr(), 1 << 20)]);
    // the first posts may be accepted; each ends (never hangs) and the peer
    // is found dead within a few peer timeouts
    let deadline = Instant::now() + Duration::from_secs(60);
    while a.is_connected(&bn) {
        assert!(Instant::now() < deadline, "{be:?}: the dead peer was not noticed");
        if let Ok(h) = a.post(Op::Write, &l, &bn, &r, None) {
            assert_ne!(wait(&mut a, h), TransferStatus::InProgress, "{be:?}: a transfer to a dead peer hung");
            a.release(h).unwrap();
        }
    }
    let e = a.post(Op::Write, &l, &bn, &r, None).unwrap_err();
    assert!(matches!(e, EngineError::Transport(TransportError::PeerDisconnected(_))), "{be:?}: {e}");
    a.disconnect(&bn).unwrap();
}

/// 32 MiB registered at `a` (filled from `seed`) and at `b`, `a` connected
/// to `b`, and the 4 KiB page descriptors that write `a`'s pages into `b`'s
/// in reverse order: `(src, dst, local, remote)`.
fn reversed_pages(
    a: &mut TransferEngine,
    b: &mut TransferEngine,
    seed: u8,
) -> (Arc<HostBuffer>, Arc<HostBuffer>, Vec<Desc>, Vec<Desc>) {
    let len = 32 << 20;
    let (src, dst) = (buf(len, seed), Arc::new(HostBuffer::new(len).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    a.connect(&b.metadata()).unwrap();
    let pages = len / 4096;
    let l: Vec<Desc> = (0..pages).map(|p| Desc::new(src.addr() + (p * 4096) as u64, 4096)).collect();
    let r: Vec<Desc> = (0..pages).map(|p| Desc::new(dst.addr() + ((pages - 1 - p) * 4096) as u64, 4096)).collect();
    (src, dst, l, r)
}

fn release_fences_the_memory(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "fence", &[]) else { return };
    let (_src, dst, l, r) = reversed_pages(&mut a, &mut b, 5);
    for _ in 0..3 {
        let h = a.post(Op::Write, &l, b.name(), &r, None).unwrap();
        a.release(h).unwrap();
        // after release returns, nothing more lands
        let snap = dst.to_vec(..);
        std::thread::sleep(Duration::from_millis(100));
        assert!(dst.to_vec(..) == snap, "{be:?}: bytes landed after release returned");
    }
    // the link still works afterwards
    let h = a.post(Op::Write, &l[..8], b.name(), &r[..8], None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
    a.release(h).unwrap();
}

fn deregistering_memory_in_use_is_refused(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "dereg", &[]) else { return };
    let len = 64 << 20;
    let (src, dst) = (buf(len, 2), Arc::new(HostBuffer::new(len).unwrap()));
    let hs = a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    a.connect(&b.metadata()).unwrap();
    let pages = len / 4096;
    let l: Vec<Desc> = (0..pages).map(|p| Desc::new(src.addr() + (p * 4096) as u64, 4096)).collect();
    let r: Vec<Desc> = (0..pages).map(|p| Desc::new(dst.addr() + ((pages - 1 - p) * 4096) as u64, 4096)).collect();
    let h = a.post(Op::Write, &l, b.name(), &r, None).unwrap();
    match a.deregister(hs) {
        Err(EngineError::RegistrationInUse { .. }) => {
            assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
            a.release(h).unwrap();
            a.deregister(hs).unwrap();
        }
        // the transfer had already finished: allowed, and then it is done
        Ok(()) => assert_eq!(a.status(h).unwrap(), TransferStatus::Done, "{be:?}: deregistered under a live transfer"),
        Err(e) => panic!("{be:?}: {e}"),
    }
}

fn a_removed_peer_reconnects(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "reconnect", &[]) else { return };
    let (src, dst) = (buf(1 << 16, 4), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    for _ in 0..3 {
        a.connect(&b.metadata()).unwrap();
        let h = a
            .post(Op::Write, &[Desc::new(src.addr(), 1 << 16)], b.name(), &[Desc::new(dst.addr(), 1 << 16)], None)
            .unwrap();
        assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
        a.release(h).unwrap();
        assert_eq!(dst.to_vec(..), src.to_vec(..));
        a.disconnect(b.name()).unwrap();
        assert!(!a.is_connected(b.name()));
    }
}

/// `n` views of `len / n` bytes each over one buffer (vLLM's shape: per
/// layer K and V views into one allocation).
fn views(b: &Arc<HostBuffer>, n: u64) -> Vec<Arc<dyn MemoryBacking>> {
    let each = b.len() as u64 / n;
    (0..n).map(|i| Arc::new(View::new(b.clone(), i * each, each).unwrap()) as Arc<dyn MemoryBacking>).collect()
}

/// Memory regions expected for `regs` registrations over one buffer.
fn one_region_on_verbs(be: Backend, regs: usize) -> usize {
    if matches!(be, Backend::Verbs | Backend::VerbsSim) { 1 } else { regs }
}

fn views_registered_as_a_list_move_data(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "views", &[]) else { return };
    let (src, dst) = (buf(1 << 16, 5), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    let ha = a.register_batch(views(&src, 16)).unwrap();
    let hb = b.register_batch(views(&dst, 16)).unwrap();
    assert_eq!(ha.len(), 16);
    assert_eq!(hb.len(), 16);
    // Each view is its own registration; on verbs they share one MR.
    assert_eq!(a.region_counts(), (16, one_region_on_verbs(be, 16)), "{be:?}");
    assert_eq!(b.region_counts(), (16, one_region_on_verbs(be, 16)), "{be:?}");
    assert_eq!(b.metadata().regions.len(), 16, "{be:?}: one published region per view");
    a.connect(&b.metadata()).unwrap();
    // Page i to page 15 - i: every transfer crosses views of the shared MR.
    let l: Vec<Desc> = (0..16).map(|i| Desc::new(src.addr() + i * 4096, 4096)).collect();
    let r: Vec<Desc> = (0..16).map(|i| Desc::new(dst.addr() + (15 - i) * 4096, 4096)).collect();
    let h = a.post(Op::Write, &l, b.name(), &r, None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
    a.release(h).unwrap();
    for i in 0..16usize {
        let at = (15 - i) * 4096;
        assert_eq!(dst.to_vec(at..at + 4096), src.to_vec(i * 4096..(i + 1) * 4096), "{be:?}: page {i}");
    }
    src.fill_with(0, 1 << 16, |_| 0);
    let h = a.post(Op::Read, &l, b.name(), &r, None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
    a.release(h).unwrap();
    assert_eq!(src.to_vec(..), buf(1 << 16, 5).to_vec(..), "{be:?}: read back");
    // Two descriptors of one local view to the abutting ends of two remote
    // views: on verbs (one rkey) the engine merges them into one segment
    // across the views, which the initiator's key check must accept.
    let l = [Desc::new(src.addr(), 2048), Desc::new(src.addr() + 2048, 2048)];
    let r = [Desc::new(dst.addr() + 2048, 2048), Desc::new(dst.addr() + 4096, 2048)];
    let h = a.post(Op::Write, &l, b.name(), &r, None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}: across abutting views");
    a.release(h).unwrap();
    assert_eq!(dst.to_vec(2048..6144), src.to_vec(..4096), "{be:?}");
}

fn bounds_hold_per_registration_of_a_view(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "viewbounds", &[]) else { return };
    let (src, dst) = (buf(1 << 16, 6), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    a.register_batch(views(&src, 16)).unwrap();
    b.register_batch(views(&dst, 16)).unwrap();
    a.connect(&b.metadata()).unwrap();
    // Straddling two abutting views (inside one verbs MR): refused on both
    // sides, one kind everywhere.
    let straddle_l = [Desc::new(src.addr() + 4096 - 512, 1024)];
    let e = a.post(Op::Write, &straddle_l, b.name(), &[Desc::new(dst.addr(), 1024)], None).unwrap_err();
    assert!(matches!(e, EngineError::LocalOutOfBounds { .. }), "{be:?}: {e}");
    let straddle_r = [Desc::new(dst.addr() + 4096 - 512, 1024)];
    let e = a.post(Op::Write, &[Desc::new(src.addr(), 1024)], b.name(), &straddle_r, None).unwrap_err();
    assert!(matches!(e, EngineError::RemoteOutOfBounds { .. }), "{be:?}: {e}");
    assert_eq!(dst.to_vec(..), vec![0; 1 << 16], "{be:?}: nothing moved");
}

/// The transport's own check (below the engine): a segment naming one
/// view's key with its neighbour's range is refused, although on verbs both
/// lie in one MR.
fn a_view_key_covers_only_its_view(be: Backend) {
    let Some((mut ta, mut tb, bn)) = raw_pair(be, "viewkey") else { return };
    let (src, dst) = (buf(1 << 16, 7), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    let ra = ta.register_batch(views(&src, 16)).unwrap();
    let rb = tb.register(dst.clone()).unwrap();
    let regions =
        [RemoteRegion { addr: dst.addr(), len_bytes: 1 << 16, rkey: rb.rkey, kind: MemoryKind::Dram, device_id: 0 }];
    let peer = ta.connect(&bn, &tb.connection_info(), &regions).unwrap();
    let seg = |lkey, at: u64| Segment {
        local_addr: src.addr() + at,
        remote_addr: dst.addr(),
        len_bytes: 4096,
        lkey,
        rkey: rb.rkey,
    };
    for (key, at) in [(ra[3].lkey, 4 * 4096), (ra[3].lkey, 2 * 4096), (ra[3].lkey, 3 * 4096 + 1)] {
        let req =
            PostRequest { xfer: XferId(1), op: Op::Write, peer, segments: vec![seg(key, at)], notification: None };
        let e = ta.post(req).unwrap_err();
        assert!(matches!(e, TransportError::LocalOutOfBounds { .. }), "{be:?}: {e}");
    }
    // Its own range goes.
    let req = PostRequest {
        xfer: XferId(2),
        op: Op::Write,
        peer,
        segments: vec![seg(ra[3].lkey, 3 * 4096)],
        notification: None,
    };
    ta.post(req).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut done = Vec::new();
    while done.is_empty() {
        assert!(Instant::now() < deadline, "{be:?}: no completion");
        ta.wait(&mut done, Duration::from_millis(50));
    }
    assert_eq!(done[0].result, Ok(()), "{be:?}");
    assert_eq!(dst.to_vec(..4096), src.to_vec(3 * 4096..4 * 4096), "{be:?}");
    ta.disconnect(peer);
}

fn views_deregister_in_any_order(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "viewdereg", &[]) else { return };
    let (src, dst) = (buf(1 << 15, 8), Arc::new(HostBuffer::new(1 << 15).unwrap()));
    let ha = a.register_batch(views(&src, 8)).unwrap();
    b.register(dst.clone()).unwrap();
    a.connect(&b.metadata()).unwrap();
    let order = [5usize, 0, 7, 2, 6, 1, 3];
    for (n, &i) in order.iter().enumerate() {
        a.deregister(ha[i]).unwrap();
        let left = 8 - n - 1;
        assert_eq!(a.region_counts(), (left, one_region_on_verbs(be, left)), "{be:?}");
        // The deregistered view is refused; view 4 (last to go) still moves.
        let gone = [Desc::new(src.addr() + i as u64 * 4096, 4096)];
        let e = a.post(Op::Write, &gone, b.name(), &[Desc::new(dst.addr(), 4096)], None).unwrap_err();
        assert!(matches!(e, EngineError::LocalOutOfBounds { .. }), "{be:?}: {e}");
        let live = [Desc::new(src.addr() + 4 * 4096, 4096)];
        let h = a.post(Op::Write, &live, b.name(), &[Desc::new(dst.addr() + n as u64 * 4096, 4096)], None).unwrap();
        assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
        a.release(h).unwrap();
        assert_eq!(dst.to_vec(n * 4096..(n + 1) * 4096), src.to_vec(4 * 4096..5 * 4096), "{be:?}");
    }
    a.deregister(ha[4]).unwrap();
    assert_eq!(a.region_counts(), (0, 0), "{be:?}");
    // Registering again after the last one went works (a fresh MR on verbs).
    a.register_batch(views(&src, 8)).unwrap();
    assert_eq!(a.region_counts(), (8, one_region_on_verbs(be, 8)), "{be:?}");
}

/// A view of `b` over pages `[first, first + n)`.
fn pages(b: &Arc<HostBuffer>, first: u64, n: u64) -> Arc<dyn MemoryBacking> {
    Arc::new(View::new(b.clone(), first * 4096, n * 4096).unwrap())
}

/// Write `n` local pages from page `l` of `src` to page `r` of `dst` (at
/// agent `b`), wait, and compare the bytes.
fn write_pages(
    be: Backend,
    a: &mut TransferEngine,
    b: &str,
    (src, dst): (&HostBuffer, &HostBuffer),
    (l, r, n): (u64, u64, u64),
) {
    let ld = [Desc::new(src.addr() + l * 4096, n * 4096)];
    let rd = [Desc::new(dst.addr() + r * 4096, n * 4096)];
    let h = a.post(Op::Write, &ld, b, &rd, None).unwrap_or_else(|e| panic!("{be:?}: pages {l}->{r}: {e}"));
    assert_eq!(wait(a, h), TransferStatus::Done, "{be:?}: pages {l}->{r}");
    a.release(h).unwrap();
    let (l, r, n) = (l as usize * 4096, r as usize * 4096, n as usize * 4096);
    assert_eq!(dst.to_vec(r..r + n), src.to_vec(l..l + n), "{be:?}: bytes of pages {l}->{r}");
}

/// Overlapping, contained and identical registrations are accepted, as
/// NIXL 1.5.1 accepts them (issue 29 item 2); each keeps its own bounds (a
/// descriptor across two overlapping registrations, inside neither, is
/// refused like any unregistered one), and memory stays registered while
/// one registration covering it lives, whichever goes first.
fn overlapping_registrations_are_accepted(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "overlap", &[]) else { return };
    let (src, dst) = (buf(1 << 16, 9), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    // Initiator: pages [0, 10) and [6, 16), one call each (on verbs two MRs
    // over the shared pages: a later range is not grown into an MR).
    let x = a.register(pages(&src, 0, 10)).unwrap();
    let y = a.register(pages(&src, 6, 10)).unwrap();
    assert_eq!(a.region_counts(), (2, 2), "{be:?}");
    // Target: pages [0, 10) and [6, 16) as one list, then [0, 10) again.
    let pq = b.register_batch(vec![pages(&dst, 0, 10), pages(&dst, 6, 10)]).unwrap();
    let p2 = b.register(pages(&dst, 0, 10)).unwrap();
    assert_eq!(b.region_counts(), (3, one_region_on_verbs(be, 3)), "{be:?}");
    let meta = b.metadata();
    assert_eq!(
        meta.regions.iter().map(|r| (r.addr - dst.addr(), r.len_bytes)).collect::<Vec<_>>(),
        [(0, 10 * 4096), (0, 10 * 4096), (6 * 4096, 10 * 4096)]
    );
    a.connect(&meta).unwrap();
    let bn = b.name().to_string();
    let io = (&*src, &*dst);
    // Inside the first only, the second only, and the shared pages.
    write_pages(be, &mut a, &bn, io, (0, 1, 2));
    write_pages(be, &mut a, &bn, io, (13, 11, 3));
    write_pages(be, &mut a, &bn, io, (6, 7, 4));
    // Past a nested registration's end, inside the longer one that starts
    // before it (the lookup must not stop at the nearest start).
    let w = a.register(pages(&src, 12, 1)).unwrap();
    assert_eq!(a.region_counts(), (3, if matches!(be, Backend::Verbs | Backend::VerbsSim) { 2 } else { 3 }), "{be:?}");
    write_pages(be, &mut a, &bn, io, (13, 11, 2));
    a.deregister(w).unwrap();
    // Across both, inside neither: refused on either side, nothing moves.
    let before = dst.to_vec(..);
    let across_l = [Desc::new(src.addr() + 4 * 4096, 8 * 4096)];
    let e = a.post(Op::Write, &across_l, &bn, &[Desc::new(dst.addr(), 8 * 4096)], None).unwrap_err();
    assert!(matches!(e, EngineError::LocalOutOfBounds { .. }), "{be:?}: {e}");
    let across_r = [Desc::new(dst.addr() + 4 * 4096, 8 * 4096)];
    let e = a.post(Op::Write, &[Desc::new(src.addr(), 8 * 4096)], &bn, &across_r, None).unwrap_err();
    assert!(matches!(e, EngineError::RemoteOutOfBounds { .. }), "{be:?}: {e}");
    assert_eq!(dst.to_vec(..), before, "{be:?}: nothing moved");

    // Initiator: the first goes; the shared pages stay registered through
    // the second, the first's own pages do not.
    a.deregister(x).unwrap();
    write_pages(be, &mut a, &bn, io, (6, 2, 1));
    let e = a.post(Op::Write, &[Desc::new(src.addr(), 4096)], &bn, &[Desc::new(dst.addr(), 4096)], None).unwrap_err();
    assert!(matches!(e, EngineError::LocalOutOfBounds { .. }), "{be:?}: {e}");
    // The other order: register it again, the second goes.
    let x = a.register(pages(&src, 0, 10)).unwrap();
    a.deregister(y).unwrap();
    write_pages(be, &mut a, &bn, io, (9, 3, 1));
    let e = a
        .post(Op::Write, &[Desc::new(src.addr() + 15 * 4096, 4096)], &bn, &[Desc::new(dst.addr(), 4096)], None)
        .unwrap_err();
    assert!(matches!(e, EngineError::LocalOutOfBounds { .. }), "{be:?}: {e}");
    a.deregister(x).unwrap();
    assert_eq!(a.region_counts(), (0, 0), "{be:?}");
    let x = a.register(src.clone()).unwrap();

    // Target: one of the two identical registrations goes; its pages stay
    // reachable through the other.
    b.deregister(p2).unwrap();
    assert_eq!(b.region_counts(), (2, one_region_on_verbs(be, 2)), "{be:?}");
    a.load_remote(&b.metadata()).unwrap();
    write_pages(be, &mut a, &bn, io, (5, 0, 1));
    // Then the first of the list: its own pages are refused, the shared ones
    // stay reachable through the second.
    b.deregister(pq[0]).unwrap();
    a.load_remote(&b.metadata()).unwrap();
    let e = a.post(Op::Write, &[Desc::new(src.addr(), 4096)], &bn, &[Desc::new(dst.addr(), 4096)], None).unwrap_err();
    assert!(matches!(e, EngineError::RemoteOutOfBounds { .. }), "{be:?}: {e}");
    write_pages(be, &mut a, &bn, io, (3, 6, 4));
    b.deregister(pq[1]).unwrap();
    assert_eq!(b.region_counts(), (0, 0), "{be:?}");
    a.deregister(x).unwrap();
}

/// Verbs only (issue 29): every `ibv_post_send` counts as one doorbell in
/// the metrics (`kvwire_doorbells_total{transport="verbs",nic=...}`) and
/// the work requests it chained in `kvwire_work_requests_total`: scattered
/// pages posted at once go out as chains of several WRs per doorbell, never
/// more than `max_batch` (64 by default).
fn posts_are_counted_as_doorbells_of_chained_work_requests(be: Backend) {
    // a label of its own on the simulator, so that no other test counts into it
    let Some((mut a, mut b)) =
        pair(be, "doorbells", &[("device", "doorbell-sim")][..usize::from(matches!(be, Backend::VerbsSim))])
    else {
        return;
    };
    let nic = if matches!(be, Backend::VerbsSim) {
        "doorbell-sim".to_string()
    } else {
        verbs_util::devices().expect("devices").1
    };
    let pages = 2048usize;
    let (src, dst) = (buf(pages * 4096, 3), Arc::new(HostBuffer::new(pages * 4096).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    a.connect(&b.metadata()).unwrap();
    let counts = || {
        let c = kvwire::metrics::link("verbs", &nic).expect("the verbs transport made its link's counters");
        (
            c.doorbells.load(std::sync::atomic::Ordering::Relaxed),
            c.work_requests.load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    let (d0, w0) = counts();
    // every other page, so that no two descriptors coalesce into one WR
    let l: Vec<Desc> = (0..pages / 2).map(|p| Desc::new(src.addr() + (2 * p * 4096) as u64, 4096)).collect();
    let r: Vec<Desc> = (0..pages / 2).map(|p| Desc::new(dst.addr() + (2 * p * 4096) as u64, 4096)).collect();
    let h = a.post(Op::Write, &l, b.name(), &r, None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
    assert_eq!(dst.to_vec(0..4096), src.to_vec(0..4096), "{be:?}");
    let (d, w) = counts();
    let (doorbells, wrs) = (d - d0, w - w0);
    eprintln!(
        "{be:?} ({nic}): {wrs} work requests in {doorbells} doorbells, {:.1} per doorbell",
        wrs as f64 / doorbells.max(1) as f64
    );
    assert!(wrs >= (pages / 2) as u64, "{be:?}: {wrs} WRs for {} pages", pages / 2);
    assert!(doorbells > 0 && doorbells * 64 >= wrs, "{be:?}: {wrs} WRs in {doorbells} doorbells (max_batch 64)");
    assert!(doorbells < wrs, "{be:?}: {wrs} WRs in {doorbells} doorbells: no chain of two or more");
    a.release(h).unwrap();
}

mod counters {
    mod verbs_sim {
        #[test]
        fn posts_are_counted_as_doorbells_of_chained_work_requests() {
            super::super::posts_are_counted_as_doorbells_of_chained_work_requests(super::super::Backend::VerbsSim)
        }
    }
    mod verbs {
        #[test]
        #[ignore = "needs an RDMA device (scripts/softroce-tests.sh runs it in the Soft-RoCE guest)"]
        fn posts_are_counted_as_doorbells_of_chained_work_requests() {
            super::super::posts_are_counted_as_doorbells_of_chained_work_requests(super::super::Backend::Verbs)
        }
    }
}

/// A waiter that holds no engine sleeps on the transport's completion
/// channel and is woken by the completion, which the engine's next status
/// check still gets (the signal takes nothing from the channel); with
/// nothing in flight it times out. This is what lets kvwire's `mooncake`
/// package block in `batch_transfer_sync_write` while other threads use the
/// engine.
fn a_completion_signal_wakes_a_waiter_and_takes_nothing(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "signal", &[]) else { return };
    let sig = a.completion_signal().expect("every backend has a completion channel");
    assert!(!sig.wait(Duration::from_millis(20)), "{be:?}: woken with nothing in flight");
    let (src, dst, l, r) = reversed_pages(&mut a, &mut b, 9);
    let pages = l.len();
    for round in 0..3 {
        let h = a.post(Op::Write, &l, b.name(), &r, None).unwrap();
        let mut wakes = 0;
        while a.status(h).unwrap() == TransferStatus::InProgress {
            // A completion queued before this call wakes it at once; one
            // arriving later wakes it then. A missed wake is a timeout.
            assert!(sig.wait(Duration::from_secs(60)), "{be:?} round {round}: the completion did not wake the waiter");
            wakes += 1;
            assert!(wakes < 1000, "{be:?}: woken without the transfer ending");
        }
        assert_eq!(a.status(h).unwrap(), TransferStatus::Done, "{be:?} round {round}");
        a.release(h).unwrap();
        for p in 0..pages {
            assert!(dst.to_vec(p * 4096..p * 4096 + 4096) == src.to_vec((pages - 1 - p) * 4096..(pages - p) * 4096));
        }
    }
    // Drained by the last status: nothing left to wake anyone.
    assert!(!sig.wait(Duration::from_millis(20)), "{be:?}: a completion was left on the channel");
}

/// A peer's connection info with its data address moved to a black hole:
/// a listener that takes connections into its backlog and never accepts
/// them, so a handshake with it waits until the hole closes (dropping it
/// resets what waits) or the dialler's `peer_timeout` ends.
enum BlackHole {
    Tcp(#[allow(dead_code)] std::net::TcpListener),
    Shm(#[allow(dead_code)] kvwire::transport::shm::wire::Listener),
}

/// `meta` (a live peer's) under `name`, its data address a [`BlackHole`]:
/// the peer Mooncake users meet when a process answers its rpc port but
/// its NIC path is gone.
fn silent_twin(be: Backend, meta: &AgentMetadata, name: &str) -> (AgentMetadata, BlackHole) {
    let mut twin = meta.clone();
    twin.name = name.to_string();
    let hole = match be {
        Backend::Shm => {
            let socket = format!("kvwire-black-hole-{name}-{}", std::process::id());
            let hole = kvwire::transport::shm::wire::Listener::bind(&socket).unwrap();
            let mut info = ShmInfo::decode(&meta.connection_info).unwrap();
            info.socket = socket;
            twin.connection_info = info.encode();
            BlackHole::Shm(hole)
        }
        Backend::Tcp => {
            let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let mut info = TcpConnectionInfo::decode(&meta.connection_info).unwrap();
            info.addr = hole.local_addr().unwrap().to_string();
            twin.connection_info = info.encode();
            BlackHole::Tcp(hole)
        }
        Backend::Verbs | Backend::VerbsSim => {
            // Verbs connection info: the listener's address (a postcard
            // string), then the secret.
            let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let (_, secret) = postcard::take_from_bytes::<String>(&meta.connection_info).unwrap();
            let mut info = postcard::to_allocvec(&hole.local_addr().unwrap().to_string()).unwrap();
            info.extend_from_slice(secret);
            twin.connection_info = info;
            BlackHole::Tcp(hole)
        }
    };
    (twin, hole)
}

/// One peer that never answers its handshake holds only the caller that
/// dials it: the handshake ([`PendingLoad::dial`]) runs without the engine,
/// which meanwhile connects a live peer, moves bytes to it and registers
/// memory (issue 25: the `mooncake` package's first transfer to a session
/// whose data port was silent held every other call for the timeout). When
/// the hole closes, the dial fails and nothing of the silent peer is kept.
fn a_silent_peer_holds_only_its_own_dial(be: Backend) {
    let Some((mut a, mut b)) = pair_timing_out(be, "silent", &[], Some(Duration::from_secs(120))) else { return };
    let (src, dst) = (buf(1 << 16, 7), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    let (silent, hole) = silent_twin(be, &b.metadata(), "silent");
    let LoadStep::Dial(pending) = a.begin_load(&silent).unwrap() else { panic!("{be:?}: a new agent needs a dial") };
    assert_eq!(pending.name(), "silent");
    let dialing = std::thread::spawn(move || pending.dial().map(drop));
    assert_eq!(a.load_remote(&b.metadata()).unwrap(), LoadOutcome::Connected, "{be:?}");
    let h = a
        .post(Op::Write, &[Desc::new(src.addr(), 1 << 16)], b.name(), &[Desc::new(dst.addr(), 1 << 16)], None)
        .unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
    a.release(h).unwrap();
    assert_eq!(dst.to_vec(..), src.to_vec(..), "{be:?}");
    let more = a.register(buf(4096, 8)).unwrap();
    a.deregister(more).unwrap();
    assert!(!dialing.is_finished(), "{be:?}: the silent peer answered nothing, so its dial still waits");
    assert!(!a.is_remote_loaded("silent"), "{be:?}");
    drop(hole);
    let e = dialing.join().unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::Transport(TransportError::Connect { .. } | TransportError::Timeout { op: "connect", .. })
        ),
        "{be:?}: {e}"
    );
    assert!(!a.is_remote_loaded("silent"), "{be:?}: a failed dial keeps nothing");
}

/// Two dials of one agent may both finish (two threads met it first at
/// once): the first installs its connection, the second is dropped as
/// `Unchanged`, and dropping it leaves the first connection working. A
/// later dial with newer regions installs as `Updated`, and a transfer into
/// the new region lands.
fn a_second_dial_of_one_agent_is_dropped_and_the_first_works(be: Backend) {
    let Some((mut a, mut b)) = pair(be, "twodials", &[]) else { return };
    let (src, dst) = (buf(1 << 16, 9), Arc::new(HostBuffer::new(1 << 16).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    let meta = b.metadata();
    let dial = |a: &mut TransferEngine, meta: &AgentMetadata| match a.begin_load(meta).unwrap() {
        LoadStep::Dial(p) => p.dial().unwrap(),
        LoadStep::Done(o) => panic!("{be:?}: expected a dial, got {o:?}"),
    };
    let (first, second) = (dial(&mut a, &meta), dial(&mut a, &meta));
    assert_eq!(a.finish_load(first).unwrap(), LoadOutcome::Connected, "{be:?}");
    assert_eq!(a.finish_load(second).unwrap(), LoadOutcome::Unchanged, "{be:?}");
    assert!(matches!(a.begin_load(&meta).unwrap(), LoadStep::Done(LoadOutcome::Unchanged)), "{be:?}");
    let bn = b.name().to_string();
    let h = a
        .post(
            Op::Write,
            &[Desc::new(src.addr(), 1 << 16)],
            &bn,
            &[Desc::new(dst.addr(), 1 << 16)],
            Some(b"one".to_vec()),
        )
        .unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
    a.release(h).unwrap();
    assert_eq!(dst.to_vec(..), src.to_vec(..), "{be:?}");
    assert_eq!(notifs(&mut b, a.name(), 1), vec![b"one".to_vec()], "{be:?}");
    let extra = Arc::new(HostBuffer::new(1 << 16).unwrap());
    b.register(extra.clone()).unwrap();
    let newer = dial(&mut a, &b.metadata());
    assert_eq!(a.finish_load(newer).unwrap(), LoadOutcome::Updated, "{be:?}");
    let h =
        a.post(Op::Write, &[Desc::new(src.addr(), 1 << 16)], &bn, &[Desc::new(extra.addr(), 1 << 16)], None).unwrap();
    assert_eq!(wait(&mut a, h), TransferStatus::Done, "{be:?}");
    assert_eq!(extra.to_vec(..), src.to_vec(..), "{be:?}");
}

macro_rules! contract {
    ($($rule:ident),* $(,)?) => {
        mod shm { $(#[test] fn $rule() { super::$rule(super::Backend::Shm) })* }
        mod tcp { $(#[test] fn $rule() { super::$rule(super::Backend::Tcp) })* }
        mod verbs_sim { $(#[test] fn $rule() { super::$rule(super::Backend::VerbsSim) })* }
        mod verbs { $(#[test] #[ignore = "needs an RDMA device (scripts/softroce-tests.sh runs it in the Soft-RoCE guest)"] fn $rule() { super::$rule(super::Backend::Verbs) })* }
    };
}

contract!(
    out_of_bounds_is_refused_before_anything_moves,
    a_forged_rkey_is_an_unknown_key,
    the_targets_own_check_refuses_what_it_never_registered,
    a_notification_arrives_after_its_data,
    standalone_notifications_keep_their_order,
    a_dead_peer_fails_within_the_timeout_then_fast,
    release_fences_the_memory,
    deregistering_memory_in_use_is_refused,
    a_removed_peer_reconnects,
    views_registered_as_a_list_move_data,
    bounds_hold_per_registration_of_a_view,
    a_view_key_covers_only_its_view,
    views_deregister_in_any_order,
    overlapping_registrations_are_accepted,
    a_target_that_takes_nothing_holds_its_bound_and_loses_none,
    a_completion_signal_wakes_a_waiter_and_takes_nothing,
    a_silent_peer_holds_only_its_own_dial,
    a_second_dial_of_one_agent_is_dropped_and_the_first_works,
);
