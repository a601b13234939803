//! The connector layer's one error type.

use super::{BlockHash, BlockId, LeafId};

/// Errors of the connector layer (MAX `kv_connector.py` exceptions and the
/// argument checks around them).
///
/// [`LoadRefused`](Self::LoadRefused) and [`LoadFailed`](Self::LoadFailed) are
/// MAX's `KVLoadRefused` / `KVLoadFailed`: on either, the caller frees the
/// destination rows without committing them and serves the request as a miss.
/// The others are caller bugs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectorError {
    /// A block hash whose canonical bytes are neither 8 (ahash64 family) nor
    /// 32 (SHA-256) long.
    #[error(
        "block hash of {len_bytes} bytes: canonical hashes are 8 (ahash64) or 32 (SHA-256) bytes"
    )]
    InvalidHashLength {
        /// The length given.
        len_bytes: usize,
    },

    /// `KVLoadRefused`: the connector cannot move every block it was asked
    /// for (one was evicted since the lookup, or never held). Raised before
    /// anything moved; short loads are forbidden.
    #[error("KVLoadRefused: {reason} (leaf {leaf_id:?}, block hash {block_hash:?})")]
    LoadRefused {
        /// Leaf of the first block that cannot be served, when known.
        leaf_id: Option<LeafId>,
        /// Hash of that block, when known.
        block_hash: Option<BlockHash>,
        /// Why.
        reason: String,
    },

    /// `KVLoadFailed`: a copy into the destination blocks failed, at post time
    /// or after. Guarantee: nothing still writes into the destination blocks
    /// when this is returned.
    #[error("KVLoadFailed: {reason}")]
    LoadFailed {
        /// The failing copy.
        reason: String,
    },

    /// An offload's device-to-host copy failed; nothing of it was stored.
    #[error("offload failed: {reason}")]
    OffloadFailed {
        /// The failing copy.
        reason: String,
    },

    /// `load` without a preceding `lookup` with the same `replica_idx` and
    /// `hint`, or a second `load` for one lookup (MAX: "must follow a
    /// lookup() with the same replica_idx and hint, at most once").
    #[error(
        "load without a matching lookup (replica {replica_idx}): each load must follow its own lookup with the same replica_idx and hint"
    )]
    LoadWithoutLookup {
        /// The replica the load named.
        replica_idx: usize,
    },

    /// `block_ids[leaf]` and `block_hashes[leaf]` differ in length, or a leaf
    /// appears in one map and not the other.
    #[error("leaf {leaf_id}: {num_block_ids} block ids but {num_block_hashes} block hashes")]
    LengthMismatch {
        /// The leaf.
        leaf_id: LeafId,
        /// `block_ids[leaf].len()` (0 when absent).
        num_block_ids: usize,
        /// `block_hashes[leaf].len()` (0 when absent).
        num_block_hashes: usize,
    },

    /// A leaf this connector does not serve.
    #[error("unknown leaf {leaf_id}")]
    UnknownLeaf {
        /// The leaf named.
        leaf_id: LeafId,
    },

    /// A DP replica this connector has no device pages for.
    #[error("replica {replica_idx} out of range: the connector serves {num_replicas} replicas")]
    NoSuchReplica {
        /// The replica named.
        replica_idx: usize,
        /// Replicas served.
        num_replicas: usize,
    },

    /// A device block id past the leaf's `total_num_pages`.
    #[error("leaf {leaf_id}: block {block_id:?} out of range (leaf has {num_pages} pages)")]
    BlockOutOfRange {
        /// The leaf.
        leaf_id: LeafId,
        /// The block id given.
        block_id: BlockId,
        /// `total_num_pages` of the leaf, null block included.
        num_pages: usize,
    },

    /// The same destination block twice in one load's leaf.
    #[error("leaf {leaf_id}: block {block_id:?} is a load destination twice")]
    DuplicateBlockId {
        /// The leaf.
        leaf_id: LeafId,
        /// The repeated block id.
        block_id: BlockId,
    },

    /// Device pages that do not fit together (construction-time check).
    #[error("invalid device pages: {reason}")]
    InvalidPages {
        /// What is wrong.
        reason: String,
    },

    /// The connector was shut down.
    #[error("connector is shut down")]
    ShutDown,
}
