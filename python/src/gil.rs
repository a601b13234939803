//! Releasing the GIL around Rust work, safely at interpreter shutdown.
//!
//! A daemon thread (NIXL's metadata listener, a user's thread polling
//! `get_new_notifs`) may be inside Rust with the GIL released when the
//! interpreter finalizes. Python up to 3.13 then ends that thread with
//! `pthread_exit` as it takes the GIL back, a forced unwind through Rust
//! frames that the extension's panic guard catches, and glibc aborts the
//! process ("FATAL: exception not rethrown", exit 134: a quarter of the runs
//! of NIXL's `expanded_two_peers.py` example's target). As Python 3.14 does,
//! a thread that comes back from Rust once shutdown has begun parks instead
//! of taking the GIL back, and the `atexit` hook lets every thread already
//! on its way back take the GIL and return to Python before finalization
//! starts: the process then ends around the parked threads.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);
/// Threads that finished their Rust work, saw no shutdown, and are taking
/// the GIL back (`SeqCst` with `SHUTTING_DOWN`: a thread and the hook cannot
/// both miss each other).
static RETURNING: AtomicUsize = AtomicUsize::new(0);
/// The thread that runs `atexit` (the main thread), which finalization never
/// ends and which must not park (a `__del__` may call into Rust).
static FINALIZING_THREAD: OnceLock<ThreadId> = OnceLock::new();

/// How long the `atexit` hook waits for threads already on their way back.
const DRAIN: Duration = Duration::from_secs(2);

/// Registered with `atexit`: runs after non-daemon threads were joined and
/// before finalization can end daemon threads.
#[pyfunction]
fn _kvwire_mark_shutdown(py: Python<'_>) {
    let _ = FINALIZING_THREAD.set(std::thread::current().id());
    SHUTTING_DOWN.store(true, SeqCst);
    py.allow_threads(|| {
        let until = Instant::now() + DRAIN;
        while RETURNING.load(SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(200));
        }
    });
}

/// Register the shutdown hook (module init).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let f = wrap_pyfunction!(_kvwire_mark_shutdown, m)?;
    m.py().import("atexit")?.call_method1("register", (f,))?;
    Ok(())
}

/// `py.allow_threads(f)`, except that once the interpreter is shutting down
/// a thread other than the one finalizing never takes the GIL back (it
/// parks for good).
pub fn without_gil<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    let r = py.allow_threads(|| {
        let r = f();
        RETURNING.fetch_add(1, SeqCst);
        if SHUTTING_DOWN.load(SeqCst) && FINALIZING_THREAD.get() != Some(&std::thread::current().id()) {
            RETURNING.fetch_sub(1, SeqCst);
            loop {
                std::thread::park();
            }
        }
        r
    });
    RETURNING.fetch_sub(1, SeqCst);
    r
}
