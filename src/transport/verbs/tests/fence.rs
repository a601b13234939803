//! The verbs side of the late-bytes fence (handshake v6, docs/VERBS.md):
//! a WRITE whose packets a stalled fabric held past its flush never lands
//! over a later transfer to the same target, over the real handshake on
//! the simulated NIC ([`SimFabric::hold_wire`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::HostBuffer;
use crate::transport::verbs::sim::{HandshakeRelay, SimFabric, SimNic};
use crate::transport::verbs::{VerbsInfo, VerbsTransport, conn};
use crate::transport::{
    Completion, MemoryBacking, Op, PeerId, PostRequest, RemoteRegion, Segment, Transport, TransportConfig, XferId,
};
use crate::verbs::QpEndpoint;

use super::sim_harness::{Opts, Pair};
use crate::transport::verbs::conn::RECVS_PER_QP;

/// `device` only names the metrics' `nic` label on the simulated NIC.
fn config(peer_timeout_ms: u64, device: &str) -> TransportConfig {
    TransportConfig {
        peer_timeout: Duration::from_millis(peer_timeout_ms),
        options: vec![("device".into(), device.into())],
        ..Default::default()
    }
}

/// Connections the target on `device` fenced so far.
fn fenced(device: &str) -> u64 {
    crate::metrics::link("verbs", device).map_or(0, |c| c.fenced.load(Ordering::Relaxed))
}

fn filled(len: usize, byte: u8) -> Arc<HostBuffer> {
    let b = Arc::new(HostBuffer::new(len).unwrap());
    b.fill_with(0, len, |_| byte);
    b
}

fn completion(t: &mut VerbsTransport<SimNic>, x: u64) -> Completion {
    let mut out = Vec::new();
    let t0 = Instant::now();
    loop {
        t.wait(&mut out, Duration::from_millis(10));
        if let Some(c) = out.iter().find(|c| c.xfer == XferId(x)) {
            return c.clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no completion of xfer {x}: {out:?}");
    }
}

const LEN: usize = 64 << 10;

/// Initiator `i` connected to target `t` through a relay; the target's
/// buffer (zeroes), and the initiator's two sources (`0xAA`, `0xBB`).
struct Setup {
    fabric: SimFabric,
    i: VerbsTransport<SimNic>,
    t: VerbsTransport<SimNic>,
    relay: HandshakeRelay,
    /// The target's connection info naming the relay.
    via: Vec<u8>,
    /// The target's device label (unique per test).
    label: String,
    /// Connections of `i` the target should serve once fenced ones left.
    live: usize,
    peer: PeerId,
    dst: Arc<HostBuffer>,
    segs: [Segment; 2],
    _src: [Arc<HostBuffer>; 2],
}

fn setup(seed: u64) -> Setup {
    let fabric = SimFabric::new(seed);
    fabric.world().auto_step = 64;
    let label = format!("sim-fence-{seed}");
    let mut t = VerbsTransport::on_sim("t", &config(30_000, &label), &fabric).unwrap();
    let mut i = VerbsTransport::on_sim("i", &config(300, "sim-fence-i"), &fabric).unwrap();
    let dst = filled(LEN, 0);
    let treg = t.register(dst.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: treg.rkey, kind: d.kind, device_id: 0 };
    let src = [filled(LEN, 0xAA), filled(LEN, 0xBB)];
    let segs = src.clone().map(|s| {
        let lkey = i.register(s.clone()).unwrap().lkey;
        Segment { local_addr: s.addr(), lkey, remote_addr: d.addr, rkey: treg.rkey, len_bytes: LEN as u64 }
    });
    let (relay, via) = HandshakeRelay::start(&t.connection_info()).unwrap();
    let peer = i.connect("t", &via, &[region]).unwrap();
    Setup { fabric, i, t, relay, via, label, live: 1, peer, dst, segs, _src: src }
}

impl Setup {
    /// Set every byte of the target's buffer to `b`.
    fn fill(&self, b: u8) {
        self.dst.fill_with(0, LEN, |_| b);
    }
}

fn write(s: &mut Setup, x: u64, seg: Segment) {
    s.i.post(PostRequest { xfer: XferId(x), op: Op::Write, peer: s.peer, segments: vec![seg], notification: None })
        .unwrap();
}

/// The first WRITE goes on a held wire and the initiator gives up on it
/// (`cut`: a cancel, which flushes its QP after `peer_timeout`, or a
/// `disconnect` + `connect`); the target never saw the old control
/// connection close. A second WRITE to the same bytes then completes over
/// new QPs, and the fabric delivers what it held: `(landed, dropped)`, and
/// whether the second WRITE's bytes are still there.
fn late_bytes_after(s: &mut Setup, x: u64, cut: impl FnOnce(&mut Setup, u64)) -> ((usize, usize), bool) {
    s.relay.hold_close(true);
    let dev = s.i.inner.nic.dev();
    s.fabric.hold_wire(dev);
    let (first, second) = (s.segs[0], s.segs[1]);
    write(s, x, first);
    let t0 = Instant::now();
    while s.fabric.on_wire() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the first WRITE never went on the wire");
        std::thread::sleep(Duration::from_millis(1));
    }
    cut(s, x);
    write(s, x + 1, second);
    assert!(completion(&mut s.i, x + 1).result.is_ok(), "the second WRITE completes over new QPs");
    assert!(s.dst.to_vec(..).iter().all(|&b| b == 0xBB), "the second WRITE landed");
    // The fence shut the replaced control connection on the target's side:
    // its thread gave the QPs and the name hold back, though the
    // initiator's close is still held.
    let t0 = Instant::now();
    while s.t.inner.names.connections("i") > s.live {
        assert!(t0.elapsed() < Duration::from_secs(10), "the fenced connection is still served");
        std::thread::sleep(Duration::from_millis(5));
    }
    let delivered = s.fabric.release_wire();
    let intact = s.dst.to_vec(..).iter().all(|&b| b == 0xBB);
    s.relay.hold_close(false);
    (delivered, intact)
}

#[test]
fn a_cancelled_writes_held_packets_never_land_over_a_later_write() {
    let mut s = setup(41);
    let r = late_bytes_after(&mut s, 1, |s, x| s.i.cancel(XferId(x)));
    none_landed(&s, r, 1);
}

/// Nothing of what the wire held landed (and something was on it), and
/// the target fenced `fences` connections in all.
fn none_landed(s: &Setup, (delivered, intact): ((usize, usize), bool), fences: u64) {
    assert_eq!(delivered.0, 0, "late bytes landed: {delivered:?}");
    assert!(delivered.1 > 0, "nothing was on the wire: the test tested nothing");
    assert!(intact, "the cut connection's WRITE overwrote the later one");
    assert_eq!(fenced(&s.label), fences, "connections fenced");
}

#[test]
fn a_reconnect_fences_what_the_old_connection_left_on_the_wire() {
    let mut s = setup(42);
    let r = late_bytes_after(&mut s, 1, reconnect);
    none_landed(&s, r, 1);
}

/// `disconnect` + `connect` of the peer.
fn reconnect(s: &mut Setup, _: u64) {
    let d = s.dst.desc();
    let region =
        RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: s.segs[1].rkey, kind: d.kind, device_id: 0 };
    s.i.disconnect(s.peer);
    s.peer = s.i.connect("t", &s.via, &[region]).unwrap();
}

/// The connection a reconnect made (after a cancel) is the one a later
/// `disconnect` fences: the peer's connection id follows its reconnects.
#[test]
fn a_disconnect_after_a_reconnect_fences_the_connection_the_reconnect_made() {
    let mut s = setup(44);
    let r = late_bytes_after(&mut s, 1, |s, x| s.i.cancel(XferId(x)));
    none_landed(&s, r, 1);
    s.fill(0);
    let r = late_bytes_after(&mut s, 3, reconnect);
    none_landed(&s, r, 2);
}

/// A `connect` to a target that one of the transport's peers reached over
/// QPs that failed since (and were never recovered) fences that peer's
/// connection: its flushed WRITE cannot land over a transfer of the new
/// peer.
#[test]
fn a_new_connect_fences_a_broken_peers_connection_to_the_same_target() {
    let mut s = setup(46);
    let r = late_bytes_after(&mut s, 1, |s, x| {
        s.i.cancel(XferId(x));
        let d = s.dst.desc();
        let region =
            RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: s.segs[1].rkey, kind: d.kind, device_id: 0 };
        // The broken peer stays (its QPs in error); a second one connects.
        s.peer = s.i.connect("t", &s.via, &[region]).unwrap();
    });
    none_landed(&s, r, 1);
}

/// A fenced receive QP keeps its CQE reservation until its flushed
/// receives came back: removed before, it is destroyed (and gives the
/// CQEs back) only once they were polled, so the CQ never holds more than
/// was reserved.
#[test]
fn a_fenced_receive_qp_keeps_its_reservation_until_its_flushes_came_back() {
    let mut p = Pair::new(45, Opts::default());
    let q = p.t.st.recv_qpns()[0];
    let reserved = p.t.st.cq().recv_reserved();
    assert_eq!(reserved, RECVS_PER_QP);
    p.t.st.fence_recv_qp(q);
    // The flushes are in the CQ, not yet polled.
    let kept = p.t.st.remove_recv_qp(q, RECVS_PER_QP);
    p.t.st.release_recv_cqes(RECVS_PER_QP - kept, &p.limits);
    assert_eq!(kept, RECVS_PER_QP, "its reservation was given back with its flushes still to come");
    assert_eq!(p.t.st.recv_qpns(), vec![q], "destroyed before its flushes came back");
    p.drain_cqs();
    assert_eq!(p.t.st.cq().recv_reserved(), 0);
    assert!(p.t.st.recv_qpns().is_empty());
    p.invariants();
}

/// A hello naming connection ids (`replaces`) fences only connections of
/// its own agent and session: another initiator that proves the secret
/// and names every id cuts nothing of `i`'s.
#[test]
fn a_hello_from_another_initiator_fences_none_of_this_ones_connections() {
    let mut s = setup(43);
    let real: VerbsInfo = postcard::from_bytes(&s.t.connection_info()).unwrap();
    let nic = s.fabric.new_device(64);
    let qp = crate::transport::verbs::nic::Nic::create_qp(&nic, 4, 1).unwrap();
    let ep: QpEndpoint = crate::transport::verbs::device::Device::endpoint(&nic, &qp, &s.i.inner.qp_options).unwrap();
    let every: Vec<u64> = (0..conn::MAX_REPLACES as u64).collect();
    let caller = conn::Caller { agent: "mallory", session: 7, conn: 1, replaces: &every };
    let r = conn::handshake(&real.addr, &caller, &real.secret, &[ep], Duration::from_secs(5));
    let (_, _ch) = r.map_err(|e| e.to_string()).expect("a proven hello is served");
    let seg = s.segs[1];
    write(&mut s, 1, seg);
    assert!(completion(&mut s.i, 1).result.is_ok(), "the other initiator's fence cut this one's QPs");
    assert!(s.dst.to_vec(..).iter().all(|&b| b == 0xBB));
    assert_eq!(fenced(&s.label), 0, "nothing fenced");
    // Over the bound: the hello does not parse (before its proof) and is
    // dropped; nothing is served.
    let over: Vec<u64> = (0..=conn::MAX_REPLACES as u64).collect();
    let caller = conn::Caller { agent: "mallory", session: 7, conn: 2, replaces: &over };
    if conn::handshake(&real.addr, &caller, &real.secret, &[ep], Duration::from_secs(5)).is_ok() {
        panic!("a hello naming {} ids was served", over.len());
    }
}
