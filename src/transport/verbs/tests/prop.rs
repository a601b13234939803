//! Random interleavings of commands (post, cancel, reconnect), fabric steps,
//! injected faults and deadline expiries, checking after every step that no
//! transfer is reported twice, no CQ overruns, the CQE budget adds up and no
//! notification arrives ahead of its data; and at the end that every
//! transfer not cancelled ended exactly once and that no buffer was touched
//! after its cancel returned.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::sim_harness::{Opts, PAGE, Pair};
use crate::transport::Op;
use crate::verbs::WcStatus;

/// Pages of source each transfer owns (its segments stay inside).
const SLICE: u64 = 16;

#[derive(Debug, Clone)]
enum Cmd {
    Post { pages: u8, notify: bool, read: bool },
    Steps(u8),
    Cancel(u8),
    Fault { qp: u8, status: u8 },
    Expire,
    Reconnect,
}

fn cmd() -> impl Strategy<Value = Cmd> {
    prop_oneof![
        4 => (0u8..12, any::<bool>(), any::<bool>()).prop_map(|(pages, notify, read)| Cmd::Post { pages, notify, read }),
        4 => any::<u8>().prop_map(Cmd::Steps),
        1 => any::<u8>().prop_map(Cmd::Cancel),
        1 => (any::<u8>(), 0u8..4).prop_map(|(qp, status)| Cmd::Fault { qp, status }),
        1 => Just(Cmd::Expire),
        1 => Just(Cmd::Reconnect),
    ]
}

fn opts() -> impl Strategy<Value = Opts> {
    (
        1u32..4,
        prop_oneof![Just(1u32), Just(4), Just(16), Just(256)],
        1u32..40,
        prop_oneof![Just(128usize), Just(256)],
        prop_oneof![Just(1u32), Just(2), Just(16)],
    )
        .prop_map(|(qps, max_send_wr, signal_every, cq, rd_atomic)| Opts {
            qps,
            max_send_wr,
            signal_every,
            post_list: 8,
            cq,
            cq_target: 1024,
            rd_atomic,
            ..Opts::default()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_transfer_ends_once_and_cancel_fences_the_nic(
        seed in any::<u64>(),
        o in opts(),
        cmds in proptest::collection::vec(cmd(), 1..60),
    ) {
        let mut p = Pair::new(seed, o);
        p.fill_src(|i| (i as u8) ^ (i >> 12) as u8);
        let mut posted: Vec<u64> = Vec::new();
        let mut cancelled: HashMap<u64, u64> = HashMap::new();
        for c in cmds {
            match c {
                Cmd::Post { pages, notify, read } => {
                    let x = posted.len() as u64;
                    if x * SLICE * PAGE + SLICE * PAGE > p.src_len {
                        continue;
                    }
                    // Descending pages (nothing coalesces), some short.
                    let segs: Vec<(u64, u64)> = (0..u64::from(pages))
                        .rev()
                        .map(|k| ((x * SLICE + k) * PAGE, if k % 3 == 1 { 100 } else { PAGE }))
                        .collect();
                    let payload = format!("x{x}").into_bytes();
                    let op = if read { Op::Read } else { Op::Write };
                    let notif = notify.then_some(payload.as_slice());
                    if p.post(x, op, &segs, notif).is_ok() {
                        posted.push(x);
                    }
                }
                Cmd::Steps(n) => p.steps(usize::from(n)),
                Cmd::Cancel(k) => {
                    if let Some(&x) = posted.get(usize::from(k) % posted.len().max(1))
                        && !cancelled.contains_key(&x)
                        && p.result(x).is_none()
                    {
                        let at = p.cancel(x);
                        cancelled.insert(x, at);
                    }
                }
                Cmd::Fault { qp, status } => {
                    if !p.qpns.is_empty() {
                        let q = p.qpns[usize::from(qp) % p.qpns.len()];
                        let s = [WcStatus::RemAccessErr, WcStatus::RetryExcErr, WcStatus::RnrRetryExcErr, WcStatus::LocProtErr][usize::from(status)];
                        p.fabric.fail_next(q, s);
                    }
                }
                Cmd::Expire => {
                    p.advance(Duration::from_secs(20));
                    p.i.st.expire(Duration::from_secs(10), &p.limits);
                }
                Cmd::Reconnect => p.reconnect(),
            }
            p.invariants();
        }
        // Settle: run, then let the deadline fail whatever is stuck.
        for _ in 0..3 {
            p.run();
            p.advance(Duration::from_secs(30));
            p.i.st.expire(Duration::from_secs(10), &p.limits);
        }
        p.run();
        p.invariants();
        for &x in &posted {
            match cancelled.get(&x) {
                None => prop_assert!(p.result(x).is_some(), "transfer {x} never ended"),
                Some(&at) => {
                    // Reported before the cancel, or never.
                    let lo = x * SLICE * PAGE;
                    let hi = lo + SLICE * PAGE;
                    let w = p.fabric.world();
                    let late = w.touches.iter().find(|&&(s, key, off, _)| {
                        s > at && key == p.src.1 && (off as u64) >= lo && (off as u64) < hi
                    });
                    prop_assert!(late.is_none(), "transfer {x} touched after cancel returned: {late:?}");
                }
            }
        }
    }
}
