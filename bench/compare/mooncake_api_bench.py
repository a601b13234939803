#!/usr/bin/env python3
"""The same Mooncake-API benchmark for the real Mooncake wheel
(mooncake-transfer-engine-non-cuda) and kvwire's `mooncake` package.

Written against `mooncake.engine.TransferEngine` only. Two processes: a
target that registers BYTES and answers fill/sha commands on stdin, and this
initiator, which moves all of it as pages of 4 KiB, 64 KiB and 1 MiB
scattered by a permutation with batch_transfer_sync_write and
batch_transfer_sync_read, and verifies the bytes (sha256 of the target's
buffer against the expected permutation after a WRITE; the read-back buffer
against the target's known contents after a READ). Reports GB/s (best of
REPS, and the median of REPS as `gbps_median`) and the calling thread's
CPU time per page of the best call.

The target is started as `$MC_BENCH_TARGET_PREFIX python this --target`
(e.g. `ip netns exec A`), so the two can sit in different network
namespaces; its sessions are P2PHANDSHAKE.

Env: MC_BENCH_HOST (this side's local_hostname, default 127.0.0.1),
MC_BENCH_TARGET_HOST (the target's, default MC_BENCH_HOST),
MC_BENCH_PROTOCOL (default tcp), MC_BENCH_BYTES (default 256 MiB),
MC_BENCH_REPS (timed calls, default 3), MC_BENCH_WARMUP (untimed calls
before them, default 2, as `kvwire bench --warmup`), MC_BENCH_BATCH (descriptors per call, 0 = all in
one call; default 0), MC_BENCH_PAGES (comma list, default 4096,65536,1048576),
MC_BENCH_TARGET_PREFIX, MC_BENCH_TARGET_MEMORY (`numpy`, the default: the
target registers a numpy array by address, as SGLang registers its
tensors; `managed`: the target's buffer comes from
`allocate_managed_buffer`), MC_BENCH_ALIGN (bytes the numpy buffers'
start is aligned to, default 4096: a page, as kvwire's Rust path's buffers,
pinned host memory and mmap'd memory are; 0 keeps numpy's own alignment,
16 bytes past a page for large arrays, which costs kernel copies — tcp,
cross-memory attach — up to a third at 4 KiB pages on the 2-vCPU VM of
docs/PERFORMANCE.md). Prints one JSON object on stdout.
"""

import ctypes
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np

BYTES = int(os.environ.get("MC_BENCH_BYTES", str(256 << 20)))
REPS = int(os.environ.get("MC_BENCH_REPS", "3"))
WARMUP = int(os.environ.get("MC_BENCH_WARMUP", "2"))
BATCH = int(os.environ.get("MC_BENCH_BATCH", "0"))
PAGES = [int(p) for p in os.environ.get("MC_BENCH_PAGES", "4096,65536,1048576").split(",")]
PROTOCOL = os.environ.get("MC_BENCH_PROTOCOL", "tcp")
HOST = os.environ.get("MC_BENCH_HOST", "127.0.0.1")
TARGET_HOST = os.environ.get("MC_BENCH_TARGET_HOST", HOST)
TARGET_MEMORY = os.environ.get("MC_BENCH_TARGET_MEMORY", "numpy")
ALIGN = int(os.environ.get("MC_BENCH_ALIGN", "4096"))


def zeros(n):
    """`n` zero bytes as a numpy array whose start is aligned to ALIGN."""
    if ALIGN <= 1:
        return np.zeros(n, np.uint8)
    raw = np.zeros(n + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + n]


def engine(host):
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize(host, "P2PHANDSHAKE", PROTOCOL, "")
    if rc != 0:
        raise SystemExit(f"initialize({host!r}) returned {rc}")
    return e


def content(seed):
    return np.frombuffer(np.random.default_rng(seed).bytes(BYTES), np.uint8)


def run_target():
    e = engine(TARGET_HOST)
    if TARGET_MEMORY == "managed":
        addr = e.allocate_managed_buffer(BYTES)
        if addr == 0:
            raise SystemExit("target allocate_managed_buffer failed")
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * BYTES).from_address(addr))
    elif TARGET_MEMORY == "numpy":
        buf = zeros(BYTES)
        if e.register_memory(buf.ctypes.data, BYTES) != 0:
            raise SystemExit("target register_memory failed")
    else:
        raise SystemExit(f"MC_BENCH_TARGET_MEMORY={TARGET_MEMORY!r}: numpy or managed")
    session = f"{TARGET_HOST}:{e.get_rpc_port()}"
    print(json.dumps({"session": session, "addr": buf.ctypes.data}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "fill":
            buf[:] = content(cmd["seed"]) if cmd["seed"] is not None else 0
            out = {}
        elif cmd["op"] == "sha":
            out = {"sha": hashlib.sha256(buf).hexdigest()}
        else:
            break
        print(json.dumps(out), flush=True)


class Target:
    def __init__(self):
        prefix = shlex.split(os.environ.get("MC_BENCH_TARGET_PREFIX", ""))
        self.proc = subprocess.Popen(prefix + [sys.executable, os.path.abspath(__file__), "--target"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline())
        self.session, self.addr = hello["session"], hello["addr"]

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("target died")
        return json.loads(line)

    def close(self):
        try:
            self.call(op="exit")
        except (SystemExit, BrokenPipeError, ValueError):
            pass
        self.proc.kill()
        self.proc.wait()


def moved(e, fn, session, locals_, remotes, page):
    """One batch op over all pages, in calls of BATCH descriptors; returns
    (seconds, caller CPU seconds)."""
    n = len(locals_)
    step = BATCH or n
    lens = [page] * min(step, n)
    # One call over all pages passes the lists as they are, as an engine
    # passes the lists it built: a slice would copy them and touch every int
    # object inside the timed part (the benchmark's work, not the engine's).
    calls = [(locals_, remotes, lens)] if step >= n else [
        (locals_[i:i + step], remotes[i:i + step], lens[:min(step, n - i)]) for i in range(0, n, step)]
    t, c = time.perf_counter(), time.thread_time()
    for a, b, k in calls:
        rc = getattr(e, fn)(session, a, b, k)
        if rc != 0:
            raise SystemExit(f"{fn} returned {rc} (page {page})")
    return time.perf_counter() - t, time.thread_time() - c


def main():
    import mooncake.engine as me

    impl = "kvwire" if getattr(me, "KVWIRE", False) else "mooncake"
    e = engine(HOST)
    src = zeros(BYTES)
    back = zeros(BYTES)
    for a in (src, back):
        if e.register_memory(a.ctypes.data, BYTES) != 0:
            raise SystemExit("register_memory failed")
    tgt = Target()
    results = []
    try:
        for page in PAGES:
            n = BYTES // page
            perm = np.random.default_rng(page).permutation(n)
            srcs = [src.ctypes.data + i * page for i in range(n)]
            backs = [back.ctypes.data + i * page for i in range(n)]
            dsts = [tgt.addr + int(p) * page for p in perm]
            for op in ("WRITE", "READ"):
                # As `kvwire bench` runs: the same bytes, WARMUP untimed calls,
                # then REPS timed calls back to back, the bytes verified after
                # the last (a call that returns nonzero stops the run).
                seed = page * 10 + (op == "READ")
                if op == "WRITE":
                    src[:] = content(seed)
                    tgt.call(op="fill", seed=None)
                    fn, locs = "batch_transfer_sync_write", srcs
                else:
                    tgt.call(op="fill", seed=seed)
                    back[:] = 0
                    fn, locs = "batch_transfer_sync_read", backs
                for _ in range(WARMUP):
                    moved(e, fn, tgt.session, locs, dsts, page)
                best, cpu, times = None, None, []
                for _ in range(REPS):
                    dt, ct = moved(e, fn, tgt.session, locs, dsts, page)
                    times.append(dt)
                    if best is None or dt < best:
                        best, cpu = dt, ct
                if op == "WRITE":
                    expect = np.empty_like(src).reshape(n, page)
                    expect[perm] = src.reshape(n, page)
                    ok = tgt.call(op="sha")["sha"] == hashlib.sha256(expect).hexdigest()
                else:
                    ok = bool((back.reshape(n, page) == content(seed).reshape(n, page)[perm]).all())
                if not ok:
                    raise SystemExit(f"{op} page {page}: bytes differ")
                results.append({"page": page, "op": op, "gbps": round(BYTES / best / 1e9, 3),
                                "gbps_median": round(BYTES / statistics.median(times) / 1e9, 3),
                                "seconds": round(best, 4), "calls": -(-n // (BATCH or n)),
                                "caller_cpu_ns_per_page": round(cpu / n * 1e9, 1)})
                print(f"{impl:8} {page:>8} {op:5} {BYTES / best / 1e9:7.3f} GB/s", file=sys.stderr, flush=True)
    finally:
        tgt.close()
    print(json.dumps({"impl": impl, "transport": getattr(e, "_transport", None) or PROTOCOL, "protocol": PROTOCOL,
                      "host": HOST, "target_host": TARGET_HOST, "target_memory": TARGET_MEMORY, "align": ALIGN, "bytes": BYTES, "reps": REPS, "warmup": WARMUP, "batch": BATCH,
                      "results": results}))


if __name__ == "__main__":
    if "--target" in sys.argv:
        run_target()
    else:
        main()
