//! Authenticated tcp: the target answers every new connection with a nonce
//! and serves nothing until the initiator proves it knows the agent secret
//! published in the connection info. A raw socket without the proof can
//! neither read nor write registered memory.

mod tcp_util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvwire::HostBuffer;
use kvwire::transport::auth::{self, AgentSecret};
use kvwire::transport::tcp::{TcpConnectionInfo, TcpTransport, wire};
use kvwire::transport::{Transport, TransportError};
use tcp_util::*;

const PATTERN: u8 = 0xa5;

/// A target with one 64 KiB region filled with `PATTERN`.
fn target() -> (TcpTransport, std::sync::Arc<HostBuffer>, u32, Vec<u8>) {
    let mut t = TcpTransport::new("target", &cfg(2000)).unwrap();
    let buf = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
    buf.fill_with(0, buf.len(), |_| PATTERN);
    let r = t.register(buf.clone()).unwrap();
    let info = t.connection_info();
    (t, buf, r.rkey.0, info)
}

fn write_frame(rkey: u32, addr: u64, len: u64) -> Vec<u8> {
    let mut f = wire::Header { kind: wire::Kind::Write, count: 1, id: 1, len }.encode().to_vec();
    wire::encode_segments([wire::SegmentDesc { rkey, addr, len_bytes: len }], &mut f);
    f.extend(std::iter::repeat_n(0x11u8, len as usize));
    f
}

fn read_frame(rkey: u32, addr: u64, len: u64) -> Vec<u8> {
    let mut f = wire::Header { kind: wire::Kind::Read, count: 1, id: 2, len }.encode().to_vec();
    wire::encode_segments([wire::SegmentDesc { rkey, addr, len_bytes: len }], &mut f);
    f
}

/// Everything the target sends until it closes (bounded by the read timeout).
fn rest(s: &mut TcpStream) -> Vec<u8> {
    let mut v = Vec::new();
    let _ = s.read_to_end(&mut v);
    v
}

/// The target refused: after the challenge, one DENIED response and EOF,
/// and nothing of the region's bytes.
fn assert_denied(after_challenge: &[u8]) {
    assert!(after_challenge.len() >= wire::HEADER_BYTES, "a refusal, got {} bytes", after_challenge.len());
    let h = wire::Header::decode(after_challenge[..wire::HEADER_BYTES].try_into().unwrap()).unwrap();
    assert_eq!((h.kind, h.status()), (wire::Kind::Resp, wire::Status::Denied));
    assert_eq!(after_challenge.len(), wire::HEADER_BYTES + h.body_bytes(), "nothing after the refusal");
    assert!(!after_challenge.windows(64).any(|w| w.iter().all(|&b| b == PATTERN)), "region bytes leaked");
}

#[test]
fn a_raw_socket_without_the_proof_can_neither_read_nor_write_registered_memory() {
    let (_t, buf, rkey, info) = target();
    let info_d = TcpConnectionInfo::decode(&info).unwrap();
    let addr = buf.addr();
    let attempts: Vec<(&str, Vec<u8>)> = vec![
        ("write without a hello", write_frame(rkey, addr, 4096)),
        ("read without a hello", read_frame(rkey, addr, 4096)),
    ];
    for (what, frame) in attempts {
        let mut s = TcpStream::connect(&info_d.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = read_challenge(&mut s);
        let _ = s.write_all(&frame);
        let got = rest(&mut s);
        assert_denied(&got);
        assert!(buf.to_vec(..).iter().all(|&b| b == PATTERN), "{what}: registered memory was written");
    }
    // Hellos with a missing (zero), wrong-secret or other-agent proof.
    let wrong = AgentSecret::random().unwrap();
    for case in 0..3 {
        let mut s = TcpStream::connect(&info_d.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let nonce = read_challenge(&mut s);
        let proof = match case {
            0 => [0u8; auth::PROOF_BYTES],
            1 => auth::prove(&wrong, &nonce, &wire::proof_context(b"mallory")),
            _ => auth::prove(&info_d.secret, &nonce, &wire::proof_context(b"alice")),
        };
        let mut frame = hello_frame(b"mallory", &proof);
        frame.extend(write_frame(rkey, addr, 4096));
        frame.extend(read_frame(rkey, addr, 4096));
        let _ = s.write_all(&frame);
        let got = rest(&mut s);
        assert_denied(&got);
        assert!(buf.to_vec(..).iter().all(|&b| b == PATTERN), "case {case}: registered memory was written");
    }
    // A proof from an earlier connection does not answer a new nonce.
    let mut s = TcpStream::connect(&info_d.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let old = read_challenge(&mut s);
    drop(s);
    let mut s = TcpStream::connect(&info_d.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _fresh = read_challenge(&mut s);
    let _ = s.write_all(&hello_frame(b"eve", &auth::prove(&info_d.secret, &old, &wire::proof_context(b"eve"))));
    assert_denied(&rest(&mut s));
}

#[test]
fn the_right_proof_is_served() {
    // The same raw client with the published secret gets in and writes:
    // the refusals above are the proof check, not a broken client.
    let (_t, buf, rkey, info) = target();
    let mut s = authed_client(&info, "prefill");
    s.write_all(&write_frame(rkey, buf.addr(), 4096)).unwrap();
    let (h, _) = read_resp(&mut s);
    assert_eq!(h.status(), wire::Status::Ok);
    assert!(buf.to_vec(..4096).iter().all(|&b| b == 0x11));
    assert!(buf.to_vec(4096..).iter().all(|&b| b == PATTERN));
}

#[test]
fn a_transport_holding_another_secret_cannot_connect() {
    let (_t, _buf, _rkey, info) = target();
    let mut forged = TcpConnectionInfo::decode(&info).unwrap();
    forged.secret = AgentSecret::random().unwrap();
    let forged = forged.encode();
    let mut init = TcpTransport::new("init", &cfg(2000)).unwrap();
    match init.connect("target", &forged, &[]) {
        Err(TransportError::Connect { reason, .. }) => assert!(reason.contains("Denied"), "{reason}"),
        other => panic!("connect with a wrong secret must fail, got {:?}", other.map(|_| ())),
    }
    // The real info connects.
    init.connect("target", &info, &[]).unwrap();
}

#[test]
fn every_transport_draws_its_own_secret() {
    let a = TcpConnectionInfo::decode(&TcpTransport::new("a", &cfg(1000)).unwrap().connection_info()).unwrap();
    let b = TcpConnectionInfo::decode(&TcpTransport::new("b", &cfg(1000)).unwrap().connection_info()).unwrap();
    assert_ne!(a.secret, b.secret);
}

/// A process on the target's address (the target died; another user bound
/// its port) that speaks the wire: it answers every hello with an ack whose
/// proof is `ack(the real target's secret, name, target nonce, initiator
/// nonce)` (an impostor cannot use the first argument; the control does),
/// then counts the bytes the initiator still sends. Returns (connect's
/// result, bytes received after the acks).
fn fake_on_the_targets_address(
    ack: impl Fn(&AgentSecret, &[u8], &auth::Nonce, &auth::Nonce) -> [u8; auth::PROOF_BYTES] + Send + 'static,
) -> (Result<(), TransportError>, usize) {
    let (t, _buf, _rkey, info) = target();
    let real = TcpConnectionInfo::decode(&info).unwrap();
    drop(t); // the target is gone; its port is free
    let l = std::net::TcpListener::bind(&real.addr).unwrap();
    l.set_nonblocking(true).unwrap();
    let fake = std::thread::spawn(move || {
        let mut after = 0usize;
        let until = std::time::Instant::now() + Duration::from_secs(3);
        while std::time::Instant::now() < until {
            let Ok((mut s, _)) = l.accept() else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let nonce = auth::Nonce::random().unwrap();
            let ch =
                wire::Header { kind: wire::Kind::Challenge, count: wire::NONCE_BYTES, id: wire::MAGIC_VERSION, len: 0 };
            let _ = s.write_all(&ch.encode());
            let _ = s.write_all(&nonce.0);
            let mut b = [0u8; wire::HEADER_BYTES];
            if s.read_exact(&mut b).is_err() {
                continue;
            }
            let h = wire::Header::decode(&b).unwrap();
            let mut body = vec![0u8; h.body_bytes()];
            s.read_exact(&mut body).unwrap();
            let mut theirs = auth::Nonce([0; auth::NONCE_BYTES]);
            theirs.0.copy_from_slice(&body[body.len() - auth::NONCE_BYTES..]);
            let a = wire::Header {
                kind: wire::Kind::HelloAck,
                count: wire::PROOF_BYTES as u32,
                id: wire::MAGIC_VERSION,
                len: 0,
            };
            let _ = s.write_all(&a.encode());
            let _ = s.write_all(&ack(&real.secret, &body[..h.count as usize], &nonce, &theirs));
            after += rest(&mut s).len();
        }
        after
    });
    let mut init = TcpTransport::new("init", &cfg(1000)).unwrap();
    let r = init.connect("target", &info, &[]).map(|_| ());
    drop(init);
    (r, fake.join().unwrap())
}

#[test]
fn an_impostor_on_the_targets_address_is_refused_before_any_request() {
    // Without the target's secret the impostor can only guess the ack's
    // proof (zeros) or prove another secret: connect fails naming it, and
    // not a byte follows the hello.
    let other = AgentSecret::random().unwrap();
    for case in 0..2 {
        let other = other.clone();
        let (r, after) = fake_on_the_targets_address(move |_real, name, nonce, theirs| match case {
            0 => [0u8; auth::PROOF_BYTES],
            _ => auth::prove(&other, theirs, &wire::ack_context(name, nonce)),
        });
        match r {
            Err(TransportError::Connect { reason, .. }) => assert!(reason.contains("Impostor"), "{reason}"),
            other => panic!("case {case}: connect to an impostor must fail, got {other:?}"),
        }
        assert_eq!(after, 0, "case {case}: the initiator sent {after} bytes to the impostor");
    }
}

#[test]
fn the_fake_target_holding_the_secret_is_accepted() {
    // The control: the same fake proving the real secret connects, so the
    // refusals above are the ack's proof check, not a broken fake.
    let (r, _) = fake_on_the_targets_address(|real, name, nonce, theirs| {
        auth::prove(real, theirs, &wire::ack_context(name, nonce))
    });
    r.expect("a fake holding the secret is accepted");
}
