"""A second process with its own mooncake.engine.TransferEngine, driven by
JSON lines on stdin (one answer line each): the target side of the
two-process tests."""

import hashlib
import json
import os
import sys

import numpy as np

from mooncake.engine import TransferEngine

engine = TransferEngine()
arrays = {}  # addr -> numpy array kept alive


def handle(cmd):
    op = cmd["op"]
    if op == "init":
        rc = engine.initialize(cmd.get("host", "127.0.0.1"), cmd.get("metadata", "P2PHANDSHAKE"),
                               cmd.get("protocol", "tcp"),
                               cmd.get("device", os.environ.get("KVWIRE_MOONCAKE_TEST_PEER_DEVICE", "")))
        return {"rc": rc, "session": engine.session_id, "port": engine.get_rpc_port(), "transport": engine._transport}
    if op == "alloc":  # numpy buffers, registered in one batch
        bufs = [np.zeros(n, dtype=np.uint8) for n in cmd["sizes"]]
        addrs = [b.ctypes.data for b in bufs]
        for a, b in zip(addrs, bufs):
            arrays[a] = b
        rc = engine.batch_register_memory(addrs, cmd["sizes"]) if cmd.get("register", True) else 0
        return {"rc": rc, "addrs": addrs}
    if op == "register":  # again, buffers made by "alloc" (same addresses)
        return {"rc": engine.batch_register_memory(cmd["addrs"], [arrays[a].nbytes for a in cmd["addrs"]])}
    if op == "managed":
        return {"addr": engine.allocate_managed_buffer(cmd["size"])}
    if op == "unregister":
        return {"rc": engine.batch_unregister_memory(cmd["addrs"])}
    if op == "fill":
        a = arrays[cmd["addr"]]
        a[:] = np.frombuffer(hashlib.shake_256(cmd["seed"].encode()).digest(a.nbytes), dtype=np.uint8)
        return {"ok": True}
    if op == "read":
        return {"hex": engine.read_bytes_from_buffer(cmd["addr"], cmd["len"]).hex()}
    if op == "write":
        return {"rc": engine.write_bytes_to_buffer(cmd["addr"], bytes.fromhex(cmd["hex"]), len(cmd["hex"]) // 2)}
    if op == "sha":  # sha256 over (addr, len) pieces in order
        h = hashlib.sha256()
        for addr, n in cmd["pieces"]:
            h.update(engine.read_bytes_from_buffer(addr, n))
        return {"sha": h.hexdigest()}
    if op == "notifies":
        return {"got": [[n.name, n.msg] for n in engine.get_notifies()]}
    if op == "transfer":  # this side as initiator
        fn = getattr(engine, cmd["fn"])
        return {"rc": fn(*cmd["args"])}
    if op == "exit":
        return {"bye": True}
    raise ValueError(f"unknown op {op}")


for line in sys.stdin:
    cmd = json.loads(line)
    try:
        out = handle(cmd)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"error": repr(e)}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    if cmd["op"] == "exit":
        os._exit(0)
