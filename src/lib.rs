//! # kvwire
//!
//! Moves the paged KV cache of LLM inference engines between processes,
//! machines and tiers, with NIXL-style one-sided transfer semantics
//! implemented directly over libibverbs (and over shared memory and TCP where
//! RDMA is absent).
//!
//! Layers, bottom up:
//! - [`transport`]: one small [`transport::Transport`] trait; backends `shm`
//!   (same host, the default), `verbs` (RDMA), `tcp`.
//! - [`engine`]: the NIXL-like [`engine::TransferEngine`] (agents,
//!   registration, descriptor lists, transfer handles, notifications).
//!
//! # Quick start (shm)
//! ```
//! use std::sync::Arc;
//! use kvwire::engine::{Desc, TransferEngine, TransferStatus};
//! use kvwire::transport::{Op, TransportConfig, TransportKind};
//! use kvwire::HostBuffer;
//!
//! let cfg = TransportConfig::default();
//! let mut target = TransferEngine::new("decode", TransportKind::Shm, &cfg).unwrap();
//! let mut initiator = TransferEngine::new("prefill", TransportKind::Shm, &cfg).unwrap();
//! let dst = Arc::new(HostBuffer::new(1 << 16).unwrap());
//! let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
//! src.write(0, b"hello");
//! target.register(dst.clone()).unwrap();
//! initiator.register(src.clone()).unwrap();
//! initiator.connect(&target.metadata()).unwrap();
//! let h = initiator
//!     .post(Op::Write, &[Desc::new(src.addr(), 5)], "decode", &[Desc::new(dst.addr() + 100, 5)], Some(b"t1".to_vec()))
//!     .unwrap();
//! while initiator.status(h).unwrap() == TransferStatus::InProgress {}
//! initiator.release(h).unwrap();
//! assert_eq!(dst.to_vec(100..105), b"hello");
//! # let mut n = Default::default();
//! # while { n = target.get_notifs(); n.is_empty() } {}
//! # assert_eq!(n["prefill"], vec![b"t1".to_vec()]);
//! ```
//!
//! # Thread safety and cleanup
//! Engines are driven by one thread (`&mut self`, not `Sync`). Releasing an
//! in-progress transfer cancels it and returns only once no copy can still
//! touch its buffers; dropping an engine cancels what is still in flight.
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod accept;
pub mod connector;
pub mod cuda;
pub mod engine;
pub mod kv;
pub mod metrics;
pub mod sidechannel;
pub mod transport;
/// The libibverbs layer (crate `kvwire-verbs`): ffi mirror, run-time
/// loader, RAII objects.
pub use kvwire_verbs as verbs;

pub use transport::shm::HostBuffer;

/// README.md's Rust example runs as a doc-test (`cargo test --doc`), so the
/// README cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
