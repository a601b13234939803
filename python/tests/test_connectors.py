"""NullConnector and the host tier: lookup / load / offload with verified bytes."""

import numpy as np
import pytest

import kvwire


def h(i):
    return int(i).to_bytes(8, "big")


def test_null_connector():
    c = kvwire.NullConnector()
    assert c.name == "NullConnector"
    assert list(c.leaves) == ["full"] and c.leaves["full"].type == "full"
    assert c.lookup([h(1), h(2)]) == {"full": [False, False]}
    t = c.offload({"full": [1]}, {"full": [h(1)]})
    assert t.is_complete() and t.g0_blocks_per_leaf == {}
    assert isinstance(c.metrics, kvwire.KVCacheMetrics)


def make_tier(capacity_bytes=1 << 20, tp=2):
    arrays = [np.zeros((16, 64), np.uint8) for _ in range(tp)]
    mem = kvwire.KVCacheMemory(False, arrays)
    return kvwire.HostTierConnector([{"0": mem}], capacity_bytes), arrays


def test_host_tier_offload_then_load_moves_bytes():
    c, arrays = make_tier()
    for s, a in enumerate(arrays):
        a[3] = 10 + s
        a[4] = 20 + s
    t = c.offload({"0": [3, 4]}, {"0": [h(1), h(2)]})
    assert t.g0_blocks_per_leaf in ({"0": [3, 4]}, {})
    t.synchronize()
    assert c.lookup([h(1), h(2), h(3)]) == {"0": [True, True, False]}
    for a in arrays:
        a[:] = 0
    lt = c.load({"0": [7, 9]}, {"0": [h(1), h(2)]})
    lt.synchronize()
    assert lt.is_complete()
    for s, a in enumerate(arrays):
        assert (a[7] == 10 + s).all() and (a[9] == 20 + s).all()
    m = c.take_metrics()
    assert m.d2h_bytes_copied > 0 and m.h2d_bytes_copied > 0
    hb = c.host_byte_count
    assert isinstance(hb, kvwire.ByteCount)
    assert hb.total == 1 << 20 and hb.free < hb.total
    assert c.disk_byte_count == kvwire.ByteCount(free=0, total=0)
    c.shutdown()


def test_host_tier_errors():
    c, _ = make_tier()
    with pytest.raises(ValueError):  # load without lookup
        c.load({"0": [1]}, {"0": [h(1)]})
    c.lookup([h(1)])
    with pytest.raises(kvwire.KVLoadRefused):  # not held
        c.load({"0": [1]}, {"0": [h(1)]})
    with pytest.raises(ValueError):
        c.lookup([b"short"])
    with pytest.raises(ValueError):
        c.offload({"nope": [1]}, {"nope": [h(1)]})
    with pytest.raises(ValueError):
        c.offload({"0": [99]}, {"0": [h(1)]})
    with pytest.raises(ValueError):
        c.offload({"0": [1, 2]}, {"0": [h(1)]})
    with pytest.raises(ValueError):
        c.lookup([h(1)], replica_idx=3)
    c.shutdown()
    with pytest.raises(RuntimeError):
        c.lookup([h(1)])
    with pytest.raises(ValueError):
        kvwire.HostTierConnector([], 1024)
    with pytest.raises(ValueError):
        kvwire.KVCacheGroupId("sliding_window")
    with pytest.raises(ValueError):
        mem = kvwire.KVCacheMemory(False, [np.zeros((4, 8), np.uint8)])
        kvwire.HostTierConnector([{"0": mem}], 1024, leaves={"0": kvwire.KVCacheGroupId.scratch()})
    assert issubclass(kvwire.KVLoadRefused, RuntimeError) and issubclass(kvwire.KVLoadFailed, RuntimeError)
