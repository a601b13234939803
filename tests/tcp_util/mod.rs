//! Helpers shared by the `tcp_*` test files: a raw client that speaks the
//! tcp wire protocol by hand (so tests can send what the transport never
//! would), and waiting for completions.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvwire::transport::auth::{self, AgentSecret, Nonce};
use kvwire::transport::tcp::{TcpConnectionInfo, wire};
use kvwire::transport::{Completion, Transport, TransportConfig};

pub(crate) fn cfg(timeout_ms: u64) -> TransportConfig {
    TransportConfig { peer_timeout: Duration::from_millis(timeout_ms), ..Default::default() }
}

/// Read the target's challenge from a fresh connection.
pub(crate) fn read_challenge(s: &mut TcpStream) -> Nonce {
    let mut b = [0u8; wire::HEADER_BYTES];
    s.read_exact(&mut b).unwrap();
    let h = wire::Header::decode(&b).unwrap();
    assert_eq!(h.kind, wire::Kind::Challenge, "the first frame of a connection is the challenge");
    let mut n = Nonce([0; auth::NONCE_BYTES]);
    s.read_exact(&mut n.0).unwrap();
    n
}

/// The initiator nonce the raw clients send in their hellos.
pub(crate) const CLIENT_NONCE: Nonce = Nonce([0x5a; auth::NONCE_BYTES]);

/// A hello frame for `name` carrying `proof` (and [`CLIENT_NONCE`]).
pub(crate) fn hello_frame(name: &[u8], proof: &[u8]) -> Vec<u8> {
    let h = wire::Header { kind: wire::Kind::Hello, count: name.len() as u32, id: wire::MAGIC_VERSION, len: 0 };
    let mut f = h.encode().to_vec();
    f.extend_from_slice(name);
    f.extend_from_slice(proof);
    f.extend_from_slice(&CLIENT_NONCE.0);
    f
}

/// Read the target's answer to a hello: its header, and for a hello ack
/// the proof it carries (checked here against `secret` and `nonce`, the
/// target's challenge, as the transport checks it).
pub(crate) fn read_hello_answer(s: &mut TcpStream, name: &[u8], secret: &AgentSecret, nonce: &Nonce) -> wire::Header {
    let mut b = [0u8; wire::HEADER_BYTES];
    s.read_exact(&mut b).unwrap();
    let h = wire::Header::decode(&b).unwrap();
    if h.kind == wire::Kind::HelloAck {
        let mut proof = vec![0u8; h.body_bytes()];
        s.read_exact(&mut proof).unwrap();
        assert!(
            auth::verify(secret, &CLIENT_NONCE, &wire::ack_context(name, nonce), &proof),
            "the hello ack proves the target's secret"
        );
    }
    h
}

/// Connect to the target of `info` and authenticate with `secret` (the
/// target's own when `None`). Returns the stream and the target's answer
/// header (`HelloAck` when accepted).
pub(crate) fn raw_client(info: &[u8], name: &str, secret: Option<&AgentSecret>) -> (TcpStream, wire::Header) {
    let info = TcpConnectionInfo::decode(info).unwrap();
    let mut s = TcpStream::connect(&info.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let nonce = read_challenge(&mut s);
    let secret = secret.unwrap_or(&info.secret);
    let proof = auth::prove(secret, &nonce, &wire::proof_context(name.as_bytes()));
    s.write_all(&hello_frame(name.as_bytes(), &proof)).unwrap();
    let h = read_hello_answer(&mut s, name.as_bytes(), &info.secret, &nonce);
    (s, h)
}

/// An authenticated raw client; panics unless the target accepted it.
pub(crate) fn authed_client(info: &[u8], name: &str) -> TcpStream {
    let (s, h) = raw_client(info, name, None);
    assert_eq!(h.kind, wire::Kind::HelloAck, "the right proof is accepted");
    s
}

/// Read one response (header and reason).
pub(crate) fn read_resp(s: &mut TcpStream) -> (wire::Header, Vec<u8>) {
    let mut b = [0u8; wire::HEADER_BYTES];
    s.read_exact(&mut b).unwrap();
    let h = wire::Header::decode(&b).unwrap();
    let mut body = vec![0u8; h.body_bytes()];
    s.read_exact(&mut body).unwrap();
    (h, body)
}

pub(crate) fn completion(t: &mut dyn Transport, limit: Duration) -> Option<Completion> {
    let t0 = Instant::now();
    let mut out = Vec::new();
    while t0.elapsed() < limit {
        t.poll(&mut out);
        if let Some(c) = out.pop() {
            return Some(c);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    None
}
