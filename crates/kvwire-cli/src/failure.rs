//! How the CLI reports a failure: one line `error: <cause>` (the error and
//! its causes joined by `: `), a `hint:` line when there is an obvious fix,
//! and the full chain with a backtrace only under `-v`.

use std::sync::atomic::{AtomicBool, Ordering};

static VERBOSE: AtomicBool = AtomicBool::new(false);

/// Set by `-v`; child processes inherit it through their command line.
pub(crate) fn set_verbose(v: bool) {
    VERBOSE.store(v, Ordering::Relaxed);
}

/// Whether `-v` was given.
pub(crate) fn verbose() -> bool {
    VERBOSE.load(Ordering::Relaxed)
}

/// An error whose fix is known where it is raised.
#[derive(Debug, thiserror::Error)]
#[error("{msg}")]
pub(crate) struct UserError {
    /// What is wrong.
    pub msg: String,
    /// What to do about it.
    pub hint: Option<String>,
}

/// `UserError` as an `anyhow::Error`.
pub(crate) fn user_error(msg: impl Into<String>, hint: impl Into<String>) -> anyhow::Error {
    UserError { msg: msg.into(), hint: Some(hint.into()) }.into()
}

/// The hint for `e`: its own, or one for a well-known cause.
pub(crate) fn hint(e: &anyhow::Error) -> Option<String> {
    // A `UserError` as the error itself, as a context, or as a cause.
    if let Some(h) = e.downcast_ref::<UserError>().and_then(|u| u.hint.clone()) {
        return Some(h);
    }
    if let Some(h) = e.chain().find_map(|c| c.downcast_ref::<UserError>().and_then(|u| u.hint.clone())) {
        return Some(h);
    }
    // etcd unreachable or silent; a name that is merely not published yet
    // gets no such hint (etcd answered).
    let discovery = e.chain().find_map(|c| c.downcast_ref::<kvwire_discovery::DiscoveryError>());
    if discovery.is_some_and(kvwire_discovery::DiscoveryError::is_unreachable) {
        return Some(
            "is etcd running at that URL? (e.g. `etcd --listen-client-urls http://0.0.0.0:2379 \
             --advertise-client-urls http://HOST:2379`)"
                .into(),
        );
    }
    let text = format!("{e:#}");
    let known: [(&[&str], &str); 4] = [
        // The library's message already points to `kvwire devices`.
        (
            &["no RDMA device found", "no RDMA device named"],
            "without an RDMA device use --transport tcp (across hosts) or shm (one host)",
        ),
        (
            &["ibv_get_device_list", "libibverbs"],
            "`kvwire devices` lists the RDMA devices here; without one use --transport tcp (across hosts) or shm (one host)",
        ),
        (
            &["Connection refused", "timed out after"],
            "is the other side running, and reachable at that address from here? (a firewall or a loopback-only listen address refuses remote peers)",
        ),
        (&["unknown option", "unknown key"], "`kvwire bench --help` lists each transport's options"),
    ];
    known.iter().find(|(needles, _)| needles.iter().any(|n| text.contains(n))).map(|(_, h)| h.to_string())
}

/// `e` and its causes on one line, joined by `: `, leaving out a cause the
/// message before it already quotes (errors whose text embeds their source).
pub(crate) fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    let mut last = String::new();
    for c in e.chain() {
        let msg = c.to_string();
        if !last.contains(&msg) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&msg);
        }
        last = msg;
    }
    line
}

/// `e` from etcd at `url`, with "connecting to etcd at URL" unless the
/// message names etcd and the URL already.
pub(crate) fn etcd_error(e: kvwire_discovery::DiscoveryError, doing: &str, url: &str) -> anyhow::Error {
    match e {
        e @ kvwire_discovery::DiscoveryError::Unanswered { .. } => e.into(),
        e => anyhow::Error::new(e).context(format!("{doing} etcd at {url}")),
    }
}

/// Print `e` as the CLI does (stderr).
pub(crate) fn report(e: &anyhow::Error) {
    if verbose() {
        eprintln!("error: {e:?}");
        if let Some(c) = e.chain().find_map(|c| c.downcast_ref::<ChildFailed>())
            && !c.backtrace.is_empty()
        {
            eprintln!("\nStack backtrace of the failed process:");
            for l in &c.backtrace {
                eprintln!("{l}");
            }
        }
    } else {
        eprintln!("error: {}", one_line(e));
    }
    if let Some(h) = hint(e) {
        eprintln!("hint: {h}");
    }
}

/// Set by SIGINT (Ctrl-C) once [`catch_interrupt`] installed the handler.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Catch Ctrl-C: the long loops (`replay`, `bench`) then stop at the next
/// step and print a one-line partial summary instead of dying mid-line. A
/// second Ctrl-C kills the process as usual.
pub(crate) fn catch_interrupt() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(SigHandler::Handler(on_sigint), SaFlags::SA_RESETHAND, SigSet::empty());
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    let _ = unsafe { sigaction(Signal::SIGINT, &action) };
}

/// Whether Ctrl-C was pressed since [`catch_interrupt`].
pub(crate) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_hint_wins_and_known_causes_get_one() {
        let e = user_error("needs 96 GiB", "use fewer --blocks").context("bench");
        assert_eq!(hint(&e).as_deref(), Some("use fewer --blocks"));
        let e = anyhow::anyhow!("ibv_get_device_list: Function not implemented (os error 38)");
        assert!(hint(&e).unwrap().contains("kvwire devices"));
        assert!(hint(&anyhow::anyhow!("block size must be at least 1")).is_none());
    }

    #[test]
    fn one_line_skips_a_cause_already_quoted() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = anyhow::Error::new(io).context("connect: Connection refused").context("connecting to etcd at X");
        assert_eq!(one_line(&e), "connecting to etcd at X: connect: Connection refused");
    }
}

/// A helper process failed: its cause, reported once by the parent (and
/// its backtrace under `-v`).
#[derive(Debug, thiserror::Error)]
#[error("the {role} process failed: {cause}")]
pub(crate) struct ChildFailed {
    pub(crate) role: &'static str,
    pub(crate) cause: String,
    /// The child's backtrace lines (`-v` with `RUST_BACKTRACE=1`).
    pub backtrace: Vec<String>,
}
