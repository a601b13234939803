//! Scatter/gather socket I/O straight between a TCP socket and registered
//! memory: `sendmsg` (gathering, with MSG_NOSIGNAL) from and `readv` into
//! up to [`wire::MAX_SEGMENTS`] (`IOV_MAX`) ranges per call, with no
//! intermediate copy. This file holds
//! the only `unsafe` of the `tcp` backend: the two system calls that touch
//! memory by raw address.

use std::cell::Cell;
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::wire;

/// One contiguous memory range by raw address: `(addr, len_bytes)`.
pub(super) type Range = (u64, u64);

fn iovecs(head: Option<&[u8]>, ranges: &[Range]) -> Vec<libc::iovec> {
    let mut v = Vec::with_capacity(ranges.len() + 1);
    if let Some(h) = head.filter(|h| !h.is_empty()) {
        v.push(libc::iovec { iov_base: h.as_ptr() as *mut libc::c_void, iov_len: h.len() });
    }
    v.extend(ranges.iter().map(|&(a, l)| libc::iovec { iov_base: a as *mut libc::c_void, iov_len: l as usize }));
    v
}

/// Drop `n` bytes from the front of `iov`, starting at index `*at`.
fn advance(iov: &mut [libc::iovec], at: &mut usize, mut n: usize) {
    while n > 0 && *at < iov.len() {
        let cur = &mut iov[*at];
        if n >= cur.iov_len {
            n -= cur.iov_len;
            *at += 1;
        } else {
            cur.iov_base = (cur.iov_base as usize + n) as *mut libc::c_void;
            cur.iov_len -= n;
            n = 0;
        }
    }
    while *at < iov.len() && iov[*at].iov_len == 0 {
        *at += 1;
    }
}

fn timed_out(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock => io::Error::new(io::ErrorKind::TimedOut, "peer silent past the timeout"),
        _ => e,
    }
}

/// A bound on the whole duration of one request, on top of the socket's
/// per-call timeouts: before each system call the socket's timeouts are cut
/// to what is left, and past the deadline the call fails with `TimedOut`.
/// So a peer that trickles bytes (each gap below `peer_timeout`) cannot
/// stretch a request, or anything it holds, beyond the deadline.
#[derive(Debug)]
pub(super) struct Deadline {
    at: Instant,
    base: Duration,
    cut: Cell<bool>,
}

impl Deadline {
    /// A deadline `limit` from now on a socket whose timeouts are `base`.
    pub(super) fn new(limit: Duration, base: Duration) -> Self {
        Self { at: Instant::now() + limit, base, cut: Cell::new(false) }
    }

    /// Check before a system call on `sock`.
    ///
    /// # Errors
    /// `TimedOut` once the deadline passed; `setsockopt` errors.
    pub(super) fn check(&self, sock: &TcpStream) -> io::Result<()> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "request exceeded its deadline"));
        }
        if left < self.base {
            let left = left.max(Duration::from_millis(1));
            sock.set_read_timeout(Some(left))?;
            sock.set_write_timeout(Some(left))?;
            self.cut.set(true);
        }
        Ok(())
    }

    /// Put the socket's timeouts back to `base` if [`Deadline::check`] cut them.
    ///
    /// # Errors
    /// `setsockopt` errors.
    pub(super) fn restore(&self, sock: &TcpStream) -> io::Result<()> {
        if self.cut.replace(false) {
            sock.set_read_timeout(Some(self.base))?;
            sock.set_write_timeout(Some(self.base))?;
        }
        Ok(())
    }
}

fn check(deadline: Option<&Deadline>, sock: &TcpStream) -> io::Result<()> {
    deadline.map_or(Ok(()), |d| d.check(sock))
}

/// Send `head`, then the bytes of `ranges`, in as few `sendmsg` calls as the
/// socket allows (gathering like `writev`, without raising SIGPIPE), within
/// `deadline` when one is given.
///
/// # Errors
/// The socket error; `TimedOut` when the peer stops reading for longer than
/// the socket's send timeout.
///
/// # Safety
/// Every range must be readable memory for the whole call (a live
/// registration that nothing frees meanwhile).
pub(super) unsafe fn write_ranges(
    sock: &TcpStream,
    head: &[u8],
    ranges: &[Range],
    deadline: Option<&Deadline>,
) -> io::Result<()> {
    let mut iov = iovecs(Some(head), ranges);
    let mut at = 0;
    advance(&mut iov, &mut at, 0);
    while at < iov.len() {
        check(deadline, sock)?;
        let n_iov = (iov.len() - at).min(wire::MAX_SEGMENTS as usize);
        // `sendmsg` with MSG_NOSIGNAL, not `writev`: a peer that closed its
        // end must give this call EPIPE (its transfers fail `PeerDied`), not
        // SIGPIPE to the process, which kills a C or C++ host that did not
        // ignore the signal (Rust's and Python's runtimes do; std's
        // `TcpStream::write` sends with MSG_NOSIGNAL itself).
        // SAFETY: all-zero is a valid `msghdr` (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[at..].as_mut_ptr();
        msg.msg_iovlen = n_iov as _;
        // SAFETY: the iovecs point into `head` (borrowed for the call) and
        // into ranges the caller guarantees readable; sendmsg only reads them
        // and `msg`, which lives for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(timed_out(e));
        }
        advance(&mut iov, &mut at, n as usize);
    }
    Ok(())
}

/// Receive exactly the bytes of `ranges` into them with `readv`, within
/// `deadline` when one is given.
///
/// When `cancelled` becomes true between two calls, the rest of the bytes
/// are read into a scratch buffer instead (`drain`), so the stream stays in
/// step while local memory is no longer touched, or not read at all (the
/// connection is being dropped). Returns `false` in that case.
///
/// # Errors
/// The socket error; `UnexpectedEof` when the peer closed; `TimedOut` past
/// the socket's receive timeout.
///
/// # Safety
/// Every range must be writable memory that no Rust reference aliases, for
/// the whole call (or until `cancelled` is seen set).
pub(super) unsafe fn read_ranges(
    sock: &TcpStream,
    ranges: &[Range],
    cancelled: &AtomicBool,
    drain_after_cancel: bool,
    deadline: Option<&Deadline>,
) -> io::Result<bool> {
    let mut iov = iovecs(None, ranges);
    let mut at = 0;
    advance(&mut iov, &mut at, 0);
    while at < iov.len() {
        if cancelled.load(Ordering::Acquire) {
            if !drain_after_cancel {
                return Ok(false);
            }
            let rest: u64 = iov[at..].iter().map(|v| v.iov_len as u64).sum();
            drain(sock, rest, deadline)?;
            return Ok(false);
        }
        check(deadline, sock)?;
        let n_iov = (iov.len() - at).min(wire::MAX_SEGMENTS as usize);
        // SAFETY: the iovecs point into ranges the caller guarantees writable
        // and unaliased; readv writes at most their lengths.
        let n = unsafe { libc::readv(sock.as_raw_fd(), iov[at..].as_ptr(), n_iov as libc::c_int) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(timed_out(e));
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection"));
        }
        advance(&mut iov, &mut at, n as usize);
    }
    Ok(true)
}

/// Read and discard `n` bytes (keeps the stream in step after a refusal),
/// within `deadline` when one is given.
///
/// # Errors
/// As [`read_exact`].
pub(super) fn drain(mut sock: &TcpStream, mut n: u64, deadline: Option<&Deadline>) -> io::Result<()> {
    let mut scratch = [0u8; 64 << 10];
    while n > 0 {
        check(deadline, sock)?;
        let want = n.min(scratch.len() as u64) as usize;
        let got = sock.read(&mut scratch[..want]).map_err(timed_out)?;
        if got == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection"));
        }
        n -= got as u64;
    }
    Ok(())
}

/// `read_exact` with timeouts reported as `TimedOut`.
///
/// # Errors
/// `UnexpectedEof` when the peer closed; `TimedOut`; other socket errors.
pub(super) fn read_exact(mut sock: &TcpStream, buf: &mut [u8]) -> io::Result<()> {
    sock.read_exact(buf).map_err(timed_out)
}

/// [`read_exact`] within `deadline`.
///
/// # Errors
/// As [`read_exact`]; `TimedOut` past the deadline.
pub(super) fn read_exact_by(mut sock: &TcpStream, mut buf: &mut [u8], deadline: &Deadline) -> io::Result<()> {
    while !buf.is_empty() {
        deadline.check(sock)?;
        match sock.read(buf) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection")),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timed_out(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_skips_whole_and_partial_entries() {
        let buf = [0u8; 64];
        let base = buf.as_ptr() as u64;
        let mut iov = iovecs(None, &[(base, 10), (base + 10, 0), (base + 20, 5)]);
        let mut at = 0;
        advance(&mut iov, &mut at, 12);
        assert_eq!(at, 2);
        assert_eq!(iov[2].iov_len, 3);
        assert_eq!(iov[2].iov_base as u64, base + 22);
        advance(&mut iov, &mut at, 3);
        assert_eq!(at, 3);
    }
}
