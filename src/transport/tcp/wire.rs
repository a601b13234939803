//! The `tcp` wire format: fixed 24-byte little-endian frame headers, then a
//! bounded body. Version 4.
//!
//! ```text
//! header  = kind:u8 flags:u8 reserved:u16 count:u32 id:u64 len:u64   (24 bytes)
//! CHALLENGE s→c  first frame of every connection: count = NONCE_BYTES, id = MAGIC_VERSION; body: nonce
//! HELLO     c→s  count = name bytes (1..=255), id = MAGIC_VERSION,
//!                len = generation << 16 | connection index (see [`hello_slot`]);
//!                body: name, then PROOF_BYTES of `auth::prove(target secret, nonce, proof_context(name))`,
//!                then NONCE_BYTES of the initiator's own nonce
//! HELLO_ACK s→c  id = MAGIC_VERSION, count = PROOF_BYTES (the proof was right; anything else is
//!                refused with RESP status DENIED and the connection closed); body: the
//!                target's proof `auth::prove(target secret, initiator nonce, ack_context(name, nonce))`,
//!                checked by the initiator before it sends a request: a process that took
//!                over the target's address without its secret gets no byte of data
//! WRITE     c→s  count = segments (1..=MAX_SEGMENTS), id = request id, len = data bytes
//!                body: count × SegmentDesc (20 bytes), then `len` data bytes
//! READ      c→s  as WRITE without the data
//! NOTIFY    c→s  count = payload bytes (0..=MAX_NOTIFICATION_BYTES), id = request id; body: payload
//! FENCE     c→s  count = entries (1..=MAX_FENCE_ENTRIES), id = request id; body: count × u64
//!                generations: the initiator cut those connections of its agent and session;
//!                the target stops taking data from them and answers RESP OK once none can
//!                write into its memory any more
//! RESP      s→c  count = status, id = request id, len = body bytes:
//!                status OK: READ data (`len` = the request's `len`), else nothing;
//!                status ≠ OK: a UTF-8 reason of at most MAX_REASON_BYTES
//! ```
//! Statuses are typed ([`Status`]): unknown key, out of bounds, denied and
//! protocol errors map one to one onto [`crate::transport::FailureKind`]s,
//! so no side parses the reason text.
//! Every length a peer sends is checked against a limit before anything is
//! allocated or read, so a hostile or buggy peer cannot make either side
//! allocate more than [`MAX_SEGMENTS`] × 20 bytes per request.

/// `b"KVWT"` in the high 32 bits, the protocol version in the low 16.
pub const MAGIC_VERSION: u64 = (0x4B56_5754u64 << 32) | PROTOCOL_VERSION as u64;
/// Wire protocol version (2: challenge/response authentication, typed
/// statuses; 3: the target proves the secret back in its hello ack; 4: a
/// hello names its connection's generation, and FENCE).
pub const PROTOCOL_VERSION: u16 = 4;
/// Size of a frame header (bytes).
pub const HEADER_BYTES: usize = 24;
/// Size of one segment descriptor on the wire (bytes).
pub const SEGMENT_DESC_BYTES: usize = 20;
/// Most segments in one request: the `IOV_MAX` of Linux, so one request's
/// data moves with `readv`/`sendmsg` calls of at most this many entries.
pub const MAX_SEGMENTS: u32 = 1024;
/// Most data bytes in one request (64 MiB).
pub const MAX_REQUEST_BYTES: u64 = 64 << 20;
/// Largest notification payload (bytes): the same on every backend.
pub const MAX_NOTIFICATION_BYTES: u32 = crate::transport::MAX_NOTIFICATION_BYTES as u32;
/// Bytes of the challenge nonce.
pub const NONCE_BYTES: u32 = crate::transport::auth::NONCE_BYTES as u32;
/// Bytes of the proof that follows the name in a hello.
pub const PROOF_BYTES: usize = crate::transport::auth::PROOF_BYTES;
/// Longest agent name in a hello (bytes).
pub const MAX_NAME_BYTES: u32 = 255;
/// Longest error reason in a response (bytes).
pub const MAX_REASON_BYTES: u64 = 1024;
/// Most entries in one FENCE (connections cut and not yet fenced, over
/// every connect of one transport to one target).
pub const MAX_FENCE_ENTRIES: u32 = 256;
/// Bytes of one FENCE entry.
pub const FENCE_ENTRY_BYTES: usize = 8;

/// A hello's `len`: connection `index` (< 2^16) opened with `generation`.
/// Generations come from one process-wide counter: each names one
/// connection of its session, which is what a FENCE entry names.
pub fn hello_slot(index: u64, generation: u64) -> u64 {
    generation << 16 | (index & 0xffff)
}

/// Split a [`hello_slot`] value into (index, generation).
pub fn split_slot(v: u64) -> (u64, u64) {
    (v & 0xffff, v >> 16)
}

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Initiator introduces itself.
    Hello = 1,
    /// Target accepts the hello.
    HelloAck = 2,
    /// Data from the initiator into target memory.
    Write = 3,
    /// Data from target memory to the initiator.
    Read = 4,
    /// A notification, sent after the transfer's data.
    Notify = 5,
    /// The target's answer to any request.
    Resp = 6,
    /// The target's nonce, first frame of every connection.
    Challenge = 7,
    /// Connections the initiator cut: the target takes no more data from
    /// them before it answers.
    Fence = 8,
}

/// The context a hello's proof is bound to: the backend and the connecting
/// agent's name, so a proof for one agent cannot be replayed for another.
pub fn proof_context(name: &[u8]) -> Vec<u8> {
    let mut c = b"tcp/".to_vec();
    c.extend_from_slice(name);
    c
}

/// The context of the target's proof in a hello ack: the hello's name
/// bytes (name, NUL, session) and the target's own challenge nonce, so an
/// ack answers one hello on one connection.
pub fn ack_context(name: &[u8], target_nonce: &crate::transport::auth::Nonce) -> Vec<u8> {
    let mut c = b"tcp-ack/".to_vec();
    c.extend_from_slice(name);
    c.extend_from_slice(&target_nonce.0);
    c
}

/// Response status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Done.
    Ok = 0,
    /// A segment named a key the target has not registered (or no longer);
    /// nothing was accessed.
    UnknownKey = 1,
    /// The request broke the protocol.
    Protocol = 2,
    /// A segment left the region its key names; nothing was accessed.
    OutOfBounds = 3,
    /// The hello's proof was missing or wrong; nothing is served.
    Denied = 4,
    /// A bounded queue of the target (its notification queue) is full; the
    /// notification was not queued.
    Overloaded = 5,
    /// The hello's agent name belongs to a peer that is connected now
    /// under another session; nothing is served.
    NameInUse = 6,
}

/// A hello's name field may end with a NUL and the initiator's 8-byte
/// session (random per transport, the same on each of its connections; the
/// proof covers it): a name is held by one session at a time. Without the
/// suffix the session is 0.
pub const SESSION_SUFFIX_BYTES: u32 = 9;

/// Split a hello's name field into the agent name and the session; `None`
/// when a NUL is present but not followed by exactly 8 bytes.
pub fn split_session(field: &[u8]) -> Option<(&[u8], u64)> {
    match field.iter().position(|&b| b == 0) {
        None => Some((field, 0)),
        Some(at) if field.len() - at == SESSION_SUFFIX_BYTES as usize => {
            Some((&field[..at], u64::from_le_bytes(field[at + 1..].try_into().ok()?)))
        }
        Some(_) => None,
    }
}

impl Status {
    /// The largest status value.
    pub const MAX: u32 = Status::NameInUse as u32;

    fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Ok),
            1 => Some(Self::UnknownKey),
            2 => Some(Self::Protocol),
            3 => Some(Self::OutOfBounds),
            4 => Some(Self::Denied),
            5 => Some(Self::Overloaded),
            6 => Some(Self::NameInUse),
            _ => None,
        }
    }
}

/// Errors decoding frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Unknown frame kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Nonzero flags or reserved bits.
    #[error("reserved header bits set")]
    Reserved,
    /// The peer speaks another magic or version.
    #[error("bad magic/version {0:#x} (expected {MAGIC_VERSION:#x})")]
    Version(u64),
    /// A length or count over its limit, or inconsistent with the kind.
    #[error("{what} {value} out of range (limit {limit})")]
    Limit {
        /// Which field.
        what: &'static str,
        /// The value received.
        value: u64,
        /// The largest allowed.
        limit: u64,
    },
    /// Segment lengths do not add up to the header's data length.
    #[error("segments add up to {sum} bytes, header says {len}")]
    LengthMismatch {
        /// Sum of the segment lengths.
        sum: u64,
        /// The header's length.
        len: u64,
    },
    /// A body of the wrong size was handed to a decoder.
    #[error("body of {0} bytes has the wrong size")]
    BodySize(usize),
}

/// A decoded frame header. Construct with the `*_header` helpers or
/// [`Header::decode`], which enforces every limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Kind-specific count (segments, payload bytes, status).
    pub count: u32,
    /// Request id (or magic/version in hellos).
    pub id: u64,
    /// Kind-specific length (data bytes, connection index).
    pub len: u64,
}

fn limit(what: &'static str, value: u64, max: u64) -> Result<(), WireError> {
    if value > max { Err(WireError::Limit { what, value, limit: max }) } else { Ok(()) }
}

impl Header {
    /// Encode into 24 bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0] = self.kind as u8;
        b[4..8].copy_from_slice(&self.count.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decode and check a header against every limit of its kind.
    ///
    /// # Errors
    /// [`WireError`] naming the broken rule.
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Self, WireError> {
        let kind = match b[0] {
            1 => Kind::Hello,
            2 => Kind::HelloAck,
            3 => Kind::Write,
            4 => Kind::Read,
            5 => Kind::Notify,
            6 => Kind::Resp,
            7 => Kind::Challenge,
            8 => Kind::Fence,
            k => return Err(WireError::UnknownKind(k)),
        };
        if b[1..4] != [0, 0, 0] {
            return Err(WireError::Reserved);
        }
        let count = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let id = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        match kind {
            Kind::Hello => {
                if id != MAGIC_VERSION {
                    return Err(WireError::Version(id));
                }
                if count == 0 {
                    return Err(WireError::Limit { what: "name bytes", value: 0, limit: MAX_NAME_BYTES as u64 });
                }
                limit("name bytes", count as u64, (MAX_NAME_BYTES + SESSION_SUFFIX_BYTES) as u64)?;
                limit("connection index", split_slot(len).0, super::MAX_CONNS_PER_PEER as u64 - 1)?;
            }
            Kind::Challenge => {
                if id != MAGIC_VERSION {
                    return Err(WireError::Version(id));
                }
                if count != NONCE_BYTES {
                    return Err(WireError::Limit {
                        what: "nonce bytes",
                        value: count as u64,
                        limit: NONCE_BYTES as u64,
                    });
                }
                limit("challenge length", len, 0)?;
            }
            Kind::HelloAck => {
                if id != MAGIC_VERSION {
                    return Err(WireError::Version(id));
                }
                if count as usize != PROOF_BYTES {
                    return Err(WireError::Limit {
                        what: "hello-ack proof bytes",
                        value: count as u64,
                        limit: PROOF_BYTES as u64,
                    });
                }
                limit("hello-ack length", len, 0)?;
            }
            Kind::Write | Kind::Read => {
                if count == 0 {
                    return Err(WireError::Limit { what: "segments", value: 0, limit: MAX_SEGMENTS as u64 });
                }
                limit("segments", count as u64, MAX_SEGMENTS as u64)?;
                limit("request bytes", len, MAX_REQUEST_BYTES)?;
            }
            Kind::Notify => {
                limit("notification bytes", count as u64, MAX_NOTIFICATION_BYTES as u64)?;
                limit("notify length", len, 0)?;
            }
            Kind::Fence => {
                if count == 0 {
                    return Err(WireError::Limit { what: "fence entries", value: 0, limit: MAX_FENCE_ENTRIES as u64 });
                }
                limit("fence entries", count as u64, MAX_FENCE_ENTRIES as u64)?;
                limit("fence length", len, 0)?;
            }
            Kind::Resp => {
                let status = Status::from_u32(count).ok_or(WireError::Limit {
                    what: "status",
                    value: count as u64,
                    limit: Status::MAX as u64,
                })?;
                let max = if status == Status::Ok { MAX_REQUEST_BYTES } else { MAX_REASON_BYTES };
                limit("response bytes", len, max)?;
            }
        }
        Ok(Self { kind, count, id, len })
    }

    /// The status of a [`Kind::Resp`] header (decoded headers always have one).
    pub fn status(&self) -> Status {
        Status::from_u32(self.count).unwrap_or(Status::Protocol)
    }

    /// Bytes of body that follow this header before any data: segment
    /// descriptors, a name and proof, a nonce, a payload or a reason.
    pub fn body_bytes(&self) -> usize {
        match self.kind {
            Kind::Write | Kind::Read => self.count as usize * SEGMENT_DESC_BYTES,
            Kind::Hello => self.count as usize + PROOF_BYTES + NONCE_BYTES as usize,
            Kind::Notify | Kind::Challenge | Kind::HelloAck => self.count as usize,
            Kind::Fence => self.count as usize * FENCE_ENTRY_BYTES,
            Kind::Resp if self.status() != Status::Ok => self.len as usize,
            Kind::Resp => 0,
        }
    }
}

/// A segment as a request names it: target memory by key and address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentDesc {
    /// Remote key of the target registration.
    pub rkey: u32,
    /// Target virtual address (bytes).
    pub addr: u64,
    /// Length (bytes).
    pub len_bytes: u64,
}

/// Append the 20-byte encodings of `segs` to `out`.
pub fn encode_segments(segs: impl IntoIterator<Item = SegmentDesc>, out: &mut Vec<u8>) {
    for s in segs {
        out.extend_from_slice(&s.rkey.to_le_bytes());
        out.extend_from_slice(&s.addr.to_le_bytes());
        out.extend_from_slice(&s.len_bytes.to_le_bytes());
    }
}

/// Decode the segment list of a WRITE/READ whose header is `h` and check that
/// the lengths add up to `h.len` without overflow. Zero-length segments are
/// refused.
///
/// # Errors
/// [`WireError::BodySize`], [`WireError::Limit`], [`WireError::LengthMismatch`].
pub fn decode_segments(h: &Header, body: &[u8], out: &mut Vec<SegmentDesc>) -> Result<(), WireError> {
    if body.len() != h.body_bytes() || !matches!(h.kind, Kind::Write | Kind::Read) {
        return Err(WireError::BodySize(body.len()));
    }
    out.clear();
    let mut sum = 0u64;
    for c in body.chunks_exact(SEGMENT_DESC_BYTES) {
        let s = SegmentDesc {
            rkey: u32::from_le_bytes(c[0..4].try_into().expect("4 bytes")),
            addr: u64::from_le_bytes(c[4..12].try_into().expect("8 bytes")),
            len_bytes: u64::from_le_bytes(c[12..20].try_into().expect("8 bytes")),
        };
        if s.len_bytes == 0 {
            return Err(WireError::Limit { what: "segment bytes", value: 0, limit: MAX_REQUEST_BYTES });
        }
        sum = sum.checked_add(s.len_bytes).ok_or(WireError::LengthMismatch { sum: u64::MAX, len: h.len })?;
        out.push(s);
    }
    if sum != h.len {
        return Err(WireError::LengthMismatch { sum, len: h.len });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
