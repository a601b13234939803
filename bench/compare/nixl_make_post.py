"""make_prepped_xfer + transfer cost per descriptor, from Python, through
kvwire's `nixl` package (issue 13's target: <= 100 ns/desc at 65,536
descriptors).

Two agents in one process over shm (NIXL_MP_BACKEND, default KVWIRE_SHM),
65,536 pages of 4 KiB scattered by a permutation, WRITE with a notification,
as bench/compare/nixl_api_bench.py does. Each rep times, on the calling
thread:

  make   agent.make_prepped_xfer(...)        (int32 index arrays)
  post   agent.transfer(handle)
  rust   the same two steps straight on the Rust core (NixlCore.make/.post),
         i.e. without the Python wrapper

as CPU time of the calling thread (and its minor page faults) (time.thread_time_ns: the machine's load
inflates it far less than wall time, which includes waiting for a core while
the copy threads run) and as wall time. Prints one JSON line: min and median
ns/desc of each over NIXL_MP_REPS reps (default 15), and the load average.
NIXL_MP_CHURN=1 allocates and frees 256 MiB between reps, as
nixl_api_bench.py's refill does, so the allocator returns memory to the
kernel and fresh allocations in make/post fault their pages in again.

    python bench/compare/nixl_make_post.py
"""

import json
import os
import resource
import statistics
import time
import uuid

import numpy as np

from nixl._api import nixl_agent, nixl_agent_config

N = int(os.environ.get("NIXL_MP_DESCS", "65536"))
PAGE = int(os.environ.get("NIXL_MP_PAGE", "4096"))
REPS = int(os.environ.get("NIXL_MP_REPS", "15"))
BACKEND = os.environ.get("NIXL_MP_BACKEND", "KVWIRE_SHM")
CHURN = os.environ.get("NIXL_MP_CHURN", "0") == "1"


def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def wait(agent, h):
    while agent.check_xfer_state(h) != "DONE":
        pass


def main():
    tgt = nixl_agent("tgt-" + uuid.uuid4().hex[:8], nixl_agent_config(backends=[BACKEND]))
    ini = nixl_agent("ini-" + uuid.uuid4().hex[:8], nixl_agent_config(backends=[BACKEND]))
    size = N * PAGE
    tbuf, ibuf = np.zeros(size, np.uint8), np.ones(size, np.uint8)
    tgt.register_memory([(tbuf.ctypes.data, size, 0, "")], "DRAM")
    ini.register_memory([(ibuf.ctypes.data, size, 0, "")], "DRAM")
    peer = ini.add_remote_agent(tgt.get_agent_metadata()).decode()
    tgt.add_remote_agent(ini.get_agent_metadata())
    perm = np.random.default_rng(1).permutation(N).astype(np.uint64)
    loc = np.zeros((N, 3), np.uint64)
    loc[:, 0] = ibuf.ctypes.data + np.arange(N, dtype=np.uint64) * PAGE
    loc[:, 1] = PAGE
    rem = np.zeros((N, 3), np.uint64)
    rem[:, 0] = tbuf.ctypes.data + perm * PAGE
    rem[:, 1] = PAGE
    lh = ini.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM")
    rh = ini.prep_xfer_dlist(peer, rem, "DRAM")
    idx = np.arange(N, dtype=np.int32)
    core = ini.agent._core
    idx64 = idx.astype("<i8").tobytes()
    cpu = {"make": [], "post": [], "rust_make": [], "rust_post": []}
    wall = {k: [] for k in cpu}
    flt = []
    for rep in range(REPS):
        if CHURN:
            junk = np.random.default_rng(rep).bytes(256 << 20)
            del junk
        # the API path
        f0 = faults()
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        h = ini.make_prepped_xfer("WRITE", lh, idx, rh, idx, b"bench")
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        ini.transfer(h)
        w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        flt.append(faults() - f0)
        wait(ini, h)
        ini.release_xfer_handle(h)
        cpu["make"].append((c1 - c0) / N)
        cpu["post"].append((c2 - c1) / N)
        wall["make"].append((w1 - w0) / N)
        wall["post"].append((w2 - w1) / N)
        # the Rust core alone
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        r = core.make("WRITE", lh._handle, idx64, rh._handle, idx64, b"bench")
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        core.post(r, None)
        w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        while core.state(r) != 0:
            pass
        core.release(r)
        cpu["rust_make"].append((c1 - c0) / N)
        cpu["rust_post"].append((c2 - c1) / N)
        wall["rust_make"].append((w1 - w0) / N)
        wall["rust_post"].append((w2 - w1) / N)
    assert tbuf[int(perm[0]) * PAGE] == 1, "WRITE did not land"
    out = {"descs": N, "page": PAGE, "backend": BACKEND, "reps": REPS, "churn": CHURN, "loadavg": os.getloadavg(),
           "make_post_faults_median": statistics.median(flt)}
    for kind, d in (("cpu", cpu), ("wall", wall)):
        for k, v in d.items():
            out[f"{kind}_{k}_min"] = round(min(v), 1)
            out[f"{kind}_{k}_median"] = round(statistics.median(v), 1)
    out["cpu_make_post_min"] = round(min(a + b for a, b in zip(cpu["make"], cpu["post"])), 1)
    out["cpu_make_post_median"] = round(statistics.median(a + b for a, b in zip(cpu["make"], cpu["post"])), 1)
    out["wall_make_post_median"] = round(statistics.median(a + b for a, b in zip(wall["make"], wall["post"])), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
