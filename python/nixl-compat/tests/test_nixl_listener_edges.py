"""Issue 27 (items 2, 4 and 5) for the `nixl` metadata listener: it binds
loopback by default, never hands the metadata (which holds the connection
secret) to a caller that did not prove the token or, without a token, runs
under another uid; keeps at most 64 unauthenticated connections, which do
not hold up a fetch; and survives running out of descriptors. Pure Python:
a stand-in agent, no transport."""

import errno
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
        s.sendall(b"c" * L.NONCE_BYTES)  # the caller's nonce ...
        L._recv_exact(s, L.MAC_BYTES)  # ... and the listener's seal over it (checked by L._request, not here)
        frame = b"F" + name
        if mac is None:
            mac = L._caller_mac(L.listen_token(), nonce, frame)
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
        os.close(held.pop())  # one descriptor: our end of a connection it cannot accept
        # Another thread of this process (the listener's, or an engine's a
        # test before this left) may take the freed descriptor for a
        # moment: wait for it, and free one more only if it keeps it.
        for tries in range(1, 101):
            try:
                queued = socket.create_connection(("127.0.0.1", lst.port), timeout=5.0)
                break
            except OSError as e:
                if e.errno != errno.EMFILE or tries == 100:
                    raise
                if tries % 20 == 0:
                    os.close(held.pop())
                time.sleep(0.01)
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


# -- the caller authenticates the listener before it sends anything ---------

def drain(c, data=b""):
    """`data` and every byte `c` sends until it closes (or times out)."""
    try:
        while True:
            chunk = c.recv(65536)
            if not chunk:
                return data
            data += chunk
    except OSError:
        return data


def fake_listener(seal=b"\0" * 32):
    """A raw listener of this process that answers the handshake with `seal`
    and records every byte a caller sends; returns (port, got, close)."""
    import threading

    ls = socket.create_server(("127.0.0.1", 0))
    got = []

    def serve():
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            with c:
                c.settimeout(2.0)
                data = b""
                try:
                    c.sendall(os.urandom(L.NONCE_BYTES))
                    data = L._recv_exact(c, L.NONCE_BYTES)
                    c.sendall(seal)
                except OSError:
                    pass
                got.append(drain(c, data))

    threading.Thread(target=serve, daemon=True).start()
    return ls.getsockname()[1], got, ls.close


def test_caller_sends_nothing_to_an_untrusted_listener(monkeypatch):
    import pytest

    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    port, got, close = fake_listener()
    try:
        # a listener of this uid here: trusted without a token
        L.send_frame("127.0.0.1", port, b"S" + b"METADATA-WITH-SECRET")
        time.sleep(0.2)
        assert got and b"METADATA-WITH-SECRET" in got[-1]
        # the same listener seen as another user's (or another host's): nothing sent
        monkeypatch.setattr(L._net, "tcp_peer_uid", lambda *a: None)
        with pytest.raises(L.ListenerUntrusted, match="nothing sent"):
            L.send_frame("127.0.0.1", port, b"S" + b"METADATA-WITH-SECRET")
        time.sleep(0.2)
        assert len(got[-1]) == L.NONCE_BYTES, "only the caller's nonce went out"
        # with a token, a forged (zero) seal is refused too ...
        monkeypatch.setenv("KVWIRE_NIXL_LISTEN_TOKEN", "s3cret")
        with pytest.raises(L.ListenerUntrusted):
            L.send_frame("127.0.0.1", port, b"S" + b"METADATA-WITH-SECRET")
        # ... and a real listener holding it proves it, whoever owns it
        agent = FakeAgent()
        lst = L.MetadataListener(agent, 0)
        try:
            L.send_frame("127.0.0.1", lst.port, b"S" + b"PEER-MD")
            deadline = time.monotonic() + 5
            while not agent.loaded and time.monotonic() < deadline:
                time.sleep(0.02)
            assert agent.loaded == [b"PEER-MD"]
        finally:
            lst.close()
    finally:
        close()


def test_another_user_on_a_listener_port_gets_no_metadata_and_gives_none(monkeypatch, tmp_path):
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to run a listener under another uid (CI runs these tests as root)")
    monkeypatch.delenv("KVWIRE_NIXL_LISTEN_TOKEN", raising=False)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the impostor: a raw listener under uid 65534 (no kvwire code needed)
        code = 3
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            ls = socket.create_server(("127.0.0.1", 0))
            os.write(w, struct.pack(">H", ls.getsockname()[1]))
            leaked = False
            ls.settimeout(10)
            for _ in range(2):
                c, _ = ls.accept()
                with c:
                    c.settimeout(2.0)
                    c.sendall(os.urandom(L.NONCE_BYTES))
                    data = b""
                    try:
                        data = c.recv(L.NONCE_BYTES)
                        c.sendall(b"\0" * L.MAC_BYTES)
                    except OSError:
                        pass
                    leaked |= b"SECRET" in drain(c, data)
                    if c.fileno() >= 0:
                        try:  # answer a FETCH with metadata of its own choosing
                            L._send(c, b"IMPOSTOR-MD")
                        except OSError:
                            pass
            code = 1 if leaked else 0
        finally:
            os._exit(code)
    os.close(w)
    (port,) = struct.unpack(">H", os.read(r, 2))
    os.close(r)
    agent = FakeAgent()
    with pytest.raises(L.ListenerUntrusted):
        L.send_frame("127.0.0.1", port, b"S" + b"METADATA-WITH-SECRET")
    L.fetch_metadata(agent, "target", "127.0.0.1", port)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the metadata (and its secret) reached uid 65534"
    time.sleep(0.2)
    assert agent.loaded == [], "metadata from uid 65534 was loaded"


def test_a_relay_to_a_live_listener_is_refused(monkeypatch):
    # With a token, a process on a dead peer's listener port (another user:
    # the caller's uid check fails) relays the handshake to a live listener.
    # The live listener's seal is bound to its own address, not the one the
    # caller dialled: the caller stops before its SEND, whose metadata
    # carries its secret, ever crosses the relay.
    import threading

    import pytest

    monkeypatch.setenv("KVWIRE_NIXL_LISTEN_TOKEN", "s3cret")
    live = L.MetadataListener(FakeAgent(), 0)
    ls = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()

    def pump(src, dst, record):
        try:
            while True:
                b = src.recv(65536)
                if not b:
                    break
                if record:
                    seen.extend(b)
                dst.sendall(b)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def relay():
        c, _ = ls.accept()
        r = socket.create_connection(("127.0.0.1", live.port))
        threading.Thread(target=pump, args=(r, c, False), daemon=True).start()
        pump(c, r, True)

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    monkeypatch.setattr(L._net, "tcp_peer_uid", lambda *a: None)  # the relay is not ours
    try:
        with pytest.raises(L.ListenerUntrusted):
            L.send_frame("127.0.0.1", ls.getsockname()[1], b"S" + b"METADATA-WITH-SECRET")
        t.join(5)
        assert b"SECRET" not in bytes(seen) and len(seen) == L.NONCE_BYTES, bytes(seen)
        # direct, the same caller is served (the refusal is the address binding)
        L.send_frame("127.0.0.1", live.port, b"S" + b"PEER-MD")
    finally:
        ls.close()
        live.close()
