//! Engine metadata exchanged between processes, as MAX's msgspec structs
//! `KVTransferEngineMetadata` and `TensorAgentMetadata` (MAX `transfer_engine.py`):
//! JSON objects with a `"type"` tag holding the class name, `bytes` fields
//! as standard base64 strings, `replicated_per_group` omitted when empty.

use serde::{Deserialize, Serialize};

use super::error::KvError;
use crate::transport::MemoryKind;

/// Largest encoded engine metadata accepted (bytes).
pub const MAX_ENGINE_METADATA_BYTES: usize = 64 << 20;
/// Most groups (leaves) per engine.
pub const MAX_GROUPS: usize = 4096;
/// Most agents (replicas × TP shards) per engine.
pub const MAX_AGENTS: usize = 4096;

/// One agent (one `(replica, tp_shard)`) of an engine, as MAX's `TensorAgentMetadata`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorAgentMetadata {
    /// `{engine_name}_{replica}_{tp_shard}`.
    pub agent_name: String,
    /// The agent's transfer-engine metadata ([`crate::engine::AgentMetadata::to_bytes`]);
    /// base64 in JSON.
    #[serde(with = "b64")]
    pub metadata: Vec<u8>,
    /// Virtual address of page 0 of each group on this shard, parallel to `bytes_per_group`.
    pub base_addrs: Vec<u64>,
    /// Device ordinal (GPU id; 0 for host memory).
    pub device_id: u32,
}

/// Memory type of an engine (`nixl.MemoryType`): all host or all device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryType {
    /// Host memory.
    #[serde(rename = "DRAM")]
    Dram,
    /// GPU memory.
    #[serde(rename = "VRAM")]
    Vram,
}

impl From<MemoryKind> for MemoryType {
    fn from(k: MemoryKind) -> Self {
        match k {
            MemoryKind::Dram => MemoryType::Dram,
            MemoryKind::Vram => MemoryType::Vram,
        }
    }
}

/// Everything a peer engine needs to connect and address pages, as MAX's
/// `KVTransferEngineMetadata` (newest generation, leaf-keyed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Tagged", into = "Tagged")]
pub struct KVTransferEngineMetadata {
    /// Base name of the engine.
    pub name: String,
    /// Host or device memory.
    pub memory_type: MemoryType,
    /// `gethostname()`, to tell intra- from inter-node peers.
    pub hostname: String,
    /// Agents, `[replica][tp_shard]`.
    pub agents_meta: Vec<Vec<TensorAgentMetadata>>,
    /// Id of each group; transfers address pages by these.
    pub leaf_ids: Vec<String>,
    /// Pages of each group, null block included.
    pub num_pages_per_group: Vec<u64>,
    /// Bytes per page of each group.
    pub bytes_per_group: Vec<u64>,
    /// Whether each group is replicated across TP shards; empty = all false
    /// (omitted from JSON when empty).
    pub replicated_per_group: Vec<bool>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "type")]
enum Tagged {
    KVTransferEngineMetadata(Body),
}

#[derive(Serialize, Deserialize)]
struct Body {
    name: String,
    memory_type: MemoryType,
    hostname: String,
    agents_meta: Vec<Vec<TaggedAgent>>,
    leaf_ids: Vec<String>,
    num_pages_per_group: Vec<u64>,
    bytes_per_group: Vec<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    replicated_per_group: Vec<bool>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "type")]
enum TaggedAgent {
    TensorAgentMetadata(TensorAgentMetadata),
}

impl From<KVTransferEngineMetadata> for Tagged {
    fn from(m: KVTransferEngineMetadata) -> Self {
        Tagged::KVTransferEngineMetadata(Body {
            name: m.name,
            memory_type: m.memory_type,
            hostname: m.hostname,
            agents_meta: m
                .agents_meta
                .into_iter()
                .map(|r| r.into_iter().map(TaggedAgent::TensorAgentMetadata).collect())
                .collect(),
            leaf_ids: m.leaf_ids,
            num_pages_per_group: m.num_pages_per_group,
            bytes_per_group: m.bytes_per_group,
            replicated_per_group: m.replicated_per_group,
        })
    }
}

impl TryFrom<Tagged> for KVTransferEngineMetadata {
    type Error = KvError;
    fn try_from(t: Tagged) -> Result<Self, KvError> {
        let Tagged::KVTransferEngineMetadata(b) = t;
        let m = KVTransferEngineMetadata {
            name: b.name,
            memory_type: b.memory_type,
            hostname: b.hostname,
            agents_meta: b
                .agents_meta
                .into_iter()
                .map(|r| r.into_iter().map(|TaggedAgent::TensorAgentMetadata(a)| a).collect())
                .collect(),
            leaf_ids: b.leaf_ids,
            num_pages_per_group: b.num_pages_per_group,
            bytes_per_group: b.bytes_per_group,
            replicated_per_group: b.replicated_per_group,
        };
        m.validate()?;
        Ok(m)
    }
}

impl KVTransferEngineMetadata {
    /// DP replicas.
    pub fn dp(&self) -> usize {
        self.agents_meta.len()
    }

    /// TP shards per replica.
    pub fn tp(&self) -> usize {
        self.agents_meta.first().map_or(0, Vec::len)
    }

    /// Groups (leaves).
    pub fn num_groups(&self) -> usize {
        self.leaf_ids.len()
    }

    /// `replicated_per_group[g]`, false when the list is empty.
    pub fn replicated(&self, group: usize) -> bool {
        self.replicated_per_group.get(group).copied().unwrap_or(false)
    }

    /// The JSON form.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain data always serializes")
    }

    /// The JSON form as bytes (what MAX sends over ZMQ).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_json().into_bytes()
    }

    /// Decode and check the JSON form.
    ///
    /// # Errors
    /// [`KvError::Decode`] (not JSON, wrong tag or types, over
    /// [`MAX_ENGINE_METADATA_BYTES`]); [`KvError::BadMetadata`] (see
    /// [`KVTransferEngineMetadata::validate`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KvError> {
        if bytes.len() > MAX_ENGINE_METADATA_BYTES {
            return Err(KvError::Decode(format!("engine metadata of {} bytes is too large", bytes.len())));
        }
        let t: Tagged = serde_json::from_slice(bytes).map_err(|e| KvError::Decode(e.to_string()))?;
        t.try_into()
    }

    /// [`KVTransferEngineMetadata::from_bytes`] from text.
    ///
    /// # Errors
    /// As [`KVTransferEngineMetadata::from_bytes`].
    pub fn from_json(text: &str) -> Result<Self, KvError> {
        Self::from_bytes(text.as_bytes())
    }

    /// Check the rules a well-formed engine follows (MAX's base
    /// `TransferEngine.__init__` parallel-list checks, plus a rectangular
    /// agent grid, agent names `{name}_{replica}_{shard}`, and bounds).
    ///
    /// # Errors
    /// [`KvError::BadMetadata`] naming the broken rule.
    pub fn validate(&self) -> Result<(), KvError> {
        let bad = |m: String| Err(KvError::BadMetadata(m));
        if self.name.is_empty() || self.name.len() > 200 {
            return bad("engine name must be 1..=200 bytes".into());
        }
        let g = self.leaf_ids.len();
        if g == 0 || g > MAX_GROUPS {
            return bad(format!("{g} groups (expected 1..={MAX_GROUPS})"));
        }
        if self.num_pages_per_group.len() != g || self.bytes_per_group.len() != g {
            return bad("leaf_ids, num_pages_per_group and bytes_per_group are not parallel".into());
        }
        if !self.replicated_per_group.is_empty() && self.replicated_per_group.len() != g {
            return bad("replicated_per_group is not parallel to bytes_per_group".into());
        }
        if self.bytes_per_group.contains(&0) || self.num_pages_per_group.contains(&0) {
            return bad("a group has no pages or zero bytes per page".into());
        }
        let (dp, tp) = (self.dp(), self.tp());
        if dp == 0 || tp == 0 || dp.saturating_mul(tp) > MAX_AGENTS {
            return bad(format!("agent grid {dp}x{tp} (expected non-empty, at most {MAX_AGENTS} agents)"));
        }
        for (r, row) in self.agents_meta.iter().enumerate() {
            if row.len() != tp {
                return bad(format!("replica {r} has {} shards, replica 0 has {tp}", row.len()));
            }
            for (s, a) in row.iter().enumerate() {
                if a.agent_name != agent_name(&self.name, r, s) {
                    return bad(format!("agent [{r}][{s}] is named {:?}", a.agent_name));
                }
                if a.base_addrs.len() != g {
                    return bad(format!(
                        "agent {:?} has {} base addresses for {g} groups",
                        a.agent_name,
                        a.base_addrs.len()
                    ));
                }
                for (gi, &base) in a.base_addrs.iter().enumerate() {
                    let end = self.num_pages_per_group[gi]
                        .checked_mul(self.bytes_per_group[gi])
                        .and_then(|len| base.checked_add(len));
                    if end.is_none() {
                        return bad(format!("group {gi} of agent {:?} wraps the address space", a.agent_name));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The agent name of `(replica, shard)` of engine `engine`: `{engine}_{replica}_{shard}`.
pub fn agent_name(engine: &str, replica: usize, shard: usize) -> String {
    format!("{engine}_{replica}_{shard}")
}

/// The engine name of an agent named `{engine}_{replica}_{shard}`, if it has that form.
pub fn engine_of_agent(agent: &str) -> Option<&str> {
    let mut it = agent.rsplitn(3, '_');
    let shard = it.next()?;
    let replica = it.next()?;
    let engine = it.next()?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(shard) && digits(replica) && !engine.is_empty()).then_some(engine)
}

/// Standard base64 with padding (Python's `base64.b64encode`, msgspec's `bytes`).
mod b64 {
    use serde::{Deserialize, Deserializer, Serializer};

    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    pub fn encode(data: &[u8]) -> String {
        let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
        for chunk in data.chunks(3) {
            let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    pub fn decode(text: &str) -> Result<Vec<u8>, String> {
        let bytes = text.as_bytes();
        if !bytes.len().is_multiple_of(4) {
            return Err(format!("base64 length {} is not a multiple of 4", bytes.len()));
        }
        let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
        let num_chunks = bytes.len() / 4;
        for (ci, chunk) in bytes.chunks(4).enumerate() {
            let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
            if pad > 2 || (pad > 0 && ci + 1 != num_chunks) {
                return Err("misplaced base64 padding".into());
            }
            let mut n = 0u32;
            for &c in &chunk[..4 - pad] {
                let v = match c {
                    b'A'..=b'Z' => c - b'A',
                    b'a'..=b'z' => c - b'a' + 26,
                    b'0'..=b'9' => c - b'0' + 52,
                    b'+' => 62,
                    b'/' => 63,
                    _ => return Err(format!("invalid base64 byte {c:#x}")),
                };
                n = (n << 6) | u32::from(v);
            }
            n <<= 6 * pad as u32;
            let full = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
            out.extend_from_slice(&full[..3 - pad]);
        }
        Ok(out)
    }

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        decode(&s).map_err(serde::de::Error::custom)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn matches_python_b64encode() {
            for (raw, enc) in [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foobar", "Zm9vYmFy")] {
                assert_eq!(super::encode(raw.as_bytes()), enc);
                assert_eq!(super::decode(enc).unwrap(), raw.as_bytes());
            }
            let all: Vec<u8> = (0..=255).collect();
            assert_eq!(super::decode(&super::encode(&all)).unwrap(), all);
            for bad in ["Zg=", "Z===", "Zg==Zg==", "Z!==", "===="] {
                assert!(super::decode(bad).is_err(), "{bad}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KVTransferEngineMetadata {
        let agent = |r, s| TensorAgentMetadata {
            agent_name: agent_name("prefill", r, s),
            metadata: vec![1, 2, 3, 255],
            base_addrs: vec![0x1000, 0x20_0000],
            device_id: 0,
        };
        KVTransferEngineMetadata {
            name: "prefill".into(),
            memory_type: MemoryType::Dram,
            hostname: "h".into(),
            agents_meta: vec![vec![agent(0, 0), agent(0, 1)], vec![agent(1, 0), agent(1, 1)]],
            leaf_ids: vec!["0".into(), "0/scales".into()],
            num_pages_per_group: vec![10, 10],
            bytes_per_group: vec![256, 16],
            replicated_per_group: vec![false, false],
        }
    }

    #[test]
    fn round_trips_with_msgspec_tags() {
        let m = sample();
        let j = m.to_json();
        assert!(j.starts_with(r#"{"type":"KVTransferEngineMetadata","name":"prefill","memory_type":"DRAM""#), "{j}");
        assert!(j.contains(r#"{"type":"TensorAgentMetadata","agent_name":"prefill_0_0","metadata":"AQID/w==""#), "{j}");
        assert_eq!(KVTransferEngineMetadata::from_bytes(&m.to_bytes()).unwrap(), m);
        let mut m2 = m.clone();
        m2.replicated_per_group.clear();
        assert!(!m2.to_json().contains("replicated_per_group"));
        assert_eq!(KVTransferEngineMetadata::from_json(&m2.to_json()).unwrap(), m2);
    }

    #[test]
    fn rejects_inconsistent_or_hostile_metadata() {
        let j = sample().to_json();
        for bad in [
            j.replace("KVTransferEngineMetadata", "TransferReqData"),
            j.replace(r#""metadata":"AQID/w==""#, r#""metadata":"!!""#),
            j.replace(r#""bytes_per_group":[256,16]"#, r#""bytes_per_group":[256]"#),
            j.replace(r#""bytes_per_group":[256,16]"#, r#""bytes_per_group":[256,0]"#),
            j.replace(r#""num_pages_per_group":[10,10]"#, r#""num_pages_per_group":[10,-1]"#),
            j.replace(r#""replicated_per_group":[false,false]"#, r#""replicated_per_group":[false]"#),
            j.replace("prefill_1_1", "prefill_9_9"),
            j.replace(r#""base_addrs":[4096,2097152]"#, r#""base_addrs":[18446744073709551615,1]"#),
            j.replace(r#""memory_type":"DRAM""#, r#""memory_type":"HBM""#),
            r#"{"type":"KVTransferEngineMetadata"}"#.into(),
            "7".into(),
        ] {
            assert!(KVTransferEngineMetadata::from_json(&bad).is_err(), "accepted {bad}");
        }
        let mut m = sample();
        m.agents_meta[1].pop();
        assert!(matches!(m.validate(), Err(KvError::BadMetadata(_))));
    }

    #[test]
    fn agent_names_parse_back() {
        assert_eq!(engine_of_agent("prefill_0_1"), Some("prefill"));
        assert_eq!(engine_of_agent("my_engine_12_3"), Some("my_engine"));
        assert_eq!(engine_of_agent("x_1"), None);
        assert_eq!(engine_of_agent("_1_2"), None);
        assert_eq!(engine_of_agent("a_b_2"), None);
    }
}
