"""The SGLang-shaped flow: the calls SGLang 0.5's NIXL disaggregation backend
(sglang/srt/disaggregation/nixl/conn.py) makes, on the prefill side in this
process and on the decode side in a child (sglang_decode_peer.py); metadata
and KV pointers cross a pipe as SGLang sends them over its ZMQ bootstrap
socket. Our own code, written against the calls and their order:

prefill: nixl_agent(uuid, nixl_agent_config(backends=[], num_threads=8)) ->
create_backend(backend, {"num_threads": "8"}) -> get_plugin_list ->
register_memory of the KV buffers and the aux buffer -> add_remote_agent(the
decode's metadata) -> per chunk: contiguous runs of page indices ->
get_xfer_descs(Nx3 uint64) -> initialize_xfer("WRITE", ..., notif
"{room}_kv_{chunk}_{last}_{rank}") -> transfer -> last chunk: aux through
get_xfer_descs(tuples) + initialize_xfer(notif "{room}_aux") -> poll
check_xfer_state until every handle is DONE; a decode prefix hit sends
"{room}_aux_nokv_{rank}" (send_notif from a rank that owns no aux). SGLang
0.5.2x's prepped path (prep_xfer_dlist over all slots x layers,
make_prepped_xfer with int32 indices) runs too.

A decode killed mid-transfer: the transfer fails with one of the errors
SGLang treats as transport errors (nixlRemoteDisconnectError,
nixlBackendError, nixlCancelledError); the dead decode's metadata stays
loaded (check_remote_metadata stays True, as on NIXL 1.5.1: SGLang's decode
side learns of a dead prefill from its HTTP heartbeat to the bootstrap
server, and its prefill side from check_xfer_state raising); a restarted
decode registers again under a new uuid (SGLang's way) and gets its bytes,
and one under the dead one's name is served after remove_remote_agent.
"""

import hashlib
import time
import uuid

import numpy as np
import pytest

import nixl._bindings as B
from nixl._api import nixl_agent, nixl_agent_config

TRANSPORT_ERRORS = (B.nixlRemoteDisconnectError, B.nixlBackendError, B.nixlCancelledError)
LAYERS = 3  # K and V buffers per layer: 2 * LAYERS KV buffers
SLOTS = 48
ITEM = 4096  # bytes per page (kv_item_len)
AUX_SLOTS, AUX_ITEM = 8, 256
RANK = 0


def sha(a):
    return hashlib.sha256(a.tobytes()).hexdigest()


def contiguous_runs(src, dst):
    """SGLang's group_concurrent_contiguous: split both index arrays where
    either stops being consecutive."""
    if len(src) == 0:
        return [], []
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    return np.split(src, cut), np.split(dst, cut)


class Prefill:
    """The prefill worker's NixlKVManager calls (our code, SGLang's order)."""

    def __init__(self, backend, slots=SLOTS, item=ITEM, seed=11):
        self.agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[], num_threads=8))
        self.agent.create_backend(backend, {"num_threads": "8"})
        assert backend in self.agent.get_plugin_list()
        rng = np.random.default_rng(seed)
        self.slots, self.item = slots, item
        self.kv = [rng.integers(0, 256, slots * item, dtype=np.uint8) for _ in range(2 * LAYERS)]
        self.aux = rng.integers(0, 256, AUX_SLOTS * AUX_ITEM, dtype=np.uint8)
        self.kv_descs = self.agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in self.kv], "DRAM")
        self.aux_descs = self.agent.register_memory([(self.aux.ctypes.data, self.aux.nbytes, 0, "")], "DRAM")
        assert self.kv_descs and self.aux_descs
        self.peers = {}  # decode_kv_args_table: agent name -> (kv ptrs, aux ptrs)
        self.prep = {}

    def add_peer(self, name, md, kv_ptrs, aux_ptrs):
        """_add_remote_peer: a known name is ignored."""
        if name in self.peers:
            return False
        self.peers[name] = (kv_ptrs, aux_ptrs)
        assert self.agent.add_remote_agent(bytes.fromhex(md)) == name.encode()
        self.prep.pop(name, None)
        return True

    def send_kvcache(self, peer, src_idx, dst_idx, notif):
        kv_ptrs, _ = self.peers[peer]
        src_runs, dst_runs = contiguous_runs(src_idx, dst_idx)
        src, dst = [], []
        for layer in range(2 * LAYERS):
            for s, d in zip(src_runs, dst_runs):
                n = len(s) * self.item
                src.append((self.kv[layer].ctypes.data + int(s[0]) * self.item, n, 0))
                dst.append((kv_ptrs[layer] + int(d[0]) * self.item, n, 0))
        src_descs = self.agent.get_xfer_descs(np.array(src, np.uint64), "DRAM")
        dst_descs = self.agent.get_xfer_descs(np.array(dst, np.uint64), "DRAM")
        h = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer, notif.encode("ascii"))
        assert h
        assert self.agent.transfer(h) != "ERR"
        return h

    def send_kvcache_prepped(self, peer, src_idx, dst_idx, notif):
        """SGLang 0.5.2x: dlists over all slots x layers, prepped once per peer."""
        kv_ptrs, _ = self.peers[peer]
        if "" not in self.prep:
            self.prep[""] = self.agent.prep_xfer_dlist("", self._rows([b.ctypes.data for b in self.kv]), "DRAM")
        if peer not in self.prep:
            self.prep[peer] = self.agent.prep_xfer_dlist(peer, self._rows(kv_ptrs), "DRAM")
        layers = np.arange(2 * LAYERS, dtype=np.int32)[:, None] * self.slots
        si = (layers + np.asarray(src_idx, np.int32)[None, :]).ravel().astype(np.int32)
        di = (layers + np.asarray(dst_idx, np.int32)[None, :]).ravel().astype(np.int32)
        h = self.agent.make_prepped_xfer("WRITE", self.prep[""], si, self.prep[peer], di, notif.encode("ascii"))
        assert h
        assert self.agent.transfer(h) != "ERR"
        return h

    def _rows(self, ptrs):
        rows = [np.column_stack([np.arange(self.slots, dtype=np.uint64) * np.uint64(self.item) + np.uint64(p),
                                 np.full(self.slots, self.item, np.uint64), np.zeros(self.slots, np.uint64)])
                for p in ptrs]
        return np.vstack(rows)

    def send_aux(self, peer, src_slot, dst_slot, notif):
        _, aux_ptrs = self.peers[peer]
        src = [(self.aux.ctypes.data + src_slot * AUX_ITEM, AUX_ITEM, 0)]
        dst = [(aux_ptrs[0] + dst_slot * AUX_ITEM, AUX_ITEM, 0)]
        h = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(src, "DRAM"),
                                       self.agent.get_xfer_descs(dst, "DRAM"), peer, notif.encode("ascii"))
        assert h and self.agent.transfer(h) != "ERR"
        return h

    def wait_all(self, handles, timeout=60):
        """The transfer worker's poll: every handle DONE, or raise."""
        deadline = time.time() + timeout
        while True:
            states = [self.agent.check_xfer_state(h) for h in handles]
            assert "ERR" not in states
            if all(s == "DONE" for s in states):
                return
            assert time.time() < deadline, states
            time.sleep(0)


def start_decode(peer_factory, backend, name=None, seed=3, slots=SLOTS, item=ITEM):
    d = peer_factory("sglang_decode_peer.py")
    name = name or str(uuid.uuid4())
    info = d.call(op="init", backend=backend, name=name, bufs=2 * LAYERS, slots=slots, item=item,
                  aux_slots=AUX_SLOTS, aux_item=AUX_ITEM, seed=seed)
    return d, name, info


def wait_room(d, room, ranks=1, timeout=60):
    deadline = time.time() + timeout
    while True:
        r = d.call(op="poll", room=room, ranks=ranks)
        if r["done"]:
            return r["status"]
        assert time.time() < deadline, r
        time.sleep(0.01)


def check_pages(p, d, src_idx, dst_idx):
    for layer in range(2 * LAYERS):
        for s, t in zip(src_idx, dst_idx):
            want = sha(p.kv[layer][int(s) * p.item:(int(s) + 1) * p.item])
            assert d.call(op="digest", buf=layer, slots=SLOTS, slot=int(t))["sha"] == want, (layer, s, t)


def test_sglang_shaped_flow(backend, peer_factory):
    p = Prefill(backend)
    d, dname, info = start_decode(peer_factory, backend)
    # bootstrap: the decode's KVArgsRegisterInfo (metadata + pointers)
    assert p.add_peer(dname, info["md"], info["kv_ptrs"], info["aux_ptrs"])
    assert not p.add_peer(dname, info["md"], info["kv_ptrs"], info["aux_ptrs"])  # already registered
    assert p.agent.check_remote_metadata(dname)

    # room 7: two chunks, page indices with contiguous runs and gaps
    src = np.array([0, 1, 2, 9, 10, 30, 31, 32, 33, 40], np.int32)
    dst = np.array([5, 6, 7, 20, 21, 11, 12, 13, 14, 2], np.int32)
    handles = [p.send_kvcache(dname, src[:6], dst[:6], f"7_kv_0_0_{RANK}"),
               p.send_kvcache(dname, src[6:], dst[6:], f"7_kv_1_1_{RANK}"),
               p.send_aux(dname, 3, 4, "7_aux")]
    p.wait_all(handles)
    st = wait_room(d, 7)
    assert st["kvs"] == {str(RANK): [0, 1]} and st["expected"] == {str(RANK): 2} and st["aux"]
    check_pages(p, d, src, dst)
    assert d.call(op="aux_digest", slot=4, item=AUX_ITEM)["sha"] == sha(p.aux[3 * AUX_ITEM:4 * AUX_ITEM])

    # room 8: the decode's prefix cache holds everything: no KV; the aux owner
    # writes aux with a nokv tag, a second sender rank only notifies.
    p.wait_all([p.send_aux(dname, 5, 6, f"8_aux_nokv_{RANK}")])
    p.agent.send_notif(dname, f"8_aux_nokv_{RANK + 1}".encode("ascii"))
    st = wait_room(d, 8, ranks=2)
    assert st["expected"] == {str(RANK): 0, str(RANK + 1): 0}
    assert d.call(op="aux_digest", slot=6, item=AUX_ITEM)["sha"] == sha(p.aux[5 * AUX_ITEM:6 * AUX_ITEM])

    # room 9: the prepped path (make_prepped_xfer over all slots x layers)
    src9 = np.array([44, 45, 46, 3], np.int32)
    dst9 = np.array([30, 31, 32, 47], np.int32)
    p.wait_all([p.send_kvcache_prepped(dname, src9, dst9, f"9_kv_0_1_{RANK}"), p.send_aux(dname, 1, 1, "9_aux")])
    wait_room(d, 9)
    check_pages(p, d, src9, dst9)
    d.close()


def test_sglang_decode_killed_then_recovered(backend, peer_factory):
    slots, item = 1024, 4096  # 24 MiB per KV set: big enough to be killed mid-way
    p = Prefill(backend, slots=slots, item=item)
    d, dname, info = start_decode(peer_factory, backend, slots=slots, item=item)
    p.add_peer(dname, info["md"], info["kv_ptrs"], info["aux_ptrs"])
    rev = np.arange(slots, dtype=np.int32)[::-1].copy()  # no contiguous runs: one descriptor per page
    fwd = np.arange(slots, dtype=np.int32)
    pending = [p.send_kvcache(dname, fwd, rev, f"1_kv_0_1_{RANK}")]
    d.kill()
    # The transfer worker polls; the room fails on a transport error. (A
    # transfer that finished before the kill landed is followed by the next
    # chunk's, until one fails.)
    failure, deadline = None, time.time() + 30
    while failure is None:
        assert time.time() < deadline, "no failure within the timeout"
        try:
            p.wait_all(pending, timeout=30)
            pending = [p.send_kvcache(dname, fwd, rev, f"1_kv_0_1_{RANK}")]
        except TRANSPORT_ERRORS as e:
            failure = e
    assert isinstance(failure, TRANSPORT_ERRORS), failure
    # NIXL 1.5.1 keeps a dead agent's metadata until it is removed.
    assert p.agent.check_remote_metadata(dname)

    # A restarted decode registers again: under a new uuid (SGLang) ...
    d2, name2, info2 = start_decode(peer_factory, backend, seed=5, slots=slots, item=item)
    assert p.add_peer(name2, info2["md"], info2["kv_ptrs"], info2["aux_ptrs"])
    p.wait_all([p.send_kvcache(name2, fwd[:64], rev[:64], f"2_kv_0_1_{RANK}"), p.send_aux(name2, 0, 0, "2_aux")])
    wait_room(d2, 2)
    for s, t in list(zip(fwd[:64], rev[:64]))[::9]:
        want = sha(p.kv[0][int(s) * item:(int(s) + 1) * item])
        assert d2.call(op="digest", buf=0, slots=slots, slot=int(t))["sha"] == want
    # ... or under the dead one's name, once the engine removed the dead one.
    assert p.agent.remove_remote_agent(dname) is None
    p.peers.pop(dname)
    d3, _, info3 = start_decode(peer_factory, backend, name=dname, seed=6, slots=slots, item=item)
    assert p.add_peer(dname, info3["md"], info3["kv_ptrs"], info3["aux_ptrs"])
    p.wait_all([p.send_kvcache(dname, fwd[:8], fwd[:8], f"3_kv_0_1_{RANK}"), p.send_aux(dname, 2, 2, "3_aux")])
    wait_room(d3, 3)
    assert d3.call(op="digest", buf=5, slots=slots, slot=7)["sha"] == sha(p.kv[5][7 * item:8 * item])
    d2.close()
    d3.close()


@pytest.fixture(autouse=True)
def _no_telemetry_env(monkeypatch):
    monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
