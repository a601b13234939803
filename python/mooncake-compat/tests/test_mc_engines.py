"""The call sequences of the engines that use Mooncake's Python API, in two
processes, bytes verified, on shm and tcp:

- SGLang 0.5.23 (srt/distributed/device_communicators/mooncake_transfer_engine.py,
  srt/disaggregation/mooncake/conn.py): one shared engine per process,
  initialize(host, "P2PHANDSHAKE", protocol, device), batch_register_memory
  of the KV buffers and register_memory of the aux buffer, session
  host:get_rpc_port(), KV pages (contiguous runs merged) per layer with
  batch_transfer_sync_write in batches of <= 1,024, aux data with
  transfer_sync_write, send_probe for liveness; transfers from a thread pool.
- vLLM 0.34 MooncakeConnector: initialize(ip, "P2PHANDSHAKE", "rdma", ""),
  get_rpc_port, batch_register_memory, all blocks of a request in one
  batch_transfer_sync_write (from a thread pool), batch_unregister_memory.
"""

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import DEVICE

from mooncake.engine import TransferEngine

LAYERS = 4
PAGES = 512
PAGE_BYTES = 4096  # one page of one layer's K (or V)
AUX_BYTES = 256  # per request slot
AUX_SLOTS = 8


def make_kv(seed=None):
    bufs = [np.zeros(PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(2 * LAYERS)]  # K and V per layer
    if seed is not None:
        for i, b in enumerate(bufs):
            b[:] = np.frombuffer(np.random.default_rng(seed + i).bytes(b.nbytes), dtype=np.uint8)
    return bufs


def group_contiguous(src, dst):
    """SGLang's group_concurrent_contiguous: runs where both index lists step by one."""
    runs, start = [], 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((src[start], dst[start], i - start))
            start = i
    return runs


def expected_sha(kv, src_pages, dst_pages):
    """sha256 of what the decode side's pages `dst_pages` must hold, layer by layer."""
    h = hashlib.sha256()
    for b in kv:
        pages = b.reshape(PAGES, PAGE_BYTES)
        for s in src_pages:
            h.update(pages[s].tobytes())
    return h.hexdigest()


def test_sglang_flow(transport, peer_factory, monkeypatch):
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")  # SGLang's default; no NIC here -> kvwire's rule
    protocol = os.environ["MOONCAKE_PROTOCOL"]
    host = "127.0.0.1"

    # decode: the shared engine, KV and aux buffers registered
    decode = peer_factory()
    info = decode.call(op="init", host=host, protocol=protocol)
    assert info["rc"] == 0
    session = info["session"]
    d_kv = decode.call(op="alloc", sizes=[PAGES * PAGE_BYTES] * (2 * LAYERS))["addrs"]
    (d_aux,) = decode.call(op="alloc", sizes=[AUX_BYTES * AUX_SLOTS])["addrs"]

    # prefill
    engine = TransferEngine()
    assert engine.initialize(host, "P2PHANDSHAKE", protocol, DEVICE) == 0
    assert f"{host}:{engine.get_rpc_port()}" == engine.session_id
    kv = make_kv(seed=100)
    aux = np.frombuffer(np.random.default_rng(7).bytes(AUX_BYTES * AUX_SLOTS), dtype=np.uint8).copy()
    assert engine.batch_register_memory([b.ctypes.data for b in kv], [b.nbytes for b in kv]) == 0
    assert engine.register_memory(aux.ctypes.data, aux.nbytes) == 0
    assert engine.send_probe(session) == 0

    rng = np.random.default_rng(11)
    requests = []
    free = rng.permutation(PAGES).tolist()
    for r in range(4):
        n = [300, 64, 1, 120][r]
        src = sorted(rng.choice(PAGES, n, replace=False).tolist())
        # decode pages: partly contiguous, as an allocator hands them out
        dst = sorted(free[:n]) if r % 2 else free[:n]
        free = free[n:]
        requests.append((r, src, dst))

    def send(req):
        r, src, dst = req
        runs = group_contiguous(src, dst)
        srcs, dsts, lens = [], [], []
        for layer in range(2 * LAYERS):
            for s, d, count in runs:
                srcs.append(kv[layer].ctypes.data + s * PAGE_BYTES)
                dsts.append(d_kv[layer] + d * PAGE_BYTES)
                lens.append(count * PAGE_BYTES)
        for i in range(0, len(srcs), 1024):  # SGLang's batch bound
            rc = engine.batch_transfer_sync_write(session, srcs[i:i + 1024], dsts[i:i + 1024], lens[i:i + 1024])
            if rc != 0:
                return rc
        rc = engine.transfer_sync_write(session, aux.ctypes.data + r * AUX_BYTES, d_aux + r * AUX_BYTES, AUX_BYTES)
        if rc != 0:
            return rc
        return len(srcs)

    with ThreadPoolExecutor(2) as pool:
        counts = list(pool.map(send, requests))
    assert all(c > 0 for c in counts), counts
    assert counts[0] > 1024, "the first request needs several batches"
    assert engine.send_probe(session) == 0

    for r, src, dst in requests:
        pieces = [[d_kv[layer] + d * PAGE_BYTES, PAGE_BYTES] for layer in range(2 * LAYERS) for d in dst]
        assert decode.call(op="sha", pieces=pieces)["sha"] == expected_sha(kv, src, dst), f"request {r}"
        got = decode.call(op="read", addr=d_aux + r * AUX_BYTES, len=AUX_BYTES)["hex"]
        assert got == aux[r * AUX_BYTES:(r + 1) * AUX_BYTES].tobytes().hex()

    assert engine.unregister_memory(aux.ctypes.data) == 0
    assert engine.batch_unregister_memory([b.ctypes.data for b in kv]) == 0
    decode.close()
    assert engine.send_probe(session) == -102, "the decode engine is gone"
    engine.close()


def test_vllm_connector_subset(transport, peer_factory):
    decode = peer_factory()
    info = decode.call(op="init", host="127.0.0.1", protocol="rdma")
    assert info["rc"] == 0
    session = info["session"]
    d_kv = decode.call(op="alloc", sizes=[PAGES * PAGE_BYTES] * (2 * LAYERS))["addrs"]

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", DEVICE) == 0
    assert engine.get_rpc_port() > 0
    kv = make_kv(seed=200)
    ptrs = [b.ctypes.data for b in kv]
    assert engine.batch_register_memory(ptrs, [b.nbytes for b in kv]) == 0

    def request(seed):
        r = np.random.default_rng(seed)
        n = int(r.integers(1, 512))
        src = r.choice(PAGES, n, replace=False)
        dst = r.choice(PAGES, n, replace=False)
        return src.tolist(), dst.tolist()

    reqs = [request(s) for s in range(3)]
    # disjoint destinations, so each request's bytes can be checked
    used, disjoint = set(), []
    for src, dst in reqs:
        keep = [(s, d) for s, d in zip(src, dst) if d not in used]
        used.update(d for _, d in keep)
        disjoint.append(([s for s, _ in keep], [d for _, d in keep]))

    def send(req):
        src, dst = req
        srcs = [ptrs[layer] + s * PAGE_BYTES for layer in range(2 * LAYERS) for s in src]
        dsts = [d_kv[layer] + d * PAGE_BYTES for layer in range(2 * LAYERS) for d in dst]
        return engine.batch_transfer_sync_write(session, srcs, dsts, [PAGE_BYTES] * len(srcs))  # one call

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(send, disjoint)) == [0, 0, 0]
    assert sum(len(s) for s, _ in disjoint) * 2 * LAYERS > 1024
    for src, dst in disjoint:
        pieces = [[d_kv[layer] + d * PAGE_BYTES, PAGE_BYTES] for layer in range(2 * LAYERS) for d in dst]
        assert decode.call(op="sha", pieces=pieces)["sha"] == expected_sha(kv, src, dst)
    assert engine.batch_unregister_memory(ptrs) == 0
    decode.close()
    engine.close()


def test_rdma_protocol_picks_verbs_where_a_port_is_active(monkeypatch):
    import mooncake.engine as me

    if not me._active_rdma_port():
        pytest.skip("no ACTIVE RDMA port on this host (the Soft-RoCE guest has one)")
    monkeypatch.delenv("KVWIRE_MOONCAKE_TRANSPORT", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", DEVICE) == 0
    assert e._transport == "verbs"
    e.close()
