//! Discovery: how engines find each other's [`AgentMetadata`].
//!
//! A [`MetadataStore`] publishes this agent's metadata and looks peers up by
//! name, waiting up to a timeout for a name not yet published (instead of
//! failing at once, a common NIXL/Mooncake complaint). Two implementations:
//! - [`DirectStore`]: the direct side channel (`--listen`/`--connect`, one
//!   TCP connection between two processes), what `bench` and `replay` use by
//!   default;
//! - [`EtcdStore`]: an etcd v3 server through its JSON gateway. Entries live
//!   under a key prefix, attached to a lease that a thread keeps alive, so a
//!   crashed engine's entry disappears within the lease TTL; peers can also
//!   [`EtcdStore::watch`] the prefix.
//!
//! ```no_run
//! use std::time::Duration;
//! use kvwire_discovery::{EtcdStore, MetadataStore};
//! # fn demo(engine: &mut kvwire::engine::TransferEngine) -> Result<(), Box<dyn std::error::Error>> {
//! let mut store = EtcdStore::connect("http://127.0.0.1:2379", "/kvwire/agents/", Duration::from_secs(5))?;
//! store.publish(&engine.metadata())?;
//! let peer = store.lookup("prefill-0", Duration::from_secs(30))?;
//! engine.connect(&peer)?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod etcd;
pub mod http;

use std::collections::HashMap;
use std::time::{Duration, Instant};

pub use etcd::{EtcdStore, Watch, WatchEvent};
use serde::{Deserialize, Serialize};

use kvwire::engine::AgentMetadata;
use kvwire::engine::MetadataError;
use kvwire::sidechannel::{SideChannel, SideChannelError};

/// Errors of the discovery layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// A socket call failed.
    #[error("{call}: {source}")]
    Io {
        /// The call.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The store URL is not one we can use.
    #[error("bad store URL: {0}")]
    BadUrl(String),
    /// The etcd gateway answered with an HTTP error.
    #[error("etcd answered HTTP {status}: {body}")]
    Http {
        /// HTTP status.
        status: u16,
        /// Start of the body.
        body: String,
    },
    /// A malformed answer from the store.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Another live engine already published this name.
    #[error("agent name {0:?} is already published by another engine")]
    NameTaken(String),
    /// No agent of that name was published within the wait.
    #[error("agent {name:?} not published after waiting {waited:?}")]
    NotFound {
        /// The name looked up.
        name: String,
        /// How long we waited.
        waited: Duration,
    },
    /// The stored metadata does not decode.
    #[error("bad metadata for {name:?}: {source}")]
    Metadata {
        /// The entry's name.
        name: String,
        /// Why.
        #[source]
        source: MetadataError,
    },
    /// The direct side channel failed.
    #[error(transparent)]
    SideChannel(#[from] SideChannelError),
    /// The lease could not be kept alive (etcd unreachable past the TTL).
    #[error("lease lost: {0}")]
    LeaseLost(String),
    /// etcd accepted the connection (or is being waited for) but sent no
    /// answer within the timeout of one call.
    #[error("etcd at {url} did not answer within {} s", waited.as_secs_f64())]
    Unanswered {
        /// The endpoint, `http://host:port`.
        url: String,
        /// How long one call waited.
        waited: Duration,
    },
}

impl DiscoveryError {
    /// etcd could not be reached or did not answer (as opposed to an
    /// answer this side did not like, or a name not published).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Io { .. } | Self::Unanswered { .. })
    }
}

/// Where engines publish and find agent metadata.
pub trait MetadataStore: Send {
    /// Publish (or replace) `meta` under `meta.name`.
    ///
    /// # Errors
    /// Store-specific; nothing is published on error.
    fn publish(&mut self, meta: &AgentMetadata) -> Result<(), DiscoveryError>;

    /// The metadata of agent `name`, waiting up to `timeout` for it to be
    /// published.
    ///
    /// # Errors
    /// [`DiscoveryError::NotFound`] when it did not appear in time; store errors.
    fn lookup(&mut self, name: &str, timeout: Duration) -> Result<AgentMetadata, DiscoveryError>;

    /// Withdraw agent `name`'s entry (no error when absent).
    ///
    /// # Errors
    /// Store-specific.
    fn unpublish(&mut self, name: &str) -> Result<(), DiscoveryError>;
}

/// Messages of the direct store on the side channel.
#[derive(Debug, Serialize, Deserialize)]
enum DirectMsg {
    /// The sender's agent metadata (binary form).
    Publish(Vec<u8>),
    /// The sender withdrew an agent.
    Unpublish(String),
}

/// The direct side channel as a [`MetadataStore`]: each side publishes to the
/// other end of one TCP connection, and looks up what the other end sent.
#[derive(Debug)]
pub struct DirectStore {
    chan: SideChannel,
    seen: HashMap<String, AgentMetadata>,
}

impl DirectStore {
    /// Wait on `addr` (e.g. `127.0.0.1:7000`) for the other process to connect.
    ///
    /// # Errors
    /// Bind or accept failure.
    pub fn listen(addr: &str) -> Result<Self, DiscoveryError> {
        let (l, _) = SideChannel::bind(addr)?;
        Ok(Self { chan: SideChannel::accept(&l)?, seen: HashMap::new() })
    }

    /// Connect to a [`DirectStore::listen`]er, retrying until `timeout`.
    ///
    /// # Errors
    /// [`SideChannelError::Timeout`].
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self, DiscoveryError> {
        Ok(Self { chan: SideChannel::connect(addr, timeout)?, seen: HashMap::new() })
    }

    /// Wrap an already connected side channel.
    pub fn from_channel(chan: SideChannel) -> Self {
        Self { chan, seen: HashMap::new() }
    }
}

impl MetadataStore for DirectStore {
    fn publish(&mut self, meta: &AgentMetadata) -> Result<(), DiscoveryError> {
        Ok(self.chan.send(&DirectMsg::Publish(meta.to_bytes()))?)
    }

    fn lookup(&mut self, name: &str, timeout: Duration) -> Result<AgentMetadata, DiscoveryError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.seen.get(name) {
                return Ok(m.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(DiscoveryError::NotFound { name: name.to_string(), waited: timeout });
            }
            self.chan.set_read_timeout(Some(left))?;
            let msg = self.chan.recv::<DirectMsg>();
            self.chan.set_read_timeout(None)?;
            match msg {
                Ok(DirectMsg::Publish(bytes)) => {
                    let m = AgentMetadata::from_bytes(&bytes)
                        .map_err(|source| DiscoveryError::Metadata { name: name.to_string(), source })?;
                    self.seen.insert(m.name.clone(), m);
                }
                Ok(DirectMsg::Unpublish(n)) => {
                    self.seen.remove(&n);
                }
                Err(SideChannelError::Io { source, .. })
                    if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    return Err(DiscoveryError::NotFound { name: name.to_string(), waited: timeout });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn unpublish(&mut self, name: &str) -> Result<(), DiscoveryError> {
        Ok(self.chan.send(&DirectMsg::Unpublish(name.to_string()))?)
    }
}
