#!/usr/bin/env python3
"""Notification delivery latency through NIXL's Python API, for real NIXL
(nixl-cu12) and kvwire's `nixl`, with a polling loop like vLLM's.

Two processes on one host. The sender stamps each notification with
`time.perf_counter_ns()` (CLOCK_MONOTONIC: one clock for every process of the
host) and sends it with `send_notif` at random gaps of 0.2-2 ms (no queueing).
The receiver polls `get_new_notifs()` the way vLLM's engine loop does:
`tight` polls back to back; `step` does ~200 µs of Python work between polls
(an engine step with nothing else to do). Latency = the receiver's
`perf_counter_ns()` when `get_new_notifs` returned the message minus the
stamp; it includes the transport.

Env: NIXL_BENCH_MODULE (default `nixl`; `nixl_cu12` for the bare wheel),
NIXL_BENCH_BACKEND (default UCX), NOTIF_COUNT (default 2000 per mode).
Prints one JSON object: p50/p90/p99/max µs per mode.
"""

import importlib
import json
import multiprocessing as mp
import os
import random
import struct
import time
import uuid

MOD = os.environ.get("NIXL_BENCH_MODULE", "nixl")
BACKEND = os.environ.get("NIXL_BENCH_BACKEND", "UCX")
COUNT = int(os.environ.get("NOTIF_COUNT", "2000"))
MODES = ("tight", "step")


def api():
    return importlib.import_module(MOD + "._api")


def make_agent(name):
    a = api()
    agent = a.nixl_agent(name, a.nixl_agent_config(backends=[]))
    agent.create_backend(BACKEND, {})
    return agent


def busy(us):
    end = time.perf_counter_ns() + us * 1000
    x = 0
    while time.perf_counter_ns() < end:
        x += 1
    return x


def receiver(conn):
    agent = make_agent("rx-" + str(uuid.uuid4()))
    conn.send(agent.get_agent_metadata())
    agent.add_remote_agent(conn.recv())
    out = {}
    for mode in MODES:
        conn.send("ready")
        lat, got = [], 0
        while got < COUNT:
            notifs = agent.get_new_notifs()
            now = time.perf_counter_ns()
            for msgs in notifs.values():
                for m in msgs:
                    (sent,) = struct.unpack("<q", bytes(m)[:8])
                    lat.append((now - sent) / 1000)
                    got += 1
            if mode == "step":
                busy(200)
        lat.sort()
        out[mode] = {q: round(lat[min(len(lat) - 1, int(len(lat) * f))], 1)
                     for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        out[mode]["max"] = round(lat[-1], 1)
    conn.send(out)


def main():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=receiver, args=(child,))
    p.start()
    agent = make_agent("tx-" + str(uuid.uuid4()))
    rx_md = parent.recv()
    rx = agent.add_remote_agent(rx_md)
    parent.send(agent.get_agent_metadata())
    rng = random.Random(7)
    for _ in MODES:
        assert parent.recv() == "ready"
        # the first notification also waits for the connection
        for _ in range(COUNT):
            agent.send_notif(rx, struct.pack("<q", time.perf_counter_ns()) + b"n")
            busy(rng.randint(200, 2000))
    res = parent.recv()
    p.join(30)
    print(json.dumps({"module": MOD, "backend": BACKEND, "count": COUNT, "latency_us": res}))


if __name__ == "__main__":
    main()
