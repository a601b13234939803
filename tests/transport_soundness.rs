//! Issue 27 item 1: safe code cannot make a transport touch memory it did
//! not register. Both programs from the issue, written without `unsafe`:
//! - posting a segment whose local range is a live `Vec` (unknown `lkey`,
//!   or a known `lkey` with a range outside it) is refused with a typed
//!   error before anything moves, and the `Vec` keeps its bytes;
//! - dropping the caller's handle to registered memory cannot free it while
//!   the transport still holds it (`register` takes an `Arc`), so a READ
//!   into it afterwards lands in live memory, never in freed pages.
//!
//! The borrowed form (`register(&buf)`, then `drop(buf)`) no longer
//! compiles: see the `compile_fail` example on `Transport::register`.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::transport::{
    self, Completion, LocalKey, MemoryBacking, Op, PeerId, PostRequest, RemoteRegion, Segment, Transport,
    TransportConfig, TransportError, TransportKind, XferId,
};

struct Pair {
    init: Box<dyn Transport>,
    _target: Box<dyn Transport>,
    peer: PeerId,
    src: Arc<HostBuffer>,
    dst: Arc<HostBuffer>,
    lkey: LocalKey,
    region: RemoteRegion,
}

fn pair(kind: TransportKind) -> Pair {
    let cfg = TransportConfig { peer_timeout: Duration::from_secs(3), ..Default::default() };
    let mut init = transport::create(kind, "init", &cfg).unwrap();
    let mut target = transport::create(kind, "target", &cfg).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
    let dst = Arc::new(HostBuffer::new(1 << 16).unwrap());
    src.fill_with(0, src.len(), |i| (i % 251) as u8 + 1);
    let l = init.register(src.clone()).unwrap();
    let r = target.register(dst.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: r.rkey, kind: d.kind, device_id: 0 };
    let peer = init.connect("target", &target.connection_info(), &[region]).unwrap();
    Pair { init, _target: target, peer, src, dst, lkey: l.lkey, region }
}

fn post(p: &mut Pair, id: u64, op: Op, local_addr: u64, lkey: LocalKey, len: u64) -> Result<(), TransportError> {
    let seg = Segment { local_addr, remote_addr: p.region.addr, len_bytes: len, lkey, rkey: p.region.rkey };
    p.init.post(PostRequest { xfer: XferId(id), op, peer: p.peer, segments: vec![seg], notification: None })
}

fn completion(t: &mut dyn Transport) -> Completion {
    let t0 = Instant::now();
    let mut out = Vec::new();
    while out.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no completion");
        t.wait(&mut out, Duration::from_millis(20));
    }
    out.remove(0)
}

/// A READ into (or a WRITE from) a live `Vec` the transport never saw.
fn unregistered_local_memory_is_refused(kind: TransportKind) {
    let mut p = pair(kind);
    p.dst.fill_with(0, p.dst.len(), |_| 0xAB);
    let victim = vec![7u8; 8192];
    let at = victim.as_ptr() as u64;
    let (lkey, src_addr) = (p.lkey, p.src.addr());
    // Unknown lkey.
    let err = post(&mut p, 1, Op::Read, at, LocalKey(lkey.0 + 1000), 4096).unwrap_err();
    assert!(matches!(err, TransportError::UnknownLocalKey(k) if k.0 == lkey.0 + 1000), "{kind}: {err:?}");
    // A known lkey with a range outside its registration.
    let err = post(&mut p, 2, Op::Read, at, lkey, 4096).unwrap_err();
    assert!(matches!(err, TransportError::LocalOutOfBounds { addr, .. } if addr == at), "{kind}: {err:?}");
    // Straddling the end of the registration.
    let end = p.src.addr() + p.src.len() as u64;
    let err = post(&mut p, 3, Op::Read, end - 100, lkey, 4096).unwrap_err();
    assert!(matches!(err, TransportError::LocalOutOfBounds { .. }), "{kind}: {err:?}");
    // Overflowing.
    let err = post(&mut p, 4, Op::Write, u64::MAX - 10, lkey, 4096).unwrap_err();
    assert!(matches!(err, TransportError::LocalOutOfBounds { .. }), "{kind}: {err:?}");
    std::thread::sleep(Duration::from_millis(50));
    assert!(victim.iter().all(|&b| b == 7), "{kind}: a refused READ wrote into a live Vec");
    let mut out = Vec::new();
    p.init.poll(&mut out);
    assert!(out.is_empty(), "{kind}: a refused post reported a completion");
    // The registered range still works.
    post(&mut p, 5, Op::Write, src_addr, lkey, 4096).unwrap();
    assert_eq!(completion(p.init.as_mut()).result, Ok(()), "{kind}");
    assert_eq!(p.dst.to_vec(..4096), p.src.to_vec(..4096), "{kind}");
}

/// The caller drops its only handle to registered memory and then posts a
/// READ into it: the transport's `Arc` keeps the memory alive, so the READ
/// lands in live memory; after `deregister` the key is refused.
fn dropped_handle_keeps_memory_alive(kind: TransportKind) {
    let mut p = pair(kind);
    p.dst.fill_with(0, p.dst.len(), |_| 0x5A);
    let (addr, len) = (p.src.addr(), p.src.len() as u64);
    let lkey = p.lkey;
    p.src = Arc::new(HostBuffer::new(4096).unwrap()); // the old buffer's last caller handle goes
    post(&mut p, 1, Op::Read, addr, lkey, len).unwrap();
    assert_eq!(completion(p.init.as_mut()).result, Ok(()), "{kind}");
    p.init.deregister(lkey).unwrap();
    let err = post(&mut p, 2, Op::Read, addr, lkey, len).unwrap_err();
    assert!(matches!(err, TransportError::UnknownLocalKey(k) if k == lkey), "{kind}: {err:?}");
}

#[test]
fn shm_refuses_unregistered_local_memory() {
    unregistered_local_memory_is_refused(TransportKind::Shm);
}

#[test]
fn tcp_refuses_unregistered_local_memory() {
    unregistered_local_memory_is_refused(TransportKind::Tcp);
}

#[test]
fn shm_registration_owns_its_memory() {
    dropped_handle_keeps_memory_alive(TransportKind::Shm);
}

#[test]
fn tcp_registration_owns_its_memory() {
    dropped_handle_keeps_memory_alive(TransportKind::Tcp);
}

/// Issue 27 item 4: while an agent is connected, another transport (another
/// session; on shm another process) claiming its name is refused with
/// `TransportError::NameInUse`; once the first one is gone, the name is free.
fn name_spoofing_is_refused(kind: TransportKind, spoofer: impl FnOnce(&[u8], &[RemoteRegion]) -> TransportError) {
    let p = pair(kind);
    let info = p._target.connection_info();
    let err = spoofer(&info, &[p.region]);
    assert!(matches!(&err, TransportError::NameInUse { name, .. } if name == "init"), "{kind}: {err:?}");
    // The honest peer is unaffected.
    let Pair { mut init, mut _target, peer, src, region, lkey, .. } = p;
    let seg = Segment { local_addr: src.addr(), remote_addr: region.addr, len_bytes: 64, lkey, rkey: region.rkey };
    init.post(PostRequest {
        xfer: XferId(1),
        op: Op::Write,
        peer,
        segments: vec![seg],
        notification: Some(b"hi".to_vec()),
    })
    .unwrap();
    assert_eq!(completion(init.as_mut()).result, Ok(()), "{kind}");
    let mut n = Vec::new();
    _target.take_notifications(&mut n);
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].from_agent, "init");
}

#[test]
fn tcp_name_spoofing_is_refused() {
    name_spoofing_is_refused(TransportKind::Tcp, |info, regions| {
        let cfg = TransportConfig { peer_timeout: Duration::from_secs(3), ..Default::default() };
        let mut spoof = transport::create(TransportKind::Tcp, "init", &cfg).unwrap();
        spoof.connect("target", info, regions).unwrap_err()
    });
}

#[test]
fn shm_name_spoofing_is_refused() {
    // Another process: this test binary re-run as `shm_spoof_child`.
    name_spoofing_is_refused(TransportKind::Shm, |info, regions| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["shm_spoof_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(SPOOF_INFO, hex(info))
            .env(SPOOF_REGION, format!("{}:{}:{}", regions[0].addr, regions[0].len_bytes, regions[0].rkey.0))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("SPOOF name-in-use"), "child said: {text}");
        TransportError::NameInUse { peer: "target".into(), name: "init".into() }
    });
}

const SPOOF_INFO: &str = "KVWIRE_TEST_SPOOF_INFO";
const SPOOF_REGION: &str = "KVWIRE_TEST_SPOOF_REGION";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn shm_spoof_child() {
    let Ok(info) = std::env::var(SPOOF_INFO) else { return };
    let info: Vec<u8> = (0..info.len()).step_by(2).map(|i| u8::from_str_radix(&info[i..i + 2], 16).unwrap()).collect();
    let r: Vec<u64> = std::env::var(SPOOF_REGION).unwrap().split(':').map(|x| x.parse().unwrap()).collect();
    let region = RemoteRegion {
        addr: r[0],
        len_bytes: r[1],
        rkey: kvwire::transport::RemoteKey(r[2] as u32),
        kind: kvwire::transport::MemoryKind::Dram,
        device_id: 0,
    };
    let cfg = TransportConfig { peer_timeout: Duration::from_secs(3), ..Default::default() };
    let mut spoof = transport::create(TransportKind::Shm, "init", &cfg).unwrap();
    match spoof.connect("target", &info, &[region]) {
        Err(TransportError::NameInUse { .. }) => println!("SPOOF name-in-use"),
        other => println!("SPOOF other {other:?}"),
    }
}
