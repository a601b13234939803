//! Bounded failure: the progress deadline of a QP with work in flight, and
//! failing a QP or a whole peer at once (its liveness channel closed).

use std::time::Duration;

use super::super::nic::NicQp;
use super::{PostLimits, Qpn, State};
use crate::transport::{PeerId, TransferFailure};

impl<Q: NicQp> State<Q> {
    /// Bound how long a QP may go without progress (issue: a transfer to a
    /// SIGKILLed peer must fail in bounded time; rxe's requester retries
    /// forever at `retry_cnt=7`, `rxe_comp.c`). A QP with WRs in flight and
    /// no completion for `deadline` is failed with
    /// [`FailureKind::PeerTimeout`](crate::transport::FailureKind) by
    /// [`fail_qp`](Self::fail_qp); one that still holds WRs `deadline`
    /// after that (no flush came) is destroyed, after which the NIC no
    /// longer touches its buffers, and what it carried fails.
    pub fn expire(&mut self, deadline: Duration, limits: &PostLimits) {
        let now = self.now;
        let (mut stuck, mut dead) = (Vec::new(), Vec::new());
        for (&q, sq) in &self.send_qps {
            if sq.outstanding == 0 && sq.chunks.is_empty() {
                continue;
            }
            match sq.expired_at {
                Some(t) if now.saturating_duration_since(t) > deadline => dead.push(q),
                Some(_) => {}
                None if now.saturating_duration_since(sq.progress_at) > deadline => stuck.push(q),
                None => {}
            }
        }
        for q in stuck {
            let why = TransferFailure::peer_timeout(format!("no completion on QP {q} within {deadline:?}"));
            self.fail_qp(q, why, limits);
        }
        for q in dead {
            tracing::warn!("verbs: QP {q} did not flush within {deadline:?} of its error; destroying it");
            self.remove_qp(q, limits);
        }
    }

    /// Put `qpn` in the error state with `why` (unless an earlier error did):
    /// the NIC flushes its posted WRs, each failing its transfer with `why`;
    /// its queued work fails now. The next post to its peer reconnects.
    pub fn fail_qp(&mut self, qpn: Qpn, why: TransferFailure, limits: &PostLimits) {
        let now = self.now;
        let Some(sq) = self.send_qps.get_mut(&qpn) else {
            return;
        };
        if sq.error.is_none() {
            tracing::warn!("verbs: QP {qpn}: {why}");
            sq.error = Some(why);
            if let Err(e) = sq.qp.set_error() {
                tracing::warn!("verbs: QP {qpn} to the error state: {e}");
            }
        }
        sq.expired_at.get_or_insert(now);
        let peer = sq.peer;
        self.mark_broken(peer);
        self.fail_queue(qpn, limits);
    }

    /// [`fail_qp`](Self::fail_qp) for every QP of `peer` (its liveness
    /// channel closed: the peer process is gone).
    pub fn fail_peer(&mut self, peer: PeerId, why: &TransferFailure, limits: &PostLimits) {
        let qps: Vec<Qpn> = self.send_qps.iter().filter(|(_, sq)| sq.peer == peer).map(|(&q, _)| q).collect();
        for q in qps {
            self.fail_qp(q, why.clone(), limits);
        }
    }
}
