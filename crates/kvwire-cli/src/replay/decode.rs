//! The decode side of the replay: allocates destination pages, waits for
//! each transfer, verifies every byte, and frees pages in simulated time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Instant;

use anyhow::{Result, bail};
use kvwire::kv::TransferReqData;
use kvwire::sidechannel::{SideChannel, SideChannelError};
use kvwire::transport::{TransportConfig, TransportKind};

use super::pool::PagePool;
use super::prefill::{CacheShape, Idle, build_engine, spawn_reader};
use super::{Msg, exchange_metadata, shard_key};
use crate::pattern::{check_from, mix, word};

struct Pending {
    id: u64,
    pages: u64,
    replica: usize,
    arrival_ms: u64,
    output_len: u64,
    waited: bool,
}

struct Holding {
    pages: Vec<u64>,
    replica: usize,
    arrival_ms: u64,
    output_len: u64,
    req: Option<TransferReqData>,
    keys: Vec<u64>,
}

/// A release in simulated time: (time in µs, request id).
type Release = Reverse<(u64, u64)>;

/// What `replay --role decode` sets on its own side (the one-host replay
/// takes all of it from prefill's Setup).
#[derive(Debug, Clone)]
pub(super) struct Own {
    /// Transport this decode was started with (must match prefill's).
    pub transport: TransportKind,
    /// Copy threads.
    pub copy_threads: usize,
    /// This side's backend options (`--option`).
    pub options: Vec<(String, String)>,
}

/// What one prefill connection ended with (`--role decode`).
pub(super) struct Served {
    /// The prefill's summary table.
    pub table: String,
    /// The same as one JSON object.
    pub json: String,
    /// Pages (× shards) that this side found wrong.
    pub bad_pages: u64,
}

pub(super) fn run(mut chan: SideChannel, own: Option<&Own>) -> Result<Option<Served>> {
    let setup = match chan.recv() {
        Ok(m) => m,
        // Prefill stopped before setting up (it reports its own error).
        Err(SideChannelError::Closed) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let Msg::Setup {
        geometry: g,
        num_pages,
        transport,
        copy_threads,
        options,
        decode_step_ms,
        speed,
        etcd,
        decode_name,
        prefill_name,
        summary,
        wait_s,
    } = setup
    else {
        bail!("expected Setup from prefill");
    };
    let (copy_threads, options) = match own {
        Some(o) if o.transport != transport => bail!(
            "the prefill replays over {transport}; this decode was started with --transport {}: give both the same --transport",
            o.transport
        ),
        Some(o) => (o.copy_threads, o.options.clone()),
        None => (copy_threads, options),
    };
    let cfg = TransportConfig { copy_threads, options, ..TransportConfig::default() };
    let shape = CacheShape { dp: g.dp, tp: g.decode_tp, num_pages, bytes_per_page: g.bytes_per_page, mla: g.mla };
    let (mut engine, hosts) = build_engine(&decode_name, &shape, transport, &cfg)?;
    let (prefill_md, _published) =
        exchange_metadata(&mut chan, etcd.as_ref(), &engine.metadata(), &prefill_name, true)?;
    super::prefill::connect_within(&mut engine, &prefill_md, std::time::Duration::from_secs(wait_s))?;
    let inbox = spawn_reader(&chan)?;

    let mut pools: Vec<PagePool> = (0..g.dp).map(|_| PagePool::new(num_pages)).collect();
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut holding: HashMap<u64, Holding> = HashMap::new();
    let mut releases: BinaryHeap<Release> = BinaryHeap::new();
    let (mut clock_us, mut backpressured) = (0u64, 0u64);
    let started = Instant::now();
    let bpp = g.bytes_per_page as usize;
    let mut tail = [0u8; 8]; // a page's last bytes past its whole words
    let mut idle = Idle::new();
    let mut finishing = false;
    let mut bad_total = 0u64;
    loop {
        let mut progressed = false;
        while let Ok(m) = inbox.try_recv() {
            progressed = true;
            match m.map_err(|e| anyhow::anyhow!("prefill process: {e}"))? {
                Msg::Alloc { id, pages, replica, arrival_ms, output_len } => {
                    pending.push_back(Pending { id, pages, replica, arrival_ms, output_len, waited: false })
                }
                Msg::Sent { id, req, keys } => match holding.get_mut(&id) {
                    Some(h) if keys.len() == h.pages.len() => {
                        h.req = Some(TransferReqData::from_json(&req)?);
                        h.keys = keys;
                    }
                    Some(h) => bail!("request {id}: {} page keys for {} pages", keys.len(), h.pages.len()),
                    None => bail!("transfer for unknown request {id}"),
                },
                Msg::Abort { id, reason } => {
                    if let Some(h) = holding.remove(&id) {
                        if let Some(req) = &h.req {
                            // Drop the notification counter; the initiator
                            // cancelled, so nothing writes these pages any more.
                            let _ = engine.cancel_transfer(req);
                        }
                        pools[h.replica].free(h.pages);
                    }
                    chan.send(&Msg::Verified { id, bad_pages: 0, error: Some(reason) })?;
                }
                Msg::Finish => finishing = true,
                other => bail!("unexpected message from prefill: {other:?}"),
            }
        }
        // Simulated time: the latest arrival, or real time × speed.
        if let Some(s) = speed {
            clock_us = clock_us.max((started.elapsed().as_secs_f64() * 1e6 * s) as u64);
        }
        // Hand out pages in arrival order; when the pool is full, jump the
        // clock to the next scheduled release (the request waits for it).
        while let Some(p) = pending.front_mut() {
            clock_us = clock_us.max(p.arrival_ms * 1000);
            release_due(&mut releases, &mut holding, &mut pools, clock_us);
            if let Some(pages) = pools[p.replica].alloc(p.pages) {
                let p = pending.pop_front().expect("front exists");
                backpressured += u64::from(p.waited);
                chan.send(&Msg::Allocated { id: p.id, pages: pages.clone() })?;
                let h = Holding {
                    pages,
                    replica: p.replica,
                    arrival_ms: p.arrival_ms,
                    output_len: p.output_len,
                    req: None,
                    keys: Vec::new(),
                };
                holding.insert(p.id, h);
                progressed = true;
                continue;
            }
            p.waited = true;
            match releases.peek() {
                Some(Reverse((t, _))) => clock_us = clock_us.max(*t),
                // Nothing holds pages that will ever be released: the request cannot fit.
                None if holding.is_empty() => {
                    bail!(
                        "request {} needs {} pages; the decode pool has {}",
                        p.id,
                        p.pages,
                        pools[p.replica].capacity()
                    )
                }
                None => break, // wait for in-flight requests to land
            }
        }
        // Transfers that landed: verify, then schedule the release.
        let mut landed = Vec::new();
        for (id, h) in &holding {
            if let Some(req) = &h.req
                && engine.is_complete(req)?
            {
                landed.push(*id);
            }
        }
        for id in landed {
            let h = holding.get_mut(&id).expect("listed above");
            let req = h.req.take().expect("checked above");
            engine.cleanup_transfer(&req)?;
            let mut bad = 0;
            for (s, host) in hosts[h.replica].iter().enumerate() {
                let src_shard = g.source_shard(s);
                for (j, &p) in h.pages.iter().enumerate() {
                    let (start, key) = (p as usize * bpp, shard_key(h.keys[j], src_shard));
                    // One pass over the landed page's words, read without a
                    // copy (HostBuffer::fold_words), then its tail bytes.
                    let m = mix(key);
                    let words = bpp / 8;
                    let diff = host.fold_words(start, words, 0u64, |d, k, w| d | (w ^ word(m, k)));
                    let rest = &mut tail[..bpp % 8];
                    host.copy_to(start + words * 8, rest);
                    let ok = diff == 0 && check_from(rest, key, words as u64);
                    if !ok {
                        bad += 1;
                    }
                }
            }
            let done_us = h.arrival_ms * 1000 + (h.output_len as f64 * decode_step_ms * 1000.0) as u64;
            releases.push(Reverse((done_us, id)));
            bad_total += bad;
            // What landed here, as `kvwire_served_bytes_total{op="write"}`
            // (`replay --role decode --metrics`): every shard's pages.
            let landed = h.pages.len() as u64 * g.bytes_per_page * g.decode_tp as u64;
            kvwire::metrics::global().record_served(&prefill_name, 0, landed);
            chan.send(&Msg::Verified { id, bad_pages: bad, error: None })?;
            progressed = true;
        }
        if finishing && pending.is_empty() && holding.values().all(|h| h.req.is_none()) {
            let high_water = pools.iter().map(PagePool::high_water).max().unwrap_or(0);
            let capacity = pools[0].capacity();
            chan.send(&Msg::Finished { high_water, capacity, backpressured })?;
            let served = if summary {
                let m = inbox
                    .recv_timeout(std::time::Duration::from_secs(60))
                    .map_err(|_| anyhow::anyhow!("the prefill sent no summary within 60 s"))?;
                match m.map_err(|e| anyhow::anyhow!("prefill process: {e}"))? {
                    Msg::Summary { table, json } => Some(Served { table, json, bad_pages: bad_total }),
                    other => bail!("expected the summary from prefill, got {other:?}"),
                }
            } else {
                None
            };
            engine.cleanup()?;
            return Ok(served);
        }
        if progressed {
            idle.reset();
        } else {
            idle.wait();
        }
    }
}

fn release_due(
    releases: &mut BinaryHeap<Release>,
    holding: &mut HashMap<u64, Holding>,
    pools: &mut [PagePool],
    clock_us: u64,
) {
    while let Some(Reverse((t, id))) = releases.peek().copied() {
        if t > clock_us {
            return;
        }
        releases.pop();
        if let Some(h) = holding.remove(&id) {
            pools[h.replica].free(h.pages);
        }
    }
}
