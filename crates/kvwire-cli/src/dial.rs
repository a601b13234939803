//! `bench --connect`: reach a two-terminal target within `--connect-timeout`,
//! saying what it waits for, and tell a dead, silent or foreign peer apart.

use std::time::{Duration, Instant};

use anyhow::Result;
use kvwire::sidechannel::{SideChannel, SideChannelError};

use crate::failure::UserError;

/// Default of `--connect-timeout` (seconds): a target started by hand in
/// another terminal has this long to come up.
pub(crate) const DEFAULT_CONNECT_TIMEOUT_S: &str = "30";

fn user(msg: String, hint: &str) -> UserError {
    UserError { msg, hint: Some(hint.to_string()) }
}

/// Connect to the target at `addr`, retrying until `timeout` while nothing
/// listens there (it may still be starting); says so on stderr when the
/// first attempt fails.
///
/// # Errors
/// Nothing accepted the connection within `timeout`; `addr` does not resolve.
pub(crate) fn connect(addr: &str, timeout: Duration) -> Result<SideChannel> {
    check_host_port(addr)?;
    let t0 = Instant::now();
    let first = match SideChannel::connect(addr, Duration::ZERO) {
        Ok(c) => return Ok(c),
        Err(e @ SideChannelError::Io { .. }) => {
            return Err(anyhow::Error::new(e).context(format!("connecting to the bench target at {addr}")));
        }
        Err(e) => e,
    };
    tracing::debug!("first attempt: {first}");
    eprintln!("kvwire bench: waiting for {addr} (up to {} s, --connect-timeout)…", secs(timeout));
    SideChannel::connect(addr, timeout.saturating_sub(t0.elapsed())).map_err(|e| {
        let last = match &e {
            SideChannelError::Timeout(_, _, last) => last.clone(),
            other => other.to_string(),
        };
        user(
            format!("no kvwire bench target at {addr} within {} s (last error: {last})", secs(timeout)),
            "start `kvwire bench --listen ADDR` there first; check the address, port and firewall; \
             or wait longer with --connect-timeout",
        )
        .into()
    })
}

/// Wait up to `timeout` for the target's answer to the Setup just sent
/// (`accepted` tells it apart from the rest of the protocol).
///
/// # Errors
/// The peer is silent, hangs up, or is not a kvwire bench target.
pub(crate) fn expect_answer<T: serde::de::DeserializeOwned>(
    chan: &mut SideChannel,
    peer: &str,
    timeout: Duration,
) -> Result<T> {
    chan.set_read_timeout(Some(timeout))?;
    match chan.recv::<T>() {
        Ok(m) => Ok(m),
        Err(SideChannelError::Io { source, .. })
            if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
        {
            Err(user(
                format!(
                    "{peer} accepted the connection but did not answer within {} s: not a kvwire bench \
                     target, or one busy with another initiator",
                    secs(timeout)
                ),
                "is `kvwire bench --listen` running there (and idle)? or wait longer with --connect-timeout",
            )
            .into())
        }
        Err(e @ (SideChannelError::NotKvwire(_) | SideChannelError::Decode(_))) => {
            Err(anyhow::Error::new(e).context(format!("the bench target at {peer}")))
        }
        Err(e @ SideChannelError::Closed) => Err(anyhow::Error::new(e).context(format!(
            "{peer} closed the connection without answering: not a kvwire bench target, or one that failed"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// `d` in whole seconds, or with decimals below 10 s.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 || s >= 10.0 { format!("{}", s.round()) } else { format!("{s:.1}") }
}

/// `--connect` takes `HOST:PORT` (`[V6]:PORT`): a bare host says so, with the
/// port the target printed, instead of a resolver error.
///
/// # Errors
/// No `:PORT` with a number after the host.
pub(crate) fn check_host_port(addr: &str) -> Result<()> {
    let port = match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && (!host.contains(':') || host.ends_with(']')) => port,
        _ => "",
    };
    if port.parse::<u16>().is_err() {
        return Err(user(
            format!("--connect {addr}: expected HOST:PORT (e.g. {}:18515)", addr.trim_end_matches(':')),
            "use the port `kvwire bench --listen` printed (\"target waiting for an initiator on IP:PORT\")",
        )
        .into());
    }
    Ok(())
}
