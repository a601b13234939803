//! In-flight bookkeeping shared by the backends whose worker threads move
//! the bytes (`shm`, `tcp`): the per-transfer state those workers update
//! ([`XferState`]) and the table of posted transfers that the transport
//! polls and cancels ([`InFlight`]).
//!
//! A transfer is cut into chunks; `pending` counts the chunks no worker has
//! finished yet. The worker that finishes the last one reports the
//! completion, unless the transfer was cancelled, and `cancel` waits for
//! `pending` to reach 0, so that once it returns no worker touches the
//! transfer's buffers (shm). A backend that knows which workers are inside
//! a chunk (tcp) uses [`InFlight::mark_cancelled`] and waits for those
//! alone: its chunks still queued are skipped when reached, touching
//! nothing, and keep the transfer's state alive until then. What is
//! backend-specific (the peer, the segments, how chunks are handed out)
//! stays in the backend, next to an embedded [`XferState`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use super::{Completion, Op, TransferFailure, XferId};

/// The state of one posted transfer that every worker-driven backend keeps.
#[derive(Debug)]
pub(super) struct XferState {
    /// Id reported in the completion.
    pub id: XferId,
    /// READ or WRITE.
    pub op: Op,
    /// Sent after the last byte.
    pub notification: Option<Vec<u8>>,
    /// Set by `cancel`: workers skip chunks not yet started and stop early.
    pub cancelled: AtomicBool,
    /// Chunks not yet finished ([`InFlight::cancel`] waits for 0).
    pending: AtomicUsize,
    /// First failure.
    error: Mutex<Option<TransferFailure>>,
}

impl XferState {
    /// A transfer of `chunks` chunks that no worker has started.
    pub(super) fn new(id: XferId, op: Op, notification: Option<Vec<u8>>, chunks: usize) -> Self {
        Self {
            id,
            op,
            notification,
            cancelled: AtomicBool::new(false),
            pending: AtomicUsize::new(chunks),
            error: Mutex::new(None),
        }
    }

    /// Record a failure; only the first one is reported.
    pub(super) fn fail(&self, why: TransferFailure) {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            *e = Some(why);
        }
    }

    /// True while the next chunk is worth moving: neither cancelled nor failed.
    pub(super) fn live(&self) -> bool {
        !self.cancelled.load(Ordering::Acquire) && self.error.lock().map(|e| e.is_none()).unwrap_or(false)
    }

    /// Count one chunk finished (moved, skipped or failed). True for the
    /// last one: the caller then calls [`XferState::complete`].
    pub(super) fn chunk_done(&self) -> bool {
        self.pending.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// After the last chunk, report the completion on `done` — unless the
    /// transfer was cancelled, which reports nothing. The result is the
    /// first failure, else what `then` returns (it runs only when every
    /// chunk succeeded: the backend's last checks and the notification).
    /// A completion sent just as a cancel lands (this check before its
    /// store) names an id the cancel removed from [`InFlight`], which drops
    /// it: it is never reported.
    pub(super) fn complete(&self, done: &Sender<Completion>, then: impl FnOnce() -> Result<(), TransferFailure>) {
        // Last chunk: nothing touches the transfer's buffers any more.
        if self.cancelled.load(Ordering::Acquire) {
            return;
        }
        let result = match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => then(),
        };
        let _ = done.send(Completion { xfer: self.id, result });
    }
}

/// The posted transfers of one transport, by id, and the queue their
/// workers report completions on. `T` is the backend's transfer type,
/// which embeds an [`XferState`].
pub(super) struct InFlight<T> {
    xfers: HashMap<u64, Arc<T>>,
    done_tx: Sender<Completion>,
    done: Receiver<Completion>,
}

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        let (done_tx, done) = crossbeam_channel::unbounded();
        Self { xfers: HashMap::new(), done_tx, done }
    }
}

fn state<T: AsRef<XferState>>(x: &Arc<T>) -> &XferState {
    (**x).as_ref()
}

impl<T: AsRef<XferState>> InFlight<T> {
    /// Where workers send completions (for [`XferState::complete`]).
    pub(super) fn sender(&self) -> Sender<Completion> {
        self.done_tx.clone()
    }

    /// A signal on the completion channel (see [`super::CompletionSignal`]).
    pub(super) fn signal(&self) -> super::CompletionSignal {
        super::CompletionSignal::new(self.done.clone())
    }

    /// Track a posted transfer until it completes or is cancelled.
    pub(super) fn insert(&mut self, x: Arc<T>) {
        let id = state(&x).id;
        self.xfers.insert(id.0, x);
    }

    /// Append the completions of tracked transfers to `out` and forget those
    /// transfers. Never blocks.
    pub(super) fn poll(&mut self, out: &mut Vec<Completion>) {
        self.drain(out);
    }

    /// [`InFlight::poll`], returning how many completions arrived (those of
    /// cancelled transfers included, which are dropped).
    fn drain(&mut self, out: &mut Vec<Completion>) -> usize {
        let mut arrived = 0;
        for c in self.done.try_iter() {
            arrived += 1;
            if self.xfers.remove(&c.xfer.0).is_some() {
                out.push(c);
            }
        }
        arrived
    }

    /// As [`InFlight::poll`], blocking until a completion arrives or
    /// `timeout` passes. A completion of a cancelled transfer ends the wait
    /// too (with nothing appended); callers wait again.
    pub(super) fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) {
        if self.drain(out) > 0 {
            return;
        }
        if let Ok(c) = self.done.recv_timeout(timeout) {
            if self.xfers.remove(&c.xfer.0).is_some() {
                out.push(c);
            }
            self.poll(out);
        }
    }

    /// Stop a transfer: mark it cancelled, then wait until no worker is
    /// inside one of its chunks, so that nothing touches its buffers once
    /// this returns. Its completion, if one was already queued, is dropped
    /// by [`InFlight::poll`]. Unknown or finished ids are ignored.
    pub(super) fn cancel(&mut self, xfer: XferId) {
        self.cancel_then(xfer, |_| {});
    }

    /// [`InFlight::cancel`], calling `cut` between marking the transfer
    /// cancelled and waiting: the backend's way to end a chunk blocked on
    /// the wire (tcp shuts its connection down). A worker that enters a
    /// chunk publishes that first and checks [`XferState::live`] after, so
    /// either `cut` sees it inside or it sees the cancel.
    pub(super) fn cancel_then(&mut self, xfer: XferId, cut: impl FnOnce(&T)) {
        let Some(x) = self.mark_cancelled(xfer) else { return };
        cut(&x);
        let s = state(&x);
        super::wait_until(|| s.pending.load(Ordering::Acquire) == 0);
    }

    /// Forget a tracked transfer and mark it cancelled, without waiting:
    /// for a backend that knows itself which workers are inside one of its
    /// chunks (tcp: its chunks still queued behind other transfers' are
    /// skipped whenever a worker reaches them, and need no wait). None for
    /// unknown or finished ids.
    pub(super) fn mark_cancelled(&mut self, xfer: XferId) -> Option<Arc<T>> {
        let x = self.xfers.remove(&xfer.0)?;
        state(&x).cancelled.store(true, Ordering::SeqCst);
        Some(x)
    }

    /// [`InFlight::cancel`] every tracked transfer, one after the other.
    pub(super) fn cancel_all(&mut self) {
        let ids: Vec<u64> = self.xfers.keys().copied().collect();
        for id in ids {
            self.cancel(XferId(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct X(XferState);

    impl AsRef<XferState> for X {
        fn as_ref(&self) -> &XferState {
            &self.0
        }
    }

    /// A table tracking transfers 1, 2, … of `chunks[i]` chunks each.
    fn tracked(chunks: &[usize]) -> (InFlight<X>, Vec<Arc<X>>) {
        let mut t = InFlight::default();
        let xs: Vec<Arc<X>> =
            (1..).zip(chunks).map(|(id, &n)| Arc::new(X(XferState::new(XferId(id), Op::Write, None, n)))).collect();
        for x in &xs {
            t.insert(x.clone());
        }
        (t, xs)
    }

    fn polled(t: &mut InFlight<X>) -> Vec<Completion> {
        let mut out = Vec::new();
        t.poll(&mut out);
        out
    }

    #[test]
    fn last_chunk_reports_first_failure_or_then() {
        let (mut t, xs) = tracked(&[2, 1]);
        let (a, b) = (&xs[0].0, &xs[1].0);
        assert!(a.live());
        a.fail(TransferFailure::peer_died("first"));
        a.fail(TransferFailure::protocol("second"));
        assert!(!a.live());
        assert!(!a.chunk_done());
        assert!(a.chunk_done());
        a.complete(&t.sender(), || panic!("runs only when every chunk succeeded"));
        assert!(b.chunk_done());
        b.complete(&t.sender(), || Err(TransferFailure::peer_timeout("notification failed")));
        let want =
            [(1, TransferFailure::peer_died("first")), (2, TransferFailure::peer_timeout("notification failed"))]
                .map(|(id, e)| Completion { xfer: XferId(id), result: Err(e) });
        assert_eq!(polled(&mut t), want);
        assert!(polled(&mut t).is_empty());
    }

    #[test]
    fn cancel_waits_for_workers_and_drops_completions() {
        let (mut t, xs) = tracked(&[1, 1]);
        // Completed but not yet polled: cancel drops the completion.
        assert!(xs[1].0.chunk_done());
        xs[1].0.complete(&t.sender(), || Ok(()));
        t.cancel(XferId(2));
        // A worker inside a chunk until it sees the cancel: cancel waits.
        let a = xs[0].clone();
        let done = t.sender();
        let worker = std::thread::spawn(move || {
            while a.0.live() {
                std::thread::yield_now();
            }
            assert!(a.0.chunk_done());
            a.0.complete(&done, || panic!("cancelled: no completion"));
        });
        t.cancel_all();
        assert_eq!(xs[0].0.pending.load(Ordering::Acquire), 0);
        worker.join().unwrap();
        t.cancel(XferId(7)); // unknown: ignored
        assert!(polled(&mut t).is_empty());
    }

    #[test]
    fn wait_returns_a_late_completion_and_times_out_without_one() {
        let (mut t, xs) = tracked(&[1, 1]);
        let mut out = Vec::new();
        let t0 = std::time::Instant::now();
        t.wait(&mut out, Duration::from_millis(30));
        assert!(out.is_empty() && t0.elapsed() >= Duration::from_millis(30), "returned early: {out:?}");
        // A cancelled transfer's completion (sent by a worker that finished
        // just as the cancel came) ends a wait with nothing appended.
        assert!(xs[1].0.chunk_done());
        t.cancel(XferId(2));
        t.sender().send(Completion { xfer: XferId(2), result: Ok(()) }).unwrap();
        let t0 = std::time::Instant::now();
        t.wait(&mut out, Duration::from_secs(10));
        assert!(out.is_empty(), "{out:?}");
        assert!(t0.elapsed() < Duration::from_secs(5), "the completion did not end the wait");
        // A completion sent while the caller waits wakes it.
        let (a, done) = (xs[0].clone(), t.sender());
        let worker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            assert!(a.0.chunk_done());
            a.0.complete(&done, || Ok(()));
        });
        t.wait(&mut out, Duration::from_secs(10));
        worker.join().unwrap();
        assert_eq!(out, [Completion { xfer: XferId(1), result: Ok(()) }]);
    }
}
