//! The verbs transport's progress thread: polls the shared completion queue
//! (blocking on its completion channel when idle) and hands each completion
//! to the shared state, which retires chunks, posts what waited and reports
//! transfers; and the lock hand-off that keeps it from starving user threads.

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Inner;
use super::state::State;
use crate::verbs::{QueuePair, WorkCompletion};

/// Times in a row the progress thread takes the state ahead of a waiting
/// thread before it lets that thread go first.
const PROGRESS_BARGES: u32 = 4;
/// Yields the progress thread gives a waiting thread before taking the
/// state again anyway.
const MAX_PROGRESS_DEFERS: u32 = 10_000;

impl Inner {
    /// The shared state, for the progress thread. The mutex is not fair,
    /// and the progress thread, which takes it again after every batch of
    /// completions (posting the next WRs under it), could otherwise keep a
    /// user thread's `status` or `post` waiting for as long as completions
    /// keep coming (seen on Soft-RoCE, where each `post_send` is a system
    /// call: 0.6 s). So once it has taken the state `PROGRESS_BARGES` times
    /// in a row while another thread was waiting (`barged` counts them), it
    /// lets that thread go first.
    pub(super) fn lock_progress(&self, barged: &mut u32) -> MutexGuard<'_, State<QueuePair>> {
        if self.waiting.load(Ordering::Acquire) == 0 {
            *barged = 0;
        } else if *barged < PROGRESS_BARGES {
            *barged += 1;
        } else {
            *barged = 0;
            let mut defers = 0;
            while self.waiting.load(Ordering::Acquire) > 0 && defers < MAX_PROGRESS_DEFERS {
                std::thread::yield_now();
                defers += 1;
            }
        }
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        guard.now = Instant::now();
        guard
    }
}

/// How long the progress thread blocks on the completion channel before it
/// looks at `stopping` again.
const EVENT_WAIT_MS: i32 = 20;
/// How often the progress thread looks for QPs past their progress deadline.
const EXPIRE_EVERY: Duration = Duration::from_millis(10);

pub(super) fn progress_loop(inner: &Inner) {
    let mut wcs = vec![WorkCompletion::default(); 64];
    let mut idle = 0u32;
    // Completion events: armed = an event was requested and not consumed yet.
    let mut events = inner.cq.has_events();
    let mut armed = false;
    let mut barged = 0u32;
    let mut next_expire = Instant::now() + EXPIRE_EVERY;
    while !inner.stopping.load(Ordering::Acquire) {
        match inner.cq.poll(&mut wcs) {
            Ok(0) => {
                idle += 1;
                if idle >= 64 && Instant::now() >= next_expire {
                    let mut st = inner.lock_progress(&mut barged);
                    st.expire(inner.progress_timeout, &inner.limits);
                    next_expire = st.now + EXPIRE_EVERY;
                }
                if idle < 64 {
                    std::hint::spin_loop();
                } else if idle < 64 + inner.limits.idle_yields {
                    std::thread::yield_now();
                } else if events && !armed {
                    // Arm, then poll once more before blocking: a completion
                    // that arrived before arming raises no event.
                    match inner.cq.arm() {
                        Ok(()) => armed = true,
                        Err(e) => {
                            tracing::warn!("verbs: {e}; polling without completion events");
                            events = false;
                        }
                    }
                } else if events {
                    match inner.cq.wait_event(EVENT_WAIT_MS) {
                        Ok(true) => armed = false,
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!("verbs: {e}; polling without completion events");
                            events = false;
                        }
                    }
                } else {
                    std::thread::sleep(Duration::from_micros(u64::from(inner.limits.poll_sleep_us)));
                }
            }
            Ok(n) => {
                idle = 0;
                let mut st = inner.lock_progress(&mut barged);
                for wc in &wcs[..n] {
                    st.on_completion(wc, &inner.limits);
                }
                if st.now >= next_expire {
                    st.expire(inner.progress_timeout, &inner.limits);
                    next_expire = st.now + EXPIRE_EVERY;
                }
            }
            Err(e) => {
                tracing::error!("verbs: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
