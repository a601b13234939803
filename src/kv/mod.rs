//! The KV-cache layer, as Modular MAX's `KVTransferEngine`: paged KV memory
//! split in TP shards and DP replicas, moved page by page between engines.
//!
//! - [`KVCacheMemory`]: one logical KV tensor (a NIXL group) as one
//!   `[num_pages, bytes_per_page]` byte buffer per TP shard (null block
//!   included in `num_pages`).
//! - [`KVTransferEngine`]: one transfer-engine agent per `(replica, shard)`;
//!   `connect` from a peer's [`KVTransferEngineMetadata`], then
//!   `initiate_send_transfer` / `initiate_read_transfer` page lists per leaf,
//!   and poll `is_complete` on **both** sides.
//! - [`TransferReqData`]: the transfer record, JSON-compatible with MAX's msgspec.
//! - [`topology`]: DIRECT / BROADCAST / GATHER_SCATTER planning (pure functions).
//! - [`PagedCacheDesc`]: `from_paged_cache` input (leaves, scales groups).
//!
//! # Quick start (shm, one process for brevity)
//! ```
//! use std::time::Duration;
//! use kvwire::kv::{KVCacheMemory, KVTransferEngine, PageIdxs};
//! use kvwire::transport::{TransportConfig, TransportKind};
//!
//! let cfg = TransportConfig::default();
//! // TP 2, one group of 16 pages × 4 KiB per shard, on each side.
//! let (src_mem, src_bufs) = KVCacheMemory::new_host(2, 16, 4096, false).unwrap();
//! let (dst_mem, dst_bufs) = KVCacheMemory::new_host(2, 16, 4096, false).unwrap();
//! let mut prefill = KVTransferEngine::new("prefill", vec![vec![src_mem]], None, TransportKind::Shm, &cfg).unwrap();
//! let mut decode = KVTransferEngine::new("decode", vec![vec![dst_mem]], None, TransportKind::Shm, &cfg).unwrap();
//! src_bufs[1].write(3 * 4096, b"page 3, shard 1");
//!
//! // Metadata normally crosses processes: to_bytes() / from_bytes().
//! prefill.connect(&decode.metadata()).unwrap();
//! let pages = |p: Vec<u64>| PageIdxs::per_leaf([("0", p)]);
//! let req = prefill.initiate_send_transfer("decode", &pages(vec![3]), &pages(vec![7]), 0, 0).unwrap();
//! assert_eq!(req.tp_shard_count, 2); // one request per shard pair
//!
//! // The decode side learns of `req` from the prefill side (req.to_json()).
//! while !decode.is_complete(&req).unwrap() {}
//! decode.cleanup_transfer(&req).unwrap();
//! prefill.sync_and_release(&req, Duration::from_secs(5)).unwrap();
//! assert_eq!(dst_bufs[1].to_vec(7 * 4096..7 * 4096 + 15), b"page 3, shard 1");
//! prefill.cleanup().unwrap();
//! decode.cleanup().unwrap();
//! ```
#![forbid(unsafe_code)]

pub mod error;
pub mod memory;

pub use error::{KvError, Side};
pub use memory::{KVCacheMemory, KvBuffer};
pub mod msgspec;
pub mod reqdata;
pub mod reqwire;
pub use reqdata::{PageIdxs, TransferReqData};
pub use reqwire::{WireIdxs, WireTransferReqData};
pub mod metadata;
pub use metadata::{KVTransferEngineMetadata, MemoryType, TensorAgentMetadata};
pub mod topology;
pub use topology::TransferStrategy;
mod cleanup;
pub mod engine;
pub mod paged;
mod transfer;
pub use engine::{KVTransferEngine, RemoteEngine};
pub use paged::{CacheLeaf, HostLeafSpec, HostPages, LeafKind, PagedCacheDesc};
pub use transfer::page_descs;

#[cfg(test)]
mod tests;
