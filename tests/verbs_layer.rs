//! The verbs layer without a device: the loader's error path, work-request
//! batches against a fake provider op table, and (with a device) the
//! safe objects and `kvwire devices` data.

mod verbs_util;

use kvwire::verbs::wr::FakeQueuePair;
use kvwire::verbs::{WrBatch, WrId};

#[test]
fn batches_chain_and_post_once() {
    let mut qp = FakeQueuePair::default();
    let mut b = WrBatch::with_capacity(8);
    for i in 0..100u64 {
        b.push_rdma(WrId(i), i % 2 == 0, i == 99, 0x1000 + i * 64, 64, 1, 0x9000 + i * 64, 2);
    }
    assert_eq!(qp.post(&mut b), 100);
    b.clear();
    b.push_send(WrId(7), true, true, 0x10, 3, 1);
    let v = b.view(0).expect("one WR");
    assert!(v.signaled && v.fence, "{v:?}");
    assert_eq!(qp.post(&mut b), 101);
    b.clear();
    b.push_send(WrId(8), false, false, 0x10, 3, 1);
    let v = b.view(0).expect("one WR");
    assert!(!v.signaled && !v.fence, "{v:?}");
}

#[test]
fn loader_reports_availability_without_panicking() {
    match kvwire::verbs::device_names() {
        Ok(names) => eprintln!("libibverbs loaded; devices: {names:?}"),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("skipped: no RDMA device ({msg})");
            assert!(msg.contains("libibverbs"), "{msg}");
        }
    }
}

#[test]
#[ignore = "needs an RDMA device (Soft-RoCE guest: scripts/softroce-tests.sh)"]
fn devices_are_described_with_ports_and_gids() {
    let infos = match kvwire::verbs::list_devices() {
        Ok(v) if !v.is_empty() => v,
        Ok(_) => return verbs_util::skip("no RDMA device (none listed)"),
        Err(e) => return verbs_util::skip(&format!("no RDMA device ({e})")),
    };
    for d in infos {
        let d = d.expect("device opens");
        assert!(!d.ports.is_empty(), "{} has no port", d.name);
        for p in &d.ports {
            eprintln!(
                "{} port {} state {} mtu {} gids {}",
                d.name,
                p.port,
                p.attr.state,
                p.attr.active_mtu,
                p.gids.len()
            );
        }
    }
}
