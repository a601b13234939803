//! The transport layer: one small trait, several backends.
//!
//! A [`Transport`] moves bytes between registered memory of two agents with
//! one-sided READ/WRITE and delivers notifications after the data. Backends
//! know nothing about KV caches: they see registered ranges, peers, and
//! batches of [`Segment`]s that the engine already validated and coalesced.
//!
//! Backends:
//! - [`shm`]: same host, inter-process (memfd mappings or cross-memory attach);
//!   the embedded default.
//! - `verbs`: RC queue pairs over InfiniBand / RoCE through libibverbs.
//! - `tcp`: hosts without RDMA.

pub mod auth;
pub mod failure;
mod inflight;
pub mod memory;
pub mod notify;
pub mod options;
pub mod shm;
pub(crate) mod split;
pub mod tcp;
pub mod verbs;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use failure::{FailureKind, FailureSource, RemoteAccessKind, TransferFailure};
pub use memory::{MemoryBacking, MemoryDesc, MemoryKind, RawMemory, Union, View};
pub use options::{OptionSet, OptionSpec};

/// Local key of a registration: its id in the backend's registration
/// table (on verbs not the hardware lkey, which several registrations of
/// one coalesced memory region share; `post` translates it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalKey(pub u32);

/// Remote key of a registration (the `rkey` a peer presents to access it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RemoteKey(pub u32);

/// Identifier of one posted transfer inside a transport, chosen by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct XferId(pub u64);

/// A connected peer, as numbered by the transport that connected it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

/// Direction of a one-sided transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// Pull: remote memory is copied into local memory.
    Read,
    /// Push: local memory is copied into remote memory.
    Write,
}

/// The keys a transport assigned to a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// Key the local side uses in its scatter-gather entries.
    pub lkey: LocalKey,
    /// Key peers present to reach this memory.
    pub rkey: RemoteKey,
}

/// A registered region of a peer, as published in its agent metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Start virtual address in the peer's address space (bytes).
    pub addr: u64,
    /// Length in bytes.
    pub len_bytes: u64,
    /// Key that grants access.
    pub rkey: RemoteKey,
    /// DRAM or VRAM.
    pub kind: MemoryKind,
    /// Device ordinal on the peer.
    pub device_id: u32,
}

impl RemoteRegion {
    /// True when `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        MemoryDesc { addr: self.addr, len_bytes: self.len_bytes, kind: self.kind, device_id: self.device_id }
            .contains(addr, len)
    }
}

/// One contiguous copy: `len_bytes` between a local and a remote address.
/// 32 bytes, so a batch of 100k pages stays in a few MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Local virtual address (bytes).
    pub local_addr: u64,
    /// Remote virtual address (bytes), in the peer's address space.
    pub remote_addr: u64,
    /// Length in bytes.
    pub len_bytes: u64,
    /// Local key of the registration holding the local range.
    pub lkey: LocalKey,
    /// Remote key of the peer registration holding the remote range.
    pub rkey: RemoteKey,
}

/// A batch of segments to move for one transfer, plus its notification.
#[derive(Debug)]
pub struct PostRequest {
    /// Engine-chosen id, reported back in the [`Completion`].
    pub xfer: XferId,
    /// READ or WRITE.
    pub op: Op,
    /// The connected peer.
    pub peer: PeerId,
    /// Validated, coalesced segments.
    pub segments: Vec<Segment>,
    /// Bytes delivered to the peer after all data is visible there.
    pub notification: Option<Vec<u8>>,
}

/// The terminal result of a posted transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The transfer.
    pub xfer: XferId,
    /// `Ok` when every byte landed (and the notification was sent);
    /// `Err(failure)` otherwise, with a typed [`FailureKind`].
    pub result: Result<(), TransferFailure>,
}

/// A way to sleep until a transport reports a completion, without holding
/// the transport (or the engine that owns it): a thread that released the
/// engine's lock between status checks sleeps here instead of polling, and
/// other threads keep using the engine meanwhile. It watches the backend's
/// completion channel without taking anything from it (the next
/// [`Transport::poll`] still gets every completion). NIXL has no such call
/// (its callers spin on `getXferStatus`); Mooncake 0.3's
/// `batch_transfer_sync_write` sleeps inside the engine the same way.
#[derive(Debug, Clone)]
pub struct CompletionSignal(crossbeam_channel::Receiver<Completion>);

impl CompletionSignal {
    pub(crate) fn new(done: crossbeam_channel::Receiver<Completion>) -> Self {
        Self(done)
    }

    /// Sleep until a completion is queued on the channel (any transfer's,
    /// one taken meanwhile by another thread's poll included) or `timeout`
    /// (wall time) passes. True when one is queued. Callers check their
    /// transfer's status after it either way: a wake is a hint, not a
    /// result. A channel whose sender is gone (a transport being dropped)
    /// sleeps the whole `timeout` instead of returning at once.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut sel = crossbeam_channel::Select::new();
        sel.recv(&self.0);
        if sel.ready_timeout(timeout).is_err() {
            return false;
        }
        if self.0.is_empty() {
            // Ready with nothing queued: disconnected, or another thread
            // drained it first; either way nothing to report now.
            std::thread::sleep(timeout);
            return false;
        }
        true
    }
}

/// A notification received from a peer: `(peer agent name, payload)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Agent name of the sender, as it introduced itself.
    pub from_agent: String,
    /// The payload bytes (MAX: the `transfer_name`).
    pub payload: Vec<u8>,
}

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransportKind {
    /// Same host, shared memory.
    Shm,
    /// RDMA over libibverbs.
    Verbs,
    /// TCP sockets.
    Tcp,
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Shm => "shm",
            TransportKind::Verbs => "verbs",
            TransportKind::Tcp => "tcp",
        })
    }
}

impl std::str::FromStr for TransportKind {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "shm" => Ok(Self::Shm),
            "verbs" | "rdma" | "ib" | "roce" => Ok(Self::Verbs),
            "tcp" => Ok(Self::Tcp),
            other => {
                Err(TransportError::Unsupported(format!("unknown transport {other:?} (expected shm, verbs or tcp)")))
            }
        }
    }
}

/// Options shared by every backend.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// A peer that does not answer within this time makes its transfers
    /// `Failed` (connect handshakes, notification sends). Default 5 s.
    pub peer_timeout: Duration,
    /// Copy/progress threads for backends that copy with the CPU
    /// (`shm`, `tcp`). Default 2: this project's reference machines have 2 cores.
    /// `shm` shares one process-wide pool among its agents, grown to the
    /// largest value any of them asked for.
    pub copy_threads: usize,
    /// Backend-specific options as `key=value` strings (e.g. `device=rxe0`,
    /// `gid_index=1`, `qps_per_peer=2`).
    pub options: Vec<(String, String)>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self { peer_timeout: Duration::from_secs(5), copy_threads: 2, options: Vec::new() }
    }
}

/// Largest notification payload every backend accepts (bytes): 64 KiB.
/// A longer one is refused by `post` with [`TransportError::Post`] before
/// anything moves. (NIXL bounds notifications per backend; kvwire keeps one
/// limit so that an application can switch backends.)
pub const MAX_NOTIFICATION_BYTES: usize = 64 << 10;

/// Longest accepted [`TransportConfig::peer_timeout`] (one day): longer
/// values are a typo, and `Instant + Duration` must not overflow.
pub const MAX_PEER_TIMEOUT: Duration = Duration::from_secs(86_400);

/// Most accepted [`TransportConfig::copy_threads`].
pub const MAX_COPY_THREADS: usize = 256;

impl TransportConfig {
    /// Check the shared options: `peer_timeout` in (0, [`MAX_PEER_TIMEOUT`]],
    /// `copy_threads` in 1..=[`MAX_COPY_THREADS`]. Every backend calls this
    /// when it is created.
    ///
    /// # Errors
    /// [`TransportError::InvalidConfig`] naming the field and the rule.
    pub fn validate(&self) -> Result<(), TransportError> {
        if self.peer_timeout.is_zero() || self.peer_timeout > MAX_PEER_TIMEOUT {
            return Err(TransportError::InvalidConfig(format!(
                "peer_timeout must be > 0 and at most {} s, got {:?}",
                MAX_PEER_TIMEOUT.as_secs(),
                self.peer_timeout
            )));
        }
        if !(1..=MAX_COPY_THREADS).contains(&self.copy_threads) {
            return Err(TransportError::InvalidConfig(format!(
                "copy_threads must be in 1..={MAX_COPY_THREADS}, got {}",
                self.copy_threads
            )));
        }
        Ok(())
    }

    /// The value of backend option `key`, if set.
    pub fn option(&self, key: &str) -> Option<&str> {
        self.options.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The `nic` label of a `kind` transport made with this configuration
    /// in the metrics (`kvwire_nic_bytes_total{nic=...}` …): the verbs
    /// `device` option (`default` when unset), else the transport's name.
    pub fn nic_label(&self, kind: TransportKind) -> String {
        match kind {
            TransportKind::Verbs => self.option("device").unwrap_or("default").to_string(),
            other => other.to_string(),
        }
    }
}

/// Errors of the transport layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The backend cannot do this here (missing library, other host, bad option).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A backend option (`key=value`) is unknown or has a bad value.
    #[error("{backend} option {key:?}: {reason}")]
    InvalidOption {
        /// The backend.
        backend: TransportKind,
        /// The key as given.
        key: String,
        /// What is wrong, with the valid keys or the expected value.
        reason: String,
    },
    /// A shared setting of [`TransportConfig`] is out of range.
    #[error("invalid transport config: {0}")]
    InvalidConfig(String),
    /// Registering memory failed (the C call or syscall named in the message).
    #[error("memory registration failed: {0}")]
    Registration(String),
    /// Unknown local key.
    #[error("unknown local key {0:?}")]
    UnknownLocalKey(LocalKey),
    /// A posted segment's local range is not inside the registration its
    /// `lkey` names (the HCA's local protection check, done in software by
    /// every backend before anything moves).
    #[error("local range {addr:#x}+{len_bytes} is outside the registration of {lkey:?}")]
    LocalOutOfBounds {
        /// The key the segment named.
        lkey: LocalKey,
        /// Start of the segment's local range.
        addr: u64,
        /// Its length in bytes.
        len_bytes: u64,
    },
    /// The registration is still used by an in-flight transfer.
    #[error("registration {0:?} is in use by an in-flight transfer")]
    InUse(LocalKey),
    /// The peer's connection info could not be decoded.
    #[error("bad connection info: {0}")]
    BadConnectionInfo(String),
    /// Connecting to the peer failed.
    #[error("connecting to peer {peer:?} failed: {reason}")]
    Connect {
        /// Peer agent name.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The peer refused us because our agent name is connected to it now
    /// from another session (another transport or process under the same
    /// name); a name is held by one connected session at a time.
    #[error("peer {peer:?} refused the connection: agent name {name:?} is already connected there")]
    NameInUse {
        /// The peer agent.
        peer: String,
        /// Our agent name, as claimed.
        name: String,
    },
    /// Unknown or disconnected peer.
    #[error("peer {0:?} is not connected")]
    NotConnected(PeerId),
    /// The peer died or closed its connection.
    #[error("peer {0} disconnected")]
    PeerDisconnected(String),
    /// Posting failed before anything moved.
    #[error("post failed: {0}")]
    Post(String),
    /// A peer did not answer within the deadline (`peer_timeout`). The
    /// operation did not take effect and may be retried: after a shm
    /// `deregister` timeout the region stays registered.
    #[error("{op}: {peer} did not answer within {timeout:?}: {detail}")]
    Timeout {
        /// The operation that waited (`"deregister"`, ...).
        op: &'static str,
        /// Who did not answer (a peer name or a count of initiators).
        peer: String,
        /// How long it waited.
        timeout: std::time::Duration,
        /// What it waited for and what state it left.
        detail: String,
    },
    /// An I/O error from a named call.
    #[error("{call}: {source}")]
    Io {
        /// The call that failed.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl TransportError {
    /// Wrap an OS error with the name of the call that returned it.
    pub fn io(call: &'static str, source: impl Into<std::io::Error>) -> Self {
        Self::Io { call, source: source.into() }
    }

    /// A connect whose handshake the target did not answer within
    /// `timeout` (every backend: shm, tcp, verbs). Like every
    /// [`TransportError::Timeout`] it took no effect (nothing of the peer is
    /// kept) and may be retried, as a NIXL user retries `makeConnection` or
    /// vLLM's connector its handshake; a refusal stays
    /// [`TransportError::Connect`] or [`TransportError::NameInUse`].
    pub fn connect_timeout(peer: &str, timeout: std::time::Duration, detail: impl std::fmt::Display) -> Self {
        Self::Timeout { op: "connect", peer: peer.to_string(), timeout, detail: detail.to_string() }
    }

    /// Whether an I/O error means a socket timeout expired (`SO_RCVTIMEO`
    /// and `SO_SNDTIMEO` report `EAGAIN`/`EWOULDBLOCK`, some paths
    /// `ETIMEDOUT`).
    pub fn is_timeout_io(e: &std::io::Error) -> bool {
        matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
    }

    /// The failing call and its errno, for an [`TransportError::Io`] that
    /// came from one (a verbs or system call during setup or I/O).
    pub fn failed_call(&self) -> Option<(&'static str, i32)> {
        match self {
            Self::Io { call, source } => source.raw_os_error().map(|errno| (*call, errno)),
            _ => None,
        }
    }
}

/// A data-path backend. One instance serves one agent.
///
/// Backends may run progress threads; the object itself is driven by one
/// thread (`&mut self`). Data moves without the target's engine doing
/// anything (one-sided); the target only drains notifications.
pub trait Transport: Send {
    /// Which backend this is.
    fn kind(&self) -> TransportKind;

    /// Register `backing`'s memory for local use and remote access
    /// (local write, remote read, remote write).
    ///
    /// The transport keeps `backing` alive until [`Transport::deregister`]
    /// returns and every transfer that used it has ended (as rust-ibverbs'
    /// `MemoryRegion<O>` owns its buffer), so safe code cannot free memory
    /// that copy threads, peers or the NIC may still access. Registering
    /// borrowed memory, which could be dropped while registered, does not
    /// compile:
    ///
    /// ```compile_fail
    /// # use kvwire::transport::{Transport, TransportConfig, shm::ShmTransport};
    /// let mut t = ShmTransport::new("a", &TransportConfig::default()).unwrap();
    /// let buf = kvwire::HostBuffer::new(4096).unwrap();
    /// let reg = t.register(&buf).unwrap(); // error: expected `Arc<dyn MemoryBacking>`
    /// drop(buf);
    /// ```
    ///
    /// The same program with the memory handed over compiles, and the
    /// transport keeps it alive after the caller's handle is gone:
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use kvwire::transport::{Transport, TransportConfig, shm::ShmTransport};
    /// let mut t = ShmTransport::new("a", &TransportConfig::default()).unwrap();
    /// let buf = Arc::new(kvwire::HostBuffer::new(4096).unwrap());
    /// let reg = t.register(buf.clone()).unwrap();
    /// drop(buf); // the registration still owns the memory
    /// t.deregister(reg.lkey).unwrap(); // freed here
    /// ```
    ///
    /// # Errors
    /// [`TransportError::Registration`] when the backend refuses the range.
    fn register(&mut self, backing: Arc<dyn MemoryBacking>) -> Result<Registration, TransportError>;

    /// Register a list (NIXL's `registerMem` of a descriptor list): the
    /// registrations come back in the order given, each individually
    /// deregistrable. All or nothing: on an error none of the list stays
    /// registered. The default registers one at a time; `verbs` coalesces
    /// the list into as few memory regions as its ranges allow.
    ///
    /// # Errors
    /// As [`Transport::register`], for the first that fails.
    fn register_batch(&mut self, backings: Vec<Arc<dyn MemoryBacking>>) -> Result<Vec<Registration>, TransportError> {
        let mut done = Vec::with_capacity(backings.len());
        for b in backings {
            match self.register(b) {
                Ok(r) => done.push(r),
                Err(e) => {
                    for r in done {
                        let _ = self.deregister(r.lkey);
                    }
                    return Err(e);
                }
            }
        }
        Ok(done)
    }

    /// Memory regions the backend holds now for its registrations, where
    /// that differs from the number of registrations: verbs MRs, which
    /// several registrations may share (`coalesce`). `None` (the default):
    /// one per registration. Registrations over this is the coalescing ratio.
    fn memory_regions(&self) -> Option<usize> {
        None
    }

    /// Forget a registration. A transfer still using it keeps the memory
    /// alive until it ends.
    ///
    /// # Errors
    /// [`TransportError::UnknownLocalKey`].
    fn deregister(&mut self, lkey: LocalKey) -> Result<(), TransportError>;

    /// Opaque connection info (addresses, QP numbers, GIDs) that peers need
    /// to reach this agent; published in the agent metadata.
    fn connection_info(&self) -> Vec<u8>;

    /// Connect to a peer agent from its connection info and registered
    /// regions: [`Transport::dial`], run the [`Dial`] here, then
    /// [`Transport::install`].
    ///
    /// # Errors
    /// [`TransportError::BadConnectionInfo`], [`TransportError::Connect`]
    /// (refused, unreachable, malformed answers),
    /// [`TransportError::NameInUse`], [`TransportError::Timeout`] with `op`
    /// `"connect"` when the target did not answer the handshake within
    /// `peer_timeout` (nothing is kept; a retry may succeed),
    /// [`TransportError::Unsupported`] (e.g. `shm` to another host).
    fn connect(&mut self, peer_name: &str, info: &[u8], regions: &[RemoteRegion]) -> Result<PeerId, TransportError> {
        let dialed = self.dial(peer_name, info, regions)?.run()?;
        self.install(dialed)
    }

    /// The first half of [`Transport::connect`]: decode `info` and return
    /// the handshake as a [`Dial`], which runs without the transport. A
    /// caller that guards the transport with a lock runs the dial outside
    /// it, so that a peer slow to answer (up to `peer_timeout`) holds up
    /// nobody but the caller dialling it; NIXL's `loadRemoteMD` and
    /// Mooncake's first transfer to a segment connect the same way, on the
    /// caller's thread. Nothing is kept when the dial is dropped.
    ///
    /// # Errors
    /// [`TransportError::BadConnectionInfo`], [`TransportError::Connect`]
    /// (e.g. another wire version), [`TransportError::Unsupported`] (e.g.
    /// `shm` to another host); the handshake's own errors come from
    /// [`Dial::run`], as listed on [`Transport::connect`].
    fn dial(&mut self, peer_name: &str, info: &[u8], regions: &[RemoteRegion]) -> Result<Dial, TransportError>;

    /// The second half of [`Transport::connect`]: add the connection of a
    /// finished [`Dial`] as a peer. Cheap: it spawns the peer's threads and
    /// never waits for the network.
    ///
    /// # Errors
    /// [`TransportError::Unsupported`] when `dialed` was dialled by another
    /// transport (it is dropped, which closes its connection);
    /// [`TransportError::Io`] when a thread of the peer cannot be spawned,
    /// or [`TransportError::Registration`] when its buffers cannot be made;
    /// nothing is kept.
    fn install(&mut self, dialed: Dialed) -> Result<PeerId, TransportError>;

    /// Drop a peer. In-flight transfers to it must already be cancelled.
    fn disconnect(&mut self, peer: PeerId);

    /// Start moving a batch. Returns once it is queued; the result arrives
    /// through [`Transport::poll`].
    ///
    /// Every segment's local range is checked against this transport's own
    /// registrations (its `lkey` known, the range inside), so no caller can
    /// make a copy thread touch memory it did not register.
    ///
    /// # Errors
    /// [`TransportError::NotConnected`], [`TransportError::PeerDisconnected`],
    /// [`TransportError::UnknownLocalKey`], [`TransportError::LocalOutOfBounds`],
    /// [`TransportError::Post`] — in each case nothing was moved.
    fn post(&mut self, req: PostRequest) -> Result<(), TransportError>;

    /// Append terminal results of posted transfers to `out`. Never blocks.
    fn poll(&mut self, out: &mut Vec<Completion>);

    /// As [`Transport::poll`], but block until something happens on the
    /// backend's completion channel or `timeout` (wall time) passes. It may
    /// return early with `out` unchanged (e.g. woken by the completion of a
    /// transfer cancelled meanwhile): callers check and wait again. The
    /// waiting thread sleeps instead of spinning, so the cores stay with the
    /// progress or copy threads that do the work. The default, for backends
    /// without a channel, polls, sleeps up to 200 µs and polls again.
    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) {
        let before = out.len();
        self.poll(out);
        if out.len() == before {
            std::thread::sleep(timeout.min(Duration::from_micros(200)));
            self.poll(out);
        }
    }

    /// A [`CompletionSignal`] on this backend's completion channel, for
    /// callers that wait without holding the transport. `None` (the
    /// default) for backends without one: callers then sleep briefly
    /// between polls.
    fn completion_signal(&self) -> Option<CompletionSignal> {
        None
    }

    /// Stop a transfer. Returns only when nothing can still touch its buffers.
    /// No completion is reported for it afterwards.
    fn cancel(&mut self, xfer: XferId);

    /// Append notifications received since the last call to `out`. Never blocks.
    fn take_notifications(&mut self, out: &mut Vec<Notification>);

    /// An empty segment list with capacity, from a finished transfer, for the
    /// engine to fill for the next post instead of allocating (and faulting
    /// in) a fresh one. `None` (the default) when the transport keeps none.
    fn spare_segments(&mut self) -> Option<Vec<Segment>> {
        None
    }
}

/// A connection handshake to run without the transport that made it
/// ([`Transport::dial`]); it blocks for at most the transport's
/// `peer_timeout`.
#[must_use = "a dial does nothing until it is run"]
pub struct Dial {
    peer: String,
    run: Box<dyn FnOnce() -> Result<Dialed, TransportError> + Send>,
}

impl Dial {
    /// A dial of `peer` that runs `handshake` (for backends).
    pub(crate) fn new(peer: &str, handshake: impl FnOnce() -> Result<Dialed, TransportError> + Send + 'static) -> Self {
        Self { peer: peer.to_string(), run: Box::new(handshake) }
    }

    /// The peer agent this dial connects to.
    pub fn peer_name(&self) -> &str {
        &self.peer
    }

    /// Run the handshake on this thread.
    ///
    /// # Errors
    /// As [`Transport::connect`]: [`TransportError::Connect`],
    /// [`TransportError::NameInUse`], [`TransportError::Timeout`]; nothing
    /// is kept.
    pub fn run(self) -> Result<Dialed, TransportError> {
        (self.run)()
    }
}

impl std::fmt::Debug for Dial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dial").field("peer", &self.peer).finish_non_exhaustive()
    }
}

/// A finished handshake waiting for [`Transport::install`] on the transport
/// that dialled it. Dropping it closes the connection (it carried nothing
/// but the handshake).
pub struct Dialed {
    /// The dialling transport (a per-transport token).
    owner: u64,
    peer: String,
    conn: Box<dyn std::any::Any + Send>,
}

impl Dialed {
    pub(crate) fn new<C: Send + 'static>(owner: u64, peer: &str, conn: C) -> Self {
        Self { owner, peer: peer.to_string(), conn: Box::new(conn) }
    }

    /// The peer agent this connection reaches.
    pub fn peer_name(&self) -> &str {
        &self.peer
    }

    /// The connection, when `owner` dialled it as a `C`; otherwise
    /// [`TransportError::Unsupported`] (dropping it closes the connection).
    pub(crate) fn take<C: Send + 'static>(self, owner: u64) -> Result<(String, C), TransportError> {
        let peer = self.peer;
        if self.owner == owner
            && let Ok(c) = self.conn.downcast::<C>()
        {
            return Ok((peer, *c));
        }
        Err(TransportError::Unsupported(format!("the connection to {peer} was dialled by another transport")))
    }
}

impl std::fmt::Debug for Dialed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialed").field("peer", &self.peer).finish_non_exhaustive()
    }
}

/// A token naming one transport instance in [`Dialed`]: process-wide
/// unique, never 0.
pub(crate) fn next_owner() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The local side of a post, checked in software as an HCA checks a
/// scatter-gather entry's `lkey`: each segment's `lkey` must name a
/// registration (`lookup` returns its range and backing) and its local range
/// must lie inside it. Returns the backings the segments use, once each, for
/// the transfer to keep alive until it ends.
pub(crate) fn check_local(
    segments: &[Segment],
    mut lookup: impl FnMut(u32) -> Option<(MemoryDesc, Arc<dyn MemoryBacking>)>,
) -> Result<Vec<Arc<dyn MemoryBacking>>, TransportError> {
    let mut held: Vec<(u32, MemoryDesc, Arc<dyn MemoryBacking>)> = Vec::new();
    for s in segments {
        let desc = match held.iter().find(|(k, _, _)| *k == s.lkey.0) {
            Some((_, d, _)) => *d,
            None => {
                let (d, b) = lookup(s.lkey.0).ok_or(TransportError::UnknownLocalKey(s.lkey))?;
                held.push((s.lkey.0, d, b));
                d
            }
        };
        if !desc.contains(s.local_addr, s.len_bytes) {
            return Err(TransportError::LocalOutOfBounds { lkey: s.lkey, addr: s.local_addr, len_bytes: s.len_bytes });
        }
    }
    Ok(held.into_iter().map(|(_, _, b)| b).collect())
}

/// Wait until `done()` holds: spin briefly, then yield, then sleep 50 µs a
/// step. Used where a caller must not return before copy threads let go of
/// buffers (cancel, revocation); the waits are short but unbounded in steps.
pub(crate) fn wait_until(mut done: impl FnMut() -> bool) {
    let mut step = 0u32;
    while !done() {
        step = step.saturating_add(1);
        if step < 64 {
            std::hint::spin_loop();
        } else if step < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Create the backend `kind` for agent `agent_name`.
///
/// # Errors
/// [`TransportError::Unsupported`] when the backend is not available here
/// (e.g. libibverbs missing for `verbs`).
pub fn create(
    kind: TransportKind,
    agent_name: &str,
    config: &TransportConfig,
) -> Result<Box<dyn Transport>, TransportError> {
    config.validate()?;
    match kind {
        TransportKind::Shm => Ok(Box::new(shm::ShmTransport::new(agent_name, config)?)),
        TransportKind::Verbs => Ok(Box::new(verbs::VerbsTransport::new(agent_name, config)?)),
        TransportKind::Tcp => Ok(Box::new(tcp::TcpTransport::new(agent_name, config)?)),
    }
}
