"""Helpers shared by the tests: page patterns, memory builders, and the
decode-side peer that runs in its own process (multiprocessing, spawn)."""

import time

import numpy as np

import kvwire

# Leaves: a values group and a smaller scales group, as MAX's FP8 caches.
LEAVES = [("0", 64, 256), ("0/scales", 64, 32)]  # (leaf_id, num_pages, bytes_per_page)


def pattern(replica, group, shard, page, bytes_per_page):
    """The bytes the source holds in one page: distinct per (replica, group, shard, page)."""
    i = np.arange(bytes_per_page, dtype=np.uint32)
    return ((i * 7 + page * 131 + shard * 17 + group * 29 + replica * 53 + 1) % 251).astype(np.uint8)


def make_memory(dp, tp, replicated, fill):
    """[replica][group] KVCacheMemory over fresh numpy arrays, and the arrays [replica][group][shard]."""
    memory, arrays = [], []
    for r in range(dp):
        groups, garr = [], []
        for g, (_, pages, bpp) in enumerate(LEAVES):
            shards = []
            for s in range(tp):
                a = np.zeros((pages, bpp), dtype=np.uint8)
                if fill:
                    for p in range(pages):
                        # a replicated group holds the same bytes in every shard
                        a[p] = pattern(r, g, 0 if replicated else s, p, bpp)
                shards.append(a)
            groups.append(kvwire.KVCacheMemory(replicated, shards))
            garr.append(shards)
        memory.append(groups)
        arrays.append(garr)
    return memory, arrays


def leaf_ids():
    return [leaf for leaf, _, _ in LEAVES]


def expected_src_shard(dst_shard, src_tp, src_replicated):
    if src_tp == 1:
        return 0
    return 0 if src_replicated else dst_shard


def verify(arrays, moves, src_tp, src_replicated):
    """Check every destination page of `moves` [(src_replica, dst_replica, src_pages, dst_pages)]."""
    for src_r, dst_r, src_pages, dst_pages in moves:
        for g, (_, _, bpp) in enumerate(LEAVES):
            for s, a in enumerate(arrays[dst_r][g]):
                ss = expected_src_shard(s, src_tp, src_replicated)
                for sp, dp_ in zip(src_pages, dst_pages):
                    want = pattern(src_r, g, 0 if src_replicated else ss, sp, bpp)
                    if not np.array_equal(a[dp_], want):
                        return f"replica {dst_r} group {g} shard {s} page {dp_} (from {sp}) differs"
    return "ok"


def decode_peer(conn, dp, tp, replicated, mode):
    """The passive (or reading) engine in its own process.

    mode "send": wait for the prefill's WRITE; "read": pull from the prefill.
    Sends back "ok" or what went wrong, after checking every page.
    """
    try:
        fill = False
        memory, arrays = make_memory(dp, tp, replicated, fill)
        eng = kvwire.KVTransferEngine("decode", memory, leaf_ids())
        conn.send(eng.metadata.to_bytes())
        msg = conn.recv()
        if mode == "send":
            src_tp, src_replicated, moves, reqs = msg
            reqs = [kvwire.TransferReqData.from_json(j) for j in reqs]
            deadline = time.monotonic() + 30
            for req in reqs:
                while not eng.is_complete(req):
                    if time.monotonic() > deadline:
                        raise TimeoutError("transfer never completed")
                    time.sleep(0.001)
                eng.cleanup_transfer(req)
        else:
            prefill_md, src_tp, src_replicated, moves = msg
            prefill_md = kvwire.KVTransferEngineMetadata.from_bytes(prefill_md)
            eng.connect(prefill_md)
            for src_r, dst_r, src_pages, dst_pages in moves:
                req = eng.initiate_read_transfer(
                    prefill_md, {k: src_pages for k in leaf_ids()}, {k: dst_pages for k in leaf_ids()}, src_r, dst_r
                )
                assert req.is_read
                eng.sync_and_release(req, timeout_s=30.0)
            conn.send([])  # tell the prefill its pages were read
        verdict = verify(arrays, moves, src_tp, src_replicated)
        eng.cleanup()
        conn.send(verdict)
    except BaseException as e:  # report, never hang the parent
        conn.send(f"{type(e).__name__}: {e}")
