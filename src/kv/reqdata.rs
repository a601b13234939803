//! `TransferReqData`: the record of one KV transfer, sent between processes
//! as JSON or msgpack exactly as MAX 26.7's msgspec struct (`tag=True,
//! kw_only=True, omit_defaults=True`, in
//! `max/pipelines/kv_cache/paged_kv_cache/transfer_engine.py`):
//! `"type": "TransferReqData"` first, then the fields in MAX's order, fields
//! at their default left out. The wire form and the encode/decode methods
//! are in `reqwire` (which builds on this module, never the reverse).

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The msgspec tag value of [`TransferReqData`].
pub const TRANSFER_REQ_DATA_TAG: &str = "TransferReqData";

/// Largest JSON text [`TransferReqData::from_json`] accepts (bytes).
pub const MAX_REQ_JSON_BYTES: usize = super::msgspec::MAX_ENCODED_BYTES;

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
    /// True when no page is to move (the transfer is complete at once).
    pub fn is_empty(&self) -> bool {
        self.src_idxs.is_empty() && self.dst_idxs.is_empty()
    }
}

#[cfg(test)]
#[path = "reqdata_tests.rs"]
mod tests;
