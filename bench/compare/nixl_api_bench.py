#!/usr/bin/env python3
"""The same NIXL-API benchmark for real NIXL (nixl-cu12) and kvwire's `nixl`.

Two processes on one host: a target that registers BYTES of memory and spins
on `get_new_notifs`, and an initiator that moves all of it as pages of 4 KiB
64 KiB and 1 MiB scattered by a permutation, WRITE and READ, with a notification,
and verifies the bytes (sha256 of the target's buffer vs the expected
permutation). Reports GB/s, `prep_xfer_dlist` ns/desc, `make_prepped_xfer` +
`transfer` ns/desc (wall, and CPU time and minor page faults of the calling
thread), and one-page (4 KiB WRITE) latency p50/p99.

Env: NIXL_BENCH_MODULE (default `nixl`; `nixl_cu12` for the bare wheel),
NIXL_BENCH_BACKEND (default UCX), NIXL_BENCH_PARAMS (JSON backend init params),
NIXL_BENCH_BYTES (default 256 MiB), NIXL_BENCH_REPS (default 3, best of),
NIXL_BENCH_PAGES (default 4096,65536,1048576).
Prints one JSON object on stdout.
"""

import hashlib
import importlib
import json
import multiprocessing as mp
import os
import resource
import sys
import time
import uuid

import numpy as np

MOD = os.environ.get("NIXL_BENCH_MODULE", "nixl")
BACKEND = os.environ.get("NIXL_BENCH_BACKEND", "UCX")
PARAMS = json.loads(os.environ.get("NIXL_BENCH_PARAMS", "{}"))
BYTES = int(os.environ.get("NIXL_BENCH_BYTES", str(256 << 20)))
REPS = int(os.environ.get("NIXL_BENCH_REPS", "3"))
PAGES = [int(p) for p in os.environ.get("NIXL_BENCH_PAGES", "4096,65536,1048576").split(",")]


def api():
    return importlib.import_module(MOD + "._api")


def make_agent(name):
    a = api()
    agent = a.nixl_agent(name, a.nixl_agent_config(backends=[]))
    agent.create_backend(BACKEND, dict(PARAMS))
    return agent


def target(conn):
    agent = make_agent("target-" + uuid.uuid4().hex[:8])
    buf = np.zeros(BYTES, np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, BYTES, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), buf.ctypes.data, agent.name))
    agent.add_remote_agent(conn.recv())
    while True:
        agent.get_new_notifs()  # a spinning target
        if conn.poll():
            cmd = conn.recv()
            if cmd[0] == "fill":
                buf[:] = np.frombuffer(np.random.default_rng(cmd[1]).bytes(BYTES), np.uint8)
                conn.send(True)
            elif cmd[0] == "sha":
                conn.send(hashlib.sha256(buf).hexdigest())
            elif cmd[0] == "exit":
                conn.send(True)
                os._exit(0)  # real NIXL may crash in its exit handlers (after the work)


def main():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    proc.start()
    md, raddr, tname = parent.recv()
    agent = make_agent("init-" + uuid.uuid4().hex[:8])
    buf = np.zeros(BYTES, np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, BYTES, 0, "")], "DRAM"))
    peer = agent.add_remote_agent(md)
    parent.send(agent.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    out = {"module": MOD, "backend": BACKEND, "params": PARAMS, "bytes": BYTES,
           "ucx_tls": os.environ.get("UCX_TLS", ""), "results": []}
    for page in PAGES:
        n = BYTES // page
        perm = np.random.default_rng(page).permutation(n)
        loc = np.zeros((n, 3), np.uint64)
        loc[:, 0] = buf.ctypes.data + np.arange(n, dtype=np.uint64) * page
        loc[:, 1] = page
        rem = np.zeros((n, 3), np.uint64)
        rem[:, 0] = raddr + perm.astype(np.uint64) * page
        rem[:, 1] = page
        t0 = time.perf_counter_ns()
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM")
        rh = agent.prep_xfer_dlist(peer, rem, "DRAM")
        prep_ns = (time.perf_counter_ns() - t0) / (2 * n)
        idx = np.arange(n, dtype=np.int32)
        for op in ("WRITE", "READ"):
            best_gbps, best_make, best_cpu, faults = 0.0, float("inf"), float("inf"), []
            for rep in range(REPS):
                seed = page * 10 + rep
                if op == "WRITE":
                    buf[:] = np.frombuffer(np.random.default_rng(seed).bytes(BYTES), np.uint8)
                else:
                    parent.send(("fill", seed))
                    parent.recv()
                    buf[:] = 0
                f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                h = agent.make_prepped_xfer(op, lh, idx, rh, idx, b"bench")
                st = agent.transfer(h)
                t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
                while st != "DONE":
                    st = agent.check_xfer_state(h)
                    if st == "ERR":
                        raise RuntimeError("transfer failed")
                t2 = time.perf_counter_ns()
                agent.release_xfer_handle(h)
                best_make = min(best_make, (t1 - t0) / n)
                best_cpu = min(best_cpu, (c1 - c0) / n)
                best_gbps = max(best_gbps, BYTES / (t2 - t0))
                src = np.frombuffer(np.random.default_rng(seed).bytes(BYTES), np.uint8)
                if op == "WRITE":
                    expect = np.empty_like(src)
                    expect.reshape(n, page)[perm] = src.reshape(n, page)
                    parent.send(("sha",))
                    assert parent.recv() == hashlib.sha256(expect).hexdigest(), "WRITE bytes differ"
                else:
                    assert np.array_equal(buf.reshape(n, page), src.reshape(n, page)[perm]), "READ bytes differ"
            out["results"].append({"page": page, "op": op, "descs": n, "gbps": round(best_gbps, 3),
                                   "prep_ns_per_desc": round(prep_ns, 1),
                                   "make_post_ns_per_desc": round(best_make, 1),
                                   "make_post_cpu_ns_per_desc": round(best_cpu, 1),
                                   "make_post_page_faults": faults})
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
    # one-page latency: 4 KiB WRITE, make + transfer + poll to DONE
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[buf.ctypes.data, 4096, 0]], np.uint64), "DRAM")
    rh = agent.prep_xfer_dlist(peer, np.array([[raddr, 4096, 0]], np.uint64), "DRAM")
    h = agent.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    lat = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        st = agent.transfer(h)
        while st != "DONE":
            st = agent.check_xfer_state(h)
        lat.append(time.perf_counter_ns() - t0)
    lat = np.array(lat[200:]) / 1000.0
    out["latency_us"] = {"p50": round(float(np.percentile(lat, 50)), 2), "p99": round(float(np.percentile(lat, 99)), 2)}
    parent.send(("exit",))
    parent.recv()
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
