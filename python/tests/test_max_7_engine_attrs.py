"""Item 7: KVTransferEngine's MAX 26.7 attributes with MAX's types, and
cleanup() leaving remote_connections (and remote_agent_to_engine) as MAX does."""

import numpy as np
import pytest

import kvwire


def mem(tp=2, pages=8, bpp=64):
    return kvwire.KVCacheMemory(False, [np.zeros((pages, bpp), np.uint8) for _ in range(tp)])


def test_attributes_and_cleanup():
    a = kvwire.KVTransferEngine("e7-a", [[mem(), mem(bpp=16)]])
    b = kvwire.KVTransferEngine("e7-b", [[mem(), mem(bpp=16)]])
    assert a.bytes_per_page == 80 and isinstance(a.bytes_per_page, int)
    assert a.memory_type is kvwire.MemoryType.DRAM
    assert (a.remote_connections, a.remote_agent_to_engine) == ({}, {})
    assert (a.inflight_send_transfers, a.inflight_read_transfers, a.completed_recv_transfers) == ({}, {}, {})
    a.connect(b.metadata)
    b.connect(a.metadata)
    rc = a.remote_connections
    assert list(rc) == ["e7-b"] and isinstance(rc["e7-b"], kvwire.KVTransferEngineMetadata)
    assert rc["e7-b"] == b.metadata
    assert a.remote_agent_to_engine == {"e7-b_0_0": "e7-b", "e7-b_0_1": "e7-b"}
    send = a.initiate_send_transfer(b.metadata, {"0": [1], "1": [2]}, {"0": [3], "1": [4]}, 0, 0)
    read = a.initiate_read_transfer(b.metadata, {"0": [5], "1": [5]}, {"0": [6], "1": [6]}, 0, 0)
    assert a.inflight_send_transfers == {send.transfer_name: send}
    assert a.inflight_read_transfers == {read.transfer_name: read}
    assert isinstance(a.inflight_send_transfers[send.transfer_name], kvwire.TransferReqData)
    b.sync_and_release(send, timeout_s=10)
    a.sync_and_release(send, timeout_s=10)
    a.sync_and_release(read, timeout_s=10)
    assert a.inflight_send_transfers == {} and a.inflight_read_transfers == {}
    a.cleanup()
    # MAX's cleanup invalidates the peers' metadata but leaves the map.
    assert list(a.remote_connections) == ["e7-b"]
    assert a.remote_agent_to_engine == {"e7-b_0_0": "e7-b", "e7-b_0_1": "e7-b"}
    with pytest.raises(ValueError, match="already connected"):
        a.connect(b.metadata)
    b.cleanup()


def test_disconnect_forgets_the_peer():
    a = kvwire.KVTransferEngine("e7-c", [[mem()]])
    b = kvwire.KVTransferEngine("e7-d", [[mem()]])
    try:
        a.connect(b.metadata)
        a.disconnect("e7-d")
        assert a.remote_connections == {} and a.remote_agent_to_engine == {}
        a.connect(b.metadata)  # accepted again, as MAX's disconnect allows
    finally:
        a.cleanup()
        b.cleanup()
