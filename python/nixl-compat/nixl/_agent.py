"""`nixl._bindings.nixlAgent` over kvwire's `NixlCore`: NIXL's C++ agent
surface (ai-dynamo/nixl `src/api/cpp/nixl.h`) as its pybind layer shows it
to Python: methods return status codes or handles, and every status other
than SUCCESS/IN_PROG raises its `nixl*Error`.

One kvwire transport per agent. The plugins and the transport each picks:
  KVWIRE_SHM -> shm, KVWIRE_TCP -> tcp, KVWIRE_VERBS -> verbs;
  KVWIRE     -> $KVWIRE_TRANSPORT (shm|tcp|verbs), default shm;
  UCX        -> $KVWIRE_NIXL_UCX (shm|tcp|verbs) when set; else verbs when an
                RDMA port is ACTIVE (/sys/class/infiniband/*/ports/*/state);
                else shm (one host). Across hosts without RDMA set
                KVWIRE_NIXL_UCX=tcp.

The verbs device: the backend's `device_list` param (first entry); else the
first RDMA device named in `$UCX_NET_DEVICES` (e.g. `mlx5_0:1`, as UCX users
already set per process); else kvwire's default (the first device).
"""

import glob
import os
import weakref

import numpy as np

from kvwire._kvwire import NixlCore, NixlCoreError

from . import _bindings as B
from ._errors import error_for, not_supported
from ._listener import MetadataListener, fetch_metadata, send_frame
from ._telemetry import stats_for
from .logging import get_logger

logger = get_logger(__name__)

PLUGINS = ["UCX", "KVWIRE", "KVWIRE_SHM", "KVWIRE_TCP", "KVWIRE_VERBS"]
_PLUGIN_PARAMS = {"num_threads": "0", "device_list": "", "peer_timeout_ms": "5000"}
_MEMS = {B.DRAM_SEG: "DRAM", B.VRAM_SEG: "VRAM"}
_ON = {"y", "yes", "1", "true", "on", "enable", "enabled"}


def _active_rdma_port() -> bool:
    for state in glob.glob("/sys/class/infiniband/*/ports/*/state"):
        try:
            with open(state) as f:
                if "ACTIVE" in f.read():
                    return True
        except OSError:
            pass
    return False


def _ucx_net_device() -> str:
    """The first RDMA device in `$UCX_NET_DEVICES` (`dev[:port]`, comma
    separated; non-RDMA entries such as `eth0` are skipped), or ""."""
    for entry in os.environ.get("UCX_NET_DEVICES", "").split(","):
        dev = entry.strip().split(":")[0]
        if dev and os.path.isdir(os.path.join("/sys/class/infiniband", dev)):
            return dev
    return ""


def transport_for(plugin: str) -> str:
    """The kvwire transport that backs `plugin` (see the module docs)."""
    if plugin == "KVWIRE_SHM":
        return "shm"
    if plugin == "KVWIRE_TCP":
        return "tcp"
    if plugin == "KVWIRE_VERBS":
        return "verbs"
    if plugin == "KVWIRE":
        return os.environ.get("KVWIRE_TRANSPORT", "shm").strip().lower() or "shm"
    forced = os.environ.get("KVWIRE_NIXL_UCX", "").strip().lower()
    if forced:
        return forced
    return "verbs" if _active_rdma_port() else "shm"


def telemetry_enabled(capture: bool) -> bool:
    """`NIXL_TELEMETRY_ENABLE` wins both ways when set; else `capture`
    (ai-dynamo/nixl `src/core/nixl_agent.cpp`)."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is None:
        return bool(capture)
    return env.strip().lower() in _ON


def _err(e: NixlCoreError):
    status, msg = e.args
    return error_for(status, msg)


def _h(handle) -> int:
    """A request or dlist handle as the core's id; a released one (the
    Python handle's value is None then) is NIXL_ERR_INVALID_PARAM, not a
    TypeError."""
    if handle is None:
        raise error_for(B.NIXL_ERR_INVALID_PARAM, "the handle was released")
    return int(handle)


def _int_param(params, key, default, lo, hi) -> int:
    """Backend init param `key` (NIXL passes strings) as an int in lo..=hi;
    missing or empty is `default`. Anything else is NIXL_ERR_INVALID_PARAM
    (not a ValueError, and never a silent clamp: "0" ms used to become a
    1 ms peer timeout)."""
    raw = params.pop(key, None)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except (TypeError, ValueError):
        v = None
    if v is None or not lo <= v <= hi:
        raise error_for(B.NIXL_ERR_INVALID_PARAM, f"backend param {key}={raw!r}: expected an integer in {lo}..={hi}")
    return v


def _send_md(ip_addr, port, frame: bytes) -> None:
    """One frame to a peer's metadata listener. As NIXL (its P2P metadata
    backend queues `sendLocalMD`/`invalidateLocalMD` to a worker thread and
    returns NIXL_SUCCESS), a refused, unreachable or timed-out listener is
    logged, not raised: a peer that already exited must not fail the caller
    (NIXL's `expanded_two_peers.py` invalidates towards a target that may be
    gone)."""
    try:
        send_frame(ip_addr, int(port), frame)
    except OSError as e:
        logger.error("metadata listener %s:%s: %s", ip_addr, port, e)


def _bytes(msg) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def _op(op) -> str:
    op = B.nixl_xfer_op_t(int(op))
    return "READ" if op == B.NIXL_READ else "WRITE"


def _idx(x, widen=False):
    """Index list -> (bytes, width) for NixlCore.make. A 1-D int32/int64
    array (what vLLM and SGLang pass) crosses as its own bytes, unconverted,
    unless `widen`; anything else becomes int64."""
    if not widen and isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind == "i" and x.dtype.itemsize in (4, 8):
        a = x.astype(x.dtype.newbyteorder("<"), copy=False)
        return a.tobytes(), a.dtype.itemsize
    return np.asarray(x, dtype="<i8").reshape(-1).tobytes(), 8


class nixlAgent:
    """One agent. See the module docs for plugins and transports."""

    def __init__(self, name, config=None):
        if not isinstance(name, str) or not name:
            raise ValueError("agent name must be a non-empty string")
        if len(name.encode()) > 255:
            raise ValueError("agent name must be at most 255 bytes")
        self.name = name
        self.config = config if config is not None else B.nixlAgentConfig()
        self._telemetry = telemetry_enabled(self.config.captureTelemetry)
        # NIXL's Prometheus exporter (NIXL_TELEMETRY_EXPORTER=prometheus), or None
        self._stats = stats_for(name, self._telemetry)
        self._req_read = {}  # request id -> is READ (for tx/rx series)
        self._req_posts = {}  # request id -> [posts, posts already counted]
        self._core = None
        self._backends = {}  # handle -> plugin name
        self._next_backend = 0
        self._listener = None
        if self.config.useListenThread:
            # Held weakly by the listener's threads: an agent its owner drops
            # is freed (and its listener closed by __del__), as NIXL's
            # destructor does, never kept alive and loaded by its listener.
            self._listener = MetadataListener(weakref.proxy(self), int(self.config.listenPort))

    # -- plugins and backends --
    def getAvailPlugins(self):
        return list(PLUGINS)

    def getPluginParams(self, plugin):
        if plugin not in PLUGINS:
            raise error_for(B.NIXL_ERR_NOT_FOUND, f"no plugin {plugin!r}")
        return dict(_PLUGIN_PARAMS), ["DRAM_SEG", "VRAM_SEG"] if transport_for(plugin) == "verbs" else ["DRAM_SEG"]

    def getBackendParams(self, backend):
        if backend not in self._backends:
            raise error_for(B.NIXL_ERR_NOT_FOUND, "unknown backend handle")
        return self.getPluginParams(self._backends[backend])

    def createBackend(self, plugin, params=None):
        if plugin not in PLUGINS:
            raise error_for(B.NIXL_ERR_NOT_FOUND, f"no plugin {plugin!r} (kvwire offers {', '.join(PLUGINS)})")
        params = dict(params or {})
        transport = transport_for(plugin)
        if self._core is None:
            threads = _int_param(params, "num_threads", 0, 0, 256)
            timeout = _int_param(params, "peer_timeout_ms", 5000, 1, 86_400_000)
            options = []
            devices = str(params.pop("device_list", "") or "")
            if transport == "verbs":
                device = devices.split(",")[0].split(":")[0].strip() or _ucx_net_device()
                if device:
                    options.append(("device", device))
            for k in list(params):
                if k.startswith("kvwire."):
                    options.append((k[len("kvwire."):], str(params.pop(k))))
            if params:
                logger.debug("backend %s: ignoring UCX-only parameters %s", plugin, sorted(params))
            try:
                self._core = NixlCore(self.name, transport, max(threads, 2) if threads else 2, timeout, options)
            except NixlCoreError as e:
                raise _err(e) from None
        elif self._core.transport != transport:
            raise not_supported(
                f"backend {plugin} ({transport}) next to {self._core.transport}",
                "one kvwire transport per agent",
            )
        self._next_backend += 1
        self._backends[self._next_backend] = plugin
        return self._next_backend

    def _c(self):
        if self._core is None:
            raise error_for(B.NIXL_ERR_NOT_FOUND, "the agent has no backend; create one first")
        return self._core

    # -- memory --
    def registerMem(self, descs, backends=()):
        mem = descs.getType()
        if mem not in _MEMS:
            raise not_supported(f"memory type {B.nixl_mem_t(mem).name}", "FILE/OBJ/BLOCK storage backends")
        core = self._c()
        # One call for the whole list (all or nothing): on verbs, views of a
        # few allocations become a few memory regions (docs/VERBS.md).
        done = [tuple(int(v) for v in descs._a[i]) for i in range(descs.descCount())]
        try:
            core.register_many(done, _MEMS[mem])
        except NixlCoreError as e:
            raise self._failed(e) from None
        if self._stats is not None:
            self._stats.registered(sum(n for _, n, _ in done))
        return B.NIXL_SUCCESS

    def deregisterMem(self, descs, backends=()):
        core = self._c()
        total = 0
        try:
            for i in range(descs.descCount()):
                addr, length, _ = (int(v) for v in descs._a[i])
                core.deregister(addr, length)
                total += length
        except NixlCoreError as e:
            raise self._failed(e) from None
        if self._stats is not None:
            self._stats.registered(total, dereg=True)
        return B.NIXL_SUCCESS

    def queryMem(self, descs, backend):
        raise not_supported("queryMem", "FILE/OBJ/BLOCK storage backends are out of scope")

    # -- descriptor lists and requests --
    def prepXferDlist(self, *args):
        if isinstance(args[0], B.nixlXferDList):
            agent, rest = B.NIXL_INIT_AGENT, args
        else:
            agent, rest = args[0], args[1:]
        if isinstance(rest[0], B.nixlXferDList):
            data, ncols = rest[0]._rows(), 3
        else:
            arr = rest[1]
            if not isinstance(arr, np.ndarray) or arr.ndim != 2 or arr.shape[1] not in (3, 5):
                raise TypeError("prepXferDlist(agent, mem_type, ndarray) needs an Nx3 or Nx5 array")
            data, ncols = np.ascontiguousarray(arr, dtype="<u8").tobytes(), arr.shape[1]
        if agent == "NIXL_INIT_AGENT":
            agent = ""
        try:
            handle, _count = self._c().prep(agent, data, ncols)
        except NixlCoreError as e:
            raise _err(e) from None
        return handle

    def makeXferReq(self, op, local_side, local_indices, remote_side, remote_indices, notif_msg="",
                    backends=(), skip_desc_merge=False):
        notif = _bytes(notif_msg) or None
        (li, lw), (ri, rw) = _idx(local_indices), _idx(remote_indices)
        if lw != rw:  # one width for both lists: both as int64
            (li, lw), (ri, rw) = _idx(local_indices, widen=True), _idx(remote_indices, widen=True)
        try:
            req = self._c().make(_op(op), _h(local_side), li, _h(remote_side), ri, notif, lw)
        except NixlCoreError as e:
            raise self._failed(e) from None
        self._req_read[req] = _op(op) == "READ"
        return req

    def createXferReq(self, op, local_descs, remote_descs, remote_agent, notif_msg="", backends=()):
        notif = _bytes(notif_msg) or None
        try:
            req = self._c().create(_op(op), local_descs._rows(), remote_agent, remote_descs._rows(), 3, notif)
        except NixlCoreError as e:
            raise self._failed(e) from None
        self._req_read[req] = _op(op) == "READ"
        return req

    def estimateXferCost(self, req):
        raise not_supported("estimateXferCost", "kvwire has no cost model")

    def postXferReq(self, req, notif_msg=""):
        notif = _bytes(notif_msg) or None
        try:
            st = B.nixl_status_t(self._c().post(_h(req), notif))
        except NixlCoreError as e:
            raise self._failed(e) from None
        if self._stats is not None:
            self._req_posts.setdefault(req, [0, 0])[0] += 1
            self._count(req, st)
        return st

    def getXferStatus(self, req):
        try:
            st = B.nixl_status_t(self._c().state(_h(req)))
        except NixlCoreError as e:
            raise self._failed(e) from None
        if self._stats is not None:
            self._count(req, st)
        return st

    def _failed(self, e: NixlCoreError):
        """The nixl error for `e`, counted in `agent_errors_total`."""
        if self._stats is not None:
            self._stats.error(B.nixl_status_t(int(e.args[0])).name if int(e.args[0]) in
                              B.nixl_status_t._value2member_map_ else "unknown")
        return _err(e)

    def _count(self, req, st):
        """Count a finished post of `req` once in the exporter's series."""
        posts = self._req_posts.get(req)
        if st != B.NIXL_SUCCESS or posts is None or posts[1] == posts[0]:
            return
        posts[1] = posts[0]
        try:
            _start, post_us, xfer_us, nbytes, _count = self._core.telemetry(req)
        except NixlCoreError:
            return
        self._stats.finished(self._req_read.get(req, False), nbytes, post_us, xfer_us)

    def getXferTelemetry(self, req):
        if not self._telemetry:
            raise error_for(B.NIXL_ERR_NO_TELEMETRY, "telemetry is off (capture_telemetry / NIXL_TELEMETRY_ENABLE)")
        try:
            start, post, xfer, nbytes, count = self._c().telemetry(_h(req))
        except NixlCoreError as e:
            raise _err(e) from None
        backend = next(iter(self._backends.values()), "")
        return B.nixlXferTelemetry(start, post, xfer, nbytes, count, backend)

    def queryXferBackend(self, req):
        self._c()
        return next(iter(self._backends))

    def releaseXferReq(self, req):
        self._req_read.pop(req, None)
        self._req_posts.pop(req, None)
        try:
            self._c().release(_h(req))
        except NixlCoreError as e:
            raise _err(e) from None
        return B.NIXL_SUCCESS

    def releasedDlistH(self, handle):
        try:
            self._c().release_dlist(_h(handle))
        except NixlCoreError as e:
            raise _err(e) from None
        return B.NIXL_SUCCESS

    def prepMemView(self, *args, **kwargs):
        raise not_supported("prepMemView", "the UCX GPU device API is out of scope")

    def releaseMemView(self, *args, **kwargs):
        raise not_supported("releaseMemView", "the UCX GPU device API is out of scope")

    def makeConnection(self, remote_agent, backends=()):
        if not self._c().is_loaded(remote_agent) and remote_agent != self.name:
            raise error_for(B.NIXL_ERR_NOT_FOUND, f"no metadata loaded for agent {remote_agent!r}")
        return B.NIXL_SUCCESS

    # -- notifications --
    def getNotifs(self, notif_map, backends=()):
        out = {k: list(v) for k, v in dict(notif_map).items()}
        if self._core is not None:
            for agent, msgs in self._core.notifs().items():
                out.setdefault(agent, []).extend(msgs)
        return out

    def genNotif(self, remote_agent, msg, backends=()):
        try:
            self._c().notify(remote_agent, _bytes(msg))
        except NixlCoreError as e:
            raise _err(e) from None
        return B.NIXL_SUCCESS

    # -- metadata --
    def getLocalMD(self):
        return bytes(self._c().metadata())

    def getLocalPartialMD(self, descs, inc_conn_info=False, backends=()):
        raise not_supported("partial metadata", "kvwire metadata is always the full snapshot; use getLocalMD")

    def loadRemoteMD(self, metadata):
        try:
            return self._c().load(bytes(metadata)).encode()
        except NixlCoreError as e:
            raise _err(e) from None

    def invalidateRemoteMD(self, remote_agent):
        try:
            self._c().forget(_str(remote_agent))
        except NixlCoreError as e:
            raise _err(e) from None
        return B.NIXL_SUCCESS

    def checkRemoteMD(self, remote_agent, descs):
        remote_agent = _str(remote_agent)
        if self._core is None or not self._core.is_loaded(remote_agent):
            return B.NIXL_ERR_NOT_FOUND
        if descs is not None and descs.descCount() > 0:
            try:
                self._core.check(remote_agent, descs._rows(), 3)
            except NixlCoreError:
                return B.NIXL_ERR_NOT_FOUND
        return B.NIXL_SUCCESS

    def sendLocalMD(self, ip_addr="", port=B.DEFAULT_COMM_PORT):
        if not ip_addr:
            raise not_supported("etcd metadata", "give ip_addr and port of a peer's listener")
        _send_md(ip_addr, port, b"S" + self.getLocalMD())
        return B.NIXL_SUCCESS

    def sendLocalPartialMD(self, *args, **kwargs):
        raise not_supported("partial metadata", "kvwire metadata is always the full snapshot")

    def fetchRemoteMD(self, remote_agent, ip_addr="", port=B.DEFAULT_COMM_PORT, label=""):
        if not ip_addr:
            raise not_supported("etcd metadata", "give ip_addr and port of the peer's listener")
        fetch_metadata(self, _str(remote_agent), ip_addr, int(port))
        return B.NIXL_SUCCESS

    def invalidateLocalMD(self, ip_addr="", port=B.DEFAULT_COMM_PORT):
        if not ip_addr:
            raise not_supported("etcd metadata", "give ip_addr and port of a peer's listener")
        _send_md(ip_addr, port, b"I" + self.name.encode())
        return B.NIXL_SUCCESS

    def _close(self):
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __del__(self):
        try:
            self._close()
        except Exception:
            pass


def _str(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)
