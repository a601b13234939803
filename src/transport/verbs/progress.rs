//! The verbs transport's progress thread: the engine's only thread. It
//! takes commands from its channel, polls the shared completion queue and
//! hands each completion to the engine; when both are idle it spins, then
//! yields, then blocks on the CQ's completion channel together with the
//! engine's wake fd (or, without completion events, on the command channel
//! for `poll_sleep_us`), so a command wakes it at once.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

use super::engine::{Cmd, Engine, Wake};
use super::nic::Nic;
use super::nic::NicQp;
use super::state::HeldNotification;
use super::state::PostLimits;
use crate::transport::Completion;
use crate::verbs::WorkCompletion;

/// Polls of an idle CQ that spin before the thread starts to yield.
const IDLE_SPINS: u32 = 64;
/// How often the progress thread looks for QPs past their progress deadline
/// (and at the deadlines of cancels in progress).
const EXPIRE_EVERY: Duration = Duration::from_millis(10);
/// Commands taken per turn before the CQ is polled again, so a stream of
/// posts cannot hold completions back.
const COMMANDS_PER_TURN: usize = 64;
/// Capacity of the command channel (commands). With the intake pause
/// ([`QUEUED_WR_LIMIT`](super::engine::QUEUED_WR_LIMIT)) it makes a poster feel the NIC: once the engine
/// holds that many WRs in software and this many commands wait behind them,
/// `VerbsTransport::post` blocks in the channel's `send` until completions
/// free room (it never fails for it, and never waits on anything but the NIC).
pub(super) const CMD_CAPACITY: usize = 1024;

/// Run `engine` until [`Cmd::Stop`] (or every sender is gone); then it is
/// dropped here, destroying its QPs, memory and NIC on this thread.
pub(super) fn run<N: Nic>(mut engine: Engine<N>, rx: &Receiver<Cmd<N::Qp>>, wake: &Wake) {
    let mut wcs = vec![WorkCompletion::default(); 64];
    let mut idle = 0u32;
    // Completion events: armed = an event was requested and not consumed yet.
    let mut events = engine.nic.has_events();
    let mut armed = false;
    let mut next_expire = Instant::now() + EXPIRE_EVERY;
    let idle_yields = engine.limits.idle_yields;
    let poll_sleep = Duration::from_micros(u64::from(engine.limits.poll_sleep_us));
    loop {
        // Receives held back while their peer was at its notification bound
        // (usually none): reposted once the application took enough.
        if engine.release_held() {
            idle = 0;
        }
        let mut took = 0;
        // Past the limit, commands wait in the (bounded) channel: a fast
        // poster then blocks in `send` until the NIC catches up.
        let intake = engine.queued_wrs() < engine.queued_wr_limit;
        while intake && took < COMMANDS_PER_TURN {
            match rx.try_recv() {
                Ok(cmd) => {
                    took += 1;
                    if !engine.command(cmd, Instant::now()) {
                        return;
                    }
                }
                Err(crossbeam_channel::TryRecvError::Empty) => break,
                Err(crossbeam_channel::TryRecvError::Disconnected) => return,
            }
        }
        if took > 0 {
            // Work was just posted: spin for its completions.
            idle = 0;
        }
        match engine.nic.poll_cq(&mut wcs) {
            Ok(0) => {
                idle = idle.saturating_add(1);
                if idle >= IDLE_SPINS || engine.cancelling() {
                    let now = Instant::now();
                    if now >= next_expire {
                        engine.tick(now);
                        next_expire = now + EXPIRE_EVERY;
                    }
                }
                if idle < IDLE_SPINS {
                    std::hint::spin_loop();
                } else if !intake {
                    // Commands wait and so does queued work: do not block on
                    // the channel or the wake fd, only give the NIC time.
                    std::thread::sleep(poll_sleep);
                } else if idle < IDLE_SPINS + idle_yields {
                    std::thread::yield_now();
                } else if events && !armed {
                    // Arm, then poll once more before blocking: a completion
                    // that arrived before arming raises no event.
                    match engine.nic.req_notify() {
                        Ok(()) => armed = true,
                        Err(e) => {
                            tracing::warn!("verbs: {e}; polling without completion events");
                            events = false;
                        }
                    }
                } else if events {
                    // `take_notifications` wakes the thread after giving
                    // credit back; a held receive that fits already is
                    // released at the top of the loop instead of sleeping.
                    if wake.prepare_sleep(rx) && !engine.st.can_release() {
                        let r = engine.nic.wait_event(wake.fd(), engine.event_wait_ms);
                        wake.woke();
                        match r {
                            Ok(true) => armed = false,
                            Ok(false) => {}
                            Err(e) => {
                                tracing::warn!("verbs: {e}; polling without completion events");
                                events = false;
                            }
                        }
                    } else {
                        wake.woke();
                    }
                } else {
                    match rx.recv_timeout(poll_sleep) {
                        Ok(cmd) => {
                            idle = 0;
                            if !engine.command(cmd, Instant::now()) {
                                return;
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            }
            Ok(n) => {
                idle = 0;
                let now = Instant::now();
                engine.on_completions(&wcs[..n], now);
                if now >= next_expire {
                    engine.tick(now);
                    next_expire = now + EXPIRE_EVERY;
                }
            }
            Err(e) => {
                tracing::error!("verbs: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// A sender of commands to the engine (cloned for the connection threads).
pub(crate) struct Handle<Q: NicQp> {
    tx: Sender<Cmd<Q>>,
    wake: Arc<Wake>,
}

impl<Q: NicQp> Clone for Handle<Q> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone(), wake: self.wake.clone() }
    }
}

impl<Q: NicQp> Handle<Q> {
    /// Send `cmd` (dropped if the engine has stopped). Blocks while the
    /// channel holds [`CMD_CAPACITY`] commands (the engine paused its
    /// intake for want of NIC room: [`QUEUED_WR_LIMIT`](super::engine::QUEUED_WR_LIMIT)).
    pub(crate) fn send(&self, cmd: Cmd<Q>) {
        if self.tx.send(cmd).is_ok() {
            self.wake.after_send();
        }
    }

    /// Wake the progress thread if it blocks (no command sent): after
    /// `take_notifications` gave credit back, so it reposts held receives.
    pub(crate) fn wake(&self) {
        self.wake.after_send();
    }

    /// Commands waiting in the channel.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.tx.len()
    }

    /// Send the command `make` builds around a reply channel and wait for
    /// its answer: `None` when the engine closed the channel without one
    /// (its way of saying "done") or has stopped.
    pub(crate) fn call<T>(&self, make: impl FnOnce(Sender<T>) -> Cmd<Q>) -> Option<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(make(tx));
        rx.recv().ok()
    }
}

/// The caller's side of a running engine: its command handle, its
/// progress thread (joined on [`stop`](Self::stop) or drop) and the
/// channels it reports on.
pub(super) struct Core<Q: NicQp> {
    pub handle: Handle<Q>,
    thread: Option<JoinHandle<()>>,
    pub done: Receiver<Completion>,
    /// Received notifications, each with its peer's credit (given back as
    /// `take_notifications` hands it out).
    pub notifs: Receiver<HeldNotification>,
}

impl<Q: NicQp> Core<Q> {
    /// Start the progress thread over `nic`, which owns it from now on.
    /// `set_up` adjusts the engine (timeouts) before it starts.
    ///
    /// # Errors
    /// The socket pair or thread could not be created.
    pub(super) fn start<N: Nic<Qp = Q> + 'static>(
        nic: N,
        cqes: u32,
        limits: PostLimits,
        set_up: impl FnOnce(&mut Engine<N>),
    ) -> std::io::Result<Self> {
        let (done_tx, done) = crossbeam_channel::unbounded();
        let (notif_tx, notifs) = crossbeam_channel::unbounded();
        let (tx, rx) = crossbeam_channel::bounded(CMD_CAPACITY);
        let wake = Arc::new(Wake::new()?);
        let mut engine = Engine::new(nic, cqes, limits, done_tx, notif_tx);
        set_up(&mut engine);
        let w2 = wake.clone();
        let thread =
            std::thread::Builder::new().name("kvwire-verbs-progress".into()).spawn(move || run(engine, &rx, &w2))?;
        Ok(Self { handle: Handle { tx, wake }, thread: Some(thread), done, notifs })
    }

    /// Stop the engine (it destroys every QP and its NIC) and join its thread.
    pub(super) fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.handle.send(Cmd::Stop);
            let _ = t.join();
        }
    }
}

impl<Q: NicQp> Drop for Core<Q> {
    fn drop(&mut self) {
        self.stop();
    }
}
