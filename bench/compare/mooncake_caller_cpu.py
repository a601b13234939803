#!/usr/bin/env python3
"""Caller CPU per page of kvwire's `mooncake` package for one
`batch_transfer_sync_write` of 65,536 4 KiB pages (issue 25's "≤ 100 ns/page
of caller CPU above the copy"), split into its parts, in one process with two
engines on one host (shm under protocol "tcp"), interleaved rounds:

- lists → descriptors: `create_scattered` (lists read straight into the
  core's descriptors) beside the array path (`array.array` → numpy rows →
  `create`), the same request either way, released unposted;
- the whole call (`time.thread_time()` of the calling thread: conversion,
  checks, post and the wait; the copy runs on kvwire's threads).

Usage: python bench/compare/mooncake_caller_cpu.py [ROUNDS]  (venv of
scripts/mooncake-tests.sh). Prints medians and every round as JSON.
"""
import json
import statistics
import sys
import time

import numpy as np

from mooncake import engine as me

N, PAGE = 65536, 4096
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7


def per_page(f):
    c = time.thread_time()
    f()
    return (time.thread_time() - c) / N * 1e9


def main():
    a, b = me.TransferEngine(), me.TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src, dst = np.ones(N * PAGE, np.uint8), np.zeros(N * PAGE, np.uint8)
    assert a.register_memory(src.ctypes.data, N * PAGE) == 0
    assert b.register_memory(dst.ctypes.data, N * PAGE) == 0
    perm = np.random.default_rng(1).permutation(N)
    bufs = [src.ctypes.data + i * PAGE for i in range(N)]
    peers = [dst.ctypes.data + int(p) * PAGE for p in perm]
    lens = [PAGE] * N
    session = f"127.0.0.1:{b.get_rpc_port()}"
    assert a.batch_transfer_sync_write(session, bufs, peers, lens) == 0
    assert (dst.reshape(N, PAGE)[perm] == 1).all()
    core, agent = a._core, a._session(session).agent

    def lists():
        rid, _ = core.create_scattered("WRITE", bufs, agent, peers, lens, None)
        core.release(rid)

    def arrays():
        x, y, z = me._ints(bufs, "Q"), me._ints(peers, "Q"), me._ints(lens, "q")
        core.release(core.create("WRITE", me._rows(x, z), agent, me._rows(y, z), 2, None))

    rounds = {"lists_create_ns": [], "arrays_create_ns": [], "whole_call_ns": []}
    for _ in range(ROUNDS):
        rounds["lists_create_ns"].append(per_page(lists))
        rounds["arrays_create_ns"].append(per_page(arrays))
        rounds["whole_call_ns"].append(per_page(lambda: a.batch_transfer_sync_write(session, bufs, peers, lens)))
    out = {k + "_per_page_median": round(statistics.median(v), 1) for k, v in rounds.items()}
    out["rounds"] = {k: [round(x, 1) for x in v] for k, v in rounds.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
