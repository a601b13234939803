"""A peer that dies: what each `nixl` call does afterwards, as real NIXL 1.5.1
does it (issue 32's table, observed with nixl-cu12 1.5.1 over UCX).

A decode agent in this process loads a prefill's metadata (a child process,
nixl_peer.py), reads from it once, and the prefill is SIGKILLed. Then:

| call after the peer died                        | NIXL 1.5.1                  |
| ----------------------------------------------- | --------------------------- |
| make_prepped_xfer + transfer                    | nixlRemoteDisconnectError   |
| check_xfer_state of the failed handle           | nixlRemoteDisconnectError   |
| send_notif                                      | nixlRemoteDisconnectError   |
| check_remote_metadata                           | True                        |
| remove_remote_agent                             | None                        |
| no transfer, 1 s of get_new_notifs, then check/remove | True / None           |

and the calls vLLM and SGLang make around those (prep_xfer_dlist,
initialize_xfer, release_xfer_handle, release_dlist_handle,
get_xfer_telemetry) never raise a class real NIXL doesn't raise there.

The suite imports `nixl._api` from whichever package is installed: ours
(backends KVWIRE_SHM, KVWIRE_TCP) or real NIXL (KVWIRE_NIXL_TEST_BACKENDS=UCX
in a venv with nixl-cu12==1.5.1; scripts/nixl-real-check.sh), so the
expectations are NIXL's and not ours.

Last, the vLLM-shaped cleanup path in two processes: a decode agent whose
prefill dies sends its heartbeat notification (fails), checks
check_remote_metadata (True), calls remove_remote_agent (no raise), and
serves a restarted prefill (same name, new metadata) at once.
"""

import hashlib
import time
import uuid

import numpy as np
import pytest

import nixl._bindings as B
from nixl._api import nixl_agent, nixl_agent_config

BLOCK, BLOCKS = 4096, 64
SIZE = BLOCK * BLOCKS


def sha(a):
    return hashlib.sha256(a.tobytes()).hexdigest()


def wait(agent, h, timeout=20):
    deadline = time.time() + timeout
    while (s := agent.check_xfer_state(h)) == "PROC":
        assert time.time() < deadline, "transfer did not finish"
    return s


class Decode:
    """The decode side: an agent with a local buffer, a prefill loaded,
    one READ done, dlists prepared on both sides (vLLM's order)."""

    def __init__(self, backend, peer_factory, telemetry=False):
        self.p = peer_factory()
        self.pname = "prefill-" + str(uuid.uuid4())
        md = self.p.call(op="init", backend=backend, name=self.pname, size=SIZE, seed=3)
        self.paddr = md["addr"]
        self.a = nixl_agent("decode-" + str(uuid.uuid4()),
                            nixl_agent_config(backends=[backend], capture_telemetry=telemetry))
        self.buf = np.zeros(SIZE, np.uint8)
        self.reg = self.a.get_reg_descs([(self.buf.ctypes.data, SIZE, 0, "")], "DRAM")
        self.a.register_memory(self.reg)
        assert self.a.add_remote_agent(bytes.fromhex(md["md"])) == self.pname.encode()
        self.local = self.a.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(self.buf.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM")
        self.remote = self.a.prep_xfer_dlist(
            self.pname, [(self.paddr + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM")
        idx = np.arange(BLOCKS, dtype=np.int32)
        h = self.a.make_prepped_xfer("READ", self.local, idx, self.remote, idx)
        self.a.transfer(h)
        assert wait(self.a, h) == "DONE"
        assert sha(self.buf) == self.p.call(op="digest", offset=0, len=SIZE)["sha"]
        self.a.release_xfer_handle(h)

    def read(self):
        idx = np.arange(BLOCKS, dtype=np.int32)
        return self.a.make_prepped_xfer("READ", self.local, idx, self.remote, idx)

    def kill_and_find_dead(self):
        """SIGKILL the prefill, then READ until the death shows; returns the
        handle that failed. The first post after the kill may still be
        accepted (the death is seen by its completion): keep going until a
        transfer or its state raises, which must be the remote-disconnect
        class."""
        self.p.kill()
        deadline = time.time() + 20
        while True:
            assert time.time() < deadline, "the death was not noticed"
            h = self.read()
            try:
                self.a.transfer(h)
                while self.a.check_xfer_state(h) == "PROC":
                    assert time.time() < deadline
            except B.nixlRemoteDisconnectError:
                return h
            self.a.release_xfer_handle(h)


@pytest.fixture
def dead(backend, peer_factory):
    d = Decode(backend, peer_factory)
    failed = d.kill_and_find_dead()
    return d, failed


def test_transfer_to_a_dead_peer_raises_remote_disconnect(dead):
    d, _ = dead
    for _ in range(3):
        h = d.read()  # making the request itself does not raise
        with pytest.raises(B.nixlRemoteDisconnectError):
            d.a.transfer(h)


def test_check_xfer_state_of_the_failed_handle_raises_remote_disconnect(dead):
    d, failed = dead
    with pytest.raises(B.nixlRemoteDisconnectError):
        d.a.check_xfer_state(failed)
    h = d.read()
    with pytest.raises(B.nixlRemoteDisconnectError):
        d.a.transfer(h)
    with pytest.raises(B.nixlRemoteDisconnectError):
        d.a.check_xfer_state(h)


def test_send_notif_to_a_dead_peer_raises_remote_disconnect(dead):
    d, _ = dead
    with pytest.raises(B.nixlRemoteDisconnectError):
        d.a.send_notif(d.pname, b"HB:req-1")


def test_dead_peer_stays_loaded_until_removed(dead):
    d, _ = dead
    assert d.a.check_remote_metadata(d.pname)
    assert d.a.remove_remote_agent(d.pname) is None
    assert not d.a.check_remote_metadata(d.pname)


def test_other_calls_on_a_dead_peer(dead):
    """prep_xfer_dlist / initialize_xfer / releases / telemetry after the
    death: only the classes NIXL raises there."""
    d, failed = dead
    # prep against the dead peer's (still loaded) metadata succeeds
    again = d.a.prep_xfer_dlist(d.pname, [(d.paddr, BLOCK, 0)], "DRAM")
    h = d.a.make_prepped_xfer("READ", d.local, [0], again, [0])
    with pytest.raises(B.nixlRemoteDisconnectError):
        d.a.transfer(h)
    d.a.release_xfer_handle(h)
    d.a.release_dlist_handle(again)
    # initialize_xfer posts nothing: the transfer raises
    l = d.a.get_xfer_descs([(d.buf.ctypes.data, BLOCK, 0)], "DRAM")
    r = d.a.get_xfer_descs([(d.paddr, BLOCK, 0)], "DRAM")
    h2 = d.a.initialize_xfer("READ", l, r, d.pname, b"n")
    with pytest.raises(B.nixlRemoteDisconnectError):
        d.a.transfer(h2)
    d.a.release_xfer_handle(h2)
    # telemetry is off here: NIXL answers NO_TELEMETRY before anything else
    with pytest.raises(B.nixlNoTelemetryError):
        d.a.get_xfer_telemetry(failed)
    # releasing the failed handle and the dlists prepared before the death
    d.a.release_xfer_handle(failed)
    d.a.release_dlist_handle(d.remote)
    d.a.release_dlist_handle(d.local)
    # removed: now the name is unknown
    assert d.a.remove_remote_agent(d.pname) is None
    with pytest.raises(B.nixlNotFoundError):
        d.a.prep_xfer_dlist(d.pname, [(d.paddr, BLOCK, 0)], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        d.a.send_notif(d.pname, b"HB")
    d.a.deregister_memory(d.reg)


def test_telemetry_of_a_handle_failed_by_a_dead_peer(backend, peer_factory, monkeypatch):
    d = Decode(backend, peer_factory, telemetry=True)
    failed = d.kill_and_find_dead()
    with pytest.raises(B.nixlRemoteDisconnectError):
        d.a.get_xfer_telemetry(failed)


def test_no_transfer_after_the_kill_then_check_and_remove(backend, peer_factory):
    d = Decode(backend, peer_factory)
    d.p.kill()
    deadline = time.time() + 1.0
    while time.time() < deadline:
        assert d.a.get_new_notifs() == {}
    assert d.a.check_remote_metadata(d.pname)
    assert d.a.remove_remote_agent(d.pname) is None
    assert not d.a.check_remote_metadata(d.pname)


def test_vllm_cleanup_path_survives_and_serves_a_restarted_prefill(backend, peer_factory):
    """vLLM's NixlConnector on the decode side: heartbeat notification to the
    prefill -> on failure, `_cleanup_remote_engines`: check_remote_metadata
    -> remove_remote_agent (no try/except in vLLM: a raise kills EngineCore)
    -> the restarted prefill's metadata is added and read from at once."""
    d = Decode(backend, peer_factory)
    d.p.kill()
    # heartbeat until it fails (the first may still be accepted)
    deadline = time.time() + 20
    while True:
        assert time.time() < deadline, "heartbeat never failed"
        try:
            d.a.send_notif(d.pname, b"HB:" + d.a.name.encode())
            h = d.read()
            d.a.transfer(h)
            while d.a.check_xfer_state(h) == "PROC":
                assert time.time() < deadline
            d.a.release_xfer_handle(h)
        except B.nixlRemoteDisconnectError:
            break
    # _cleanup_remote_engines
    if d.a.check_remote_metadata(d.pname):
        d.a.remove_remote_agent(d.pname)
    assert not d.a.check_remote_metadata(d.pname)
    # the prefill restarts under the same name with new metadata
    p2 = peer_factory()
    md2 = p2.call(op="init", backend=backend, name=d.pname, size=SIZE, seed=9)
    assert d.a.add_remote_agent(bytes.fromhex(md2["md"])) == d.pname.encode()
    remote2 = d.a.prep_xfer_dlist(d.pname, [(md2["addr"] + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM")
    perm = np.random.default_rng(1).permutation(BLOCKS).astype(np.int32)
    h = d.a.make_prepped_xfer("READ", d.local, np.arange(BLOCKS, dtype=np.int32), remote2, perm, b"req-2")
    d.a.transfer(h)
    assert wait(d.a, h) == "DONE"
    for i in range(0, BLOCKS, 5):
        want = p2.call(op="digest", offset=int(perm[i]) * BLOCK, len=BLOCK)["sha"]
        assert sha(d.buf[i * BLOCK:(i + 1) * BLOCK]) == want
    # and the restarted prefill gets the READ's notification and a heartbeat
    d.a.send_notif(d.pname, b"HB:again")
    deadline, got = time.time() + 10, []
    while len(got) < 2:
        got += [bytes.fromhex(m) for m in p2.call(op="notifs")["notifs"].get(d.a.name, [])]
        assert time.time() < deadline, got
    assert got == [b"req-2", b"HB:again"]
    p2.close()
