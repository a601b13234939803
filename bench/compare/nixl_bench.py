#!/usr/bin/env python3
"""The kvwire bench workload through NIXL's Python API, as a NIXL user runs it.

Two processes on this host: this one (the initiator) starts a target with
`--role target` and talks to it over a loopback side channel
(multiprocessing.connection), the way an inference engine exchanges NIXL agent
metadata out of band. Both register one host (DRAM) buffer of
`blocks x block_size` bytes with the UCX backend; the initiator loads the
target's agent metadata, prepares a descriptor list over every local page and
every remote page once (`prep_xfer_dlist`), and then, per transfer, makes one
request over the batch of page indices (`make_prepped_xfer`, local page i ->
remote page perm[i]), posts it (`transfer`, with a notification as a KV
connector does), polls `check_xfer_state` until DONE and releases it. Every byte
is verified at the end (by the target for WRITE, locally for READ). The UCX
transport is whatever `UCX_TLS` says (inherited by the target).

Prints one JSON object with the same keys as `kvwire bench --json`, plus NIXL
specifics (prep cost, make/post split, UCX_TLS).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from multiprocessing.connection import Client, Listener

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pattern import expected_pages, fill_pages, permutation  # noqa: E402

AUTH = b"kvwire-compare"


def import_nixl():
    try:
        import nixl_cu12 as nixl  # the wheel's module name
    except ImportError:
        import nixl  # the meta package, or a source build
    return nixl


def host_buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous, page-aligned, pre-faulted memory (as a KV pool would be)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::4096] = 0  # fault every page in now, outside any timed region
    return m, a


def make_agent(nixl, name: str, prog_thread: bool, err_mode: str):
    conf = nixl.nixl_agent_config(enable_prog_thread=prog_thread, backends=[])
    agent = nixl.nixl_agent(name, conf)
    params = {}
    if err_mode:
        # UCX's shared-memory transports (sysv, posix, self) have no peer
        # failure handler, so NIXL's default "peer" mode rules them out.
        params["ucx_error_handling_mode"] = err_mode
    agent.create_backend("UCX", params)
    return agent


def register(agent, buf: np.ndarray):
    addr = buf.ctypes.data
    return agent.register_memory([(addr, buf.nbytes, 0, "")], "DRAM")


def page_dlist(base: int, block_size: int, blocks: int) -> np.ndarray:
    d = np.empty((blocks, 3), dtype=np.uint64)
    d[:, 0] = base + np.arange(blocks, dtype=np.uint64) * np.uint64(block_size)
    d[:, 1] = block_size
    d[:, 2] = 0
    return d


def wait_done(agent, h, first: str, deadline_s: float = 120.0):
    st = first
    t_end = time.monotonic() + deadline_s
    while st == "PROC":
        st = agent.check_xfer_state(h)
        if time.monotonic() > t_end:
            raise RuntimeError("transfer did not finish in 120 s")
    if st != "DONE":
        raise RuntimeError(f"transfer failed: {st}")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# ---------------------------------------------------------------- target


def run_target(a) -> int:
    nixl = import_nixl()
    conn = Client(("127.0.0.1", a.port), authkey=AUTH)
    setup = conn.recv()
    bs, n = setup["block_size"], setup["blocks"]
    agent = make_agent(nixl, "nixl-bench-target", a.prog_thread, a.ucx_err_mode)
    _m, buf = host_buffer(bs * n)
    if setup["op"] == "read":
        fill_pages(buf, bs, n, setup["seed"])
    register(agent, buf)
    conn.send({"meta": agent.get_agent_metadata(), "base": buf.ctypes.data})
    notifs = 0
    while True:
        if not a.prog_thread:
            # Without NIXL's progress thread nobody else drives the target's
            # UCX worker: poll it while waiting, as such a user must.
            while not conn.poll(0):
                for v in agent.get_new_notifs().values():
                    notifs += len(v)
        msg = conn.recv()
        if msg["cmd"] == "verify":
            # Drain the per-transfer notifications the initiator attached.
            t_end = time.monotonic() + 10
            while notifs < msg["notifications"] and time.monotonic() < t_end:
                for v in agent.get_new_notifs().values():
                    notifs += len(v)
            bad = 0
            if setup["op"] == "write":
                perm = permutation(n, setup["seed"]) if setup["scatter"] else np.arange(n)
                got = buf.view(np.uint64).reshape(n, -1)[perm]
                want = expected_pages(bs, n, setup["seed"])
                bad = int(np.count_nonzero((got != want).any(axis=1)))
            conn.send({"bad_blocks": bad, "notifications": notifs})
        elif msg["cmd"] == "exit":
            conn.send("bye")
            return 0


# ------------------------------------------------------------- initiator


def run_initiator(a) -> dict:
    nixl = import_nixl()
    bs, n = a.block_size, a.blocks
    total = bs * n
    listener = Listener(("127.0.0.1", 0), authkey=AUTH)
    port = listener.address[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "target", "--port", str(port)]
    if not a.prog_thread:
        cmd.append("--no-prog-thread")
    if a.ucx_err_mode:
        cmd += ["--ucx-err-mode", a.ucx_err_mode]
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        conn = listener.accept()
        conn.send({"op": a.op, "block_size": bs, "blocks": n, "seed": a.seed, "scatter": a.scatter})
        agent = make_agent(nixl, "nixl-bench-initiator", a.prog_thread, a.ucx_err_mode)
        _m, buf = host_buffer(total)
        if a.op == "write":
            fill_pages(buf, bs, n, a.seed)
        register(agent, buf)
        hello = conn.recv()
        remote = agent.add_remote_agent(hello["meta"])
        perm = permutation(n, a.seed) if a.scatter else np.arange(n, dtype=np.int64)

        # Prepare both sides once, over every page (what a KV connector does at
        # connect time), timed as the one-off cost.
        t0 = time.perf_counter_ns()
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", page_dlist(buf.ctypes.data, bs, n), "DRAM")
        remote_h = agent.prep_xfer_dlist(remote, page_dlist(hello["base"], bs, n), "DRAM")
        prep_ns = time.perf_counter_ns() - t0
        local_idx = np.arange(n, dtype=np.int32)
        remote_idx = perm.astype(np.int32)
        op = a.op.upper()

        lat_us, prep_post_ns, make_ns, post_ns = [], [], [], []
        moved_ns = 0
        iters = a.warmup + a.iters
        for it in range(iters):
            if a.op == "read" and it + 1 == iters:
                buf[:] = 0  # the last READ must really land every byte
            t0 = time.perf_counter_ns()
            h = agent.make_prepped_xfer(op, local_h, local_idx, remote_h, remote_idx, f"iter-{it}".encode())
            t1 = time.perf_counter_ns()
            st = agent.transfer(h)
            t2 = time.perf_counter_ns()
            wait_done(agent, h, st)
            t3 = time.perf_counter_ns()
            agent.release_xfer_handle(h)
            if it >= a.warmup:
                lat_us.append((t3 - t0) / 1e3)
                prep_post_ns.append((t2 - t0) / n)
                make_ns.append((t1 - t0) / n)
                post_ns.append((t2 - t1) / n)
                moved_ns += t3 - t0

        bad_local = 0
        if a.op == "read":
            got = buf.view(np.uint64).reshape(n, -1)
            want = expected_pages(bs, n, a.seed)[perm]
            bad_local = int(np.count_nonzero((got != want).any(axis=1)))

        # The combined API (createXferReq: prep x2 + make in one call, no
        # reuse), timed once over the same pages; not posted.
        remote_pages = page_dlist(hello["base"], bs, n)[perm]
        t0 = time.perf_counter_ns()
        h = agent.initialize_xfer(
            op,
            agent.get_xfer_descs(page_dlist(buf.ctypes.data, bs, n), "DRAM"),
            agent.get_xfer_descs(remote_pages, "DRAM"),
            remote,
        )
        init_ns = time.perf_counter_ns() - t0
        agent.release_xfer_handle(h)

        page_lat = []
        for i in range(a.lat_iters):
            k = i % n
            t0 = time.perf_counter_ns()
            h = agent.make_prepped_xfer(op, local_h, local_idx[k : k + 1], remote_h, remote_idx[k : k + 1])
            wait_done(agent, h, agent.transfer(h))
            page_lat.append((time.perf_counter_ns() - t0) / 1e3)
            agent.release_xfer_handle(h)

        conn.send({"cmd": "verify", "notifications": iters})
        ver = conn.recv()
        conn.send({"cmd": "exit"})
        conn.recv()
        backend = "UCX"
        agent.release_dlist_handle(local_h)
        agent.release_dlist_handle(remote_h)
    finally:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        listener.close()

    gb = total * a.iters / moved_ns if moved_ns else 0.0
    return {
        "system": "nixl",
        "transport": "nixl-ucx",
        "ucx_tls": os.environ.get("UCX_TLS", ""),
        "backend": backend,
        "nixl_version": nixl_version(),
        "prog_thread": a.prog_thread,
        "ucx_error_handling_mode": a.ucx_err_mode or "peer (default)",
        "op": a.op,
        "block_size": bs,
        "blocks": n,
        "bytes_per_transfer": total,
        "iters": a.iters,
        "scatter": a.scatter,
        "gb_per_s": gb,
        "p50_us": pct(lat_us, 0.5),
        "p99_us": pct(lat_us, 0.99),
        "post_ns_per_block": pct(prep_post_ns, 0.5),
        "make_ns_per_block": pct(make_ns, 0.5),
        "transfer_call_ns_per_block": pct(post_ns, 0.5),
        "prep_dlist_ns_per_desc": prep_ns / (2 * n),
        "initialize_xfer_ns_per_block": init_ns / n,
        "page_p50_us": pct(page_lat, 0.5),
        "page_p99_us": pct(page_lat, 0.99),
        "notifications": ver["notifications"],
        "verified": bad_local == 0 and ver["bad_blocks"] == 0,
        "bad_blocks": bad_local + ver["bad_blocks"],
    }


def nixl_version() -> str:
    try:
        from importlib.metadata import version

        return version("nixl-cu12")
    except Exception:
        return "unknown"


def parse_size(s: str) -> int:
    s = s.strip()
    for suf, mul in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("K", 1 << 10), ("M", 1 << 20)):
        if s.endswith(suf):
            return int(s[: -len(suf)]) * mul
    return int(s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["initiator", "target"], default="initiator")
    p.add_argument("--port", type=int, default=0, help="(target) side channel port")
    p.add_argument("--op", choices=["write", "read"], default="write")
    p.add_argument("--block-size", type=parse_size, default=64 << 10)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lat-iters", type=int, default=200)
    p.add_argument("--scatter", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--no-prog-thread",
        dest="prog_thread",
        action="store_false",
        help="disable NIXL's progress thread (nixl_agent_config default: on)",
    )
    p.add_argument(
        "--ucx-err-mode",
        default="",
        help="UCX backend ucx_error_handling_mode (NIXL default 'peer'; 'none' is needed for sysv/posix shm)",
    )
    p.add_argument("--json", action="store_true", help="(accepted for symmetry; output is always JSON)")
    a = p.parse_args()
    if a.role == "target":
        return run_target(a)
    r = run_initiator(a)
    print(json.dumps(r))
    return 0 if r["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
