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
HMAC-SHA256(token, nonce || frame), where the token is
`KVWIRE_NIXL_LISTEN_TOKEN` (empty when unset). A frame with a wrong MAC is
refused, and a listener bound to a non-loopback address without a token
refuses every command: it never hands the metadata (or takes metadata) from
a caller that did not prove the token. The accept loop survives EMFILE,
ENFILE, ENOMEM, ENOBUFS (bounded backoff, logged once per episode) and
per-connection errors such as ECONNABORTED."""

import errno
import hashlib
import hmac
import ipaddress
import os
import socket
import struct
import sys
import threading
import time

from .logging import get_logger

logger = get_logger(__name__)

#: Largest frame accepted (bytes): kvwire's metadata limit, 16 MiB.
MAX_FRAME = 16 << 20


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock) -> bytes:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return _recv_exact(sock, n)


def _send(sock, payload: bytes):
    sock.sendall(struct.pack(">I", len(payload)) + payload)


#: Bytes of the listener's per-connection nonce.
NONCE_BYTES = 16
#: Bytes of the MAC that precedes a caller's frame.
MAC_BYTES = 32
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


def listen_token() -> bytes:
    """The shared token (`KVWIRE_NIXL_LISTEN_TOKEN`), empty when unset."""
    return os.environ.get("KVWIRE_NIXL_LISTEN_TOKEN", "").encode()


def _mac(token: bytes, nonce: bytes, frame: bytes) -> bytes:
    return hmac.new(token, nonce + frame, hashlib.sha256).digest()


def _request(s, payload: bytes) -> None:
    """Answer the listener's nonce and send `payload` with its MAC."""
    nonce = _recv_exact(s, NONCE_BYTES)
    _send(s, _mac(listen_token(), nonce, payload) + payload)


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
            with conn:
                try:
                    conn.settimeout(5.0)
                    nonce = os.urandom(NONCE_BYTES)
                    conn.sendall(nonce)
                    framed = recv_frame(conn)
                    mac, frame = framed[:MAC_BYTES], framed[MAC_BYTES:]
                    if not self._open or not hmac.compare_digest(mac, _mac(self._token, nonce, frame)):
                        logger.warning("metadata listener: refused an unauthenticated request")
                        continue
                    cmd, body = frame[:1], frame[1:]
                    if cmd == b"S":
                        self._agent.loadRemoteMD(body)
                    elif cmd == b"F":
                        ok = body.decode() == self._agent.name and self._agent._core is not None
                        _send(conn, self._agent.getLocalMD() if ok else b"")
                    elif cmd == b"I":
                        self._agent.invalidateRemoteMD(body.decode())
                except Exception as e:  # noqa: BLE001 - a bad peer must not stop the listener
                    logger.warning("metadata listener: %s", e)

    def close(self):
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
