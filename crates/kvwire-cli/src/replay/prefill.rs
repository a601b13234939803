//! The prefill side of the replay: fills and sends each request's pages.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use crossbeam_channel::Receiver;
use indicatif::{ProgressBar, ProgressStyle};
use kvwire::HostBuffer;
use kvwire::kv::{KVCacheMemory, KVTransferEngine, PageIdxs, TransferReqData};
use kvwire::sidechannel::SideChannel;
use kvwire::transport::TransportConfig;

use super::model::ModelPreset;
use super::pool::PagePool;
use super::prefix::{LEAF, PrefixTier, offload_landed, page_content_key, page_hashes};
use super::report::Report;
use super::trace::{self, TraceRequest};
use super::{Geometry, Msg, ReplayArgs, default_trace, exchange_metadata, shard_key};
use crate::pattern::fill_page;
use crate::units::percentile;

/// `--host-tier-gib` when not given (with `--connector host`).
const DEFAULT_HOST_TIER_GIB: f64 = 4.0;

/// Receive side-channel messages on a thread so the engine loop never blocks.
pub(super) fn spawn_reader(chan: &SideChannel) -> Result<Receiver<Result<Msg, String>>> {
    let mut rx_chan = chan.try_clone()?;
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::Builder::new().name("replay-sidechannel".into()).spawn(move || {
        loop {
            let m = rx_chan.recv::<Msg>().map_err(|e| e.to_string());
            let stop = m.is_err();
            if tx.send(m).is_err() || stop {
                return;
            }
        }
    })?;
    Ok(rx)
}

/// Back off when a loop iteration did nothing: spin, yield, then sleep, so
/// the copy threads and the other process keep the cores.
pub(super) struct Idle(u32);

impl Idle {
    /// A fresh backoff.
    pub(super) fn new() -> Self {
        Self(0)
    }
    /// Something happened.
    pub(super) fn reset(&mut self) {
        self.0 = 0;
    }
    /// Nothing happened.
    pub(super) fn wait(&mut self) {
        self.0 += 1;
        if self.0 < 16 {
            std::hint::spin_loop();
        } else if self.0 < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Shape of one side's paged cache: `dp` replicas × `tp` shards × one group
/// of `num_pages` pages of `bytes_per_page` bytes.
#[derive(Clone, Copy)]
pub(super) struct CacheShape {
    /// Replicas.
    pub dp: usize,
    /// Shards.
    pub tp: usize,
    /// Pages per pool, null block included.
    pub num_pages: u64,
    /// Bytes of one page on one shard.
    pub bytes_per_page: u64,
    /// Replicated (MLA) group.
    pub mla: bool,
}

/// Build a KV engine of `shape` in host memory; returns the shard buffers
/// `[replica][shard]` too, for filling and checking pages.
/// Connect to a decode engine, trying again while its transport handshake
/// times out (a target starved of CPU or memory answers late; a timed-out
/// connect keeps nothing, see `TransportError::Timeout`) until `budget`
/// (`--wait-s`) is spent. A refusal or any other error fails at once.
pub(super) fn connect_within(
    engine: &mut KVTransferEngine,
    md: &kvwire::kv::KVTransferEngineMetadata,
    budget: Duration,
) -> Result<(), kvwire::kv::KvError> {
    use kvwire::engine::EngineError;
    use kvwire::kv::KvError;
    use kvwire::transport::TransportError;
    let deadline = Instant::now() + budget;
    loop {
        match engine.connect(md) {
            Err(KvError::Engine(EngineError::Transport(e @ TransportError::Timeout { op: "connect", .. })))
                if Instant::now() < deadline =>
            {
                eprintln!("replay: {e}; trying again (up to --wait-s {} s)", budget.as_secs());
            }
            other => return other,
        }
    }
}

pub(super) fn build_engine(
    name: &str,
    shape: &CacheShape,
    transport: kvwire::transport::TransportKind,
    cfg: &TransportConfig,
) -> Result<(KVTransferEngine, Vec<Vec<Arc<HostBuffer>>>)> {
    let CacheShape { dp, tp, num_pages, bytes_per_page, mla } = *shape;
    let mut memory = Vec::with_capacity(dp);
    let mut hosts = Vec::with_capacity(dp);
    for _ in 0..dp {
        let (m, h) = KVCacheMemory::new_host(tp, num_pages, bytes_per_page, mla && tp >= 2)
            .with_context(|| format!("allocating {num_pages} pages of {bytes_per_page} bytes x {tp} shards"))?;
        memory.push(vec![m]);
        hosts.push(h);
    }
    let listen = cfg.options.iter().find(|(k, _)| k == "listen").map(|(_, v)| v.clone());
    let engine = KVTransferEngine::new(name, memory, Some(vec![LEAF.to_string()]), transport, cfg);
    // A bind failure names the address.
    let engine = match listen {
        Some(l) => {
            engine.with_context(|| format!("starting the {name} engine's {transport} transport on listen={l}"))?
        }
        None => engine?,
    };
    Ok((engine, hosts))
}

struct Sending {
    req: TransferReqData,
    src: Vec<u64>,
    replica: usize,
    started: Instant,
    /// The offload of this request's new full pages, which pins `src`.
    offload: Option<kvwire::connector::KVConnectorTransfer>,
}

/// Check the flags before anything is loaded or allocated.
pub(super) fn validate(a: &ReplayArgs) -> Result<()> {
    let model = ModelPreset::by_name(&a.model)?;
    if a.layers == 0 || a.layers > model.layers {
        bail!("--layers must be 1..={} for {}", model.layers, model.name);
    }
    if a.requests == Some(0) {
        bail!("--requests must be at least 1 (it replays the first N requests of the trace)");
    }
    for (flag, v) in [
        ("--page-tokens", a.page_tokens),
        ("--tp", a.tp as u64),
        ("--decode-tp", a.decode_tp.unwrap_or(1) as u64),
        ("--dp", a.dp as u64),
        ("--inflight", a.inflight as u64),
        ("--copy-threads", a.copy_threads as u64),
        ("--decode-pages", a.decode_pages),
        ("--prefill-pages", a.prefill_pages.unwrap_or(1)),
        ("--prefills", a.prefills as u64),
    ] {
        if v == 0 {
            bail!("{flag} must be at least 1, got 0");
        }
    }
    if a.prefill_rank >= a.prefills {
        bail!("--prefill-rank must be 0..{} (0-based, below --prefills), got {}", a.prefills, a.prefill_rank);
    }
    if a.speed.is_some_and(|s| !(0.001..=1e6).contains(&s)) {
        bail!("--speed must be 0.001..=1000000 (times real time)");
    }
    // Finite, non-negative and bounded: a tier of at most 1 PiB, a decode
    // step of at most a minute.
    let tier_gib = a.host_tier_gib.unwrap_or(DEFAULT_HOST_TIER_GIB);
    if !(0.0..=(1u64 << 20) as f64).contains(&tier_gib) {
        bail!("--host-tier-gib must be 0..=1048576 (GiB), got {tier_gib}");
    }
    if a.host_tier_gib.is_some() && a.connector != "host" {
        bail!("--host-tier-gib sizes the host tier: it needs --connector host (the connector is {})", a.connector);
    }
    if !(0.0..=60_000.0).contains(&a.decode_step_ms) {
        bail!("--decode-step-ms must be 0..=60000 (ms per output token), got {}", a.decode_step_ms);
    }
    Ok(())
}

/// The prefill side: replays this process's share of the trace to the
/// decode engines on `chans` (request j of the share → `chans[j % len]`).
pub(super) fn run(a: &ReplayArgs, mut chans: Vec<SideChannel>) -> Result<Report> {
    let model = ModelPreset::by_name(&a.model)?;
    let tier_gib = a.host_tier_gib.unwrap_or(DEFAULT_HOST_TIER_GIB);
    let n_dec = chans.len();
    let role = a.role.is_some();
    let decode_tp = a.decode_tp.unwrap_or(a.tp);
    let page_bytes = |tp: usize, flag: &str| -> Result<u64> {
        let per_token = model.shard_bytes_per_token(a.layers, tp as u64).with_context(|| format!("{flag} {tp}"))?;
        per_token.checked_mul(a.page_tokens).filter(|&b| b <= 1 << 30).with_context(|| {
            format!("--page-tokens {} makes a page larger than 1 GiB ({per_token} bytes per token)", a.page_tokens)
        })
    };
    let prefill_bpp = page_bytes(a.tp, "--tp")?;
    let decode_bpp = page_bytes(decode_tp, "--decode-tp")?;
    let path = a.trace.clone().unwrap_or_else(default_trace);
    let reqs: Vec<TraceRequest> = trace::load(&path, a.requests)?
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % a.prefills == a.prefill_rank)
        .map(|(_, r)| r)
        .collect();
    if reqs.is_empty() {
        bail!("prefill {} of {} has no requests of the trace to replay", a.prefill_rank, a.prefills);
    }
    let pages_of = |r: &TraceRequest| r.input_length.div_ceil(a.page_tokens);
    let largest = reqs.iter().map(pages_of).max().unwrap_or(1);
    let prefill_pages = a.prefill_pages.unwrap_or((2 * largest + 1).max(1024));
    if largest >= prefill_pages || largest >= a.decode_pages {
        bail!("the largest request needs {largest} pages: raise --prefill-pages/--decode-pages or --page-tokens");
    }
    let pool = |pages: u64, bpp: u64, tp: usize| pages as u128 * bpp as u128 * tp as u128 * a.dp as u128;
    let (prefill_bytes, decode_bytes) =
        (pool(prefill_pages, prefill_bpp, a.tp), if role { 0 } else { pool(a.decode_pages, decode_bpp, decode_tp) });
    let tier_bytes = if a.connector == "host" { (tier_gib * (1u64 << 30) as f64) as u128 } else { 0 };
    crate::memcheck::check(
        "replay",
        prefill_bytes + decode_bytes + tier_bytes,
        &format!(
            "prefill pool {:.1} GiB + decode pool {:.1} GiB + host tier {:.1} GiB",
            prefill_bytes as f64 / (1u64 << 30) as f64,
            decode_bytes as f64 / (1u64 << 30) as f64,
            tier_bytes as f64 / (1u64 << 30) as f64
        ),
        "use fewer --decode-pages/--prefill-pages, fewer --layers, or a smaller --host-tier-gib",
    )?;
    let geometry = Geometry { bytes_per_page: decode_bpp, decode_tp, prefill_tp: a.tp, dp: a.dp, mla: model.mla };
    let prefill_name = if role { format!("prefill{}", a.prefill_rank) } else { "prefill".to_string() };
    for (d, chan) in chans.iter_mut().enumerate() {
        chan.send(&Msg::Setup {
            geometry: geometry.clone(),
            num_pages: a.decode_pages,
            transport: a.transport,
            copy_threads: a.copy_threads,
            options: a.decode_options.clone(),
            decode_step_ms: a.decode_step_ms,
            speed: a.speed,
            etcd: a.etcd.clone().map(|url| (url, a.etcd_prefix.clone())),
            decode_name: if role { format!("decode{d}-p{}", a.prefill_rank) } else { "decode".to_string() },
            prefill_name: prefill_name.clone(),
            summary: role,
            wait_s: a.wait_s,
        })?;
    }
    let cfg =
        TransportConfig { copy_threads: a.copy_threads, options: a.options.clone(), ..TransportConfig::default() };
    let shape =
        CacheShape { dp: a.dp, tp: a.tp, num_pages: prefill_pages, bytes_per_page: prefill_bpp, mla: model.mla };
    let (mut engine, hosts) = build_engine(&prefill_name, &shape, a.transport, &cfg)?;
    let etcd = a.etcd.clone().map(|url| (url, a.etcd_prefix.clone()));
    let mut decode_mds = Vec::with_capacity(n_dec);
    let mut published = Vec::with_capacity(n_dec);
    for (d, chan) in chans.iter_mut().enumerate() {
        let their = if role { format!("decode{d}-p{}", a.prefill_rank) } else { "decode".to_string() };
        let (md, p) = exchange_metadata(chan, etcd.as_ref(), &engine.metadata(), &their, false)?;
        connect_within(&mut engine, &md, Duration::from_secs(a.wait_s))
            .with_context(|| format!("connecting to the decode engine {}", md.name))?;
        decode_mds.push(md);
        published.push(p);
    }
    let (tx, inbox) = crossbeam_channel::unbounded();
    for (d, chan) in chans.iter().enumerate() {
        let rx = spawn_reader(chan)?;
        let tx = tx.clone();
        std::thread::Builder::new().name(format!("replay-decode-{d}")).spawn(move || {
            for m in rx {
                if tx.send((d, m)).is_err() {
                    return;
                }
            }
        })?;
    }
    drop(tx);
    let route = |id: u64| id as usize % n_dec;

    let mut pools: Vec<PagePool> = (0..a.dp).map(|_| PagePool::new(prefill_pages)).collect();
    let bar = ProgressBar::new(reqs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut r = Report {
        transport: a.transport.to_string(),
        model: model.name.to_string(),
        layers: a.layers,
        tp: a.tp,
        decode_tp,
        dp: a.dp,
        page_tokens: a.page_tokens,
        bytes_per_token: model.shard_bytes_per_token(a.layers, a.tp as u64)? * a.tp as u64,
        full_model_bytes_per_token: model.bytes_per_token(),
        unlimited_prefix_hit_rate: trace::unlimited_hit_rate(&reqs),
        decode_pool_capacity: a.decode_pages - 1,
        ..Report::default()
    };
    let started = Instant::now();
    let (mut next, mut open, mut verified) = (0usize, 0usize, 0usize);
    let mut ready: VecDeque<(u64, Vec<u64>)> = VecDeque::new();
    let mut sending: HashMap<u64, Sending> = HashMap::new();
    let mut lat_ms = Vec::with_capacity(reqs.len());
    let (mut busy, mut busy_since) = (Duration::ZERO, None::<Instant>);
    let mut idle = Idle::new();
    let mut tier = match a.connector.as_str() {
        "host" => Some(PrefixTier::new(&engine, (tier_gib * (1u64 << 30) as f64) as u64, a.page_tokens)?),
        _ => None,
    };
    let mut all_hashes: Vec<Vec<u64>> = Vec::new();
    let mut pinned: Vec<(usize, Vec<u64>, kvwire::connector::KVConnectorTransfer)> = Vec::new();
    // Where the bar is not drawn (stderr not a terminal: CI, a log file),
    // one line every 5 s instead, so a long run is never silent.
    let lines = !a.json && !std::io::IsTerminal::is_terminal(&std::io::stderr());
    if !a.json {
        eprintln!(
            "replay: {} requests from {}; progress: requests verified, GB moved (1 GB = 1e9 bytes), GB/s since the start",
            reqs.len(),
            path.display()
        );
    }
    let mut last_line = Instant::now();
    while verified < reqs.len() {
        if crate::failure::interrupted() {
            let secs = started.elapsed().as_secs_f64();
            bail!(
                "interrupted (Ctrl-C) after {secs:.1} s: {verified}/{} requests verified, {:.2} GB sent, {} bad pages, {} failed transfers",
                reqs.len(),
                r.bytes as f64 / 1e9,
                r.bad_pages,
                r.failed
            );
        }
        if lines && last_line.elapsed() >= Duration::from_secs(5) {
            last_line = Instant::now();
            let secs = started.elapsed().as_secs_f64();
            eprintln!(
                "replay: {:>6.0} s  {verified}/{} requests  {:.1} GB  {:.2} GB/s",
                secs,
                reqs.len(),
                r.bytes as f64 / 1e9,
                r.bytes as f64 / 1e9 / secs.max(1e-9)
            );
        }
        let mut progressed = false;
        // 1. admit arrivals
        while next < reqs.len() && open < a.inflight {
            let q = &reqs[next];
            if let Some(speed) = a.speed
                && started.elapsed().as_secs_f64() * 1e3 * speed < q.timestamp as f64
            {
                break;
            }
            let id = next as u64;
            chans[route(id)].send(&Msg::Alloc {
                id,
                pages: pages_of(q),
                replica: next % a.dp,
                arrival_ms: q.timestamp,
                output_len: q.output_length,
            })?;
            next += 1;
            open += 1;
            progressed = true;
        }
        // 2. messages from decode
        while let Ok(m) = inbox.try_recv() {
            progressed = true;
            let (d, m) = m;
            match m.map_err(|e| anyhow::anyhow!("decode engine {}: {e}", a.connect.get(d).map_or("process", |s| s)))? {
                Msg::Allocated { id, pages } => ready.push_back((id, pages)),
                Msg::Verified { id, bad_pages, error } => {
                    r.bad_pages += bad_pages;
                    if let Some(e) = error {
                        r.failed += 1;
                        tracing::error!("request {id}: {e}");
                    }
                    verified += 1;
                    open -= 1;
                    bar.inc(1);
                }
                other => bail!("unexpected message from decode: {other:?}"),
            }
        }
        // 3. fill and send what has destination pages, while source pages last
        while let Some((id, dst)) = ready.front() {
            let (id, q) = (*id, &reqs[*id as usize]);
            let replica = id as usize % a.dp;
            let Some(src) = pools[replica].alloc(dst.len() as u64) else { break };
            let dst = ready.pop_front().expect("front exists").1;
            let hashes = page_hashes(q, a.page_tokens);
            let keys: Vec<u64> = (0..src.len()).map(|j| page_content_key(id, j, &hashes)).collect();
            // Prefix reuse: pages the tier holds are loaded, not computed.
            let hit = match tier.as_mut() {
                Some(t) => t.load(&hashes, &src, replica)?,
                None => 0,
            };
            for (s, host) in hosts[replica].iter().enumerate() {
                for (j, &p) in src.iter().enumerate().skip(hit) {
                    let corrupt = j == 0 && a.inject_bad_page == Some(id);
                    let key = shard_key(keys[j], s) ^ u64::from(corrupt);
                    let mut page = vec![0u8; prefill_bpp as usize];
                    fill_page(&mut page, key);
                    host.write((p * prefill_bpp) as usize, &page);
                }
            }
            let offload = match tier.as_mut() {
                Some(t) => {
                    t.record(hit, hashes.len(), src.len(), prefill_bpp * a.tp as u64);
                    all_hashes.push(hashes.clone());
                    Some(t.offload(&hashes, &src, hit, replica)?)
                }
                None => None,
            };
            let t0 = Instant::now();
            let req = engine.initiate_send_transfer(
                decode_mds[route(id)].name.as_str(),
                &PageIdxs::per_leaf([(LEAF, src.clone())]),
                &PageIdxs::per_leaf([(LEAF, dst.clone())]),
                replica,
                replica,
            )?;
            busy_since.get_or_insert(t0);
            chans[route(id)].send(&Msg::Sent { id, req: req.to_json(), keys })?;
            r.requests += 1;
            r.tokens += q.input_length;
            r.pages += src.len() as u64;
            // What lands on decode: every decode shard's pages (with
            // BROADCAST, prefill shard 0's bytes once per decode shard).
            r.bytes += src.len() as u64 * decode_bpp * decode_tp as u64;
            sending.insert(id, Sending { req, src, replica, started: t0, offload });
            progressed = true;
        }
        // 4. completions of our sends
        let mut finished = Vec::new();
        for (id, s) in &sending {
            match engine.is_complete(&s.req) {
                Ok(false) => {}
                Ok(true) => finished.push((*id, None)),
                Err(e) => finished.push((*id, Some(e.to_string()))),
            }
        }
        for (id, err) in finished {
            let s = sending.remove(&id).expect("listed above");
            lat_ms.push(s.started.elapsed().as_secs_f64() * 1e3);
            match err {
                None => engine.cleanup_transfer(&s.req)?,
                Some(e) => {
                    // Cancel what may still be moving before the pages go back.
                    engine.cancel_transfer(&s.req)?;
                    chans[route(id)].send(&Msg::Abort { id, reason: e })?;
                }
            }
            match s.offload {
                Some(off) if !offload_landed(&off) => pinned.push((s.replica, s.src, off)),
                _ => pools[s.replica].free(s.src),
            }
            progressed = true;
        }
        // 5. pages pinned by an offload go back once it landed
        let mut k = 0;
        while k < pinned.len() {
            if offload_landed(&pinned[k].2) {
                let (replica, src, _) = pinned.swap_remove(k);
                pools[replica].free(src);
                progressed = true;
            } else {
                k += 1;
            }
        }
        if sending.is_empty()
            && let Some(t) = busy_since.take()
        {
            busy += t.elapsed();
        }
        if progressed {
            idle.reset();
        } else {
            idle.wait();
        }
    }
    if let Some(t) = busy_since.take() {
        busy += t.elapsed();
    }
    for chan in &mut chans {
        chan.send(&Msg::Finish)?;
    }
    let (mut finished, mut got) = (0u64, 0usize);
    while got < n_dec {
        match inbox.recv_timeout(Duration::from_secs(60)).context("waiting for decode's final figures")? {
            (_, Ok(Msg::Finished { high_water, backpressured, .. })) => {
                r.backpressured += backpressured;
                finished = finished.max(high_water);
                got += 1;
            }
            (_, Ok(_)) => continue,
            (_, Err(e)) => bail!("decode process: {e}"),
        }
    }
    bar.finish_and_clear();
    r.elapsed_s = started.elapsed().as_secs_f64();
    r.gb_per_s = r.bytes as f64 / 1e9 / r.elapsed_s;
    r.wire_gb_per_s = r.bytes as f64 / 1e9 / busy.as_secs_f64().max(1e-9);
    r.p50_ms = percentile(&mut lat_ms, 0.5);
    r.p99_ms = percentile(&mut lat_ms, 0.99);
    r.max_ms = percentile(&mut lat_ms, 1.0);
    r.decode_pool_high_water = finished;
    r.connector = a.connector.clone();
    r.prefix = tier.map(|t| t.finish(&all_hashes));
    r.verified = r.bad_pages == 0 && r.failed == 0 && r.requests == reqs.len() as u64;
    r.decode_engines = n_dec;
    r.prefills = a.prefills;
    r.prefill_rank = a.prefill_rank;
    if role {
        let (table, json) = (super::report::render(&r, false), super::report::render(&r, true));
        for chan in &mut chans {
            chan.send(&Msg::Summary { table: table.clone(), json: json.clone() })?;
        }
    }
    drop(published);
    engine.cleanup()?;
    Ok(r)
}
