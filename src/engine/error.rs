//! Errors of the transfer engine.

use crate::transport::TransportError;

/// Errors returned by [`crate::engine::TransferEngine`]. Each validation rule
/// (as NIXL's `createXferReq`) has its own variant so callers can branch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Agent metadata could not be decoded or is inconsistent.
    #[error("bad agent metadata: {0}")]
    Metadata(#[from] MetadataError),
    /// Registering an empty range.
    #[error("cannot register an empty range at {addr:#x}")]
    EmptyRegistration {
        /// Start address.
        addr: u64,
    },
    /// No such registration.
    #[error("unknown registration")]
    UnknownRegistration,
    /// `deregister` while a transfer still uses the registration (or one
    /// overlapping it).
    #[error("registration is used by {inflight} in-flight transfer(s)")]
    RegistrationInUse {
        /// Transfers still using it.
        inflight: u32,
    },
    /// The remote agent was never connected (NIXL `NOT_FOUND`).
    #[error("unknown remote agent {0:?}")]
    UnknownAgent(String),
    /// `connect` of a name that is already connected.
    #[error("agent {0:?} already connected")]
    AlreadyConnected(String),
    /// `connect` to our own name (NIXL refuses it too).
    #[error("cannot connect agent {0:?} to itself")]
    SelfConnect(String),
    /// The peer uses another transport.
    #[error("peer {peer:?} uses transport {remote}, this agent uses {local}")]
    TransportMismatch {
        /// Peer name.
        peer: String,
        /// Our transport.
        local: String,
        /// Theirs.
        remote: String,
    },
    /// Local and remote descriptor lists differ in length.
    #[error("descriptor count mismatch: {local} local vs {remote} remote")]
    DescCountMismatch {
        /// Local descriptors.
        local: usize,
        /// Remote descriptors.
        remote: usize,
    },
    /// A descriptor pair differs in length (NIXL: "length mismatch at index i").
    #[error("length mismatch at index {index}: local {local} bytes, remote {remote} bytes")]
    LengthMismatch {
        /// Index in the lists.
        index: usize,
        /// Local length (bytes).
        local: u64,
        /// Remote length (bytes).
        remote: u64,
    },
    /// A zero-length descriptor.
    #[error("descriptor {index} has length 0")]
    EmptyDescriptor {
        /// Index in the lists.
        index: usize,
    },
    /// A local descriptor is not inside one local registration.
    #[error("local descriptor {index} ({addr:#x}+{len_bytes}) is outside every registered region")]
    LocalOutOfBounds {
        /// Index in the list.
        index: usize,
        /// Address.
        addr: u64,
        /// Length (bytes).
        len_bytes: u64,
    },
    /// A remote descriptor is not inside one region the peer registered.
    #[error("remote descriptor {index} ({addr:#x}+{len_bytes}) is outside every region of agent {agent:?}")]
    RemoteOutOfBounds {
        /// Index in the list.
        index: usize,
        /// Address.
        addr: u64,
        /// Length (bytes).
        len_bytes: u64,
        /// Remote agent.
        agent: String,
    },
    /// No such transfer handle (released, or never issued).
    #[error("unknown transfer handle {0}")]
    UnknownHandle(u64),
    /// An agent name that is empty or longer than
    /// [`crate::engine::metadata::MAX_NAME_BYTES`] (NIXL's `nixlAgent`
    /// constructor refuses an empty name with `std::invalid_argument`).
    #[error("bad agent name {name:?}: {reason}")]
    BadAgentName {
        /// The name given (lossy: cut to 64 characters when long).
        name: String,
        /// Which rule it broke.
        reason: String,
    },
    /// Metadata of an already-loaded agent whose connection info or transport
    /// changed: NIXL 1.5's `loadRemoteMD` answers `NIXL_ERR_NOT_ALLOWED`.
    /// Remove the agent first, then load the new metadata.
    #[error("agent {0:?} is already loaded with other connection info; remove it before loading new metadata")]
    MetadataConflict(String),
    /// A telemetry query for a transfer that has not finished.
    #[error("transfer {0} has not completed; telemetry is taken at completion")]
    NotCompleted(u64),
}

/// Errors decoding or checking [`crate::engine::AgentMetadata`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetadataError {
    /// Fewer bytes than the header or the encoded value needs.
    #[error("truncated metadata ({0} bytes)")]
    Truncated(usize),
    /// Larger than the limit.
    #[error("metadata of {len} bytes exceeds the {limit}-byte limit")]
    TooLarge {
        /// Size seen.
        len: usize,
        /// Limit.
        limit: usize,
    },
    /// Not kvwire metadata.
    #[error("bad magic: not kvwire agent metadata")]
    BadMagic,
    /// A version this build cannot read.
    #[error("unsupported metadata version {found} (this build reads {supported})")]
    Version {
        /// Version found.
        found: u16,
        /// Version supported.
        supported: u16,
    },
    /// The body does not decode.
    #[error("malformed metadata: {0}")]
    Malformed(String),
    /// Decodes, but breaks a rule (empty name, regions out of address order, ...).
    #[error("inconsistent metadata: {0}")]
    Inconsistent(String),
}
