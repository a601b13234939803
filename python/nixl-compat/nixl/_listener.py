"""The metadata listener thread (NIXL's `enable_listen_thread`) over plain
TCP: a peer SENDs its metadata (loaded here), FETCHes ours, or INVALIDATEs
itself. Frames are a 4-byte big-endian length, then one command byte
(`S`, `F`, `I`) and its body; a FETCH is answered with one frame holding
the metadata. kvwire's own wire: NIXL agents cannot talk to it.

On start it prints `MD listener is listening on port N` to stderr, as NIXL
does (NIXL's CI harness reads the port from that line).

Security (docs/SECURITY.md, issue 27): the metadata holds the agent's
connection secret, so the listener binds 127.0.0.1 unless
`KVWIRE_NIXL_LISTEN_ADDR` names another address. Each connection starts
with a 16-byte nonce from the listener; the caller's frame is preceded by
HMAC-SHA256(token, "C" || nonce || frame), where the token is
`KVWIRE_NIXL_LISTEN_TOKEN` (empty when unset). A frame with a wrong MAC is
refused (no answer; the connection is closed). Who is served:

- with a token: a caller whose MAC proves it, from any address or uid;
- on loopback without a token: a caller running under the listener
  process's own effective uid (root is not special, as on shm). The caller's
  uid is the owner of its end of the connection in /proc/net/tcp (and
  tcp6), the entry whose local address is the peer address accept()
  returned, looked up before the nonce is sent while the connection is
  ESTABLISHED; any other uid, or no entry found, is refused like a wrong MAC;
- on any other address without a token: nobody.

So the listener never hands the metadata (or takes metadata) to a caller it
did not authenticate. The caller authenticates the listener in turn, before it
sends anything (a SEND carries the caller's own metadata and secret; a FETCH
answer names where its KV will go): after the listener's nonce it sends a
16-byte nonce of its own and the listener answers HMAC-SHA256(token, "L" ||
caller nonce || listener nonce || its address of the connection, "ip:port").
The caller goes on only when that proves its token (a non-empty one) for
the address it dialled (so another live listener cannot vouch for a dead
one through a relay) or the listener's end of the connection is a
socket of the caller's own effective uid in this network namespace; else
it stops with `ListenerUntrusted` (logged). So another user that binds a
port where a peer's listener was (or will be) gets no metadata and hands
out none. At most `MAX_PREAUTH` (64) connections that have not
been authenticated yet are kept open at once, each served by its own thread
(a silent caller holds only its own thread, for at most 5 s); a new one
closes the oldest. The accept loop survives EMFILE, ENFILE, ENOMEM,
ENOBUFS (bounded backoff, logged once per episode) and per-connection errors
such as ECONNABORTED."""

import errno
import hmac
import ipaddress
import os
import socket
import sys
import threading
import time

from kvwire import _net

from .logging import get_logger

logger = get_logger(__name__)

#: Largest frame accepted (bytes): kvwire's metadata limit, 16 MiB.
MAX_FRAME = 16 << 20

_recv_exact = _net.recv_exact
_send = _net.send_frame


def recv_frame(sock) -> bytes:
    return _net.recv_frame(sock, MAX_FRAME)


#: Bytes of the listener's per-connection nonce.
NONCE_BYTES = 16
#: Bytes of the MAC that precedes a caller's frame.
MAC_BYTES = 32
#: Connections not yet authenticated kept open at once (the oldest is closed
#: for a new one).
MAX_PREAUTH = 64
#: Backoff of the accept loop on resource errors (seconds): start, most.
BACKOFF_START, BACKOFF_MAX = 0.005, 0.25

_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_PER_CONNECTION_ERRNOS = {
    errno.ECONNABORTED,
    errno.EINTR,
    errno.EAGAIN,
    errno.EPROTO,
    errno.EPERM,
    errno.ECONNRESET,
    errno.ETIMEDOUT,
}


class ListenerUntrusted(ConnectionError):
    """The listener proved neither the caller's token nor that it runs under
    the caller's uid here: nothing was sent to it, nothing taken from it."""


def listen_token() -> bytes:
    """The shared token (`KVWIRE_NIXL_LISTEN_TOKEN`), empty when unset."""
    return os.environ.get("KVWIRE_NIXL_LISTEN_TOKEN", "").encode()


_mac = _net.proof


def _seal(token: bytes, caller_nonce: bytes, nonce: bytes, where: bytes) -> bytes:
    """The listener's proof to one caller, for the address `where` (module docs)."""
    return _mac(token, b"L" + caller_nonce + nonce, where)


def _caller_mac(token: bytes, nonce: bytes, frame: bytes) -> bytes:
    """The caller's MAC of `frame` over the listener's nonce ("C": never
    equal to a listener's seal, "L")."""
    return _mac(token, b"C" + nonce, frame)


def _request(s, payload: bytes) -> None:
    """Authenticate the listener on `s`, then send `payload` with its MAC
    over the listener's nonce. Raises `ListenerUntrusted` (sending nothing)."""
    nonce = _recv_exact(s, NONCE_BYTES)
    # the listener's end: local address = what we dialled, remote = us;
    # looked up now, while it is open
    try:
        ours = _net.tcp_peer_uid(s.getpeername(), s.getsockname()) == os.geteuid()
    except OSError:
        ours = False
    mine = os.urandom(NONCE_BYTES)
    s.sendall(mine)
    seal = _recv_exact(s, MAC_BYTES)
    token = listen_token()
    where = _net.addr_bytes(s.getpeername())
    if not ((token and hmac.compare_digest(seal, _seal(token, mine, nonce, where))) or ours):
        peer = s.getpeername()
        raise ListenerUntrusted(
            f"listener {peer[0]}:{peer[1]} is not a process of this user and did not prove "
            f"KVWIRE_NIXL_LISTEN_TOKEN{'' if token else ' (none is set here)'}: nothing sent to it"
        )
    _send(s, _caller_mac(token, nonce, payload) + payload)


def send_frame(ip: str, port: int, payload: bytes, timeout: float = 5.0) -> None:
    with socket.create_connection((ip, port), timeout=timeout) as s:
        _request(s, payload)


def fetch_metadata(agent, name: str, ip: str, port: int) -> None:
    """Fetch `name`'s metadata from the listener at ip:port and load it, in
    a background thread (NIXL's `fetchRemoteMD` is asynchronous; poll
    `checkRemoteMD`)."""

    def run():
        try:
            with socket.create_connection((ip, port), timeout=5.0) as s:
                _request(s, b"F" + name.encode())
                md = recv_frame(s)
            if md:
                agent.loadRemoteMD(md)
            else:
                logger.warning("listener %s:%d has no metadata for %s", ip, port, name)
        except Exception as e:  # noqa: BLE001 - logged, as NIXL's async fetch
            logger.warning("fetching metadata of %s from %s:%d failed: %s", name, ip, port, e)

    threading.Thread(target=run, name="nixl-md-fetch", daemon=True).start()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def peer_uid(peer, local):
    """The uid owning the caller's end of a connection, from /proc/net/tcp
    and tcp6: the ESTABLISHED entry whose local address is `peer` (as
    accept() returned it) and whose remote address is `local` (our end).
    None when there is no such entry or the tables cannot be read."""
    return _net.tcp_peer_uid(peer, local)


class MetadataListener:
    """Serves `agent`'s metadata on `port` (0: an ephemeral port), on `host`
    (default `KVWIRE_NIXL_LISTEN_ADDR`, else 127.0.0.1)."""

    def __init__(self, agent, port: int, host=None):
        self._agent = agent
        host = host or os.environ.get("KVWIRE_NIXL_LISTEN_ADDR", "127.0.0.1")
        self.host = host
        self._token = listen_token()
        # Without a token only loopback callers are possible at all; on any
        # other address an empty token would admit anyone: refuse everything.
        self._open = bool(self._token) or _is_loopback(host)
        # On loopback without a token the caller is authenticated by its uid.
        self._by_uid = not self._token and self._open
        self._uid = os.geteuid()
        # Connections not yet authenticated, oldest first (at most MAX_PREAUTH).
        self._pending = _net.Served(MAX_PREAUTH)
        # The agent's calls stay serialized, as when one thread served all.
        self._agent_lock = threading.Lock()
        if not self._open:
            logger.warning(
                "metadata listener on %s without KVWIRE_NIXL_LISTEN_TOKEN: every request is refused", host
            )
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        print(f"MD listener is listening on port {self.port}", file=sys.stderr, flush=True)
        self._thread = threading.Thread(target=self._serve, name="nixl-md-listener", daemon=True)
        self._thread.start()

    def _serve(self):
        delay, episode = BACKOFF_START, None
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                if self._stop:
                    return
                if e.errno in _RESOURCE_ERRNOS:
                    if episode is None:
                        episode = e.errno
                        logger.warning("metadata listener: accept failed (%s); backing off up to %ss", e, BACKOFF_MAX)
                    time.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)
                    continue
                if e.errno in _PER_CONNECTION_ERRNOS:
                    continue
                return
            if episode is not None:
                logger.info("metadata listener: accepting again (%s)", os.strerror(episode))
                delay, episode = BACKOFF_START, None
            self._pending.add(conn)
            try:
                threading.Thread(target=self._handle, args=(conn,), name="nixl-md-conn", daemon=True).start()
            except RuntimeError as e:  # no thread for it: this connection only
                logger.warning("metadata listener: cannot serve a connection: %s", e)
                self._pending.forget(conn)

    def _handle(self, conn):
        try:
            conn.settimeout(5.0)
            uid_ok = True
            if self._by_uid:
                # Before the nonce: a caller gets one only while its end is
                # still open (and so still listed under its uid).
                uid = peer_uid(conn.getpeername(), conn.getsockname())
                uid_ok = uid == self._uid
                if not uid_ok:
                    logger.warning(
                        "metadata listener: refusing a caller under uid %s (only uid %d without"
                        " KVWIRE_NIXL_LISTEN_TOKEN)",
                        "unknown" if uid is None else uid,
                        self._uid,
                    )
            nonce = os.urandom(NONCE_BYTES)
            conn.sendall(nonce)
            # prove ourselves to the caller (module docs) before it sends
            where = _net.addr_bytes(conn.getsockname())
            conn.sendall(_seal(self._token, _recv_exact(conn, NONCE_BYTES), nonce, where))
            framed = recv_frame(conn)
            mac, frame = framed[:MAC_BYTES], framed[MAC_BYTES:]
            if not (self._open and uid_ok and hmac.compare_digest(mac, _caller_mac(self._token, nonce, frame))):
                logger.warning("metadata listener: refused an unauthenticated request")
                return
            if not self._pending.take(conn):
                return  # closed for a newer connection meanwhile
            cmd, body = frame[:1], frame[1:]
            if cmd == b"S":
                with self._agent_lock:
                    self._agent.loadRemoteMD(body)
            elif cmd == b"F":
                with self._agent_lock:
                    ok = body.decode() == self._agent.name and self._agent._core is not None
                    md = self._agent.getLocalMD() if ok else b""
                _send(conn, md)
            elif cmd == b"I":
                with self._agent_lock:
                    self._agent.invalidateRemoteMD(body.decode())
        except ConnectionError as e:  # it left, or was closed for a newer connection
            logger.debug("metadata listener: %s", e)
        except Exception as e:  # noqa: BLE001 - a bad peer must not stop the listener
            logger.warning("metadata listener: %s", e)
        finally:
            self._pending.forget(conn)

    def close(self):
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._pending.shutdown_all()
