//! The one error type of the KV layer.
//!
//! Every validation rule of MAX's `KVCacheMemory.__post_init__`,
//! `KVTransferEngine.__init__`, `connect`, `initiate_*_transfer` and the
//! completion calls has its own variant, so a caller (or a Python wrapper
//! mapping them to `ValueError` / `NotImplementedError` / `TimeoutError`)
//! can branch on it. MAX's catalogue: the exceptions raised in
//! `max/pipelines/kv_cache/paged_kv_cache/transfer_engine.py`.

use std::time::Duration;

use crate::engine::EngineError;

/// Which side of a transfer an index or replica belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The engine the pages are copied from.
    Source,
    /// The engine the pages are copied into.
    Destination,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// Errors of [`crate::kv`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    // ---- KVCacheMemory (MAX `KVCacheMemory.__post_init__`, in its order) ----
    /// `buffers` is empty.
    #[error("KVCacheMemory needs at least one buffer (one per TP shard)")]
    NoBuffers,
    /// A buffer is not 2-D `[num_pages, bytes_per_page]`.
    #[error("buffer of TP shard {shard} has {ndim} dimensions, expected 2 ([num_pages, bytes_per_page])")]
    NotTwoDimensional {
        /// TP shard.
        shard: usize,
        /// Dimensions found.
        ndim: usize,
    },
    /// A buffer's row stride differs from its row length (padded pages; MAX MXSERV-502).
    #[error(
        "buffer of TP shard {shard} is not contiguous: row stride {row_stride_bytes} bytes, row length {bytes_per_page} bytes"
    )]
    NonContiguous {
        /// TP shard.
        shard: usize,
        /// Bytes between consecutive pages.
        row_stride_bytes: u64,
        /// Bytes per page.
        bytes_per_page: u64,
    },
    /// The shards' shapes differ.
    #[error("buffer of TP shard {shard} has shape {found:?}, shard 0 has {expected:?}")]
    ShapeMismatch {
        /// TP shard.
        shard: usize,
        /// Shard 0's shape.
        expected: Vec<u64>,
        /// This shard's shape.
        found: Vec<u64>,
    },
    /// `replicated = true` with fewer than 2 shards.
    #[error("replicated KVCacheMemory needs at least 2 buffers, got {num_buffers}")]
    ReplicatedNeedsTwoShards {
        /// Buffers given.
        num_buffers: usize,
    },
    /// A buffer with no pages or no bytes per page (kvwire: cannot be registered).
    #[error("buffer of TP shard {shard} is empty (shape {shape:?})")]
    ZeroSizedBuffer {
        /// TP shard.
        shard: usize,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// The view `[offset, offset + num_pages * bytes_per_page)` does not fit its backing memory.
    #[error(
        "buffer of TP shard {shard} needs {need_bytes} bytes at offset {offset_bytes}, its memory has {have_bytes}"
    )]
    BufferTooSmall {
        /// TP shard.
        shard: usize,
        /// Offset of the view in the backing (bytes).
        offset_bytes: u64,
        /// Bytes the view needs.
        need_bytes: u64,
        /// Bytes the backing has.
        have_bytes: u64,
    },
    /// Allocating host memory failed (`memfd_create`, `mmap`, ...).
    #[error("allocating host memory: {0}")]
    Alloc(#[source] std::io::Error),

    // ---- KVTransferEngine::new (MAX `KVTransferEngine.__init__`, in its order) ----
    /// `memory` has no replica ("tensors must contain at least one replica").
    #[error("memory must contain at least one replica")]
    NoReplicas,
    /// A replica has no group ("Each replica must contain at least one tensor").
    #[error("replica {replica} must contain at least one group")]
    EmptyReplica {
        /// DP replica.
        replica: usize,
    },
    /// `leaf_ids` is not parallel to the groups.
    #[error("{found} leaf ids for {expected} groups")]
    LeafIdCount {
        /// Groups per replica.
        expected: usize,
        /// Leaf ids given.
        found: usize,
    },
    /// A leaf id appears twice.
    #[error("duplicate leaf id {0:?}")]
    DuplicateLeafId(String),
    /// A replica's group count differs from replica 0's.
    #[error("replica {replica} has {found} groups, replica 0 has {expected}")]
    GroupCountMismatch {
        /// DP replica.
        replica: usize,
        /// Replica 0's group count.
        expected: usize,
        /// This replica's.
        found: usize,
    },
    /// A group's page count (null block included) differs from replica 0's.
    #[error("group {group} of replica {replica} has {found} pages, replica 0 has {expected}")]
    PageCountMismatch {
        /// DP replica.
        replica: usize,
        /// Group index.
        group: usize,
        /// Replica 0's page count.
        expected: u64,
        /// This replica's.
        found: u64,
    },
    /// A group's `replicated` flag differs from replica 0's.
    #[error("group {group} of replica {replica} has replicated={found}, replica 0 has {expected}")]
    ReplicationMismatch {
        /// DP replica.
        replica: usize,
        /// Group index.
        group: usize,
        /// Replica 0's flag.
        expected: bool,
        /// This replica's.
        found: bool,
    },
    /// A group's TP shard count differs from `len(memory[0][0].buffers)`.
    #[error("group {group} of replica {replica} has {found} TP shards, expected {expected}")]
    ShardCountMismatch {
        /// DP replica.
        replica: usize,
        /// Group index.
        group: usize,
        /// TP of the engine.
        expected: usize,
        /// This group's shard count.
        found: usize,
    },
    /// A group mixes host and GPU memory.
    #[error("group {group} of replica {replica} mixes host and device memory")]
    MixedDeviceKinds {
        /// DP replica.
        replica: usize,
        /// Group index.
        group: usize,
    },
    /// A group's bytes per page differs from replica 0's.
    #[error("group {group} of replica {replica} has {found} bytes per page, replica 0 has {expected}")]
    BytesPerPageMismatch {
        /// DP replica.
        replica: usize,
        /// Group index.
        group: usize,
        /// Replica 0's bytes per page.
        expected: u64,
        /// This replica's.
        found: u64,
    },
    /// Host and device memory across groups/replicas: exactly one memory type is allowed.
    #[error("the engine mixes host and device memory across groups")]
    MixedMemoryTypes,
    /// An agent name would not be unique or the engine name is unusable.
    #[error("invalid engine name {0:?}")]
    InvalidName(String),

    // ---- connect / disconnect (MAX `connect`, in its order) ----
    /// `connect` of an engine name that is already connected.
    #[error("engine {0:?} already connected")]
    AlreadyConnected(String),
    /// Something MAX does not implement either: GATHER_SCATTER resharding
    /// (MXSERV-290), a cache with recurrent state.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Per-group bytes per page differ between the engines.
    #[error("per-group bytes-per-page mismatch: local {local:?}, remote {remote:?}")]
    BytesPerGroupMismatch {
        /// Ours.
        local: Vec<u64>,
        /// Theirs.
        remote: Vec<u64>,
    },
    /// The engines declare different leaves.
    #[error("leaf mismatch: local {local:?}, remote {remote:?}")]
    LeafMismatch {
        /// Ours.
        local: Vec<String>,
        /// Theirs.
        remote: Vec<String>,
    },
    /// Engine metadata that breaks its own rules (arrays not parallel, ragged agent grid, ...).
    #[error("bad engine metadata: {0}")]
    BadMetadata(String),
    /// A remote engine that is not connected (`disconnect`, `initiate_*`).
    #[error("engine {0:?} is not connected")]
    NotConnected(String),

    // ---- initiate_send_transfer / initiate_read_transfer (MAX order) ----
    /// A replica index out of range.
    #[error("{side} replica {replica} out of range (engine has {num_replicas})")]
    ReplicaOutOfRange {
        /// Whose replica.
        side: Side,
        /// Index given.
        replica: usize,
        /// Replicas that side has.
        num_replicas: usize,
    },
    /// A page list names a leaf the engine does not have.
    #[error("{side} page list names unknown leaf {leaf:?}")]
    UnknownLeaf {
        /// Whose list.
        side: Side,
        /// The leaf.
        leaf: String,
    },
    /// A page list lacks one of the engine's leaves (it must name exactly the leaf set).
    #[error("{side} page list lacks leaf {leaf:?}")]
    MissingLeaf {
        /// Whose list.
        side: Side,
        /// The leaf.
        leaf: String,
    },
    /// A page index is not in `[0, num_pages)` of its group.
    #[error("{side} page {idx} of leaf {leaf:?} out of range (the group has {num_pages} pages)")]
    PageOutOfRange {
        /// Whose index.
        side: Side,
        /// The leaf.
        leaf: String,
        /// The index.
        idx: u64,
        /// Pages of the group, null block included.
        num_pages: u64,
    },
    /// Source and destination lists of a leaf differ in length.
    #[error("leaf {leaf:?}: {src} source pages but {dst} destination pages")]
    PageCountLengthMismatch {
        /// The leaf.
        leaf: String,
        /// Source pages.
        src: usize,
        /// Destination pages.
        dst: usize,
    },
    /// A destination page appears twice in one leaf.
    #[error("leaf {leaf:?}: destination page {idx} appears more than once")]
    DuplicateDestinationPage {
        /// The leaf.
        leaf: String,
        /// The page.
        idx: u64,
    },
    /// Posting the request of one shard pair failed; the pairs already posted were released.
    #[error("transfer request failed for TP shard pair ({local_shard}, {remote_shard}): {source}")]
    PostFailed {
        /// Our shard.
        local_shard: usize,
        /// The peer's shard.
        remote_shard: usize,
        /// Why.
        #[source]
        source: EngineError,
    },

    // ---- completion and cleanup ----
    /// A shard request failed (MAX: "Transfer request failed with status ...").
    #[error("transfer {transfer_name} failed on TP shard {shard}: {reason}")]
    TransferFailed {
        /// The transfer.
        transfer_name: String,
        /// Our shard owning the failed request.
        shard: usize,
        /// The transport's reason.
        reason: crate::transport::TransferFailure,
    },
    /// `cleanup_transfer` of a transfer still in progress.
    #[error("transfer {0} is not complete")]
    NotComplete(String),
    /// This engine initiated no such transfer (already cleaned up, or a stale handle).
    #[error("unknown transfer {0}")]
    UnknownTransfer(String),
    /// The request names neither this engine as its source nor as its
    /// destination (kvwire; MAX would poll it forever).
    #[error("transfer {transfer_name} is between {src_name:?} and {dst_name:?}, not engine {engine:?}")]
    NotOurTransfer {
        /// The request's transfer name.
        transfer_name: String,
        /// Its source engine.
        src_name: String,
        /// Its destination engine.
        dst_name: String,
        /// This engine.
        engine: String,
    },
    /// `sync_and_release` deadline; the transfer was cancelled before returning.
    #[error("transfer {transfer_name} did not complete within {timeout:?} (cancelled)")]
    Timeout {
        /// The transfer.
        transfer_name: String,
        /// The deadline.
        timeout: Duration,
    },

    // ---- wire ----
    /// Undecodable or hostile wire data (`TransferReqData`, engine metadata).
    #[error("decode error: {0}")]
    Decode(String),
    /// The underlying transfer engine failed (registration, connect, release, ...).
    #[error(transparent)]
    Engine(#[from] EngineError),
}
