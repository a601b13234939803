"""Item 5: engines MAX builds that kvwire used to refuse: groups of zero
pages or zero bytes per page, and leaves that are views into one shared
buffer (registered once as their union, each addressed from its own base)."""

import numpy as np
import pytest

import kvwire


def test_zero_pages_and_zero_bytes_per_page_build_and_connect():
    z_pages = lambda: kvwire.KVCacheMemory(False, [np.zeros((0, 64), np.uint8)])
    z_bytes = lambda: kvwire.KVCacheMemory(False, [np.zeros((8, 0), np.uint8)])
    real = [np.arange(8 * 32, dtype=np.uint32).astype(np.uint8).reshape(8, 32), np.zeros((8, 32), np.uint8)]
    a = kvwire.KVTransferEngine("e5-a", [[z_pages(), z_bytes(), kvwire.KVCacheMemory(False, [real[0]])]])
    b = kvwire.KVTransferEngine("e5-b", [[z_pages(), z_bytes(), kvwire.KVCacheMemory(False, [real[1]])]])
    try:
        assert a.num_pages_per_group == [0, 8, 8] and a.bytes_per_group == [64, 0, 32]
        assert a.metadata.bytes_per_page == 96
        a.connect(b.metadata)
        b.connect(a.metadata)
        req = a.initiate_send_transfer(b.metadata, {"0": [], "1": [2], "2": [3]}, {"0": [], "1": [5], "2": [6]})
        b.sync_and_release(req, timeout_s=10)
        a.sync_and_release(req, timeout_s=10)
        assert (real[1][6] == real[0][3]).all()
        with pytest.raises(ValueError, match="range"):
            a.initiate_send_transfer(b.metadata, {"0": [0], "1": [], "2": []}, {"0": [0], "1": [], "2": []})
    finally:
        a.cleanup()
        b.cleanup()


def slab_engine(name, fill):
    # One slab; leaf "k" is its first 10 rows of 64 B, leaf "v" rows 5..15 (they overlap).
    slab = np.zeros((16, 64), np.uint8)
    if fill:
        slab[:] = (np.arange(16 * 64) % 251).reshape(16, 64)
    k, v = slab[0:10], slab[5:15]
    mem = [[kvwire.KVCacheMemory(False, [k]), kvwire.KVCacheMemory(False, [v])]]
    return kvwire.KVTransferEngine(name, mem, leaf_ids=["k", "v"]), slab


def test_overlapping_views_of_one_slab_register_once_and_move_by_offset():
    (a, src), (b, dst) = slab_engine("e5-slab-a", True), slab_engine("e5-slab-b", False)
    try:
        a.connect(b.metadata)
        b.connect(a.metadata)
        base = src.__array_interface__["data"][0]
        assert a.metadata.agents_meta[0][0].base_addrs == [base, base + 5 * 64]
        # "k" page 1 -> "k" page 2; "v" page 0 (slab row 5) -> "v" page 9 (slab row 14).
        req = a.initiate_send_transfer(b.metadata, {"k": [1], "v": [0]}, {"k": [2], "v": [9]})
        b.sync_and_release(req, timeout_s=10)
        a.sync_and_release(req, timeout_s=10)
        assert (dst[2] == src[1]).all() and (dst[14] == src[5]).all()
        assert not dst[[0, 1, 3, 4, 5, 13, 15]].any()
    finally:
        a.cleanup()
        b.cleanup()
