//! The verbs transport's progress thread: the engine's only thread. It
//! takes commands from its channel, polls the shared completion queue and
//! hands each completion to the engine; when both are idle it spins, then
//! yields, then blocks on the CQ's completion channel together with the
//! engine's wake fd (or, without completion events, on the command channel
//! for `poll_sleep_us`), so a command wakes it at once.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::engine::{Cmd, Engine, Wake};
use super::nic::Nic;
use crate::verbs::WorkCompletion;

/// Polls of an idle CQ that spin before the thread starts to yield.
const IDLE_SPINS: u32 = 64;
/// How often the progress thread looks for QPs past their progress deadline
/// (and at the deadlines of cancels in progress).
const EXPIRE_EVERY: Duration = Duration::from_millis(10);
/// Commands taken per turn before the CQ is polled again, so a stream of
/// posts cannot hold completions back.
const COMMANDS_PER_TURN: usize = 64;

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
        let mut took = 0;
        while took < COMMANDS_PER_TURN {
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
                    if wake.prepare_sleep(rx) {
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
