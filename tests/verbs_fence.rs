//! The verbs late-bytes fence (handshake version 6, docs/VERBS.md "The
//! late-bytes fence") on a real RDMA device (Soft-RoCE in CI: rxe0 ↔ rxe1).
//!
//! A fabric cannot be made to hold packets here (the simulated NIC's
//! `transport::verbs::tests::fence` shows the late bytes dropped); this
//! shows the fence itself on real QPs: through a relay that holds the old
//! control connection's close (so the target keeps the old receive QPs in
//! RTS), a `disconnect` + `connect` names the old connection, the target
//! moves its receive QPs to the error state (`ibv_modify_qp` to ERR, their
//! receives flushed) before it answers, counts it
//! (`kvwire_fenced_connections_total`), and the new connection carries a
//! WRITE and its notification. Its own binary: the counter is per device,
//! and no other test here fences on it meanwhile.

mod verbs_util;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::transport::verbs::sim::HandshakeRelay;
use kvwire::transport::{
    self, MemoryBacking, Notification, Op, PeerId, PostRequest, RemoteRegion, Segment, Transport, TransportKind, XferId,
};
use verbs_util::{WAIT, config, wait_completion};

/// WRITE `seg` with notification `note` as `x`; Ok, and the target got
/// exactly that notification.
fn write_notified(i: &mut Box<dyn Transport>, t: &mut Box<dyn Transport>, peer: PeerId, seg: Segment, x: u64) {
    let note = format!("n{x}").into_bytes();
    let req =
        PostRequest { xfer: XferId(x), op: Op::Write, peer, segments: vec![seg], notification: Some(note.clone()) };
    i.post(req).unwrap();
    assert_eq!(wait_completion(i, XferId(x)).result, Ok(()), "xfer {x}");
    let mut n: Vec<Notification> = Vec::new();
    let t0 = Instant::now();
    while n.is_empty() && t0.elapsed() < WAIT {
        t.take_notifications(&mut n);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(n.iter().map(|n| n.payload.clone()).collect::<Vec<_>>(), vec![note], "xfer {x}'s notification");
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn verbs_a_reconnect_fences_the_old_connections_receive_qps_and_carries_on() {
    let (tdev, idev) = need_devices!();
    let fenced = || kvwire::metrics::link("verbs", &tdev).map_or(0, |c| c.fenced.load(Ordering::Relaxed));
    let mut t = transport::create(TransportKind::Verbs, "t-fence", &config(&tdev, &[])).unwrap();
    let mut i = transport::create(TransportKind::Verbs, "i-fence", &config(&idev, &[])).unwrap();
    let len = 1 << 14;
    let dst = Arc::new(HostBuffer::new(len).unwrap());
    let src = Arc::new(HostBuffer::new(len).unwrap());
    let treg = t.register(dst.clone()).unwrap();
    let ireg = i.register(src.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: treg.rkey, kind: d.kind, device_id: 0 };
    let seg = Segment {
        local_addr: src.addr(),
        lkey: ireg.lkey,
        remote_addr: d.addr,
        rkey: treg.rkey,
        len_bytes: len as u64,
    };
    let (relay, via) = HandshakeRelay::start(&t.connection_info()).unwrap();
    let before = fenced();
    src.fill_with(0, len, |_| 0xAA);
    let peer = i.connect("t-fence", &via, &[region]).unwrap();
    write_notified(&mut i, &mut t, peer, seg, 1);
    // The old control connection's close never reaches the target.
    relay.hold_close(true);
    i.disconnect(peer);
    src.fill_with(0, len, |_| 0xBB);
    let peer = i.connect("t-fence", &via, &[region]).unwrap();
    assert_eq!(fenced() - before, 1, "the reconnect fenced the old connection");
    write_notified(&mut i, &mut t, peer, seg, 2);
    assert!(dst.to_vec(..).iter().all(|&b| b == 0xBB), "the new connection's WRITE landed");
    // A reconnect with nothing left to fence fences nothing.
    relay.hold_close(false);
    i.disconnect(peer);
    // (The target sees that close at once; give the slow guest a second.)
    std::thread::sleep(Duration::from_secs(1));
    let peer = i.connect("t-fence", &via, &[region]).unwrap();
    write_notified(&mut i, &mut t, peer, seg, 3);
    assert_eq!(fenced() - before, 1, "{} fences", fenced() - before);
}
