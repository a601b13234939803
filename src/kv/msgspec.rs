//! The encoding rules of msgspec (<https://github.com/jcrist/msgspec>) that
//! MAX's wire structs (`TransferReqData`, `KVTransferEngineMetadata`,
//! `TensorAgentMetadata`: `msgspec.Struct, tag=True, kw_only=True,
//! omit_defaults=True`) follow, shared by their encoders and decoders here.
//!
//! - A struct is a JSON object / msgpack map: `"type": <class name>` first,
//!   then the fields in msgspec's order, fields equal to their default left out.
//! - `int` is any integer in `-2^63..2^64` (msgpack: the shortest encoding,
//!   unsigned when non-negative); a float or a bool is not an `int`.
//! - `bytes` is a standard-base64 string in JSON and a `bin` in msgpack.
//! - Decoding is lenient where msgspec is: a missing `"type"` tag, unknown
//!   fields (skipped), a key given twice (the last wins).
//! - Errors split as msgspec's: [`KvError::Decode`] (`msgspec.DecodeError`:
//!   not JSON / msgpack, truncated, trailing data) and [`KvError::Validation`]
//!   (`msgspec.ValidationError`: a wrong type, a missing field, a wrong tag).

use std::fmt;

use serde::de::{self, DeserializeOwned, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::KvError;

/// Largest encoded struct decoded (bytes), JSON or msgpack.
pub const MAX_ENCODED_BYTES: usize = 64 << 20;

/// A msgspec `int`: any integer in `-2^63 ..= 2^64 - 1` (the range msgpack
/// carries). Encodes unsigned when non-negative, as msgspec does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct MsgInt(pub i128);

impl MsgInt {
    /// Smallest value.
    pub const MIN: i128 = i64::MIN as i128;
    /// Largest value.
    pub const MAX: i128 = u64::MAX as i128;
}

impl Serialize for MsgInt {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 >= 0 {
            s.serialize_u64(u64::try_from(self.0).map_err(serde::ser::Error::custom)?)
        } else {
            s.serialize_i64(i64::try_from(self.0).map_err(serde::ser::Error::custom)?)
        }
    }
}

impl<'de> Deserialize<'de> for MsgInt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = MsgInt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an `int` in -2^63..2^64")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<MsgInt, E> {
                Ok(MsgInt(i128::from(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<MsgInt, E> {
                Ok(MsgInt(i128::from(v)))
            }
            fn visit_i128<E: de::Error>(self, v: i128) -> Result<MsgInt, E> {
                if (MsgInt::MIN..=MsgInt::MAX).contains(&v) {
                    Ok(MsgInt(v))
                } else {
                    Err(E::custom(format_args!("integer {v} is outside -2^63..2^64")))
                }
            }
            fn visit_u128<E: de::Error>(self, v: u128) -> Result<MsgInt, E> {
                self.visit_i128(i128::try_from(v).unwrap_or(i128::MAX))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<MsgInt, E> {
                // serde_json hands integers past u64 over as floats.
                if v.fract() == 0.0 && v.is_finite() {
                    Err(E::custom("integer is outside -2^63..2^64"))
                } else {
                    Err(E::custom("Expected `int`, got `float`"))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// The `bytes` of a msgspec field: base64 text in JSON, `bin` in msgpack.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MsgBytes(pub Vec<u8>);

impl Serialize for MsgBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() { s.serialize_str(&b64::encode(&self.0)) } else { s.serialize_bytes(&self.0) }
    }
}

impl<'de> Deserialize<'de> for MsgBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = MsgBytes;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`bytes` (base64 text in JSON, bin in msgpack)")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<MsgBytes, E> {
                b64::decode(v).map(MsgBytes).map_err(E::custom)
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<MsgBytes, E> {
                Ok(MsgBytes(v.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<MsgBytes, E> {
                Ok(MsgBytes(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// Check a `"type"` tag value against the struct's class name.
pub fn check_tag<E: de::Error>(found: &str, expected: &str) -> Result<(), E> {
    if found == expected { Ok(()) } else { Err(E::custom(format_args!("Invalid value '{found}' - at `$.type`"))) }
}

/// Compact JSON, as `msgspec.json.encode`.
pub fn to_json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("plain data always serializes")
}

/// msgpack, as `msgspec.msgpack.encode`.
pub fn to_msgpack<T: Serialize>(v: &T) -> Vec<u8> {
    let mut out = Vec::new();
    v.serialize(&mut rmp_serde::Serializer::new(&mut out)).expect("plain data always serializes");
    out
}

fn check_len(what: &str, len: usize) -> Result<(), KvError> {
    if len > MAX_ENCODED_BYTES {
        return Err(KvError::Decode(format!("{what} of {len} bytes is too large (most {MAX_ENCODED_BYTES})")));
    }
    Ok(())
}

/// Decode JSON as `msgspec.json.decode(data, type=T)`.
///
/// # Errors
/// [`KvError::Decode`] (not JSON, truncated, trailing data, too large);
/// [`KvError::Validation`] (types, missing fields, tag).
pub fn from_json<T: DeserializeOwned>(what: &str, data: &[u8]) -> Result<T, KvError> {
    check_len(what, data.len())?;
    serde_json::from_slice(data).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => KvError::Validation(format!("{what}: {e}")),
        _ => KvError::Decode(format!("{what}: {e}")),
    })
}

/// Decode msgpack as `msgspec.msgpack.decode(data, type=T)`.
///
/// # Errors
/// As [`from_json`].
pub fn from_msgpack<T: DeserializeOwned>(what: &str, data: &[u8]) -> Result<T, KvError> {
    use rmp_serde::decode::Error as E;
    check_len(what, data.len())?;
    let mut rest = data;
    let mut de = rmp_serde::Deserializer::new(&mut rest);
    let v = T::deserialize(&mut de).map_err(|e| match e {
        E::TypeMismatch(_) | E::OutOfRange | E::LengthMismatch(_) | E::Syntax(_) => {
            KvError::Validation(format!("{what}: {e}"))
        }
        _ => KvError::Decode(format!("{what}: {e}")),
    })?;
    drop(de);
    if !rest.is_empty() {
        return Err(KvError::Decode(format!("{what}: {} trailing bytes after the msgpack object", rest.len())));
    }
    Ok(v)
}

/// Standard base64 with padding (Python's `base64.b64encode`, msgspec's `bytes`).
pub(crate) mod b64 {
    use base64::Engine as _;
    use base64::engine::{GeneralPurpose, GeneralPurposeConfig};

    /// Padding required; unused trailing bits ignored (as Python's
    /// `base64.b64decode` does).
    const ENGINE: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true),
    );

    pub(crate) fn encode(data: &[u8]) -> String {
        ENGINE.encode(data)
    }

    pub(crate) fn decode(text: &str) -> Result<Vec<u8>, String> {
        if !text.len().is_multiple_of(4) {
            return Err(format!("base64 length {} is not a multiple of 4", text.len()));
        }
        ENGINE.decode(text).map_err(|e| match e {
            base64::DecodeError::InvalidByte(_, b'=') | base64::DecodeError::InvalidPadding => {
                "misplaced base64 padding".to_string()
            }
            base64::DecodeError::InvalidByte(_, c) | base64::DecodeError::InvalidLastSymbol(_, c) => {
                format!("invalid base64 byte {c:#x}")
            }
            base64::DecodeError::InvalidLength(n) => format!("base64 length {n} is not a multiple of 4"),
        })
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
            for (bad, why) in [
                ("Zg=", "base64 length 3 is not a multiple of 4"),
                ("Z===", "misplaced base64 padding"),
                ("Zg==Zg==", "misplaced base64 padding"),
                ("====", "misplaced base64 padding"),
                ("Z!==", "invalid base64 byte 0x21"),
                ("Zm9v\n===", "invalid base64 byte 0xa"),
            ] {
                assert_eq!(super::decode(bad).unwrap_err(), why, "{bad:?}");
            }
            // Unused trailing bits are ignored, as Python's b64decode does.
            assert_eq!(super::decode("Zh==").unwrap(), b"f");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_encode_shortest_and_unsigned_when_non_negative() {
        let v = vec![MsgInt(0), MsgInt(127), MsgInt(300), MsgInt(-1), MsgInt(-33), MsgInt(MsgInt::MAX)];
        let mut expect = vec![0x96, 0x00, 0x7f, 0xcd, 0x01, 0x2c, 0xff, 0xd0, 0xdf, 0xcf];
        expect.extend([0xff; 8]);
        assert_eq!(to_msgpack(&v), expect);
        assert_eq!(to_json(&v), "[0,127,300,-1,-33,18446744073709551615]");
        assert_eq!(from_msgpack::<Vec<MsgInt>>("x", &expect).unwrap(), v);
    }

    #[test]
    fn ints_refuse_floats_bools_and_out_of_range() {
        for bad in ["[1.0]", "[true]", "[18446744073709551616]", "[\"1\"]"] {
            assert!(matches!(from_json::<Vec<MsgInt>>("x", bad.as_bytes()), Err(KvError::Validation(_))), "{bad}");
        }
        for bad in ["[1", "[1] x", "nope"] {
            assert!(matches!(from_json::<Vec<MsgInt>>("x", bad.as_bytes()), Err(KvError::Decode(_))), "{bad}");
        }
        // msgpack: a float64, then truncated, then trailing data.
        let f = [0x91, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0];
        assert!(matches!(from_msgpack::<Vec<MsgInt>>("x", &f), Err(KvError::Validation(_))));
        assert!(matches!(from_msgpack::<Vec<MsgInt>>("x", &[0x92, 0x01]), Err(KvError::Decode(_))));
        assert!(matches!(from_msgpack::<Vec<MsgInt>>("x", &[0x91, 0x01, 0x01]), Err(KvError::Decode(_))));
    }

    #[test]
    fn bytes_are_base64_in_json_and_bin_in_msgpack() {
        let b = MsgBytes(vec![1, 2, 255]);
        assert_eq!(to_json(&b), "\"AQL/\"");
        assert_eq!(to_msgpack(&b), [0xc4, 3, 1, 2, 255]);
        assert_eq!(from_msgpack::<MsgBytes>("x", &[0xc4, 3, 1, 2, 255]).unwrap(), b);
        assert_eq!(from_json::<MsgBytes>("x", b"\"AQL/\"").unwrap(), b);
    }
}
