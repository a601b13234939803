"""The decode side of the SGLang-shaped test (test_nixl_sglang.py), a child
process driven by JSON lines on stdin, one JSON line answered on stdout.

It makes the calls SGLang 0.5's NIXL disaggregation backend makes on a decode
worker (sglang/srt/disaggregation/nixl/conn.py, NixlKVManager in DECODE mode
and NixlKVReceiver): an agent named by a uuid with `backends=[]` and
`num_threads=0`, `create_backend(backend, params)`, `register_memory` of the
per-layer KV buffers and of the aux buffers (lists of 4-tuples), and
`get_new_notifs` parsed by SGLang's notification tags:

    {room}_kv_{chunk_id}_{is_last}_{rank}   a KV chunk arrived
    {room}_aux                              aux arrived
    {room}_aux_nokv_{rank}                  aux, and `rank` sends no KV (decode prefix hit)
    {room}_state_{rank}                     state arrived

Commands: init(backend, name, bufs, slots, item, aux_slots, aux_item, seed)
-> md (hex), kv_ptrs, aux_ptrs; poll(room, ranks) -> done, status; digest(buf,
slot) / aux_digest(slot) -> sha256 hex; exit. KV memory is DRAM here (SGLang
registers VRAM, which kvwire moves over verbs only).
"""

import hashlib
import json
import sys
from collections import defaultdict

import numpy as np

from nixl._api import nixl_agent, nixl_agent_config


class Status:
    """SGLang's per-room receive state (TransferStatus)."""

    def __init__(self):
        self.kvs = defaultdict(set)  # rank -> chunk ids received
        self.expected = {}  # rank -> chunk count, known once the last chunk arrived
        self.aux = False
        self.state = set()

    def done(self, ranks):
        return self.aux and len(self.expected) >= ranks and all(
            len(self.kvs[r]) == n for r, n in self.expected.items())

    def as_json(self):
        return {"kvs": {str(r): sorted(c) for r, c in self.kvs.items()},
                "expected": {str(r): n for r, n in self.expected.items()}, "aux": self.aux,
                "state": sorted(self.state)}


def update(agent, statuses):
    """SGLang's update_transfer_status: parse every new notification."""
    for _peer, msgs in agent.get_new_notifs().items():
        for msg in msgs:
            parts = msg.decode("ascii").split("_", 8)
            st = statuses[int(parts[0])]
            if parts[1] == "kv":
                chunk, last, rank = int(parts[2]), bool(int(parts[3])), int(parts[4])
                st.kvs[rank].add(chunk)
                if last:
                    st.expected[rank] = chunk + 1
            elif parts[1] == "aux":
                st.aux = True
                if len(parts) > 3 and parts[2] == "nokv":
                    st.expected[int(parts[3])] = 0
            elif parts[1] == "state":
                st.state.add(int(parts[2]))


def main():
    agent = None
    kv, aux = [], None
    statuses = defaultdict(Status)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out = {}
        if op == "init":
            backend = cmd["backend"]
            agent = nixl_agent(cmd["name"], nixl_agent_config(backends=[], num_threads=0))
            agent.create_backend(backend, {})
            assert backend in agent.get_plugin_list()
            rng = np.random.default_rng(cmd["seed"])
            kv = [rng.integers(0, 256, cmd["slots"] * cmd["item"], dtype=np.uint8) for _ in range(cmd["bufs"])]
            aux = np.zeros(cmd["aux_slots"] * cmd["aux_item"], np.uint8)
            kv_descs = agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in kv], "DRAM")
            aux_descs = agent.register_memory([(aux.ctypes.data, aux.nbytes, 0, "")], "DRAM")
            assert kv_descs and aux_descs, "registration failed"
            out = {"md": agent.get_agent_metadata().hex(), "kv_ptrs": [b.ctypes.data for b in kv],
                   "aux_ptrs": [aux.ctypes.data]}
        elif op == "poll":
            update(agent, statuses)
            st = statuses[cmd["room"]]
            out = {"done": st.done(cmd["ranks"]), "status": st.as_json()}
        elif op == "digest":
            item = len(kv[0]) // cmd["slots"]
            s = cmd["slot"] * item
            out["sha"] = hashlib.sha256(kv[cmd["buf"]][s:s + item].tobytes()).hexdigest()
        elif op == "aux_digest":
            n = cmd["item"]
            out["sha"] = hashlib.sha256(aux[cmd["slot"] * n:(cmd["slot"] + 1) * n].tobytes()).hexdigest()
        elif op == "exit":
            print(json.dumps({"ok": True}), flush=True)
            return
        print(json.dumps({"ok": True, **out}), flush=True)


if __name__ == "__main__":
    main()
