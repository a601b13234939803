//! Long-run resources of the shm backend (issue 18 items 7 and 8): threads
//! across connect/disconnect cycles and mappings of deregistered regions.
//! One test in its own binary, so that no other test's threads or
//! mappings change the counts.

use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::transport::shm::ShmTransport;
use kvwire::transport::{MemoryBacking, RemoteRegion, Transport, TransportConfig};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn host_buffer_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:kvwire-host-buffer"))
        .count()
}

/// Wait up to 5 s for `f() <= want` (threads of closed connections exit
/// asynchronously); returns the last value.
fn settle(want: usize, f: impl Fn() -> usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = f();
        if n <= want || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn connect_disconnect_cycles_and_deregistrations_leak_nothing() {
    let cfg = TransportConfig::default();
    let mut target = ShmTransport::new("target", &cfg).unwrap();
    let buf = std::sync::Arc::new(HostBuffer::new(64 << 20).unwrap());
    let reg = target.register(buf.clone()).unwrap();
    let d = buf.desc();
    let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: reg.rkey, kind: d.kind, device_id: 0 };
    let info = target.connection_info();
    let mut init = ShmTransport::new("initiator", &cfg).unwrap();
    let p = init.connect("target", &info, &[region]).unwrap();
    init.disconnect(p);
    std::thread::sleep(Duration::from_millis(200));
    let base = threads();
    // Item 7: each cycle used to keep its monitor thread (and 2 MiB stack)
    // until the transport dropped.
    for _ in 0..300 {
        let p = init.connect("target", &info, &[region]).unwrap();
        init.disconnect(p);
    }
    let after = settle(base + 2, threads);
    assert!(after <= base + 2, "threads grew over 300 connect/disconnect cycles: {base} -> {after}");
    // Item 8: a deregistered region used to stay mapped in every connected
    // initiator until it disconnected.
    let own = host_buffer_maps();
    let _peer = init.connect("target", &info, &[region]).unwrap();
    assert_eq!(host_buffer_maps(), own + 1, "the initiator maps the target's region");
    target.deregister(reg.lkey).unwrap();
    assert_eq!(host_buffer_maps(), own, "the initiator still maps a deregistered region");
}
