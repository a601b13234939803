"""Every error path, mapped to the exception a MAX user expects."""

import numpy as np
import pytest

import kvwire


def buf(pages=8, bpp=64):
    return np.zeros((pages, bpp), dtype=np.uint8)


def mem(tp=1, replicated=False, pages=8, bpp=64):
    return kvwire.KVCacheMemory(replicated, [buf(pages, bpp) for _ in range(tp)])


# ---- KVCacheMemory (MAX __post_init__) ----
@pytest.mark.parametrize(
    "buffers, replicated, match",
    [
        ([], False, "no buffers|at least one|empty"),
        ([np.zeros(64, np.uint8)], False, "2-D|dimension|ndim"),
        ([np.zeros((2, 4, 8), np.uint8)], False, "2-D|dimension|ndim"),
        ([np.zeros((8, 16), np.float32)], False, "uint8"),
        ([np.zeros((8, 80), np.uint8)[:, :64]], False, "contiguous"),
        ([np.zeros((8, 128), np.uint8)[:, ::2]], False, "contiguous"),
        ([buf(8, 64), buf(8, 32)], False, "shape"),
        ([buf()], True, "2|replicated"),
        ([42], False, "buffer"),
        ([b"immutable bytes"], False, "read-only"),
    ],
)
def test_memory_validation(buffers, replicated, match):
    with pytest.raises(ValueError, match=match):
        kvwire.KVCacheMemory(replicated, buffers)


def test_memory_read_only_array():
    a = buf()
    a.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        kvwire.KVCacheMemory(False, [a])


def test_memory_accepts_buffer_protocol_and_properties():
    # a bytearray is 1-D: rejected as not 2-D; a 2-D memoryview cast is accepted
    with pytest.raises(ValueError, match="2"):
        kvwire.KVCacheMemory(False, [bytearray(128)])
    m = kvwire.KVCacheMemory(True, [memoryview(bytearray(128)).cast("B", (4, 32)) for _ in range(2)])
    assert (m.replicated, m.bytes_per_page, m.total_num_pages, m.host_bytes_per_page) == (True, 32, 4, 32)
    m = mem(tp=3)
    assert m.host_bytes_per_page == 3 * 64 and len(m.buffers) == 3


# ---- KVTransferEngine.__init__ ----
def test_engine_validation():
    E = kvwire.KVTransferEngine
    with pytest.raises(ValueError, match="replica"):
        E("e", [])
    with pytest.raises(ValueError):
        E("e", [[]])
    with pytest.raises(ValueError):
        E("", [[mem()]])
    with pytest.raises(ValueError, match="[Ll]eaf"):
        E("e", [[mem(), mem()]], leaf_ids=["a"])
    with pytest.raises(ValueError, match="[Dd]uplicate|unique"):
        E("e", [[mem(), mem()]], leaf_ids=["a", "a"])
    with pytest.raises(ValueError):  # group count differs across replicas
        E("e", [[mem(), mem()], [mem()]])
    with pytest.raises(ValueError):  # page count differs across replicas
        E("e", [[mem(pages=8)], [mem(pages=9)]])
    with pytest.raises(ValueError):  # replication differs across replicas
        E("e", [[mem(tp=2, replicated=True)], [mem(tp=2)]])
    with pytest.raises(ValueError):  # shard count differs
        E("e", [[mem(tp=2), mem(tp=1)]])
    with pytest.raises(ValueError):  # bytes per page differs across replicas
        E("e", [[mem(bpp=64)], [mem(bpp=32)]])
    with pytest.raises(ValueError, match="transport|unknown"):
        E("e", [[mem()]], transport="carrier-pigeon")
    with pytest.raises(ValueError, match="KVCacheMemory"):
        E("e", [[np.zeros((8, 64), np.uint8)]])
    with pytest.raises(ValueError):
        E("e", [mem()])  # not [replica][group]
    with pytest.raises(ValueError):
        E("e", [[mem()]], peer_timeout_s=0)


@pytest.fixture
def pair():
    a = kvwire.KVTransferEngine("errs-a", [[mem(tp=2)]])
    b = kvwire.KVTransferEngine("errs-b", [[mem(tp=2)]])
    yield a, b
    a.cleanup()
    b.cleanup()


def test_connect_errors(pair):
    a, b = pair
    with pytest.raises(ValueError):
        a.connect("errs-b")  # needs metadata
    a.connect(b.metadata)
    assert a.is_connected("errs-b")
    with pytest.raises(ValueError, match="already connected"):
        a.connect(b.metadata)
    a.disconnect("errs-b")
    with pytest.raises(ValueError, match="not connected"):
        a.disconnect("errs-b")

    c = kvwire.KVTransferEngine("errs-c", [[mem(tp=4)]])  # sharded TP 2 -> 4
    with pytest.raises(NotImplementedError, match="GATHER_SCATTER"):
        a.connect(c.metadata)
    d = kvwire.KVTransferEngine("errs-d", [[mem(tp=2, bpp=32)]])
    with pytest.raises(ValueError, match="Bytes per page mismatch: 64 != 32"):
        a.connect(d.metadata)
    e = kvwire.KVTransferEngine("errs-e", [[mem(tp=2)]], leaf_ids=["other"])
    with pytest.raises(ValueError, match="[Ll]eaf"):
        a.connect(e.metadata)
    for x in (c, d, e):
        x.cleanup()


def test_initiate_errors(pair):
    a, b = pair
    with pytest.raises(ValueError, match="not connected"):
        a.initiate_send_transfer("errs-b", [1], [1])
    a.connect(b.metadata)
    send = a.initiate_send_transfer
    with pytest.raises(ValueError, match="replica"):
        send("errs-b", [1], [1], 1, 0)
    with pytest.raises(ValueError, match="replica"):
        send(b.metadata, [1], [1], 0, 5)
    with pytest.raises(ValueError, match="[Ll]eaf"):
        send("errs-b", {"nope": [1]}, {"nope": [1]})
    with pytest.raises(ValueError, match="[Ll]eaf"):
        send("errs-b", {"0": [1]}, {})
    with pytest.raises(ValueError, match="range"):
        send("errs-b", [8], [1])
    with pytest.raises(ValueError):
        send("errs-b", [1, 2], [1])
    with pytest.raises(ValueError, match="more than once"):
        send("errs-b", [1, 2], [3, 3])
    with pytest.raises(ValueError):
        send("errs-b", [-1], [1])
    with pytest.raises(ValueError):
        send("errs-b", "12", [1])
    with pytest.raises(ValueError):
        send(42, [1], [1])


def test_completion_errors(pair):
    a, b = pair
    a.connect(b.metadata)
    req = a.initiate_send_transfer("errs-b", [1, 2], [3, 4])
    a.sync_and_release(req, timeout_s=10)
    with pytest.raises(ValueError, match="unknown"):
        a.cleanup_transfer(req)
    with pytest.raises(ValueError):
        a.sync_and_release(req, timeout_s=-1)
    # the passive side: a transfer that never happens never completes
    ghost = kvwire.TransferReqData.from_json(req.to_json().replace(req.transfer_name, "ghost"))
    assert not b.is_complete(ghost)
    with pytest.raises(ValueError, match="not complete"):
        b.cleanup_transfer(ghost)
    with pytest.raises(TimeoutError):
        b.sync_and_release(ghost, timeout_s=0.02)


def test_metadata_round_trip_and_errors(pair):
    import pickle

    a, _ = pair
    md = a.metadata
    assert kvwire.KVTransferEngineMetadata.from_bytes(md.to_bytes()) == md
    assert kvwire.KVTransferEngineMetadata.from_json(md.to_json()) == md
    assert pickle.loads(pickle.dumps(md)) == md
    assert (md.name, md.dp, md.tp, md.leaf_ids, md.memory_type) == ("errs-a", 1, 2, ["0"], kvwire.MemoryType.DRAM)
    assert md.bytes_per_group == [64] and md.num_pages_per_group == [8]
    for bad in (b"", b"garbage", b'{"type":"KVTransferEngineMetadata"}'):
        with pytest.raises(ValueError):
            kvwire.KVTransferEngineMetadata.from_bytes(bad)


def test_dead_peer_fails_with_transfer_error():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_die_after_metadata, args=(child,))
    p.start()
    md = kvwire.KVTransferEngineMetadata.from_bytes(parent.recv())
    a = kvwire.KVTransferEngine("survivor", [[mem(tp=1)]], peer_timeout_s=1.0)
    p.join(30)
    with pytest.raises(kvwire.TransferError, match="doomed"):
        a.connect(md)
    a.cleanup()


def test_peer_dying_after_connect_fails_the_transfer():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_die_after_metadata, args=(child, True))
    p.start()
    md = kvwire.KVTransferEngineMetadata.from_bytes(parent.recv())
    a = kvwire.KVTransferEngine("survivor2", [[mem(tp=1)]], peer_timeout_s=1.0)
    a.connect(md)
    parent.send("die")
    p.join(30)
    with pytest.raises(kvwire.TransferError):
        req = a.initiate_send_transfer("doomed", [1], [1])
        a.sync_and_release(req, timeout_s=10)
    a.cleanup()


def _die_after_metadata(conn, wait=False):
    e = kvwire.KVTransferEngine("doomed", [[mem(tp=1)]])
    conn.send(e.metadata.to_bytes())
    if wait:
        conn.recv()
