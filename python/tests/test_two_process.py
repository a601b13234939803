"""Two engines in two Python processes moving verified pages over shm."""

import multiprocessing as mp

import pytest

import kvwire
from kvpeer import decode_peer, leaf_ids, make_memory

CTX = mp.get_context("spawn")


def run(src_dp, src_tp, src_repl, dst_dp, dst_tp, dst_repl, moves, mode="send"):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=decode_peer, args=(child, dst_dp, dst_tp, dst_repl, mode))
    p.start()
    try:
        memory, _ = make_memory(src_dp, src_tp, src_repl, fill=True)
        eng = kvwire.KVTransferEngine("prefill", memory, leaf_ids())
        assert parent.poll(60), "decode peer did not start"
        md_bytes = parent.recv()
        if isinstance(md_bytes, str):
            pytest.fail(md_bytes)
        md = kvwire.KVTransferEngineMetadata.from_bytes(md_bytes)
        assert md.name == "decode" and md.tp == dst_tp and md.dp == dst_dp
        if mode == "send":
            eng.connect(md)
            reqs = []
            for src_r, dst_r, sp, dp_ in moves:
                idx = lambda pages: {k: pages for k in leaf_ids()}  # noqa: E731
                req = eng.initiate_send_transfer("decode", idx(sp), idx(dp_), src_r, dst_r)
                assert req.src_name == "prefill" and req.dst_name == "decode" and not req.is_read
                assert req.tp_shard_count == len(req.transfer_ids) == dst_tp  # the destination spans all its shards
                reqs.append(req)
            parent.send((src_tp, src_repl, moves, [r.to_json() for r in reqs]))
            for req in reqs:
                eng.sync_and_release(req, timeout_s=30.0)
        else:
            parent.send((eng.metadata.to_bytes(), src_tp, src_repl, moves))
            assert parent.poll(60)
            first = parent.recv()
            assert first == [], first
        assert parent.poll(60), "decode peer did not answer"
        assert parent.recv() == "ok"
        eng.cleanup()
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def test_tp1_send():
    run(1, 1, False, 1, 1, False, [(0, 0, [1, 2, 3], [7, 8, 9])])


def test_tp2_send():
    run(1, 2, False, 1, 2, False, [(0, 0, [1, 5, 63], [2, 40, 10])])


def test_tp2_read():
    run(1, 2, False, 1, 2, False, [(0, 0, [4, 6], [11, 12])], mode="read")


def test_dp2_send():
    run(2, 1, False, 2, 1, False, [(0, 1, [1, 2], [3, 4]), (1, 0, [5, 6], [7, 8])])


def test_tp1_to_tp4_mla_broadcast():
    run(1, 1, False, 1, 4, True, [(0, 0, [1, 2, 3, 4], [60, 61, 62, 63])])


def test_tp4_mla_to_tp1_send():
    # the replicated source is flattened to shard 0
    run(1, 4, True, 1, 1, False, [(0, 0, [9], [10])])
