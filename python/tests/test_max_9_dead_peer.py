"""Item 9 and issue 16 item 5 (Python part): a dead peer raises
kvwire.TransferError with a typed `.kind`, asserted here instead of the
message text."""

import multiprocessing as mp

import numpy as np
import pytest

import kvwire


def mem():
    return [[kvwire.KVCacheMemory(False, [np.zeros((8, 64), np.uint8)])]]


def _peer(conn, name, transport):
    e = kvwire.KVTransferEngine(name, mem(), transport=transport)
    conn.send(e.metadata.to_bytes())
    conn.recv()  # then exit without cleanup: the peer dies


def start_peer(name, transport):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peer, args=(child, name, transport))
    p.start()
    return p, parent, kvwire.KVTransferEngineMetadata.from_bytes(parent.recv())


def test_connect_to_a_dead_peer_is_peer_died():
    p, conn, md = start_peer("e9-gone", "shm")
    conn.send("die")
    p.join(30)
    a = kvwire.KVTransferEngine("e9-a", mem(), peer_timeout_s=1.0)
    try:
        with pytest.raises(kvwire.TransferError) as info:
            a.connect(md)
        assert info.value.kind == "peer_died"
    finally:
        a.cleanup()


def test_send_to_a_peer_that_died_after_connect_is_peer_died():
    p, conn, md = start_peer("e9-dies", "shm")
    a = kvwire.KVTransferEngine("e9-b", mem(), peer_timeout_s=1.0)
    try:
        a.connect(md)
        conn.send("die")
        p.join(30)
        with pytest.raises(kvwire.TransferError) as info:
            req = a.initiate_send_transfer(md, {"0": [1]}, {"0": [2]})
            a.sync_and_release(req, timeout_s=10)
        assert info.value.kind == "peer_died"
    finally:
        a.cleanup()


# tcp: once the peer is known dead, the post raises at the call (MAX's
# behaviour), instead of an accepted transfer that fails a moment later.
def test_tcp_send_to_a_dead_peer_raises_at_the_call():
    p, conn, md = start_peer("e9-tcp", "tcp")
    a = kvwire.KVTransferEngine("e9-c", mem(), transport="tcp", peer_timeout_s=1.0)
    try:
        a.connect(md)
        conn.send("die")
        p.join(30)
        import time

        time.sleep(0.5)  # the peer's sockets are closed by now
        with pytest.raises(kvwire.TransferError) as info:
            a.initiate_send_transfer(md, {"0": [1]}, {"0": [2]})
        assert info.value.kind == "peer_died"
    finally:
        a.cleanup()


# Issue 32 item 3: a dead peer stays known until the caller removes it,
# removing it never raises, and a restarted peer under the same name connects
# and moves bytes at once (on shm and tcp).
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_peer_stays_known_then_disconnect_and_reconnect(transport):
    name = f"e9-restart-{transport}"
    p, conn, md = start_peer(name, transport)
    a = kvwire.KVTransferEngine(f"e9-r-{transport}", mem(), transport=transport, peer_timeout_s=1.0)
    try:
        a.connect(md)
        conn.send("die")
        p.join(30)
        import time

        deadline = time.time() + 20
        kinds = []
        while len(kinds) < 2:
            assert time.time() < deadline, kinds
            try:
                req = a.initiate_send_transfer(md, {"0": [1]}, {"0": [2]})
                a.sync_and_release(req, timeout_s=10)
            except kvwire.TransferError as e:
                kinds.append(e.kind)
        assert set(kinds) == {"peer_died"}, kinds
        assert a.is_connected(name), "a dead peer stays known until disconnect"
        a.disconnect(name)  # never raises for a dead peer
        assert not a.is_connected(name)
        p2, conn2, md2 = start_peer(name, transport)
        a.connect(md2)
        req = a.initiate_send_transfer(md2, {"0": [1, 2]}, {"0": [3, 4]})
        a.sync_and_release(req, timeout_s=10)
        conn2.send("die")
        p2.join(30)
    finally:
        a.cleanup()
