"""Item 6: MAX 26.7's error classes and order: a negative replica index is a
ValueError (not OverflowError); replicated_per_group of another length across
a TP change is MAX's zip(strict=True) ValueError; the source side's page
checks (leaf set, then ranges) come before the destination side's."""

import numpy as np
import pytest

import kvwire


def mem(tp=1, replicated=False, pages=8, bpp=64):
    return kvwire.KVCacheMemory(replicated, [np.zeros((pages, bpp), np.uint8) for _ in range(tp)])


@pytest.fixture
def pair():
    a = kvwire.KVTransferEngine("e6-a", [[mem()]])
    b = kvwire.KVTransferEngine("e6-b", [[mem()]])
    a.connect(b.metadata)
    yield a, b
    a.cleanup()
    b.cleanup()


def test_negative_replica_is_value_error(pair):
    a, b = pair
    with pytest.raises(ValueError, match=r"src_replica_idx -1 must be between 0 and 0"):
        a.initiate_send_transfer(b.metadata, {"0": [1]}, {"0": [1]}, -1, 0)
    with pytest.raises(ValueError, match=r"dst_replica_idx -2 must be between 0 and 0"):
        a.initiate_send_transfer(b.metadata, {"0": [1]}, {"0": [1]}, 0, -2)
    with pytest.raises(ValueError, match=r"dst_replica_idx -1 must be between 0 and 0"):
        a.initiate_read_transfer(b.metadata, {"0": [1]}, {"0": [1]}, 0, -1)
    with pytest.raises(ValueError, match=r"src_replica_idx -1 must be between 0 and 0"):
        a.initiate_read_transfer("e6-b", {"0": [1]}, {"0": [1]}, -1, 0)


def test_group_count_mismatch_across_tp_change_is_value_error():
    a = kvwire.KVTransferEngine("e6-tp1", [[mem(tp=1)]])
    b = kvwire.KVTransferEngine("e6-tp2", [[mem(tp=2, replicated=True), mem(tp=2, replicated=True)]])
    try:
        with pytest.raises(ValueError, match="replicated_per_group") as info:
            a.connect(b.metadata)
        assert not isinstance(info.value, NotImplementedError)
    finally:
        a.cleanup()
        b.cleanup()


def test_source_checks_come_first(pair):
    a, b = pair
    # Source page out of range and destination leaf unknown: MAX reports the source.
    with pytest.raises(ValueError, match="source page 99"):
        a.initiate_send_transfer(b.metadata, {"0": [99]}, {"nope": [1]}, 0, 0)
    # Source leaf unknown and destination page out of range: the source again.
    with pytest.raises(ValueError, match="[Ss]ource.*leaf"):
        a.initiate_send_transfer(b.metadata, {"nope": [1]}, {"0": [99]}, 0, 0)
    # Source fine, destination range wrong.
    with pytest.raises(ValueError, match="destination page 99"):
        a.initiate_send_transfer(b.metadata, {"0": [1]}, {"0": [99]}, 0, 0)
