"""NIXL's Prometheus telemetry exporter, as nixl-cu12 1.5.1 exposes it
(`libtelemetry_exporter_prometheus.so`, ai-dynamo/nixl
`src/plugins/telemetry/prometheus`), so dashboards that scrape NIXL's
`agent_*` series read kvwire's `nixl` unchanged.

Switched on as NIXL does: `NIXL_TELEMETRY_ENABLE` (`y`/`yes`/`1`/`on`/...)
or the agent config's `capture_telemetry`, and
`NIXL_TELEMETRY_EXPORTER=prometheus`. One HTTP endpoint per process
(`GET /metrics`), on `NIXL_TELEMETRY_PROMETHEUS_PORT` (default 9090), all
addresses unless `NIXL_TELEMETRY_PROMETHEUS_LOCAL` is true (then 127.0.0.1).
A process that loses the port to another logs one warning and exports
nothing, as NIXL's exporter does. `NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US`
(strictly increasing positive µs bounds) replaces the default buckets; an
invalid value raises `ValueError` at agent creation, as NIXL refuses it.
`NIXL_TELEMETRY_METRICS` (comma-separated families, `*` globs) selects the
exported families; the rest are still counted.

Series (labels `agent_name`, `hostname`; the names, types and units are
those real NIXL 1.5.1 printed in the same setup, see
tests/test_nixl_telemetry.py):

| series | type | what |
| --- | --- | --- |
| `agent_tx_bytes_total` / `agent_rx_bytes_total` | counter | bytes of finished WRITE / READ requests this agent initiated |
| `agent_tx_requests_num_total` / `agent_rx_requests_num_total` | counter | those requests |
| `agent_memory_registered_total` / `agent_memory_deregistered_total` | counter | bytes (de)registered |
| `agent_xfer_time_total` / `agent_xfer_post_time_total` | counter | µs from start to completion / to posting, summed |
| `agent_telemetry_events_dropped_total` | counter | always 0 (no staging queue) |
| `agent_errors_total{status}` | counter | failed requests by NIXL status (`remote_disconnect`, ...) |
| `agent_tx_last_bytes` / `agent_rx_last_bytes` | gauge | bytes of the last request |
| `agent_memory_registered_last_bytes` / `agent_memory_deregistered_last_bytes` | gauge | bytes of the last (de)registration |
| `agent_xfer_time` / `agent_xfer_post_time` | gauge | µs of the last request |
| `agent_xfer_time_us` / `agent_xfer_post_time_us` | histogram | µs per request |
"""

import fnmatch
import http.server
import os
import socket
import threading

from .logging import get_logger

logger = get_logger(__name__)

_ON = {"y", "yes", "1", "true", "on", "enable", "enabled"}
DEFAULT_BUCKETS_US = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000,
                      500000, 1000000, 5000000, 10000000)
ERROR_STATUSES = ("not_posted", "invalid_param", "backend", "not_found", "mismatch", "not_allowed",
                  "repost_active", "unknown", "not_supported", "remote_disconnect", "canceled", "no_telemetry")
# (family, type, help), in the order NIXL 1.5.1 prints them
COUNTERS = (
    ("agent_tx_bytes", "Number of bytes sent by the agent"),
    ("agent_rx_bytes", "Number of bytes received by the agent"),
    ("agent_tx_requests_num", "Number of requests sent by the agent"),
    ("agent_rx_requests_num", "Number of requests received by the agent"),
    ("agent_memory_registered", "Cumulative memory registered"),
    ("agent_memory_deregistered", "Cumulative memory deregistered"),
    ("agent_xfer_time", "Cumulative sum of transfer time from start to completion"),
    ("agent_xfer_post_time", "Cumulative sum of time from start to posting to the back-end"),
    ("agent_telemetry_events_dropped", "Cumulative telemetry events dropped at the producer-side staging queue"),
)
GAUGES = (
    ("agent_tx_last_bytes", "agent_tx_bytes", "Bytes sent by the last request"),
    ("agent_rx_last_bytes", "agent_rx_bytes", "Bytes received by the last request"),
    ("agent_memory_registered_last_bytes", "agent_memory_registered", "Memory registered by the last operation"),
    ("agent_memory_deregistered_last_bytes", "agent_memory_deregistered",
     "Memory deregistered by the last operation"),
    ("agent_xfer_time", "agent_xfer_time", "Transfer time of the last request"),
    ("agent_xfer_post_time", "agent_xfer_post_time", "Post time of the last request"),
)
HISTOGRAMS = (
    ("agent_xfer_time_us", "agent_xfer_time", "Distribution of transfer time from start to completion, in microseconds"),
    ("agent_xfer_post_time_us", "agent_xfer_post_time",
     "Distribution of time from start to posting to the back-end, in microseconds"),
)


def _on(var):
    return os.environ.get(var, "").strip().lower() in _ON


def buckets_from_env():
    raw = os.environ.get("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "").strip()
    if not raw:
        return DEFAULT_BUCKETS_US
    try:
        b = tuple(float(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US={raw!r}: not a list of numbers") from None
    if not b or any(x <= 0 for x in b) or any(y <= x for x, y in zip(b, b[1:])):
        raise ValueError(f"NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US={raw!r}: bounds must be positive and strictly increasing")
    return tuple(int(x) if x == int(x) else x for x in b)


class _Histogram:
    def __init__(self, bounds):
        self.bounds, self.counts, self.sum, self.n = bounds, [0] * len(bounds), 0, 0

    def observe(self, v):
        self.n += 1
        self.sum += v
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1


class AgentStats:
    """One agent's series."""

    def __init__(self, name, buckets):
        self.name = name
        self.counters = {c: 0 for c, _ in COUNTERS}
        self.gauges = {g: 0 for g, _, _ in GAUGES}
        self.errors = {s: 0 for s in ERROR_STATUSES}
        self.hist = {h: _Histogram(buckets) for h, _, _ in HISTOGRAMS}
        self.lock = threading.Lock()

    def registered(self, nbytes, dereg=False):
        fam = "agent_memory_deregistered" if dereg else "agent_memory_registered"
        with self.lock:
            self.counters[fam] += nbytes
            self.gauges[fam + "_last_bytes"] = nbytes

    def finished(self, op_read, nbytes, post_us, xfer_us):
        side = "rx" if op_read else "tx"
        with self.lock:
            self.counters[f"agent_{side}_bytes"] += nbytes
            self.counters[f"agent_{side}_requests_num"] += 1
            self.gauges[f"agent_{side}_last_bytes"] = nbytes
            self.counters["agent_xfer_time"] += xfer_us
            self.counters["agent_xfer_post_time"] += post_us
            self.gauges["agent_xfer_time"] = xfer_us
            self.gauges["agent_xfer_post_time"] = post_us
            self.hist["agent_xfer_time_us"].observe(xfer_us)
            self.hist["agent_xfer_post_time_us"].observe(post_us)

    def error(self, status_name):
        s = status_name.lower().removeprefix("nixl_err_")
        with self.lock:
            if s in self.errors:
                self.errors[s] += 1


class Registry:
    """The process's exporter: every agent's series behind one endpoint."""

    def __init__(self, port, local, buckets, families):
        self.agents = []
        self.buckets = buckets
        self.families = families
        self.hostname = socket.gethostname()
        self.lock = threading.Lock()
        reg = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = reg.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1" if local else "0.0.0.0", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="nixl-telemetry-prometheus", daemon=True).start()

    def add(self, name):
        stats = AgentStats(name, self.buckets)
        with self.lock:
            self.agents.append(stats)
        return stats

    def _on(self, family):
        return not self.families or any(fnmatch.fnmatchcase(family, f) for f in self.families)

    def text(self):
        with self.lock:
            agents = list(self.agents)
        out = []

        def lbl(a, extra=""):
            name = a.name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            return f'{{agent_name="{name}",hostname="{self.hostname}"{extra}}}'

        snap = []
        for a in agents:
            with a.lock:
                snap.append((a, dict(a.counters), dict(a.gauges), dict(a.errors),
                             {k: (list(h.counts), h.sum, h.n) for k, h in a.hist.items()}))
        for fam, help_ in COUNTERS:
            if not self._on(fam):
                continue
            out += [f"# HELP {fam}_total {help_}", f"# TYPE {fam}_total counter"]
            out += [f"{fam}_total{lbl(a)} {c[fam]}" for a, c, _, _, _ in snap]
        if self._on("agent_err_*") or self._on("agent_errors"):
            out += ["# HELP agent_errors_total Cumulative error count by status", "# TYPE agent_errors_total counter"]
            for a, _, _, e, _ in snap:
                out += [f"agent_errors_total{lbl(a, ',status=' + chr(34) + s + chr(34))} {n}" for s, n in e.items()]
        for g, fam, help_ in GAUGES:
            if not self._on(fam):
                continue
            out += [f"# HELP {g} {help_}", f"# TYPE {g} gauge"]
            out += [f"{g}{lbl(a)} {gv[g]}" for a, _, gv, _, _ in snap]
        for h, fam, help_ in HISTOGRAMS:
            if not self._on(fam):
                continue
            out += [f"# HELP {h} {help_}", f"# TYPE {h} histogram"]
            for a, _, _, _, hv in snap:
                counts, total, n = hv[h]
                # counts are cumulative already: observe adds to every bound >= v
                for b, cum in zip(self.buckets, counts):
                    out.append(f"{h}_bucket{lbl(a, ',le=' + chr(34) + str(b) + chr(34))} {cum}")
                out.append(f"{h}_bucket{lbl(a, ',le=' + chr(34) + '+Inf' + chr(34))} {n}")
                out.append(f"{h}_sum{lbl(a)} {total}")
                out.append(f"{h}_count{lbl(a)} {n}")
        return "\n".join(out) + "\n"


_registry = None
_registry_lock = threading.Lock()
_failed = False


def stats_for(agent_name, telemetry_on):
    """The agent's `AgentStats` when NIXL's Prometheus exporter is switched
    on for it, else None. Starts the process's endpoint on first use."""
    global _registry, _failed
    if not telemetry_on or os.environ.get("NIXL_TELEMETRY_EXPORTER", "").strip().lower() != "prometheus":
        return None
    buckets = buckets_from_env()
    with _registry_lock:
        if _registry is None and not _failed:
            port = int(os.environ.get("NIXL_TELEMETRY_PROMETHEUS_PORT", "9090") or 9090)
            families = [f.strip() for f in os.environ.get("NIXL_TELEMETRY_METRICS", "").split(",") if f.strip()]
            try:
                _registry = Registry(port, _on("NIXL_TELEMETRY_PROMETHEUS_LOCAL"), buckets, families)
            except OSError as e:
                _failed = True
                logger.warning("telemetry: port %s is taken (%s); this process exports no metrics", port, e)
        return _registry.add(agent_name) if _registry is not None else None
