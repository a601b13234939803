"""Issue 27 (items 2, 4 and 5) for the `nixl` metadata listener: it binds
loopback by default, never hands the metadata (which holds the connection
secret) to a caller that did not prove the token or, without a token, runs
under another uid; keeps at most 64 unauthenticated connections, which do
not hold up a fetch; and survives running out of descriptors. Pure Python:
a stand-in agent, no transport."""

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


NOBODY = 65534


def fetch_as(uid, port):
    """FETCH from a forked child running under `uid`: the reply, or None
    when refused (the child's exit code carries which)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            got = fetch(port)
            code = 0 if got is None else 1 if got == b"METADATA-WITH-SECRET" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 1), f"the child under uid {uid} failed (exit {code})"
    return b"METADATA-WITH-SECRET" if code == 1 else None


def test_peer_uid_is_the_callers(monkeypatch):
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    with srv, socket.create_connection(srv.getsockname()) as c:
        conn, peer = srv.accept()
        with conn:
            assert peer == c.getsockname()
            assert L.peer_uid(peer, conn.getsockname()) == os.geteuid()
            # Our own (accepted) end is not the caller's.
            assert L.peer_uid(conn.getsockname(), peer) == os.geteuid()
            assert L.peer_uid(("127.0.0.1", 1), conn.getsockname()) is None


def test_without_token_only_the_listeners_uid_is_served(monkeypatch):
    if os.geteuid() != 0:
        import pytest

        pytest.skip("needs root to run a caller under another uid (CI runs these tests as root)")
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_ADDR", raising=False)
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    lst = L.MetadataListener(FakeAgent(), 0)
    try:
        # Another local user knows the (empty) key but is not the listener's uid.
        assert fetch_as(NOBODY, lst.port) is None
        # The same uid is served without a token.
        assert fetch(lst.port) == b"METADATA-WITH-SECRET"
    finally:
        lst.close()
    # With a token the MAC decides, whatever the caller's uid.
    monkeypatch.setenv("KVWIRE_NIXL_LISTEN_TOKEN", "s3cret")
    lst = L.MetadataListener(FakeAgent(), 0)
    try:
        assert fetch_as(NOBODY, lst.port) == b"METADATA-WITH-SECRET"
    finally:
        lst.close()


def test_silent_connections_are_capped_and_do_not_block_a_fetch(monkeypatch):
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    lst = L.MetadataListener(FakeAgent(), 0)
    silent = []
    try:
        for _ in range(100):
            silent.append(socket.create_connection(("127.0.0.1", lst.port), timeout=5.0))
        t0 = time.monotonic()
        assert fetch(lst.port) == b"METADATA-WITH-SECRET"
        took = time.monotonic() - t0
        assert took < 2.0, f"the fetch took {took:.2f} s behind 100 silent connections"
        # The 100 silent ones and the fetch made 101: the 37 oldest were
        # closed, the newest 63 (at most MAX_PREAUTH) are still open.
        time.sleep(0.2)
        closed = []
        for s in silent:
            s.settimeout(2.0)
            got, eof = b"", False
            while len(got) < L.NONCE_BYTES:  # the nonce, unless closed before it
                chunk = s.recv(L.NONCE_BYTES - len(got))
                if not chunk:
                    eof = True
                    break
                got += chunk
            if not eof:
                s.setblocking(False)
                try:
                    eof = s.recv(1) == b""
                except BlockingIOError:
                    pass
            closed.append(eof)
        assert closed == [True] * 37 + [False] * 63, closed
        assert len(lst._pending) <= L.MAX_PREAUTH
    finally:
        for s in silent:
            s.close()
        lst.close()
