//! What revocation without the peer's consent costs on shm (issue 27 item 4):
//! `deregister` of a `HostBuffer` whose memfd a peer was handed re-homes
//! the owner's pages (a copy into a fresh memfd, `mremap` over the same
//! address, a hole punch of the old file). Timed per GiB against a `memcpy`
//! of the same size in the same run (the baseline), and against `deregister`
//! of a region no peer was handed (nothing moves).
//!
//! `cargo bench -p kvwire --bench shm_rehome` (`KVWIRE_REHOME_MIB`, default
//! 1024; `KVWIRE_REHOME_REPS`, default 5). Prints the median of each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire::HostBuffer;
use kvwire::transport::shm::ShmTransport;
use kvwire::transport::{MemoryBacking, RemoteRegion, Transport, TransportConfig};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // nothing to list
    }
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this
    // binary without it: then a 4 MiB smoke run (it still checks contents).
    let bench = std::env::args().any(|a| a == "--bench");
    let mib = if bench { env("KVWIRE_REHOME_MIB", 1024) } else { 4 };
    let reps = if bench { env("KVWIRE_REHOME_REPS", 5).max(1) } else { 1 };
    let len = mib << 20;
    let cfg = TransportConfig::default();
    let mut target = ShmTransport::new("rehome-target", &cfg).unwrap();
    let mut init = ShmTransport::new("rehome-init", &cfg).unwrap();
    let buf = Arc::new(HostBuffer::new(len).unwrap());
    buf.fill_with(0, 4096, |i| i as u8);
    let mut out = vec![0u8; len];
    out.fill(1); // fault the destination in before timing
    let (mut copy, mut rehome, mut quiet) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        buf.copy_to(0, &mut out);
        copy.push(t.elapsed());
        std::hint::black_box(&out);

        // Handed to a peer (which maps it): deregister re-homes.
        let reg = target.register(buf.clone()).unwrap();
        let d = buf.desc();
        let region = RemoteRegion { addr: d.addr, len_bytes: d.len_bytes, rkey: reg.rkey, kind: d.kind, device_id: 0 };
        let peer = init.connect("rehome-target", &target.connection_info(), &[region]).unwrap();
        let t = Instant::now();
        target.deregister(reg.lkey).unwrap();
        rehome.push(t.elapsed());
        init.disconnect(peer);

        // Never handed out: nothing moves.
        let reg = target.register(buf.clone()).unwrap();
        let t = Instant::now();
        target.deregister(reg.lkey).unwrap();
        quiet.push(t.elapsed());
    }
    assert!(buf.eq_at(0, &(0..4096).map(|i| i as u8).collect::<Vec<_>>()), "contents lost by re-homing");
    let gib = len as f64 / (1u64 << 30) as f64;
    let (c, r, q) = (median(copy), median(rehome), median(quiet));
    println!(
        "shm_rehome: {mib} MiB, {reps} reps (median): memcpy {:.1} ms ({:.1} ms/GiB); deregister with re-homing {:.1} ms \
         ({:.1} ms/GiB, {:.2}x memcpy); deregister never handed out {:.3} ms",
        c.as_secs_f64() * 1e3,
        c.as_secs_f64() * 1e3 / gib,
        r.as_secs_f64() * 1e3,
        r.as_secs_f64() * 1e3 / gib,
        r.as_secs_f64() / c.as_secs_f64(),
        q.as_secs_f64() * 1e3,
    );
}
