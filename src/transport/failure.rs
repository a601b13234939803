//! Typed reasons for a failed transfer, shared by every backend and carried
//! unchanged through the engine, the KV layer, Python and C.
//!
//! A scheduler branches on [`FailureKind`] (retry on another peer when the
//! peer died, drop the request on a remote access error, ignore a
//! cancellation); the [`FailureSource`] keeps what the backend saw (the verbs
//! work-completion status, an errno) and `detail` is for people.
//!
//! The categories follow what NIXL reports to its callers
//! (`NIXL_ERR_REMOTE_DISCONNECT`, `NIXL_ERR_CANCELED`, `NIXL_ERR_BACKEND`,
//! `nixl_types.h`) and the verbs work-completion statuses
//! (`enum ibv_wc_status`, `<infiniband/verbs.h>`).

use std::fmt;

/// Which rule a remote access broke (as an HCA's rkey check reports
/// `IBV_WC_REM_ACCESS_ERR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RemoteAccessKind {
    /// The range is not inside the region the key names.
    OutOfBounds,
    /// The key names no region the target has registered (never, or no longer).
    UnknownKey,
    /// The target refused access (wrong credentials, permissions).
    Denied,
}

/// Why a transfer failed. `#[non_exhaustive]`: match with a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// The peer process or its connection went away (EOF, reset, liveness
    /// channel closed, `IBV_WC_RETRY_EXC_ERR` after the peer vanished).
    PeerDied,
    /// The peer stopped answering within the configured timeout (a hung or
    /// stopped peer; the data-path progress deadline).
    PeerTimeout,
    /// The target refused the access: see [`RemoteAccessKind`].
    RemoteAccess(RemoteAccessKind),
    /// The transfer was cancelled by the caller (release before completion).
    Cancelled,
    /// A local registration was missing or refused the access
    /// (`IBV_WC_LOC_PROT_ERR`, `IBV_WC_LOC_LEN_ERR`).
    LocalProtection,
    /// The peer broke the wire protocol (malformed or oversized frames).
    Protocol,
    /// Any other error of the transport (an OS error, a work-completion
    /// status with no better category).
    Transport,
    /// The target refused for now because a bounded queue it keeps for its
    /// peers is full (its notification queue: it is not draining
    /// notifications). Nothing was dropped silently; retry later or elsewhere.
    Overloaded,
}

impl FailureKind {
    /// A stable snake_case name (`peer_died`, `remote_access`, …), used by
    /// Python's `.kind` and the C error codes' documentation.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::PeerDied => "peer_died",
            FailureKind::PeerTimeout => "peer_timeout",
            FailureKind::RemoteAccess(_) => "remote_access",
            FailureKind::Cancelled => "cancelled",
            FailureKind::LocalProtection => "local_protection",
            FailureKind::Protocol => "protocol",
            FailureKind::Transport => "transport",
            FailureKind::Overloaded => "overloaded",
        }
    }

    /// For [`FailureKind::RemoteAccess`], which rule was broken.
    pub fn remote_access(self) -> Option<RemoteAccessKind> {
        match self {
            FailureKind::RemoteAccess(r) => Some(r),
            _ => None,
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureKind::PeerDied => f.write_str("peer died"),
            FailureKind::PeerTimeout => f.write_str("peer timed out"),
            FailureKind::RemoteAccess(RemoteAccessKind::OutOfBounds) => {
                f.write_str("remote access error (out of bounds)")
            }
            FailureKind::RemoteAccess(RemoteAccessKind::UnknownKey) => f.write_str("remote access error (unknown key)"),
            FailureKind::RemoteAccess(RemoteAccessKind::Denied) => f.write_str("remote access error (denied)"),
            FailureKind::Cancelled => f.write_str("cancelled"),
            FailureKind::LocalProtection => f.write_str("local protection error"),
            FailureKind::Protocol => f.write_str("protocol error"),
            FailureKind::Transport => f.write_str("transport error"),
            FailureKind::Overloaded => f.write_str("target overloaded"),
        }
    }
}

/// What the backend saw, kept as the source of a [`TransferFailure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum FailureSource {
    /// Nothing beyond the kind and the detail.
    #[default]
    None,
    /// A verbs work completion: `status` is the `ibv_wc_status` value,
    /// `vendor_err` the provider's vendor syndrome.
    WorkCompletion {
        /// `enum ibv_wc_status` value.
        status: u32,
        /// `ibv_wc.vendor_err`.
        vendor_err: u32,
    },
    /// An OS error number (`errno`).
    Os(i32),
}

/// A failed transfer: the category a caller branches on, what the backend
/// saw, and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferFailure {
    /// The category.
    pub kind: FailureKind,
    /// The backend's own code (WC status, errno), when there is one.
    pub source: FailureSource,
    /// Human-readable detail (peer name, key, range, call).
    pub detail: String,
}

impl TransferFailure {
    /// A failure of `kind` with `detail` and no source code.
    pub fn new(kind: FailureKind, detail: impl Into<String>) -> Self {
        Self { kind, source: FailureSource::None, detail: detail.into() }
    }

    /// The peer died or closed its connection.
    pub fn peer_died(detail: impl Into<String>) -> Self {
        Self::new(FailureKind::PeerDied, detail)
    }

    /// The peer stopped answering within the timeout.
    pub fn peer_timeout(detail: impl Into<String>) -> Self {
        Self::new(FailureKind::PeerTimeout, detail)
    }

    /// The target refused the access.
    pub fn remote_access(why: RemoteAccessKind, detail: impl Into<String>) -> Self {
        Self::new(FailureKind::RemoteAccess(why), detail)
    }

    /// The target refused because a bounded queue of its is full.
    pub fn overloaded(detail: impl Into<String>) -> Self {
        Self::new(FailureKind::Overloaded, detail)
    }

    /// The peer broke the wire protocol.
    pub fn protocol(detail: impl Into<String>) -> Self {
        Self::new(FailureKind::Protocol, detail)
    }

    /// Cancelled by the caller.
    pub fn cancelled(detail: impl Into<String>) -> Self {
        Self::new(FailureKind::Cancelled, detail)
    }

    /// Classify an OS error seen on a peer's connection: EOF, reset and broken
    /// pipe mean the peer died, timeouts that it hung, anything else is a
    /// transport error. The errno is kept as the source.
    pub fn from_io(e: &std::io::Error, detail: impl Into<String>) -> Self {
        use std::io::ErrorKind as K;
        let kind = match e.kind() {
            K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::NotConnected => {
                FailureKind::PeerDied
            }
            K::TimedOut | K::WouldBlock => FailureKind::PeerTimeout,
            K::InvalidData => FailureKind::Protocol,
            _ => match e.raw_os_error() {
                Some(libc::ESRCH) | Some(libc::ECONNREFUSED) => FailureKind::PeerDied,
                _ => FailureKind::Transport,
            },
        };
        let source = e.raw_os_error().map_or(FailureSource::None, FailureSource::Os);
        Self { kind, source, detail: format!("{}: {e}", detail.into()) }
    }

    /// With `source` as the backend's code.
    pub fn with_source(mut self, source: FailureSource) -> Self {
        self.source = source;
        self
    }
}

impl fmt::Display for TransferFailure {
    /// `kind: detail`; a detail that names the peer first reads
    /// `detail (kind)` ("peer b disconnected (peer died)", not "peer died:
    /// peer b disconnected").
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.detail.is_empty() {
            write!(f, "{}", self.kind)
        } else if self.detail.starts_with("peer ") {
            write!(f, "{} ({})", self.detail, self.kind)
        } else {
            write!(f, "{}: {}", self.kind, self.detail)
        }
    }
}

impl std::error::Error for TransferFailure {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_peer_and_the_kind_once() {
        let f = TransferFailure::peer_died("peer b disconnected");
        assert_eq!(f.to_string(), "peer b disconnected (peer died)");
        let reset = std::io::Error::from_raw_os_error(libc::ECONNRESET);
        let f = TransferFailure::from_io(&reset, "peer b");
        assert_eq!(f.to_string(), "peer b: Connection reset by peer (os error 104) (peer died)");
        let f = TransferFailure::remote_access(RemoteAccessKind::UnknownKey, "unknown rkey 5");
        assert_eq!(f.to_string(), "remote access error (unknown key): unknown rkey 5");
        assert_eq!(TransferFailure::cancelled("").to_string(), "cancelled");
    }

    #[test]
    fn io_errors_map_to_kinds_and_keep_errno() {
        let reset = std::io::Error::from_raw_os_error(libc::ECONNRESET);
        let f = TransferFailure::from_io(&reset, "peer b");
        assert_eq!(f.kind, FailureKind::PeerDied);
        assert_eq!(f.source, FailureSource::Os(libc::ECONNRESET));
        let eof = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed");
        assert_eq!(TransferFailure::from_io(&eof, "x").kind, FailureKind::PeerDied);
        let to = std::io::Error::from_raw_os_error(libc::ETIMEDOUT);
        assert_eq!(TransferFailure::from_io(&to, "x").kind, FailureKind::PeerTimeout);
        let other = std::io::Error::from_raw_os_error(libc::ENOMEM);
        assert_eq!(TransferFailure::from_io(&other, "x").kind, FailureKind::Transport);
    }

    #[test]
    fn display_names_kind_then_detail() {
        let f = TransferFailure::remote_access(RemoteAccessKind::OutOfBounds, "0x10+4 outside rkey 3");
        assert_eq!(f.to_string(), "remote access error (out of bounds): 0x10+4 outside rkey 3");
        assert_eq!(f.kind.name(), "remote_access");
        assert_eq!(f.kind.remote_access(), Some(RemoteAccessKind::OutOfBounds));
        assert_eq!(FailureKind::Cancelled.remote_access(), None);
    }
}
