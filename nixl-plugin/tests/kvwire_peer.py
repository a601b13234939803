"""The target process of test_real_nixl.py: real NIXL (`import nixl`, the
nixl / nixl-cu12 1.5.1 wheels) with backend KVWIRE, driven over stdin/stdout
one line at a time (metadata travels base64-encoded).

Usage: python kvwire_peer.py NAME TRANSPORT NBYTES MODE
  MODE verify: wait for the initiator's WRITE notification, check the bytes,
               answer with genNotif("ack:<ok|bad>"), then wait for "bye".
  MODE sleep:  serve memory until killed (the dead-peer test).
"""
import base64
import os
import sys
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * seed + 7) % 251).astype(np.uint8)


def wait_notif(agent, sender, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = agent.get_new_notifs()
        for msg in got.get(sender, []):
            if msg.startswith(want):
                return msg
        time.sleep(0.001)
    raise TimeoutError(f"no notification {want!r} from {sender}")


def main():
    name, transport, nbytes, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    params = {"kvwire_transport": transport, "peer_timeout_ms": "2000"}
    if transport == "verbs" and os.environ.get("KVWIRE_NIXL_PLUGIN_PEER_DEVICE"):
        params["device_list"] = os.environ["KVWIRE_NIXL_PLUGIN_PEER_DEVICE"]
    agent.create_backend("KVWIRE", params)
    buf = np.zeros(nbytes, dtype=np.uint8)
    half = nbytes // 2
    buf[half:] = pattern(nbytes - half, 13)  # what the initiator READs
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    print("@@ MD", base64.b64encode(agent.get_agent_metadata()).decode(), buf.ctypes.data, flush=True)
    line = sys.stdin.readline().split()
    assert line[0] == "MD", line
    initiator = agent.add_remote_agent(base64.b64decode(line[1]))
    initiator = initiator.decode() if isinstance(initiator, bytes) else initiator
    if mode == "sleep":
        print("@@ READY", flush=True)
        time.sleep(3600)
        return
    wait_notif(agent, initiator, b"write-done")
    ok = np.array_equal(buf[:half], pattern(half, 31))
    agent.send_notif(initiator, b"ack:" + (b"ok" if ok else b"bad"))
    print("@@ VERIFIED", "ok" if ok else "bad", flush=True)
    wait_notif(agent, initiator, b"read-done")
    print("@@ BYE", flush=True)


if __name__ == "__main__":
    main()
