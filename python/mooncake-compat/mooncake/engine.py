"""``mooncake.engine``: Mooncake Transfer Engine 0.3's Python API
(``TransferEngine``, ``TransferOpcode``, ``TransferNotify``) over kvwire.

Written from Mooncake's public API description; no Mooncake code. Every
transfer call returns Mooncake's integer codes and never raises; the
features kvwire cannot stand in for raise ``NotImplementedError`` naming
the reason and the alternative. See docs/MOONCAKE.md.

Transport rule (``initialize(..., protocol, device_name)``):

1. ``KVWIRE_MOONCAKE_TRANSPORT=shm|tcp|verbs`` wins when set.
2. ``MC_FORCE_TCP`` set (to anything but 0/false/off/no): tcp.
3. ``protocol="rdma"``: verbs when an RDMA port is ACTIVE on this host
   (``device_name``: comma list of NICs, the first is used); else, as
   Mooncake falls back to TCP, the tcp rule below.
4. ``protocol="tcp"``: shm when ``local_hostname`` is a loopback address
   (every peer that can reach a loopback session is on this host), else tcp.
5. any other protocol (efa, cxi, nvlink, hip, ...): ``initialize`` returns -1.

Peers are found by session id ``host:rpc_port`` (``P2PHANDSHAKE``): the rpc
port is kvwire's own side channel (``mooncake._rpc``) that hands the
engine's kvwire metadata and buffer list to a local or token-holding asker.
``etcd://host:port`` keeps ``segment name -> host:rpc_port`` in etcd (v3 JSON
gateway) and then does the same.
"""

import array
import base64
import bisect
import collections
import contextlib
import ctypes
import enum
import glob
import ipaddress
import json
import logging
import operator
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref

import numpy as np

from kvwire._kvwire import NixlCore, NixlCoreError

from . import _rpc

logger = logging.getLogger("mooncake.kvwire")
if not logger.handlers and not logging.getLogger().handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("mooncake(kvwire) %(levelname)s: %(message)s"))
    logger.addHandler(_h)
    logger.setLevel(os.environ.get("KVWIRE_MOONCAKE_LOG", "WARNING").upper())

P2PHANDSHAKE = "P2PHANDSHAKE"

# Mooncake's error codes (mooncake-transfer-engine/include/error.h).
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_DEVICE_NOT_FOUND = -6
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
ERR_METADATA = -200

SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False
SUPPORT_CUDA = False
#: Marks this implementation: ``mooncake.engine.KVWIRE`` is absent in Mooncake's.
KVWIRE = True

# NIXL status codes the kvwire core raises (kvwire python/src/nixl.rs).
_BACKEND = -3
_NOT_FOUND = -4
_REMOTE_DISCONNECT = -10
# _poll/_wait: the transfer failed with the backend's error (a remote access
# error: the target refused a key or range), which a stale description of
# the target explains; any other failure is -1.
_REFUSED = -3
# Longest single sleep of a sync call inside the core (seconds).
_WAIT_SLICE_S = 0.1
# How many freed batch ids keep their final answer (1, -1, -2), so a thread
# that checks an id another thread just finished gets that answer rather
# than "unknown id" (Mooncake frees the id; checking it again there is a
# use after free). Ids are never reused, so a kept answer is never stale.
_FINISHED_KEPT = 1024

_OFF = {"", "0", "false", "off", "no"}


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: ``name`` and ``msg`` (strings), as Mooncake's."""

    def __init__(self, name="", msg=""):
        # Strings, as the std::string fields of Mooncake's binding (which
        # raises TypeError for anything else); bytes are read as UTF-8.
        self.name = name
        self.msg = msg

    def __setattr__(self, key, value):
        if key in ("name", "msg"):
            value = self._str(value, key)
        object.__setattr__(self, key, value)

    @staticmethod
    def _str(v, what):
        if isinstance(v, str):
            return v
        if isinstance(v, (bytes, bytearray)):
            return bytes(v).decode(errors="replace")
        raise TypeError(f"TransferNotify.{what} must be str, not {type(v).__name__}")

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other):
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)


_ABSENT = {
    "InnerTransferEngine": "Mooncake's C++ engine object has no kvwire counterpart (see TransferEngine.get_engine)",
    "SharedSegment": "Mooncake's shared segments belong to Mooncake Store",
    "RpcInterface": "Mooncake's coro-RPC tensor channel is not part of kvwire",
    "CoroRPCInterface": "Mooncake's coro-RPC tensor channel is not part of kvwire",
    "ReceivedData": "Mooncake's coro-RPC tensor channel is not part of kvwire",
    "ReceivedTensor": "Mooncake's coro-RPC tensor channel is not part of kvwire",
    "create_rpc_client": "Mooncake's coro-RPC tensor channel is not part of kvwire",
    "create_rpc_server": "Mooncake's coro-RPC tensor channel is not part of kvwire",
}


def __getattr__(name):
    if name in _ABSENT:
        raise AttributeError(f"mooncake.engine.{name} is not provided by kvwire: {_ABSENT[name]}")
    raise AttributeError(f"module 'mooncake.engine' has no attribute {name!r}")


def _not_supported(what, why):
    return NotImplementedError(f"mooncake (kvwire): {what} is not supported: {why}")


def _env_on(name):
    v = os.environ.get(name)
    return v is not None and v.strip().lower() not in _OFF


def _active_rdma_port():
    for state in glob.glob("/sys/class/infiniband/*/ports/*/state"):
        try:
            with open(state) as f:
                if "ACTIVE" in f.read():
                    return True
        except OSError:
            pass
    return False


def _split_host_port(name):
    """``host:port`` / ``[v6]:port`` / ``host`` -> (host, port or None);
    a port outside 1..65535 is None (not wrapped by the resolver)."""
    name = str(name).strip()
    if name.startswith("["):
        host, _, rest = name[1:].partition("]")
        rest = rest.lstrip(":")
        return host, _port(rest)
    host, sep, port = name.rpartition(":")
    if sep and _digits(port) and ":" not in host:
        return host, _port(port)
    return name, None


def _port(text):
    # at most 5 digits: int() refuses (raises on) thousands of them
    return int(text) if _digits(text) and len(text) <= 5 and 0 < int(text) < 65536 else None


def _digits(text):
    return text.isascii() and text.isdigit()  # not "²" or "٣", which str.isdigit takes


def _resolve(host):
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def _is_loopback(host):
    ip = _resolve(host) if host else None
    return ip is not None and ipaddress.ip_address(ip).is_loopback


def transport_for(protocol, local_host):
    """The kvwire transport for `protocol` on `local_host` (module docs), or
    None with the reason when there is none."""
    forced = os.environ.get("KVWIRE_MOONCAKE_TRANSPORT", "").strip().lower()
    if forced:
        if forced in ("shm", "tcp", "verbs"):
            return forced, ""
        return None, f"KVWIRE_MOONCAKE_TRANSPORT={forced!r}: expected shm, tcp or verbs"
    protocol = (protocol or "").strip().lower()
    if _env_on("MC_FORCE_TCP"):
        return "tcp", ""
    if protocol == "rdma" and _active_rdma_port():
        return "verbs", ""
    if protocol in ("rdma", "tcp"):
        return ("shm" if _is_loopback(local_host) else "tcp"), ""
    return None, (f"protocol {protocol!r} is not offered by kvwire (rdma -> verbs, tcp -> tcp/shm); "
                  "use protocol='rdma' or 'tcp'")


def _first_device(device_name):
    """The first NIC of Mooncake's ``device_name``: a comma list
    (``"mlx5_0,mlx5_1"``, ``"mlx5_0:1"``) or a JSON map of GPU -> NICs
    (``{"0": "mlx5_0,mlx5_1"}``, as SGLang's --disaggregation-ib-device
    accepts); "" for none."""
    text = (device_name or "").strip()
    if text.startswith("{"):
        try:
            first = next(iter(json.loads(text).values()), "")
        except (ValueError, AttributeError):
            return ""
        text = ",".join(first) if isinstance(first, list) else str(first)
    return text.split(",")[0].split(":")[0].strip()


def _timeout_s():
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return 30.0
    try:
        return float(max(5, int(raw)))
    except ValueError:
        return 30.0


# -- CUDA pointers (optional; without libcuda everything is host memory) --

_cuda = None
_cuda_tried = False


def _cuda_lib():
    global _cuda, _cuda_tried
    if not _cuda_tried:
        _cuda_tried = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            if lib.cuInit(0) == 0:
                _cuda = lib
        except OSError:
            _cuda = None
    return _cuda


def _memory_of(addr, location):
    """(``"DRAM"``/``"VRAM"``, device) for a buffer, from Mooncake's
    ``location`` (``"cuda:N"``, ``"cpu:N"``, ``"*"``) or, for ``"*"``, the
    CUDA driver's view of the pointer when libcuda is present."""
    loc = (location or "*").strip().lower()
    if loc.startswith(("cuda:", "gpu:")):
        return "VRAM", int(loc.split(":", 1)[1] or 0)
    if loc.startswith("cpu"):
        return "DRAM", 0
    lib = _cuda_lib()
    if lib is None:
        return "DRAM", 0
    ptr = ctypes.c_uint64(addr)
    get_attr = getattr(lib, "cuPointerGetAttribute", None)
    if get_attr is not None:
        mtype = ctypes.c_uint(0)
        # CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2; CU_MEMORYTYPE_DEVICE = 2
        if get_attr(ctypes.byref(mtype), 2, ptr) == 0 and mtype.value == 2:
            dev = ctypes.c_int(0)
            get_attr(ctypes.byref(dev), 9, ptr)  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
            return "VRAM", dev.value
        return "DRAM", 0
    # a driver without cuPointerGetAttribute: device memory is what
    # cuMemGetAddressRange knows (device 0)
    get_range = getattr(lib, "cuMemGetAddressRange_v2", None)
    if get_range is not None:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        if get_range(ctypes.byref(base), ctypes.byref(size), ptr) == 0 and size.value:
            return "VRAM", 0
    return "DRAM", 0


# -- etcd (v3 JSON gateway) ---------------------------------------------

class _Etcd:
    PREFIX = "mooncake/kvwire/rpc/"

    def __init__(self, endpoints):
        self.endpoints = [e if "://" in e else "http://" + e for e in endpoints.split(",") if e.strip()]

    def _post(self, path, body):
        last = None
        for ep in self.endpoints:
            try:
                req = urllib.request.Request(ep.rstrip("/") + path, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    return json.loads(r.read() or b"{}")
            except Exception as e:  # noqa: BLE001 - unreachable, or any bad answer (RecursionError): OSError below
                last = e
        raise OSError(f"etcd {self.endpoints}: {last}")

    @staticmethod
    def _b64(s):
        return base64.b64encode(s.encode()).decode()

    def put(self, name, value):
        self._post("/v3/kv/put", {"key": self._b64(self.PREFIX + name), "value": self._b64(value)})

    def get(self, name):
        kvs = self._post("/v3/kv/range", {"key": self._b64(self.PREFIX + name)}).get("kvs") or []
        return base64.b64decode(kvs[0]["value"]).decode() if kvs else None

    def delete(self, name):
        self._post("/v3/kv/deleterange", {"key": self._b64(self.PREFIX + name)})


class _Session:
    __slots__ = ("name", "host", "port", "agent", "instance", "buffers", "transport", "md", "seq")

    def __init__(self, name, host, port, desc):
        self.name, self.host, self.port = name, host, port
        self.seq = 0  # TransferEngine._load_seq when recorded
        self.agent = desc["agent"]
        self.instance = desc["instance"]
        self.buffers = [tuple(b) for b in desc["buffers"]]
        self.transport = desc["transport"]
        self.md = desc.get("md")


def _checked(desc):
    """A peer's description (`_rpc.describe`) checked field by field before
    anything uses it; returns its agent metadata (bytes). ValueError or
    TypeError names the first bad field."""
    for key in ("agent", "instance", "transport", "md"):
        if not isinstance(desc.get(key), str) or not desc[key]:
            raise ValueError(f"{key!r} must be a non-empty string")
    bufs = desc.get("buffers")
    if not isinstance(bufs, list):
        raise ValueError("'buffers' must be a list of [address, length]")
    for b in bufs:
        if not (isinstance(b, list) and len(b) == 2 and all(type(v) is int and 0 <= v < 1 << 64 for v in b)):
            raise ValueError(f"'buffers' entry {str(b)[:64]} is not [address, length] (u64)")
    return base64.b64decode(desc["md"], validate=True)


class _Refused(Exception):
    """_submit: the backend refused the post (args: the _Session, why)."""


class _LoadSlot:
    """One agent's loads (TransferEngine._loading): the lock that runs them
    one at a time, how many callers hold or wait for it, and the last failed
    load (count, the peer instance it was of, why)."""

    __slots__ = ("lock", "users", "failures", "failed_instance", "why")

    def __init__(self):
        self.lock = threading.Lock()
        self.users = self.failures = 0
        self.failed_instance = self.why = None


class _Batch:
    """An async batch: its request, deadline, session name, the _Session it
    was posted with, and whether it was posted again (`TransferEngine._retry`)."""

    __slots__ = ("rid", "deadline", "session", "used", "retried", "lock", "result")

    def __init__(self, rid, deadline, session, used):
        self.rid, self.deadline, self.session, self.used = rid, deadline, session, used
        self.retried = False
        # Held while one thread polls, posts again or waits (two threads
        # checking one id must not both repost, or release what the other
        # posts); `result` is the final code once there is one.
        self.lock = threading.Lock()
        self.result = None


_NOTIFY_MAGIC = b"MCKVN1"
_STALE = object()  # TransferEngine._open: the description fetched may be of a dead instance


def _pack_notify(name, msg):
    n, m = str(name).encode(), str(msg).encode()
    return _NOTIFY_MAGIC + len(n).to_bytes(4, "big") + n + m


def _unpack_notify(sender, payload):
    if payload.startswith(_NOTIFY_MAGIC) and len(payload) >= len(_NOTIFY_MAGIC) + 4:
        k = len(_NOTIFY_MAGIC)
        n = int.from_bytes(payload[k:k + 4], "big")
        name = payload[k + 4:k + 4 + n].decode(errors="replace")
        return TransferNotify(name, payload[k + 4 + n:].decode(errors="replace"))
    return TransferNotify(sender, payload.decode(errors="replace"))


def _opcode(opcode):
    """TransferOpcode, or None (the transfer then fails with Mooncake's code)."""
    try:
        return TransferOpcode(int(opcode))
    except (TypeError, ValueError):
        logger.error("unknown opcode %r (TransferOpcode.Read or .Write)", opcode)
        return None


def _all_zero(lengths):
    """Whether every length (an int or anything with `__index__`) is 0;
    False for anything else (the transfer path then refuses it)."""
    try:
        return all(operator.index(n) == 0 for n in lengths)
    except TypeError:
        return False


def _ints(x, code):
    """A sequence of ints as a 1-D numpy array (``"Q"`` uint64, ``"q"``
    int64). Lists go through ``array.array`` (half the cost of
    ``np.asarray`` per element); raises TypeError/ValueError/OverflowError
    (e.g. a negative address) on bad input."""
    dtype = np.uint64 if code == "Q" else np.int64
    if not isinstance(x, np.ndarray):
        try:
            return np.frombuffer(array.array(code, x), dtype=dtype)
        except TypeError:
            x = np.asarray(x)
    if x.dtype.kind not in "iu":  # floats are refused, not truncated (as a list's are)
        raise TypeError(f"an integer array is required, not {x.dtype}")
    return x.astype(dtype, copy=False).reshape(-1)


def _rows(addrs, lens):
    """(addr, len) rows as the kvwire core takes them: little-endian u64 pairs."""
    a = np.empty((len(addrs), 2), dtype="<u8")
    a[:, 0] = addrs
    a[:, 1] = lens
    return a.tobytes()


def _uintptr(x, call):
    """`x` as a uintptr_t, as pybind11 converts one: an int (or anything
    with ``__index__``, never a float or a string) in [0, 2**64), else
    TypeError (pybind11's "incompatible function arguments")."""
    n = operator.index(x)
    if not 0 <= n < 1 << 64:
        raise TypeError(f"{call}: {n} is not an address (0 <= address < 2**64)")
    return n


def _size_t(length, call):
    """`length` as a size_t, as pybind11 converts one: an int >= 0, else TypeError."""
    n = operator.index(length)
    if n < 0:
        raise TypeError(f"{call}: length must not be negative (got {n})")
    return n


def _weak_describe(engine):
    """`engine` (a weak reference)'s ``_describe``, for its rpc server."""

    def describe():
        e = engine()
        if e is None:
            raise RuntimeError("engine dropped")
        return e._describe()

    return describe


class TransferEngine:
    """Mooncake's ``TransferEngine`` over kvwire (see the module docs)."""

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._core = None
        self._lock = threading.RLock()
        self._regs = {}  # addr -> length, in registration order
        self._starts = []  # the keys of _regs, sorted (overlap checks)
        self._managed = {}  # addr -> length (memory from the core's alloc_host)
        self._sessions = {}  # session id -> _Session
        self._load_locks = {}  # agent -> _LoadSlot (_loading)
        self._load_seq = 0  # sessions recorded so far (_open)
        self._agent_seq = {}  # agent -> _load_seq when a session of it was last recorded
        self._batches = {}  # id -> _Batch
        self._finished = collections.OrderedDict()  # freed id -> final answer, the last _FINISHED_KEPT
        self._next_batch = 0
        self._server = None
        self._etcd = None
        self._names = set()
        self.session_id = ""
        self._instance = uuid.uuid4().hex
        self._timeout = _timeout_s()
        self._transport = None

    # -- setup ----------------------------------------------------------
    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        ms = str(metadata_server or "")
        if ms == P2PHANDSHAKE:
            return self.initialize_ext(local_hostname, P2PHANDSHAKE, protocol, device_name, "")
        if "://" in ms:
            kind, _, rest = ms.partition("://")
        else:
            kind, rest = "etcd", ms  # Mooncake's default metadata type
        return self.initialize_ext(local_hostname, rest, protocol, device_name, kind)

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        try:
            return self._init(str(local_hostname or ""), str(metadata_server or ""), str(protocol or ""),
                              str(device_name or ""), str(metadata_type or ""))
        except Exception as e:  # noqa: BLE001 - Mooncake returns -1, never raises
            logger.error("initialize failed: %s", e)
            self._teardown()
            return -1

    def _init(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        if self._core is not None:
            logger.error("initialize: this engine is already initialized")
            return -1
        self._etcd = None  # from a failed earlier attempt
        self._instance = uuid.uuid4().hex  # each initialize is a new instance to peers (new core, new secret)
        host, port = _split_host_port(local_hostname)
        if not host:
            logger.error("initialize: empty local_hostname")
            return -1
        p2p = metadata_server == P2PHANDSHAKE or metadata_type in ("p2p", "P2PHANDSHAKE")
        if not p2p:
            if metadata_type != "etcd":
                logger.error("initialize: metadata server type %r is not supported by kvwire "
                             "(use P2PHANDSHAKE or etcd://host:port)", metadata_type)
                return -1
            self._etcd = _Etcd(metadata_server)
        transport, why = transport_for(protocol, host)
        if transport is None:
            logger.error("initialize: %s", why)
            return -1
        # The rpc port: random in [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]
        # (15000..17000), as Mooncake picks it.
        sock = self._bind_rpc()
        if sock is None:
            logger.error("initialize: no free rpc port in the MC_MIN_RPC_PORT..MC_MAX_RPC_PORT range")
            return -1
        rpc_port = sock.getsockname()[1]
        self.session_id = f"{host}:{rpc_port}" if p2p else local_hostname
        self._names = {self.session_id, local_hostname}
        options = []
        ip = _resolve(host)
        if transport == "tcp" and ip and not os.environ.get("KVWIRE_TCP_LISTEN"):
            bind = os.environ.get("MC_TCP_BIND_ADDRESS") or ip
            options.append(("listen", f"{bind}:0"))
        if transport == "verbs":
            dev = _first_device(device_name)
            if dev:
                options.append(("device", dev))
        try:
            self._core = NixlCore(self.session_id, transport, 2, int(self._timeout * 1000), options)
        except (NixlCoreError, ValueError) as e:
            sock.close()
            logger.error("initialize: kvwire %s transport: %s", transport, e)
            return -1
        self._transport = transport
        # The rpc threads hold the engine weakly: an engine its owner drops
        # without close() is torn down by __del__ (as Mooncake's destructor
        # does), never kept alive and remotely writable by its own server.
        self._server = _rpc.RpcServer(sock, _weak_describe(weakref.ref(self)))
        if self._etcd is not None:
            try:
                self._etcd.put(self.session_id, f"{ip or host}:{rpc_port}")
            except OSError as e:
                logger.error("initialize: %s", e)
                self._teardown()
                return -1
        logger.info("engine %s on kvwire %s", self.session_id, transport)
        return 0

    @staticmethod
    def _bind_rpc():
        lo, hi = 15000, 17000
        try:
            lo = int(os.environ.get("MC_MIN_RPC_PORT") or os.environ.get("MC_MIN_PRC_PORT") or lo)
            hi = int(os.environ.get("MC_MAX_RPC_PORT") or os.environ.get("MC_MAX_PRC_PORT") or hi)
        except ValueError:
            pass
        if not (1024 < lo <= hi < 65536):
            lo, hi = 15000, 17000
        ports = list(range(lo, hi + 1))
        random.shuffle(ports)
        for p in ports[:500]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted peer gets its port back
            try:
                s.bind(("0.0.0.0", p))
                s.listen(128)
                return s
            except OSError:
                s.close()
        return None

    def _teardown(self):
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._etcd is not None and self.session_id:
            try:
                self._etcd.delete(self.session_id)
            except OSError:
                pass
        self._core = None

    def get_rpc_port(self):
        return self._server.port if self._server is not None else -1

    def get_local_topology(self, device_name=None):
        devs = sorted(os.path.basename(d) for d in glob.glob("/sys/class/infiniband/*"))
        if device_name:
            keep = {d.split(":")[0].strip() for d in str(device_name).split(",")}
            devs = [d for d in devs if d in keep]
        return json.dumps({"cpu:0": [devs, []]})

    def get_engine(self):
        raise _not_supported("get_engine()", "Mooncake's C++ TransferEngine object (for mooncake.pg / "
                             "mooncake.store / EP buffers) does not exist in kvwire; use torch.distributed "
                             "process groups, and this TransferEngine's Python methods for KV transfers")

    def get_engine_ptr(self):
        raise _not_supported("get_engine_ptr()", "there is no C++ engine object to point at; see get_engine()")

    def warmup_efa_segment(self, segment_name):
        return 0  # Mooncake returns 0 where EFA is not installed

    def close(self):
        """Stop serving and drop the kvwire engine (kvwire extension; Mooncake
        frees on destruction, as this engine's ``__del__`` does). Its
        registrations and sessions go with it: a later ``initialize`` starts
        from none."""
        with self._lock:
            self._teardown()  # the core, and the managed memory it holds, go with it
            self._managed.clear()
            self._regs.clear()
            self._starts.clear()
            self._sessions.clear()
            self._agent_seq.clear()
            self._load_locks = {}  # loads of the closed core end on their own slots

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit modules may be gone
            pass

    # -- this engine's description, served on the rpc port ---------------
    def _describe(self):
        core = self._core
        if core is None:
            raise RuntimeError("engine closed")
        with self._lock:
            bufs = [[a, n] for a, n in self._regs.items()]
        md = bytes(core.metadata())
        return json.dumps({"v": 1, "agent": core.name, "instance": self._instance, "transport": self._transport,
                           "buffers": bufs, "md": base64.b64encode(md).decode()}).encode()

    # -- memory -----------------------------------------------------------
    def register_memory(self, buffer_addr, capacity, location="*"):
        return self.batch_register_memory([buffer_addr], [capacity], location)

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        core = self._core
        if core is None:
            logger.error("register_memory before initialize")
            return ERR_INVALID_ARGUMENT
        try:
            addrs, caps = list(buffer_addresses), list(capacities)
            if len(addrs) != len(caps):
                raise ValueError(f"{len(addrs)} addresses but {len(caps)} capacities")
            # operator.index: a float or a string is refused, never truncated
            pairs = [(operator.index(a), operator.index(n)) for a, n in zip(addrs, caps)]
        except (TypeError, ValueError) as e:
            logger.error("batch_register_memory: %s", e)
            return ERR_INVALID_ARGUMENT
        done = []
        with self._lock:
            for addr, n in pairs:
                if addr in self._regs:
                    logger.error("register_memory: %#x is already registered", addr)
                    rc = ERR_ADDRESS_OVERLAPPED
                elif self._overlaps(addr, n):
                    # Mooncake refuses overlapping registrations
                    # (TransferEngine::registerLocalMemory: "does not support
                    # overlapped memory region"); kvwire's engine accepts
                    # them, as NIXL does, so the refusal lives here.
                    logger.error("register_memory %#x+%d overlaps a registration", addr, n)
                    rc = ERR_ADDRESS_OVERLAPPED
                else:
                    try:
                        mem, dev = _memory_of(addr, location)
                    except (ValueError, OSError, AttributeError, ctypes.ArgumentError) as e:
                        logger.error("register_memory %#x: location %r: %s", addr, location, e)
                        mem = None
                    if mem is None:
                        rc = ERR_INVALID_ARGUMENT
                    else:
                        try:
                            core.register(addr, n, mem, dev)
                            self._regs[addr] = n
                            bisect.insort(self._starts, addr)
                            done.append((addr, n))
                            continue
                        except (NixlCoreError, OverflowError) as e:
                            logger.error("register_memory %#x+%d: %s", addr, n, e.args[-1])
                            rc = ERR_INVALID_ARGUMENT
                for a, k in done:  # all or nothing
                    try:
                        core.deregister(a, k)
                    except NixlCoreError:
                        pass
                    if self._regs.pop(a, None) is not None:
                        self._starts.remove(a)
                return rc
        return 0

    def _overlaps(self, addr, n):
        """True when [addr, addr + n) shares a byte with a registration
        (registrations never overlap one another here, so the neighbours by
        start address are the only candidates). Call with the lock held."""
        i = bisect.bisect_right(self._starts, addr)
        if i > 0 and self._starts[i - 1] + self._regs[self._starts[i - 1]] > addr:
            return True
        return i < len(self._starts) and self._starts[i] < addr + n

    def unregister_memory(self, buffer_addr):
        return self.batch_unregister_memory([buffer_addr])

    def batch_unregister_memory(self, buffer_addresses):
        core = self._core
        if core is None:
            return ERR_INVALID_ARGUMENT
        try:
            addrs = [operator.index(a) for a in buffer_addresses]
        except TypeError as e:
            logger.error("unregister_memory: %s", e)
            return ERR_INVALID_ARGUMENT
        rc = 0
        with self._lock:
            for a in addrs:
                n = self._regs.get(a)
                if n is None:
                    logger.error("unregister_memory: %#x is not registered", a)
                    rc = ERR_ADDRESS_NOT_REGISTERED
                    continue
                try:
                    core.deregister(a, n)
                    del self._regs[a]
                    self._starts.remove(a)
                except NixlCoreError as e:
                    logger.error("unregister_memory %#x: %s", a, e.args[-1])
                    rc = ERR_INVALID_ARGUMENT
        return rc

    def allocate_managed_buffer(self, length):
        """``length`` bytes of zeroed host memory, registered; 0 on failure.
        kvwire allocates it (a sealed memfd), so peers on this host on shm
        map it and copy with plain stores instead of by cross-memory attach."""
        try:
            length = operator.index(length)
        except TypeError as e:
            logger.error("allocate_managed_buffer: %s", e)
            return 0
        core = self._core
        if length <= 0 or core is None:
            return 0
        try:
            addr = core.alloc_host(length)
        except (NixlCoreError, ValueError, OverflowError) as e:
            logger.error("allocate_managed_buffer(%d): %s", length, e.args[-1])
            return 0
        if self.register_memory(addr, length, "cpu:0") != 0:
            core.free_host(addr)
            return 0
        with self._lock:
            self._managed[addr] = length
        return addr

    def free_managed_buffer(self, buffer_addr, length):
        try:
            addr = operator.index(buffer_addr)
        except TypeError as e:
            logger.error("free_managed_buffer: %s", e)
            return ERR_INVALID_ARGUMENT
        with self._lock:
            if addr not in self._managed:
                logger.error("free_managed_buffer: %#x was not allocated here", addr)
                return ERR_INVALID_ARGUMENT
            if addr in self._regs:  # the caller may have unregistered it already
                rc = self.unregister_memory(addr)
                if rc != 0:
                    return rc
            del self._managed[addr]
            try:
                self._core.free_host(addr)
            except (NixlCoreError, AttributeError):
                pass  # the engine (and its memory) is gone already
        return 0

    def get_first_buffer_address(self, segment_name):
        if segment_name in self._names:
            with self._lock:
                return next(iter(self._regs), 0)
        if self._core is None:
            return 0
        # The peer's description only, as Mooncake reads the segment's
        # metadata: no data connection (a peer whose data port is silent
        # answers at once).
        fetched = self._fetch(str(segment_name), 5.0, drop=False)
        return fetched[0].buffers[0][0] if fetched is not None and fetched[0].buffers else 0

    @staticmethod
    def write_bytes_to_buffer(dest_address, src_ptr, length):
        # As Mooncake's binding (`char *src_ptr, size_t length`): the source
        # is bytes-like or str (UTF-8), the length not negative (TypeError,
        # as pybind11's size_t); at most len(src) bytes are written.
        if isinstance(src_ptr, str):
            data = src_ptr.encode()
        elif isinstance(src_ptr, (bytes, bytearray, memoryview)):
            data = bytes(src_ptr)
        else:
            raise TypeError(f"write_bytes_to_buffer: src_ptr must be bytes or str, not {type(src_ptr).__name__}")
        dest = _uintptr(dest_address, "write_bytes_to_buffer")
        n = _size_t(length, "write_bytes_to_buffer")
        ctypes.memmove(dest, data, min(n, len(data)))
        return 0

    @staticmethod
    def read_bytes_from_buffer(source_address, length):
        # Exactly `length` bytes, as Mooncake's py::bytes(ptr, size_t):
        # ctypes.string_at takes a C int (2 GiB and more were cut or read
        # to the first NUL).
        src = _uintptr(source_address, "read_bytes_from_buffer")
        n = _size_t(length, "read_bytes_from_buffer")
        return bytes((ctypes.c_char * n).from_address(src)) if n else b""

    # -- sessions ---------------------------------------------------------
    def _locate(self, name):
        """(host, rpc port) of session `name`, or None."""
        if self._etcd is not None:
            try:
                ep = self._etcd.get(name)
            except Exception as e:  # noqa: BLE001 - unreachable, or any bad record: a code, never raised
                logger.error("session %s: etcd: %s", name, e)
                return None
            if ep is None:
                logger.error("session %s: not in etcd", name)
                return None
            name = ep
        host, port = _split_host_port(name)
        if port is None:
            logger.error("session %r: expected host:rpc_port", name)
            return None
        return host, port

    def _session(self, name, refresh=False, rpc_timeout=5.0, drop=True):
        """The open session `name` (fetching the peer's description on first
        use or when `refresh`, waiting at most `rpc_timeout` seconds for its
        rpc port), or None (logged). An unreachable peer is forgotten unless
        not `drop`."""
        core = self._core
        if core is None:
            return None
        name = str(name)
        if name in self._names:
            return _Session(name, "", 0, {"agent": core.name, "instance": self._instance,
                                          "buffers": list(self._regs.items()), "transport": self._transport})
        with self._lock:
            s = self._sessions.get(name)
            if s is not None and not refresh:
                return s
        for _ in range(2):
            seen = self._load_seq
            fetched = self._fetch(name, rpc_timeout, drop)
            if fetched is None:
                return None
            new = self._open(core, name, seen, *fetched)
            if new is not _STALE:
                return new
        logger.error("session %s: its peer restarted twice while this engine loaded it", name)
        return None

    def _fetch(self, name, rpc_timeout, drop):
        """(new _Session, agent metadata) of session `name` from its rpc
        port, or None (logged)."""
        where = self._locate(name)
        if where is None:
            return None
        try:
            desc = _rpc.describe(where[0], where[1], timeout=min(rpc_timeout, self._timeout))
        except _rpc.RpcRefused as e:
            logger.error("session %s refused to describe itself: %s", name, e)
            return None
        except _rpc.RpcUntrusted as e:
            logger.error("session %s: not using its description: %s", name, e)
            return None
        except (OSError, ValueError, ConnectionError) as e:
            logger.error("session %s unreachable: %s", name, e)
            if drop:
                self._drop(name)
            return None
        except Exception as e:  # noqa: BLE001 - e.g. RecursionError from a deeply nested JSON answer
            logger.error("session %s: unusable answer from its rpc port: %s", name, e)
            return None
        try:
            md = _checked(desc)
        except Exception as e:  # noqa: BLE001 - any malformed field: a code, never raised
            logger.error("session %s sent a malformed description: %s", name, e)
            return None
        if desc.get("transport") != self._transport:
            logger.error("session %s uses kvwire %s, this engine %s (see the transport rule in "
                         "docs/MOONCAKE.md; KVWIRE_MOONCAKE_TRANSPORT sets both)", name, desc.get("transport"),
                         self._transport)
            return None
        return _Session(name, where[0], where[1], desc), md

    def _open(self, core, name, seen, new, md):
        """Load `new` (a session fetched when the load count was `seen`) into
        the core and record it; returns it, None (logged), or _STALE when
        another instance of its peer was loaded after the fetch began (the
        peer restarted meanwhile: `new` may describe the dead one)."""
        # One load of a peer at a time; the engine lock is held only to
        # decide and to record, never while the peer answers its handshake
        # (the core dials without its own lock too), so a peer whose data
        # port is silent holds the callers of its own session only.
        # One peer may be reached under several session names (host names
        # or addresses of one machine): they share its kvwire agent, which
        # is loaded once and forgotten only for another instance of it.
        with self._loading(new.agent) as (slot, failures):
            with self._lock:
                if self._core is not core:
                    logger.error("session %s: the engine was closed meanwhile", name)
                    return None
                old = self._sessions.get(name)
                same = [n for n, x in self._sessions.items() if x.agent == new.agent]
                current = any(self._sessions[n].instance == new.instance for n in same)
                # Another instance recorded after this fetch began, under
                # this name or (same agent) another: the peer restarted
                # meanwhile and `new` may describe the dead one.
                if (old is not None and old.instance != new.instance and old.seq > seen) or (
                        not current and same and self._agent_seq.get(new.agent, 0) > seen):
                    return _STALE
                if slot.failures != failures and slot.failed_instance == new.instance:
                    # Callers queued behind a failed load of the same
                    # instance take its answer instead of a timeout each.
                    logger.error("session %s: loading its metadata failed in another call just now: %s", name,
                                 slot.why)
                    return None
                if old is not None and old.agent != new.agent:
                    self._sessions.pop(name)  # another engine answers under this name now
                    self._forget_unused(old.agent)
                    same = [n for n, x in self._sessions.items() if x.agent == new.agent]
                if not current:
                    if same or core.is_loaded(new.agent):
                        # A restarted peer (new secret, new regions), or one
                        # loaded by an earlier, dropped session: connect
                        # afresh; names that knew the old instance fetch the
                        # new one.
                        for n in same:
                            del self._sessions[n]
                        self._forget(new.agent)
            try:
                core.load(md)
            except NixlCoreError as e:
                logger.error("session %s: loading its metadata failed: %s", name, e.args[-1])
                slot.failures += 1
                slot.failed_instance, slot.why = new.instance, e.args[-1]
                with self._lock:
                    self._sessions.pop(name, None)
                return None
            with self._lock:
                if self._core is not core:
                    logger.error("session %s: the engine was closed meanwhile", name)
                    return None
                self._load_seq += 1
                new.seq = self._agent_seq[new.agent] = self._load_seq
                self._sessions[name] = new
        return new

    @contextlib.contextmanager
    def _loading(self, agent):
        """Hold `agent`'s load slot (one per agent, kept while used); yields
        (the slot, its failure count when this caller began to wait)."""
        with self._lock:
            slot = self._load_locks.get(agent)
            if slot is None:
                slot = self._load_locks[agent] = _LoadSlot()
            slot.users += 1
            failures = slot.failures
        try:
            with slot.lock:
                yield slot, failures
        finally:
            with self._lock:
                slot.users -= 1
                if slot.users == 0 and self._load_locks.get(agent) is slot:
                    del self._load_locks[agent]

    def _forget(self, agent):
        core = self._core
        if core is None:
            return  # closed: the core and its peers are gone already
        try:
            core.forget(agent)
        except NixlCoreError:
            pass

    def _forget_unused(self, agent):
        """Forget `agent` unless another open session reaches it or a load
        of it runs (that load replaces a dead connection itself)."""
        if agent not in self._load_locks and not any(x.agent == agent for x in self._sessions.values()):
            self._forget(agent)

    def _drop(self, name, used=None):
        """Forget session `name` (and its agent, unless another name reaches
        it), after a failure on it; with `used` (the _Session the failed
        request went out on), only while `name` still means that session: a
        request of a dead instance that fails after the session reconnected
        to the restarted peer leaves the new connection alone."""
        with self._lock:
            s = self._sessions.get(name)
            if s is None or (used is not None and s is not used):
                return
            del self._sessions[name]
            self._forget_unused(s.agent)  # nothing to forget once closed

    # -- transfers --------------------------------------------------------
    def _submit(self, target, op, buffers, peer_addrs, lengths, notify=None):
        """Post a transfer; returns (request id, session, total bytes) or
        (None, ..., ...) after logging why. A request id of 0 means nothing
        to move."""
        core = self._core
        if core is None:
            logger.error("transfer before initialize")
            return None, None, 0
        if op is None:
            return None, None, 0
        # Lists (what SGLang and vLLM pass) go straight into the core's
        # descriptors (create_scattered); arrays through numpy.
        lists = all(type(x) in (list, tuple) for x in (buffers, peer_addrs, lengths))
        if lists:
            if not (len(buffers) == len(peer_addrs) == len(lengths)):
                logger.error("buffers, peer_buffer_addresses and lengths have different size")
                return None, None, 0
        else:
            try:
                bufs, peers, lens = _ints(buffers, "Q"), _ints(peer_addrs, "Q"), _ints(lengths, "q")
            except (TypeError, ValueError, OverflowError) as e:
                logger.error("transfer arguments: %s", e)
                return None, None, 0
            if not (len(bufs) == len(peers) == len(lens)):
                logger.error("buffers, peer_buffer_addresses and lengths have different size")
                return None, None, 0
            if len(lens) and lens.min() <= 0:
                if lens.min() < 0:
                    logger.error("negative length")
                    return None, None, 0
                keep = lens > 0  # zero-length entries move nothing
                bufs, peers, lens = bufs[keep], peers[keep], lens[keep]
        s = self._session(target)
        if s is None:
            return None, None, 0
        notif = _pack_notify(notify.name, notify.msg) if notify is not None else None
        nothing = (notif is not None and _all_zero(lengths)) if lists else not len(bufs)
        if nothing:
            # Nothing to move. A notification still goes, after the earlier
            # transfers to the peer, as Mooncake sends it once the (empty)
            # batch completes (TransferEngine::getBatchTransferStatus).
            if notif is not None:
                try:
                    core.notify(s.agent, notif)
                except NixlCoreError as e:
                    logger.error("notification to %s: %s", target, e.args[-1])
                    if e.args[0] in (_REMOTE_DISCONNECT, _NOT_FOUND):  # dead, or no longer loaded
                        self._drop(target, s)  # the next call loads the peer again
                    return None, None, 0
            return 0, s, 0
        opname = "WRITE" if op == TransferOpcode.Write else "READ"
        indexed = refreshed = False  # each retry at most once
        while True:
            try:
                if lists:
                    # Created and posted in one call (one pass of checks).
                    rid, total = core.create_scattered(opname, buffers, s.agent, peer_addrs, lengths, notif,
                                                       post=True)
                    return rid, s, total
                else:
                    total = int(lens.sum())
                    rid = core.create(opname, _rows(bufs, lens), s.agent, _rows(peers, lens), 2, notif)
                break
            except TypeError as e:
                if lists and not indexed:
                    # numpy ints (or any `__index__` type) in the lists, as
                    # Mooncake's pybind11 binding takes them: read each
                    # column as Python ints once here, then ask again.
                    try:
                        buffers, peer_addrs, lengths = (list(map(operator.index, c))
                                                        for c in (buffers, peer_addrs, lengths))
                    except TypeError:
                        logger.error("transfer arguments: %s", e)
                        return None, None, 0
                    indexed = True
                    continue
                logger.error("transfer arguments: %s", e)
                return None, None, 0
            except (ValueError, OverflowError) as e:
                logger.error("transfer arguments: %s", e)
                return None, None, 0
            except NixlCoreError as e:
                status, msg = e.args
                if status == _NOT_FOUND and not refreshed and s.host:
                    if not self._remote_ok(s, peer_addrs, lengths):
                        # Registered after we fetched its description? Ask again.
                        refreshed = True
                        s = self._session(target, refresh=True)
                        if s is None:
                            return None, None, 0
                        continue
                if status == _BACKEND:
                    raise _Refused(s, msg)  # at post (shm copies in the call)
                logger.error("transfer to %s: %s", target, msg)
                if status == _REMOTE_DISCONNECT or "unknown remote agent" in msg.lower():
                    self._drop(target, s)
                return None, None, 0
        try:
            core.post(rid)
        except NixlCoreError as e:
            self._release(rid)
            if e.args[0] == _BACKEND:
                raise _Refused(s, e.args[-1]) from None
            logger.error("transfer to %s: %s", target, e.args[-1])
            if e.args[0] == _REMOTE_DISCONNECT:
                self._drop(target, s)
            return None, None, 0
        return rid, s, total

    def _remote_ok(self, s, peer_addrs, lengths):
        """Whether every non-empty (peer address, length) lies in the
        session's regions as last fetched."""
        peers, lens = _ints(peer_addrs, "Q"), _ints(lengths, "q")
        keep = lens > 0
        try:
            self._core.check(s.agent, _rows(peers[keep], lens[keep]), 2)
            return True
        except (NixlCoreError, AttributeError):  # AttributeError: closed meanwhile
            return False

    def _release(self, rid):
        try:
            self._core.release(rid)
        except (NixlCoreError, AttributeError):
            pass

    def _poll(self, rid, target, wait_s=None, used=None):
        """(1, None) done, (0, None) running, (-1, why) failed, or
        (_REFUSED, why): the target refused it (the request is kept, for the
        caller to post again or release); released after 1 and -1. With
        ``wait_s``, first sleep up to that many seconds for the request to
        finish (in the core, GIL and lock released)."""
        try:
            st = self._core.state(rid) if wait_s is None else self._core.wait(rid, wait_s)
        except NixlCoreError as e:
            if e.args[0] == _BACKEND:
                return _REFUSED, e.args[-1]
            self._release(rid)
            if e.args[0] == _REMOTE_DISCONNECT:
                self._drop(target, used)
            return -1, e.args[-1]
        except AttributeError:  # closed meanwhile
            return -1, "engine closed"
        if st == 0:
            self._release(rid)
            return 1, None
        return 0, None

    def _deadline(self, total, start=None):
        # Mooncake: MC_TRANSFER_TIMEOUT + 1 s per GiB, from the call
        return (time.monotonic() if start is None else start) + self._timeout + total / 1e9

    def _wait(self, rid, target, deadline, used=None):
        """(0, None) done, (-1, why) failed or timed out (the request
        cancelled and released), or (_REFUSED, why) as `_poll`."""
        # Mooncake's sync calls block inside the engine; so does this: the
        # core sleeps on the transport's completion channel, in slices of at
        # most 0.1 s so that signals (Ctrl-C) are handled meanwhile.
        while True:
            r, why = self._poll(rid, target, max(0.0, min(deadline - time.monotonic(), _WAIT_SLICE_S)), used)
            if r != 0:
                return (0, None) if r == 1 else (r, why)
            if time.monotonic() > deadline:
                self._release(rid)  # cancels; returns once no byte can still move
                return -1, f"timed out (MC_TRANSFER_TIMEOUT={self._timeout:g}s)"

    def _stale(self, target, used, deadline):
        """Whether the target's description changed since `used` (a
        _Session) was fetched: it unregistered and registered memory again
        (new keys, maybe at the same addresses), so a transfer it refused may
        succeed with the new one. Fetches (and loads) the new description,
        waiting for the rpc port at most 1 s and never past `deadline`; an
        rpc port that does not answer is not stale (and not forgotten)."""
        if used is None or not used.host:
            return False
        left = min(1.0, deadline - time.monotonic())
        if left <= 0:
            return False
        new = self._session(target, refresh=True, rpc_timeout=left, drop=False)
        return new is not None and new.md != used.md

    def _repost(self, rid, target, used, deadline):
        """After request `rid` was refused (`_REFUSED`): post it again — its
        own descriptors, resolved against the target's new description —
        when that description changed (`_stale`); else release it. True when
        posted again."""
        # Not past the deadline: the description may come just before it.
        if self._stale(target, used, deadline) and time.monotonic() < deadline:
            try:
                self._core.post(rid)
                return True
            except NixlCoreError as e:
                logger.debug("transfer to %s: posting again: %s", target, e.args[-1])
            except AttributeError:  # closed meanwhile
                return False
        self._release(rid)
        return False

    def _failed(self, target, why):
        logger.error("transfer to %s failed: %s", target, why)
        return -1

    def _post_once_more(self, target, op, buffers, peer_addrs, lengths, notify, start):
        """_submit, and once more if the target refused the post itself and
        its description changed (a refusal at post: shm copies in the call).
        Returns (request id or None, session, total bytes)."""
        try:
            return self._submit(target, op, buffers, peer_addrs, lengths, notify)
        except _Refused as e:
            s, why = e.args
        if self._stale(target, s, self._deadline(0, start)):
            try:
                return self._submit(target, op, buffers, peer_addrs, lengths, notify)
            except _Refused as e:
                why = e.args[1]
        self._failed(target, why)
        return None, None, 0

    def _sync(self, target, op, buffers, peer_addrs, lengths, notify=None):
        # A transfer the target refuses because it registered again since
        # we fetched its description (its keys changed) is posted once more
        # with the new one, within the same deadline. Both ops move the same
        # bytes again, so a part moved before the refusal is harmless.
        target = str(target)
        if self._core is not None and self._session(target) is None:
            return -1
        # As Mooncake's transferSync, the clock starts once the session is
        # open: a first contact's handshake is not taken from the transfer's
        # MC_TRANSFER_TIMEOUT.
        start = time.monotonic()
        rid, s, total = self._post_once_more(target, op, buffers, peer_addrs, lengths, notify, start)
        if rid is None:
            return -1
        if rid == 0:
            return 0
        deadline = self._deadline(total, start)
        r, why = self._wait(rid, target, deadline, s)
        if r == _REFUSED and self._repost(rid, target, s, deadline):
            r, why = self._wait(rid, target, deadline, s)
            if r == _REFUSED:
                self._release(rid)
        return 0 if r == 0 else self._failed(target, why)

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        return self._sync(target_hostname, TransferOpcode.Write, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        return self._sync(target_hostname, TransferOpcode.Read, [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode, notify=None,
                      transport_hint=""):
        return self._sync(target_hostname, _opcode(opcode), [buffer], [peer_buffer_address], [length],
                          notify)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        return self._sync(target_hostname, TransferOpcode.Write, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                 transport_hint=""):
        return self._sync(target_hostname, TransferOpcode.Read, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify=None,
                            transport_hint=""):
        return self._sync(target_hostname, _opcode(opcode), buffers, peer_buffer_addresses, lengths,
                          notify)

    def _async(self, target, op, buffers, peer_addrs, lengths):
        target = str(target)
        if self._core is not None and self._session(target) is None:
            return 0  # Mooncake's failure id
        start = time.monotonic()  # once the session is open, as _sync
        rid, s, total = self._post_once_more(target, op, buffers, peer_addrs, lengths, None, start)
        if rid is None:
            return 0  # Mooncake's failure id
        with self._lock:
            self._next_batch += 1
            bid = self._next_batch
            self._batches[bid] = _Batch(rid, self._deadline(total, start), target, s)
        return bid

    def _retry(self, b, r):
        """After batch `b`'s request ended with `r`: when refused, post it
        again once (`_repost`: its own descriptors, never the caller's lists,
        which Mooncake lets the caller reuse once the call returned). True
        when posted again; a refused request not posted again is released."""
        if r != _REFUSED:
            return False
        if b.retried:
            self._release(b.rid)
            return False
        b.retried = True
        return self._repost(b.rid, b.session, b.used, b.deadline)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                   transport_hint=""):
        return self._async(target_hostname, TransferOpcode.Write, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint=""):
        return self._async(target_hostname, TransferOpcode.Read, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                             transport_hint=""):
        return self._async(target_hostname, _opcode(opcode), buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        return self._async(target_hostname, TransferOpcode.Write, [buffer], [peer_buffer_address], [length])

    def _take(self, bid, result):
        """Frees batch `bid`, keeping its final `result` for late checkers."""
        with self._lock:
            self._batches.pop(int(bid), None)
            self._finished[int(bid)] = result
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)

    def transfer_check_status(self, batch_id):
        """1 done, 0 running, -1 failed, -2 timed out (the transfer is
        cancelled). After 1, -1 or -2 the id is freed; threads that check the
        same id meanwhile or later get the same answer (the last 1,024 freed
        ids keep it). An id never handed out is -1."""
        try:
            batch_id = operator.index(batch_id)  # a float or a string is no id
        except TypeError:
            logger.error("transfer_check_status: %r is not a batch id", batch_id)
            return -1
        with self._lock:
            b = self._batches.get(batch_id)
            done = self._finished.get(batch_id)
        if b is None:
            if done is not None:
                return done
            logger.error("transfer_check_status: unknown batch id %s", batch_id)
            return -1
        with b.lock:
            if b.result is not None:  # another thread finished it meanwhile
                return b.result
            if b.rid == 0:
                r, why = 1, None
            else:
                r, why = self._poll(b.rid, b.session, used=b.used)
                if r < 0 and self._retry(b, r):
                    return 0
            if r == 0 and time.monotonic() > b.deadline:
                self._release(b.rid)
                r = -2
                logger.error("transfer to %s timed out (MC_TRANSFER_TIMEOUT=%gs)", b.session, self._timeout)
            elif r < 0:
                r = self._failed(b.session, why)
            if r != 0:
                b.result = r
                self._take(batch_id, r)
            return r

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch: 0 when all completed, -1 on the first
        failure or timeout (the rest are cancelled and freed). An id freed
        already (by `transfer_check_status` or an earlier call) counts with
        its final answer; an id never handed out is -1 with every batch left
        as it was."""
        try:
            ids = list(dict.fromkeys(operator.index(bid) for bid in batch_ids))  # each once, in order
        except (TypeError, ValueError) as e:
            logger.error("get_batch_transfer_status: %s", e)
            return -1
        with self._lock:
            unknown = [bid for bid in ids if bid not in self._batches and bid not in self._finished]
            if unknown:
                logger.error("get_batch_transfer_status: unknown batch id %s", unknown[0])
                return -1
            # a batch stays findable while it is waited for, so a
            # transfer_check_status of the same id meanwhile waits on its
            # lock and gets the answer given here
            batches = [(bid, self._batches.get(bid), self._finished.get(bid)) for bid in ids]
        rc = 0
        for i, (bid, b, done) in enumerate(batches):
            if b is None:
                r, why = (0, None) if done == 1 else (-1, "failed (seen by an earlier check)")
            else:
                with b.lock:  # a transfer_check_status of the same id may be inside
                    if b.result is not None:
                        r, why = (0, None) if b.result == 1 else (-1, "failed (seen by transfer_check_status)")
                    elif b.rid == 0:
                        r, why = 0, None
                    else:
                        while True:
                            r, why = self._wait(b.rid, b.session, b.deadline, b.used)
                            if r == 0 or not self._retry(b, r):
                                break
                        b.result = 1 if r == 0 else -1
                    self._take(bid, 1 if r == 0 else b.result)
            if r != 0:
                rc = -1
                logger.error("transfer to %s failed: %s", b.session if b else bid, why)
                for obid, o, _ in batches[i + 1:]:
                    if o is None:
                        continue
                    with o.lock:
                        if o.result is None:
                            if o.rid:
                                self._release(o.rid)
                            o.result = -1
                        self._take(obid, o.result)
                break
        return rc

    # -- CUDA-stream variants ---------------------------------------------
    def _on_cuda(self, *args, **kwargs):
        raise _not_supported("transfers ordered on a CUDA stream",
                             "kvwire runs no CUDA host callbacks; synchronize the stream, then call "
                             "batch_transfer_sync_write/read")

    transfer_write_on_cuda = _on_cuda
    transfer_read_on_cuda = _on_cuda
    batch_transfer_write_on_cuda = _on_cuda
    batch_transfer_read_on_cuda = _on_cuda

    # -- notifications and liveness ---------------------------------------
    def get_notifies(self):
        core = self._core
        if core is None:
            return []
        out = []
        try:
            got = core.notifs()
        except NixlCoreError as e:
            logger.error("get_notifies: %s", e.args[-1])
            return out
        for sender, msgs in got.items():
            out.extend(_unpack_notify(sender, bytes(m)) for m in msgs)
        return out

    def send_probe(self, peer_server_name):
        """0 when the session's rpc port answers, ERR_SOCKET (-102) otherwise."""
        if self._core is None:
            return -1
        if peer_server_name in self._names:
            return 0
        where = self._locate(str(peer_server_name))
        if where is None:
            return ERR_SOCKET
        return 0 if _rpc.probe(where[0], where[1], timeout=min(5.0, self._timeout)) else ERR_SOCKET
