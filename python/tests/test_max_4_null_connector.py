"""Item 4: NullConnector, KVCacheGroupId, KVCacheMetrics, ByteCount,
BlockCount and CompletedTransfer as MAX 26.7's."""

import dataclasses

import pytest

import kvwire

# MAX 26.7's KVCacheMetrics fields, in order, with their defaults.
METRIC_FIELDS = [
    ("input_tokens", 0), ("cache_tokens", 0), ("device_blocks_served", 0), ("h2d_bytes_copied", 0),
    ("d2h_bytes_copied", 0), ("cross_replica_blocks_copied", 0), ("cross_replica_bytes_copied", 0),
    ("disk_bytes_written", 0), ("disk_bytes_read", 0), ("inflight_disk_ops", 0), ("connector_loads_refused", 0),
    ("connector_load_failures", 0), ("connector_offload_blocks_dropped", 0), ("nixl_read_blocks", 0),
    ("nixl_write_blocks", 0), ("nixl_read_latency_total_ms", 0.0), ("nixl_read_latency_count", 0),
    ("nixl_read_latency_max_ms", 0.0), ("nixl_write_latency_total_ms", 0.0), ("nixl_write_latency_count", 0),
    ("rpc_acquire_latency_total_ms", 0.0), ("rpc_acquire_latency_count", 0), ("rpc_read_latency_total_ms", 0.0),
    ("rpc_read_latency_count", 0), ("nixl_read_bytes", 0), ("nixl_write_bytes", 0), ("dkv_connected_clients", 0),
    ("dkv_total_clients", 0), ("dkv_reconnect_attempts", 0), ("dkv_peer_attaches", 0),
    ("dkv_peer_attach_failures", 0), ("dkv_peers_dropped", 0), ("dkv_peer_loads", 0), ("dkv_peer_load_failures", 0),
    ("dkv_peer_transfer_failures", 0), ("dkv_peer_metadata_refreshes", 0), ("dkv_peer_metadata_refresh_failures", 0),
    ("dkv_hints_rejected", 0), ("dkv_hints_rejected_by_reason", {}), ("dkv_rpc_calls", {}), ("dkv_rpc_time_ms", {}),
    ("dkv_rpc_socket_wait_ms", {}), ("dkv_lock_waits", {}), ("dkv_lock_wait_ms", {}),
]


def test_null_connector_is_maxs():
    c = kvwire.NullConnector()
    assert c.name == "NullConnector"
    assert c.leaves == {"full": kvwire.KVCacheGroupId(type="full", window_size=-1)}
    assert repr(c.leaves["full"]) == "full_group"
    # Hashes of any length, any block ids: MAX's null connector checks nothing.
    assert c.lookup([b"", b"x" * 3, b"y" * 100]) == {"full": [False, False, False]}
    t = c.load({"full": [1, 2]}, {"full": [b"a", b"bb"]})
    assert isinstance(t, kvwire.CompletedTransfer) and t.is_complete() and t.g0_blocks_per_leaf == {}
    assert t.synchronize() is None
    assert isinstance(c.load({}, {}), kvwire.CompletedTransfer)
    assert isinstance(c.offload({"x": [9]}, {"x": [b"z"]}), kvwire.CompletedTransfer)
    assert c.touch([b"a"]) is None and c.poll_transfers() is None and c.shutdown() is None
    assert c.host_byte_count == kvwire.ByteCount(free=0, total=0) == c.disk_byte_count
    assert c.metrics == kvwire.KVCacheMetrics() == c.take_metrics()


def test_metrics_have_maxs_fields_defaults_and_arithmetic():
    m = kvwire.KVCacheMetrics()
    assert [(f.name, getattr(m, f.name)) for f in dataclasses.fields(m)] == METRIC_FIELDS
    assert type(m.nixl_read_latency_total_ms) is float and type(m.input_tokens) is int
    a = kvwire.KVCacheMetrics(input_tokens=3, cache_tokens=1, nixl_read_latency_max_ms=5.0,
                              nixl_read_bytes=1 << 30, nixl_read_latency_total_ms=500.0, nixl_read_latency_count=2,
                              dkv_rpc_calls={"get": 1})
    b = kvwire.KVCacheMetrics(input_tokens=1, nixl_read_latency_max_ms=2.0, dkv_rpc_calls={"get": 2, "put": 1},
                              dkv_total_clients=2, dkv_connected_clients=1)
    s = a + b
    assert (s.input_tokens, s.nixl_read_latency_max_ms, s.dkv_rpc_calls) == (4, 5.0, {"get": 3, "put": 1})
    assert (a.prompt_tokens, a.cache_hit_rate, a.nixl_read_latency_avg_ms, a.nixl_read_gib_per_s) == (4, 0.25, 250.0, 2.0)
    assert m.cache_hit_rate == 0.0 and m.nixl_write_gib_per_s == 0.0
    assert s.dkv_degraded and not m.dkv_degraded


def test_group_id_is_maxs():
    G = kvwire.KVCacheGroupId
    assert G.full() == G("full") and G.full().window_size == -1 and G.full().is_full()
    assert repr(G("sliding_window", 8)) == "sliding_window_group(8)"
    assert G("sliding_window", 9).blocks_in_window(4) == 2 and G.full().blocks_in_window(4) == -1
    assert repr(G.recurrent()) == "recurrent_group" and repr(G.scratch()) == "scratch_group"
    for bad in [("full", 4), ("sliding_window", 1), ("sliding_window", -1), ("recurrent", 2), ("scratch", 3)]:
        with pytest.raises(ValueError):
            G(*bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        G.full().type = "x"
    assert hash(G.full()) == hash(G("full"))


def test_byte_and_block_counts():
    b = kvwire.ByteCount(free=25, total=100)
    assert (b.used, b.used_pct, b.free_pct) == (75, 75.0, 25.0)
    z = kvwire.BlockCount(free=0, total=0)
    assert (z.used, z.used_pct, z.free_pct) == (0, 0.0, 0.0)
    c = kvwire.CompletedTransfer({"0": [1, 2]})
    assert c.g0_blocks_per_leaf == {"0": [1, 2]}


# Issue 30, MAX parity 5. What MAX 26.7's ByteCount (max/pipelines/kv_cache/
# kv_connector.py: ``@dataclass(frozen=True, slots=True)``, not a NamedTuple)
# printed for each expression, under CPython 3.11.
MAX_BYTECOUNT = [
    ("repr(b)", "ByteCount(free=25, total=100)"),
    ("(b.free, b.total, b.used, b.used_pct, b.free_pct)", (25, 100, 75, 75.0, 25.0)),
    ("[f.name for f in dataclasses.fields(b)]", ["free", "total"]),
    ("dataclasses.astuple(b)", (25, 100)),
    ("type(b).__match_args__", ("free", "total")),
    ("b == kvwire.ByteCount(25, 100) and hash(b) == hash(kvwire.ByteCount(25, 100))", True),
    ("b == (25, 100)", False),
    ("kvwire.ByteCount(0, 0) == kvwire.BlockCount(0, 0)", False),
    ("pickle.loads(pickle.dumps(b)) == b", True),
    ("kvwire.ByteCount(free=0, total=0).used_pct", 0.0),
    ("type(b).__mro__[1:]", (object,)),
]
MAX_BYTECOUNT_RAISES = [
    ("free, total = b", TypeError, "cannot unpack non-iterable ByteCount object"),
    ("b[0]", TypeError, "'ByteCount' object is not subscriptable"),
    ("tuple(b)", TypeError, "'ByteCount' object is not iterable"),
    ("len(b)", TypeError, "object of type 'ByteCount' has no len()"),
    ("b.free = 1", dataclasses.FrozenInstanceError, "cannot assign to field 'free'"),
]


@pytest.mark.parametrize("expr, value", MAX_BYTECOUNT)
def test_byte_count_is_maxs(expr, value):
    import pickle

    b = kvwire.ByteCount(free=25, total=100)
    assert eval(expr) == value


@pytest.mark.parametrize("stmt, exc, message", MAX_BYTECOUNT_RAISES)
def test_byte_count_refuses_what_maxs_refuses(stmt, exc, message):
    b = kvwire.ByteCount(free=25, total=100)  # noqa: F841 (used by stmt)
    with pytest.raises(exc) as info:
        exec(stmt)
    assert str(info.value) == message


def test_null_connector_byte_counts_are_maxs():
    import sys

    c = kvwire.NullConnector()
    for count in (c.host_byte_count, c.disk_byte_count):
        assert type(count) is kvwire.ByteCount
        assert repr(count) == "ByteCount(free=0, total=0)"
        assert (count.free, count.total, count.used, count.used_pct, count.free_pct) == (0, 0, 0, 0.0, 0.0)
        if sys.version_info >= (3, 10):
            assert not hasattr(count, "__dict__")  # slots=True, as MAX's


def test_tier_connector_metrics_are_kvcachemetrics():
    import numpy as np

    mem = kvwire.KVCacheMemory(False, [np.zeros((8, 32), np.uint8)])
    c = kvwire.HostTierConnector([{"0": mem}], 1 << 16, leaves={"0": kvwire.KVCacheGroupId("sliding_window", 16)})
    try:
        assert c.leaves == {"0": kvwire.KVCacheGroupId("sliding_window", 16)}
        assert isinstance(c.metrics, kvwire.KVCacheMetrics)
        c.lookup([])
        assert c.load({"0": []}, {"0": []}).is_complete() is True
    finally:
        c.shutdown()
