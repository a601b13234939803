"""A second process for the two-process tests: one `nixl_agent` driven by
JSON lines on stdin, answering one JSON line each on stdout (the metadata
travels over this pipe, as vLLM sends it over ZMQ).

Commands: init(backend, name, size, seed) -> md (hex); prep(blocks, block) ->
prepares an Nx5 local dlist as vLLM's prefill worker does; add(md);
notifs -> {agent: [hex]}; notify(agent, hex); digest(offset, len) -> sha256
hex of the local buffer; fill(seed); release; exit."""

import hashlib
import json
import sys

import numpy as np

import nixl_alias  # noqa: F401  (before `nixl`: KVWIRE_NIXL_TEST_MODULE)

from nixl._api import nixl_agent, nixl_agent_config


def main():
    agent = buf = dl = reg = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out = {}
        if op == "init":
            agent = nixl_agent(cmd["name"], nixl_agent_config(backends=[cmd["backend"]], num_threads=2))
            buf = np.random.default_rng(cmd["seed"]).integers(0, 256, cmd["size"], dtype=np.uint8)
            reg = agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            agent.register_memory(reg)
            out["md"] = agent.get_agent_metadata().hex()
            out["addr"] = buf.ctypes.data
        elif op == "prep":
            blocks, block = cmd["blocks"], cmd["block"]
            rows = np.array([[buf.ctypes.data, block, 0, block, blocks]], dtype=np.uint64)
            dl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type="DRAM")
        elif op == "add":
            out["name"] = agent.add_remote_agent(bytes.fromhex(cmd["md"])).decode()
        elif op == "notifs":
            out["notifs"] = {k: [m.hex() for m in v] for k, v in agent.get_new_notifs().items()}
        elif op == "notify":
            agent.send_notif(cmd["agent"], bytes.fromhex(cmd["payload"]))
        elif op == "digest":
            o, n = cmd["offset"], cmd["len"]
            out["sha"] = hashlib.sha256(buf[o:o + n].tobytes()).hexdigest()
        elif op == "fill":
            buf[:] = np.random.default_rng(cmd["seed"]).integers(0, 256, buf.nbytes, dtype=np.uint8)
        elif op == "release":
            if dl is not None:
                agent.release_dlist_handle(dl)
            agent.deregister_memory(reg)
        elif op == "exit":
            print(json.dumps({"ok": True}), flush=True)
            return
        print(json.dumps({"ok": True, **out}), flush=True)


if __name__ == "__main__":
    main()
