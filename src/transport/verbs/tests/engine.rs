//! The engine on its own progress thread over `SimNic` (`auto_step`: each
//! `poll_cq` moves the fabric), driven only through its command channel as
//! `VerbsTransport` drives it over the real device.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::transport::verbs::conn::RECVS_PER_QP;
use crate::transport::verbs::engine::{Cmd, PeerHealth};
use crate::transport::verbs::nic::{Nic, NicQp};
use crate::transport::verbs::progress::Core;
use crate::transport::verbs::sim::{SimFabric, SimQp, SimSlab};
use crate::transport::verbs::state::NOTIF_SLOTS;
use crate::transport::verbs::state::PeerLink;
use crate::transport::verbs::state::{NOTIF_SLOT_BYTES, PostLimits, RECV_BIT};
use crate::transport::{LocalKey, Op, PeerId, PostRequest, RemoteKey, Segment, XferId};

const PAGE: u64 = 4096;

fn limits() -> PostLimits {
    PostLimits { max_send_wr: 64, signal_every: 8, max_batch: 16, batch_bytes: 0, poll_sleep_us: 50, idle_yields: 0 }
}

/// An engine on device 0 with one QP to a target QP on device 1 (receives
/// posted), installed as peer 1; the target's side stays with the test.
struct Rig {
    fabric: SimFabric,
    core: Option<Core<SimQp>>,
    link: Arc<PeerLink>,
    target: Option<(SimQp, Arc<SimSlab>)>,
    qpn: u32,
    src: (u64, u32),
    dst: (u64, u32),
}

impl Rig {
    fn new(events: bool, event_wait_ms: i32) -> Self {
        Self::build(events, event_wait_ms, crate::transport::verbs::engine::QUEUED_WR_LIMIT)
    }

    /// [`Rig::new`] with the engine's intake pause at `queued_wr_limit` WRs.
    fn build(events: bool, event_wait_ms: i32, queued_wr_limit: usize) -> Self {
        let fabric = SimFabric::new(7);
        fabric.world().auto_step = 4;
        fabric.world().events = events;
        let nic = fabric.device(0, 256);
        let t = fabric.device(1, 1024);
        let iq = nic.create_qp(64, 1).unwrap();
        let mut tq = t.create_qp(4, RECVS_PER_QP).unwrap();
        fabric.connect(iq.qp_num(), tq.qp_num());
        let tslab = Arc::new(t.alloc_slab(RECVS_PER_QP as usize * NOTIF_SLOT_BYTES).unwrap());
        for slot in 0..RECVS_PER_QP {
            let off = slot as usize * NOTIF_SLOT_BYTES;
            tq.post_recv(RECV_BIT | u64::from(slot), &tslab, off, NOTIF_SLOT_BYTES as u32).unwrap();
        }
        let slab = nic.alloc_slab(NOTIF_SLOTS as usize * NOTIF_SLOT_BYTES).unwrap();
        let src = fabric.alloc(0, 1 << 20);
        let dst = fabric.alloc(1, 1 << 20);
        let qpn = iq.qp_num();
        let core = Core::start(nic, 256, limits(), |e| {
            e.event_wait_ms = event_wait_ms;
            e.peer_timeout = Duration::from_millis(200);
            e.queued_wr_limit = queued_wr_limit;
        })
        .unwrap();
        let link = Arc::new(PeerLink::default());
        let (name, slab, l) = ("target".to_string(), Some(slab), Some(link.clone()));
        core.handle.send(Cmd::Install { peer: PeerId(1), name, qps: vec![iq], slab, link: l });
        Self { fabric, core: Some(core), link, target: Some((tq, tslab)), qpn, src, dst }
    }

    fn core(&self) -> &Core<SimQp> {
        self.core.as_ref().expect("running")
    }

    fn post(&self, x: u64, op: Op, pages: u64, notification: Option<&[u8]>) {
        self.core().handle.send(Cmd::Post(self.request(x, op, pages, notification)));
    }

    fn request(&self, x: u64, op: Op, pages: u64, notification: Option<&[u8]>) -> PostRequest {
        let segments = (0..pages)
            .map(|i| Segment {
                local_addr: self.src.0 + i * PAGE,
                lkey: LocalKey(self.src.1),
                remote_addr: self.dst.0 + i * PAGE,
                rkey: RemoteKey(self.dst.1),
                len_bytes: PAGE,
            })
            .collect();
        let notification = notification.map(<[u8]>::to_vec);
        PostRequest { xfer: XferId(x), op, peer: PeerId(1), segments, notification }
    }

    fn wait_done(&self, x: u64) -> crate::transport::Completion {
        let c = self.core().done.recv_timeout(Duration::from_secs(20)).expect("a completion");
        assert_eq!(c.xfer, XferId(x));
        c
    }
}

#[test]
fn posts_complete_through_the_channels_and_drop_ends_the_thread_and_frees_the_nic() {
    let mut r = Rig::new(false, 20);
    let data: Vec<u8> = (0..64 * PAGE as usize).map(|i| (i % 251) as u8).collect();
    assert!(r.fabric.write(r.src.1, r.src.0, &data));
    r.post(1, Op::Write, 64, Some(b"hello"));
    assert_eq!(r.wait_done(1).result, Ok(()));
    assert_eq!(r.fabric.read(r.dst.1, r.dst.0, data.len()), Some(data));
    // The slot came back to the engine's count once the SEND completed.
    assert!(!r.link.broken.load(Ordering::Acquire));
    let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply });
    assert_eq!(h, Some(PeerHealth { busy: false, broken: false, free_slots: NOTIF_SLOTS }));
    // Drop: the progress thread ends (joined) and with it every QP, slab
    // and the NIC it owned; with the test's own handles gone, only the
    // fabric itself is left.
    let qpn = r.qpn;
    r.core = None;
    assert!(!r.fabric.world().has_qp(qpn), "the engine's QP outlived it");
    r.target = None;
    assert_eq!(r.fabric.handles(), 1, "something of the NIC outlived the engine");
}

#[test]
fn a_failed_qp_marks_the_link_broken_for_the_next_post() {
    let r = Rig::new(false, 20);
    r.fabric.fail_next(r.qpn, crate::verbs::WcStatus::RemAccessErr);
    r.post(1, Op::Write, 4, None);
    assert!(r.wait_done(1).result.is_err());
    assert!(r.link.broken.load(Ordering::Acquire), "the caller would not reconnect");
    let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply }).unwrap();
    assert!(h.broken && !h.busy, "{h:?}");
    // Unplug destroys the QP; the reply comes once it is gone.
    r.core().handle.call::<()>(|done| Cmd::Unplug { peer: PeerId(1), done });
    assert!(!r.fabric.world().has_qp(r.qpn));
}

#[test]
fn a_command_wakes_the_engine_blocked_on_the_completion_channel() {
    // Completion events on, and a blocking wait of a minute: only the wake
    // fd can bring the thread back for a command in time.
    let r = Rig::new(true, 60_000);
    for round in 0..3 {
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply });
        assert!(h.is_some());
        let waited = t0.elapsed();
        assert!(waited < Duration::from_secs(5), "round {round}: the query waited {waited:?}");
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        r.post(10 + round, Op::Write, 8, None);
        assert_eq!(r.wait_done(10 + round).result, Ok(()));
        assert!(t0.elapsed() < Duration::from_secs(5), "round {round}: the post waited {:?}", t0.elapsed());
    }
}

#[test]
fn cancel_over_the_channel_returns_once_the_nic_let_go() {
    let r = Rig::new(false, 20);
    // A stopped peer with infinite retries: the READ stays in flight until
    // the cancel's flush deadline (peer_timeout 200 ms) puts the QP in error.
    r.fabric.world().infinite_retry = true;
    r.fabric.kill(1);
    r.post(1, Op::Read, 128, Some(b"never"));
    std::thread::sleep(Duration::from_millis(20));
    let t0 = Instant::now();
    r.core().handle.call::<()>(|done| Cmd::Cancel { xfer: Some(XferId(1)), done });
    assert!(t0.elapsed() >= Duration::from_millis(150), "returned before the NIC let go: {:?}", t0.elapsed());
    let w = r.fabric.world();
    let at = w.steps;
    drop(w);
    std::thread::sleep(Duration::from_millis(50));
    let w = r.fabric.world();
    assert!(w.touches.iter().all(|&(s, key, _, _)| s <= at || key != r.src.1), "touched after cancel");
    drop(w);
    assert!(r.core().done.try_recv().is_err(), "a cancelled transfer is not reported");
    let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply }).unwrap();
    assert_eq!(h.free_slots, NOTIF_SLOTS, "the notification slot leaked");
}

#[test]
fn a_fast_poster_blocks_in_the_bounded_channel_while_the_nic_is_behind() {
    use crate::transport::verbs::progress::CMD_CAPACITY;
    // The engine stops taking commands once 256 WRs wait in software; with
    // the fabric frozen nothing frees room, so the channel fills and the
    // poster blocks in `send` (mutation-checked: without the intake pause
    // the engine takes every command and the channel never fills).
    let r = Rig::build(false, 20, 256);
    r.fabric.world().auto_step = 0;
    let total = CMD_CAPACITY as u64 + 400;
    let reqs: Vec<PostRequest> = (1..=total).map(|x| r.request(x, Op::Write, 16, None)).collect();
    let h = r.core().handle.clone();
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let s2 = sent.clone();
    let poster = std::thread::spawn(move || {
        for req in reqs {
            h.send(Cmd::Post(req));
            s2.fetch_add(1, Ordering::AcqRel);
        }
    });
    let t0 = Instant::now();
    while r.core().handle.queued() < CMD_CAPACITY {
        assert!(t0.elapsed() < Duration::from_secs(20), "the channel never filled: the engine took every command");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Frozen, it stays so: give an engine that kept taking commands time to
    // drain the channel (a pass never depends on this wait being long).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(r.core().handle.queued(), CMD_CAPACITY, "the engine took commands with the NIC frozen");
    assert!(!poster.is_finished() && sent.load(Ordering::Acquire) < total, "the poster did not feel the NIC");
    // The NIC moves again: every command goes through and every transfer ends.
    r.fabric.world().auto_step = 4;
    poster.join().unwrap();
    let mut ok = 0;
    while ok < total {
        let c = r.core().done.recv_timeout(Duration::from_secs(20)).expect("a completion");
        assert_eq!(c.result, Ok(()), "{:?}", c.xfer);
        ok += 1;
    }
}

#[test]
fn the_engine_alone_counts_notification_slots_and_refuses_past_them_as_overloaded() {
    use crate::transport::FailureKind;
    // The fabric frozen: no SEND completes, so no slot comes back.
    let r = Rig::new(false, 20);
    r.fabric.world().auto_step = 0;
    let n = u64::from(NOTIF_SLOTS);
    for x in 1..=n + 2 {
        r.post(x, Op::Write, 1, Some(b"n"));
    }
    let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply }).unwrap();
    assert_eq!(h.free_slots, 0);
    for x in [n + 1, n + 2] {
        let c = r.wait_done(x);
        let why = c.result.expect_err("past the slots");
        assert_eq!(why.kind, FailureKind::Overloaded, "{why}");
        assert!(why.detail.contains("notifications in flight"), "{why}");
    }
    // The NIC moves again: the first 256 end and give their slots back (the
    // test's target holds 64 receives and reposts none, so the later ones
    // fail on RNR: ending is what counts here).
    r.fabric.world().auto_step = 4;
    let mut done = std::collections::HashSet::new();
    while done.len() < NOTIF_SLOTS as usize {
        let c = r.core().done.recv_timeout(Duration::from_secs(20)).expect("a completion");
        assert!(c.xfer.0 <= n && done.insert(c.xfer.0), "{:?}", c.xfer);
    }
    let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply }).unwrap();
    assert_eq!(h.free_slots, NOTIF_SLOTS, "a slot leaked");
}

/// A new QP pair between the rig's devices, receives posted on the target
/// side: what a reconnect hands the engine. Returns the initiator's QP and
/// keeps the target's in the rig.
fn new_qps(r: &mut Rig) -> SimQp {
    let iq = r.fabric.handle(0).create_qp(64, 1).unwrap();
    let t = r.fabric.handle(1);
    let mut tq = t.create_qp(4, RECVS_PER_QP).unwrap();
    r.fabric.connect(iq.qp_num(), tq.qp_num());
    let tslab = Arc::new(t.alloc_slab(RECVS_PER_QP as usize * NOTIF_SLOT_BYTES).unwrap());
    for slot in 0..RECVS_PER_QP {
        let off = slot as usize * NOTIF_SLOT_BYTES;
        tq.post_recv(RECV_BIT | u64::from(slot), &tslab, off, NOTIF_SLOT_BYTES as u32).unwrap();
    }
    r.target = Some((tq, tslab));
    iq
}

/// Break the rig's QP with an error completion (transfer `x` fails).
fn break_link(r: &Rig, x: u64) {
    r.fabric.fail_next(r.qpn, crate::verbs::WcStatus::RemAccessErr);
    r.post(x, Op::Write, 4, None);
    assert!(r.wait_done(x).result.is_err());
    assert!(r.link.broken.load(Ordering::Acquire));
}

#[test]
fn posts_wait_in_the_engine_behind_a_reconnect_and_go_on_the_new_qps() {
    let mut r = Rig::new(false, 20);
    break_link(&r, 1);
    // VerbsTransport::post on a broken peer: `Reconnecting`, then the post,
    // and it returns; the reconnect thread does the rest.
    r.core().handle.send(Cmd::Reconnecting { peer: PeerId(1) });
    let data: Vec<u8> = (0..4 * PAGE as usize).map(|i| (i % 239) as u8).collect();
    assert!(r.fabric.write(r.src.1, r.src.0, &data));
    r.post(2, Op::Write, 4, Some(b"after"));
    let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply }).unwrap();
    assert!(h.broken && !h.busy, "{h:?}");
    r.core().handle.call::<()>(|done| Cmd::Unplug { peer: PeerId(1), done });
    // Channel order: had the post not been held, it would have failed on
    // the broken QP before the Unplug answered (mutation-checked).
    assert!(r.core().done.try_recv().is_err(), "a post behind the reconnect ran on the broken QP");
    let iq = new_qps(&mut r);
    r.core().handle.send(Cmd::Install {
        peer: PeerId(1),
        name: "target".into(),
        qps: vec![iq],
        slab: None,
        link: None,
    });
    assert_eq!(r.wait_done(2).result, Ok(()));
    assert_eq!(r.fabric.read(r.dst.1, r.dst.0, data.len()), Some(data));
    assert!(!r.link.broken.load(Ordering::Acquire));
}

#[test]
fn a_failed_reconnect_fails_the_posts_held_behind_it_and_a_cancelled_one_is_not_reported() {
    use crate::transport::FailureKind;
    let r = Rig::new(false, 20);
    break_link(&r, 1);
    r.core().handle.send(Cmd::Reconnecting { peer: PeerId(1) });
    r.post(2, Op::Write, 4, None);
    r.post(3, Op::Write, 4, Some(b"n"));
    r.core().handle.call::<()>(|done| Cmd::Cancel { xfer: Some(XferId(3)), done });
    r.core().handle.send(Cmd::Resume { peer: PeerId(1), failed: Some("target refused: authentication failed".into()) });
    let why = r.wait_done(2).result.expect_err("held behind a failed reconnect");
    assert_eq!(why.kind, FailureKind::PeerDied);
    assert!(why.detail.contains("reconnect failed: target refused"), "{why}");
    let h = r.core().handle.call(|reply| Cmd::Query { peer: PeerId(1), reply }).unwrap();
    assert!(r.core().done.try_recv().is_err(), "the cancelled post was reported");
    assert_eq!(h.free_slots, NOTIF_SLOTS, "a held post took a slot");
}
