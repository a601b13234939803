//! Faults the tcp backend survives: a notification-only post, a dead peer
//! seen at post time, a peer that trickles a WRITE, bad configuration,
//! typed refusals and the shared notification limit.

mod tcp_util;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine};
use kvwire::transport::tcp::{TcpTransport, wire};
use kvwire::transport::{
    FailureKind, LocalKey, MAX_NOTIFICATION_BYTES, Op, PeerId, PostRequest, RemoteKey, Segment, Transport,
    TransportConfig, TransportError, TransportKind, XferId,
};
use tcp_util::*;

struct Pair {
    init: TcpTransport,
    target: TcpTransport,
    peer: PeerId,
    src: std::sync::Arc<HostBuffer>,
    dst: std::sync::Arc<HostBuffer>,
    lkey: LocalKey,
    rkey: RemoteKey,
}

fn pair(timeout_ms: u64) -> Pair {
    let mut init = TcpTransport::new("init", &cfg(timeout_ms)).unwrap();
    let mut target = TcpTransport::new("target", &cfg(timeout_ms)).unwrap();
    let src = std::sync::Arc::new(HostBuffer::new(1 << 20).unwrap());
    let dst = std::sync::Arc::new(HostBuffer::new(1 << 20).unwrap());
    src.fill_with(0, src.len(), |i| (i % 251) as u8);
    let l = init.register(src.clone()).unwrap();
    let r = target.register(dst.clone()).unwrap();
    let peer = init.connect("target", &target.connection_info(), &[]).unwrap();
    Pair { init, target, peer, src, dst, lkey: l.lkey, rkey: r.rkey }
}

impl Pair {
    fn post(&mut self, id: u64, segments: Vec<Segment>, notification: Option<Vec<u8>>) -> Result<(), TransportError> {
        self.init.post(PostRequest { xfer: XferId(id), op: Op::Write, peer: self.peer, segments, notification })
    }

    fn seg(&self, len: u64) -> Segment {
        Segment {
            local_addr: self.src.addr(),
            remote_addr: self.dst.addr(),
            len_bytes: len,
            lkey: self.lkey,
            rkey: self.rkey,
        }
    }

    fn notifs(&mut self, limit: Duration) -> Vec<kvwire::transport::Notification> {
        let t0 = Instant::now();
        let mut n = Vec::new();
        while n.is_empty() && t0.elapsed() < limit {
            self.target.take_notifications(&mut n);
            std::thread::sleep(Duration::from_millis(1));
        }
        n
    }
}

#[test]
fn an_empty_post_with_a_notification_delivers_it_and_ends_done() {
    let mut p = pair(2000);
    p.post(1, Vec::new(), Some(b"only-a-notification".to_vec())).unwrap();
    let c = completion(&mut p.init, Duration::from_secs(5)).expect("a completion");
    assert_eq!(c.result, Ok(()), "a notification-only post ends Done");
    let n = p.notifs(Duration::from_secs(5));
    assert_eq!(n.len(), 1);
    assert_eq!((n[0].from_agent.as_str(), n[0].payload.as_slice()), ("init", &b"only-a-notification"[..]));
    // The connection survived: a data post still works, and so does an
    // empty one without a notification.
    let s = p.seg(4096);
    p.post(2, vec![s], None).unwrap();
    assert_eq!(completion(&mut p.init, Duration::from_secs(5)).unwrap().result, Ok(()));
    assert_eq!(p.dst.to_vec(..4096), p.src.to_vec(..4096));
    p.post(3, Vec::new(), None).unwrap();
    assert_eq!(completion(&mut p.init, Duration::from_secs(5)).unwrap().result, Ok(()));
}

#[test]
fn a_post_to_a_dead_peer_raises_at_the_call() {
    let mut p = pair(2000);
    let s = p.seg(4096);
    p.post(1, vec![s], None).unwrap();
    assert_eq!(completion(&mut p.init, Duration::from_secs(5)).unwrap().result, Ok(()));
    // The target goes away; its connections close (FIN) at once.
    drop(std::mem::replace(&mut p.target, TcpTransport::new("other", &cfg(2000)).unwrap()));
    std::thread::sleep(Duration::from_millis(300));
    let s = p.seg(4096);
    match p.post(2, vec![s], Some(b"n".to_vec())) {
        Err(TransportError::PeerDisconnected(why)) => assert!(why.contains("target"), "{why}"),
        other => panic!("post to a dead peer must raise PeerDisconnected, got {other:?}"),
    }
    let mut out = Vec::new();
    p.init.poll(&mut out);
    assert!(out.is_empty(), "a refused post reports no completion");
}

#[test]
fn an_engine_post_to_a_dead_peer_raises_at_the_call() {
    let mut target = TransferEngine::new("decode", TransportKind::Tcp, &cfg(2000)).unwrap();
    let mut init = TransferEngine::new("prefill", TransportKind::Tcp, &cfg(2000)).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
    let dst = Arc::new(HostBuffer::new(1 << 16).unwrap());
    init.register(src.clone()).unwrap();
    target.register(dst.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    drop(target);
    std::thread::sleep(Duration::from_millis(300));
    let r = init.post(Op::Write, &[Desc::new(src.addr(), 4096)], "decode", &[Desc::new(dst.addr(), 4096)], None);
    assert!(r.is_err(), "the engine's post must raise for a dead tcp peer");
}

/// A peer trickling a valid WRITE (gaps below peer_timeout) holds nothing
/// without bound: the target drops it past the request's deadline,
/// `deregister` returns, and another initiator's WRITE to another region of
/// the same target completes meanwhile.
#[test]
fn a_trickling_write_cannot_stall_deregister_or_other_peers() {
    let timeout = 1000;
    let mut target = TcpTransport::new("target", &cfg(timeout)).unwrap();
    let a = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
    let b = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
    let ra = target.register(a.clone()).unwrap();
    let _rb = target.register(b.clone()).unwrap();
    let info = target.connection_info();
    let (a_addr, b_addr) = (a.addr(), b.addr());

    // The honest initiator connects first.
    let mut init = TcpTransport::new("honest", &cfg(timeout)).unwrap();
    let src = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
    src.fill_with(0, src.len(), |i| (i % 199) as u8);
    let l = init.register(src.clone()).unwrap();
    let peer = init.connect("target", &info, &[]).unwrap();

    let mut s = authed_client(&info, "trickler");
    let len = 1u64 << 16;
    let mut f = wire::Header { kind: wire::Kind::Write, count: 1, id: 1, len }.encode().to_vec();
    wire::encode_segments([wire::SegmentDesc { rkey: ra.rkey.0, addr: a_addr, len_bytes: len }], &mut f);
    s.write_all(&f).unwrap();
    // One byte every 100 ms for up to 30 s: each gap far below peer_timeout.
    let trickler = std::thread::spawn(move || {
        for _ in 0..300 {
            if s.write_all(&[7]).is_err() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    });
    std::thread::sleep(Duration::from_millis(300));
    let (tx, rx) = std::sync::mpsc::channel();
    let dereg = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = target.deregister(ra.lkey);
        tx.send((r.is_ok(), t0.elapsed())).unwrap();
        target
    });
    std::thread::sleep(Duration::from_millis(100));
    // Meanwhile another initiator writes into region B.
    let seg = Segment { local_addr: src.addr(), remote_addr: b_addr, len_bytes: 4096, lkey: l.lkey, rkey: _rb.rkey };
    init.post(PostRequest { xfer: XferId(1), op: Op::Write, peer, segments: vec![seg], notification: None }).unwrap();
    let c = completion(&mut init, Duration::from_secs(10)).expect("a completion");
    assert_eq!(c.result, Ok(()), "another peer's WRITE must not wait for the trickler");
    // deregister returns within the request deadline (≈ peer_timeout), far
    // before the trickler would finish (30 s).
    let (ok, took) = rx.recv_timeout(Duration::from_secs(15)).expect("deregister must not wait for the trickler");
    assert!(ok);
    assert!(trickler.join().unwrap(), "the target dropped the trickling connection");
    let _target = dereg.join().unwrap();
    eprintln!("deregister waited {took:?} for a trickling WRITE (peer_timeout {timeout} ms)");
    assert_eq!(b.to_vec(..4096), src.to_vec(..4096));
}

#[test]
fn zero_timeouts_counts_and_bad_options_are_refused_at_creation() {
    let zero = TransportConfig { peer_timeout: Duration::ZERO, ..Default::default() };
    assert!(matches!(TcpTransport::new("x", &zero), Err(TransportError::InvalidConfig(_))));
    let huge = TransportConfig { peer_timeout: Duration::from_secs(10_000_000), ..Default::default() };
    assert!(matches!(TcpTransport::new("x", &huge), Err(TransportError::InvalidConfig(_))));
    let no_threads = TransportConfig { copy_threads: 0, ..Default::default() };
    assert!(matches!(TcpTransport::new("x", &no_threads), Err(TransportError::InvalidConfig(_))));
    let opt = |k: &str, v: &str| TransportConfig { options: vec![(k.into(), v.into())], ..Default::default() };
    for (k, v) in [
        ("conns_per_peer", "0"),
        ("conns_per_peer", "65"),
        ("conns_per_peer", "two"),
        ("conn_per_peer", "2"),
        ("listen", "localhost"),
        ("listen", "1.2.3.4.5:0"),
        ("advertise", "host-without-port"),
        ("advertise", "10.0.0.1:0"),
    ] {
        match TcpTransport::new("x", &opt(k, v)) {
            Err(TransportError::InvalidOption { key, .. }) => assert_eq!(key, k),
            other => panic!("{k}={v} must be refused as an invalid option, got {:?}", other.map(|_| ())),
        }
    }
    assert!(TcpTransport::new("x", &opt("conns_per_peer", "64")).is_ok());
}

#[test]
fn refusals_carry_a_typed_status_and_the_connection_stays_up() {
    let mut target = TcpTransport::new("target", &cfg(2000)).unwrap();
    let buf = std::sync::Arc::new(HostBuffer::new(1 << 16).unwrap());
    let r = target.register(buf.clone()).unwrap();
    let mut s = authed_client(&target.connection_info(), "raw");
    let req = |rkey: u32, addr: u64, len: u64| {
        let mut f = wire::Header { kind: wire::Kind::Read, count: 1, id: 5, len }.encode().to_vec();
        wire::encode_segments([wire::SegmentDesc { rkey, addr, len_bytes: len }], &mut f);
        f
    };
    s.write_all(&req(r.rkey.0 + 1, buf.addr(), 64)).unwrap();
    assert_eq!(read_resp(&mut s).0.status(), wire::Status::UnknownKey);
    s.write_all(&req(r.rkey.0, buf.addr() + (1 << 16) - 8, 64)).unwrap();
    assert_eq!(read_resp(&mut s).0.status(), wire::Status::OutOfBounds);
    s.write_all(&req(r.rkey.0, buf.addr(), 64)).unwrap();
    let (h, _) = read_resp(&mut s);
    assert_eq!((h.status(), h.len), (wire::Status::Ok, 64));
    // A deregistered key is an unknown key, for transfers as well.
    let mut p = pair(2000);
    p.target.deregister(LocalKey(p.rkey.0)).unwrap();
    let s = p.seg(64);
    p.post(1, vec![s], None).unwrap();
    let f = completion(&mut p.init, Duration::from_secs(5)).unwrap().result.unwrap_err();
    assert_eq!(f.kind, FailureKind::RemoteAccess(kvwire::transport::RemoteAccessKind::UnknownKey), "{f}");
}

#[test]
fn the_largest_notification_is_the_shared_limit() {
    let mut p = pair(2000);
    let big = vec![3u8; MAX_NOTIFICATION_BYTES];
    p.post(1, Vec::new(), Some(big.clone())).unwrap();
    assert_eq!(completion(&mut p.init, Duration::from_secs(5)).unwrap().result, Ok(()));
    assert_eq!(p.notifs(Duration::from_secs(5))[0].payload, big);
    let over = vec![3u8; MAX_NOTIFICATION_BYTES + 1];
    assert!(matches!(p.post(2, Vec::new(), Some(over)), Err(TransportError::Post(_))));
    assert_eq!(wire::MAX_NOTIFICATION_BYTES as usize, MAX_NOTIFICATION_BYTES);
}
