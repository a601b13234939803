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


def test_cleanup_leaves_maxs_dicts_in_connect_order():
    # Issue 30, MAX parity 4. MAX 26.7's cleanup() releases the in-flight
    # transfers and invalidates its peers' metadata, and leaves the plain
    # dicts remote_connections, remote_agent_to_engine and
    # completed_recv_transfers as they were: peers in the order connect()
    # added them, agents in [replica][shard] order.
    names = ["e7-z", "e7-m", "e7-x10"]
    a = kvwire.KVTransferEngine("e7-hub", [[mem(tp=1)]])
    peers = {n: kvwire.KVTransferEngine(n, [[mem(tp=1)], [mem(tp=1)]] if n == "e7-x10" else [[mem(tp=1)]])
             for n in names}
    try:
        for n in names:
            a.connect(peers[n].metadata)
            peers[n].connect(a.metadata)
        expect_rc = ["e7-z", "e7-m", "e7-x10"]
        expect_agents = {"e7-z_0_0": "e7-z", "e7-m_0_0": "e7-m", "e7-x10_0_0": "e7-x10", "e7-x10_1_0": "e7-x10"}
        assert list(a.remote_connections) == expect_rc
        assert list(a.remote_agent_to_engine.items()) == list(expect_agents.items())
        # One transfer from "e7-m" lands here and is released; one from "e7-z" is not.
        done = peers["e7-m"].initiate_send_transfer(a.metadata, [1], [2], 0, 0)
        a.sync_and_release(done, timeout_s=10)
        peers["e7-m"].sync_and_release(done, timeout_s=10)
        pending = peers["e7-z"].initiate_send_transfer(a.metadata, [1], [3], 0, 0)
        peers["e7-z"].sync_and_release(pending, timeout_s=10)
        import time

        deadline = time.monotonic() + 10
        while not a.is_complete(pending) and time.monotonic() < deadline:
            time.sleep(0.01)
        recv = a.completed_recv_transfers
        assert recv["e7-z"] == {pending.transfer_name: 1} and recv["e7-m"] == {}
        out = a.initiate_send_transfer(peers["e7-x10"].metadata, [4], [5], 0, 1)
        assert list(a.inflight_send_transfers) == [out.transfer_name]
        a.cleanup()
        assert list(a.remote_connections) == expect_rc
        assert all(a.remote_connections[n] == peers[n].metadata for n in names)
        assert list(a.remote_agent_to_engine.items()) == list(expect_agents.items())
        assert a.completed_recv_transfers == recv
        assert (a.inflight_send_transfers, a.inflight_read_transfers) == ({}, {})
        with pytest.raises(ValueError, match="already connected"):
            a.connect(peers["e7-m"].metadata)
    finally:
        a.cleanup()
        for p in peers.values():
            p.cleanup()
