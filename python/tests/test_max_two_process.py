"""Two processes: the child speaks MAX 26.7's wire formats with msgspec and
MAX's struct definitions (maxdefs.py); the parent is kvwire. The child
re-encodes the engines' metadata and builds the TransferReqData the way
MAX's scheduler sends it (msgpack over a socket); kvwire decodes both,
connects and completes the transfer, and the bytes land."""

import multiprocessing as mp

import numpy as np
import pytest

import kvwire

msgspec = pytest.importorskip("msgspec", reason="the MAX side of this test encodes with msgspec (test-only)")


def _max_side(conn):
    import msgspec

    import maxdefs

    enc = msgspec.msgpack.Encoder()
    src_json, dst_json = conn.recv()
    src = msgspec.json.decode(src_json, type=maxdefs.KVTransferEngineMetadata)
    dst = msgspec.json.decode(dst_json, type=maxdefs.KVTransferEngineMetadata)
    conn.send((enc.encode(src), enc.encode(dst)))
    # The request record of a send prefill -> decode, as MAX's engine fills it.
    req = maxdefs.TransferReqData(
        dst_name=dst.name, src_name=src.name, transfer_name=conn.recv(), transfer_ids=[0],
        src_idxs={"0": [1, 2]}, dst_idxs={"0": [5, 6]}, src_replica_idx=0, dst_replica_idx=0,
        tp_shard_count=1, local_shards_used=[0],
    )
    conn.send(enc.encode(req))


def test_max_encoded_metadata_and_request_drive_kvwire():
    src_kv = (np.arange(8 * 64) % 251).astype(np.uint8).reshape(8, 64)
    dst_kv = np.zeros((8, 64), np.uint8)
    a = kvwire.KVTransferEngine("tp-max-a", [[kvwire.KVCacheMemory(False, [src_kv])]])
    b = kvwire.KVTransferEngine("tp-max-b", [[kvwire.KVCacheMemory(False, [dst_kv])]])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_max_side, args=(child,))
    p.start()
    try:
        parent.send((a.metadata.to_bytes(), b.metadata.to_bytes()))
        src_mp, dst_mp = parent.recv()
        assert src_mp == a.metadata.to_msgpack() and dst_mp == b.metadata.to_msgpack()
        a.connect(kvwire.KVTransferEngineMetadata.from_msgpack(dst_mp))
        b.connect(kvwire.KVTransferEngineMetadata.from_msgpack(src_mp))
        req = a.initiate_send_transfer("tp-max-b", {"0": [1, 2]}, {"0": [5, 6]}, 0, 0)
        parent.send(req.transfer_name)
        on_decode = kvwire.TransferReqData.from_msgpack(parent.recv())
        assert on_decode.to_msgpack() == kvwire.TransferReqData(
            dst_name="tp-max-b", src_name="tp-max-a", transfer_name=req.transfer_name, transfer_ids=[0],
            src_idxs={"0": [1, 2]}, dst_idxs={"0": [5, 6]}, src_replica_idx=0, dst_replica_idx=0,
            tp_shard_count=1, local_shards_used=[0]).to_msgpack()
        b.sync_and_release(on_decode, timeout_s=10)
        a.sync_and_release(req, timeout_s=10)
        assert (dst_kv[5:7] == src_kv[1:3]).all() and not dst_kv[[0, 1, 2, 3, 4, 7]].any()
    finally:
        p.join(30)
        a.cleanup()
        b.cleanup()
