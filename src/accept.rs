//! Accept loops that survive resource exhaustion (issue 27 item 2).
//!
//! `accept` fails with `EMFILE`/`ENFILE` when the process or system is out
//! of descriptors, `ENOMEM`/`ENOBUFS` under memory pressure, and
//! `ECONNABORTED`/`EPROTO`/... when a peer gave up while queued. None of
//! these says the listener is broken: a loop that ended on the first one
//! left the agent unreachable for good. [`AcceptBackoff`] sorts the errors:
//! resource errors sleep with a bounded exponential backoff
//! ([`BACKOFF_START`] doubling to [`BACKOFF_MAX`]) and are logged once per
//! episode (a warning when it starts, a note when an accept succeeds
//! again); per-connection errors retry at once; anything else (the listener
//! was shut down: `EINVAL`, `EBADF`) ends the loop.

use std::io;
use std::time::Duration;

/// First sleep after a resource error.
pub const BACKOFF_START: Duration = Duration::from_millis(5);
/// Longest sleep between two accepts while resources are exhausted: a
/// freed descriptor is used within this time.
pub const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// Connections that have not yet proved the agent secret, at most, per
/// listener, unless option `max_preauth` says otherwise (tcp service and
/// verbs handshake listeners); a new one over that closes the oldest, so an
/// unauthenticated flood cannot use up the descriptors.
pub const DEFAULT_MAX_PREAUTH: usize = 64;

/// What an accept loop does after an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterError {
    /// Accept again (after the backoff sleep, already taken).
    Retry,
    /// The listener is gone: end the loop.
    Stop,
}

/// Backoff and episode logging for one accept loop.
#[derive(Debug)]
pub(crate) struct AcceptBackoff {
    what: &'static str,
    delay: Duration,
    episode: Option<i32>,
    errors: u64,
}

/// Errors of the process or system running short of a resource.
fn resource(errno: i32) -> bool {
    matches!(errno, libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS)
}

/// Errors about the one connection being accepted (it went away while
/// queued, or a firewall refused it): the next one may be fine.
fn per_connection(errno: i32) -> bool {
    matches!(
        errno,
        libc::ECONNABORTED
            | libc::EINTR
            | libc::EAGAIN
            | libc::EPROTO
            | libc::EPERM
            | libc::ECONNRESET
            | libc::ETIMEDOUT
            | libc::ENETDOWN
            | libc::ENETUNREACH
            | libc::EHOSTDOWN
            | libc::EHOSTUNREACH
            | libc::ENONET
            | libc::ENOPROTOOPT
            | libc::EOPNOTSUPP
    )
}

impl AcceptBackoff {
    /// A loop named `what` in the logs (`"tcp"`, `"shm"`, ...).
    pub(crate) fn new(what: &'static str) -> Self {
        Self { what, delay: BACKOFF_START, episode: None, errors: 0 }
    }

    /// `accept` failed with `e`: sleep if resources are short, and say
    /// whether to accept again.
    pub(crate) fn failed(&mut self, e: &io::Error) -> AfterError {
        let Some(errno) = e.raw_os_error() else {
            return if e.kind() == io::ErrorKind::Interrupted { AfterError::Retry } else { AfterError::Stop };
        };
        if resource(errno) {
            self.errors += 1;
            if self.episode.is_none() {
                tracing::warn!(
                    "{}: accept failed ({e}); retrying every {:?} at most until it succeeds (logged once)",
                    self.what,
                    BACKOFF_MAX
                );
                self.episode = Some(errno);
            }
            std::thread::sleep(self.delay);
            self.delay = (self.delay * 2).min(BACKOFF_MAX);
            AfterError::Retry
        } else if per_connection(errno) {
            AfterError::Retry
        } else {
            AfterError::Stop
        }
    }

    /// An `accept` succeeded: end the episode, if any.
    pub(crate) fn accepted(&mut self) {
        if let Some(errno) = self.episode.take() {
            tracing::info!(
                "{}: accepting again after {} failed accept(s) ({})",
                self.what,
                self.errors,
                io::Error::from_raw_os_error(errno)
            );
        }
        self.errors = 0;
        self.delay = BACKOFF_START;
    }

    /// True while resources are short (between the first resource error
    /// and the next successful accept).
    #[cfg(test)]
    pub(crate) fn in_episode(&self) -> bool {
        self.episode.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_errors_back_off_and_recover_shutdown_stops() {
        let mut b = AcceptBackoff::new("test");
        let t0 = std::time::Instant::now();
        for _ in 0..4 {
            assert_eq!(b.failed(&io::Error::from_raw_os_error(libc::EMFILE)), AfterError::Retry);
        }
        assert!(b.in_episode());
        // 5 + 10 + 20 + 40 ms, capped by BACKOFF_MAX.
        assert!(t0.elapsed() >= Duration::from_millis(75));
        assert_eq!(b.failed(&io::Error::from_raw_os_error(libc::ECONNABORTED)), AfterError::Retry);
        assert_eq!(b.failed(&io::Error::from_raw_os_error(libc::ENOMEM)), AfterError::Retry);
        b.accepted();
        assert!(!b.in_episode());
        assert_eq!(b.delay, BACKOFF_START);
        assert_eq!(b.failed(&io::Error::from_raw_os_error(libc::EINVAL)), AfterError::Stop);
        assert_eq!(b.failed(&io::Error::from_raw_os_error(libc::EBADF)), AfterError::Stop);
    }
}
