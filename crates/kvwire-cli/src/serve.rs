//! `kvwire serve`: an engine that publishes its metadata in etcd and serves
//! one-sided transfers until killed. Its buffer is split in two halves: the
//! lower half holds pages of a pattern keyed by the agent name (what a peer
//! READs and checks), the upper half is scratch that peers may WRITE.
//!
//! With `--pull PEER,...` it is also a decode-side initiator: each round it
//! READs scattered pattern pages from every live peer and checks them, then
//! WRITEs them into the peer's scratch half and READs them back. A peer
//! whose transfer fails is dropped (the line `peer NAME failed after N ms:
//! REASON`), the others keep going, and the dead peer's etcd entry is
//! watched until its lease expires (`peer NAME left etcd after N ms`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferHandle, TransferStatus};
use kvwire::transport::{Op, TransportConfig, TransportKind};
use kvwire_discovery::{DiscoveryError, EtcdStore, MetadataStore};

use crate::failure::{etcd_error, user_error};
use crate::pattern::{check_page, fill_page, mix};
use crate::units::parse_size;

/// Options of `kvwire serve`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ServeArgs {
    /// Agent name, unique in the etcd prefix.
    #[arg(long)]
    name: String,
    /// etcd endpoint(s), `http://host:port[,http://host:port]`.
    #[arg(long)]
    etcd: String,
    /// Key prefix of the agent entries.
    #[arg(long, default_value = "/kvwire/agents/")]
    prefix: String,
    /// Lease TTL in seconds: a killed engine's entry disappears after this.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    ttl: u64,
    /// Transport (tcp across hosts; shm on one host).
    #[arg(long, default_value = "tcp")]
    transport: TransportKind,
    /// Address the tcp transport listens on and advertises (`IP:PORT`, port
    /// 0: any). Default: the tcp transport's own rule, as for bench and
    /// replay: $KVWIRE_TCP_LISTEN, else 0.0.0.0:0 advertising the
    /// default-route interface's address (127.0.0.1:0 on a loopback-only
    /// host). With --transport verbs: the IP of the connection handshake
    /// listener. Not used by shm.
    #[arg(long)]
    listen: Option<String>,
    /// Registered buffer size (e.g. 64MiB): pattern half + scratch half.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    buffer: u64,
    /// Page size (e.g. 64KiB).
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    page_size: u64,
    /// Seconds after which a dead or silent peer fails its transfers.
    #[arg(long, default_value = "2", value_parser = crate::units::parse_seconds)]
    peer_timeout: Duration,
    /// Backend option `key=value` (repeatable), e.g. conns_per_peer=4.
    #[arg(long = "option", value_parser = crate::units::parse_kv)]
    options: Vec<(String, String)>,
    /// Peers to pull from (comma-separated agent names), as a decode engine.
    #[arg(long, value_delimiter = ',')]
    pull: Vec<String>,
    /// Pull rounds (with --pull).
    #[arg(long, default_value_t = 20)]
    rounds: u64,
    /// Pages per peer per round (with --pull).
    #[arg(long, default_value_t = 64)]
    pages: u64,
    /// How long to wait for a pulled peer to be published (seconds).
    #[arg(long, default_value = "30", value_parser = crate::units::parse_seconds)]
    lookup_timeout: Duration,
    /// Stop serving after this many seconds (default: until killed).
    #[arg(long, value_parser = crate::units::parse_seconds)]
    duration: Option<Duration>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9400:
    /// this engine's own transfers (bytes, failures, latency per op and
    /// peer; MAX's metric names) and, as a target, what it served
    /// (kvwire_served_requests_total, kvwire_served_bytes_total by op and
    /// peer, kvwire_served_peers), as the peers' notifications report it.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

/// The bytes a `--pull` peer's round notification reports
/// (`NAME-round-R read=B write=B`); 0 for other notifications.
fn served_bytes(note: &str) -> (u64, u64) {
    let field =
        |k: &str| note.split_whitespace().find_map(|w| w.strip_prefix(k).and_then(|v| v.parse().ok())).unwrap_or(0);
    (field("read="), field("write="))
}

/// Pattern key of page `i` of agent `name`.
fn page_key(name: &str, i: u64) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    mix(h ^ i)
}

/// Run `kvwire serve`.
///
/// # Errors
/// Setup failures (etcd unreachable, bind failure); with `--pull`, a round in
/// which no peer succeeded.
pub(crate) fn run(a: ServeArgs) -> Result<()> {
    if a.page_size == 0 || a.buffer < 2 * a.page_size {
        bail!("--buffer must hold at least two pages");
    }
    if !a.pull.is_empty() && a.rounds == 0 {
        bail!("--rounds must be at least 1 with --pull, got 0");
    }
    if !a.pull.is_empty() && a.pages == 0 {
        bail!("--pages must be at least 1 with --pull, got 0");
    }
    for (i, name) in a.pull.iter().enumerate() {
        if a.pull[..i].contains(name) {
            bail!("--pull names {name} twice");
        }
        if *name == a.name {
            bail!("--pull {name}: that is this engine's own --name");
        }
    }
    crate::memcheck::check(
        "serve",
        a.buffer as u128,
        &format!("--buffer {}", crate::units::human(a.buffer)),
        "use a smaller --buffer",
    )?;
    crate::units::check_option_keys(a.transport, "--option", &a.options)?;
    let listen = match (a.transport, &a.listen) {
        (TransportKind::Tcp, l) => l.clone(),
        (TransportKind::Verbs, l) => l.clone(),
        (TransportKind::Shm, None) => None,
        (TransportKind::Shm, Some(_)) => bail!("--listen is for --transport tcp or verbs; shm needs no address"),
    };
    let mut options: Vec<(String, String)> = listen.map(|l| ("listen".to_string(), l)).into_iter().collect();
    options.extend(a.options.iter().cloned());
    let config = TransportConfig { peer_timeout: a.peer_timeout, options, ..TransportConfig::default() };
    if let Some(addr) = &a.metrics {
        let bound = kvwire::metrics::serve_http(addr).with_context(|| format!("--metrics {addr}"))?;
        println!("metrics at http://{bound}/metrics");
    }
    let mut engine = TransferEngine::new(&a.name, a.transport, &config).with_context(|| match &a.listen {
        // A bind failure names the address.
        Some(l) => format!("starting the {} transport on --listen {l}", a.transport),
        None => format!("starting the {} transport", a.transport),
    })?;
    let buf = Arc::new(HostBuffer::new(a.buffer as usize)?);
    let half_pages = a.buffer / 2 / a.page_size;
    let mut page = vec![0u8; a.page_size as usize];
    for i in 0..half_pages {
        fill_page(&mut page, page_key(&a.name, i));
        buf.write((i * a.page_size) as usize, &page);
    }
    engine.register(buf.clone())?;
    let mut store = EtcdStore::connect(&a.etcd, &a.prefix, Duration::from_secs(a.ttl.max(1)))
        .map_err(|e| etcd_error(e, "connecting to", &a.etcd))?;
    store.publish(&engine.metadata()).map_err(|e| etcd_error(e, "publishing in", &a.etcd))?;
    println!("serving {} ({} pages of {} B) published under {}{}", a.name, half_pages, a.page_size, a.prefix, a.name);
    if !a.pull.is_empty() {
        return pull(&a, &mut engine, &buf, &store);
    }
    let t0 = Instant::now();
    loop {
        for (from, msgs) in engine.get_notifs() {
            for m in msgs {
                let text = String::from_utf8_lossy(&m);
                println!("notification from {from}: {text}");
                let (read, written) = served_bytes(&text);
                kvwire::metrics::global().record_served(&from, read, written);
            }
        }
        if a.duration.is_some_and(|d| t0.elapsed() >= d) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait for `h`, counting it in the metrics registry (`--metrics`) as an
/// `op` of `bytes` with `peer`.
fn wait(engine: &mut TransferEngine, h: TransferHandle, op: Op, peer: &str, bytes: u64) -> Result<(), String> {
    use kvwire::metrics::{MetricOp, global};
    let t0 = Instant::now();
    let mop = if op == Op::Read { MetricOp::Read } else { MetricOp::Write };
    loop {
        match engine.status(h).map_err(|e| e.to_string())? {
            TransferStatus::InProgress => std::thread::sleep(Duration::from_micros(100)),
            TransferStatus::Done => {
                global().record_transfer(mop, peer, bytes, t0.elapsed());
                let _ = engine.release(h);
                return Ok(());
            }
            TransferStatus::Failed(why) => {
                global().record_failure(mop, peer);
                let _ = engine.release(h);
                return Err(why.to_string());
            }
        }
    }
}

/// `why` without a leading "peer NAME" that the line printing it already
/// starts with ("peer b failed after 3 ms: disconnected (peer died)").
fn without_name<'a>(why: &'a str, name: &str) -> &'a str {
    let named = format!("peer {name}");
    match why.strip_prefix(&named) {
        Some(rest) if rest.starts_with([' ', ':']) => rest.trim_start_matches(':').trim_start(),
        _ => why,
    }
}

struct Peer {
    name: String,
    meta: kvwire::engine::AgentMetadata,
    pages: u64,
}

/// One round with one peer: READ pattern pages and check them, WRITE them
/// to the peer's scratch half, READ them back and compare.
fn round(a: &ServeArgs, engine: &mut TransferEngine, buf: &HostBuffer, p: &Peer, r: u64) -> Result<(), String> {
    let ps = a.page_size;
    let n = a.pages.min(p.pages).min(buf.len() as u64 / 2 / ps);
    let remote_base = p.meta.regions.first().ok_or("peer has no region")?.addr;
    let local_base = buf.addr();
    // Remote pattern page for slot k: scattered with a stride prime to the page count.
    let src_page = |k: u64| (k * 7919 + r * 31) % p.pages;
    let local: Vec<Desc> = (0..n).map(|k| Desc::new(local_base + k * ps, ps)).collect();
    let remote: Vec<Desc> = (0..n).map(|k| Desc::new(remote_base + src_page(k) * ps, ps)).collect();
    let h = engine.post(Op::Read, &local, &p.name, &remote, None).map_err(|e| e.to_string())?;
    wait(engine, h, Op::Read, &p.name, n * ps)?;
    let mut page = vec![0u8; ps as usize];
    for k in 0..n {
        buf.copy_to((k * ps) as usize, &mut page);
        if !check_page(&page, page_key(&p.name, src_page(k))) {
            return Err(format!("page {} from {} has wrong bytes", src_page(k), p.name));
        }
    }
    // WRITE into the peer's scratch half (reversed order), then READ it back.
    let scratch_base = remote_base + p.pages * ps;
    let remote_w: Vec<Desc> = (0..n).map(|k| Desc::new(scratch_base + (n - 1 - k) * ps, ps)).collect();
    // What this round moves with the peer (two READs, one WRITE), so that
    // its `--metrics` can export what it served.
    let note = format!("{}-round-{r} read={} write={}", a.name, 2 * n * ps, n * ps).into_bytes();
    let h = engine.post(Op::Write, &local, &p.name, &remote_w, Some(note)).map_err(|e| e.to_string())?;
    wait(engine, h, Op::Write, &p.name, n * ps)?;
    let back_base = local_base + buf.len() as u64 / 2;
    let back: Vec<Desc> = (0..n).map(|k| Desc::new(back_base + k * ps, ps)).collect();
    let h = engine.post(Op::Read, &back, &p.name, &remote_w, None).map_err(|e| e.to_string())?;
    wait(engine, h, Op::Read, &p.name, n * ps)?;
    let (half, moved) = (buf.len() / 2, (n * ps) as usize);
    if buf.to_vec(..moved) != buf.to_vec(half..half + moved) {
        return Err(format!("WRITE/READ round trip with {} lost bytes", p.name));
    }
    Ok(())
}

fn pull(a: &ServeArgs, engine: &mut TransferEngine, buf: &HostBuffer, store: &EtcdStore) -> Result<()> {
    let mut lookup = EtcdStore::connect(&a.etcd, &a.prefix, Duration::from_secs(a.ttl.max(1)))
        .map_err(|e| etcd_error(e, "connecting to", &a.etcd))?;
    let mut peers = Vec::new();
    for name in &a.pull {
        let meta = lookup.lookup(name, a.lookup_timeout).map_err(|e| match e {
            DiscoveryError::NotFound { .. } => user_error(
                format!(
                    "agent {name:?} was not published under {}{name} in etcd at {} within {} s",
                    a.prefix,
                    a.etcd,
                    a.lookup_timeout.as_secs_f64()
                ),
                format!(
                    "start `kvwire serve --name {name} --etcd {}` (same --prefix) first, or wait longer with --lookup-timeout",
                    a.etcd
                ),
            ),
            e => etcd_error(e, &format!("looking up {name} in"), &a.etcd),
        })?;
        engine.connect(&meta)?;
        let pages = meta.regions.first().map(|r| r.len_bytes / 2 / a.page_size).unwrap_or(0);
        println!("connected to {name} ({pages} pages)");
        peers.push(Peer { name: name.clone(), meta, pages });
    }
    let mut gone: Vec<(String, Instant)> = Vec::new();
    let (mut ok, mut failed) = (0u64, 0u64);
    for r in 0..a.rounds {
        let mut round_ok = 0;
        let mut i = 0;
        while i < peers.len() {
            let t0 = Instant::now();
            match round(a, engine, buf, &peers[i], r) {
                Ok(()) => {
                    ok += 1;
                    round_ok += 1;
                    i += 1;
                }
                Err(why) => {
                    failed += 1;
                    let p = peers.remove(i);
                    println!(
                        "peer {} failed after {} ms: {}",
                        p.name,
                        t0.elapsed().as_millis(),
                        without_name(&why, &p.name)
                    );
                    let _ = engine.disconnect(&p.name);
                    gone.push((p.name, Instant::now()));
                }
            }
        }
        gone.retain(|(name, since)| match store.get(name) {
            Ok(None) => {
                println!("peer {name} left etcd after {} ms", since.elapsed().as_millis());
                false
            }
            _ => true,
        });
        println!("round {r}: {round_ok} peer(s) ok");
        if round_ok == 0 {
            bail!("round {r}: no peer left to pull from (ok={ok} failed={failed})");
        }
    }
    // Wait (up to the lease TTL and a margin) for dead peers' entries to expire.
    let deadline = Instant::now() + Duration::from_secs(a.ttl + 5);
    while !gone.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        gone.retain(|(name, since)| match store.get(name) {
            Ok(None) => {
                println!("peer {name} left etcd after {} ms", since.elapsed().as_millis());
                false
            }
            _ => true,
        });
    }
    for (name, _) in &gone {
        println!("peer {name} still in etcd");
    }
    println!("pull summary: ok={ok} failed={failed} live_peers={}", peers.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::without_name;

    #[test]
    fn a_failure_line_names_the_peer_once() {
        assert_eq!(without_name("peer b disconnected (peer died)", "b"), "disconnected (peer died)");
        assert_eq!(
            without_name("peer b: Connection reset by peer (os error 104) (peer died)", "b"),
            "Connection reset by peer (os error 104) (peer died)"
        );
        assert_eq!(without_name("peer bb disconnected", "b"), "peer bb disconnected");
        assert_eq!(without_name("page 3 from b has wrong bytes", "b"), "page 3 from b has wrong bytes");
    }
}
