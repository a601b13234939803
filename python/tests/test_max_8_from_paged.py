"""Item 8: KVTransferEngine.from_paged_kv_cache(name, kv_cache) with any
object of MAX's PagedKVCacheManager shape (params.data_parallel_degree,
params.leaves(), get_device_buffer(r).to_memory()), MAX not imported."""

from dataclasses import dataclass

import numpy as np
import pytest

import kvwire


@dataclass
class Unit:  # the shape of MAX's KVCacheMemory: `replicated` and `buffers`
    replicated: bool
    buffers: list


@dataclass
class Leaf:  # the shape of MAX's KVLeafRegion: a group_id
    group_id: kvwire.KVCacheGroupId


class Params:
    def __init__(self, dp, leaves):
        self.data_parallel_degree = dp
        self._leaves = leaves

    def leaves(self):
        return self._leaves


class DeviceBuffer:
    def __init__(self, units):
        self.units = units

    def to_memory(self):
        return dict(reversed(list(self.units.items())))  # any mapping order


class Cache:
    def __init__(self, dp, shapes, recurrent=False):
        g = kvwire.KVCacheGroupId.recurrent() if recurrent else kvwire.KVCacheGroupId.full()
        self.params = Params(dp, {leaf: Leaf(g) for leaf in shapes})
        self.arrays = [{leaf: [np.full(s, r + 1, np.uint8) for _ in range(2)] for leaf, s in shapes.items()}
                       for r in range(dp)]
        self.bufs = [DeviceBuffer({leaf: Unit(False, a) for leaf, a in arr.items()}) for arr in self.arrays]

    def get_device_buffer(self, r):
        return self.bufs[r]


def test_builds_in_declared_leaf_order():
    cache = Cache(2, {"main": (6, 64), "main/scales": (6, 8), "draft": (6, 32)})
    e = kvwire.KVTransferEngine.from_paged_kv_cache("e8", cache)
    try:
        assert e.leaf_ids == ["main", "main/scales", "draft"]
        assert e.bytes_per_group == [64, 8, 32] and e.num_pages_per_group == [6, 6, 6]
        assert (e.dp, e.tp, e.bytes_per_page) == (2, 2, 104)
        md = e.metadata
        a = cache.arrays[1]["draft"][1]
        assert md.agents_meta[1][1].base_addrs[2] == a.__array_interface__["data"][0]
    finally:
        e.cleanup()


def test_recurrent_state_is_not_implemented():
    with pytest.raises(NotImplementedError, match="recurrent"):
        kvwire.KVTransferEngine.from_paged_kv_cache("e8r", Cache(1, {"s": (4, 16)}, recurrent=True))


def test_a_unit_of_the_wrong_shape_is_value_error():
    cache = Cache(1, {"x": (4, 16)})
    cache.bufs[0].units["x"] = object()
    with pytest.raises(ValueError, match="replicated"):
        kvwire.KVTransferEngine.from_paged_kv_cache("e8b", cache)
