//! `kvwire replay`: disaggregated prefill → decode on one host, driven by a
//! Mooncake-format request trace.
//!
//! The prefill engine (this process) and the decode engine (a child process)
//! each own a paged KV cache (`KVTransferEngine`, `--dp` replicas × `--tp`
//! shards, one group). Per request, decode allocates destination pages from
//! its pool (waiting, in simulated time, for earlier requests to finish
//! decoding when the pool is full), prefill fills `ceil(input/page_tokens)`
//! pages with bytes derived from (request, page, shard), sends them with
//! `initiate_send_transfer`, and decode verifies every byte and frees the
//! pages once the request's `output_length` decode steps have elapsed.

mod decode;
pub(crate) mod model;
pub(crate) mod pool;
mod prefill;
mod prefix;
mod report;
pub(crate) mod trace;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use kvwire::sidechannel::{SideChannel, SideListener};
use kvwire::transport::TransportKind;
use serde::{Deserialize, Serialize};

use crate::units::parse_kv;

/// Options of `kvwire replay`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ReplayArgs {
    /// Mooncake-format trace (JSON lines); default: the bundled conversation trace.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Model whose per-token KV geometry to use (llama3-8b, llama3-70b, qwen3-32b, deepseek-v3).
    #[arg(long, default_value = "llama3-8b")]
    pub model: String,
    /// Layers to move (real per-layer geometry, fewer layers); default 1.
    #[arg(long, default_value_t = 1)]
    pub layers: u64,
    /// Tensor-parallel shards of the prefill engine.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Tensor-parallel shards of the decode engine (default: --tp). Differing
    /// TP needs a replicated (MLA) model: BROADCAST.
    #[arg(long)]
    pub decode_tp: Option<usize>,
    /// Data-parallel replicas on each side; request i uses replica i % dp.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 128)]
    pub page_tokens: u64,
    /// Pages in each decode replica's pool (null block included).
    #[arg(long, default_value_t = 4096)]
    pub decode_pages: u64,
    /// Pages in each prefill replica's pool (default: enough for the largest request twice, at least 1024).
    #[arg(long)]
    pub prefill_pages: Option<u64>,
    /// Replay only the first N requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Replay the timestamps X times faster than real time, 0.001..=1000000
    /// (default: as fast as possible, in arrival order).
    #[arg(long)]
    pub speed: Option<f64>,
    /// Simulated time per decode step (ms per output token, 0..=60000).
    #[arg(long, default_value_t = 20.0)]
    pub decode_step_ms: f64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    pub inflight: usize,
    /// Transport: shm, verbs or tcp.
    #[arg(long, default_value = "shm")]
    pub transport: TransportKind,
    /// Copy/progress threads of CPU-copying transports.
    #[arg(long, default_value_t = 2)]
    pub copy_threads: usize,
    /// Backend option for the prefill side, `key=value` (repeatable).
    #[arg(long = "option", value_parser = parse_kv)]
    pub options: Vec<(String, String)>,
    /// Backend option for the decode side, `key=value` (repeatable).
    #[arg(long = "decode-option", value_parser = parse_kv)]
    pub decode_options: Vec<(String, String)>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Discover the engines' metadata through etcd at this URL (e.g.
    /// http://127.0.0.1:2379) instead of the side channel; each side
    /// publishes its KV engine metadata under --etcd-prefix with a lease and
    /// waits (up to 30 s) for the other's.
    #[arg(long)]
    pub etcd: Option<String>,
    /// Key prefix for --etcd.
    #[arg(long, default_value = "/kvwire/replay/")]
    pub etcd_prefix: String,
    /// External KV tier for prefix reuse: `none`, or `host` (a host-memory
    /// tier with LRU eviction, sized by --host-tier-gib).
    #[arg(long, default_value = "none", value_parser = ["none", "host"])]
    pub connector: String,
    /// Host tier size (GiB, 0..=1048576; default 4); needs `--connector host`.
    #[arg(long)]
    pub host_tier_gib: Option<f64>,
    /// Run one side only, for prefill and decode on different hosts:
    /// `decode` (listens on --listen for --prefills prefill processes,
    /// verifies every byte, prints each one's summary) or `prefill` (reads
    /// the trace, sends its share to the decode engines at --connect).
    /// Routing: trace request i goes to prefill i mod P (P = --prefills,
    /// this one is --prefill-rank), and the j-th request of a prefill's share
    /// to decode engine j mod N (N = addresses in --connect, in order).
    /// Default: both sides on this host, decode as a child process.
    #[arg(long, value_parser = ["decode", "prefill"])]
    pub role: Option<String>,
    /// `--role decode`: side-channel address to listen on for the prefills (IP:PORT).
    #[arg(long, value_name = "IP:PORT")]
    pub listen: Option<String>,
    /// `--role prefill`: the decode engines' --listen addresses, comma-separated (HOST:PORT,...).
    #[arg(long, value_name = "HOST:PORT,...", value_delimiter = ',')]
    pub connect: Vec<String>,
    /// Prefill processes sharing the trace (each decode serves them all).
    #[arg(long, default_value_t = 1)]
    pub prefills: usize,
    /// `--role prefill`: which of the --prefills this one is, 0-based.
    #[arg(long, default_value_t = 0)]
    pub prefill_rank: usize,
    /// Seconds a side waits for the other to connect, and a prefill for a
    /// decode engine that answers its transport handshake late (--role only).
    #[arg(long, default_value_t = 60)]
    pub wait_s: u64,
    /// Serve kvwire's Prometheus metrics at http://IP:PORT/metrics for the
    /// replay (port 0 picks one; the bound address is printed on stderr as
    /// `replay: metrics at http://IP:PORT/metrics`). On the prefill side
    /// `maxserve_dkv_nixl_write_bytes_total` and `kvwire_nic_bytes_total` add
    /// up to the summary's `bytes`; on `--role decode`,
    /// `kvwire_served_bytes_total{op="write"}` does (docs/METRICS.md).
    #[arg(long, value_name = "IP:PORT")]
    pub metrics: Option<String>,
    /// Keep the --metrics endpoint up this many seconds after the summary
    /// (0..=86400; default 0), so that a scraper reads the final counts.
    #[arg(long, value_name = "SECS", default_value_t = 0, requires = "metrics",
          value_parser = clap::value_parser!(u64).range(0..=86400))]
    pub metrics_linger: u64,
    /// Test hook: fill page 0 of request N with the wrong bytes, to prove
    /// that verification catches it (the replay must then fail).
    #[arg(long, hide = true)]
    pub inject_bad_page: Option<u64>,
}

/// Options of the hidden `replay-decode` child.
#[derive(Args, Debug)]
pub(crate) struct DecodeArgs {
    /// Side-channel address of the prefill process.
    #[arg(long)]
    pub connect: String,
}

/// Geometry both sides agree on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Geometry {
    /// Bytes of one page on one shard.
    pub bytes_per_page: u64,
    /// Shards of the decode engine.
    pub decode_tp: usize,
    /// Shards of the prefill engine.
    pub prefill_tp: usize,
    /// Replicas on each side.
    pub dp: usize,
    /// The group is replicated across shards (MLA).
    pub mla: bool,
}

impl Geometry {
    /// Which prefill shard's bytes decode shard `s` receives: the same shard
    /// (DIRECT), or shard 0 fanned out (BROADCAST).
    pub(crate) fn source_shard(&self, s: usize) -> usize {
        if self.prefill_tp == self.decode_tp { s } else { 0 }
    }
}

/// Key of the bytes a page with content key `key` holds on prefill shard `shard`.
pub(crate) fn shard_key(key: u64, shard: usize) -> u64 {
    crate::pattern::mix(key ^ (shard as u64).wrapping_mul(0xA24B_AED4_963E_E407))
}

/// Side-channel messages between prefill (P) and decode (D).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Msg {
    /// P→D: build your engine.
    Setup {
        /// Page geometry.
        geometry: Geometry,
        /// Decode pool pages per replica.
        num_pages: u64,
        /// Transport.
        transport: TransportKind,
        /// Copy threads.
        copy_threads: usize,
        /// Decode-side backend options.
        options: Vec<(String, String)>,
        /// Simulated ms per decode step.
        decode_step_ms: f64,
        /// Real-time speed-up, if replaying timestamps.
        speed: Option<f64>,
        /// etcd URL and key prefix, when metadata goes through etcd.
        etcd: Option<(String, String)>,
        /// The decode engine's name (unique per prefill × decode pair).
        decode_name: String,
        /// The prefill engine's name.
        prefill_name: String,
        /// Send the summary to decode after `Finished` (`--role`).
        summary: bool,
        /// Seconds the decode keeps trying a transport handshake with the
        /// prefill that times out (`--wait-s`).
        wait_s: u64,
    },
    /// Either way: KV engine metadata bytes (empty: published in etcd).
    Meta(Vec<u8>),
    /// P→D: request `id` needs `pages` pages on `replica`.
    Alloc {
        /// Request id (trace order).
        id: u64,
        /// Pages.
        pages: u64,
        /// Replica.
        replica: usize,
        /// Arrival (trace ms).
        arrival_ms: u64,
        /// Output tokens (decode steps before the pages free).
        output_len: u64,
    },
    /// D→P: destination pages for `id`.
    Allocated {
        /// Request id.
        id: u64,
        /// Destination page indices.
        pages: Vec<u64>,
    },
    /// P→D: the transfer of `id` is posted.
    Sent {
        /// Request id.
        id: u64,
        /// `TransferReqData` JSON.
        req: String,
        /// Content key of each page, in request order (see `shard_key`).
        keys: Vec<u64>,
    },
    /// D→P: `id` arrived and was checked.
    Verified {
        /// Request id.
        id: u64,
        /// Pages (× shards) whose bytes were wrong.
        bad_pages: u64,
        /// Transport error, if the transfer failed.
        error: Option<String>,
    },
    /// P→D: the transfer of `id` failed and was cancelled; free its pages.
    Abort {
        /// Request id.
        id: u64,
        /// Why.
        reason: String,
    },
    /// P→D: all done; report your pool high-water mark.
    Finish,
    /// P→D: the run's summary, as the table and as JSON (`--role`), so
    /// that the decode host prints the same one.
    Summary {
        /// The table.
        table: String,
        /// One JSON object.
        json: String,
    },
    /// D→P: final decode-side figures.
    Finished {
        /// Most decode pages in use at once (per replica, max).
        high_water: u64,
        /// Pool capacity.
        capacity: u64,
        /// Requests that waited for pages.
        backpressured: u64,
    },
}

/// Exchange KV engine metadata with the other side: over the side channel,
/// or (with `etcd`) by publishing ours in etcd under `my_name` and looking
/// theirs up under `their_name` (waiting up to 30 s for it to appear); the
/// side channel then only says "published". Returns the peer's metadata and
/// the store, which keeps our entry alive until dropped.
pub(crate) fn exchange_metadata(
    chan: &mut SideChannel,
    etcd: Option<&(String, String)>,
    mine: &kvwire::kv::KVTransferEngineMetadata,
    their_name: &str,
    first: bool,
) -> Result<(kvwire::kv::KVTransferEngineMetadata, Option<kvwire_discovery::EtcdStore>)> {
    use kvwire::kv::KVTransferEngineMetadata as Md;
    let etcd_url = etcd.map(|(url, _)| url.clone()).unwrap_or_default();
    let mut store = match etcd {
        Some((url, prefix)) => Some(
            kvwire_discovery::EtcdStore::connect(url, prefix, Duration::from_secs(10))
                .map_err(|e| crate::failure::etcd_error(e, "connecting to", url))?,
        ),
        None => None,
    };
    let send = |chan: &mut SideChannel, store: &mut Option<kvwire_discovery::EtcdStore>| -> Result<()> {
        match store {
            Some(s) => {
                s.publish_bytes(&mine.name, &mine.to_bytes())
                    .map_err(|e| crate::failure::etcd_error(e, "publishing the engine's metadata in", &etcd_url))?;
                chan.send(&Msg::Meta(Vec::new()))?;
            }
            None => chan.send(&Msg::Meta(mine.to_bytes()))?,
        }
        Ok(())
    };
    let recv = |chan: &mut SideChannel, store: &mut Option<kvwire_discovery::EtcdStore>| -> Result<Md> {
        let Msg::Meta(bytes) = chan.recv()? else { anyhow::bail!("expected the {their_name} engine's metadata") };
        let bytes = match store {
            Some(s) if bytes.is_empty() => {
                s.lookup_bytes(their_name, Duration::from_secs(30)).map_err(|e| match e {
                    e @ kvwire_discovery::DiscoveryError::NotFound { .. } => anyhow::Error::new(e)
                        .context(format!("the {their_name} engine's entry did not appear in etcd at {etcd_url}")),
                    e => crate::failure::etcd_error(e, &format!("looking up the {their_name} engine in"), &etcd_url),
                })?
            }
            _ => bytes,
        };
        Ok(Md::from_bytes(&bytes)?)
    };
    let theirs = if first {
        send(chan, &mut store)?;
        recv(chan, &mut store)?
    } else {
        let t = recv(chan, &mut store)?;
        send(chan, &mut store)?;
        t
    };
    Ok((theirs, store))
}

/// Default trace path: ./data/… when run from the repository, else the
/// copy in the source tree this binary was built from.
pub(crate) fn default_trace() -> PathBuf {
    let local = PathBuf::from("data/mooncake_conversation_trace.jsonl");
    if local.exists() {
        return local;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/mooncake_conversation_trace.jsonl")
}

/// `kvwire replay`.
pub(crate) fn run(a: ReplayArgs) -> Result<()> {
    prefill::validate(&a)?;
    if a.role.as_deref() != Some("decode") {
        crate::failure::catch_interrupt();
    }
    match a.role.as_deref() {
        Some("decode") => return run_decode_role(&a),
        Some(_) => return run_prefill_role(&a),
        None => {}
    }
    if !a.connect.is_empty() || a.listen.is_some() || a.prefills != 1 || a.prefill_rank != 0 {
        anyhow::bail!(
            "--listen, --connect, --prefills and --prefill-rank split the replay across processes: add --role decode or --role prefill"
        );
    }
    crate::units::check_option_keys(a.transport, "--option", &a.options)?;
    crate::units::check_option_keys(a.transport, "--decode-option", &a.decode_options)?;
    serve_metrics(a.metrics.as_deref())?;
    let (l, addr) = SideChannel::bind("127.0.0.1:0")?;
    let child = crate::child::Child::spawn("decode", &["replay-decode", "--connect", &addr.to_string()])?;
    let chan = SideChannel::accept(&l)?;
    chan.set_read_timeout(Some(Duration::from_secs(300)))?;
    let report = child.finish(prefill::run(&a, vec![chan]))?;
    report::print(&report, a.json);
    linger(&a);
    if !report.verified {
        anyhow::bail!("replay failed: {} bad pages, {} failed transfers", report.bad_pages, report.failed);
    }
    Ok(())
}

/// `replay --role prefill`: this host's share of the trace, sent to the
/// decode engines at `--connect`.
fn run_prefill_role(a: &ReplayArgs) -> Result<()> {
    if a.connect.is_empty() {
        anyhow::bail!(
            "--role prefill needs --connect HOST:PORT[,HOST:PORT...] (the decode engines' --listen addresses)"
        );
    }
    if a.listen.is_some() {
        anyhow::bail!("--listen is for --role decode; a prefill connects (--connect)");
    }
    if !a.decode_options.is_empty() {
        anyhow::bail!(
            "--decode-option is for the one-host replay; give the decode host its options with --option there"
        );
    }
    crate::units::check_option_keys(a.transport, "--option", &a.options)?;
    serve_metrics(a.metrics.as_deref())?;
    let mut chans = Vec::with_capacity(a.connect.len());
    for addr in &a.connect {
        if !addr.contains(':') {
            anyhow::bail!("--connect {addr}: expected HOST:PORT (the decode engine's --listen address)");
        }
        eprintln!(
            "replay prefill {}: connecting to the decode engine at {addr} (up to {} s)",
            a.prefill_rank, a.wait_s
        );
        let chan = SideChannel::connect(addr, Duration::from_secs(a.wait_s))
            .with_context(|| format!("no `kvwire replay --role decode` at {addr}"))?;
        chan.set_read_timeout(Some(Duration::from_secs(300)))?;
        chans.push(chan);
    }
    let report = prefill::run(a, chans)?;
    report::print(&report, a.json);
    linger(a);
    if !report.verified {
        anyhow::bail!("replay failed: {} bad pages, {} failed transfers", report.bad_pages, report.failed);
    }
    Ok(())
}

/// `replay --role decode`: serve `--prefills` prefill processes, each with
/// its own engine, verifying every byte; prints each prefill's summary.
fn run_decode_role(a: &ReplayArgs) -> Result<()> {
    let Some(listen) = a.listen.as_deref() else {
        anyhow::bail!("--role decode needs --listen IP:PORT (the address the prefills --connect to)");
    };
    if !a.connect.is_empty() {
        anyhow::bail!("--connect is for --role prefill; a decode listens (--listen)");
    }
    if !a.decode_options.is_empty() {
        anyhow::bail!("--decode-option is for the one-host replay; on the decode host give its options with --option");
    }
    crate::units::check_option_keys(a.transport, "--option", &a.options)?;
    let mut l = SideListener::bind(listen).with_context(|| format!("listening on {listen} (--listen)"))?;
    let addr = l.local_addr();
    eprintln!("replay decode: listening on {addr} for {} prefill(s) (up to {} s each)", a.prefills, a.wait_s);
    serve_metrics(a.metrics.as_deref())?;
    let own = decode::Own { transport: a.transport, copy_threads: a.copy_threads, options: a.options.clone() };
    let mut workers = Vec::new();
    for k in 0..a.prefills {
        let deadline = std::time::Instant::now() + Duration::from_secs(a.wait_s);
        let chan = loop {
            if let Some(c) = l.try_accept().with_context(|| format!("accepting on {addr}"))? {
                break c;
            }
            if std::time::Instant::now() >= deadline {
                anyhow::bail!(
                    "no prefill connected to {addr} within {} s ({k} of {} came; --wait-s): start `kvwire replay --role prefill --connect {addr}` on the prefill host",
                    a.wait_s,
                    a.prefills
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        chan.set_read_timeout(Some(Duration::from_secs(300)))?;
        let own = own.clone();
        workers.push(
            std::thread::Builder::new().name(format!("decode-{k}")).spawn(move || decode::run(chan, Some(&own)))?,
        );
    }
    let mut failed = Vec::new();
    for (k, w) in workers.into_iter().enumerate() {
        match w.join().map_err(|_| anyhow::anyhow!("decode worker {k} panicked"))? {
            Ok(Some(s)) => {
                print!("{}", if a.json { &s.json } else { &s.table });
                if s.bad_pages > 0 {
                    failed.push(format!("connection {k}: {} bad pages verified here", s.bad_pages));
                }
            }
            Ok(None) => failed.push(format!("connection {k}: the prefill stopped before setting up")),
            Err(e) => failed.push(format!("connection {k}: {e:#}")),
        }
    }
    linger(a);
    if !failed.is_empty() {
        anyhow::bail!("replay decode failed: {}", failed.join("; "));
    }
    Ok(())
}

/// `--metrics`: serve the process's registry, saying where on stderr (stdout
/// carries the summary, one JSON object with `--json`).
fn serve_metrics(addr: Option<&str>) -> Result<()> {
    if let Some(addr) = addr {
        let bound = kvwire::metrics::serve_http(addr).with_context(|| format!("--metrics {addr}"))?;
        eprintln!("replay: metrics at http://{bound}/metrics");
    }
    Ok(())
}

/// `--metrics-linger`: the summary is out; keep the endpoint up a while.
fn linger(a: &ReplayArgs) {
    use std::io::Write;
    if a.metrics.is_some() && a.metrics_linger > 0 {
        let _ = std::io::stdout().flush();
        eprintln!("replay: serving the final metrics for {} s (--metrics-linger)", a.metrics_linger);
        std::thread::sleep(Duration::from_secs(a.metrics_linger));
    }
}

/// `kvwire replay-decode`: the decode engine, started by `replay`.
pub(crate) fn run_decode(a: DecodeArgs) -> Result<()> {
    let chan = SideChannel::connect(&a.connect, Duration::from_secs(10))?;
    decode::run(chan, None).map(|_| ())
}
