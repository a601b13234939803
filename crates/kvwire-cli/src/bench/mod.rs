//! `kvwire bench`: perftest/nixlbench-style measurement of one transport.
//!
//! The initiator posts `--blocks` blocks of `--block-size` bytes per
//! transfer (destination pages a seeded random permutation with `--scatter`),
//! `--iters` times, and reports GB/s, transfer latency p50/p99, the prep+post
//! cost per block, single-block latency, and the copy ceilings of the same
//! pattern measured in the same run (1-thread `memcpy`, and the
//! `--copy-threads`-thread ceiling: see [`crate::ceiling`]). Every byte is
//! verified at the end (by the target for WRITE, locally for READ).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvwire::HostBuffer;
use kvwire::engine::{AgentMetadata, Desc, TransferEngine, TransferHandle, TransferStatus};
use kvwire::sidechannel::{SideChannel, SideListener};
use kvwire::transport::{Op, TransportConfig, TransportKind};
use serde::{Deserialize, Serialize};

use crate::pattern::{check_page, fill_page, mix, permutation};
use crate::units::{human, parse_kv, parse_size, percentile};

mod target;
pub(crate) use target::{TargetArgs, run_target};

/// Options of `kvwire bench`.
#[derive(Args, Debug, Clone)]
pub(crate) struct BenchArgs {
    /// Transport: shm, verbs or tcp (default: shm, or tcp when --connect
    /// names another host; shm works within one host only).
    #[arg(long = "transport", value_name = "TRANSPORT")]
    transport_flag: Option<TransportKind>,
    /// The transport used (resolved from --transport and --connect).
    #[arg(skip = TransportKind::Shm)]
    transport: TransportKind,
    /// write (push to the target) or read (pull from it).
    #[arg(long, default_value = "write", value_parser = ["write", "read"])]
    op: String,
    /// Bytes per block (e.g. 4KiB, 64KiB, 1MiB).
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    block_size: u64,
    /// Blocks per transfer.
    #[arg(long, default_value_t = 4096)]
    blocks: u64,
    /// Measured transfers (1..=1000000).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Unmeasured transfers first (0..=1000000).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Destination blocks in a random permutation (a paged cache); default: contiguous.
    #[arg(long)]
    scatter: bool,
    /// How the target registers its buffer: `memfd` (kvwire's HostBuffer,
    /// whose sealed memfd shm peers map and copy into directly) or `plain`
    /// (by address only, as a Python or torch engine registers its own
    /// memory: shm then copies by cross-memory attach). Other transports
    /// move the same bytes either way.
    #[arg(long, default_value = "memfd", value_parser = ["memfd", "plain"])]
    target_memory: String,
    /// Transfers in flight at once in the measured phase (1: one after the
    /// other, each timed alone; more: a stream, as perftest's outstanding
    /// messages); 1..=4096.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Post the transfers without a notification (perftest sends none); by
    /// default each carries one, checked on the target.
    #[arg(long)]
    no_notify: bool,
    /// Single-block transfers timed for the latency columns (0..=1000000;
    /// default 200, fewer for large blocks: at most 2 GiB moved, at least 5).
    #[arg(long = "lat-iters", value_name = "LAT_ITERS")]
    lat_iters_flag: Option<usize>,
    /// The latency transfers used (resolved from --lat-iters and the block size).
    #[arg(skip)]
    lat_iters: usize,
    /// Copy/progress threads of CPU-copying transports.
    #[arg(long, default_value_t = 2)]
    copy_threads: usize,
    /// Backend option for this side, `key=value` (repeatable), e.g. gid_index=1.
    #[arg(long = "option", value_parser = parse_kv)]
    options: Vec<(String, String)>,
    /// Backend option for the target side (repeatable).
    #[arg(long = "target-option", value_parser = parse_kv)]
    target_options: Vec<(String, String)>,
    /// RDMA device for this side (same as --option device=NAME).
    #[arg(long)]
    device: Option<String>,
    /// RDMA device for the target side.
    #[arg(long)]
    target_device: Option<String>,
    /// Seed of the permutation.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Wait for transfers by polling `status` (spin, then yield, then
    /// `--wait-sleep-us` sleeps), as a NIXL caller polls `check_xfer_state`,
    /// instead of `TransferEngine::wait` (which polls briefly, then sleeps on
    /// the transport's completion channel).
    #[arg(long)]
    poll_wait: bool,
    /// With --poll-wait: sleep this many microseconds between status polls
    /// once spinning and yielding found the transfer unfinished (0: never
    /// sleep; at most 1000000). For CPU-starved hosts (the Soft-RoCE guest),
    /// where a polling application thread competes with the transport's
    /// progress thread and the (software) NIC for the same cores.
    #[arg(long, default_value_t = 0, requires = "poll_wait")]
    wait_sleep_us: u64,
    /// Be the target and wait for an initiator on ADDR (two terminals).
    #[arg(long, conflicts_with = "connect")]
    listen: Option<String>,
    /// With --listen: give up with an error when no initiator came within
    /// this many seconds (unset: wait for ever, as perftest's server does; a
    /// line every 60 s says the target is still waiting).
    #[arg(long, value_parser = crate::units::parse_seconds, requires = "listen")]
    listen_timeout: Option<Duration>,
    /// Be the initiator against a target listening on ADDR (two terminals).
    #[arg(long)]
    connect: Option<String>,
    /// With --connect: seconds to wait for the target to accept the
    /// connection and answer; a dead or silent target fails after this.
    #[arg(long, default_value = crate::dial::DEFAULT_CONNECT_TIMEOUT_S, value_parser = crate::units::parse_seconds)]
    connect_timeout: Duration,
}

/// The side channel's messages between initiator and target.
#[derive(Debug, Serialize, Deserialize)]
enum Ctl {
    Setup {
        transport: TransportKind,
        op: Op,
        block_size: u64,
        blocks: u64,
        options: Vec<(String, String)>,
        copy_threads: usize,
        /// `--target-memory plain`: register the buffer without its memfd.
        #[serde(default)]
        plain_memory: bool,
    },
    Meta(Vec<u8>),
    Verify {
        seed: u64,
        scatter: bool,
        notifications: usize,
    },
    Verified {
        bad_blocks: u64,
        notifications: usize,
    },
    Exit,
    /// Target → initiator: the target could not go on (its cause).
    Failed(String),
    /// Target → initiator, at once on a Setup (before the engine and the
    /// buffer, which may take long): a kvwire bench target is there.
    Accepted,
}

/// Key of the contents of source block `i`.
fn block_key(i: u64) -> u64 {
    mix(i ^ 0x6b76_7769_7265)
}

fn config(copy_threads: usize, options: Vec<(String, String)>) -> TransportConfig {
    TransportConfig { copy_threads, options, ..TransportConfig::default() }
}

fn fill_blocks(buf: &HostBuffer, block_size: u64, blocks: u64) {
    let mut page = vec![0u8; block_size as usize];
    for i in 0..blocks {
        fill_page(&mut page, block_key(i));
        buf.write((i * block_size) as usize, &page);
    }
}

/// Source block `i` lands in destination block `dst[i]`.
fn destinations(blocks: u64, scatter: bool, seed: u64) -> Vec<u32> {
    if scatter { permutation(blocks as usize, seed) } else { (0..blocks as u32).collect() }
}

/// Blocks of `buf` whose contents are wrong. Source block `i` (contents
/// `block_key(i)`) moves to destination block `dst[i]`: for WRITE the target
/// checks its block `dst[i]`; for READ the initiator pulled the target's
/// block `dst[i]` (contents `block_key(dst[i])`) into its block `i`.
fn count_bad(buf: &HostBuffer, block_size: u64, dst: &[u32], op: Op) -> u64 {
    let mut bad = 0;
    let mut page = vec![0u8; block_size as usize]; // one scratch page, reused
    for (i, &d) in dst.iter().enumerate() {
        let (at, key) = match op {
            Op::Write => (d as u64, block_key(i as u64)),
            Op::Read => (i as u64, block_key(d as u64)),
        };
        buf.copy_to((at * block_size) as usize, &mut page);
        if !check_page(&page, key) {
            bad += 1;
        }
    }
    bad
}

/// Longest wait for one transfer of the bench.
const WAIT_LIMIT: Duration = Duration::from_secs(120);

fn wait_done(e: &mut TransferEngine, h: TransferHandle, a: &BenchArgs) -> Result<()> {
    let status = if a.poll_wait { poll_status(e, h, a.wait_sleep_us)? } else { e.wait(h, WAIT_LIMIT)? };
    match status {
        TransferStatus::Done => Ok(e.release(h)?),
        TransferStatus::Failed(why) => bail!("transfer failed: {why}"),
        TransferStatus::InProgress => bail!("transfer did not finish in {} s", WAIT_LIMIT.as_secs()),
    }
}

/// `--poll-wait`: poll `status` until the transfer ends or [`WAIT_LIMIT`]
/// passes; spin briefly, then yield the core to the copy threads (this
/// machine may have no more cores than the transport has threads), then
/// sleep `sleep_us` between polls when it is non-zero.
fn poll_status(e: &mut TransferEngine, h: TransferHandle, sleep_us: u64) -> Result<TransferStatus> {
    let deadline = Instant::now() + WAIT_LIMIT;
    let mut spins = 0u32;
    loop {
        let status = e.status(h)?;
        if status != TransferStatus::InProgress || Instant::now() > deadline {
            return Ok(status);
        }
        if spins < 64 {
            spins += 1;
            std::hint::spin_loop();
        } else if sleep_us == 0 || spins < 128 {
            spins += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(sleep_us));
        }
    }
}

/// The measured figures (`--json` prints them).
#[derive(Debug, Serialize)]
struct Report {
    transport: String,
    op: String,
    block_size: u64,
    blocks: u64,
    bytes_per_transfer: u64,
    iters: usize,
    /// Single-block latency transfers (`--lat-iters` or its default).
    lat_iters: usize,
    scatter: bool,
    /// How the target registered its buffer (`--target-memory`).
    target_memory: String,
    copy_threads: usize,
    pipeline: usize,
    /// How the initiator waited for each transfer: `block`
    /// (`TransferEngine::wait`) or `poll` (`--poll-wait`).
    wait: &'static str,
    segments_after_coalescing: usize,
    gb_per_s: f64,
    /// One thread `memcpy` of the same page pattern (GB/s).
    memcpy_gb_per_s: f64,
    /// `gb_per_s / memcpy_gb_per_s`.
    memcpy_ratio: f64,
    /// `copy_threads` threads `memcpy` of the same pattern (GB/s).
    memcpy_n_gb_per_s: f64,
    /// `copy_threads` threads, the copy core's streaming-store copy (GB/s).
    stream_n_gb_per_s: f64,
    /// The N-thread ceiling: the faster of the two N-thread copies (GB/s).
    ceiling_gb_per_s: f64,
    /// `gb_per_s / ceiling_gb_per_s`.
    ceiling_ratio: f64,
    p50_us: f64,
    p99_us: f64,
    post_ns_per_block: f64,
    /// CPU time of the posting thread in prep+post per block (ns): the
    /// wall-clock figure without the time the poster spent preempted by the
    /// copy threads it woke.
    post_cpu_ns_per_block: f64,
    page_p50_us: f64,
    page_p99_us: f64,
    /// Notifications the target received (one per transfer, none with `--no-notify`).
    notifications_received: usize,
    verified: bool,
}

/// Most `--iters`, `--warmup` and `--lat-iters` (each keeps a sample per
/// transfer): a million takes hours at 4 KiB already.
const MAX_ITERS: usize = 1_000_000;
/// Most `--pipeline`: transfers in flight at once.
const MAX_PIPELINE: usize = 4096;
/// Most `--wait-sleep-us` (1 s): a longer sleep only delays each transfer.
const MAX_WAIT_SLEEP_US: u64 = 1_000_000;

/// Counts that are zero where at least one is needed, or so large that the
/// run would exhaust memory or never end.
fn check_counts(a: &BenchArgs) -> Result<()> {
    for (flag, v) in [("--iters", a.iters), ("--warmup", a.warmup), ("--lat-iters", a.lat_iters)] {
        if v > MAX_ITERS {
            bail!("{flag} {v} is more than {MAX_ITERS}");
        }
    }
    if !(1..=MAX_PIPELINE).contains(&a.pipeline) {
        bail!("--pipeline must be 1..={MAX_PIPELINE} (transfers in flight at once), got {}", a.pipeline);
    }
    if a.wait_sleep_us > MAX_WAIT_SLEEP_US {
        bail!("--wait-sleep-us must be at most {MAX_WAIT_SLEEP_US} (1 s), got {}", a.wait_sleep_us);
    }
    Ok(())
}

/// Default `--lat-iters` for `block_size`: 200, but no more than 2 GiB
/// moved in all (a whole 1 GiB block 200 times took 82 s), and at least 5.
fn default_lat_iters(block_size: u64) -> usize {
    ((2u64 << 30) / block_size.max(1)).clamp(5, 200) as usize
}

/// Flags that set the test: a `--listen` target takes them from the
/// initiator's Setup, so giving them there would be silently ignored.
const INITIATOR_FLAGS: &[&str] = &[
    "--transport",
    "--op",
    "--block-size",
    "--blocks",
    "--iters",
    "--warmup",
    "--scatter",
    "--pipeline",
    "--no-notify",
    "--lat-iters",
    "--copy-threads",
    "--option",
    "--target-option",
    "--device",
    "--target-device",
    "--seed",
    "--json",
    "--poll-wait",
    "--wait-sleep-us",
    "--connect-timeout",
];

/// The test flags among `args` (the command line), for `--listen`.
fn initiator_flags_given(args: &[String]) -> Vec<&'static str> {
    INITIATOR_FLAGS
        .iter()
        .copied()
        .filter(|f| args.iter().any(|a| a == f || a.strip_prefix(f).is_some_and(|r| r.starts_with('='))))
        .collect()
}

/// The transport: `--transport`, else tcp when `--connect` names another
/// host (shm cannot cross hosts), else shm; shm towards another host is
/// refused saying what to add.
fn resolve_transport(a: &BenchArgs) -> Result<TransportKind> {
    let remote = a.connect.as_deref().and_then(reached_ip);
    match (a.transport_flag, remote) {
        (Some(TransportKind::Shm), Some(ip)) => Err(crate::failure::user_error(
            format!("--transport shm moves bytes within one host; the target at {ip} is another host"),
            "add --transport tcp (or --transport verbs with RDMA devices on both hosts)",
        )),
        (Some(t), _) => Ok(t),
        (None, Some(ip)) => {
            eprintln!(
                "kvwire bench: the target at {ip} is another host: using --transport tcp (shm works within one host; add --transport verbs for RDMA)"
            );
            Ok(TransportKind::Tcp)
        }
        (None, None) => Ok(TransportKind::Shm),
    }
}

/// `kvwire bench`.
pub(crate) fn run(mut a: BenchArgs) -> Result<()> {
    if a.listen.is_some() {
        let args: Vec<String> = std::env::args().collect();
        let given = initiator_flags_given(&args);
        if !given.is_empty() {
            bail!(
                "{} set the test, which a `bench --listen` target takes from its initiator: give {} to `kvwire bench --connect` instead (target-side backend options: --target-option there)",
                given.join(", "),
                if given.len() == 1 { "it" } else { "them" }
            );
        }
    }
    for (flag, v) in [("--blocks", a.blocks), ("--iters", a.iters as u64), ("--block-size", a.block_size)] {
        if v == 0 {
            bail!("{flag} must be at least 1, got 0");
        }
    }
    if let Some(c) = &a.connect {
        crate::dial::check_host_port(c)?;
    }
    a.transport = resolve_transport(&a)?;
    if a.listen.is_none() {
        crate::failure::catch_interrupt();
    }
    a.lat_iters = a.lat_iters_flag.unwrap_or_else(|| default_lat_iters(a.block_size));
    check_counts(&a)?;
    crate::units::check_option_keys(a.transport, "--option", &a.options)?;
    crate::units::check_option_keys(a.transport, "--target-option", &a.target_options)?;
    let total =
        a.block_size.checked_mul(a.blocks).filter(|&t| t <= 64 << 30).context("block size × blocks exceeds 64 GiB")?;
    // Buffers on this host: the target's, the initiator's, and the memcpy
    // baseline's copy (the two-terminal target holds only its own).
    let (copies, who) = match (&a.listen, &a.connect) {
        (Some(_), _) => (1, "the target's buffer"),
        (None, Some(_)) => (2, "the initiator's buffer and the memcpy baseline's"),
        (None, None) => (3, "target, initiator and memcpy-baseline buffers"),
    };
    crate::memcheck::check(
        "bench",
        total as u128 * copies,
        &format!("{copies} x {} = --block-size x --blocks: {who}", human(total)),
        "use fewer --blocks or a smaller --block-size",
    )?;
    if let Some(addr) = &a.listen {
        let mut l = SideListener::bind(addr).with_context(|| {
            if addr.parse::<std::net::SocketAddr>().is_ok() {
                format!("--listen {addr}")
            } else {
                format!("--listen {addr} (expected IP:PORT, e.g. 0.0.0.0:18515)")
            }
        })?;
        let bound = l.local_addr();
        eprintln!("kvwire bench: target waiting for an initiator on {bound}");
        return target::listen(&mut l, &bound.to_string(), a.listen_timeout);
    }
    let mut child = None;
    let mut chan = match &a.connect {
        Some(addr) => crate::dial::connect(addr, a.connect_timeout)?,
        None => {
            let (l, addr) = SideChannel::bind("127.0.0.1:0")?;
            child = Some(crate::child::Child::spawn("target", &["bench-target", "--connect", &addr.to_string()])?);
            SideChannel::accept(&l)?
        }
    };
    let result = initiate(&a, total, &mut chan);
    let _ = chan.send(&Ctl::Exit);
    drop(chan);
    let result = match child {
        Some(c) => c.finish(result),
        None => result,
    };
    let report = result?;
    print_report(&report, a.json);
    if !report.verified {
        bail!("verification failed");
    }
    Ok(())
}

fn initiate(a: &BenchArgs, total: u64, chan: &mut SideChannel) -> Result<Report> {
    let op = if a.op == "read" { Op::Read } else { Op::Write };
    let mut mine = a.options.clone();
    mine.extend(a.device.iter().map(|d| ("device".to_string(), d.clone())));
    let mut theirs = a.target_options.clone();
    theirs.extend(a.target_device.iter().map(|d| ("device".to_string(), d.clone())));
    // A target on another host (two terminals, tcp): have it listen on the
    // address this initiator reached it at, which is routable from here, unless
    // the user chose its address.
    if a.transport == TransportKind::Tcp
        && !theirs.iter().any(|(k, _)| k == "listen" || k == "advertise")
        && let Some(ip) = a.connect.as_deref().and_then(reached_ip)
    {
        theirs.push(("listen".to_string(), std::net::SocketAddr::new(ip, 0).to_string()));
    }
    chan.send(&Ctl::Setup {
        transport: a.transport,
        op,
        block_size: a.block_size,
        blocks: a.blocks,
        options: theirs,
        copy_threads: a.copy_threads,
        plain_memory: a.target_memory == "plain",
    })?;
    let peer = a.connect.as_deref().unwrap_or("the target process");
    match crate::dial::expect_answer(chan, peer, a.connect_timeout)? {
        Ctl::Accepted => {}
        Ctl::Failed(cause) => bail!("the target failed: {cause}"),
        other => bail!("{peer} answered {other:?} instead of accepting: a different kvwire version?"),
    }
    // The target now builds its engine and fills its buffer.
    chan.set_read_timeout(Some(Duration::from_secs(120)))?;
    let bytes = match chan.recv()? {
        Ctl::Meta(bytes) => bytes,
        Ctl::Failed(cause) => bail!("the target failed: {cause}"),
        other => bail!("expected the target's metadata, got {other:?}"),
    };
    let meta = AgentMetadata::from_bytes(&bytes)?;
    let mut engine = TransferEngine::new("bench-initiator", a.transport, &config(a.copy_threads, mine))?;
    let buf = Arc::new(HostBuffer::new(total as usize)?);
    engine.register(buf.clone())?;
    engine.connect(&meta)?;
    if op == Op::Write {
        fill_blocks(&buf, a.block_size, a.blocks);
    }
    let remote_base = meta.regions.first().context("target registered nothing")?.addr;
    let dst = destinations(a.blocks, a.scatter, a.seed);
    let local: Vec<Desc> = (0..a.blocks).map(|i| Desc::new(buf.addr() + i * a.block_size, a.block_size)).collect();
    let remote: Vec<Desc> =
        dst.iter().map(|&d| Desc::new(remote_base + d as u64 * a.block_size, a.block_size)).collect();

    let segment_count = count_segments(&local, &remote);
    if !a.json {
        // The header now, before the measured phases (which may take long).
        use std::io::Write;
        println!("{}", header(a, total, segment_count));
        let _ = std::io::stdout().flush();
    }
    let mut progress = Progress::new(a.json);
    let mut lat_us = Vec::with_capacity(a.iters);
    let mut post_ns = Vec::with_capacity(a.iters);
    let mut post_cpu_ns = Vec::with_capacity(a.iters);
    let mut segments = Vec::new();
    let mut moved_ns = 0u128;
    for it in 0..a.warmup {
        let notification = (!a.no_notify).then(|| format!("iter-{it}").into_bytes());
        let h = engine.post_with(op, &local, &meta.name, &remote, notification, &mut segments)?;
        wait_done(&mut engine, h, a)?;
    }
    if op == Op::Read {
        // Every measured READ rewrites the whole buffer: start from zeros so
        // the check below proves they did.
        buf.fill_with(0, buf.len(), |_| 0);
    }
    // Measured transfers, up to `--pipeline` in flight (1: one after the
    // other); bandwidth = bytes / wall time of the whole phase.
    let depth = a.pipeline;
    let mut inflight: std::collections::VecDeque<(TransferHandle, Instant)> = std::collections::VecDeque::new();
    let phase = Instant::now();
    let mut next = 0;
    while next < a.iters || !inflight.is_empty() {
        while next < a.iters && inflight.len() < depth {
            let notification = (!a.no_notify).then(|| format!("iter-{}", a.warmup + next).into_bytes());
            let cpu0 = thread_cpu_ns();
            let t0 = Instant::now();
            let h = engine.post_with(op, &local, &meta.name, &remote, notification, &mut segments)?;
            post_ns.push(t0.elapsed().as_nanos() as f64 / a.blocks as f64);
            post_cpu_ns.push(thread_cpu_ns().saturating_sub(cpu0) as f64 / a.blocks as f64);
            inflight.push_back((h, t0));
            next += 1;
        }
        let (h, t0) = inflight.pop_front().expect("the loop keeps one in flight");
        wait_done(&mut engine, h, a)?;
        lat_us.push(t0.elapsed().as_secs_f64() * 1e6);
        progress.tick("measured transfers", lat_us.len(), a.iters)?;
    }
    moved_ns += phase.elapsed().as_nanos();
    let verified_local = op == Op::Write || count_bad(&buf, a.block_size, &dst, Op::Read) == 0;
    let mut page_lat = Vec::with_capacity(a.lat_iters);
    for i in 0..a.lat_iters {
        let k = i % a.blocks as usize;
        let t0 = Instant::now();
        let h = engine.post_with(op, &local[k..k + 1], &meta.name, &remote[k..k + 1], None, &mut segments)?;
        wait_done(&mut engine, h, a)?;
        page_lat.push(t0.elapsed().as_secs_f64() * 1e6);
        progress.tick("single-block latency transfers", page_lat.len(), a.lat_iters)?;
    }
    let notifications = if a.no_notify { 0 } else { a.warmup + a.iters };
    chan.send(&Ctl::Verify { seed: a.seed, scatter: a.scatter, notifications })?;
    let (bad_blocks, got) = match chan.recv()? {
        Ctl::Verified { bad_blocks, notifications } => (bad_blocks, notifications),
        Ctl::Failed(cause) => bail!("the target failed: {cause}"),
        other => bail!("expected Verified, got {other:?}"),
    };
    let ceil = crate::ceiling::measure(&buf, a.block_size, &dst, op, a.iters, a.copy_threads)?;
    let gb_per_s = (total as f64 * a.iters as f64) / (moved_ns as f64);
    Ok(Report {
        transport: a.transport.to_string(),
        op: a.op.clone(),
        block_size: a.block_size,
        blocks: a.blocks,
        bytes_per_transfer: total,
        iters: a.iters,
        lat_iters: a.lat_iters,
        scatter: a.scatter,
        target_memory: a.target_memory.clone(),
        copy_threads: a.copy_threads,
        pipeline: a.pipeline,
        wait: if a.poll_wait { "poll" } else { "block" },
        segments_after_coalescing: segment_count,
        gb_per_s,
        memcpy_gb_per_s: ceil.memcpy_1,
        memcpy_ratio: gb_per_s / ceil.memcpy_1,
        memcpy_n_gb_per_s: ceil.memcpy_n,
        stream_n_gb_per_s: ceil.stream_n,
        ceiling_gb_per_s: ceil.ceiling(),
        ceiling_ratio: gb_per_s / ceil.ceiling(),
        p50_us: percentile(&mut lat_us.clone(), 0.5),
        p99_us: percentile(&mut lat_us, 0.99),
        post_ns_per_block: percentile(&mut post_ns, 0.5),
        post_cpu_ns_per_block: percentile(&mut post_cpu_ns, 0.5),
        page_p50_us: percentile(&mut page_lat.clone(), 0.5),
        page_p99_us: percentile(&mut page_lat, 0.99),
        notifications_received: got,
        verified: verified_local && bad_blocks == 0 && got >= notifications,
    })
}

/// The IP `--connect HOST:PORT` resolves to, unless it is a loopback address.
fn reached_ip(addr: &str) -> Option<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let ip = addr.to_socket_addrs().ok()?.next()?.ip();
    (!ip.is_loopback()).then_some(ip)
}

/// CPU time this thread has used (ns), `CLOCK_THREAD_CPUTIME_ID`.
fn thread_cpu_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

/// Segments `local`/`remote` coalesce into (as the engine merges them).
fn count_segments(local: &[Desc], remote: &[Desc]) -> usize {
    1 + local
        .windows(2)
        .zip(remote.windows(2))
        .filter(|(l, r)| l[0].addr + l[0].len_bytes != l[1].addr || r[0].addr + r[0].len_bytes != r[1].addr)
        .count()
}

/// The table's first line, printed before the measured phases.
fn header(a: &BenchArgs, total: u64, segments: usize) -> String {
    format!(
        "kvwire bench: {} {}, {} x {} blocks ({}), {}, {} iters, {} latency iters, {} copy threads, {} segments after coalescing",
        a.transport,
        a.op.to_uppercase(),
        a.blocks,
        human(a.block_size),
        human(total),
        if a.scatter { "scattered" } else { "contiguous" },
        a.iters,
        a.lat_iters,
        a.copy_threads,
        segments
    )
}

/// A line on stderr every 2 s of a long phase (as perftest prints), so
/// that a large run is never silent.
struct Progress {
    last: Instant,
    started: Instant,
    quiet: bool,
    every: Duration,
}

impl Progress {
    fn new(quiet: bool) -> Self {
        // KVWIRE_PROGRESS_MS: a shorter interval, for the tests.
        let every = std::env::var("KVWIRE_PROGRESS_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(PROGRESS_EVERY, Duration::from_millis);
        Self { last: Instant::now(), started: Instant::now(), quiet, every }
    }

    /// One more of `of` done; stops the run on Ctrl-C with what was done.
    fn tick(&mut self, what: &str, done: usize, of: usize) -> Result<()> {
        if crate::failure::interrupted() {
            bail!(
                "interrupted (Ctrl-C) after {done}/{of} {what} ({:.1} s into the run)",
                self.started.elapsed().as_secs_f64()
            );
        }
        if !self.quiet && self.last.elapsed() >= self.every {
            self.last = Instant::now();
            eprintln!("kvwire bench: {done}/{of} {what}");
        }
        Ok(())
    }
}

/// How often [`Progress`] prints.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

fn print_report(r: &Report, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).expect("plain data"));
        return;
    }
    println!(
        "{:>10} {:>7} {:>8} {:>11} {:>6} {:>12} {:>6} {:>9} {:>9} {:>13} {:>11} {:>11} {:>9}",
        "block",
        "blocks",
        "GB/s",
        "memcpy GB/s",
        "ratio",
        "ceiling GB/s",
        "ratio",
        "p50 us",
        "p99 us",
        "post ns/block",
        "page p50 us",
        "page p99 us",
        "verified"
    );
    println!(
        "{:>10} {:>7} {:>8.2} {:>11.2} {:>6.2} {:>12.2} {:>6.2} {:>9.1} {:>9.1} {:>13.1} {:>11.1} {:>11.1} {:>9}",
        human(r.block_size),
        r.blocks,
        r.gb_per_s,
        r.memcpy_gb_per_s,
        r.memcpy_ratio,
        r.ceiling_gb_per_s,
        r.ceiling_ratio,
        r.p50_us,
        r.p99_us,
        r.post_ns_per_block,
        r.page_p50_us,
        r.page_p99_us,
        r.verified
    );
    println!(
        "  GB/s = 1e9 bytes/s over the measured transfers; memcpy = one thread copying the same block pattern in \
         this run; ratio = GB/s / memcpy;\n  p50/p99 = transfer latency (post to completion); post ns/block = \
         prep + post per block; page p50/p99 = one block posted and waited for"
    );
}
