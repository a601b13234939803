//! The agent-level Prometheus series (issue 29; `kvwire::metrics` module
//! docs): start-up, registrations, regions, descriptors vs segments
//! (coalescing), bytes per NIC and disconnects add up exactly to what the
//! engines in this process did. One test in its own binary: the registry is
//! per process. `promtool check metrics` where installed.

use std::sync::Arc;
use std::time::Duration;

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferStatus};
use kvwire::transport::{Op, TransportConfig, TransportKind};

fn sample(text: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}}} ");
    let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {prefix} in\n{text}"));
    line[prefix.len()..].parse().unwrap()
}

#[test]
fn agent_series_add_up_to_what_the_engines_did() {
    let cfg = TransportConfig::default();
    let an = format!("mx-a-{}", std::process::id());
    let bn = format!("mx-b-{}", std::process::id());
    let mut a = TransferEngine::new(&an, TransportKind::Shm, &cfg).unwrap();
    let mut b = TransferEngine::new(&bn, TransportKind::Shm, &cfg).unwrap();
    let (src, dst) = (Arc::new(HostBuffer::new(1 << 20).unwrap()), Arc::new(HostBuffer::new(1 << 20).unwrap()));
    a.register(src.clone()).unwrap();
    b.register(dst.clone()).unwrap();
    let extra = Arc::new(HostBuffer::new(4096).unwrap());
    let h_extra = b.register(extra).unwrap();
    b.deregister(h_extra).unwrap();
    a.connect(&b.metadata()).unwrap();
    // 3 posts of 4 abutting 64 KiB descriptors each: one segment per post
    for i in 0..3u64 {
        let base = i * (256 << 10);
        let l: Vec<Desc> = (0..4).map(|j| Desc::new(src.addr() + base + j * (64 << 10), 64 << 10)).collect();
        let r: Vec<Desc> = (0..4).map(|j| Desc::new(dst.addr() + base + j * (64 << 10), 64 << 10)).collect();
        let h = a.post(Op::Write, &l, &bn, &r, None).unwrap();
        assert_eq!(a.wait(h, Duration::from_secs(30)).unwrap(), TransferStatus::Done);
        a.release(h).unwrap();
    }
    let text = kvwire::metrics::prometheus_text();
    let shm = "transport=\"shm\",nic=\"shm\"";
    assert_eq!(sample(&text, "kvwire_posted_descriptors_total", shm), 12.0);
    assert_eq!(sample(&text, "kvwire_posted_segments_total", shm), 3.0);
    assert_eq!(sample(&text, "kvwire_nic_bytes_total", shm), (3 * (256 << 10)) as f64);
    assert_eq!(sample(&text, "kvwire_peer_disconnects_total", shm), 0.0);
    assert_eq!(sample(&text, "kvwire_registrations_total", "transport=\"shm\""), 3.0);
    assert_eq!(sample(&text, "kvwire_registered_bytes_total", "transport=\"shm\""), (2 * (1 << 20) + 4096) as f64);
    assert!(sample(&text, "kvwire_registration_seconds_total", "transport=\"shm\"") > 0.0);
    assert_eq!(sample(&text, "kvwire_regions", &format!("agent=\"{an}\",transport=\"shm\"")), 1.0);
    assert_eq!(sample(&text, "kvwire_regions", &format!("agent=\"{bn}\",transport=\"shm\"")), 1.0);
    // One memory region per registration off verbs: ratio 1.
    for n in [&an, &bn] {
        let l = format!("agent=\"{n}\",transport=\"shm\"");
        assert_eq!(sample(&text, "kvwire_memory_regions", &l), 1.0);
        assert_eq!(sample(&text, "kvwire_region_coalescing_ratio", &l), 1.0);
    }
    assert_eq!(sample(&text, "kvwire_agent_startup_seconds_count", "transport=\"shm\""), 2.0);
    // the peer dies: one disconnect; its region gauge goes, counters stay
    drop(b);
    let l = [Desc::new(src.addr(), 4096)];
    let r = [Desc::new(dst.addr(), 4096)];
    for _ in 0..200 {
        if !a.is_connected(&bn) {
            break;
        }
        if let Ok(h) = a.post(Op::Write, &l, &bn, &r, None) {
            let _ = a.wait(h, Duration::from_secs(10));
            a.release(h).unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!a.is_connected(&bn));
    let text = kvwire::metrics::prometheus_text();
    assert_eq!(sample(&text, "kvwire_peer_disconnects_total", shm), 1.0);
    assert!(!text.contains(&format!("agent=\"{bn}\"")), "a dropped engine's gauge goes");
    assert_eq!(sample(&text, "kvwire_registrations_total", "transport=\"shm\""), 3.0, "counters stay");
    if let Ok(out) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(text.as_bytes())?;
            c.wait_with_output()
        })
    {
        let msg = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "promtool check metrics: {msg}");
    } else {
        eprintln!("agent_series_add_up_to_what_the_engines_did: promtool not installed: exposition not linted");
    }
}
