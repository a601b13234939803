"""Item 2: TransferReqData.to_msgpack / from_msgpack byte-identical to
msgspec.msgpack.encode of MAX 26.7's struct (tag, omit_defaults)."""

import pickle

import pytest

import kvwire

# msgspec.msgpack.encode(TransferReqData(...)) with MAX 26.7's definition (msgspec 0.23).
FULL_HEX = (
    "8ca474797065af5472616e7366657252657144617461a86473745f6e616d65a164a87372635f6e616d65a173"
    "ad7472616e736665725f6e616d65a174ac7472616e736665725f69647393cfffffffffffffffffcd012cce00011170"
    "a87372635f6964787381a1309101a86473745f6964787381a1309102af7372635f7265706c6963615f696478ff"
    "af6473745f7265706c6963615f69647805a769735f72656164c3ae74705f73686172645f636f756e7402"
    "b16c6f63616c5f7368617264735f75736564920001"
)
MINIMAL = (
    b"\x89\xa4type\xafTransferReqData\xa8dst_name\xa1d\xa8src_name\xa1s\xadtransfer_name\xa1t"
    b"\xactransfer_ids\x92\x01\x02\xa8src_idxs\x81\xa10\x91\x01\xa8dst_idxs\x81\xa10\x91\x02"
    b"\xafsrc_replica_idx\x00\xafdst_replica_idx\x00"
)


def full():
    return kvwire.TransferReqData(
        dst_name="d", src_name="s", transfer_name="t", transfer_ids=[2**64 - 1, 300, 70000],
        src_idxs={"0": [1]}, dst_idxs={"0": [2]}, src_replica_idx=-1, dst_replica_idx=5,
        is_read=True, tp_shard_count=2, local_shards_used=[0, 1],
    )


def minimal():
    return kvwire.TransferReqData(
        dst_name="d", src_name="s", transfer_name="t", transfer_ids=[1, 2],
        src_idxs={"0": [1]}, dst_idxs={"0": [2]}, src_replica_idx=0, dst_replica_idx=0,
    )


def test_literal_bytes():
    assert full().to_msgpack() == bytes.fromhex(FULL_HEX)
    assert minimal().to_msgpack() == MINIMAL
    assert kvwire.TransferReqData.from_msgpack(bytes.fromhex(FULL_HEX)) == full()
    assert kvwire.TransferReqData.from_msgpack(MINIMAL) == minimal()
    r = kvwire.TransferReqData.from_msgpack(bytearray(MINIMAL))
    assert (r.is_read, r.tp_shard_count, r.local_shards_used) == (False, 0, [])
    assert pickle.loads(pickle.dumps(full())) == full()


def test_engine_requests_cross_msgpack():
    import numpy as np

    mem = lambda: [[kvwire.KVCacheMemory(False, [np.zeros((8, 32), np.uint8) for _ in range(2)])]]
    a, b = kvwire.KVTransferEngine("mp-a", mem()), kvwire.KVTransferEngine("mp-b", mem())
    try:
        a.connect(b.metadata)
        b.connect(a.metadata)
        req = a.initiate_send_transfer(b.metadata, {"0": [1, 2]}, {"0": [3, 4]}, 0, 0)
        wire = kvwire.TransferReqData.from_msgpack(req.to_msgpack())
        assert wire == req
        b.sync_and_release(wire, timeout_s=10)
        a.sync_and_release(req, timeout_s=10)
    finally:
        a.cleanup()
        b.cleanup()


@pytest.mark.parametrize(
    "data, exc",
    [
        (bytes.fromhex(FULL_HEX)[:-1], kvwire.DecodeError),  # truncated
        (MINIMAL + b"\xc0", kvwire.DecodeError),  # trailing data
        (b"\x91\x01", kvwire.ValidationError),  # an array
        (MINIMAL.replace(b"\xa1d", b"\x01", 1), kvwire.ValidationError),  # int for str
    ],
)
def test_msgpack_errors(data, exc):
    with pytest.raises(exc):
        kvwire.TransferReqData.from_msgpack(data)


msgspec = pytest.importorskip("msgspec", reason="msgspec (test-only) cross-checks against MAX's struct definitions")


def test_equals_msgspec_over_many_requests():
    import random

    import maxdefs

    rng = random.Random(7)
    for _ in range(300):
        leaves = [f"l{i}" for i in range(rng.randint(0, 3))]
        kw = dict(
            dst_name="x" * rng.randint(0, 40), src_name="é" * rng.randint(0, 3), transfer_name="t",
            transfer_ids=[rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**64 - 1, -1, -33, -2**63])
                          for _ in range(rng.randint(0, 4))],
            src_idxs={l: [rng.randint(-5, 70000) for _ in range(rng.randint(0, 3))] for l in leaves},
            dst_idxs={l: [rng.randint(0, 300) for _ in range(rng.randint(0, 3))] for l in leaves},
            src_replica_idx=rng.randint(-2, 3), dst_replica_idx=rng.randint(0, 3),
            is_read=rng.random() < 0.5, tp_shard_count=rng.randint(0, 3),
            local_shards_used=[rng.randint(0, 3) for _ in range(rng.randint(0, 2))],
        )
        ours, theirs = kvwire.TransferReqData(**kw), maxdefs.TransferReqData(**kw)
        assert ours.to_msgpack() == msgspec.msgpack.encode(theirs)
        assert ours.to_bytes() == msgspec.json.encode(theirs)
        assert kvwire.TransferReqData.from_msgpack(msgspec.msgpack.encode(theirs)) == ours
