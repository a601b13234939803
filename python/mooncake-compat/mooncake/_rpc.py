"""The "rpc port" of a kvwire-backed Mooncake engine: a small TCP side
channel that hands this engine's description (kvwire agent metadata and
the list of registered buffers) to a peer that names the session
``host:rpc_port``, and answers liveness probes.

kvwire's own wire, not Mooncake's: a real Mooncake engine cannot talk to it.

Frames are a 4-byte big-endian length and a payload. On accept the server
sends ``CHALLENGE`` = ``b"MCKV3" + nonce(16)``. The asker answers with one
frame ``cmd(1) + proof(32) + asker_nonce(16)``:

- ``P`` (probe): answered ``b"+ok"``; needs no proof (it reveals nothing).
- ``M`` (describe): answered ``b"+" + seal(32) + JSON`` with the
  description, or ``b"-" + reason``. The description carries the agent
  metadata, and the metadata carries the secret that lets a peer connect to
  the transport (docs/SECURITY.md), so it is handed out only to

  * an asker that proves it holds the deployment token
    (``KVWIRE_MOONCAKE_TOKEN``, the same string on every host):
    ``proof = HMAC-SHA256(token, b"A" + nonce + cmd + where)``, `where`
    being the server's address of the connection (``b"ip:port"``: what the
    asker dialled, what the server accepted on), so a proof made for one
    server is refused by another (a relay to a live peer gets nothing); or
  * without a token, a *local* asker: its TCP socket is in this network
    namespace's ``/proc/net/tcp{,6}`` and is owned by this process's uid.

  The asker, in turn, takes a description only from a server it trusts
  the same way, since it will write KV data to (or read it from) whatever
  the description names: ``seal = HMAC-SHA256(token, b"R" + asker_nonce +
  nonce + len(where) + where + JSON)`` proves the token (32 zero bytes
  without one) and the address the asker dialled, or else
  the server's end of the connection must be owned by the asker's uid in
  this network namespace (looked up while the connection is open). So a
  process of another user that binds a dead peer's rpc port, or a host
  without the token, cannot pose as a session (``RpcUntrusted``).

Everything a peer sends is bounded (a request frame by ``MAX_REQUEST``, a
reply by ``MAX_FRAME``) and every socket has a timeout. At most
``MAX_OPEN`` (64) connections are served at once, each by its own thread;
a new one shuts the oldest down (as the ``nixl`` package's metadata
listener), so a flood of silent askers holds at most 64 threads and cannot
keep a real asker out for long.
"""

import hmac
import json
import logging
import os
import socket
import threading
import time

from kvwire import _net

logger = logging.getLogger("mooncake.kvwire")

MAGIC = b"MCKV3"
#: Bytes of each side's nonce.
NONCE_BYTES = 16
MAX_FRAME = 64 << 20
#: Largest request the server reads (bytes): cmd(1) + proof(32); the rest is slack.
MAX_REQUEST = 1024
#: Connections served at once (a new one shuts the oldest down).
MAX_OPEN = 64
IO_TIMEOUT_S = 5.0
TOKEN_ENV = "KVWIRE_MOONCAKE_TOKEN"


class RpcRefused(Exception):
    """The peer answered, but refused to describe itself (reason in args)."""


class RpcUntrusted(Exception):
    """The server described itself, but is neither a process of this uid
    in this network namespace nor a holder of the token (reason in args):
    its description is not used."""


def _token():
    t = os.environ.get(TOKEN_ENV, "")
    return t.encode() if t else None


def recv_frame(sock):
    return _net.recv_frame(sock, MAX_FRAME)


send_frame = _net.send_frame


def _proof(token, nonce, cmd, where):
    """The asker's proof (zeros without a token), bound to the server address `where`."""
    if token is None:
        return b"\0" * _net.PROOF_BYTES
    return _net.proof(token, b"A" + nonce, cmd + where)


def _seal(token, asker_nonce, nonce, where, body):
    """The server's proof over its answer to one asker at `where` (zeros without a token)."""
    if token is None:
        return b"\0" * _net.PROOF_BYTES
    return _net.proof(token, b"R" + asker_nonce + nonce, bytes([len(where)]) + where + body)


# -- the local-asker rule ------------------------------------------------

def socket_owner_uid(local, remote):
    """uid owning the TCP socket whose local end is `local` and remote end
    is `remote` in this network namespace, or None when there is none."""
    return _net.tcp_peer_uid(local, remote)


def is_local_same_user(conn):
    """True when the asker on `conn` is a process of this uid in this network namespace."""
    try:
        uid = socket_owner_uid(conn.getpeername(), conn.getsockname())
    except OSError:
        return False
    return uid is not None and uid == os.getuid()


# -- server --------------------------------------------------------------

class RpcServer:
    """Serves `describe()` (bytes, a JSON document) on `sock` (bound, listening)."""

    def __init__(self, sock, describe):
        self._token = _token()  # read once, at initialize
        self._sock = sock
        self._describe = describe
        self.port = sock.getsockname()[1]
        self._stop = False
        self._open = _net.Served(MAX_OPEN)  # connections being served
        self._thread = threading.Thread(target=self._serve, name="mooncake-kvwire-rpc", daemon=True)
        self._thread.start()

    def _serve(self):
        # One failed accept (EMFILE, ENFILE, ENOBUFS, ECONNABORTED) or thread
        # start must not stop the server: log it, back off, keep accepting.
        backoff = 0.0
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                if self._stop:
                    return
                backoff = min(max(backoff * 2, 0.01), 1.0)
                logger.warning("mooncake rpc: accept failed (%s); retrying in %.2f s", e, backoff)
                time.sleep(backoff)
                continue
            backoff = 0.0
            self._open.add(conn)
            try:
                threading.Thread(target=self._handle, args=(conn,), name="mooncake-kvwire-rpc-conn",
                                 daemon=True).start()
            except RuntimeError as e:  # no thread to spare: refuse this asker, keep serving
                logger.warning("mooncake rpc: %s; connection refused", e)
                self._open.forget(conn)

    def _handle(self, conn):
        try:
            conn.settimeout(IO_TIMEOUT_S)
            nonce = os.urandom(NONCE_BYTES)
            send_frame(conn, MAGIC + nonce)
            frame = _net.recv_frame(conn, MAX_REQUEST)
            if len(frame) < 33:
                return
            cmd, proof, asker_nonce = frame[:1], frame[1:33], frame[33:33 + NONCE_BYTES]
            if cmd == b"P":
                send_frame(conn, b"+ok")
            elif cmd == b"M" and len(asker_nonce) != NONCE_BYTES:
                send_frame(conn, b"-an asker nonce is required (an older kvwire?)")
            elif cmd == b"M":
                token = self._token
                where = _net.addr_bytes(conn.getsockname())  # what the asker dialled
                if token is not None:
                    ok = hmac.compare_digest(proof, _proof(token, nonce, cmd, where))
                    why = (f"wrong or missing {TOKEN_ENV} proof (or one made for another address than "
                           f"{where.decode()}: a relay)")
                else:
                    ok = is_local_same_user(conn)
                    why = (f"asker {conn.getpeername()[0]} is not a local process of this user; "
                           f"set the same {TOKEN_ENV} on every host to serve remote peers")
                if ok:
                    body = self._describe()
                    send_frame(conn, b"+" + _seal(token, asker_nonce, nonce, where, body) + body)
                else:
                    logger.warning("mooncake rpc: refused to describe this engine: %s", why)
                    send_frame(conn, b"-" + why.encode())
        except Exception as e:  # noqa: BLE001 - a bad asker must not stop the server
            logger.debug("mooncake rpc: %s", e)
        finally:
            self._open.forget(conn)

    def close(self):
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._open.shutdown_all()


# -- client --------------------------------------------------------------

class _Within:
    """A socket whose reads and writes all end by `deadline` (monotonic
    seconds): the timeout left is set before each, so a peer that answers
    in small pieces cannot stretch the exchange past it."""

    def __init__(self, sock, deadline):
        self._sock, self._deadline = sock, deadline

    def _left(self):
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("rpc exchange timed out")
        self._sock.settimeout(left)

    def recv(self, n):
        self._left()
        return self._sock.recv(n)

    def sendall(self, data):
        self._left()
        return self._sock.sendall(data)


def _ask(host, port, cmd, timeout):
    """One exchange with the rpc port at `host:port`, `timeout` seconds in
    all (connect, challenge, request, answer). Returns (reply, whether the
    server's end is a socket of this uid in this network namespace, the
    server's nonce, this asker's nonce, the server address dialled)."""
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as raw:
        s = _Within(raw, deadline)
        hello = recv_frame(s)
        if not hello.startswith(MAGIC) or len(hello) != len(MAGIC) + NONCE_BYTES:
            raise ConnectionError(f"{host}:{port} is not a kvwire Mooncake rpc port (of this version)")
        nonce = hello[len(MAGIC):]
        ours = False
        if cmd == b"M":
            # the server's end: local address = what we dialled, remote = us
            # (read while the connection is open; it is gone once closed)
            try:
                ours = _net.tcp_peer_uid(raw.getpeername(), raw.getsockname()) == os.getuid()
            except OSError:
                ours = False
        mine = os.urandom(NONCE_BYTES)
        where = _net.addr_bytes(raw.getpeername())
        send_frame(s, cmd + _proof(_token() if cmd == b"M" else None, nonce, cmd, where) + mine)
        return recv_frame(s), ours, nonce, mine, where


def describe(host, port, timeout=IO_TIMEOUT_S):
    """The peer's description (a dict). Raises OSError/ConnectionError when
    it cannot be reached, RpcRefused when it refused, RpcUntrusted when the
    server proved neither the token nor that it runs under this uid here,
    ValueError when the answer is not a JSON object."""
    reply, ours, nonce, mine, where = _ask(host, port, b"M", timeout)
    if reply[:1] != b"+":
        raise RpcRefused(reply[1:].decode(errors="replace"))
    seal, body = reply[1:1 + _net.PROOF_BYTES], reply[1 + _net.PROOF_BYTES:]
    token = _token()
    sealed = token is not None and hmac.compare_digest(seal, _seal(token, mine, nonce, where, body))
    if not (sealed or ours):
        raise RpcUntrusted(f"{host}:{port} is not a local process of this user and did not prove "
                           f"{TOKEN_ENV}" + ("" if token is not None else " (none is set here)"))
    desc = json.loads(body)
    if not isinstance(desc, dict):
        raise ValueError(f"{host}:{port}: a description must be a JSON object")
    return desc


def probe(host, port, timeout=IO_TIMEOUT_S):
    """True when the peer's rpc port answers a probe."""
    try:
        return _ask(host, port, b"P", timeout)[0] == b"+ok"
    except (OSError, ValueError, ConnectionError):
        return False
