//! Agent metadata: what a peer needs to reach this agent's memory.
//!
//! Two encodings: a compact binary form (`KVWM` magic, a little-endian `u16`
//! version, then postcard) for the wire, and JSON for debugging. Decoding
//! untrusted input never panics and never allocates more than the input size
//! allows: every length is bounded (see the `MAX_*` constants).

use serde::{Deserialize, Serialize};

use super::error::MetadataError;
use crate::transport::{RemoteRegion, TransportKind};

/// Current metadata format version.
pub const METADATA_VERSION: u16 = 1;
/// Largest encoded metadata accepted (bytes).
pub const MAX_METADATA_BYTES: usize = 16 << 20;
/// Longest agent or host name (bytes).
pub const MAX_NAME_BYTES: usize = 255;
/// Largest transport connection info (bytes).
pub const MAX_CONNECTION_INFO_BYTES: usize = 64 << 10;
/// Most registered regions per agent.
pub const MAX_REGIONS: usize = 1 << 16;

const MAGIC: &[u8; 4] = b"KVWM";

/// Everything a peer needs to connect to an agent and address its memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    /// Unique agent name.
    pub name: String,
    /// Host the agent runs on (`gethostname`), to tell intra- from inter-node.
    pub hostname: String,
    /// The agent's transport.
    pub transport: TransportKind,
    /// Bumped at every register/deregister; a peer holding an older
    /// generation holds a stale view (NIXL's stale-generation check).
    pub generation: u64,
    /// Transport-specific connection info (opaque).
    pub connection_info: Vec<u8>,
    /// Registered regions with their remote keys, one per registration,
    /// sorted by start address; they may overlap or repeat, as
    /// registrations may (NIXL accepts overlapping registrations).
    pub regions: Vec<RemoteRegion>,
}

impl AgentMetadata {
    /// Compact binary form.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.connection_info.len() + self.regions.len() * 24);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&METADATA_VERSION.to_le_bytes());
        let body = postcard::to_allocvec(self).expect("encoding plain data to a Vec cannot fail");
        out.extend_from_slice(&body);
        out
    }

    /// Decode the binary form and check it.
    ///
    /// # Errors
    /// [`MetadataError::Truncated`], [`MetadataError::TooLarge`],
    /// [`MetadataError::BadMagic`], [`MetadataError::Version`],
    /// [`MetadataError::Malformed`], [`MetadataError::Inconsistent`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, MetadataError> {
        if bytes.len() > MAX_METADATA_BYTES {
            return Err(MetadataError::TooLarge { len: bytes.len(), limit: MAX_METADATA_BYTES });
        }
        if bytes.len() < 6 {
            return Err(MetadataError::Truncated(bytes.len()));
        }
        if &bytes[..4] != MAGIC {
            return Err(MetadataError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != METADATA_VERSION {
            return Err(MetadataError::Version { found: version, supported: METADATA_VERSION });
        }
        let (meta, rest): (Self, &[u8]) = postcard::take_from_bytes(&bytes[6..]).map_err(|e| match e {
            postcard::Error::DeserializeUnexpectedEnd => MetadataError::Truncated(bytes.len()),
            other => MetadataError::Malformed(other.to_string()),
        })?;
        if !rest.is_empty() {
            return Err(MetadataError::Malformed(format!("{} trailing bytes", rest.len())));
        }
        meta.validate()?;
        Ok(meta)
    }

    /// JSON form, for debugging (the etcd store keeps the binary form, base64).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain data always serializes")
    }

    /// Decode the JSON form and check it.
    ///
    /// # Errors
    /// As [`AgentMetadata::from_bytes`].
    pub fn from_json(text: &str) -> Result<Self, MetadataError> {
        if text.len() > MAX_METADATA_BYTES {
            return Err(MetadataError::TooLarge { len: text.len(), limit: MAX_METADATA_BYTES });
        }
        let meta: Self = serde_json::from_str(text).map_err(|e| MetadataError::Malformed(e.to_string()))?;
        meta.validate()?;
        Ok(meta)
    }

    /// Check the rules a well-formed agent follows.
    ///
    /// # Errors
    /// [`MetadataError::Inconsistent`] naming the broken rule.
    pub fn validate(&self) -> Result<(), MetadataError> {
        let bad = |m: String| Err(MetadataError::Inconsistent(m));
        if self.name.is_empty() || self.name.len() > MAX_NAME_BYTES {
            return bad(format!("agent name must be 1..={MAX_NAME_BYTES} bytes"));
        }
        if self.hostname.len() > MAX_NAME_BYTES {
            return bad(format!("hostname longer than {MAX_NAME_BYTES} bytes"));
        }
        if self.connection_info.len() > MAX_CONNECTION_INFO_BYTES {
            return bad(format!(
                "connection info of {} bytes exceeds {MAX_CONNECTION_INFO_BYTES}",
                self.connection_info.len()
            ));
        }
        if self.regions.len() > MAX_REGIONS {
            return bad(format!("{} regions exceed {MAX_REGIONS}", self.regions.len()));
        }
        // Remote keys may repeat: on verbs, registrations coalesced into one
        // memory region share its rkey (docs/VERBS.md, "Registration"); a
        // descriptor is matched to a region by address, not by key. Regions
        // may overlap and repeat (NIXL 1.5.1 accepts overlapping and
        // identical registrations and publishes each one); they are sorted
        // by start address, which the lookup relies on.
        let mut prev_addr = 0u64;
        for (i, r) in self.regions.iter().enumerate() {
            if r.len_bytes == 0 {
                return bad(format!("region {i} is empty"));
            }
            if r.addr.checked_add(r.len_bytes).is_none() {
                return bad(format!("region {i} wraps the address space"));
            }
            if r.addr < prev_addr {
                return bad(format!("region {i} is out of address order"));
            }
            prev_addr = r.addr;
        }
        Ok(())
    }

    /// A region holding all of `[addr, addr + len)`, if one does (regions
    /// may overlap: the one starting nearest below `addr` that covers it).
    pub fn find_region(&self, addr: u64, len: u64) -> Option<&RemoteRegion> {
        let below = self.regions.partition_point(|r| r.addr <= addr);
        self.regions[..below].iter().rev().find(|r| r.contains(addr, len))
    }
}

/// This host's name, as `gethostname` reports it.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{MemoryKind, RemoteKey};

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "prefill_0_0".into(),
            hostname: "h".into(),
            transport: TransportKind::Shm,
            generation: 3,
            connection_info: vec![1, 2, 3],
            regions: vec![
                RemoteRegion {
                    addr: 0x1000,
                    len_bytes: 0x1000,
                    rkey: RemoteKey(1),
                    kind: MemoryKind::Dram,
                    device_id: 0,
                },
                RemoteRegion {
                    addr: 0x4000,
                    len_bytes: 0x100,
                    rkey: RemoteKey(2),
                    kind: MemoryKind::Dram,
                    device_id: 0,
                },
            ],
        }
    }

    #[test]
    fn round_trips_binary_and_json() {
        let m = sample();
        assert_eq!(AgentMetadata::from_bytes(&m.to_bytes()).unwrap(), m);
        assert_eq!(AgentMetadata::from_json(&m.to_json()).unwrap(), m);
    }

    #[test]
    fn rejects_truncation_at_every_length() {
        let b = sample().to_bytes();
        for n in 0..b.len() {
            assert!(AgentMetadata::from_bytes(&b[..n]).is_err(), "prefix of {n} bytes accepted");
        }
    }

    #[test]
    fn rejects_wrong_magic_version_and_trailing() {
        let mut b = sample().to_bytes();
        b[0] = b'X';
        assert_eq!(AgentMetadata::from_bytes(&b), Err(MetadataError::BadMagic));
        let mut b = sample().to_bytes();
        b[4] = 9;
        assert!(matches!(AgentMetadata::from_bytes(&b), Err(MetadataError::Version { found: 9, .. })));
        let mut b = sample().to_bytes();
        b.push(0);
        assert!(matches!(AgentMetadata::from_bytes(&b), Err(MetadataError::Malformed(_))));
    }

    #[test]
    fn rejects_inconsistent_regions() {
        let mut m = sample();
        m.regions[1].addr = 0x800;
        assert!(matches!(AgentMetadata::from_bytes(&m.to_bytes()), Err(MetadataError::Inconsistent(_))));
        let mut m = sample();
        m.regions[1].len_bytes = u64::MAX - 0x4000 + 1;
        assert!(matches!(AgentMetadata::from_bytes(&m.to_bytes()), Err(MetadataError::Inconsistent(_))));
        // Regions sharing one rkey (a coalesced verbs MR) are consistent.
        let mut m = sample();
        m.regions[1].rkey = RemoteKey(1);
        assert!(AgentMetadata::from_bytes(&m.to_bytes()).is_ok());
        let mut m = sample();
        m.regions[0].len_bytes = 0;
        assert!(m.validate().is_err());
        let mut m = sample();
        m.name.clear();
        assert!(m.validate().is_err());
    }

    #[test]
    fn overlapping_and_repeated_regions_are_consistent_and_found() {
        let mut m = sample();
        // [0x1000, 0x2000), [0x1800, 0x4800) overlapping it, [0x1800, 0x1900)
        // inside both, and the first one again (an identical registration).
        m.regions[1].addr = 0x1800;
        m.regions[1].len_bytes = 0x3000;
        let inner = RemoteRegion { addr: 0x1800, len_bytes: 0x100, rkey: RemoteKey(3), ..m.regions[0] };
        let again = RemoteRegion { rkey: RemoteKey(4), ..m.regions[0] };
        m.regions.insert(0, again);
        m.regions.push(inner);
        assert_eq!(AgentMetadata::from_bytes(&m.to_bytes()).unwrap(), m);
        assert!(m.find_region(0x1000, 0x1000).is_some_and(|r| r.addr == 0x1000));
        // Past the inner region, inside the outer one that starts before it.
        assert_eq!(m.find_region(0x1a00, 0x100).unwrap().rkey, RemoteKey(2));
        assert_eq!(m.find_region(0x1f00, 0x100).unwrap().rkey, RemoteKey(2));
        assert_eq!(m.find_region(0x1000, 0x800).unwrap().addr, 0x1000);
        // Across both overlapping regions, inside neither.
        assert!(m.find_region(0x0f00, 0x1000).is_none());
        assert!(m.find_region(0x1000, 0x3800).is_none());
    }

    #[test]
    fn finds_regions() {
        let m = sample();
        assert_eq!(m.find_region(0x1000, 0x1000).unwrap().rkey, RemoteKey(1));
        assert!(m.find_region(0x1800, 0x1000).is_none());
        assert_eq!(m.find_region(0x40ff, 1).unwrap().rkey, RemoteKey(2));
        assert!(m.find_region(0x0, 1).is_none());
        assert!(m.find_region(u64::MAX, 2).is_none());
    }
}
