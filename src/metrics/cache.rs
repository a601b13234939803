//! `KVCacheMetrics` with MAX's field names (`max.nn.kv_cache.metrics`,
//! MAX `max/nn/kv_cache/metrics.py`). Device figures are in blocks; tiers in bytes.

use std::ops::{Add, AddAssign};

use serde::{Deserialize, Serialize};

/// Per-window counters and live gauges of a KV cache and its connector.
///
/// Counters are summed by `+` and cleared by `take_metrics`; the `dkv_*`
/// gauges are read live and never cleared. `nixl_read_latency_max_ms` is
/// combined with `max`, not summed.
///
/// The host tier reports a load (tier → device) as a *read* and an offload
/// (device → tier) as a *write*: `nixl_read_blocks`/`_bytes` count blocks and
/// host-row bytes read out of the tier, `h2d_bytes_copied` the bytes written
/// into device pages (every shard of a replicated leaf counted).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct KVCacheMetrics {
    // Counters.
    pub input_tokens: u64,
    pub cache_tokens: u64,
    pub device_blocks_served: u64,
    pub h2d_bytes_copied: u64,
    pub d2h_bytes_copied: u64,
    pub cross_replica_blocks_copied: u64,
    pub cross_replica_bytes_copied: u64,
    pub disk_bytes_written: u64,
    pub disk_bytes_read: u64,
    pub inflight_disk_ops: u64,
    pub connector_loads_refused: u64,
    pub connector_load_failures: u64,
    pub connector_offload_blocks_dropped: u64,
    pub nixl_read_blocks: u64,
    pub nixl_write_blocks: u64,
    pub nixl_read_bytes: u64,
    pub nixl_write_bytes: u64,
    pub nixl_read_latency_total_ms: f64,
    pub nixl_read_latency_count: u64,
    pub nixl_read_latency_max_ms: f64,
    pub nixl_write_latency_total_ms: f64,
    pub nixl_write_latency_count: u64,
    pub rpc_acquire_latency_total_ms: f64,
    pub rpc_acquire_latency_count: u64,
    pub rpc_read_latency_total_ms: f64,
    pub rpc_read_latency_count: u64,
    pub dkv_peer_attaches: u64,
    pub dkv_peer_attach_failures: u64,
    pub dkv_peers_dropped: u64,
    pub dkv_peer_loads: u64,
    pub dkv_peer_load_failures: u64,
    pub dkv_hints_rejected: u64,
    // Gauges.
    pub dkv_connected_clients: u64,
    pub dkv_total_clients: u64,
    pub dkv_reconnect_attempts: u64,
}

impl KVCacheMetrics {
    /// `input_tokens + cache_tokens`.
    pub fn prompt_tokens(&self) -> u64 {
        self.input_tokens + self.cache_tokens
    }

    /// `cache_tokens / prompt_tokens`, 0 when there were none.
    pub fn cache_hit_rate(&self) -> f64 {
        ratio(self.cache_tokens as f64, self.prompt_tokens() as f64)
    }

    /// Mean tier-read latency in ms (0 without samples).
    pub fn nixl_read_latency_avg_ms(&self) -> f64 {
        ratio(self.nixl_read_latency_total_ms, self.nixl_read_latency_count as f64)
    }

    /// Mean tier-write latency in ms (0 without samples).
    pub fn nixl_write_latency_avg_ms(&self) -> f64 {
        ratio(self.nixl_write_latency_total_ms, self.nixl_write_latency_count as f64)
    }

    /// Mean RPC acquire latency in ms (0 without samples).
    pub fn rpc_acquire_latency_avg_ms(&self) -> f64 {
        ratio(self.rpc_acquire_latency_total_ms, self.rpc_acquire_latency_count as f64)
    }

    /// Mean RPC read latency in ms (0 without samples).
    pub fn rpc_read_latency_avg_ms(&self) -> f64 {
        ratio(self.rpc_read_latency_total_ms, self.rpc_read_latency_count as f64)
    }

    /// `(nixl_read_bytes / 2^30) / (nixl_read_latency_total_ms / 1000)`.
    pub fn nixl_read_gib_per_s(&self) -> f64 {
        ratio(self.nixl_read_bytes as f64 / GIB, self.nixl_read_latency_total_ms / 1000.0)
    }

    /// `(nixl_write_bytes / 2^30) / (nixl_write_latency_total_ms / 1000)`.
    pub fn nixl_write_gib_per_s(&self) -> f64 {
        ratio(self.nixl_write_bytes as f64 / GIB, self.nixl_write_latency_total_ms / 1000.0)
    }

    /// `dkv_total_clients > 0 && dkv_connected_clients < dkv_total_clients`.
    pub fn dkv_degraded(&self) -> bool {
        self.dkv_total_clients > 0 && self.dkv_connected_clients < self.dkv_total_clients
    }

    /// Return the counters and clear them, keeping the gauges
    /// (what `take_metrics` does to a connector's window).
    pub fn take_counters(&mut self) -> Self {
        let gauges = Self {
            dkv_connected_clients: self.dkv_connected_clients,
            dkv_total_clients: self.dkv_total_clients,
            dkv_reconnect_attempts: self.dkv_reconnect_attempts,
            ..Self::default()
        };
        std::mem::replace(self, gauges)
    }

    /// Record one tier read (load) of `latency_ms`.
    pub fn record_read_latency(&mut self, latency_ms: f64) {
        self.nixl_read_latency_total_ms += latency_ms;
        self.nixl_read_latency_count += 1;
        self.nixl_read_latency_max_ms = self.nixl_read_latency_max_ms.max(latency_ms);
    }

    /// Record one tier write (offload) of `latency_ms`.
    pub fn record_write_latency(&mut self, latency_ms: f64) {
        self.nixl_write_latency_total_ms += latency_ms;
        self.nixl_write_latency_count += 1;
    }
}

const GIB: f64 = (1u64 << 30) as f64;

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 { num / den } else { 0.0 }
}

impl AddAssign<&KVCacheMetrics> for KVCacheMetrics {
    /// Sum counters and gauges; `nixl_read_latency_max_ms` takes the max.
    fn add_assign(&mut self, o: &KVCacheMetrics) {
        macro_rules! sum {
            ($($f:ident),*) => { $( self.$f += o.$f; )* };
        }
        sum!(
            input_tokens,
            cache_tokens,
            device_blocks_served,
            h2d_bytes_copied,
            d2h_bytes_copied,
            cross_replica_blocks_copied,
            cross_replica_bytes_copied,
            disk_bytes_written,
            disk_bytes_read,
            inflight_disk_ops,
            connector_loads_refused,
            connector_load_failures,
            connector_offload_blocks_dropped,
            nixl_read_blocks,
            nixl_write_blocks,
            nixl_read_bytes,
            nixl_write_bytes,
            nixl_read_latency_total_ms,
            nixl_read_latency_count,
            nixl_write_latency_total_ms,
            nixl_write_latency_count,
            rpc_acquire_latency_total_ms,
            rpc_acquire_latency_count,
            rpc_read_latency_total_ms,
            rpc_read_latency_count,
            dkv_peer_attaches,
            dkv_peer_attach_failures,
            dkv_peers_dropped,
            dkv_peer_loads,
            dkv_peer_load_failures,
            dkv_hints_rejected,
            dkv_connected_clients,
            dkv_total_clients,
            dkv_reconnect_attempts
        );
        self.nixl_read_latency_max_ms = self.nixl_read_latency_max_ms.max(o.nixl_read_latency_max_ms);
    }
}

impl Add for KVCacheMetrics {
    type Output = KVCacheMetrics;

    fn add(mut self, o: KVCacheMetrics) -> KVCacheMetrics {
        self += &o;
        self
    }
}
