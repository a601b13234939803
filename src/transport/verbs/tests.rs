//! State-machine tests on the simulated NIC (`sim::SimNic`): no RDMA hardware.

mod batch {

    use crate::transport::Segment;
    use crate::transport::verbs::state::*;
    use crate::transport::{LocalKey, RemoteKey, XferId};
    use std::collections::VecDeque;

    fn limits(max_batch: u32, batch_bytes: u64) -> PostLimits {
        PostLimits { max_send_wr: 1024, signal_every: 32, max_batch, batch_bytes, poll_sleep_us: 50, idle_yields: 0 }
    }

    fn queue(sizes: &[u64]) -> VecDeque<Work> {
        sizes
            .iter()
            .map(|&len_bytes| Work::Rdma {
                xfer: XferId(1),
                read: true,
                seg: Segment { local_addr: 0, lkey: LocalKey(1), remote_addr: 0, rkey: RemoteKey(2), len_bytes },
            })
            .collect()
    }

    #[test]
    fn batch_len_counts_wrs_room_and_bytes() {
        let q = queue(&[4096; 100]);
        assert_eq!(batch_len(&q, 1000, &limits(64, 0)), 64, "max_batch");
        assert_eq!(batch_len(&q, 10, &limits(64, 0)), 10, "room in the send queue");
        assert_eq!(batch_len(&q, 1000, &limits(64, 64 << 10)), 16, "16 x 4 KiB reach 64 KiB");
        assert_eq!(batch_len(&q, 5, &limits(64, 64 << 10)), 5, "room before bytes");
        let big = queue(&[65536, 65536, 1 << 20]);
        assert_eq!(batch_len(&big, 1000, &limits(64, 64 << 10)), 1, "one 64 KiB WR per post");
        assert_eq!(batch_len(&queue(&[100, 1 << 20]), 1000, &limits(64, 64 << 10)), 2);
        assert_eq!(batch_len(&queue(&[]), 1000, &limits(64, 64 << 10)), 0);
        let mut with_notify = queue(&[4096; 3]);
        with_notify.push_back(Work::Notify { xfer: XferId(1), slot: 0, len: 100, fence: false });
        assert_eq!(batch_len(&with_notify, 1000, &limits(64, 64 << 10)), 4, "short queue: all of it");
    }
}

mod sim_harness;

use std::time::Duration;

use sim_harness::{Opts, PAGE, Pair};

use crate::transport::verbs::conn::RECVS_PER_QP;
use crate::transport::verbs::state::Qpn;
use crate::transport::{FailureKind, FailureSource, Op, RemoteAccessKind, TransportError};
use crate::verbs::WcStatus;

fn ok(p: &Pair, x: u64) -> bool {
    p.result(x) == Some(Ok(()))
}

#[test]
fn tiny_queue_odd_batches_three_qps_move_every_byte() {
    // verbs_edge: max_send_wr 5, post_list 3, signal_every 2, 3 QPs.
    let mut p = Pair::new(1, Opts { qps: 3, max_send_wr: 5, post_list: 3, signal_every: 2, ..Opts::default() });
    let segs: Vec<(u64, u64)> = (0..200).map(|i| (i * 2 * PAGE, [4096, 61, 65536, 1, 4095][i as usize % 5])).collect();
    p.fill_src(|i| (i * 31 + i / 4096) as u8);
    p.post(1, Op::Write, &segs, Some(b"odd")).unwrap();
    p.run();
    assert!(ok(&p, 1), "{:?}", p.result(1));
    p.assert_same(&segs);
    assert_eq!(p.notifs(), vec![b"odd".to_vec()]);
    p.invariants();
}

#[test]
fn many_transfers_with_notifications_refuse_past_the_slots_then_deliver_all() {
    let mut p = Pair::new(2, Opts { qps: 2, ..Opts::default() });
    let mut posted = Vec::new();
    for i in 0..300u64 {
        match p.post(i, Op::Write, &[(i * PAGE, PAGE)], Some(format!("m{i}").as_bytes())) {
            Ok(()) => posted.push(i),
            Err(e) => assert!(e.to_string().contains("notifications in flight"), "{e}"),
        }
    }
    assert_eq!(posted.len(), 256, "one slot per notification in flight");
    p.run();
    assert!(posted.iter().all(|&i| ok(&p, i)));
    let mut got = p.notifs();
    got.sort();
    let mut want: Vec<Vec<u8>> = posted.iter().map(|i| format!("m{i}").into_bytes()).collect();
    want.sort();
    assert_eq!(got, want);
    // The slots came back: more can be posted.
    p.post(1000, Op::Write, &[(0, 8)], Some(b"again")).unwrap();
    p.run();
    assert!(ok(&p, 1000));
    p.invariants();
}

#[test]
fn cancel_returns_only_when_nothing_can_touch_the_buffers_and_frees_the_slot() {
    // verbs_edge release_in_flight + the notification slot leak in cancel.
    for seed in 0..20 {
        let mut p = Pair::new(seed, Opts { qps: 2, max_send_wr: 64, ..Opts::default() });
        let segs: Vec<(u64, u64)> = (0..512).map(|i| (i * PAGE, PAGE)).collect();
        p.post(1, Op::Read, &segs, Some(b"no")).unwrap();
        p.steps(seed as usize * 7);
        let returned_at = p.cancel(1);
        assert!(p.fabric.world().touches.iter().all(|&(s, key, _, _)| s <= returned_at || key != p.src.1));
        p.run();
        assert_eq!(p.result(1), None, "a cancelled transfer is not reported");
        assert!(p.notifs().is_empty(), "notification of a cancelled transfer");
        assert!(p.fabric.world().touches.iter().all(|&(s, key, _, _)| s <= returned_at || key != p.src.1));
        assert_eq!(p.i.st.slots().free(p.peer), 256, "the notification slot leaked");
        p.invariants();
    }
}

#[test]
fn forged_bounds_and_rkeys_fail_as_remote_access_without_writing() {
    let mut p = Pair::new(3, Opts::default());
    let past = p.dst_len;
    p.post(1, Op::Write, &[(past - 4096, 8192)], None).unwrap();
    p.run();
    let f = p.result(1).unwrap().unwrap_err();
    assert_eq!(f.kind, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds));
    assert!(
        matches!(f.source, FailureSource::WorkCompletion { status, .. } if status == WcStatus::RemAccessErr.raw()),
        "{f:?}"
    );
    // The next post reconnects (the harness as the transport's recover).
    p.reconnect();
    p.post_with_rkey(2, Op::Write, &[(0, 4096)], p.dst.1 + 0x100).unwrap();
    p.run();
    assert_eq!(p.result(2).unwrap().unwrap_err().kind, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds));
    assert!(p.dst_bytes().iter().all(|&b| b == 0), "wrote through a forged bound or rkey");
}

#[test]
fn a_reads_notification_leaves_only_after_its_data_arrived() {
    // One QP: the SEND goes right behind the READs. An RC QP may run a SEND
    // while READs ahead of it wait for their data; without the fence the
    // target would hear "done" before the bytes were here (and could reuse
    // its pages under a READ answered again).
    for seed in 0..20 {
        let mut p = Pair::new(seed, Opts { qps: 1, ..Opts::default() });
        p.fill_dst(|i| (i as u8) ^ 0x5a);
        let segs: Vec<(u64, u64)> = (0..48).map(|i| (i * PAGE, PAGE)).collect();
        p.post(1, Op::Read, &segs, Some(b"r")).unwrap();
        p.run();
        assert!(p.result(1).expect("ended").is_ok());
        assert_eq!(p.notifs(), vec![b"r".to_vec()]);
        p.invariants();
    }
}

#[test]
fn deferred_notification_on_a_failed_qp_completes() {
    // Two QPs: A's notification waits for both; B fails QP 0 meanwhile.
    for seed in 0..20 {
        let mut p = Pair::new(seed, Opts { qps: 2, ..Opts::default() });
        p.fill_dst(|i| (i as u8) ^ 0x3c);
        let segs: Vec<(u64, u64)> = (0..128).map(|i| (i * PAGE, 64)).collect();
        p.post(1, Op::Read, &segs, Some(b"A")).unwrap();
        p.steps(seed as usize);
        p.post_with_rkey(2, Op::Read, &[(0, 64)], 9999).unwrap();
        p.run();
        assert!(p.result(2).unwrap().is_err());
        match p.result(1).expect("A never completed") {
            Ok(()) => assert_eq!(p.notifs(), vec![b"A".to_vec()], "A succeeded: its notification arrives"),
            // Its SEND sat behind B's READ, which the responder refused:
            // nothing after that READ executes.
            Err(_) => assert!(p.notifs().is_empty()),
        }
        p.invariants();
    }
}

#[test]
fn transfer_queued_behind_a_failed_wr_is_reported() {
    let mut p = Pair::new(4, Opts { max_send_wr: 4, signal_every: 1, ..Opts::default() });
    let qp = p.qpns[0];
    p.fabric.fail_next(qp, WcStatus::RemAccessErr);
    let b: Vec<(u64, u64)> = (0..4).map(|i| (i * PAGE, PAGE)).collect();
    p.post(1, Op::Read, &b, None).unwrap();
    p.post(2, Op::Read, &[(8 * PAGE, PAGE)], Some(b"y")).unwrap();
    p.run();
    assert!(p.result(1).unwrap().is_err());
    assert!(p.result(2).expect("Y never completed").is_err());
    p.invariants();
}

#[test]
fn wc_error_statuses_fail_with_their_kind_and_flushes_carry_the_first_error() {
    for (status, kind) in [
        (WcStatus::RetryExcErr, FailureKind::PeerDied),
        (WcStatus::RnrRetryExcErr, FailureKind::PeerDied),
        (WcStatus::RemAccessErr, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds)),
    ] {
        let mut p = Pair::new(5, Opts { signal_every: 1, max_send_wr: 8, ..Opts::default() });
        p.fabric.fail_next(p.qpns[0], status);
        p.post(1, Op::Write, &[(0, PAGE)], None).unwrap();
        p.post(2, Op::Write, &[(PAGE, PAGE), (3 * PAGE, PAGE)], None).unwrap();
        p.run();
        let f1 = p.result(1).unwrap().unwrap_err();
        assert_eq!(f1.kind, kind, "{f1}");
        assert!(matches!(f1.source, FailureSource::WorkCompletion { status: s, .. } if s == status.raw()));
        // WRs flushed behind it fail with the first error's kind.
        let f2 = p.result(2).unwrap().unwrap_err();
        assert_eq!(f2.kind, kind, "{f2}");
        p.invariants();
    }
}

#[test]
fn small_completion_queue_holds_work_back_instead_of_overrunning() {
    let o = Opts { qps: 4, cq: 128, max_send_wr: 256, signal_every: 1, ..Opts::default() };
    let mut p = Pair::new(6, o);
    let segs: Vec<(u64, u64)> = (0..2000).map(|i| (i * 2 * 1024, 1024)).collect();
    p.fill_src(|i| (i * 7 + i / 1024) as u8);
    p.post(1, Op::Write, &segs, Some(b"cq")).unwrap();
    p.run();
    assert!(ok(&p, 1));
    p.assert_same(&segs);
    p.invariants();
}

#[test]
fn receives_hold_at_most_half_the_cq_and_refuse_beyond() {
    let mut p = Pair::new(7, Opts { cq_target: 128, ..Opts::default() });
    // The pair's one QP holds 64 receives on a 128-entry CQ: no room for more.
    assert!(!p.t.st.reserve_recv_cqes(64), "receives may hold half the CQ");
    assert!(p.t.st.reserve_recv_cqes(0));
    p.invariants();
}

#[test]
fn cq_room_given_back_outside_a_completion_posts_waiting_work() {
    // A target's CQ half held by receives; the room receives give back when
    // their initiator leaves must post sends that waited for it.
    let mut p = Pair::new(8, Opts { cq: 128, max_send_wr: 256, signal_every: 1, ..Opts::default() });
    assert!(p.i.st.reserve_recv_cqes(64), "receives take half of the CQ");
    // The other half is held elsewhere (sends of another peer in flight).
    p.i.st.cq_mut().exhaust();
    let segs: Vec<(u64, u64)> = (0..64).map(|i| (i * 2 * PAGE, PAGE)).collect();
    p.post(1, Op::Write, &segs, None).unwrap();
    p.run();
    assert_eq!(p.result(1), None, "waits for CQEs");
    p.i.st.release_cqes(64);
    // The receives' initiator left: their CQEs come back outside any completion.
    p.i.st.release_recv_cqes(64, &p.limits);
    p.run();
    assert!(ok(&p, 1), "work that waited for CQEs given back outside a completion");
    p.invariants();
}

#[test]
fn one_busy_qp_does_not_starve_another_peers_small_transfer() {
    let o = Opts { cq: 128, max_send_wr: 256, signal_every: 32, ..Opts::default() };
    let mut p = Pair::new(9, o);
    let second = p.add_peer();
    let big: Vec<(u64, u64)> = (0..4000).map(|i| (i * 2 * 1024 % (p.dst_len - 1024), 1024)).collect();
    p.post(1, Op::Write, &big, None).unwrap();
    p.post_to(second, 2, Op::Write, &[(0, 1024)], None).unwrap();
    while p.result(2).is_none() {
        assert!(p.pump(), "stalled");
    }
    assert_eq!(p.result(1), None, "the small transfer waited for all of the large one");
    p.run();
    assert!(ok(&p, 1));
}

#[test]
fn qp_number_reuse_after_destroy_never_removes_another_peers_qp() {
    let mut p = Pair::new(10, Opts::default());
    let old = p.qpns[0];
    p.i.st.remove_qp(Qpn(old), &p.limits); // a failed post_send destroyed it
    let second = p.add_peer();
    let reused = p.peer_qpns(second)[0];
    assert_eq!(reused, old, "the simulator hands out the freed number first");
    // Disconnecting the first peer by its stale number leaves the second's QP.
    p.i.st.remove_peer_qp(Qpn(old), p.peer, &p.limits);
    assert!(p.i.st.has_send_qp(Qpn(reused)));
    p.post_to(second, 1, Op::Write, &[(0, 64)], None).unwrap();
    p.run();
    assert!(ok(&p, 1));
}

#[test]
fn max_send_wr_of_one_and_post_after_failed_reconnect() {
    let mut p = Pair::new(11, Opts { max_send_wr: 1, signal_every: 1, post_list: 1, ..Opts::default() });
    let segs: Vec<(u64, u64)> = (0..50).map(|i| (i * PAGE, 100)).collect();
    p.post(1, Op::Write, &segs, Some(b"1")).unwrap();
    p.run();
    assert!(ok(&p, 1));
    // A reconnect that failed leaves the peer with no QPs: posts are refused.
    for q in p.qpns.clone() {
        p.i.st.remove_peer_qp(Qpn(q), p.peer, &p.limits);
    }
    p.qpns.clear();
    let e = p.post(2, Op::Write, &[(0, 8)], None).unwrap_err();
    assert!(matches!(e, TransportError::NotConnected(_)), "{e}");
}

#[test]
fn failed_post_send_destroys_the_qp_and_keeps_the_errno() {
    let mut p = Pair::new(12, Opts { signal_every: 4, ..Opts::default() });
    p.fabric.world().fail_post_at = Some(2);
    let segs: Vec<(u64, u64)> = (0..8).map(|i| (i * PAGE, 64)).collect();
    p.post(1, Op::Write, &segs, None).unwrap();
    p.run();
    let f = p.result(1).unwrap().unwrap_err();
    assert_eq!(f.kind, FailureKind::Transport);
    assert_eq!(f.source, FailureSource::Os(libc::EINVAL));
    assert!(!p.fabric.world().has_qp(p.qpns[0]), "the cut QP was destroyed");
    p.invariants();
}

#[test]
fn empty_post_with_a_notification_delivers_it_and_ends_done() {
    for qps in [1, 2] {
        let mut p = Pair::new(13, Opts { qps, ..Opts::default() });
        p.post(1, Op::Write, &[], Some(b"only")).unwrap();
        p.post(2, Op::Read, &[], None).unwrap();
        p.run();
        assert!(ok(&p, 1) && ok(&p, 2));
        assert_eq!(p.notifs(), vec![b"only".to_vec()]);
        p.post(3, Op::Write, &[(0, 64)], None).unwrap();
        p.run();
        assert!(ok(&p, 3), "the connection survives");
    }
}

#[test]
fn dead_peer_fails_by_the_progress_deadline_with_infinite_retries() {
    // rxe at retry_cnt=7: WRs to a killed peer never complete.
    let mut p = Pair::new(14, Opts { qps: 2, ..Opts::default() });
    p.fabric.world().infinite_retry = true;
    p.fabric.kill(1);
    let segs: Vec<(u64, u64)> = (0..300).map(|i| (i * PAGE, PAGE)).collect();
    p.post(1, Op::Write, &segs, Some(b"x")).unwrap();
    p.run();
    assert_eq!(p.result(1), None, "nothing completes by itself");
    let deadline = Duration::from_secs(10);
    p.advance(deadline / 2);
    p.i.st.expire(deadline, &p.limits);
    p.run();
    assert_eq!(p.result(1), None, "failed before its deadline");
    p.advance(deadline);
    p.i.st.expire(deadline, &p.limits);
    p.run();
    let f = p.result(1).expect("bounded by the deadline").unwrap_err();
    assert_eq!(f.kind, FailureKind::PeerTimeout, "{f}");
    p.invariants();
}

#[test]
fn a_qp_that_never_flushes_is_destroyed_a_deadline_later() {
    let mut p = Pair::new(15, Opts::default());
    p.fabric.world().infinite_retry = true;
    p.fabric.kill(1);
    p.post(1, Op::Write, &[(0, PAGE)], None).unwrap();
    let d = Duration::from_secs(1);
    p.advance(2 * d);
    p.i.st.expire(d, &p.limits);
    // The simulated flush is held back: the QP stays "stuck".
    p.advance(2 * d);
    p.i.st.expire(d, &p.limits);
    p.drain_cqs();
    let f = p.result(1).expect("destroyed QP fails its transfer").unwrap_err();
    assert!(matches!(f.kind, FailureKind::PeerTimeout | FailureKind::PeerDied), "{f}");
}

#[test]
fn liveness_close_fails_the_peers_qps_at_once() {
    let mut p = Pair::new(16, Opts { qps: 2, ..Opts::default() });
    p.fabric.world().infinite_retry = true;
    p.fabric.kill(1);
    let segs: Vec<(u64, u64)> = (0..100).map(|i| (i * PAGE, PAGE)).collect();
    p.post(1, Op::Write, &segs, None).unwrap();
    p.run();
    let why = crate::transport::TransferFailure::peer_died("liveness channel closed");
    p.i.st.fail_peer(p.peer, &why, &p.limits);
    p.run();
    assert_eq!(p.result(1).expect("failed at once").unwrap_err().kind, FailureKind::PeerDied);
    p.invariants();
}

#[test]
fn reads_beyond_the_read_depth_wait_in_the_send_queue() {
    // max_rd_atomic 2: at most two READs outstanding per QP; the rest wait
    // in the send queue (and a WRITE behind them until it reaches the head)
    // and every byte arrives.
    for seed in 0..4 {
        let mut p = Pair::new(seed, Opts { qps: 2, max_send_wr: 64, rd_atomic: 2, ..Opts::default() });
        p.fill_dst(|i| (i * 7 + i / 4096) as u8);
        let segs: Vec<(u64, u64)> = (0..200).rev().map(|i| (i * PAGE, PAGE)).collect();
        p.post(1, Op::Read, &segs, None).unwrap();
        p.post(2, Op::Write, &[(300 * PAGE, PAGE)], Some(b"after")).unwrap();
        p.run();
        assert!(ok(&p, 1) && ok(&p, 2), "{:?} {:?}", p.result(1), p.result(2));
        p.assert_same(&segs);
        let w = p.fabric.world();
        for q in &p.qpns {
            assert_eq!(w.max_reads.get(q), Some(&2), "QP {q}: READs outstanding at once");
        }
        assert!(w.read_waits > 0, "no READ waited for the depth");
        drop(w);
        p.invariants();
    }
}

#[test]
fn a_read_depth_of_one_still_fails_and_flushes_like_any_other_depth() {
    let mut p = Pair::new(9, Opts { max_send_wr: 16, rd_atomic: 1, ..Opts::default() });
    let segs: Vec<(u64, u64)> = (0..40).map(|i| (i * PAGE, PAGE)).collect();
    p.post(1, Op::Read, &segs, None).unwrap();
    p.steps(5);
    p.fabric.fail_next(p.qpns[0], WcStatus::RemAccessErr);
    p.run();
    let f = p.result(1).expect("reported").unwrap_err();
    assert_eq!(f.kind, FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds), "{f}");
    assert_eq!(p.fabric.world().max_reads.get(&p.qpns[0]), Some(&1));
    p.invariants();
}

mod coalesce;
mod engine;
mod fence;
mod prop;

#[test]
fn setup_errors_name_the_failing_verb_and_its_errno() {
    use crate::verbs::VerbsError;
    let e = super::setup_err(VerbsError::call("ibv_create_cq", libc::ENOMEM));
    assert!(matches!(e, TransportError::Io { call: "ibv_create_cq", .. }), "{e:?}");
    assert_eq!(e.failed_call(), Some(("ibv_create_cq", libc::ENOMEM)));
    assert_eq!(e.to_string(), format!("ibv_create_cq: {}", std::io::Error::from_raw_os_error(libc::ENOMEM)));
    let source = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>());
    assert_eq!(source.and_then(std::io::Error::raw_os_error), Some(libc::ENOMEM));
    // A missing device or provider op is still "unsupported", with its message.
    let e = super::setup_err(VerbsError::Unsupported("no RDMA device named mlx9".into()));
    assert!(matches!(&e, TransportError::Unsupported(m) if m == "no RDMA device named mlx9"), "{e:?}");
    assert_eq!(e.failed_call(), None);
}

#[test]
fn a_target_that_takes_nothing_holds_a_peer_at_its_bound_then_delivers_all_in_order() {
    let bound = 10usize;
    let mut p = Pair::new(7, Opts { notif_bound: (bound, 1 << 20), ..Opts::default() });
    // rnr_retry = 7, as the transport connects its QPs.
    for &q in &p.qpns {
        p.fabric.set_rnr_forever(q, true);
    }
    p.hold_notifs = true;
    let mut posted = Vec::new();
    let mut post_all = |p: &mut Pair, from: u64, to: u64| {
        let mut refused = 0;
        for i in from..to {
            match p.post(i, Op::Write, &[(i * 8, 8)], Some(format!("m{i}").as_bytes())) {
                Ok(()) => posted.push(i),
                Err(e) => {
                    assert!(e.to_string().contains("notifications in flight"), "{e}");
                    refused += 1;
                }
            }
        }
        refused
    };
    assert_eq!(post_all(&mut p, 0, 300), 44, "256 slots in flight");
    p.run();
    let recv_qpn = p.t.st.recv_qpns()[0];
    // The queue holds the bound (those receives were reposted); then every
    // posted receive completed and waits in its slot, unreposted; the next
    // SEND waits (RNR).
    assert_eq!(p.t_queued(), bound, "the target's queue stays at the peer's bound");
    assert_eq!(p.t.st.held_in(recv_qpn), RECVS_PER_QP as usize);
    let through = u64::from(RECVS_PER_QP) + bound as u64;
    let done: Vec<u64> = (0..300).filter(|&i| p.result(i).is_some()).collect();
    assert_eq!(done, (0..through).collect::<Vec<_>>(), "one SEND completed per receive");
    assert!(done.iter().all(|&i| ok(&p, i)));
    // Their slots came back: that many more go in flight, the rest are refused.
    assert_eq!(post_all(&mut p, 300, 400), 100 - through as usize);
    p.run();
    assert_eq!(p.t_queued(), bound, "still at the bound");
    // The application takes them: every one arrives, once, in order.
    p.hold_notifs = false;
    p.run();
    assert!(posted.iter().all(|&i| ok(&p, i)));
    let want: Vec<Vec<u8>> = posted.iter().map(|i| format!("m{i}").into_bytes()).collect();
    assert_eq!(p.notifs(), want);
    assert_eq!(p.t.st.held_in(recv_qpn), 0);
    assert!(!p.t.st.holds_back());
    p.invariants();
}

#[test]
fn held_notifications_are_delivered_when_their_peer_leaves() {
    let mut p = Pair::new(8, Opts { notif_bound: (3, 1 << 20), ..Opts::default() });
    for &q in &p.qpns {
        p.fabric.set_rnr_forever(q, true);
    }
    p.hold_notifs = true;
    for i in 0..20u64 {
        p.post(i, Op::Write, &[(i * 8, 8)], Some(format!("m{i}").as_bytes())).unwrap();
    }
    p.run();
    assert_eq!(p.t_queued(), 3);
    assert_eq!(p.t.st.held_in(p.t.st.recv_qpns()[0]), 17);
    // Their senders saw them succeed: destroying the QP delivers them.
    p.reconnect();
    assert_eq!(p.t_queued(), 20);
    p.hold_notifs = false;
    let want: Vec<Vec<u8>> = (0..20).map(|i| format!("m{i}").into_bytes()).collect();
    assert_eq!(p.notifs(), want);
}

#[test]
fn the_byte_bound_holds_too_but_one_notification_always_fits() {
    let mut p = Pair::new(9, Opts { notif_bound: (1000, 250), ..Opts::default() });
    for &q in &p.qpns {
        p.fabric.set_rnr_forever(q, true);
    }
    p.hold_notifs = true;
    for i in 0..10u64 {
        p.post(i, Op::Write, &[], Some(&[i as u8; 100])).unwrap();
    }
    p.run();
    assert_eq!(p.t_queued(), 2, "200 of 250 bytes; a third would pass the bound");
    p.hold_notifs = false;
    p.run();
    assert_eq!(p.notifs().len(), 10);
    // Larger than the byte bound alone: delivered when the queue is empty.
    p.hold_notifs = true;
    p.post(10, Op::Write, &[], Some(&[7; 1000])).unwrap();
    p.post(11, Op::Write, &[], Some(&[8; 10])).unwrap();
    p.run();
    assert_eq!(p.t_queued(), 1);
    p.hold_notifs = false;
    p.run();
    let got = p.notifs();
    assert_eq!(got.len(), 12);
    assert_eq!((got[10].len(), got[11].len()), (1000, 10));
}

/// The bound over the whole transport on the simulated NIC: a target that
/// takes nothing, one peer flooding it, another peer notifying it.
mod transport_bound {
    use std::time::{Duration, Instant};

    use crate::transport::verbs::VerbsTransport;
    use crate::transport::verbs::sim::{SimFabric, SimNic};
    use crate::transport::{
        Completion, FailureKind, Notification, Op, PeerId, PostRequest, Transport, TransportConfig, XferId,
    };

    fn config(opts: &[(&str, &str)]) -> TransportConfig {
        TransportConfig {
            peer_timeout: Duration::from_secs(30),
            options: opts.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }
    }

    fn notify(t: &mut VerbsTransport<SimNic>, peer: PeerId, x: u64, payload: Vec<u8>) {
        t.post(PostRequest { xfer: XferId(x), op: Op::Write, peer, segments: vec![], notification: Some(payload) })
            .unwrap();
    }

    /// Completions of `t` until none came for `quiet`.
    fn settle(t: &mut VerbsTransport<SimNic>, out: &mut Vec<Completion>, quiet: Duration) {
        let mut last = Instant::now();
        while last.elapsed() < quiet {
            let n = out.len();
            t.wait(out, Duration::from_millis(10));
            if out.len() > n {
                last = Instant::now();
            }
        }
    }

    #[test]
    fn a_flooding_peer_is_held_at_its_bound_fails_overloaded_past_its_slots_and_another_peer_still_delivers() {
        let fabric = SimFabric::new(11);
        fabric.world().auto_step = 64;
        let bound = 8usize;
        let mut t = VerbsTransport::on_sim("t", &config(&[("notif_queue_count", "8")]), &fabric).unwrap();
        let mut a = VerbsTransport::on_sim("a", &config(&[]), &fabric).unwrap();
        let mut b = VerbsTransport::on_sim("b", &config(&[]), &fabric).unwrap();
        let pa = a.connect("t", &t.connection_info(), &[]).unwrap();
        let pb = b.connect("t", &t.connection_info(), &[]).unwrap();
        let total = 600u64;
        for x in 0..total {
            notify(&mut a, pa, x, format!("a{x}").into_bytes());
        }
        let mut done_a = Vec::new();
        settle(&mut a, &mut done_a, Duration::from_millis(300));
        assert_eq!(t.core.notifs.len(), bound, "the target's queue holds the flooding peer's bound");
        let ok_a = done_a.iter().filter(|c| c.result.is_ok()).count();
        let over_a = done_a.iter().filter(|c| c.result.as_ref().is_err_and(|f| f.kind == FailureKind::Overloaded));
        assert_eq!(ok_a, 64 + bound, "one SEND per receive: {bound} queued (reposted), 64 held in their slots");
        assert_eq!(over_a.count() + ok_a, done_a.len(), "every failure is Overloaded: {done_a:?}");
        let in_flight = total as usize - done_a.len();
        assert!(in_flight > 0 && in_flight <= 256, "{in_flight} in flight (256 slots)");
        // Another peer is not held up by the first one's bound.
        for x in 0..5u64 {
            notify(&mut b, pb, x, format!("b{x}").into_bytes());
        }
        let mut done_b = Vec::new();
        settle(&mut b, &mut done_b, Duration::from_millis(200));
        assert_eq!(done_b.len(), 5);
        assert!(done_b.iter().all(|c| c.result.is_ok()), "{done_b:?}");
        assert_eq!(t.core.notifs.len(), bound + 5);
        // The target takes them: every notification of `a` not refused
        // arrives once, in order, and `b`'s five.
        let mut got: Vec<Notification> = Vec::new();
        let t0 = Instant::now();
        while done_a.len() < total as usize || got.len() < total as usize - over_count(&done_a) + 5 {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{} notifications, {} completions",
                got.len(),
                done_a.len()
            );
            t.take_notifications(&mut got);
            a.poll(&mut done_a);
            std::thread::sleep(Duration::from_millis(1));
        }
        t.take_notifications(&mut got);
        let refused: Vec<u64> = done_a.iter().filter(|c| c.result.is_err()).map(|c| c.xfer.0).collect();
        let want_a: Vec<Vec<u8>> =
            (0..total).filter(|x| !refused.contains(x)).map(|x| format!("a{x}").into_bytes()).collect();
        let from = |agent: &str| -> Vec<Vec<u8>> {
            got.iter().filter(|n| n.from_agent == agent).map(|n| n.payload.clone()).collect()
        };
        assert_eq!(from("a"), want_a);
        assert_eq!(from("b"), (0..5).map(|x| format!("b{x}").into_bytes()).collect::<Vec<_>>());
        assert!(
            done_a
                .iter()
                .filter(|c| c.result.is_err())
                .all(|c| c.result.as_ref().unwrap_err().kind == FailureKind::Overloaded)
        );
    }

    fn over_count(done: &[Completion]) -> usize {
        done.iter().filter(|c| c.result.is_err()).count()
    }

    #[test]
    fn a_target_that_takes_nothing_past_the_progress_timeout_fails_the_held_senders_transfers_peer_timeout() {
        let fabric = SimFabric::new(13);
        fabric.world().auto_step = 64;
        let mut t = VerbsTransport::on_sim("t", &config(&[("notif_queue_count", "4")]), &fabric).unwrap();
        let mut a = VerbsTransport::on_sim("a", &config(&[("progress_timeout_ms", "200")]), &fabric).unwrap();
        let pa = a.connect("t", &t.connection_info(), &[]).unwrap();
        for x in 0..100u64 {
            notify(&mut a, pa, x, format!("a{x}").into_bytes());
        }
        let mut done = Vec::new();
        let t0 = Instant::now();
        while done.len() < 100 {
            assert!(t0.elapsed() < Duration::from_secs(20), "{} of 100 completions", done.len());
            a.wait(&mut done, Duration::from_millis(10));
        }
        let ok = done.iter().filter(|c| c.result.is_ok()).count();
        assert_eq!(ok, 64 + 4, "delivered or held in the target's slots");
        let timed_out =
            done.iter().filter(|c| c.result.as_ref().is_err_and(|f| f.kind == FailureKind::PeerTimeout)).count();
        assert_eq!(ok + timed_out, 100, "the SENDs waiting at the NIC end PeerTimeout: {done:?}");
        // What succeeded is the target's: the queued ones now, the held ones
        // as it takes them.
        let mut got: Vec<Notification> = Vec::new();
        let t0 = Instant::now();
        while got.len() < ok {
            assert!(t0.elapsed() < Duration::from_secs(20), "{} of {ok} notifications", got.len());
            t.take_notifications(&mut got);
            std::thread::sleep(Duration::from_millis(1));
        }
        let want: Vec<Vec<u8>> = (0..ok as u64).map(|x| format!("a{x}").into_bytes()).collect();
        assert_eq!(got.into_iter().map(|n| n.payload).collect::<Vec<_>>(), want);
    }

    #[test]
    fn zero_or_garbage_bounds_are_invalid_options() {
        let fabric = SimFabric::new(12);
        for (k, v) in [("notif_queue_count", "0"), ("notif_queue_bytes", "0"), ("notif_queue_count", "many")] {
            let e = VerbsTransport::on_sim("x", &config(&[(k, v)]), &fabric).err().expect("refused");
            assert!(matches!(e, crate::transport::TransportError::InvalidOption { .. }), "{k}={v}: {e:?}");
        }
    }
}

/// The handshake listener's two rules (issue 27): an agent name is held by
/// one session at a time, and at most `max_preauth` connections wait for
/// their proof. Over the real handshake (TCP) on the simulated NIC.
mod listener_rules {
    use std::io::Read;
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    use crate::transport::verbs::sim::{SimFabric, SimNic};
    use crate::transport::verbs::{VerbsInfo, VerbsTransport};
    use crate::transport::{Notification, Op, PeerId, PostRequest, Transport, TransportConfig, TransportError, XferId};

    fn config(opts: &[(&str, &str)]) -> TransportConfig {
        TransportConfig {
            peer_timeout: Duration::from_secs(30),
            options: opts.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }
    }

    /// `from` notifies `t` once (`payload`) and `t` receives it from `name`.
    fn delivers(from: &mut VerbsTransport<SimNic>, peer: PeerId, t: &mut VerbsTransport<SimNic>, name: &str, x: u64) {
        let payload = format!("n{x}").into_bytes();
        let req = PostRequest { xfer: XferId(x), op: Op::Write, peer, segments: vec![], notification: Some(payload) };
        from.post(req).unwrap();
        let mut done = Vec::new();
        let mut got: Vec<Notification> = Vec::new();
        let t0 = Instant::now();
        while done.is_empty() || got.is_empty() {
            assert!(t0.elapsed() < Duration::from_secs(20), "no notification: {done:?}");
            from.poll(&mut done);
            t.take_notifications(&mut got);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(done[0].result.is_ok(), "{done:?}");
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].from_agent, name);
        assert_eq!(got[0].payload, format!("n{x}").into_bytes());
    }

    #[test]
    fn a_connected_name_is_refused_to_another_session_and_free_once_it_left() {
        let fabric = SimFabric::new(21);
        fabric.world().auto_step = 64;
        let mut t = VerbsTransport::on_sim("t", &config(&[]), &fabric).unwrap();
        let info = t.connection_info();
        let mut a = VerbsTransport::on_sim("a", &config(&[]), &fabric).unwrap();
        let pa = a.connect("t", &info, &[]).unwrap();
        // Another transport (another session) under the same name: refused, typed.
        let mut spoof = VerbsTransport::on_sim("a", &config(&[]), &fabric).unwrap();
        let e = spoof.connect("t", &info, &[]).unwrap_err();
        assert!(matches!(&e, TransportError::NameInUse { peer, name } if peer == "t" && name == "a"), "{e:?}");
        // The honest peer is unaffected, and its own session reconnects.
        delivers(&mut a, pa, &mut t, "a", 1);
        a.disconnect(pa);
        let pa = a.connect("t", &info, &[]).unwrap();
        delivers(&mut a, pa, &mut t, "a", 2);
        // Still held while `a` is connected, however often the spoofer tries.
        assert!(matches!(spoof.connect("t", &info, &[]), Err(TransportError::NameInUse { .. })));
        // Once `a` left (its receive QPs removed here), the name is free.
        drop(a);
        let t0 = Instant::now();
        let ps = loop {
            match spoof.connect("t", &info, &[]) {
                Ok(p) => break p,
                Err(TransportError::NameInUse { .. }) if t0.elapsed() < Duration::from_secs(5) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("the name stayed held after its peer left: {e:?}"),
            }
        };
        delivers(&mut spoof, ps, &mut t, "a", 3);
    }

    #[test]
    fn the_oldest_unauthenticated_handshakes_are_closed_past_max_preauth() {
        let fabric = SimFabric::new(22);
        fabric.world().auto_step = 64;
        let max = 4usize;
        let mut t = VerbsTransport::on_sim("t", &config(&[("max_preauth", "4")]), &fabric).unwrap();
        let info = t.connection_info();
        let addr = postcard::from_bytes::<VerbsInfo>(&info).unwrap().addr;
        // A flood that never says hello (peer_timeout is 30 s: none times out).
        let mut flood: Vec<TcpStream> = (0..3 * max).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        // The listener closes all but the newest `max`, oldest first.
        let closed = |s: &mut TcpStream| {
            s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
            }
        };
        let t0 = Instant::now();
        for (i, s) in flood.iter_mut().enumerate().take(2 * max) {
            let mut shut = closed(s);
            while !shut && t0.elapsed() < Duration::from_secs(10) {
                shut = closed(s);
            }
            assert!(shut, "flood connection {i} (of {}) is still open past max_preauth {max}", 3 * max);
        }
        for (i, s) in flood.iter_mut().enumerate().skip(2 * max) {
            assert!(!closed(s), "flood connection {i}, among the newest {max}, was closed");
        }
        // An authenticated peer connects (well within peer_timeout) and delivers.
        let mut a = VerbsTransport::on_sim("a", &config(&[]), &fabric).unwrap();
        let t0 = Instant::now();
        let pa = a.connect("t", &info, &[]).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
        delivers(&mut a, pa, &mut t, "a", 1);
        // Its proof took it off the list: the flood's newest are still open.
        assert!(!closed(&mut flood[3 * max - 1]), "the newest flood connection was closed");
    }

    #[test]
    fn max_preauth_zero_or_garbage_is_an_invalid_option() {
        let fabric = SimFabric::new(23);
        for v in ["0", "many", "-1"] {
            let e = VerbsTransport::on_sim("x", &config(&[("max_preauth", v)]), &fabric).err().expect("refused");
            assert!(matches!(e, TransportError::InvalidOption { .. }), "max_preauth={v}: {e:?}");
        }
        // A known option: 1 is the least accepted.
        VerbsTransport::on_sim("x", &config(&[("max_preauth", "1")]), &fabric).expect("max_preauth=1");
    }
}

/// A target that takes the side-channel connection but never answers the
/// handshake is a `Timeout` (`op` `"connect"`) within `peer_timeout`,
/// which may be retried; the same transport then connects to a real
/// target (nothing of the failed try was kept).
#[test]
fn a_target_that_never_answers_the_handshake_is_a_connect_timeout() {
    use crate::transport::verbs::sim::SimFabric;
    use crate::transport::verbs::{VerbsInfo, VerbsTransport};
    use crate::transport::{Transport, TransportConfig};

    let fabric = SimFabric::new(17);
    fabric.world().auto_step = 64;
    let timeout = Duration::from_millis(300);
    let config = TransportConfig { peer_timeout: timeout, ..Default::default() };
    let mut a = VerbsTransport::on_sim("a", &config, &fabric).unwrap();
    let t = VerbsTransport::on_sim("t", &config, &fabric).unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let held = std::thread::spawn({
        let silent = silent.try_clone().unwrap();
        move || silent.accept().map(|(s, _)| s)
    });
    let real: VerbsInfo = postcard::from_bytes(&t.connection_info()).unwrap();
    let info = VerbsInfo { addr: silent.local_addr().unwrap().to_string(), secret: real.secret };
    let started = std::time::Instant::now();
    let got = a.connect("t", &postcard::to_allocvec(&info).unwrap(), &[]);
    match &got {
        Err(TransportError::Timeout { op: "connect", peer, timeout: t, .. }) => {
            assert_eq!((peer.as_str(), *t), ("t", timeout));
        }
        other => panic!("expected a connect Timeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(20), "bounded by peer_timeout: {:?}", started.elapsed());
    drop(held.join());
    a.connect("t", &t.connection_info(), &[]).expect("the real target after a timed-out try");
}
