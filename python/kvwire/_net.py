"""Socket helpers shared by the Python faces over kvwire (the `nixl` and
`mooncake` packages' side channels): length-prefixed frames, the
HMAC-SHA256 proof of a shared token over a listener's nonce, and the uid
that owns the other end of a local TCP connection. Plain Python, no
extension needed."""

import hashlib
import hmac
import ipaddress
import os
import socket
import struct
import threading

#: Bytes of a frame's length prefix (big-endian unsigned).
LEN_BYTES = 4
#: Bytes of :func:`proof`'s output (SHA-256).
PROOF_BYTES = 32


def recv_exact(sock, n):
    """Exactly `n` bytes from `sock`; ConnectionError when the peer closes
    first (the socket's own timeout bounds the wait)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock, max_bytes):
    """One frame: a 4-byte big-endian length, then that many bytes.
    ValueError for a length above `max_bytes` (nothing more is read)."""
    (n,) = struct.unpack(">I", recv_exact(sock, LEN_BYTES))
    if n > max_bytes:
        raise ValueError(f"frame of {n} bytes exceeds {max_bytes}")
    return recv_exact(sock, n)


def send_frame(sock, payload):
    """Send `payload` as one frame (see :func:`recv_frame`)."""
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def proof(token, nonce, data):
    """HMAC-SHA256(`token`, `nonce` + `data`): 32 bytes."""
    return hmac.new(token, nonce + data, hashlib.sha256).digest()


def _proc_addr(text):
    """`/proc/net/tcp{,6}` address ``HEX:PORT`` -> (ip_address, port); an
    IPv4-mapped IPv6 address as its IPv4 address."""
    h, p = text.split(":")
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:
        # four 32-bit words, each in host (little-endian) order
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return ip, int(p, 16)


def _sock_addr(addr):
    """A socket address tuple -> (ip_address, port), as :func:`_proc_addr`."""
    ip = ipaddress.ip_address(addr[0].split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(addr[1])


def _here():
    """This host's boot id and this process's network namespace (inode):
    what both ends of a loopback connection share and no other host or
    namespace does. Empty parts where /proc cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        ns = 0
    return f"@{boot}/{ns}"


def addr_bytes(addr):
    """A socket address tuple as bytes ``b"ip:port"`` (an IPv4-mapped IPv6
    address as its IPv4 address), for binding a proof to the address a
    connection was made to: the accepting side passes ``getsockname()``,
    the connecting side ``getpeername()``. A loopback address names the
    same port in every namespace and on every host, so it also carries
    the boot id and network namespace (``b"127.0.0.1:P@boot/netns"``): a
    proof for one namespace's 127.0.0.1:P does not vouch for another's."""
    ip, port = _sock_addr(addr)
    text = f"{ip}:{port}"
    if ip.is_loopback:
        text += _here()
    return text.encode()


def tcp_peer_uid(peer, local):
    """The uid owning the other end of an accepted TCP connection in this
    network namespace: the ESTABLISHED entry of /proc/net/tcp or tcp6 whose
    local address is `peer` (as ``accept()``/``getpeername()`` give it) and
    whose remote address is `local` (this end). None when there is no such
    entry (a connection from another namespace or host) or the tables
    cannot be read."""
    try:
        want_l, want_r = _sock_addr(peer), _sock_addr(local)
    except (ValueError, IndexError):
        return None
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local rem st queues tr retrnsmt uid ...; st 01 = ESTABLISHED
            cols = line.split()
            if len(cols) < 8 or cols[3] != "01":
                continue
            try:
                if _proc_addr(cols[1]) == want_l and _proc_addr(cols[2]) == want_r:
                    return int(cols[7])
            except ValueError:
                continue
    return None


class Served:
    """The connections a listener serves at once, oldest first, at most
    `limit`: adding one past it shuts the oldest down (its thread sees EOF
    and ends), so silent callers hold at most `limit` threads. Shutting down
    and closing happen under one lock, so a descriptor is never shut down
    after it was closed and reused."""

    def __init__(self, limit):
        self.limit = limit
        self._conns = {}
        self._lock = threading.Lock()

    def __len__(self):
        with self._lock:
            return len(self._conns)

    def add(self, conn):
        with self._lock:
            while len(self._conns) >= self.limit:
                oldest = next(iter(self._conns))
                del self._conns[oldest]
                _shutdown(oldest)
            self._conns[conn] = True

    def take(self, conn):
        """Stop counting `conn` (it is no longer a silent caller); False
        when it was shut down for a newer one meanwhile."""
        with self._lock:
            return self._conns.pop(conn, False)

    def forget(self, conn):
        """Stop counting `conn` and close it."""
        with self._lock:
            self._conns.pop(conn, None)
            conn.close()

    def shutdown_all(self):
        with self._lock:
            for conn in self._conns:
                _shutdown(conn)


def _shutdown(conn):
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
