#!/usr/bin/env python3
"""Start-up and registration through NIXL's Python API, for real NIXL
(nixl-cu12) and kvwire's `nixl` (issue 29). One JSON line:

- `create_ms`: `nixl_agent(name, config(backends=[B]))` wall time (median of
  5, each a fresh agent in this process);
- `concurrent16_ms`: 16 processes, each with its imports done, create one
  agent at the same instant: time from that instant until the last is ready;
- `register_1265_ms`: vLLM's shape, 1,265 tensors carved out of 4 allocations
  (per layer K and V views of 4 buffers of 64 MiB), one `register_memory`
  call per tensor, wall time; `register_1265_list_ms`: the same 1,265 in
  one `register_memory(list)` call (vLLM's `register_kv_caches` registers
  its `caches_data` list at once), wall time;
- `reg_cycles_us_first100` / `_last100`: 1,000 register/deregister cycles of
  one 1 MiB buffer, µs per cycle over the first and the last 100.

Env: NIXL_BENCH_MODULE (default `nixl`; `nixl_cu12` for the bare wheel),
NIXL_BENCH_BACKEND (default UCX).
"""

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

MOD = os.environ.get("NIXL_BENCH_MODULE", "nixl")
BACKEND = os.environ.get("NIXL_BENCH_BACKEND", "UCX")


def api():
    return importlib.import_module(MOD + "._api")


def agent(a):
    return a.nixl_agent("s-" + str(uuid.uuid4()), a.nixl_agent_config(backends=[BACKEND]))


def child():
    go = float(sys.argv[2])
    a = api()  # imports done before the common start time
    time.sleep(max(0.0, go - time.time()))
    agent(a)
    print(json.dumps({"ready_s": time.time() - go}), flush=True)
    os._exit(0)


def main():
    a = api()
    agent(a)  # warm: imports, plugin loading
    times = []
    for _ in range(5):
        t = time.perf_counter()
        agent(a)
        times.append((time.perf_counter() - t) * 1e3)
    create_ms = statistics.median(times)

    go = time.time() + 8.0  # every child has imported by then; all create at once
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(go)], stdout=subprocess.PIPE, text=True)
             for _ in range(16)]
    ready = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        ready.append(json.loads(out.strip().splitlines()[-1])["ready_s"])
    concurrent_ms = max(ready) * 1e3

    g = agent(a)
    bufs = [np.zeros(64 << 20, np.uint8) for _ in range(4)]
    n, layers = 0, []
    per = 1265 // 4 + 1
    for b in bufs:
        step = b.nbytes // per
        for i in range(per):
            if n == 1265:
                break
            layers.append((b.ctypes.data + i * step, step, 0, ""))
            n += 1
    t = time.perf_counter()
    regs = [g.register_memory([x], "DRAM") for x in layers]
    register_ms = (time.perf_counter() - t) * 1e3
    for r in regs:
        g.deregister_memory(r)
    t = time.perf_counter()
    lst = g.register_memory(layers, "DRAM")
    register_list_ms = (time.perf_counter() - t) * 1e3
    g.deregister_memory(lst)

    one = np.zeros(1 << 20, np.uint8)
    cyc = []
    for _ in range(1000):
        t = time.perf_counter()
        r = g.register_memory([(one.ctypes.data, one.nbytes, 0, "")], "DRAM")
        g.deregister_memory(r)
        cyc.append((time.perf_counter() - t) * 1e6)
    print(json.dumps({
        "module": MOD, "backend": BACKEND, "interfaces": len(os.listdir("/sys/class/net")),
        "create_ms": round(create_ms, 2), "concurrent16_ms": round(concurrent_ms, 1),
        "register_1265_ms": round(register_ms, 2),
        "register_1265_list_ms": round(register_list_ms, 2),
        "reg_cycles_us_first100": round(statistics.mean(cyc[:100]), 1),
        "reg_cycles_us_last100": round(statistics.mean(cyc[-100:]), 1),
    }))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
    else:
        main()
