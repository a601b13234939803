"""The metadata listener thread (NIXL's `enable_listen_thread`) over plain
TCP: a peer SENDs its metadata (loaded here), FETCHes ours, or INVALIDATEs
itself. Frames are a 4-byte big-endian length, then one command byte
(`S`, `F`, `I`) and its body; a FETCH is answered with one frame holding
the metadata. kvwire's own wire: NIXL agents cannot talk to it.

On start it prints `MD listener is listening on port N` to stderr, as NIXL
does (NIXL's CI harness reads the port from that line)."""

import socket
import struct
import sys
import threading

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


def send_frame(ip: str, port: int, payload: bytes, timeout: float = 5.0) -> None:
    with socket.create_connection((ip, port), timeout=timeout) as s:
        _send(s, payload)


def fetch_metadata(agent, name: str, ip: str, port: int) -> None:
    """Fetch `name`'s metadata from the listener at ip:port and load it, in
    a background thread (NIXL's `fetchRemoteMD` is asynchronous; poll
    `checkRemoteMD`)."""

    def run():
        try:
            with socket.create_connection((ip, port), timeout=5.0) as s:
                _send(s, b"F" + name.encode())
                md = recv_frame(s)
            if md:
                agent.loadRemoteMD(md)
            else:
                logger.warning("listener %s:%d has no metadata for %s", ip, port, name)
        except Exception as e:  # noqa: BLE001 - logged, as NIXL's async fetch
            logger.warning("fetching metadata of %s from %s:%d failed: %s", name, ip, port, e)

    threading.Thread(target=run, name="nixl-md-fetch", daemon=True).start()


class MetadataListener:
    """Serves `agent`'s metadata on `port` (0: an ephemeral port)."""

    def __init__(self, agent, port: int):
        self._agent = agent
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("0.0.0.0", port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        print(f"MD listener is listening on port {self.port}", file=sys.stderr, flush=True)
        self._thread = threading.Thread(target=self._serve, name="nixl-md-listener", daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5.0)
                    frame = recv_frame(conn)
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
