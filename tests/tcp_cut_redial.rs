//! A tcp cancel cuts the connection of a chunk on the wire and the worker
//! redials before its next live chunk (docs/TCP.md, cancel).
//! A proxy between initiator and target lets a test freeze the wire (a
//! stopped peer) and hold the listener's accept queue full (listen backlog
//! 0), so that a redial's `connect` is slow (SYN dropped, retried after 1 s)
//! or never completes, and throttle it (a slow but live target).

mod tcp_util;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::transport::tcp::{TcpConnectionInfo, TcpTransport};
use kvwire::transport::{LocalKey, Op, PeerId, PostRequest, RemoteKey, Segment, Transport, TransportConfig, XferId};
use tcp_util::completion;

struct Proxy {
    addr: String,
    accepting: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
    /// Bytes per second each direction of each connection carries (0: no
    /// limit).
    rate: Arc<AtomicU64>,
    /// Connections accepted so far (each numbered in accept order).
    accepted: Arc<AtomicU64>,
    /// Connections numbered below this stay frozen whatever `frozen` says.
    held_below: Arc<AtomicU64>,
}

/// What one direction of one proxied connection obeys.
#[derive(Clone)]
struct Wire {
    frozen: Arc<AtomicBool>,
    rate: Arc<AtomicU64>,
    /// This connection's number in accept order.
    seq: u64,
    held_below: Arc<AtomicU64>,
}

fn pump(mut from: TcpStream, mut to: TcpStream, w: Wire) {
    const BUF: u64 = 16 << 10;
    let Wire { frozen, rate, seq, held_below } = w;
    let mut buf = vec![0u8; BUF as usize];
    loop {
        while frozen.load(Ordering::Acquire) || seq < held_below.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(2));
        }
        if let Some(us) = (BUF * 1_000_000).checked_div(rate.load(Ordering::Relaxed)) {
            std::thread::sleep(Duration::from_micros(us));
        }
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

impl Proxy {
    fn start(target: String) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        // Backlog 0: the accept queue holds one connection; a SYN beyond it
        // is dropped (the client retries after 1 s, 3 s, ...).
        // SAFETY: listen(2) on a socket this listener owns; no memory is passed.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let accepting = Arc::new(AtomicBool::new(true));
        let frozen = Arc::new(AtomicBool::new(false));
        let rate = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let held_below = Arc::new(AtomicU64::new(0));
        let (a, f, r, n, h) = (accepting.clone(), frozen.clone(), rate.clone(), accepted.clone(), held_below.clone());
        std::thread::spawn(move || {
            loop {
                if !a.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                match l.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        let t = TcpStream::connect(&target).unwrap();
                        let (c2, t2) = (c.try_clone().unwrap(), t.try_clone().unwrap());
                        let seq = n.fetch_add(1, Ordering::AcqRel);
                        let w = Wire { frozen: f.clone(), rate: r.clone(), seq, held_below: h.clone() };
                        let w2 = w.clone();
                        std::thread::spawn(move || pump(c, t, w));
                        std::thread::spawn(move || pump(t2, c2, w2));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Proxy { addr, accepting, frozen, rate, accepted, held_below }
    }

    /// Keep every connection accepted so far frozen (until
    /// [`Proxy::release_held`]); later ones follow `frozen`.
    fn hold_existing(&self) {
        self.held_below.store(self.accepted.load(Ordering::Acquire), Ordering::Release);
    }

    fn release_held(&self) {
        self.held_below.store(0, Ordering::Release);
    }
}

struct Setup {
    init: TcpTransport,
    _target: TcpTransport,
    proxy: Proxy,
    peer: PeerId,
    src: Arc<HostBuffer>,
    dst: Arc<HostBuffer>,
    lkey: LocalKey,
    rkey: RemoteKey,
    /// The target's connection info, its address the proxy's.
    info: Vec<u8>,
}

const MIB: u64 = 1 << 20;

fn setup(timeout: Duration) -> Setup {
    setup_with(timeout, 2)
}

/// Initiator and target joined through a proxy, `conns` connections per
/// peer, 64 MiB buffers each side.
fn setup_with(timeout: Duration, conns: usize) -> Setup {
    let cfg = TransportConfig {
        peer_timeout: timeout,
        options: vec![("conns_per_peer".into(), conns.to_string())],
        ..Default::default()
    };
    let mut init = TcpTransport::new("init", &cfg).unwrap();
    let mut target = TcpTransport::new("target", &cfg).unwrap();
    let src = Arc::new(HostBuffer::new((64 * MIB) as usize).unwrap());
    let dst = Arc::new(HostBuffer::new((64 * MIB) as usize).unwrap());
    let lkey = init.register(src.clone()).unwrap().lkey;
    let rkey = target.register(dst.clone()).unwrap().rkey;
    let mut info = TcpConnectionInfo::decode(&target.connection_info()).unwrap();
    let proxy = Proxy::start(info.addr.clone());
    info.addr = proxy.addr.clone();
    let info = info.encode();
    let peer = init.connect("target", &info, &[]).unwrap();
    Setup { init, _target: target, proxy, peer, src, dst, lkey, rkey, info }
}

impl Setup {
    fn post(&mut self, id: u64, segs: &[(u64, u64, RemoteKey)]) {
        let segments = segs
            .iter()
            .map(|&(off, len, rkey)| Segment {
                local_addr: self.src.addr() + off,
                remote_addr: self.dst.addr() + off,
                len_bytes: len,
                lkey: self.lkey,
                rkey,
            })
            .collect();
        self.init
            .post(PostRequest { xfer: XferId(id), op: Op::Write, peer: self.peer, segments, notification: None })
            .unwrap();
    }

    /// Cut both connections: a 2-chunk WRITE stuck on a frozen wire, cancelled.
    fn cut(&mut self, id: u64, n: u64) {
        let ok = completion(&mut self.init, Duration::from_secs(0));
        assert!(ok.is_none(), "{ok:?}");
        self.proxy.frozen.store(true, Ordering::Release);
        let r = self.rkey;
        let segs: Vec<_> = (0..n).map(|i| (i * 4 * MIB, 4 * MIB, r)).collect();
        self.post(id, &segs);
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        self.init.cancel(XferId(id));
        assert!(t0.elapsed() < Duration::from_secs(1), "the cut cancel took {:?}", t0.elapsed());
        self.proxy.frozen.store(false, Ordering::Release);
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A transfer refused by the target (unknown rkey) while another worker of
/// the same peer redials: the refusal fails that transfer only; the redial
/// of the other worker does not take it as the peer's fault, and the
/// healthy peer takes the next transfer.
#[test]
fn a_refused_transfer_during_a_redial_does_not_kill_the_peer() {
    let mut s = setup(Duration::from_secs(5));
    s.post(1, &[(0, MIB, s.rkey)]);
    assert_eq!(completion(&mut s.init, Duration::from_secs(5)).unwrap().result, Ok(()));
    // One worker's connection cut: it redials before its next chunk.
    s.cut(2, 1);
    // Hold the proxy's accept queue full: the redial's SYN is dropped and
    // retried after 1 s; meanwhile the other worker's chunk of the same
    // transfer is refused (unknown rkey) on its intact connection.
    s.proxy.accepting.store(false, Ordering::Release);
    let _filler = TcpStream::connect(&s.proxy.addr).unwrap();
    let bad = RemoteKey(999);
    s.post(3, &[(0, 4 * MIB, bad), (4 * MIB, 4 * MIB, bad)]);
    std::thread::sleep(Duration::from_millis(300));
    s.proxy.accepting.store(true, Ordering::Release);
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 3 completes");
    println!("refused transfer: {c:?}");
    assert!(c.result.is_err());
    // The peer is alive and well: a good transfer must go through.
    std::thread::sleep(Duration::from_millis(200));
    let segments = vec![Segment {
        local_addr: s.src.addr(),
        remote_addr: s.dst.addr(),
        len_bytes: MIB,
        lkey: s.lkey,
        rkey: s.rkey,
    }];
    let posted =
        s.init.post(PostRequest { xfer: XferId(4), op: Op::Write, peer: s.peer, segments, notification: None });
    assert!(posted.is_ok(), "a post to the healthy peer was refused: {posted:?}");
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 4 completes");
    assert_eq!(c.result, Ok(()), "a live transfer to the healthy peer failed");
}

/// Cut both connections, then hold the proxy's accept queue full so that
/// the workers' redials for transfer 3 sit in a TCP connect that does not
/// complete (SYNs dropped); returns once they are in it.
fn stuck_in_redial(timeout: Duration) -> (Setup, TcpStream) {
    let mut s = setup(timeout);
    s.post(1, &[(0, MIB, s.rkey)]);
    assert_eq!(completion(&mut s.init, Duration::from_secs(5)).unwrap().result, Ok(()));
    s.cut(2, 2);
    s.proxy.accepting.store(false, Ordering::Release);
    let filler = TcpStream::connect(&s.proxy.addr).unwrap();
    let r = s.rkey;
    s.post(3, &[(0, 4 * MIB, r), (4 * MIB, 4 * MIB, r)]);
    std::thread::sleep(Duration::from_millis(300));
    (s, filler)
}

/// A cancel while the workers redial a peer that completes no TCP handshake
/// returns at once (not after the peer timeout), and the peer stays usable.
#[test]
fn a_cancel_during_a_redials_connect_returns_at_once() {
    let (mut s, filler) = stuck_in_redial(Duration::from_secs(4));
    let t0 = Instant::now();
    s.init.cancel(XferId(3));
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "a cancel during a redial's connect took {took:?}");
    assert!(completion(&mut s.init, Duration::from_millis(200)).is_none(), "a cancelled transfer reported");
    // Listener back: the peer was never at fault and takes the next transfer.
    drop(filler);
    s.proxy.accepting.store(true, Ordering::Release);
    s.src.fill_with(0, MIB as usize, |_| 0x5a);
    let r = s.rkey;
    s.post(4, &[(0, MIB, r)]);
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 4 completes");
    assert_eq!(c.result, Ok(()), "a live transfer after the cancelled redial failed");
    assert!(s.dst.eq_at(0, &[0x5a; MIB as usize]), "xfer 4's bytes did not land");
}

/// Releases of many transfers, one after another, while the workers sit in
/// a redial's connect to a peer whose accept queue is full (what
/// `get_batch_transfer_status` does with hundreds of batches to a stopped
/// peer): a worker still connecting has touched nothing of its transfer, so
/// no release waits for it (each waited up to one 50 ms connect slice, as
/// the worker then redialled for the next transfer: 400 batches of 8 MiB to
/// a SIGSTOPped `mooncake` peer took 16.8 s past their timeout). The peer
/// stays usable and the released transfers wrote nothing.
#[test]
fn releases_while_the_workers_sit_in_a_redials_connect_wait_for_none_of_them() {
    let (mut s, filler) = stuck_in_redial(Duration::from_secs(20));
    let r = s.rkey;
    for id in 4..104u64 {
        s.post(id, &[(16 * MIB + (id - 4) * 64 * 1024, 64 * 1024, r)]);
    }
    let t0 = Instant::now();
    for id in 3..104u64 {
        s.init.cancel(XferId(id));
    }
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "101 releases during a redial's connect took {took:?}");
    assert!(completion(&mut s.init, Duration::from_millis(200)).is_none(), "a cancelled transfer reported");
    drop(filler);
    s.proxy.accepting.store(true, Ordering::Release);
    s.src.fill_with(32 * MIB as usize, MIB as usize, |_| 0x6b);
    s.post(200, &[(32 * MIB, MIB, r)]);
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 200 completes");
    assert_eq!((c.xfer, c.result), (XferId(200), Ok(())));
    assert!(s.dst.eq_at(32 * MIB as usize, &[0x6b; MIB as usize]), "xfer 200's bytes did not land");
    assert!(s.dst.eq_at(16 * MIB as usize, &[0; 100 * 64 * 1024]), "a released transfer wrote");
}

/// A disconnect while the workers redial a peer that completes no TCP
/// handshake returns at once, and the transfer in the redial fails.
#[test]
fn a_disconnect_during_a_redials_connect_returns_at_once() {
    let (mut s, _filler) = stuck_in_redial(Duration::from_secs(4));
    let t0 = Instant::now();
    s.init.disconnect(s.peer);
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "a disconnect during a redial's connect took {took:?}");
    let c = completion(&mut s.init, Duration::from_secs(1)).expect("xfer 3 reports");
    assert!(c.result.is_err(), "xfer 3 to a disconnected peer: {c:?}");
}

/// Dropping the transport while its workers redial a peer that completes no
/// TCP handshake returns at once.
#[test]
fn a_drop_during_a_redials_connect_returns_at_once() {
    let (s, _filler) = stuck_in_redial(Duration::from_secs(4));
    let Setup { init, .. } = s;
    let t0 = Instant::now();
    drop(init);
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "a drop during a redial's connect took {took:?}");
}

/// A first transfer whose 1 MiB WRITE completes (the connections are open).
fn warmed(timeout: Duration, conns: usize) -> Setup {
    let mut s = setup_with(timeout, conns);
    s.post(1, &[(0, MIB, s.rkey)]);
    assert_eq!(completion(&mut s.init, Duration::from_secs(5)).unwrap().result, Ok(()));
    s
}

/// The cancel of a transfer whose chunk is only queued, behind another
/// transfer's chunks stuck on a frozen wire, returns at once: a queued
/// chunk is skipped when a worker reaches it, nothing waits for it (it
/// waited for the stuck chunks' socket timeout, 4.85 s).
#[test]
fn a_cancel_of_a_transfer_queued_behind_a_stalled_one_returns_at_once() {
    let mut s = warmed(Duration::from_secs(5), 2);
    s.proxy.frozen.store(true, Ordering::Release);
    let r = s.rkey;
    s.post(10, &[(0, 4 * MIB, r), (4 * MIB, 4 * MIB, r)]); // both workers stuck
    std::thread::sleep(Duration::from_millis(300));
    s.post(11, &[(8 * MIB, MIB, r)]); // queued behind
    let t0 = Instant::now();
    s.init.cancel(XferId(11));
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "the cancel of a queued transfer took {took:?}");
    s.init.cancel(XferId(10));
    s.proxy.frozen.store(false, Ordering::Release);
    assert!(completion(&mut s.init, Duration::from_millis(300)).is_none(), "a cancelled transfer reported");
    // The skipped chunk moved nothing; the peer takes the next transfer.
    s.src.fill_with(16 * MIB as usize, MIB as usize, |_| 0x3c);
    s.post(12, &[(16 * MIB, MIB, r)]);
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 12 completes");
    assert_eq!((c.xfer, c.result), (XferId(12), Ok(())));
    assert!(s.dst.eq_at(16 * MIB as usize, &[0x3c; MIB as usize]), "xfer 12's bytes did not land");
    assert!(s.dst.eq_at(8 * MIB as usize, &[0; MIB as usize]), "the cancelled queued transfer wrote");
}

/// As above behind a slow but live transfer (no socket timeout ever
/// fires): the cancel of the queued transfer does not wait for the 32 MiB
/// ahead of it (it did: 1.98 s), and the transfer ahead completes.
#[test]
fn a_cancel_of_a_transfer_queued_behind_a_slow_one_returns_at_once() {
    let mut s = warmed(Duration::from_secs(20), 2);
    s.proxy.rate.store(8 << 20, Ordering::Relaxed);
    let r = s.rkey;
    let segs: Vec<_> = (0..8).map(|i| (i * 4 * MIB, 4 * MIB, r)).collect();
    s.post(10, &segs);
    std::thread::sleep(Duration::from_millis(300));
    s.post(11, &[(40 * MIB, MIB, r)]);
    let t0 = Instant::now();
    s.init.cancel(XferId(11));
    let took = t0.elapsed();
    s.proxy.rate.store(0, Ordering::Relaxed);
    assert!(took < Duration::from_secs(1), "the cancel of a queued transfer took {took:?}");
    let c = completion(&mut s.init, Duration::from_secs(20)).expect("xfer 10 completes");
    assert_eq!((c.xfer, c.result), (XferId(10), Ok(())));
}

/// Releases one after another of WRITEs on the wire to a stopped peer (what
/// `get_batch_transfer_status` does with the rest of a batch): the first
/// waits one grace and marks the peer stalled, the next cut at once (each
/// waited the 500 ms grace: 4.0 s for 8). A completed transfer afterwards
/// clears the mark.
#[test]
fn releases_one_after_another_to_a_stalled_peer_wait_one_grace() {
    let mut s = warmed(Duration::from_secs(30), 8);
    s.proxy.frozen.store(true, Ordering::Release);
    let r = s.rkey;
    for i in 0..8u64 {
        s.post(10 + i, &[(i * 4 * MIB, 4 * MIB, r)]);
    }
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    for i in 0..8u64 {
        s.init.cancel(XferId(10 + i));
    }
    let took = t0.elapsed();
    s.proxy.frozen.store(false, Ordering::Release);
    assert!(took < Duration::from_millis(2000), "8 releases to a stalled peer took {took:?}");
    s.src.fill_with(0, MIB as usize, |_| 0x77);
    s.post(20, &[(0, MIB, r)]);
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 20 completes");
    assert_eq!((c.xfer, c.result), (XferId(20), Ok(())));
    assert!(s.dst.eq_at(0, &[0x77; MIB as usize]), "xfer 20's bytes did not land");
}

/// With the old connections' bytes (0x11, bound for `..stale_end`) held by
/// the proxy: let new connections flow, run `reconnect`, WRITE 4 MiB of 0x77
/// at offset 0 as xfer 20 and check it landed; then release the held bytes
/// and return how many of them landed after it (anywhere in `..stale_end`,
/// or over xfer 20's bytes, which fails at once).
fn late_bytes_over_a_later_write(s: &mut Setup, stale_end: u64, reconnect: impl FnOnce(&mut Setup)) -> usize {
    s.proxy.hold_existing();
    // What each pump had already read when the wire froze (up to 16 KiB a
    // connection) landed before, beyond xfer 20's 4 MiB.
    let stale = |s: &Setup| s.dst.to_vec((4 * MIB) as usize..stale_end as usize).iter().filter(|&&b| b == 0x11).count();
    let landed_before = stale(s);
    s.proxy.frozen.store(false, Ordering::Release);
    reconnect(s);
    s.src.fill_with(0, (4 * MIB) as usize, |_| 0x77);
    s.post(20, &[(0, 4 * MIB, s.rkey)]);
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 20 completes");
    assert_eq!((c.xfer, c.result), (XferId(20), Ok(())));
    assert!(s.dst.eq_at(0, &[0x77; (4 * MIB) as usize]), "xfer 20's bytes did not land");
    s.proxy.release_held();
    std::thread::sleep(Duration::from_millis(1000));
    assert!(s.dst.eq_at(0, &[0x77; (4 * MIB) as usize]), "late bytes of a cut connection landed over xfer 20's");
    stale(s) - landed_before
}

/// The bytes of a cancelled WRITE still on their way when cancel returned
/// (here held by the proxy, as by a stopped target's receive path or a
/// middlebox) never land after, and over, the bytes of a later WRITE to the
/// same place: the later transfer's chunks first fence the cut connections
/// (wire v4 FENCE), and the target takes no more data from them. Without
/// the fence the held 0x11 bytes land over xfer 20's 0x77 once released.
#[test]
fn a_cancelled_writes_late_bytes_never_overwrite_a_later_write() {
    let mut s = warmed(Duration::from_secs(30), 4);
    s.proxy.frozen.store(true, Ordering::Release);
    let r = s.rkey;
    s.src.fill_with(0, (16 * MIB) as usize, |_| 0x11);
    for i in 0..4u64 {
        s.post(10 + i, &[(i * 4 * MIB, 4 * MIB, r)]);
    }
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..4u64 {
        s.init.cancel(XferId(10 + i));
    }
    // The four cut connections stay held; xfer 20 is one chunk: one redial
    // (the proxy's backlog of 0 makes several at once slow), whose fence
    // names all four cuts.
    let late = late_bytes_over_a_later_write(&mut s, 16 * MIB, |_| {});
    assert_eq!(late, 0, "{late} late bytes of the cancelled WRITEs landed after xfer 20");
    // The peer is whole: another transfer goes through.
    s.post(21, &[(4 * MIB, MIB, r)]);
    let c = completion(&mut s.init, Duration::from_secs(10)).expect("xfer 21 completes");
    assert_eq!((c.xfer, c.result), (XferId(21), Ok(())));
}

/// A `disconnect` while WRITEs are on the wire, then a `connect` to the
/// same target: the new peer's first chunk fences the connections the old
/// one left with a request on the way (the fence list belongs to the
/// target, not to one connect), so their late bytes, held by the proxy
/// until after the new peer's WRITE to the same offset, never land over it.
#[test]
fn a_reconnect_fences_what_the_old_peer_left_on_the_wire() {
    let mut s = warmed(Duration::from_secs(30), 2);
    s.proxy.frozen.store(true, Ordering::Release);
    let r = s.rkey;
    s.src.fill_with(0, (8 * MIB) as usize, |_| 0x11);
    s.post(10, &[(0, 4 * MIB, r), (4 * MIB, 4 * MIB, r)]);
    std::thread::sleep(Duration::from_millis(300));
    s.init.disconnect(s.peer);
    let c = completion(&mut s.init, Duration::from_secs(5)).expect("the disconnect fails xfer 10");
    assert_eq!(c.xfer, XferId(10));
    assert!(c.result.is_err(), "{c:?}");
    let fenced = || kvwire::metrics::link("tcp", "tcp").map_or(0, |c| c.fenced.load(Ordering::Relaxed));
    let before = fenced();
    let late = late_bytes_over_a_later_write(&mut s, 8 * MIB, |s| {
        s.peer = s.init.connect("target", &s.info.clone(), &[]).unwrap();
    });
    assert_eq!(late, 0, "{late} late bytes of the old peer's WRITE landed after xfer 20");
    // The target counted what it fenced (other tests here may add to it).
    assert!(fenced() > before, "kvwire_fenced_connections_total did not move");
}

/// Post an 8 MiB WRITE `id` (two 4 MiB chunks) to a target the proxy
/// throttles to 4 MiB/s a connection, release it mid-chunk, and return how
/// many of its bytes landed in the following 2 s.
fn landed_after_release_of_a_slow_write(s: &mut Setup, id: u64) -> usize {
    let n = 8 * MIB as usize;
    s.src.fill_with(0, n, |_| 0xab);
    s.dst.fill_with(0, n, |_| 0);
    s.proxy.rate.store(4 << 20, Ordering::Relaxed);
    let r = s.rkey;
    s.post(id, &[(0, 4 * MIB, r), (4 * MIB, 4 * MIB, r)]);
    std::thread::sleep(Duration::from_millis(200));
    s.init.cancel(XferId(id));
    let landed = |s: &Setup| s.dst.to_vec(0..n).iter().filter(|&&b| b == 0xab).count();
    let at_release = landed(s);
    std::thread::sleep(Duration::from_secs(2));
    let later = landed(s);
    s.proxy.rate.store(0, Ordering::Relaxed);
    assert!(completion(&mut s.init, Duration::from_millis(200)).is_none(), "a cancelled transfer reported");
    later - at_release
}

/// A WRITE to a slow but live target (4 MiB/s a connection), released
/// mid-chunk: release returns once the target has taken and acknowledged
/// what was on the wire, so no byte lands after it (2.9 MB did with a fixed
/// 500 ms grace).
#[test]
fn a_released_write_to_a_slow_live_target_lands_nothing_after_release() {
    let mut s = warmed(Duration::from_secs(20), 2);
    let late = landed_after_release_of_a_slow_write(&mut s, 20);
    assert_eq!(late, 0, "{late} bytes landed after release returned");
}

/// A stall seen by one release is not held against the peer for long: once
/// it runs again, a later release of a WRITE to it waits for the chunk on
/// the wire as for any live target (it does not cut at once), so no byte
/// lands after it.
#[test]
fn a_peer_that_recovered_from_a_stall_is_not_cut_at_once() {
    let mut s = warmed(Duration::from_secs(20), 2);
    s.proxy.frozen.store(true, Ordering::Release);
    let r = s.rkey;
    s.post(10, &[(16 * MIB, 4 * MIB, r), (20 * MIB, 4 * MIB, r)]);
    std::thread::sleep(Duration::from_millis(300));
    s.init.cancel(XferId(10)); // the grace ends on no progress: stalled
    s.proxy.frozen.store(false, Ordering::Release);
    std::thread::sleep(Duration::from_millis(1500));
    let late = landed_after_release_of_a_slow_write(&mut s, 20);
    assert_eq!(late, 0, "{late} bytes landed after release returned");
}
