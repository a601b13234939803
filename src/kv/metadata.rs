//! Engine metadata exchanged between processes, as MAX 26.7's msgspec structs
//! `KVTransferEngineMetadata` (a subclass of `TransferEngineMetadata`) and
//! `TensorAgentMetadata` (`max/pipelines/kv_cache/paged_kv_cache/transfer_engine.py`):
//! a JSON object / msgpack map with a `"type"` tag holding the class name,
//! fields in msgspec's order (the subclass's own fields first, then the
//! inherited `name`, `memory_type`, `hostname`, `agents_meta`),
//! `memory_type` as `nixl.MemoryType`'s integer, `bytes` as base64 (JSON) or
//! `bin` (msgpack), fields at their default left out. Where MAX carries
//! NIXL's agent blob (`TensorAgentMetadata.metadata`), kvwire carries its
//! own agent metadata ([`crate::engine::AgentMetadata::to_bytes`]).

use std::fmt;

use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::KvError;
use super::msgspec::{self, MsgBytes, check_tag};
use crate::transport::MemoryKind;

/// Largest encoded engine metadata accepted (bytes).
pub const MAX_ENGINE_METADATA_BYTES: usize = msgspec::MAX_ENCODED_BYTES;
/// Most groups (leaves) per engine.
pub const MAX_GROUPS: usize = 4096;
/// Most agents (replicas × TP shards) per engine.
pub const MAX_AGENTS: usize = 4096;

const ENGINE_TAG: &str = "KVTransferEngineMetadata";
const AGENT_TAG: &str = "TensorAgentMetadata";

/// One agent (one `(replica, tp_shard)`) of an engine, as MAX's `TensorAgentMetadata`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorAgentMetadata {
    /// `{engine_name}_{replica}_{tp_shard}`.
    pub agent_name: String,
    /// The agent's transfer-engine metadata ([`crate::engine::AgentMetadata::to_bytes`]);
    /// base64 in JSON.
    pub metadata: Vec<u8>,
    /// Virtual address of page 0 of each group on this shard, parallel to `bytes_per_group`.
    pub base_addrs: Vec<u64>,
    /// Device ordinal (GPU id; 0 for host memory).
    pub device_id: u32,
    /// Per group, the byte offsets from `base_addrs[g]` where a new
    /// registered region begins (MAX: CUDA allocation boundaries). kvwire
    /// registers each group's memory whole, so every list is empty; MAX's
    /// engines send one (empty) list per group, and so does kvwire. Omitted
    /// from the encoding when the outer list is empty (msgspec's default).
    pub region_splits: Vec<Vec<u64>>,
}

/// Memory type of an engine (`nixl.MemoryType`): all host or all device.
/// Encoded as NIXL's integer (`DRAM = 0`, `VRAM = 1`), as msgspec encodes
/// MAX's `nixl.MemoryType` enum. NIXL's `BLK`/`OBJ`/`FILE` (2, 3, 4) decode
/// to a [`KvError::Validation`] naming them: no KV engine registers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Host memory.
    Dram,
    /// GPU memory.
    Vram,
}

impl MemoryType {
    /// `nixl.MemoryType` value.
    pub fn nixl_value(self) -> u64 {
        match self {
            MemoryType::Dram => 0,
            MemoryType::Vram => 1,
        }
    }

    /// NIXL's name (`"DRAM"`, `"VRAM"`).
    pub fn name(self) -> &'static str {
        match self {
            MemoryType::Dram => "DRAM",
            MemoryType::Vram => "VRAM",
        }
    }
}

impl Serialize for MemoryType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.nixl_value())
    }
}

impl<'de> Deserialize<'de> for MemoryType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match msgspec::MsgInt::deserialize(d)?.0 {
            0 => Ok(MemoryType::Dram),
            1 => Ok(MemoryType::Vram),
            v @ 2..=4 => Err(de::Error::custom(format_args!(
                "memory_type {} ({v}) is not supported: kvwire engines register DRAM or VRAM",
                ["BLK", "OBJ", "FILE"][(v - 2) as usize]
            ))),
            v => Err(de::Error::custom(format_args!("Invalid enum value {v} - at `$.memory_type`"))),
        }
    }
}

impl From<MemoryKind> for MemoryType {
    fn from(k: MemoryKind) -> Self {
        match k {
            MemoryKind::Dram => MemoryType::Dram,
            MemoryKind::Vram => MemoryType::Vram,
        }
    }
}

/// Everything a peer engine needs to connect and address pages, as MAX
/// 26.7's `KVTransferEngineMetadata` (leaf-keyed).
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Bytes of one page over all groups: `sum(bytes_per_group)` for engines
    /// MAX and kvwire build; `connect` compares it first, as MAX does.
    pub bytes_per_page: u64,
    /// Bytes per page of each group.
    pub bytes_per_group: Vec<u64>,
    /// Whether each group is replicated across TP shards; empty = all false
    /// (omitted from the encoding when empty).
    pub replicated_per_group: Vec<bool>,
}

impl Serialize for TensorAgentMetadata {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(5 + usize::from(!self.region_splits.is_empty())))?;
        m.serialize_entry("type", AGENT_TAG)?;
        m.serialize_entry("agent_name", &self.agent_name)?;
        m.serialize_entry("metadata", &MsgBytes(self.metadata.clone()))?;
        m.serialize_entry("base_addrs", &self.base_addrs)?;
        m.serialize_entry("device_id", &self.device_id)?;
        if !self.region_splits.is_empty() {
            m.serialize_entry("region_splits", &self.region_splits)?;
        }
        m.end()
    }
}

impl Serialize for KVTransferEngineMetadata {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(9 + usize::from(!self.replicated_per_group.is_empty())))?;
        m.serialize_entry("type", ENGINE_TAG)?;
        m.serialize_entry("leaf_ids", &self.leaf_ids)?;
        m.serialize_entry("num_pages_per_group", &self.num_pages_per_group)?;
        m.serialize_entry("bytes_per_page", &self.bytes_per_page)?;
        m.serialize_entry("bytes_per_group", &self.bytes_per_group)?;
        if !self.replicated_per_group.is_empty() {
            m.serialize_entry("replicated_per_group", &self.replicated_per_group)?;
        }
        m.serialize_entry("name", &self.name)?;
        m.serialize_entry("memory_type", &self.memory_type)?;
        m.serialize_entry("hostname", &self.hostname)?;
        m.serialize_entry("agents_meta", &self.agents_meta)?;
        m.end()
    }
}

fn missing<E: de::Error>(f: &'static str) -> E {
    E::custom(format_args!("Object missing required field `{f}`"))
}

impl<'de> Deserialize<'de> for TensorAgentMetadata {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TensorAgentMetadata;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an `object` (TensorAgentMetadata)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TensorAgentMetadata, A::Error> {
                let (mut name, mut blob, mut bases, mut dev) = (None, None, None, None);
                let mut splits = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "type" => check_tag(&map.next_value::<String>()?, AGENT_TAG)?,
                        "agent_name" => name = Some(map.next_value()?),
                        "metadata" => blob = Some(map.next_value::<MsgBytes>()?.0),
                        "base_addrs" => bases = Some(map.next_value()?),
                        "device_id" => dev = Some(map.next_value()?),
                        "region_splits" => splits = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(TensorAgentMetadata {
                    agent_name: name.ok_or_else(|| missing("agent_name"))?,
                    metadata: blob.ok_or_else(|| missing("metadata"))?,
                    base_addrs: bases.ok_or_else(|| missing("base_addrs"))?,
                    device_id: dev.ok_or_else(|| missing("device_id"))?,
                    region_splits: splits,
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for KVTransferEngineMetadata {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KVTransferEngineMetadata;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an `object` (KVTransferEngineMetadata)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KVTransferEngineMetadata, A::Error> {
                let (mut name, mut mt, mut host, mut agents) = (None, None, None, None);
                let (mut leaves, mut pages, mut bpp, mut bpg) = (None, None, None, None);
                let mut repl = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "type" => check_tag(&map.next_value::<String>()?, ENGINE_TAG)?,
                        "name" => name = Some(map.next_value()?),
                        "memory_type" => mt = Some(map.next_value()?),
                        "hostname" => host = Some(map.next_value()?),
                        "agents_meta" => agents = Some(map.next_value()?),
                        "leaf_ids" => leaves = Some(map.next_value()?),
                        "num_pages_per_group" => pages = Some(map.next_value()?),
                        "bytes_per_page" => bpp = Some(map.next_value()?),
                        "bytes_per_group" => bpg = Some(map.next_value()?),
                        "replicated_per_group" => repl = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(KVTransferEngineMetadata {
                    name: name.ok_or_else(|| missing("name"))?,
                    memory_type: mt.ok_or_else(|| missing("memory_type"))?,
                    hostname: host.ok_or_else(|| missing("hostname"))?,
                    agents_meta: agents.ok_or_else(|| missing("agents_meta"))?,
                    leaf_ids: leaves.ok_or_else(|| missing("leaf_ids"))?,
                    num_pages_per_group: pages.ok_or_else(|| missing("num_pages_per_group"))?,
                    bytes_per_page: bpp.ok_or_else(|| missing("bytes_per_page"))?,
                    bytes_per_group: bpg.ok_or_else(|| missing("bytes_per_group"))?,
                    replicated_per_group: repl,
                })
            }
        }
        d.deserialize_any(V)
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

    /// The JSON form, byte-identical to `msgspec.json.encode(metadata)` of MAX's struct.
    pub fn to_json(&self) -> String {
        msgspec::to_json(self)
    }

    /// The msgpack form, byte-identical to `msgspec.msgpack.encode(metadata)`.
    pub fn to_msgpack(&self) -> Vec<u8> {
        msgspec::to_msgpack(self)
    }

    /// Decode and check the msgpack form.
    ///
    /// # Errors
    /// As [`KVTransferEngineMetadata::from_bytes`].
    pub fn from_msgpack(bytes: &[u8]) -> Result<Self, KvError> {
        let m: Self = msgspec::from_msgpack(ENGINE_TAG, bytes)?;
        m.validate()?;
        Ok(m)
    }

    /// The JSON form as bytes (what MAX sends over ZMQ).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_json().into_bytes()
    }

    /// Decode and check the JSON form.
    ///
    /// # Errors
    /// [`KvError::Decode`] (not JSON, truncated, over
    /// [`MAX_ENGINE_METADATA_BYTES`]); [`KvError::Validation`] (wrong tag,
    /// types or enum value, a missing field); [`KvError::BadMetadata`] (see
    /// [`KVTransferEngineMetadata::validate`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KvError> {
        let m: Self = msgspec::from_json(ENGINE_TAG, bytes)?;
        m.validate()?;
        Ok(m)
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
                if !a.region_splits.is_empty() && a.region_splits.len() != g {
                    return bad(format!(
                        "agent {:?} has region_splits for {} groups, the engine has {g}",
                        a.agent_name,
                        a.region_splits.len()
                    ));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KVTransferEngineMetadata {
        let agent = |r, s| TensorAgentMetadata {
            agent_name: agent_name("prefill", r, s),
            metadata: vec![1, 2, 3, 255],
            base_addrs: vec![0x1000, 0x20_0000],
            device_id: 0,
            region_splits: vec![vec![], vec![]],
        };
        KVTransferEngineMetadata {
            name: "prefill".into(),
            memory_type: MemoryType::Dram,
            hostname: "h".into(),
            agents_meta: vec![vec![agent(0, 0), agent(0, 1)], vec![agent(1, 0), agent(1, 1)]],
            leaf_ids: vec!["0".into(), "0/scales".into()],
            num_pages_per_group: vec![10, 10],
            bytes_per_page: 272,
            bytes_per_group: vec![256, 16],
            replicated_per_group: vec![false, false],
        }
    }

    /// The bytes msgspec 0.23 gives for MAX 26.7's struct with one agent
    /// (written down from `msgspec.json.encode`).
    const ONE_AGENT: &str = concat!(
        r#"{"type":"KVTransferEngineMetadata","leaf_ids":["0"],"num_pages_per_group":[4],"#,
        r#""bytes_per_page":16,"bytes_per_group":[16],"replicated_per_group":[false],"name":"p","#,
        r#""memory_type":0,"hostname":"h","agents_meta":[[{"type":"TensorAgentMetadata","#,
        r#""agent_name":"p_0_0","metadata":"AQI=","base_addrs":[4096],"device_id":0,"region_splits":[[]]}]]}"#
    );

    fn one_agent() -> KVTransferEngineMetadata {
        KVTransferEngineMetadata {
            name: "p".into(),
            memory_type: MemoryType::Dram,
            hostname: "h".into(),
            agents_meta: vec![vec![TensorAgentMetadata {
                agent_name: "p_0_0".into(),
                metadata: vec![1, 2],
                base_addrs: vec![4096],
                device_id: 0,
                region_splits: vec![vec![]],
            }]],
            leaf_ids: vec!["0".into()],
            num_pages_per_group: vec![4],
            bytes_per_page: 16,
            bytes_per_group: vec![16],
            replicated_per_group: vec![false],
        }
    }

    #[test]
    fn encodes_like_msgspec_json_and_msgpack() {
        assert_eq!(one_agent().to_json(), ONE_AGENT);
        assert_eq!(KVTransferEngineMetadata::from_json(ONE_AGENT).unwrap(), one_agent());
        let mp = one_agent().to_msgpack();
        // fixmap of 10 entries, then "type" and the class name.
        assert_eq!(&mp[..6], &[0x8a, 0xa4, b't', b'y', b'p', b'e']);
        assert!(mp.windows(4).any(|w| w == [0xc4, 2, 1, 2]), "metadata is a bin");
        assert_eq!(KVTransferEngineMetadata::from_msgpack(&mp).unwrap(), one_agent());
    }

    #[test]
    fn round_trips_and_omits_defaults() {
        let m = sample();
        assert_eq!(KVTransferEngineMetadata::from_bytes(&m.to_bytes()).unwrap(), m);
        let mut m2 = m.clone();
        m2.replicated_per_group.clear();
        m2.agents_meta.iter_mut().flatten().for_each(|a| a.region_splits.clear());
        let j = m2.to_json();
        assert!(!j.contains("replicated_per_group") && !j.contains("region_splits"), "{j}");
        assert_eq!(KVTransferEngineMetadata::from_json(&j).unwrap(), m2);
    }

    #[test]
    fn decodes_as_leniently_as_msgspec() {
        let no_tags = ONE_AGENT
            .replace(r#""type":"KVTransferEngineMetadata","#, "")
            .replace(r#""type":"TensorAgentMetadata","#, "");
        assert_eq!(KVTransferEngineMetadata::from_json(&no_tags).unwrap(), one_agent());
        let dup = ONE_AGENT.replace(r#""hostname":"h""#, r#""hostname":"x","hostname":"h","extra":[{}]"#);
        assert_eq!(KVTransferEngineMetadata::from_json(&dup).unwrap(), one_agent());
        let vram = ONE_AGENT.replace(r#""memory_type":0"#, r#""memory_type":1"#);
        assert_eq!(KVTransferEngineMetadata::from_json(&vram).unwrap().memory_type, MemoryType::Vram);
    }

    #[test]
    fn rejects_inconsistent_or_hostile_metadata() {
        let j = sample().to_json();
        for bad in [
            j.replace("KVTransferEngineMetadata", "TransferReqData"),
            j.replace(r#""metadata":"AQID/w==""#, r#""metadata":"!!""#),
            j.replace(r#""bytes_per_group":[256,16]"#, r#""bytes_per_group":[256]"#),
            j.replace(r#""num_pages_per_group":[10,10]"#, r#""num_pages_per_group":[10,-1]"#),
            j.replace(r#""replicated_per_group":[false,false]"#, r#""replicated_per_group":[false]"#),
            j.replace(r#""region_splits":[[],[]]"#, r#""region_splits":[[]]"#),
            j.replace("prefill_1_1", "prefill_9_9"),
            j.replace(r#""base_addrs":[4096,2097152]"#, r#""base_addrs":[18446744073709551615,1]"#),
            j.replace(r#""memory_type":0"#, r#""memory_type":"DRAM""#),
            j.replace(r#""memory_type":0"#, r#""memory_type":7"#),
            j.replace(r#""memory_type":0"#, r#""memory_type":2"#),
            j.replace(r#""bytes_per_page":272,"#, ""),
            r#"{"type":"KVTransferEngineMetadata"}"#.into(),
            "7".into(),
        ] {
            assert!(KVTransferEngineMetadata::from_json(&bad).is_err(), "accepted {bad}");
        }
        assert!(matches!(KVTransferEngineMetadata::from_json(&j[..40]), Err(KvError::Decode(_))));
        let wrong = j.replace(r#""memory_type":0"#, r#""memory_type":7"#);
        assert!(matches!(KVTransferEngineMetadata::from_json(&wrong), Err(KvError::Validation(_))));
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
