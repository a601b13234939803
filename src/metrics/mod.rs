//! One metrics registry for the process: transfer telemetry (bytes,
//! transfers, failures and a latency histogram per operation and peer) and
//! connector [`KVCacheMetrics`] snapshots, exported as Prometheus text
//! (exposition format 0.0.4, written by hand: a few counters and histograms
//! need no crate).
//!
//! Names are MAX's (`max/serve/telemetry/metrics.py`: `maxserve.dkv.*`,
//! `maxserve.cache.*`) as OpenTelemetry's Prometheus exporter spells them:
//! dots become `_`, a unit is appended (`_milliseconds`, `_bytes`), counters
//! end in `_total`. Transfer telemetry:
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `maxserve_dkv_nixl_{read,write}_latency_milliseconds` | histogram (ms) | `peer` |
//! | `maxserve_dkv_nixl_{read,write}_bytes_total` | counter (bytes) | `peer` |
//! | `maxserve_dkv_nixl_{read,write}_transfers_total` | counter | `peer` |
//! | `kvwire_transfer_failures_total` | counter | `op`, `peer` (kvwire's own: MAX has no such series) |
//!
//! and, per connector (label `connector`), every counter of
//! [`KVCacheMetrics`] under `maxserve_cache_<field>_total` /
//! `maxserve_dkv_<field>_total` (MAX's prefix for that field).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

mod agent;
mod cache;
pub use agent::{AgentHandle, LinkCounters, STARTUP_BUCKETS_S, link};
pub use cache::KVCacheMetrics;

/// Upper bounds (ms) of the latency histogram buckets (`+Inf` follows).
pub const LATENCY_BUCKETS_MS: [f64; 16] =
    [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0];

/// The direction of a one-sided transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MetricOp {
    /// Pull from the peer (NIXL READ).
    Read,
    /// Push to the peer (NIXL WRITE).
    Write,
}

impl MetricOp {
    fn name(self) -> &'static str {
        match self {
            MetricOp::Read => "read",
            MetricOp::Write => "write",
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Stats {
    transfers: u64,
    failures: u64,
    bytes: u64,
    /// Per bucket of [`LATENCY_BUCKETS_MS`], then `+Inf` (not cumulative).
    buckets: [u64; LATENCY_BUCKETS_MS.len() + 1],
    latency_sum_ms: f64,
}

#[derive(Default)]
struct State {
    transfers: BTreeMap<(MetricOp, String), Stats>,
    connectors: BTreeMap<String, KVCacheMetrics>,
    agents: agent::AgentState,
    /// What peers reported moving with this engine as their target
    /// (requests, bytes READ from it, bytes WRITTEN to it).
    served: BTreeMap<String, (u64, u64, u64)>,
    notifications_refused: BTreeMap<String, u64>,
}

/// A metrics registry (see the module doc); [`global`] is the process's.
#[derive(Default)]
pub struct Registry {
    state: Mutex<State>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain counters: keep using them.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Count one finished transfer of `bytes` with `peer` (an engine or
    /// agent name) that took `latency` from post to completion.
    pub fn record_transfer(&self, op: MetricOp, peer: &str, bytes: u64, latency: Duration) {
        let ms = latency.as_secs_f64() * 1e3;
        let mut s = self.lock();
        let st = s.transfers.entry((op, peer.to_string())).or_default();
        st.transfers += 1;
        st.bytes = st.bytes.saturating_add(bytes);
        st.latency_sum_ms += ms;
        let b = bucket_of(&LATENCY_BUCKETS_MS, ms);
        st.buckets[b] += 1;
    }

    /// Count one failed transfer with `peer`.
    pub fn record_failure(&self, op: MetricOp, peer: &str) {
        self.lock().transfers.entry((op, peer.to_string())).or_default().failures += 1;
    }

    /// Count one request a peer served by this engine (the target of its
    /// one-sided transfers, which the target itself does not see) reported:
    /// `read` bytes it READ from us and `written` bytes it WROTE to us.
    pub fn record_served(&self, peer: &str, read: u64, written: u64) {
        let mut s = self.lock();
        let e = s.served.entry(peer.to_string()).or_default();
        e.0 += 1;
        e.1 = e.1.saturating_add(read);
        e.2 = e.2.saturating_add(written);
    }

    /// Count one notification a target refused because its queue was full
    /// (`transport`: `shm`, `tcp`).
    pub fn record_notification_refused(&self, transport: &str) {
        *self.lock().notifications_refused.entry(transport.to_string()).or_default() += 1;
    }

    /// Add a connector's window (`take_metrics()`) to its running totals.
    pub fn add_connector_metrics(&self, connector: &str, m: &KVCacheMetrics) {
        let mut s = self.lock();
        let e = s.connectors.entry(connector.to_string()).or_default();
        *e = e.clone() + m.clone();
    }

    /// The registry as Prometheus text exposition (format 0.0.4).
    pub fn prometheus_text(&self) -> String {
        let s = self.lock();
        let mut fams = Families::default();
        for ((op, peer), st) in &s.transfers {
            let o = op.name();
            let peer = escape(peer);
            let h = format!("maxserve_dkv_nixl_{o}_latency_milliseconds");
            let help = format!("Latency of NIXL {o} transfers, post to completion, in milliseconds.");
            let labels = format!("peer=\"{peer}\"");
            fams.histogram(&h, &help, &labels, &LATENCY_BUCKETS_MS, &st.buckets, st.latency_sum_ms);
            let b = format!("maxserve_dkv_nixl_{o}_bytes_total");
            fams.add(
                &b,
                "counter",
                "Bytes moved by finished NIXL transfers.",
                format!("{b}{{peer=\"{peer}\"}} {}", st.bytes),
            );
            let t = format!("maxserve_dkv_nixl_{o}_transfers_total");
            fams.add(&t, "counter", "Finished NIXL transfers.", format!("{t}{{peer=\"{peer}\"}} {}", st.transfers));
            let f = "kvwire_transfer_failures_total";
            fams.add(
                f,
                "counter",
                "Transfers that failed (the transport reported an error).",
                format!("{f}{{op=\"{o}\",peer=\"{peer}\"}} {}", st.failures),
            );
        }
        if !s.served.is_empty() {
            fams.add(
                "kvwire_served_peers",
                "gauge",
                "Peers that reported transfers with this engine as their target.",
                format!("kvwire_served_peers {}", s.served.len()),
            );
        }
        for (peer, (requests, read, written)) in &s.served {
            let peer = escape(peer);
            let r = "kvwire_served_requests_total";
            fams.add(
                r,
                "counter",
                "Requests served as the target, as each peer reported them (notifications).",
                format!("{r}{{peer=\"{peer}\"}} {requests}"),
            );
            let b = "kvwire_served_bytes_total";
            let help = "Bytes peers reported moving with this engine as their target, by op.";
            fams.add(b, "counter", help, format!("{b}{{op=\"read\",peer=\"{peer}\"}} {read}"));
            fams.add(b, "counter", help, format!("{b}{{op=\"write\",peer=\"{peer}\"}} {written}"));
        }
        for (t, n) in &s.notifications_refused {
            let name = "kvwire_notifications_refused_total";
            fams.add(
                name,
                "counter",
                "Notifications a target refused because its queue was at its bound (the sender saw `overloaded`).",
                format!("{name}{{transport=\"{}\"}} {n}", escape(t)),
            );
        }
        for (c, m) in &s.connectors {
            let c = escape(c);
            if let serde_json::Value::Object(map) = serde_json::to_value(m).unwrap_or_default() {
                for (field, x) in map {
                    let Some(x) = x.as_f64() else { continue };
                    let (name, kind) = connector_metric(&field);
                    fams.add(
                        &name,
                        kind,
                        &format!("KVCacheMetrics.{field} of each connector."),
                        format!("{name}{{connector=\"{c}\"}} {x}"),
                    );
                }
            }
        }
        agent::render(&s.agents, &mut fams);
        fams.render()
    }
}

/// The Prometheus name and type of a [`KVCacheMetrics`] field: MAX's
/// `maxserve.dkv.*` for the dKV/NIXL/RPC figures, `maxserve.cache.*` for the
/// rest; the three dKV health figures are gauges, as in MAX.
fn connector_metric(field: &str) -> (String, &'static str) {
    if let Some(g) =
        ["dkv_connected_clients", "dkv_total_clients", "dkv_reconnect_attempts"].iter().find(|g| **g == field)
    {
        return (format!("maxserve_dkv_{}", &g[4..]), "gauge");
    }
    let dkv = field.starts_with("dkv_") || field.starts_with("nixl_") || field.starts_with("rpc_");
    let base = field.strip_prefix("dkv_").unwrap_or(field);
    (format!("{}{base}_total", if dkv { "maxserve_dkv_" } else { "maxserve_cache_" }), "counter")
}

/// Samples grouped by metric family, so each family has one `# TYPE`.
#[derive(Default)]
struct Families {
    fams: BTreeMap<String, (&'static str, String, Vec<String>)>,
}

impl Families {
    fn add(&mut self, name: &str, kind: &'static str, help: &str, line: String) {
        self.fams.entry(name.to_string()).or_insert_with(|| (kind, help.to_string(), Vec::new())).2.push(line);
    }

    /// A histogram's `_bucket` (cumulative, then `+Inf`), `_sum` and
    /// `_count` samples with `labels` (`k="v",...`, escaped): `counts[i]`
    /// observations fell in bucket `i` of `bounds`, the last entry past them.
    fn histogram(&mut self, name: &str, help: &str, labels: &str, bounds: &[f64], counts: &[u64], sum: f64) {
        let mut cum = 0u64;
        for (ub, n) in bounds.iter().zip(counts) {
            cum += n;
            self.add(name, "histogram", help, format!("{name}_bucket{{{labels},le=\"{ub}\"}} {cum}"));
        }
        cum += counts[bounds.len()];
        self.add(name, "histogram", help, format!("{name}_bucket{{{labels},le=\"+Inf\"}} {cum}"));
        self.add(name, "histogram", help, format!("{name}_sum{{{labels}}} {sum}"));
        self.add(name, "histogram", help, format!("{name}_count{{{labels}}} {cum}"));
    }

    fn render(&self) -> String {
        let mut out = String::new();
        for (name, (kind, help, lines)) in &self.fams {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for l in lines {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

/// The bucket of `bounds` (upper bounds) that `v` falls in; `bounds.len()`
/// for past the last one (`+Inf`).
fn bucket_of(bounds: &[f64], v: f64) -> usize {
    bounds.iter().position(|&ub| v <= ub).unwrap_or(bounds.len())
}

/// A label value with `\`, `"` and newlines escaped, as the format requires.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The process-wide registry that [`crate::kv::KVTransferEngine`] records into.
pub fn global() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(Registry::new)
}

/// [`global`]'s Prometheus text.
pub fn prometheus_text() -> String {
    global().prometheus_text()
}

/// Serve [`prometheus_text`] at `http://<addr>/metrics` (HTTP/1.0, one
/// request per connection, on a background thread) for a Prometheus
/// scraper; other paths answer 404. Returns the bound address (`addr` may
/// use port 0).
///
/// # Errors
/// The bind error.
pub fn serve_http(addr: &str) -> std::io::Result<std::net::SocketAddr> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    std::thread::Builder::new().name("kvwire-metrics".into()).spawn(move || {
        let mut backoff = crate::accept::AcceptBackoff::new("metrics listener");
        for conn in listener.incoming() {
            let mut c = match conn {
                Ok(c) => {
                    backoff.accepted();
                    c
                }
                // Out of descriptors or memory: bounded backoff, not a spin.
                Err(e) => match backoff.failed(&e) {
                    crate::accept::AfterError::Retry => continue,
                    crate::accept::AfterError::Stop => break,
                },
            };
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            // The request line and headers: at most 8 KiB are read.
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while req.len() < 8192 && !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let line = String::from_utf8_lossy(&req);
            let path = line.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if line.starts_with("GET ") && (path == "/metrics" || path.starts_with("/metrics?")) {
                ("200 OK", prometheus_text())
            } else {
                ("404 Not Found", "not found: try /metrics\n".to_string())
            };
            let _ = write!(
                c,
                "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    })?;
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_max_names_buckets_and_labels() {
        let r = Registry::new();
        r.record_transfer(MetricOp::Read, "decode", 4096, Duration::from_micros(300));
        r.record_transfer(MetricOp::Read, "decode", 1024, Duration::from_millis(20));
        r.record_failure(MetricOp::Write, "pre\"fill");
        let t = r.prometheus_text();
        for line in [
            "# TYPE maxserve_dkv_nixl_read_latency_milliseconds histogram",
            "maxserve_dkv_nixl_read_latency_milliseconds_bucket{peer=\"decode\",le=\"0.25\"} 0",
            "maxserve_dkv_nixl_read_latency_milliseconds_bucket{peer=\"decode\",le=\"0.5\"} 1",
            "maxserve_dkv_nixl_read_latency_milliseconds_bucket{peer=\"decode\",le=\"25\"} 2",
            "maxserve_dkv_nixl_read_latency_milliseconds_bucket{peer=\"decode\",le=\"+Inf\"} 2",
            "maxserve_dkv_nixl_read_latency_milliseconds_count{peer=\"decode\"} 2",
            "maxserve_dkv_nixl_read_bytes_total{peer=\"decode\"} 5120",
            "maxserve_dkv_nixl_read_transfers_total{peer=\"decode\"} 2",
            "kvwire_transfer_failures_total{op=\"write\",peer=\"pre\\\"fill\"} 1",
            "kvwire_transfer_failures_total{op=\"read\",peer=\"decode\"} 0",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in\n{t}");
        }
        let sum: f64 = t
            .lines()
            .find_map(|l| l.strip_prefix("maxserve_dkv_nixl_read_latency_milliseconds_sum{peer=\"decode\"} "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((sum - 20.3).abs() < 1e-9, "{sum}");
    }

    #[test]
    fn memory_region_gauges_and_the_coalescing_ratio() {
        use std::sync::atomic::Ordering::Relaxed;
        let r = Registry::new();
        let h = r.agent("prefill", "verbs", "rxe0", Duration::from_millis(1));
        let t = r.prometheus_text();
        assert!(
            t.lines().any(|l| l == "kvwire_region_coalescing_ratio{agent=\"prefill\",transport=\"verbs\"} 1"),
            "{t}"
        );
        // vLLM's shape on verbs: 1,265 views in 4 MRs.
        h.regions.store(1265, Relaxed);
        h.memory_regions.store(4, Relaxed);
        let t = r.prometheus_text();
        for line in [
            "# TYPE kvwire_memory_regions gauge",
            "kvwire_regions{agent=\"prefill\",transport=\"verbs\"} 1265",
            "kvwire_memory_regions{agent=\"prefill\",transport=\"verbs\"} 4",
            "# TYPE kvwire_region_coalescing_ratio gauge",
            "kvwire_region_coalescing_ratio{agent=\"prefill\",transport=\"verbs\"} 316.25",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in\n{t}");
        }
    }

    #[test]
    fn serves_metrics_over_http() {
        use std::io::{Read, Write};
        global().record_transfer(MetricOp::Write, "http-test-peer", 7, Duration::from_millis(2));
        let addr = serve_http("127.0.0.1:0").unwrap();
        let get = |path: &str| {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).unwrap();
            out
        };
        let ok = get("/metrics");
        assert!(ok.starts_with("HTTP/1.0 200 OK\r\n"), "{ok}");
        assert!(ok.contains("maxserve_dkv_nixl_write_bytes_total{peer=\"http-test-peer\"} 7\n"), "{ok}");
        assert!(get("/other").starts_with("HTTP/1.0 404"));
    }

    #[test]
    fn connector_totals_accumulate_under_max_names() {
        let r = Registry::new();
        let m = KVCacheMetrics { h2d_bytes_copied: 10, nixl_read_bytes: 7, ..Default::default() };
        r.add_connector_metrics("host", &m);
        r.add_connector_metrics("host", &m);
        r.record_transfer(MetricOp::Read, "peer", 1, Duration::from_millis(1));
        let t = r.prometheus_text();
        assert!(t.contains("maxserve_cache_h2d_bytes_copied_total{connector=\"host\"} 20\n"), "{t}");
        assert!(t.contains("maxserve_dkv_nixl_read_bytes_total{connector=\"host\"} 14\n"), "{t}");
        assert!(t.contains("# TYPE maxserve_dkv_connected_clients gauge\n"), "{t}");
        assert_eq!(t.matches("# TYPE maxserve_dkv_nixl_read_bytes_total counter").count(), 1);
    }
}
