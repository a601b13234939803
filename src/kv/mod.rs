//! The KV-cache layer, as Modular MAX's `KVTransferEngine`: paged KV memory
//! split in TP shards and DP replicas, moved page by page between engines.
//!
//! - [`KVCacheMemory`]: one logical KV tensor (a NIXL group) as one
//!   `[num_pages, bytes_per_page]` byte buffer per TP shard.
#![forbid(unsafe_code)]

pub mod error;
pub mod memory;

pub use error::{KvError, Side};
pub use memory::{KVCacheMemory, KvBuffer};
pub mod reqdata;
pub use reqdata::{PageIdxs, TransferReqData};
pub mod metadata;
pub use metadata::{KVTransferEngineMetadata, MemoryType, TensorAgentMetadata};
pub mod topology;
pub use topology::TransferStrategy;
pub mod engine;
mod transfer;
pub use engine::{KVTransferEngine, RemoteEngine};
pub use transfer::page_descs;
