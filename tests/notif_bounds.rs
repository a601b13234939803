//! Issue 27 item 3: a target that does not drain its notifications keeps
//! them under the configured bound (count and bytes); the senders of the
//! rest see their transfers fail with `FailureKind::Overloaded` (the same
//! kind on shm and tcp), nothing is dropped silently, and the refusals are
//! counted in the metrics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::transport::{
    self, Completion, FailureKind, MemoryBacking, Notification, Op, PostRequest, RemoteRegion, Segment, Transport,
    TransportConfig, TransportKind, XferId,
};

fn completions(t: &mut dyn Transport, n: usize) -> Vec<Completion> {
    let t0 = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(t0.elapsed() < Duration::from_secs(20), "{} of {n} completions", out.len());
        t.wait(&mut out, Duration::from_millis(20));
    }
    out
}

fn flood(kind: TransportKind) {
    let bound_count = 8usize;
    let payload = 100usize;
    let cfg = |opts: Vec<(String, String)>| TransportConfig {
        peer_timeout: Duration::from_secs(3),
        options: opts,
        ..Default::default()
    };
    let mut target = transport::create(
        kind,
        "target",
        &cfg(vec![("notif_queue_count".into(), bound_count.to_string()), ("notif_queue_bytes".into(), "1000".into())]),
    )
    .unwrap();
    let mut init = transport::create(kind, "init", &cfg(vec![])).unwrap();
    let src = Arc::new(HostBuffer::new(4096).unwrap());
    let dst = Arc::new(HostBuffer::new(4096).unwrap());
    let l = init.register(src.clone()).unwrap();
    let r = target.register(dst.clone()).unwrap();
    let d = dst.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: r.rkey, kind: d.kind, device_id: 0 };
    let peer = init.connect("target", &target.connection_info(), &[region]).unwrap();
    let total = 40u64;
    for i in 0..total {
        let seg = Segment { local_addr: src.addr(), remote_addr: d.addr, len_bytes: 64, lkey: l.lkey, rkey: r.rkey };
        init.post(PostRequest {
            xfer: XferId(i),
            op: Op::Write,
            peer,
            segments: vec![seg],
            notification: Some(vec![i as u8; payload]),
        })
        .unwrap();
    }
    let done = completions(init.as_mut(), total as usize);
    let ok = done.iter().filter(|c| c.result.is_ok()).count();
    let overloaded =
        done.iter().filter(|c| c.result.as_ref().is_err_and(|f| f.kind == FailureKind::Overloaded)).count();
    assert_eq!(ok, bound_count, "{kind}: {done:?}");
    assert_eq!(ok + overloaded, total as usize, "{kind}: every refusal is typed Overloaded: {done:?}");
    let mut got: Vec<Notification> = Vec::new();
    target.take_notifications(&mut got);
    assert_eq!(got.len(), bound_count, "{kind}: the queue stays within its bound");
    assert!(got.iter().all(|n| n.payload.len() == payload && n.from_agent == "init"));
    // Drained: room again.
    let seg = Segment { local_addr: src.addr(), remote_addr: d.addr, len_bytes: 64, lkey: l.lkey, rkey: r.rkey };
    init.post(PostRequest { xfer: XferId(999), op: Op::Write, peer, segments: vec![seg], notification: Some(vec![1]) })
        .unwrap();
    assert_eq!(completions(init.as_mut(), 1)[0].result, Ok(()), "{kind}");
    let text = kvwire::metrics::prometheus_text();
    let line = format!("kvwire_notifications_refused_total{{transport=\"{kind}\"}} ");
    let n: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(&line))
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
        .parse()
        .unwrap();
    assert!(n >= overloaded as u64, "{kind}: metric {n} < {overloaded}");
}

#[test]
fn shm_notification_flood_is_bounded_and_refused_typed() {
    flood(TransportKind::Shm);
}

#[test]
fn tcp_notification_flood_is_bounded_and_refused_typed() {
    flood(TransportKind::Tcp);
}

#[test]
fn a_zero_bound_is_an_invalid_option() {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let cfg = TransportConfig { options: vec![("notif_queue_count".into(), "0".into())], ..Default::default() };
        assert!(transport::create(kind, "x", &cfg).is_err(), "{kind}");
    }
}
