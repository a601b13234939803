//! [`WireTransferReqData`]: `TransferReqData` exactly as MAX 26.7 declares it
//! (`max/pipelines/kv_cache/paged_kv_cache/transfer_engine.py`, a
//! `msgspec.Struct, tag=True, kw_only=True, omit_defaults=True`), holding
//! every value msgspec's decoder accepts for it: negative replica indices,
//! negative or 64-bit-unsigned ids, `dst_idxs` leaves in any number. Its
//! checks happen at use ([`TryFrom`] into [`TransferReqData`]), as in MAX,
//! where a bad index raises `ValueError` only when an engine is handed it.
//!
//! Encodings: JSON (`msgspec.json.encode`) and msgpack
//! (`msgspec.msgpack.encode`, what MAX's ZMQ sockets carry), byte for byte.

use std::fmt;

use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::KvError;
use super::msgspec::{self, MsgInt, check_tag};
use super::reqdata::{PageIdxs, TRANSFER_REQ_DATA_TAG, TransferReqData};

/// Page indices as msgspec holds them.
///
/// `PerLeaf` is MAX 26.7's `dict[str, list[int]]`, the only form decoded;
/// `Flat` (one `list[int]` for every leaf, MAX's earlier generation) can be
/// built and encoded, as a msgspec struct holds whatever its constructor got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireIdxs {
    /// One list for every leaf.
    Flat(Vec<MsgInt>),
    /// `(leaf_id, pages)` in first-seen key order; a key given twice keeps its last value.
    PerLeaf(Vec<(String, Vec<MsgInt>)>),
}

impl Default for WireIdxs {
    fn default() -> Self {
        WireIdxs::PerLeaf(Vec::new())
    }
}

impl Serialize for WireIdxs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            WireIdxs::Flat(v) => v.serialize(s),
            WireIdxs::PerLeaf(m) => {
                let mut map = s.serialize_map(Some(m.len()))?;
                for (k, v) in m {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for WireIdxs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireIdxs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an `object` (dict[str, list[int]])")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireIdxs, A::Error> {
                let mut out: Vec<(String, Vec<MsgInt>)> = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Vec<MsgInt>>()? {
                    match out.iter_mut().find(|(key, _)| *key == k) {
                        Some(slot) => slot.1 = v,
                        None => out.push((k, v)),
                    }
                }
                Ok(WireIdxs::PerLeaf(out))
            }
        }
        d.deserialize_any(V)
    }
}

impl From<&PageIdxs> for WireIdxs {
    fn from(p: &PageIdxs) -> Self {
        let ints = |v: &[u64]| v.iter().map(|&x| MsgInt(i128::from(x))).collect();
        match p {
            PageIdxs::Flat(v) => WireIdxs::Flat(ints(v)),
            PageIdxs::PerLeaf(m) => WireIdxs::PerLeaf(m.iter().map(|(k, v)| (k.clone(), ints(v))).collect()),
        }
    }
}

/// MAX 26.7's `TransferReqData`, field for field (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WireTransferReqData {
    /// Base name of the destination engine.
    pub dst_name: String,
    /// Base name of the source engine.
    pub src_name: String,
    /// Transfer name.
    pub transfer_name: String,
    /// Transfer handles (one per posted TP shard pair).
    pub transfer_ids: Vec<MsgInt>,
    /// Source page indices, keyed by leaf id.
    pub src_idxs: WireIdxs,
    /// Destination page indices, keyed by leaf id.
    pub dst_idxs: WireIdxs,
    /// Source DP replica.
    pub src_replica_idx: MsgInt,
    /// Destination DP replica.
    pub dst_replica_idx: MsgInt,
    /// READ (pull) started by the destination. Default false.
    pub is_read: bool,
    /// Shard requests posted; 0 (default) = all shards.
    pub tp_shard_count: MsgInt,
    /// Initiator shard of each transfer id; empty (default) = all shards.
    pub local_shards_used: Vec<MsgInt>,
}

impl WireTransferReqData {
    /// `msgspec.json.encode(req)`.
    pub fn to_json(&self) -> String {
        msgspec::to_json(self)
    }

    /// `msgspec.msgpack.encode(req)`.
    pub fn to_msgpack(&self) -> Vec<u8> {
        msgspec::to_msgpack(self)
    }

    /// `msgspec.json.decode(data, type=TransferReqData)`.
    ///
    /// # Errors
    /// [`KvError::Decode`] (malformed, truncated, trailing data, over
    /// [`msgspec::MAX_ENCODED_BYTES`]); [`KvError::Validation`] (a missing
    /// field, a wrong type or tag, an integer outside `-2^63..2^64`).
    pub fn from_json(data: &[u8]) -> Result<Self, KvError> {
        msgspec::from_json(TRANSFER_REQ_DATA_TAG, data)
    }

    /// `msgspec.msgpack.decode(data, type=TransferReqData)`.
    ///
    /// # Errors
    /// As [`WireTransferReqData::from_json`].
    pub fn from_msgpack(data: &[u8]) -> Result<Self, KvError> {
        msgspec::from_msgpack(TRANSFER_REQ_DATA_TAG, data)
    }
}

impl From<&TransferReqData> for WireTransferReqData {
    fn from(r: &TransferReqData) -> Self {
        let int = |x: usize| MsgInt(x as i128);
        WireTransferReqData {
            dst_name: r.dst_name.clone(),
            src_name: r.src_name.clone(),
            transfer_name: r.transfer_name.clone(),
            transfer_ids: r.transfer_ids.iter().map(|&x| MsgInt(i128::from(x))).collect(),
            src_idxs: (&r.src_idxs).into(),
            dst_idxs: (&r.dst_idxs).into(),
            src_replica_idx: int(r.src_replica_idx),
            dst_replica_idx: int(r.dst_replica_idx),
            is_read: r.is_read,
            tp_shard_count: int(r.tp_shard_count),
            local_shards_used: r.local_shards_used.iter().map(|&x| int(x)).collect(),
        }
    }
}

fn non_negative<T: TryFrom<i128>>(what: &str, v: MsgInt) -> Result<T, KvError> {
    T::try_from(v.0).map_err(|_| KvError::InvalidRequest(format!("{what} {} must be >= 0", v.0)))
}

fn idxs_at_use(side: &str, w: &WireIdxs) -> Result<PageIdxs, KvError> {
    let list = |leaf: &str, v: &[MsgInt]| -> Result<Vec<u64>, KvError> {
        v.iter().map(|&x| non_negative(&format!("{side} index of leaf {leaf:?}"), x)).collect()
    };
    Ok(match w {
        WireIdxs::Flat(v) => PageIdxs::Flat(list("*", v)?),
        WireIdxs::PerLeaf(m) => {
            PageIdxs::PerLeaf(m.iter().map(|(k, v)| Ok((k.clone(), list(k, v)?))).collect::<Result<_, KvError>>()?)
        }
    })
}

impl TryFrom<&WireTransferReqData> for TransferReqData {
    type Error = KvError;
    /// The checks MAX makes when an engine uses a request.
    ///
    /// # Errors
    /// [`KvError::InvalidRequest`]: a negative replica index, page index,
    /// shard or count, a transfer id outside `0..2^64`, `local_shards_used`
    /// not parallel to `transfer_ids`.
    fn try_from(w: &WireTransferReqData) -> Result<Self, KvError> {
        if !w.local_shards_used.is_empty() && w.local_shards_used.len() != w.transfer_ids.len() {
            return Err(KvError::InvalidRequest(format!(
                "local_shards_used has {} entries for {} transfer_ids",
                w.local_shards_used.len(),
                w.transfer_ids.len()
            )));
        }
        Ok(TransferReqData {
            dst_name: w.dst_name.clone(),
            src_name: w.src_name.clone(),
            transfer_name: w.transfer_name.clone(),
            transfer_ids: w.transfer_ids.iter().map(|&x| non_negative("transfer id", x)).collect::<Result<_, _>>()?,
            src_idxs: idxs_at_use("Source", &w.src_idxs)?,
            dst_idxs: idxs_at_use("Destination", &w.dst_idxs)?,
            src_replica_idx: non_negative("src_replica_idx", w.src_replica_idx)?,
            dst_replica_idx: non_negative("dst_replica_idx", w.dst_replica_idx)?,
            is_read: w.is_read,
            tp_shard_count: non_negative("tp_shard_count", w.tp_shard_count)?,
            local_shards_used: w
                .local_shards_used
                .iter()
                .map(|&x| non_negative("local shard", x))
                .collect::<Result<_, _>>()?,
        })
    }
}

impl Serialize for WireTransferReqData {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let n = 9
            + usize::from(self.is_read)
            + usize::from(self.tp_shard_count.0 != 0)
            + usize::from(!self.local_shards_used.is_empty());
        let mut m = s.serialize_map(Some(n))?;
        m.serialize_entry("type", TRANSFER_REQ_DATA_TAG)?;
        m.serialize_entry("dst_name", &self.dst_name)?;
        m.serialize_entry("src_name", &self.src_name)?;
        m.serialize_entry("transfer_name", &self.transfer_name)?;
        m.serialize_entry("transfer_ids", &self.transfer_ids)?;
        m.serialize_entry("src_idxs", &self.src_idxs)?;
        m.serialize_entry("dst_idxs", &self.dst_idxs)?;
        m.serialize_entry("src_replica_idx", &self.src_replica_idx)?;
        m.serialize_entry("dst_replica_idx", &self.dst_replica_idx)?;
        if self.is_read {
            m.serialize_entry("is_read", &true)?;
        }
        if self.tp_shard_count.0 != 0 {
            m.serialize_entry("tp_shard_count", &self.tp_shard_count)?;
        }
        if !self.local_shards_used.is_empty() {
            m.serialize_entry("local_shards_used", &self.local_shards_used)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for WireTransferReqData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireTransferReqData;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an `object` (TransferReqData)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireTransferReqData, A::Error> {
                let (mut dst, mut src, mut tname, mut ids) = (None, None, None, None);
                let (mut sidx, mut didx, mut srep, mut drep) = (None, None, None, None);
                let mut r = WireTransferReqData::default();
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "type" => check_tag(&map.next_value::<String>()?, TRANSFER_REQ_DATA_TAG)?,
                        "dst_name" => dst = Some(map.next_value()?),
                        "src_name" => src = Some(map.next_value()?),
                        "transfer_name" => tname = Some(map.next_value()?),
                        "transfer_ids" => ids = Some(map.next_value()?),
                        "src_idxs" => sidx = Some(map.next_value()?),
                        "dst_idxs" => didx = Some(map.next_value()?),
                        "src_replica_idx" => srep = Some(map.next_value()?),
                        "dst_replica_idx" => drep = Some(map.next_value()?),
                        "is_read" => r.is_read = map.next_value()?,
                        "tp_shard_count" => r.tp_shard_count = map.next_value()?,
                        "local_shards_used" => r.local_shards_used = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                let need = |f: &'static str| de::Error::custom(format_args!("Object missing required field `{f}`"));
                r.dst_name = dst.ok_or_else(|| need("dst_name"))?;
                r.src_name = src.ok_or_else(|| need("src_name"))?;
                r.transfer_name = tname.ok_or_else(|| need("transfer_name"))?;
                r.transfer_ids = ids.ok_or_else(|| need("transfer_ids"))?;
                r.src_idxs = sidx.ok_or_else(|| need("src_idxs"))?;
                r.dst_idxs = didx.ok_or_else(|| need("dst_idxs"))?;
                r.src_replica_idx = srep.ok_or_else(|| need("src_replica_idx"))?;
                r.dst_replica_idx = drep.ok_or_else(|| need("dst_replica_idx"))?;
                Ok(r)
            }
        }
        d.deserialize_any(V)
    }
}

// ---- TransferReqData's wire methods (here, so reqdata never imports reqwire) ----

impl TransferReqData {
    /// The msgspec JSON form (compact), as `msgspec.json.encode(req)`.
    pub fn to_json(&self) -> String {
        WireTransferReqData::from(self).to_json()
    }

    /// [`TransferReqData::to_json`] as bytes (what `msgspec.json.encode` returns).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_json().into_bytes()
    }

    /// The msgpack form, byte-identical to `msgspec.msgpack.encode(req)`
    /// (what MAX sends over ZMQ).
    pub fn to_msgpack(&self) -> Vec<u8> {
        WireTransferReqData::from(self).to_msgpack()
    }

    /// Decode the msgspec JSON form, accepting what msgspec accepts for MAX
    /// 26.7's struct (a missing `"type"` tag, unknown fields, a key given
    /// twice: the last wins), then make the checks of use.
    ///
    /// # Errors
    /// [`KvError::Decode`] (not JSON, truncated, trailing data, over
    /// [`MAX_REQ_JSON_BYTES`]); [`KvError::Validation`] (a wrong tag or type,
    /// a missing field, `src_idxs` not a `dict`); [`KvError::InvalidRequest`]
    /// (a negative index or replica, `local_shards_used` not parallel to
    /// `transfer_ids`). Never panics.
    pub fn from_json(text: &str) -> Result<Self, KvError> {
        Self::from_bytes(text.as_bytes())
    }

    /// [`TransferReqData::from_json`] from bytes.
    ///
    /// # Errors
    /// As [`TransferReqData::from_json`] (also: not UTF-8).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KvError> {
        (&WireTransferReqData::from_json(bytes)?).try_into()
    }

    /// Decode the msgpack form (`msgspec.msgpack.decode(data, type=TransferReqData)`).
    ///
    /// # Errors
    /// As [`TransferReqData::from_json`].
    pub fn from_msgpack(bytes: &[u8]) -> Result<Self, KvError> {
        (&WireTransferReqData::from_msgpack(bytes)?).try_into()
    }
}

impl Serialize for TransferReqData {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        WireTransferReqData::from(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for TransferReqData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = WireTransferReqData::deserialize(d)?;
        (&w).try_into().map_err(de::Error::custom)
    }
}
