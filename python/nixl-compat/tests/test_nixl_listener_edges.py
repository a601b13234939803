"""Issue 27 (items 2 and 4) for the `nixl` metadata listener: it binds
loopback by default, never hands the metadata (which holds the connection
secret) to a caller that did not prove the token, and survives running out
of descriptors. Pure Python: a stand-in agent, no transport."""

import os
import resource
import socket
import struct
import time

from nixl import _listener as L


class FakeAgent:
    name = "target"
    _core = object()

    def __init__(self):
        self.loaded = []

    def getLocalMD(self):
        return b"METADATA-WITH-SECRET"

    def loadRemoteMD(self, md):
        self.loaded.append(md)


def fetch(port, name=b"target", mac=None):
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        nonce = L._recv_exact(s, L.NONCE_BYTES)
        frame = b"F" + name
        if mac is None:
            mac = L._mac(L.listen_token(), nonce, frame)
        s.sendall(struct.pack(">I", len(mac + frame)) + mac + frame)
        try:
            return L.recv_frame(s)
        except (ConnectionError, OSError):
            return None


def test_binds_loopback_by_default_and_serves_an_authenticated_fetch(monkeypatch):
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_ADDR", raising=False)
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    lst = L.MetadataListener(FakeAgent(), 0)
    try:
        assert lst._sock.getsockname()[0] == "127.0.0.1"
        assert fetch(lst.port) == b"METADATA-WITH-SECRET"
    finally:
        lst.close()


def test_unauthenticated_fetch_gets_nothing(monkeypatch):
    monkeypatch.setenv("KVWIRE_NIXL_LISTEN_TOKEN", "s3cret")
    agent = FakeAgent()
    lst = L.MetadataListener(agent, 0)
    try:
        # The old protocol (no MAC) and a wrong MAC are both refused.
        assert fetch(lst.port, mac=b"") is None
        assert fetch(lst.port, mac=b"\0" * L.MAC_BYTES) is None
        monkeypatch.setenv("KVWIRE_NIXL_LISTEN_TOKEN", "wrong")
        assert fetch(lst.port) is None
        monkeypatch.setenv("KVWIRE_NIXL_LISTEN_TOKEN", "s3cret")
        assert fetch(lst.port) == b"METADATA-WITH-SECRET"
    finally:
        lst.close()


def test_non_loopback_without_token_refuses_everything(monkeypatch):
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    lst = L.MetadataListener(FakeAgent(), 0, host="0.0.0.0")
    try:
        assert fetch(lst.port) is None
    finally:
        lst.close()


def test_listener_survives_emfile(monkeypatch):
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    lst = L.MetadataListener(FakeAgent(), 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        os.close(held.pop())
        queued = socket.create_connection(("127.0.0.1", lst.port), timeout=5.0)
        time.sleep(0.3)  # the listener's accept fails with EMFILE meanwhile
        queued.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert fetch(lst.port) == b"METADATA-WITH-SECRET"
    finally:
        lst.close()
