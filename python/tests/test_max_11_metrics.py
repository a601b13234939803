"""Item 11: one metrics registry behind transfers and connector windows,
exported as Prometheus text with MAX's metric names."""

import numpy as np

import kvwire


def value(text, line_prefix):
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split(" ")[-1])
    raise AssertionError(f"{line_prefix!r} not in\n{text}")


def test_transfers_show_up_per_op_and_peer():
    mem = lambda: [[kvwire.KVCacheMemory(False, [np.zeros((8, 128), np.uint8) for _ in range(2)])]]
    a, b = kvwire.KVTransferEngine("m11-a", mem()), kvwire.KVTransferEngine("m11-b", mem())
    try:
        a.connect(b.metadata)
        b.connect(a.metadata)
        before = kvwire.metrics_text()
        req = a.initiate_send_transfer(b.metadata, {"0": [1, 2, 3]}, {"0": [4, 5, 6]})
        b.sync_and_release(req, timeout_s=10)
        a.sync_and_release(req, timeout_s=10)
        rd = a.initiate_read_transfer(b.metadata, {"0": [1]}, {"0": [7]})
        a.sync_and_release(rd, timeout_s=10)
        b.sync_and_release(rd, timeout_s=10)
        t = kvwire.metrics_text()
        assert "# TYPE maxserve_dkv_nixl_write_latency_milliseconds histogram" in t
        # 3 pages x 128 B x 2 shard requests.
        assert value(t, 'maxserve_dkv_nixl_write_bytes_total{peer="m11-b"}') == 768
        assert value(t, 'maxserve_dkv_nixl_write_transfers_total{peer="m11-b"}') == 1
        assert value(t, 'maxserve_dkv_nixl_write_latency_milliseconds_count{peer="m11-b"}') == 1
        assert value(t, 'maxserve_dkv_nixl_write_latency_milliseconds_bucket{peer="m11-b",le="+Inf"}') == 1
        assert value(t, 'maxserve_dkv_nixl_read_bytes_total{peer="m11-b"}') == 256
        assert value(t, 'kvwire_transfer_failures_total{op="write",peer="m11-b"}') == 0
        assert 'peer="m11-b"' not in before
    finally:
        a.cleanup()
        b.cleanup()


def test_connector_windows_accumulate():
    arrays = [np.zeros((16, 64), np.uint8)]
    c = kvwire.HostTierConnector([{"0": kvwire.KVCacheMemory(False, arrays)}], 1 << 20)
    try:
        c.offload({"0": [3]}, {"0": [(1).to_bytes(8, "big")]}).synchronize()
        w = c.take_metrics()
        assert w.d2h_bytes_copied == 64
        t = kvwire.metrics_text()
        assert value(t, 'maxserve_cache_d2h_bytes_copied_total{connector="HostTierConnector"}') >= 64
        assert "# TYPE maxserve_dkv_connected_clients gauge" in t
    finally:
        c.shutdown()
