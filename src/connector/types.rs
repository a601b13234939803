//! Plain-data types of the connector interface: leaf ids, device block ids,
//! canonical block hashes, cache group ids and occupancy counts.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::ConnectorError;

/// Name of one KV cache leaf, e.g. `"full"`, `"sliding"`, `"full/scales"`
/// (MAX: the keys of `KVCacheBufferInterface.to_memory()`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LeafId(pub String);

impl LeafId {
    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for LeafId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl From<String> for LeafId {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl Borrow<str> for LeafId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LeafId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Index of one device page (block) in a leaf's `[num_pages, bytes_per_page]`
/// buffers. Block 0 is the null block by convention (MAX `cache_params.py`); the
/// connector never sees null slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The page index as `usize`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A block hash in canonical bytes form (MAX `kv_connector.py`): 8 big-endian
/// bytes for the ahash64 family (including `sha256_64`), or 32 bytes for a
/// full SHA-256. Ordered and hashable; `Copy`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum BlockHash {
    /// ahash64 / sha256_64: the 64-bit value (canonical form is its
    /// big-endian bytes).
    H64(u64),
    /// Full SHA-256 digest.
    Sha256([u8; 32]),
}

impl BlockHash {
    /// Parse canonical bytes.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidHashLength`] for any length other than 8 or 32.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ConnectorError> {
        match bytes.len() {
            8 => Ok(Self::H64(u64::from_be_bytes(bytes.try_into().expect("8 bytes")))),
            32 => Ok(Self::Sha256(bytes.try_into().expect("32 bytes"))),
            len_bytes => Err(ConnectorError::InvalidHashLength { len_bytes }),
        }
    }

    /// An ahash64-family hash from its integer value (as a trace's `hash_ids`).
    pub fn from_u64(v: u64) -> Self {
        Self::H64(v)
    }

    /// The canonical bytes (8 or 32 of them).
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            Self::H64(v) => v.to_be_bytes().to_vec(),
            Self::Sha256(d) => d.to_vec(),
        }
    }

    /// The `u64` wire form used by dKV (MAX `connectors/dkv/connector.py`): the value itself,
    /// or the first 8 bytes, big-endian, of a SHA-256.
    pub fn seq_hash(&self) -> u64 {
        match self {
            Self::H64(v) => *v,
            Self::Sha256(d) => u64::from_be_bytes(d[..8].try_into().expect("8 bytes")),
        }
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::H64(v) => write!(f, "{v:016x}"),
            Self::Sha256(d) => d.iter().try_for_each(|b| write!(f, "{b:02x}")),
        }
    }
}

/// Attention kind of a cache group (MAX `KVCacheGroupId.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KVCacheGroupKind {
    /// Full attention: the whole root-anchored prefix.
    Full,
    /// Sliding-window attention: only the last `window_size` tokens.
    SlidingWindow,
    /// Recurrent state: published at checkpoint boundaries.
    Recurrent,
}

/// Group a leaf belongs to (MAX `KVCacheGroupId(type, window_size)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KVCacheGroupId {
    /// Attention kind.
    pub kind: KVCacheGroupKind,
    /// Window in tokens for sliding-window groups, `None` otherwise.
    pub window_size: Option<u32>,
}

impl KVCacheGroupId {
    /// A full-attention group.
    pub fn full() -> Self {
        Self { kind: KVCacheGroupKind::Full, window_size: None }
    }

    /// A sliding-window group of `window_size` tokens.
    pub fn sliding_window(window_size: u32) -> Self {
        Self { kind: KVCacheGroupKind::SlidingWindow, window_size: Some(window_size) }
    }

    /// A recurrent-state group.
    pub fn recurrent() -> Self {
        Self { kind: KVCacheGroupKind::Recurrent, window_size: None }
    }
}

/// Something per leaf: `leaf_id -> Vec<T>`, in leaf-name order.
pub type PerLeaf<T> = BTreeMap<LeafId, Vec<T>>;

/// Occupancy of a host or disk tier in bytes (MAX `ByteCount(free, total)`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteCount {
    /// Free bytes.
    pub free: u64,
    /// Capacity in bytes.
    pub total: u64,
}

impl ByteCount {
    /// `total - free`.
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }

    /// Used share in percent; 0 when `total == 0`.
    pub fn used_pct(&self) -> f64 {
        pct(self.used(), self.total)
    }

    /// Free share in percent; 0 when `total == 0`.
    pub fn free_pct(&self) -> f64 {
        pct(self.free, self.total)
    }
}

/// Occupancy of a device (G0) pool in blocks (MAX `BlockCount(free, total)`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockCount {
    /// Free blocks.
    pub free: u64,
    /// Pool size in blocks.
    pub total: u64,
}

impl BlockCount {
    /// `total - free`.
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }

    /// Used share in percent; 0 when `total == 0`.
    pub fn used_pct(&self) -> f64 {
        pct(self.used(), self.total)
    }

    /// Free share in percent; 0 when `total == 0`.
    pub fn free_pct(&self) -> f64 {
        pct(self.free, self.total)
    }
}

fn pct(part: u64, total: u64) -> f64 {
    if total == 0 { 0.0 } else { 100.0 * part as f64 / total as f64 }
}
