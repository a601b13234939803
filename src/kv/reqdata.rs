//! `TransferReqData`: the record of one KV transfer, sent between processes
//! as JSON exactly as MAX's msgspec struct (`tag=True, kw_only=True,
//! omit_defaults=True`): `"type": "TransferReqData"` first, then the fields
//! in the seed's order, fields at their default left out.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::KvError;

/// The msgspec tag value of [`TransferReqData`].
pub const TRANSFER_REQ_DATA_TAG: &str = "TransferReqData";

/// Largest JSON text [`TransferReqData::from_json`] accepts (bytes).
pub const MAX_REQ_JSON_BYTES: usize = 64 << 20;

/// Page indices of one side of a transfer.
///
/// Two wire forms, both decoded:
/// - `Flat`: `list[int]` (MAX's previous generation, and the seed page): one
///   index list that addresses that page in *every* leaf;
/// - `PerLeaf`: `{leaf_id: list[int]}` (current MAX): each leaf its own list,
///   in insertion order; leaves may differ in length.
///
/// Each form encodes as itself; the engine always records `PerLeaf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageIdxs {
    /// One list for every leaf.
    Flat(Vec<u64>),
    /// `(leaf_id, pages)` in order; leaf ids unique.
    PerLeaf(Vec<(String, Vec<u64>)>),
}

impl Default for PageIdxs {
    fn default() -> Self {
        PageIdxs::PerLeaf(Vec::new())
    }
}

impl PageIdxs {
    /// A per-leaf list from `(leaf, pages)` pairs.
    pub fn per_leaf<S: Into<String>>(pairs: impl IntoIterator<Item = (S, Vec<u64>)>) -> Self {
        PageIdxs::PerLeaf(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// True when no page is named.
    pub fn is_empty(&self) -> bool {
        match self {
            PageIdxs::Flat(v) => v.is_empty(),
            PageIdxs::PerLeaf(m) => m.iter().all(|(_, v)| v.is_empty()),
        }
    }

    /// The pages of `leaf`: the flat list for every leaf, else its entry.
    pub fn get(&self, leaf: &str) -> Option<&[u64]> {
        match self {
            PageIdxs::Flat(v) => Some(v),
            PageIdxs::PerLeaf(m) => m.iter().find(|(k, _)| k == leaf).map(|(_, v)| v.as_slice()),
        }
    }

    /// Total page indices named (flat: counted once).
    pub fn num_pages(&self) -> usize {
        match self {
            PageIdxs::Flat(v) => v.len(),
            PageIdxs::PerLeaf(m) => m.iter().map(|(_, v)| v.len()).sum(),
        }
    }
}

impl From<Vec<u64>> for PageIdxs {
    fn from(v: Vec<u64>) -> Self {
        PageIdxs::Flat(v)
    }
}

impl Serialize for PageIdxs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            PageIdxs::Flat(v) => v.serialize(s),
            PageIdxs::PerLeaf(m) => {
                let mut map = s.serialize_map(Some(m.len()))?;
                for (k, v) in m {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for PageIdxs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PageIdxs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of page indices or a map from leaf id to a list of page indices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PageIdxs, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(x) = seq.next_element::<u64>()? {
                    v.push(x);
                }
                Ok(PageIdxs::Flat(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PageIdxs, A::Error> {
                let mut out: Vec<(String, Vec<u64>)> = Vec::new();
                let mut seen = HashSet::new();
                while let Some((k, v)) = map.next_entry::<String, Vec<u64>>()? {
                    if !seen.insert(k.clone()) {
                        return Err(de::Error::custom(format_args!("duplicate leaf id {k:?}")));
                    }
                    out.push((k, v));
                }
                Ok(PageIdxs::PerLeaf(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// Metadata of one transfer request, as MAX's `TransferReqData` (all 11
/// fields of the seed, in its order). Safe to send between threads and
/// processes: [`TransferReqData::to_json`] / [`TransferReqData::from_json`],
/// or any serde format (the JSON form is the msgspec one).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TransferReqData {
    /// Base name of the destination engine.
    pub dst_name: String,
    /// Base name of the source engine.
    pub src_name: String,
    /// Transfer name: a fresh UUID v4, also the notification payload of every
    /// posted shard request.
    pub transfer_name: String,
    /// One transfer handle per `(src_shard, dst_shard)` pair actually posted,
    /// in pairing order. Only the initiator can use them.
    pub transfer_ids: Vec<u64>,
    /// Source page indices. Their count is independent of `transfer_ids`.
    pub src_idxs: PageIdxs,
    /// Destination page indices.
    pub dst_idxs: PageIdxs,
    /// DP replica on the source engine.
    pub src_replica_idx: usize,
    /// DP replica on the destination engine.
    pub dst_replica_idx: usize,
    /// True for a READ (pull) started by the destination. Default false.
    pub is_read: bool,
    /// Shard requests posted (`len(transfer_ids)`); the passive side waits
    /// for this many notifications. 0 (default) = all shards of the passive
    /// side's replica.
    pub tp_shard_count: usize,
    /// Initiator's TP shard owning each `transfer_ids[i]`; may repeat.
    /// Empty (default) = shards `0..n-1` of the recorded replica.
    pub local_shards_used: Vec<usize>,
}

impl TransferReqData {
    /// The msgspec JSON form (compact).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain data always serializes")
    }

    /// [`TransferReqData::to_json`] as bytes (what `msgspec.json.encode` returns).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_json().into_bytes()
    }

    /// Decode the msgspec JSON form (either page-index form; unknown fields
    /// ignored, as msgspec does).
    ///
    /// # Errors
    /// [`KvError::Decode`]: not JSON, a missing or wrong `"type"` tag, a
    /// missing field, a wrong type, a negative or out-of-range number, a
    /// duplicate leaf id, `local_shards_used` not parallel to `transfer_ids`,
    /// text over [`MAX_REQ_JSON_BYTES`]. Never panics.
    pub fn from_json(text: &str) -> Result<Self, KvError> {
        Self::from_bytes(text.as_bytes())
    }

    /// [`TransferReqData::from_json`] from bytes.
    ///
    /// # Errors
    /// As [`TransferReqData::from_json`] (also: not UTF-8).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KvError> {
        if bytes.len() > MAX_REQ_JSON_BYTES {
            return Err(KvError::Decode(format!("TransferReqData of {} bytes is too large", bytes.len())));
        }
        serde_json::from_slice(bytes).map_err(|e| KvError::Decode(e.to_string()))
    }

    /// True when no page is to move (the transfer is complete at once).
    pub fn is_empty(&self) -> bool {
        self.src_idxs.is_empty() && self.dst_idxs.is_empty()
    }
}

impl Serialize for TransferReqData {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let n = 9
            + usize::from(self.is_read)
            + usize::from(self.tp_shard_count != 0)
            + usize::from(!self.local_shards_used.is_empty());
        let mut st = s.serialize_struct(TRANSFER_REQ_DATA_TAG, n)?;
        st.serialize_field("type", TRANSFER_REQ_DATA_TAG)?;
        st.serialize_field("dst_name", &self.dst_name)?;
        st.serialize_field("src_name", &self.src_name)?;
        st.serialize_field("transfer_name", &self.transfer_name)?;
        st.serialize_field("transfer_ids", &self.transfer_ids)?;
        st.serialize_field("src_idxs", &self.src_idxs)?;
        st.serialize_field("dst_idxs", &self.dst_idxs)?;
        st.serialize_field("src_replica_idx", &self.src_replica_idx)?;
        st.serialize_field("dst_replica_idx", &self.dst_replica_idx)?;
        if self.is_read {
            st.serialize_field("is_read", &true)?;
        }
        if self.tp_shard_count != 0 {
            st.serialize_field("tp_shard_count", &self.tp_shard_count)?;
        }
        if !self.local_shards_used.is_empty() {
            st.serialize_field("local_shards_used", &self.local_shards_used)?;
        }
        st.end()
    }
}

#[derive(Deserialize)]
struct Wire {
    #[serde(rename = "type")]
    tag: String,
    dst_name: String,
    src_name: String,
    transfer_name: String,
    transfer_ids: Vec<u64>,
    src_idxs: PageIdxs,
    dst_idxs: PageIdxs,
    src_replica_idx: usize,
    dst_replica_idx: usize,
    #[serde(default)]
    is_read: bool,
    #[serde(default)]
    tp_shard_count: usize,
    #[serde(default)]
    local_shards_used: Vec<usize>,
}

impl<'de> Deserialize<'de> for TransferReqData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        if w.tag != TRANSFER_REQ_DATA_TAG {
            return Err(de::Error::custom(format_args!(
                "expected \"type\": {TRANSFER_REQ_DATA_TAG:?}, found {:?}",
                w.tag
            )));
        }
        if !w.local_shards_used.is_empty() && w.local_shards_used.len() != w.transfer_ids.len() {
            return Err(de::Error::custom(format_args!(
                "local_shards_used has {} entries for {} transfer_ids",
                w.local_shards_used.len(),
                w.transfer_ids.len()
            )));
        }
        Ok(TransferReqData {
            dst_name: w.dst_name,
            src_name: w.src_name,
            transfer_name: w.transfer_name,
            transfer_ids: w.transfer_ids,
            src_idxs: w.src_idxs,
            dst_idxs: w.dst_idxs,
            src_replica_idx: w.src_replica_idx,
            dst_replica_idx: w.dst_replica_idx,
            is_read: w.is_read,
            tp_shard_count: w.tp_shard_count,
            local_shards_used: w.local_shards_used,
        })
    }
}

#[cfg(test)]
#[path = "reqdata_tests.rs"]
mod tests;
