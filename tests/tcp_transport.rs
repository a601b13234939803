//! The `tcp` transport on loopback: WRITE, READ, notifications, refused
//! accesses, dead and silent peers, hostile frames, cancel.

mod tcp_util;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferStatus};
use kvwire::transport::auth::{self, Nonce};
use kvwire::transport::tcp::{TcpConnectionInfo, TcpTransport, wire};
use kvwire::transport::{
    FailureKind, LocalKey, MemoryBacking, Op, PeerId, PostRequest, RemoteAccessKind, RemoteKey, Segment, Transport,
    TransportConfig, TransportKind, XferId,
};
use tcp_util::{cfg, completion};

fn wait(e: &mut TransferEngine, h: kvwire::engine::TransferHandle, limit: Duration) -> TransferStatus {
    let t0 = Instant::now();
    loop {
        let s = e.status(h).unwrap();
        if s != TransferStatus::InProgress || t0.elapsed() > limit {
            return s;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn pattern(seed: u64) -> impl FnMut(usize) -> u8 {
    move |i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8
}

#[test]
fn scattered_write_lands_before_its_notification() {
    let mut target = TransferEngine::new("decode", TransportKind::Tcp, &cfg(2000)).unwrap();
    let mut init = TransferEngine::new("prefill", TransportKind::Tcp, &cfg(2000)).unwrap();
    let page = 4096u64;
    let pages = 3000u64; // > MAX_SEGMENTS and > CHUNK_BYTES: several chunks.
    let src = Arc::new(HostBuffer::new((page * pages) as usize).unwrap());
    let dst = Arc::new(HostBuffer::new((page * pages) as usize).unwrap());
    src.fill_with(0, src.len(), pattern(1));
    init.register(src.clone()).unwrap();
    target.register(dst.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    // Page i goes to page (i * 7) % pages: scattered, no two runs adjacent.
    let local: Vec<Desc> = (0..pages).map(|i| Desc::new(src.addr() + i * page, page)).collect();
    let remote: Vec<Desc> = (0..pages).map(|i| Desc::new(dst.addr() + (i * 7 % pages) * page, page)).collect();
    let h = init.post(Op::Write, &local, "decode", &remote, Some(b"xfer-1".to_vec())).unwrap();
    assert_eq!(wait(&mut init, h, Duration::from_secs(20)), TransferStatus::Done);
    let t0 = Instant::now();
    let notifs = loop {
        let n = target.get_notifs();
        if !n.is_empty() || t0.elapsed() > Duration::from_secs(5) {
            break n;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(notifs["prefill"], vec![b"xfer-1".to_vec()]);
    for i in 0..pages {
        let d = ((i * 7 % pages) * page) as usize;
        let s = (i * page) as usize;
        assert_eq!(dst.to_vec(d..d + page as usize), src.to_vec(s..s + page as usize), "page {i}");
    }
    init.release(h).unwrap();
}

#[test]
fn read_pulls_remote_pages() {
    let mut target = TransferEngine::new("prefill", TransportKind::Tcp, &cfg(2000)).unwrap();
    let mut init = TransferEngine::new("decode", TransportKind::Tcp, &cfg(2000)).unwrap();
    let remote_buf = Arc::new(HostBuffer::new(1 << 22).unwrap());
    let local_buf = Arc::new(HostBuffer::new(1 << 22).unwrap());
    remote_buf.fill_with(0, remote_buf.len(), pattern(9));
    target.register(remote_buf.clone()).unwrap();
    init.register(local_buf.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    let page = 65536u64;
    let local: Vec<Desc> = (0..32).map(|i| Desc::new(local_buf.addr() + i * page, page)).collect();
    let remote: Vec<Desc> = (0..32).map(|i| Desc::new(remote_buf.addr() + (63 - i) * page, page)).collect();
    let h = init.post(Op::Read, &local, "prefill", &remote, Some(b"read-done".to_vec())).unwrap();
    assert_eq!(wait(&mut init, h, Duration::from_secs(10)), TransferStatus::Done);
    for i in 0..32u64 {
        let l = (i * page) as usize;
        let r = ((63 - i) * page) as usize;
        assert_eq!(local_buf.to_vec(l..l + page as usize), remote_buf.to_vec(r..r + page as usize));
    }
    let t0 = Instant::now();
    while !target.get_notifs().contains_key("decode") {
        assert!(t0.elapsed() < Duration::from_secs(5), "READ notification never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A raw transport pair, so that requests the engine would refuse reach the target.
struct RawPair {
    init: TcpTransport,
    target: TcpTransport,
    peer: PeerId,
    src: Arc<HostBuffer>,
    dst: Arc<HostBuffer>,
    lkey: LocalKey,
    rkey: RemoteKey,
}

fn raw_pair(timeout_ms: u64) -> RawPair {
    let mut init = TcpTransport::new("init", &cfg(timeout_ms)).unwrap();
    let mut target = TcpTransport::new("target", &cfg(timeout_ms)).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 20).unwrap());
    let dst = Arc::new(HostBuffer::new(1 << 20).unwrap());
    src.fill_with(0, src.len(), pattern(3));
    let l = init.register(src.clone()).unwrap();
    let r = target.register(dst.clone()).unwrap();
    let peer = init.connect("target", &target.connection_info(), &[]).unwrap();
    RawPair { init, target, peer, src, dst, lkey: l.lkey, rkey: r.rkey }
}

fn post_one(id: u64, op: Op, remote_addr: u64, rkey: RemoteKey, len: u64, p: &mut RawPair) {
    let seg = Segment { local_addr: p.src.addr(), remote_addr, len_bytes: len, lkey: p.lkey, rkey };
    p.init
        .post(PostRequest {
            xfer: XferId(id),
            op,
            peer: p.peer,
            segments: vec![seg],
            notification: Some(b"n".to_vec()),
        })
        .unwrap();
}

#[test]
fn out_of_bounds_and_unknown_keys_fail_and_write_nothing() {
    let mut p = raw_pair(2000);
    let end = p.dst.addr() + p.dst.len() as u64;
    let cases = [
        (1, Op::Write, end - 100, p.rkey, 4096u64),
        (2, Op::Write, p.dst.addr() - 4096, p.rkey, 4096),
        (3, Op::Write, p.dst.addr(), RemoteKey(p.rkey.0 + 77), 4096),
        (4, Op::Read, end - 10, p.rkey, 4096),
        (5, Op::Write, u64::MAX - 10, p.rkey, 4096),
    ];
    for (id, op, addr, rkey, len) in cases {
        post_one(id, op, addr, rkey, len, &mut p);
        let c = completion(&mut p.init, Duration::from_secs(5)).expect("a completion");
        assert_eq!(c.xfer, XferId(id));
        let err = c.result.expect_err("refused");
        let want = if id == 3 { RemoteAccessKind::UnknownKey } else { RemoteAccessKind::OutOfBounds };
        assert_eq!(err.kind, FailureKind::RemoteAccess(want), "case {id}: {err}");
    }
    assert!(p.dst.to_vec(..).iter().all(|&b| b == 0), "a refused WRITE wrote something");
    let mut n = Vec::new();
    p.target.take_notifications(&mut n);
    assert!(n.is_empty(), "no notification for refused transfers");
    // The connection is still good for a valid transfer.
    post_one(9, Op::Write, p.dst.addr(), p.rkey, 4096, &mut p);
    assert_eq!(completion(&mut p.init, Duration::from_secs(5)).unwrap().result, Ok(()));
    assert_eq!(p.dst.to_vec(..4096), p.src.to_vec(..4096));
}

#[test]
fn dead_peer_fails_transfers_fast_and_later_posts_at_once() {
    let mut p = raw_pair(1000);
    // A long stream of READs, then the target goes away mid-transfer.
    for id in 0..50 {
        post_one(id, Op::Read, p.dst.addr(), p.rkey, 1 << 20, &mut p);
    }
    drop(std::mem::replace(&mut p.target, TcpTransport::new("other", &cfg(1000)).unwrap()));
    let t0 = Instant::now();
    let mut failed = 0;
    let mut out = Vec::new();
    while out.len() < 50 && t0.elapsed() < Duration::from_secs(5) {
        p.init.poll(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(out.len(), 50, "every transfer reached a terminal state");
    for c in &out {
        if c.result.is_err() {
            failed += 1;
        }
    }
    assert!(failed > 0, "transfers to a closed peer must fail");
    assert!(t0.elapsed() < Duration::from_secs(2), "failure took {:?}", t0.elapsed());
    let seg = Segment { local_addr: p.src.addr(), remote_addr: p.dst.addr(), len_bytes: 8, lkey: p.lkey, rkey: p.rkey };
    let r = p.init.post(PostRequest {
        xfer: XferId(99),
        op: Op::Write,
        peer: p.peer,
        segments: vec![seg],
        notification: None,
    });
    assert!(r.is_err(), "posting to a dead peer fails at once");
}

/// A fake target that accepts the hellos and then never answers.
fn silent_peer() -> (Vec<u8>, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let info = postcard_info(&addr);
    let secret = TcpConnectionInfo::decode(&info).unwrap().secret;
    let h = std::thread::spawn(move || {
        let mut held = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = l.accept().unwrap();
            let ch =
                wire::Header { kind: wire::Kind::Challenge, count: wire::NONCE_BYTES, id: wire::MAGIC_VERSION, len: 0 };
            s.write_all(&ch.encode()).unwrap();
            s.write_all(&[0u8; auth::NONCE_BYTES]).unwrap();
            let mut hdr = [0u8; wire::HEADER_BYTES];
            s.read_exact(&mut hdr).unwrap();
            let h = wire::Header::decode(&hdr).unwrap();
            let mut body = vec![0u8; h.body_bytes()];
            s.read_exact(&mut body).unwrap();
            // an honest but silent target: it proves the secret back (wire v3)
            let name = &body[..h.count as usize];
            let mut theirs = Nonce([0; auth::NONCE_BYTES]);
            theirs.0.copy_from_slice(&body[body.len() - auth::NONCE_BYTES..]);
            let proof = auth::prove(&secret, &theirs, &wire::ack_context(name, &Nonce([0; auth::NONCE_BYTES])));
            let ack = wire::Header {
                kind: wire::Kind::HelloAck,
                count: wire::PROOF_BYTES as u32,
                id: wire::MAGIC_VERSION,
                len: 0,
            };
            s.write_all(&ack.encode()).unwrap();
            s.write_all(&proof).unwrap();
            held.push(s);
        }
        std::thread::sleep(Duration::from_secs(4));
    });
    (info, h)
}

/// Connection info as `TcpTransport::connection_info` encodes it.
fn postcard_info(addr: &str) -> Vec<u8> {
    let probe = TcpTransport::new(
        "probe",
        &TransportConfig {
            options: vec![("listen".into(), "127.0.0.1:0".into()), ("advertise".into(), addr.into())],
            ..Default::default()
        },
    )
    .unwrap();
    probe.connection_info()
}

#[test]
fn silent_peer_fails_within_the_timeout() {
    let (info, fake) = silent_peer();
    let mut init = TcpTransport::new("init", &cfg(500)).unwrap();
    let src = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
    let l = init.register(src.clone()).unwrap();
    let peer = init.connect("silent", &info, &[]).unwrap();
    let seg =
        Segment { local_addr: src.addr(), remote_addr: 0x1000, len_bytes: 4096, lkey: l.lkey, rkey: RemoteKey(1) };
    let t0 = Instant::now();
    init.post(PostRequest { xfer: XferId(1), op: Op::Write, peer, segments: vec![seg], notification: None }).unwrap();
    let c = completion(&mut init, Duration::from_secs(3)).expect("silent peer must fail the transfer");
    // Hung but alive (its socket stays open): timed out, not "died".
    let why = c.result.expect_err("silent peer must fail the transfer");
    assert_eq!(why.kind, FailureKind::PeerTimeout, "{why}");
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(400) && took < Duration::from_millis(1500), "took {took:?}");
    drop(init);
    fake.join().unwrap();
}

#[test]
fn hostile_frames_are_refused_and_the_target_keeps_serving() {
    let mut p = raw_pair(1000);
    let info = p.target.connection_info();
    let addr = TcpConnectionInfo::decode(&info).unwrap().addr;
    // An authenticated client: the frames below test the decoder, not the handshake.
    let authed = || {
        let s = tcp_util::authed_client(&info, "evil");
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        s
    };
    let frames: Vec<Vec<u8>> = vec![
        vec![0xff; 24],                                                                             // unknown kind
        wire::Header { kind: wire::Kind::Write, count: u32::MAX, id: 1, len: 1 }.encode().to_vec(), // too many segments
        wire::Header { kind: wire::Kind::Read, count: 1, id: 1, len: u64::MAX }.encode().to_vec(),  // huge length
        wire::Header { kind: wire::Kind::Notify, count: u32::MAX, id: 1, len: 0 }.encode().to_vec(), // huge payload
        wire::Header { kind: wire::Kind::Resp, count: 0, id: 1, len: 0 }.encode().to_vec(),         // wrong direction
    ];
    for f in frames {
        let mut s = authed();
        s.write_all(&f).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest); // the target answers "protocol" and closes
        assert!(rest.len() <= wire::HEADER_BYTES + wire::MAX_REASON_BYTES as usize);
    }
    // A segment list whose lengths do not add up.
    let mut s = authed();
    let mut f = wire::Header { kind: wire::Kind::Write, count: 1, id: 1, len: 10 }.encode().to_vec();
    wire::encode_segments([wire::SegmentDesc { rkey: p.rkey.0, addr: p.dst.addr(), len_bytes: 5 }], &mut f);
    s.write_all(&f).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    // A hello with a wrong version is dropped without an ack: the target
    // sent its challenge, then a refusal.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut bad = wire::Header { kind: wire::Kind::Hello, count: 1, id: 1, len: 0 }.encode().to_vec();
    bad[8] ^= 1;
    s.write_all(&bad).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    let challenge = wire::HEADER_BYTES + auth::NONCE_BYTES;
    assert!(rest.len() >= challenge + wire::HEADER_BYTES, "challenge then refusal, got {} bytes", rest.len());
    let answer = wire::Header::decode(rest[challenge..challenge + wire::HEADER_BYTES].try_into().unwrap()).unwrap();
    assert_eq!((answer.kind, answer.status()), (wire::Kind::Resp, wire::Status::Denied));
    assert!(p.dst.to_vec(..).iter().all(|&b| b == 0));
    post_one(1, Op::Write, p.dst.addr(), p.rkey, 1 << 16, &mut p);
    assert_eq!(completion(&mut p.init, Duration::from_secs(5)).unwrap().result, Ok(()));
}

#[test]
fn cancel_returns_once_nothing_writes_local_memory() {
    let mut p = raw_pair(2000);
    p.target_fill();
    for id in 0..20 {
        post_one(id, Op::Read, p.dst.addr(), p.rkey, 1 << 20, &mut p);
    }
    for id in 0..20 {
        p.init.cancel(XferId(id));
    }
    let snapshot = p.src.to_vec(..);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(p.src.to_vec(..), snapshot, "a cancelled READ wrote after cancel returned");
    let mut out = Vec::new();
    p.init.poll(&mut out);
    assert!(out.is_empty(), "no completion after cancel");
    // The peer still works.
    post_one(100, Op::Read, p.dst.addr(), p.rkey, 4096, &mut p);
    assert_eq!(completion(&mut p.init, Duration::from_secs(5)).unwrap().result, Ok(()));
}

/// Cancels cut the connections of chunks on the wire; the transport opens
/// them again, and transfers that were not cancelled — posted before,
/// beside and after — complete with their bytes, notifications delivered,
/// the peer never marked dead.
#[test]
fn cancels_beside_live_transfers_leave_the_peer_and_its_other_transfers_whole() {
    let mut p = raw_pair(5000);
    p.target_fill();
    let half = (p.src.len() / 2) as u64;
    for round in 0..60u64 {
        // A live WRITE into the first half, big READs of the second half
        // cancelled while on the wire, another live WRITE after them.
        p.src.fill_with(0, half as usize, pattern(round));
        let seg = |off: u64, len: u64, p: &RawPair| Segment {
            local_addr: p.src.addr() + off,
            remote_addr: p.dst.addr() + off,
            len_bytes: len,
            lkey: p.lkey,
            rkey: p.rkey,
        };
        let live = 1000 + 2 * round;
        let write = |id: u64, off: u64, p: &mut RawPair| {
            let segments = vec![seg(off, half / 2, p)];
            let req =
                PostRequest { xfer: XferId(id), op: Op::Write, peer: p.peer, segments, notification: Some(vec![1]) };
            p.init.post(req).unwrap();
        };
        write(live, 0, &mut p);
        for k in 0..3 {
            let segments = vec![seg(half, half, &p)];
            let req =
                PostRequest { xfer: XferId(10 * round + k), op: Op::Read, peer: p.peer, segments, notification: None };
            p.init.post(req).unwrap();
        }
        for k in 0..3 {
            p.init.cancel(XferId(10 * round + k));
        }
        write(live + 1, half / 2, &mut p);
        let (mut out, t0) = (Vec::new(), Instant::now());
        while out.len() < 2 {
            assert!(t0.elapsed() < Duration::from_secs(20), "round {round}: a live transfer never completed: {out:?}");
            p.init.poll(&mut out);
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(out.iter().all(|c| c.result.is_ok()), "round {round}: {out:?}");
        let mut done: Vec<u64> = out.iter().map(|c| c.xfer.0).collect();
        done.sort();
        assert_eq!(done, [live, live + 1], "round {round}: only the live transfers complete");
        assert_eq!(p.dst.to_vec(..half as usize), p.src.to_vec(..half as usize), "round {round}");
    }
    let mut notes = Vec::new();
    let t0 = Instant::now();
    while notes.len() < 120 && t0.elapsed() < Duration::from_secs(10) {
        p.target.take_notifications(&mut notes);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(notes.len(), 120, "one notification per live transfer");
}

impl RawPair {
    fn target_fill(&self) {
        self.dst.fill_with(0, self.dst.len(), pattern(5));
    }
}

#[test]
fn backing_must_be_host_memory() {
    let mut t = TcpTransport::new("x", &TransportConfig::default()).unwrap();
    struct Vram;
    // SAFETY: a descriptor the transport must refuse (VRAM) before it
    // touches the (fake) range; nothing dereferences it.
    unsafe impl MemoryBacking for Vram {
        fn desc(&self) -> kvwire::transport::MemoryDesc {
            kvwire::transport::MemoryDesc {
                addr: 0x1000,
                len_bytes: 10,
                kind: kvwire::transport::MemoryKind::Vram,
                device_id: 0,
            }
        }
    }
    assert!(t.register(std::sync::Arc::new(Vram)).is_err());
    assert!(
        TcpTransport::new(
            "y",
            &TransportConfig { options: vec![("conns_per_peer".into(), "0".into())], ..Default::default() }
        )
        .is_err()
    );
}
