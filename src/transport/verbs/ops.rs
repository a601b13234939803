//! The engine's commands as steps of the state machine: accept a post
//! (notification slot, transfer record, queued work) and cancel a transfer
//! (drop its queued work, flush and finally destroy the QPs that still carry
//! it). The engine (`engine.rs`) and the simulated tests call these same
//! functions.

use super::super::nic::NicQp;
use super::{DeferredNotify, NOTIF_SLOT_BYTES, NOTIF_SLOTS, PostLimits, Qpn, SlotRefusal, State, Xfer};
use crate::transport::{Op, PeerId, PostRequest, TransferFailure, TransportError, XferId};

impl<Q: NicQp> State<Q> {
    /// Accept `req` for a peer named `peer_name` whose QPs are `qpns`: take
    /// a notification slot (when it carries one), record the transfer, queue
    /// its work and post what fits. A post with no segments and a
    /// notification sends just the notification and ends `Done` once it was
    /// sent; with neither it ends `Done` at once.
    ///
    /// # Errors
    /// [`TransportError::Post`] for a notification over
    /// [`NOTIF_SLOT_BYTES`] or more than [`NOTIF_SLOTS`] in flight;
    /// [`TransportError::NotConnected`] when the peer has no slots.
    pub fn post(
        &mut self,
        req: &PostRequest,
        qpns: &[Qpn],
        peer_name: &str,
        limits: &PostLimits,
    ) -> Result<(), TransportError> {
        if req.notification.as_ref().is_some_and(|n| n.len() > NOTIF_SLOT_BYTES) {
            return Err(TransportError::Post(format!("notification larger than {NOTIF_SLOT_BYTES} bytes")));
        }
        if qpns.is_empty() {
            return Err(TransportError::NotConnected(req.peer));
        }
        let mut slot = None;
        if let Some(payload) = &req.notification {
            let r = self.slots.take(req.peer, payload).map_err(|e| match e {
                SlotRefusal::NoSlab => TransportError::NotConnected(req.peer),
                SlotRefusal::Full => {
                    TransportError::Post(format!("more than {NOTIF_SLOTS} notifications in flight to {peer_name}"))
                }
            })?;
            slot = Some((r, payload.len() as u32));
        }
        let qp0 = qpns[0];
        let multi = qpns.len() > 1;
        self.xfers.insert(
            req.xfer,
            Xfer {
                queued: 0,
                chunks: 0,
                error: None,
                cancelled: false,
                deferred_notify: slot.filter(|_| multi).map(|(r, len)| DeferredNotify { qpn: qp0, slot: r.slot, len }),
                slot: slot.map(|(r, _)| r),
            },
        );
        self.enqueue(req.xfer, req.op, &req.segments, qpns, limits);
        if let (Some((r, l)), false) = (slot, multi) {
            // One QP: the notification goes right behind the data. After
            // WRITEs in-order delivery suffices; after READs it must wait
            // for their data to arrive here (the target may reuse the pages
            // once notified, and a READ answered again after a lost packet
            // would read them anew), which the fence makes the NIC do.
            self.enqueue_notify(req.xfer, qp0, r.slot, l, req.op == Op::Read, limits);
        }
        self.try_finish(req.xfer, limits);
        Ok(())
    }

    /// A QP of `peer` failed or went away: tell the caller (its next post
    /// reconnects).
    pub fn mark_broken(&self, peer: PeerId) {
        if let Some(l) = self.links.get(&peer) {
            l.broken.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Start cancelling `xfer`: drop its queued work and its deferred
    /// notification; it will not be reported. False when it is not in
    /// flight (finished already).
    pub fn cancel_start(&mut self, xfer: XferId, limits: &PostLimits) -> bool {
        let Some(x) = self.xfers.get_mut(&xfer) else {
            return false;
        };
        x.cancelled = true;
        x.deferred_notify = None;
        let mut dropped = 0;
        for sq in self.send_qps.values_mut() {
            let before = sq.queue.len();
            sq.queue.retain(|w| w.xfer() != xfer);
            dropped += before - sq.queue.len();
        }
        if let Some(x) = self.xfers.get_mut(&xfer) {
            x.queued = x.queued.saturating_sub(dropped as u32);
        }
        self.try_finish(xfer, limits);
        true
    }

    /// One look at a cancel in progress: true once `xfer` is gone, so the
    /// NIC can no longer touch its buffers. Past the flush deadline (`flush`)
    /// the QPs still carrying it are put in error once (`flushed` remembers),
    /// which flushes its WRs; past the destroy deadline (`destroy`) those
    /// QPs are destroyed, and with none left carrying it the record is
    /// dropped (its notification slot given back).
    pub fn cancel_step(
        &mut self,
        xfer: XferId,
        flush: bool,
        destroy: bool,
        flushed: &mut bool,
        limits: &PostLimits,
    ) -> bool {
        if !self.xfers.contains_key(&xfer) {
            return true;
        }
        if !flush {
            return false;
        }
        let carrying: Vec<Qpn> = self
            .send_qps
            .iter()
            .filter(|(_, sq)| sq.chunks.values().any(|c| c.xfer == xfer))
            .map(|(&q, _)| q)
            .collect();
        if !*flushed {
            *flushed = true;
            for q in &carrying {
                let why = TransferFailure::cancelled(format!("QP flushed to cancel transfer {}", xfer.0));
                self.fail_qp(*q, why, limits);
            }
        } else if destroy {
            for q in &carrying {
                tracing::warn!("verbs: cancel of transfer {} destroys QP {q}, which did not drain", xfer.0);
                self.remove_qp(*q, limits);
            }
            if carrying.is_empty() {
                self.drop_xfer(xfer);
            }
        }
        !self.xfers.contains_key(&xfer)
    }
}
