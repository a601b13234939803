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
use kvwire::transport::{Op, PostRequest, RemoteKey, Segment, Transport, TransportError, XferId};
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

/// The proof a fake target puts in its hello ack: `(the real target's
/// secret, hello name bytes, its challenge, the initiator's nonce)`. An
/// impostor cannot use the first argument; the control does.
type AckFn = dyn Fn(&AgentSecret, &[u8], &auth::Nonce, &auth::Nonce) -> [u8; auth::PROOF_BYTES] + Send + Sync;
type AckProof = Box<AckFn>;

/// A process on `addr` (the target died; another user bound its port) that
/// speaks the wire for 3 s: it answers every hello with an ack carrying
/// `ack(..)` (each connection on its own thread, held open), then counts
/// the bytes the initiator still sends. Joins to (hellos answered, bytes
/// received after the acks).
fn spawn_fake(addr: &str, secret: AgentSecret, ack: AckProof) -> std::thread::JoinHandle<(usize, usize)> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let l = std::net::TcpListener::bind(addr).unwrap();
    l.set_nonblocking(true).unwrap();
    let ack: Arc<AckFn> = Arc::from(ack);
    std::thread::spawn(move || {
        let (hellos, after) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let until = std::time::Instant::now() + Duration::from_secs(3);
        let mut served = Vec::new();
        while std::time::Instant::now() < until {
            let Ok((mut s, _)) = l.accept() else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            let (ack, secret, hellos, after) = (ack.clone(), secret.clone(), hellos.clone(), after.clone());
            let left = until.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(10));
            served.push(std::thread::spawn(move || {
                s.set_nonblocking(false).unwrap();
                s.set_read_timeout(Some(left)).unwrap();
                let nonce = auth::Nonce::random().unwrap();
                let ch = wire::Header {
                    kind: wire::Kind::Challenge,
                    count: wire::NONCE_BYTES,
                    id: wire::MAGIC_VERSION,
                    len: 0,
                };
                let _ = s.write_all(&ch.encode());
                let _ = s.write_all(&nonce.0);
                let mut b = [0u8; wire::HEADER_BYTES];
                if s.read_exact(&mut b).is_err() {
                    return;
                }
                let h = wire::Header::decode(&b).unwrap();
                let mut body = vec![0u8; h.body_bytes()];
                s.read_exact(&mut body).unwrap();
                hellos.fetch_add(1, Ordering::SeqCst);
                let mut theirs = auth::Nonce([0; auth::NONCE_BYTES]);
                theirs.0.copy_from_slice(&body[body.len() - auth::NONCE_BYTES..]);
                let a = wire::Header {
                    kind: wire::Kind::HelloAck,
                    count: wire::PROOF_BYTES as u32,
                    id: wire::MAGIC_VERSION,
                    len: 0,
                };
                let _ = s.write_all(&a.encode());
                let _ = s.write_all(&ack(&secret, &body[..h.count as usize], &nonce, &theirs));
                after.fetch_add(rest(&mut s).len(), Ordering::SeqCst);
            }));
        }
        for t in served {
            t.join().unwrap();
        }
        (hellos.load(Ordering::SeqCst), after.load(Ordering::SeqCst))
    })
}

/// Acks an impostor can make without the secret: a guess, another secret's.
fn impostor_acks() -> Vec<AckProof> {
    let other = AgentSecret::random().unwrap();
    vec![
        Box::new(|_, _, _, _| [0u8; auth::PROOF_BYTES]),
        Box::new(move |_, name, nonce, theirs| auth::prove(&other, theirs, &wire::ack_context(name, nonce))),
    ]
}

#[test]
fn an_impostor_on_a_dead_targets_address_gets_no_write() {
    // The target dies; another process binds its port. An initiator that
    // connects with the target's metadata (as an engine reconnecting to a
    // peer it still knows) and then writes a page: against an impostor
    // (cases 0, 1) connect fails naming it and not a byte reaches the fake;
    // the control (case 2, a fake holding the secret) is connected and
    // receives the page, so the fake counts what a passing check lets through.
    let control: AckProof =
        Box::new(|real, name, nonce, theirs| auth::prove(real, theirs, &wire::ack_context(name, nonce)));
    for (case, ack) in impostor_acks().into_iter().chain([control]).enumerate() {
        let (t, buf, rkey, info) = target();
        let real = TcpConnectionInfo::decode(&info).unwrap();
        drop(t); // the target is gone; its port is free
        let fake = spawn_fake(&real.addr, real.secret.clone(), ack);
        let mut init = TcpTransport::new("init", &cfg(1000)).unwrap();
        let src = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
        let l = init.register(src.clone()).unwrap();
        let connected = init.connect("target", &info, &[]);
        if let Ok(peer) = &connected {
            let seg = Segment {
                local_addr: src.addr(),
                remote_addr: buf.addr(),
                len_bytes: 4096,
                lkey: l.lkey,
                rkey: RemoteKey(rkey),
            };
            let req =
                PostRequest { xfer: XferId(1), op: Op::Write, peer: *peer, segments: vec![seg], notification: None };
            init.post(req).unwrap();
            let _ = completion(&mut init, Duration::from_secs(3)); // the fake never answers
        }
        drop(init);
        let (hellos, after) = fake.join().unwrap();
        assert!(hellos > 0, "case {case}: the fake was never dialled");
        if case == 2 {
            connected.expect("the control fake holds the secret");
            assert!(after >= 4096, "case {case}: the control fake got {after} bytes");
        } else {
            match connected {
                Err(TransportError::Connect { reason, .. }) => assert!(reason.contains("Impostor"), "{reason}"),
                other => panic!("case {case}: connect to an impostor must fail, got {:?}", other.map(|_| ())),
            }
            assert_eq!(after, 0, "case {case}: {after} bytes went to the impostor");
        }
    }
}

/// A FENCE (wire v4) stops only connections of the agent and session that
/// sends it: another initiator that names every generation drawn so far
/// cuts none of a third party's connections, whose transfers go on.
#[test]
fn a_fence_from_one_initiator_cuts_no_other_initiators_connection() {
    let (_t, buf, rkey, info) = target();
    let mut decode = TcpTransport::new("decode", &cfg(2000)).unwrap();
    let src = std::sync::Arc::new(HostBuffer::new(4096).unwrap());
    let lkey = decode.register(src.clone()).unwrap().lkey;
    let peer = decode.connect("target", &info, &[]).unwrap();
    let write = |t: &mut TcpTransport, id: u64, byte: u8| {
        src.fill_with(0, 4096, |_| byte);
        let segments = vec![Segment {
            local_addr: src.addr(),
            remote_addr: buf.addr(),
            len_bytes: 4096,
            lkey,
            rkey: RemoteKey(rkey),
        }];
        t.post(PostRequest { xfer: XferId(id), op: Op::Write, peer, segments, notification: None }).unwrap();
        let c = completion(t, Duration::from_secs(5)).expect("the write completes");
        assert_eq!(c.result, Ok(()), "write {id}");
        assert!(buf.to_vec(..4096).iter().all(|&b| b == byte), "write {id} landed");
    };
    write(&mut decode, 1, 0x33);
    // Every generation this test process can have drawn so far (a few per
    // connection of each test), in fences of the largest size.
    let mut s = authed_client(&info, "prefill");
    let n = wire::MAX_FENCE_ENTRIES as u64;
    for (id, first) in (0..16u64).map(|i| (10 + i, i * n)) {
        let mut f = wire::Header { kind: wire::Kind::Fence, count: n as u32, id, len: 0 }.encode().to_vec();
        for generation in first..first + n {
            f.extend_from_slice(&generation.to_le_bytes());
        }
        s.write_all(&f).unwrap();
        let (h, _) = read_resp(&mut s);
        assert_eq!((h.kind, h.id, h.status()), (wire::Kind::Resp, id, wire::Status::Ok));
    }
    write(&mut decode, 2, 0x44);
}
