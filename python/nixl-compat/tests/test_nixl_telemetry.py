"""NIXL's Prometheus exporter (NIXL_TELEMETRY_EXPORTER=prometheus): the same
series names, types, labels, buckets and values as nixl-cu12 1.5.1 prints
for the same work (telemetry_child.py), run against whichever `nixl` is
installed (scripts/nixl-real-check.sh runs it against real NIXL 1.5.1, so
the literals below are NIXL's). promtool checks the exposition where it is
installed (Debian's `prometheus` package)."""

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# (name, type) in the order real NIXL 1.5.1 prints them (its exposer_* self
# metrics, prometheus-cpp's own, are left out: kvwire has no such library).
NIXL_FAMILIES = [
    ("agent_tx_bytes_total", "counter"), ("agent_rx_bytes_total", "counter"),
    ("agent_tx_requests_num_total", "counter"), ("agent_rx_requests_num_total", "counter"),
    ("agent_memory_registered_total", "counter"), ("agent_memory_deregistered_total", "counter"),
    ("agent_xfer_time_total", "counter"), ("agent_xfer_post_time_total", "counter"),
    ("agent_telemetry_events_dropped_total", "counter"), ("agent_errors_total", "counter"),
    ("agent_tx_last_bytes", "gauge"), ("agent_rx_last_bytes", "gauge"),
    ("agent_memory_registered_last_bytes", "gauge"), ("agent_memory_deregistered_last_bytes", "gauge"),
    ("agent_xfer_time", "gauge"), ("agent_xfer_post_time", "gauge"),
    ("agent_xfer_time_us", "histogram"), ("agent_xfer_post_time_us", "histogram"),
]
NIXL_BUCKETS = ["10", "25", "50", "100", "250", "500", "1000", "2500", "5000", "10000", "25000", "50000",
                "100000", "250000", "500000", "1000000", "5000000", "10000000", "+Inf"]
NIXL_ERROR_STATUSES = {"not_posted", "invalid_param", "backend", "not_found", "mismatch", "not_allowed",
                       "repost_active", "unknown", "not_supported", "remote_disconnect", "canceled", "no_telemetry"}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def scrape(backend, **env):
    port = free_port()
    e = dict(os.environ, NIXL_TELEMETRY_ENABLE="y", NIXL_TELEMETRY_EXPORTER="prometheus",
             NIXL_TELEMETRY_PROMETHEUS_PORT=str(port), NIXL_TELEMETRY_PROMETHEUS_LOCAL="y", **env)
    if os.environ.get("KVWIRE_NIXL_TEST_MODULE") == "nixl_cu12" and "NIXL_PLUGIN_DIR" not in e:
        import nixl_cu12
        e["NIXL_PLUGIN_DIR"] = os.path.join(os.path.dirname(os.path.dirname(nixl_cu12.__file__)),
                                            "nixl_cu12.libs", "nixl")
    out = subprocess.run([sys.executable, os.path.join(HERE, "telemetry_child.py"), backend, str(port)],
                         capture_output=True, text=True, timeout=120, env=e, cwd=HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout[out.stdout.index("# HELP"):]


def parse(text):
    types, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            types[name] = typ
        elif line and not line.startswith("#"):
            m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$', line)
            assert m, line
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return types, samples


def value(samples, name, agent, **labels):
    got = [v for n, lb, v in samples if n == name and lb.get("agent_name") == agent
           and all(lb.get(k) == w for k, w in labels.items())]
    assert len(got) == 1, (name, agent, labels, got)
    return got[0]


def test_exporter_series_are_nixls(backend):
    text = scrape(backend)
    types, samples = parse(text)
    ours = [(n, t) for n, t in types.items() if not n.startswith("exposer_")]
    assert ours == NIXL_FAMILIES
    host = socket.gethostname()
    assert all(lb.get("hostname") == host for n, lb, _ in samples if n.startswith("agent_")), "hostname label"
    # values for the work telemetry_child.py did
    mib = float(1 << 20)
    assert value(samples, "agent_tx_bytes_total", "A") == 3 * mib
    assert value(samples, "agent_tx_requests_num_total", "A") == 3
    assert value(samples, "agent_rx_bytes_total", "A") == mib
    assert value(samples, "agent_rx_requests_num_total", "A") == 1
    assert value(samples, "agent_rx_last_bytes", "A") == mib
    assert value(samples, "agent_tx_bytes_total", "B") == 0
    assert value(samples, "agent_memory_registered_total", "A") == mib
    assert value(samples, "agent_memory_registered_total", "B") == mib + 4096
    assert value(samples, "agent_memory_registered_last_bytes", "B") == 4096
    assert value(samples, "agent_memory_deregistered_total", "B") == 4096
    assert value(samples, "agent_xfer_time_us_count", "A") == 4
    assert value(samples, "agent_xfer_time_us_sum", "A") == value(samples, "agent_xfer_time_total", "A") > 0
    assert value(samples, "agent_xfer_post_time_us_count", "A") == 4
    les = [lb["le"] for n, lb, _ in samples if n == "agent_xfer_time_us_bucket" and lb["agent_name"] == "A"]
    assert les == NIXL_BUCKETS
    assert value(samples, "agent_xfer_time_us_bucket", "A", le="+Inf") == 4
    statuses = {lb["status"] for n, lb, _ in samples if n == "agent_errors_total" and lb["agent_name"] == "A"}
    assert statuses == NIXL_ERROR_STATUSES
    assert all(v == 0 for n, lb, v in samples if n == "agent_errors_total")
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        # promtool lints (e.g. "counter metrics should have _total suffix") go to stdout with exit 3;
        # a malformed exposition is exit 1
        assert r.returncode in (0, 3), r.stdout + r.stderr
        assert "error" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr


def test_metric_selection_and_bad_buckets(backend):
    if os.environ.get("KVWIRE_NIXL_TEST_MODULE") == "nixl_cu12":
        pytest.skip("NIXL_TELEMETRY_METRICS postdates nixl-cu12 1.5.1")
    types, _ = parse(scrape(backend, NIXL_TELEMETRY_METRICS="agent_tx_bytes,agent_err_*"))
    assert list(types) == ["agent_tx_bytes_total", "agent_errors_total", "agent_tx_last_bytes"]
    port = free_port()
    e = dict(os.environ, NIXL_TELEMETRY_ENABLE="y", NIXL_TELEMETRY_EXPORTER="prometheus",
             NIXL_TELEMETRY_PROMETHEUS_PORT=str(port), NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US="10,5")
    out = subprocess.run([sys.executable, os.path.join(HERE, "telemetry_child.py"), backend, str(port)],
                         capture_output=True, text=True, timeout=60, env=e, cwd=HERE)
    assert out.returncode != 0 and "strictly increasing" in out.stderr
