"""Real NIXL 1.5.1 (the `nixl` + `nixl-cu12` wheels from PyPI) with kvwire's
backend plugin libplugin_KVWIRE.so, found through NIXL_PLUGIN_DIR.

Run by scripts/nixl-plugin-tests.sh, which builds the plugin and the venv.
Every transfer crosses two processes (this one and kvwire_peer.py) and its
bytes are checked on both sides.
"""
import base64
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import nixl
from nixl._api import nixl_agent, nixl_agent_config

HERE = os.path.dirname(os.path.abspath(__file__))
TRANSPORTS = os.environ.get("KVWIRE_NIXL_PLUGIN_TRANSPORTS", "shm,tcp").split(",")
# verbs (scripts/nixl-plugin-softroce-check.sh, in the Soft-RoCE guest): this
# process's agents use KVWIRE_NIXL_PLUGIN_DEVICE, kvwire_peer.py's
# KVWIRE_NIXL_PLUGIN_PEER_DEVICE (NIXL's `device_list` backend parameter).
DEVICE = os.environ.get("KVWIRE_NIXL_PLUGIN_DEVICE", "")


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * seed + 7) % 251).astype(np.uint8)


def make_agent(name, transport, **extra):
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    if transport == "verbs" and DEVICE:
        extra.setdefault("device_list", DEVICE)
    agent.create_backend("KVWIRE", {"kvwire_transport": transport, **extra})
    return agent


def wait_state(agent, handle, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
        if state != "PROC":
            return state
    return "PROC"


def wait_notif(agent, sender, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for msg in agent.get_new_notifs().get(sender, []):
            if msg.startswith(want):
                return msg
        time.sleep(0.001)
    raise AssertionError(f"no notification {want!r} from {sender}")


class Peer:
    """kvwire_peer.py in its own process, spoken to over its stdin/stdout."""

    def __init__(self, name, transport, nbytes, mode):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "kvwire_peer.py"), name, transport, str(nbytes), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.expect("MD")
        self.metadata = base64.b64decode(line[1])
        self.addr = int(line[2])

    def expect(self, tag):
        # NIXL logs to stdout too: the protocol's lines start with "@@".
        while True:
            raw = self.proc.stdout.readline()
            assert raw, f"peer exited (rc {self.proc.poll()}) before saying {tag}"
            if raw.startswith("@@ "):
                break
        line = raw.split()[1:]
        assert line and line[0] == tag, f"peer said {line!r}, expected {tag}"
        return line

    def send(self, text):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def test_nixl_lists_and_describes_the_plugin():
    agent = nixl_agent("lister", nixl_agent_config(backends=[]))
    assert "KVWIRE" in agent.get_plugin_list()
    params = agent.get_plugin_params("KVWIRE")
    assert set(params) == {"kvwire_transport", "device_list", "num_threads", "peer_timeout_ms", "kvwire_options"}
    assert agent.get_plugin_mem_types("KVWIRE") == ["DRAM_SEG", "VRAM_SEG"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vram_on_a_cpu_copy_transport_is_refused(transport):
    """shm and tcp engines take DRAM only (getSupportedMems), so NIXL finds no
    backend for VRAM registrations instead of the plugin accepting them."""
    if transport not in ("shm", "tcp"):
        pytest.skip(f"{transport} takes VRAM through GPUDirect RDMA (a GPU check, scripts/gpu-check.sh)")
    agent = make_agent(f"vram-{transport}", transport)
    assert agent.get_backend_mem_types("KVWIRE") == ["DRAM_SEG"]
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(nixl._bindings.nixlNotFoundError):
        agent.register_memory([(buf.ctypes.data, 4096, 0, "")], "VRAM")


@pytest.mark.parametrize("params", [
    {"no_such_key": "1"},
    {"kvwire_transport": "carrier-pigeon"},
    {"kvwire_transport": "shm", "peer_timeout_ms": "soon"},
    {"kvwire_transport": "shm", "device_list": "mlx5_0"},
    {"kvwire_transport": "tcp", "kvwire_options": "listen=not-an-address"},
    {"kvwire_transport": "tcp", "kvwire.listen": "not-an-address"},
    {"kvwire_transport": "tcp", "kvwire.no_such_option": "1"},
])
def test_backend_options_are_refused_with_a_nixl_error(params):
    agent = nixl_agent("refuser", nixl_agent_config(backends=[]))
    with pytest.raises(nixl._bindings.nixlBackendError):
        agent.create_backend("KVWIRE", params)
    assert "KVWIRE" not in agent.backends


def test_auto_transport_falls_back_to_tcp_only_without_a_device_asked_for():
    """auto: verbs where an RDMA device opens, else tcp; with a device named in
    device_list there is no fallback (that device or a refusal)."""
    has_rdma = os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")
    agent = nixl_agent("auto", nixl_agent_config(backends=[]))
    agent.create_backend("KVWIRE", {"kvwire_transport": "auto"})
    assert "KVWIRE" in agent.backends
    if not has_rdma:
        assert agent.get_backend_mem_types("KVWIRE") == ["DRAM_SEG"]  # tcp, not verbs
        other = nixl_agent("auto-dev", nixl_agent_config(backends=[]))
        with pytest.raises(nixl._bindings.nixlBackendError):
            other.create_backend("KVWIRE", {"kvwire_transport": "auto", "device_list": "no_such_dev0"})


def test_kvwire_options_reach_the_transport():
    agent = nixl_agent("opts", nixl_agent_config(backends=[]))
    agent.create_backend("KVWIRE", {"kvwire_transport": "tcp", "kvwire.listen": "127.0.0.1:0",
                                    "kvwire_options": "conns_per_peer=2", "num_threads": "1",
                                    "peer_timeout_ms": "1500"})
    assert "KVWIRE" in agent.backends


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_processes_write_and_read_with_notifications(transport):
    n = 8 << 20
    half = n // 2
    peer = Peer(f"target-{transport}", transport, n, "verify")
    try:
        agent = make_agent(f"initiator-{transport}", transport)
        buf = pattern(n, 31)
        buf[half:] = 0
        agent.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")
        assert agent.add_remote_agent(peer.metadata) in (peer_name(peer, transport), peer_name(peer, transport).encode())
        peer.send("MD " + base64.b64encode(agent.get_agent_metadata()).decode())
        target = peer_name(peer, transport)

        # WRITE the first half, scattered in 64 KiB blocks, with a notification.
        blk = 64 << 10
        local = [(buf.ctypes.data + off, blk, 0) for off in range(0, half, blk)]
        remote = [(peer.addr + off, blk, 0) for off in range(0, half, blk)]
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                  agent.get_xfer_descs(remote, "DRAM"), target, b"write-done")
        assert agent.transfer(h) in ("PROC", "DONE")
        assert wait_state(agent, h) == "DONE"
        agent.release_xfer_handle(h)
        # The target checked the bytes after the notification and says so with genNotif.
        assert wait_notif(agent, target, b"ack:") == b"ack:ok"
        assert peer.expect("VERIFIED")[1] == "ok"

        # READ the target's second half with a notification.
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(buf.ctypes.data + half, half, 0)], "DRAM"),
                                  agent.get_xfer_descs([(peer.addr + half, half, 0)], "DRAM"), target, b"read-done")
        assert agent.transfer(h) in ("PROC", "DONE")
        assert wait_state(agent, h) == "DONE"
        assert np.array_equal(buf[half:], pattern(n - half, 13))
        assert np.array_equal(buf[:half], pattern(half, 31))
        agent.release_xfer_handle(h)
        peer.expect("BYE")

        # Out of bounds of what the target registered: refused before anything moves.
        with pytest.raises(nixl._bindings.nixlNotFoundError):
            agent.initialize_xfer("WRITE", agent.get_xfer_descs([(buf.ctypes.data, 4096, 0)], "DRAM"),
                                  agent.get_xfer_descs([(peer.addr + n, 4096, 0)], "DRAM"), target)
    finally:
        peer.close()


def peer_name(peer, transport):
    return f"target-{transport}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_killed_mid_transfer_is_a_remote_disconnect(transport):
    n = 64 << 20
    peer = Peer(f"doomed-{transport}", transport, n, "sleep")
    try:
        agent = make_agent(f"survivor-{transport}", transport, peer_timeout_ms="2000")
        buf = pattern(n, 5)
        agent.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")
        agent.add_remote_agent(peer.metadata)
        peer.send("MD " + base64.b64encode(agent.get_agent_metadata()).decode())
        peer.expect("READY")
        target = f"doomed-{transport}"
        blk = 4096
        local = agent.get_xfer_descs([(buf.ctypes.data + off, blk, 0) for off in range(0, n, blk)], "DRAM")
        remote = agent.get_xfer_descs([(peer.addr + off, blk, 0) for off in range(0, n, blk)], "DRAM")
        handles = []
        status = None
        killed_at = None
        deadline = time.monotonic() + 60
        # Keep WRITEs flowing, kill the peer while they do, and wait for NIXL's verdict.
        while time.monotonic() < deadline and status is None:
            if len(handles) < 4:
                try:
                    h = agent.initialize_xfer("WRITE", local, remote, target)
                    agent.transfer(h)
                    handles.append(h)
                except nixl._bindings.nixlRemoteDisconnectError:
                    status = "remote-disconnect"
                    break
            if killed_at is None and len(handles) == 4:
                os.kill(peer.proc.pid, signal.SIGKILL)
                killed_at = time.monotonic()
            for h in list(handles):
                # NIXL's binding raises the status's exception for an error.
                try:
                    st = agent.agent.getXferStatus(h._handle)
                except nixl._bindings.nixlRemoteDisconnectError:
                    status = "remote-disconnect"
                    break
                if st == nixl._bindings.NIXL_SUCCESS:
                    handles.remove(h)
                    agent.release_xfer_handle(h)
                else:
                    assert st == nixl._bindings.NIXL_IN_PROG, st
        assert killed_at is not None
        assert status == "remote-disconnect"
        # within the peer timeout (2 s) plus scheduling slack on a loaded 2-core machine
        assert time.monotonic() - killed_at < 10
        for h in handles:
            agent.release_xfer_handle(h)
    finally:
        peer.close()


def test_release_in_flight_cancels_and_keeps_the_agent_usable():
    """releaseReqH on a transfer in flight: kvwire cancels it safely; the same
    agents then move and verify bytes again (one process, shm)."""
    n = 64 << 20
    a = make_agent("rel-a", "shm")
    b = make_agent("rel-b", "shm")
    src = pattern(n, 3)
    dst = np.zeros(n, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, n, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, n, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    blk = 4096
    local = a.get_xfer_descs([(src.ctypes.data + o, blk, 0) for o in range(0, n, blk)], "DRAM")
    remote = a.get_xfer_descs([(dst.ctypes.data + o, blk, 0) for o in range(0, n, blk)], "DRAM")
    h = a.initialize_xfer("WRITE", local, remote, "rel-b", b"never")
    a.transfer(h)
    a.release_xfer_handle(h)  # in flight or just done: either way safe
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, n, 0)], "DRAM"),
                          a.get_xfer_descs([(dst.ctypes.data, n, 0)], "DRAM"), "rel-b", b"again")
    a.transfer(h)
    assert wait_state(a, h) == "DONE"
    assert np.array_equal(src, dst)
    assert wait_notif(b, "rel-a", b"again") == b"again"
    a.release_xfer_handle(h)


def test_local_transfer_and_self_notification():
    """supportsLocal: a transfer to the agent's own name (kvwire's loopback)."""
    n = 1 << 20
    a = make_agent("self-agent", "shm")
    buf = pattern(n, 11)
    buf[n // 2:] = 0
    a.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(buf.ctypes.data, n // 2, 0)], "DRAM"),
                          a.get_xfer_descs([(buf.ctypes.data + n // 2, n // 2, 0)], "DRAM"), "self-agent", b"me")
    a.transfer(h)
    assert wait_state(a, h) == "DONE"
    assert np.array_equal(buf[n // 2:], buf[: n // 2])
    assert wait_notif(a, "self-agent", b"me") == b"me"
    a.release_xfer_handle(h)
