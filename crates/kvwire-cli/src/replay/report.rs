//! The replay's figures: a table for people, one JSON object for scripts.

use serde::Serialize;

use crate::units::human;

/// What `kvwire replay` measured.
#[derive(Debug, Default, Serialize)]
pub(super) struct Report {
    /// Transport used.
    pub transport: String,
    /// Model preset.
    pub model: String,
    /// Layers moved.
    pub layers: u64,
    /// Prefill TP, decode TP, DP.
    pub tp: usize,
    /// Decode TP.
    pub decode_tp: usize,
    /// DP replicas.
    pub dp: usize,
    /// Tokens per page.
    pub page_tokens: u64,
    /// KV bytes per token moved (all shards, `layers` layers).
    pub bytes_per_token: u64,
    /// KV bytes per token of the full model.
    pub full_model_bytes_per_token: u64,
    /// Share of `hash_ids` block references that repeat an earlier one: the
    /// hit rate a prefix cache of unlimited size would reach on this trace.
    pub unlimited_prefix_hit_rate: f64,
    /// Requests replayed.
    pub requests: u64,
    /// Prompt tokens moved.
    pub tokens: u64,
    /// Pages sent (per request, counted once across shards).
    pub pages: u64,
    /// Bytes moved (all shards): what landed on decode; with BROADCAST each
    /// decode shard's copy counts (as `kvwire_nic_bytes_total` does).
    pub bytes: u64,
    /// Wall time of the replay (s).
    pub elapsed_s: f64,
    /// Bytes / wall time (GB/s, 1e9), fill and verification included.
    pub gb_per_s: f64,
    /// Bytes / time with at least one transfer in flight (GB/s).
    pub wire_gb_per_s: f64,
    /// Transfer latency (post → initiator complete), ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Maximum, ms.
    pub max_ms: f64,
    /// Most decode pages in use at once (per replica).
    pub decode_pool_high_water: u64,
    /// Decode pool pages per replica.
    pub decode_pool_capacity: u64,
    /// Requests that waited for decode pages (backpressure).
    pub backpressured: u64,
    /// Destination pages (× shards) with wrong bytes.
    pub bad_pages: u64,
    /// Transfers that failed.
    pub failed: u64,
    /// True when every byte arrived intact and nothing failed.
    pub verified: bool,
    /// Decode engines this prefill sent to (`--connect`).
    pub decode_engines: usize,
    /// Prefill processes sharing the trace.
    pub prefills: usize,
    /// This prefill's rank among them.
    pub prefill_rank: usize,
    /// KV connector used for prefix reuse (`none`, `host`).
    pub connector: String,
    /// Prefix-reuse figures, with a connector.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<super::prefix::PrefixStats>,
}

/// Print `r` as a table or as JSON.
pub(super) fn print(r: &Report, json: bool) {
    print!("{}", render(r, json));
}

/// `r` as a table or as one JSON line.
pub(super) fn render(r: &Report, json: bool) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    if json {
        let _ = writeln!(o, "{}", serde_json::to_string(r).expect("plain data"));
        return o;
    }
    if r.prefills > 1 || r.decode_engines > 1 {
        let _ = writeln!(
            o,
            "prefill {} of {} (trace request i -> prefill i mod {}), to {} decode engine(s) (share request j -> decode j mod {})",
            r.prefill_rank, r.prefills, r.prefills, r.decode_engines, r.decode_engines
        );
    }
    let _ = writeln!(
        o,
        "kvwire replay: {} requests over {} ({}, {} layer(s): {}/token; full model {}/token, x{:.0}), TP {}->{}, DP {}, {} tokens/page",
        r.requests,
        r.transport,
        r.model,
        r.layers,
        human(r.bytes_per_token),
        human(r.full_model_bytes_per_token),
        r.full_model_bytes_per_token as f64 / r.bytes_per_token.max(1) as f64,
        r.tp,
        r.decode_tp,
        r.dp,
        r.page_tokens
    );
    let _ = writeln!(
        o,
        "{:>9} {:>9} {:>10} {:>8} {:>7} {:>9} {:>8} {:>8} {:>8} {:>14} {:>8}",
        "requests",
        "pages",
        "GB",
        "time s",
        "GB/s",
        "wire GB/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "decode pool hw",
        "verified"
    );
    let _ = writeln!(
        o,
        "{:>9} {:>9} {:>10.2} {:>8.1} {:>7.2} {:>9.2} {:>8.2} {:>8.2} {:>8.2} {:>8}/{:<5} {:>8}",
        r.requests,
        r.pages,
        r.bytes as f64 / 1e9,
        r.elapsed_s,
        r.gb_per_s,
        r.wire_gb_per_s,
        r.p50_ms,
        r.p99_ms,
        r.max_ms,
        r.decode_pool_high_water,
        r.decode_pool_capacity,
        r.verified
    );
    let _ = writeln!(
        o,
        "  GB = 1e9 bytes moved and verified (all shards); GB/s = GB / wall time; wire GB/s = GB / time with a \
         transfer in flight;\n  p50/p99/max = transfer latency from post to completion; decode pool hw = most \
         decode pages in use at once / pool size"
    );
    if let Some(p) = &r.prefix {
        let _ = writeln!(
            o,
            "prefix reuse ({}): hit rate {:.1}% of {} full prefix pages (unlimited tier: {:.1}%; trace block repeats: {:.1}%), loaded {:.2} GB, computed {:.2} GB",
            r.connector,
            100.0 * p.prefix_hit_rate,
            p.prefix_pages,
            100.0 * p.unlimited_tier_hit_rate,
            100.0 * r.unlimited_prefix_hit_rate,
            p.bytes_loaded as f64 / 1e9,
            p.bytes_computed as f64 / 1e9
        );
    }
    if r.bad_pages > 0 || r.failed > 0 {
        let _ = writeln!(o, "{} bad pages, {} failed transfers", r.bad_pages, r.failed);
    }
    o
}
