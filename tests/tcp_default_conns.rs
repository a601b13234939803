//! The tcp backend's default connection count follows the cores the process
//! may run on (`default_conns_per_peer`: half of them, 2..=8), and the
//! `conns_per_peer` option still overrides it: counted as the initiator's
//! worker threads (`kvwire-tcp-<i>`, one per connection) after a connect.
//! Alone in its own test binary, so no other test's transports are counted.

use std::time::Duration;

use kvwire::engine::TransferEngine;
use kvwire::transport::tcp::{DEFAULT_CONNS_PER_PEER, DEFAULT_CONNS_PER_PEER_MAX, default_conns_per_peer};
use kvwire::transport::{TransportConfig, TransportKind};

/// Threads of this process named `kvwire-tcp-<digits>` (the initiator's
/// per-connection workers; the target's are `kvwire-tcp-serve`).
fn workers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| {
            c.trim().strip_prefix("kvwire-tcp-").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .count()
}

/// [`workers`] once it equals `want`, or its last count after 10 s: a
/// thread names itself when it starts, just after `connect` spawned it.
fn workers_settled(want: usize) -> usize {
    let t0 = std::time::Instant::now();
    loop {
        let n = workers();
        if n == want || t0.elapsed() > Duration::from_secs(10) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn engine(name: &str, options: &[(&str, &str)]) -> TransferEngine {
    let config = TransportConfig {
        peer_timeout: Duration::from_secs(5),
        options: options.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect(),
        ..Default::default()
    };
    TransferEngine::new(name, TransportKind::Tcp, &config).unwrap()
}

#[test]
fn the_default_connection_count_follows_the_cores_and_the_option_overrides_it() {
    let cores = std::thread::available_parallelism().unwrap().get();
    let expected = (cores / 2).clamp(DEFAULT_CONNS_PER_PEER, DEFAULT_CONNS_PER_PEER_MAX);
    assert_eq!(default_conns_per_peer(), expected, "{cores} cores");
    assert!((2..=8).contains(&expected));

    let target = engine("decode", &[]);
    let mut init = engine("prefill", &[]);
    assert_eq!(workers(), 0);
    init.connect(&target.metadata()).unwrap();
    assert_eq!(workers_settled(expected), expected, "one worker per default connection on {cores} cores");

    let mut three = engine("prefill-3", &[("conns_per_peer", "3")]);
    three.connect(&target.metadata()).unwrap();
    assert_eq!(workers_settled(expected + 3), expected + 3, "the option's count, not the default");

    drop(init);
    drop(three);
    assert_eq!(workers_settled(0), 0, "dropping the initiators ends their workers");
}
