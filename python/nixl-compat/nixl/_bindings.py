"""`nixl._bindings`: NIXL 1.5.1's pybind surface (ai-dynamo/nixl
`src/bindings/python/nixl_bindings.cpp`) written in Python over kvwire's
`NixlCore`: enums with their values also at module scope, status codes, the
`nixl*Error` classes (raised for every status other than SUCCESS/IN_PROG),
descriptor lists, `nixlAgentConfig`, `nixlXferTelemetry` and `nixlAgent`.
"""

import enum as _enum
import pickle as _pickle  # noqa: F401  (dlists pickle through __reduce__)

import numpy as _np

from ._errors import (  # noqa: F401
    NIXL_ERR_BACKEND,
    NIXL_ERR_CANCELED,
    NIXL_ERR_INVALID_PARAM,
    NIXL_ERR_MISMATCH,
    NIXL_ERR_NO_TELEMETRY,
    NIXL_ERR_NOT_ALLOWED,
    NIXL_ERR_NOT_FOUND,
    NIXL_ERR_NOT_POSTED,
    NIXL_ERR_NOT_SUPPORTED,
    NIXL_ERR_REMOTE_DISCONNECT,
    NIXL_ERR_REPOST_ACTIVE,
    NIXL_ERR_UNKNOWN,
    NIXL_IN_PROG,
    NIXL_SUCCESS,
    nixl_status_t,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)


class nixl_mem_t(_enum.IntEnum):
    """Memory segment types (`nixl_mem_t`)."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(_enum.IntEnum):
    """Transfer operations (`nixl_xfer_op_t`)."""

    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_thread_sync_t(_enum.IntEnum):
    """Agent thread-synchronization modes; kvwire always serializes calls
    with a lock, so every mode is thread-safe."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


class nixl_cost_t(_enum.IntEnum):
    """Cost-estimate methods (`nixl_cost_t`)."""

    NIXL_COST_ANALYTICAL_BACKEND = 0


DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = list(nixl_mem_t)
NIXL_READ, NIXL_WRITE = list(nixl_xfer_op_t)
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT
NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND

#: The name that means "the local side" in `prepXferDlist`.
NIXL_INIT_AGENT = ""
#: Default port of the metadata listener.
DEFAULT_COMM_PORT = 8888
#: kvwire has no UCX GPU device API (`prep_mem_view`).
HAVE_UCX_GPU_DEVICE_API = False


def _mem(mem) -> nixl_mem_t:
    return nixl_mem_t(int(mem))


class _DList:
    """A descriptor list backed by an `Nx3` `uint64` array `(addr, len, dev)`."""

    _WIDTH = 3

    def __init__(self, mem, descs=None, *args):
        self._type = _mem(mem)
        self._meta = []
        if descs is None or isinstance(descs, (int, bool)):
            self._a = _np.zeros((0, 3), dtype=_np.uint64)
        elif isinstance(descs, _np.ndarray):
            if descs.ndim != 2 or descs.shape[1] != 3:
                raise ValueError("descriptor array must be Nx3 (addr, len, devId)")
            self._a = _np.ascontiguousarray(descs, dtype=_np.uint64).copy()
            self._meta = [b""] * len(self._a)
        else:
            rows = list(descs)
            for d in rows:
                self._check(d)
            self._a = _np.array([d[:3] for d in rows], dtype=_np.uint64).reshape(-1, 3)
            self._meta = [_b(d[3]) for d in rows] if self._WIDTH == 4 else [b""] * len(rows)

    # -- NIXL's list methods --
    def getType(self):
        return self._type

    def descCount(self) -> int:
        return len(self._a)

    def __len__(self) -> int:
        return len(self._a)

    def isEmpty(self) -> bool:
        return len(self._a) == 0

    def _check(self, d):
        if not isinstance(d, tuple) or len(d) != self._WIDTH:
            raise TypeError(f"a descriptor of this list is a {self._WIDTH}-tuple")

    def _row(self, i):
        a = self._a[i]
        return (int(a[0]), int(a[1]), int(a[2]))

    def __getitem__(self, i):
        if not -len(self._a) <= i < len(self._a):
            raise IndexError("descriptor index out of range")
        return self._row(i)

    def __setitem__(self, i, d):
        self._check(d)
        self._a[i] = d[:3]
        if self._WIDTH == 4:
            self._meta[i] = _b(d[3])

    def __iter__(self):
        return (self[i] for i in range(len(self._a)))

    def addDesc(self, d):
        self._check(d)
        self._a = _np.vstack([self._a, _np.array([d[:3]], dtype=_np.uint64)])
        self._meta.append(_b(d[3]) if self._WIDTH == 4 else b"")

    append = addDesc

    def index(self, d) -> int:
        for i in range(len(self._a)):
            if self[i] == tuple(d):
                return i
        raise ValueError(f"{d} is not in the list")

    def remDesc(self, i: int):
        if not 0 <= i < len(self._a):
            raise IndexError("descriptor index out of range")
        self._a = _np.delete(self._a, i, axis=0)
        del self._meta[i]

    def clear(self):
        self._a = _np.zeros((0, 3), dtype=_np.uint64)
        self._meta = []

    def print(self):
        print(repr(self))

    def __repr__(self):
        return f"{type(self).__name__}({self._type.name}, {[self[i] for i in range(len(self._a))]})"

    def __eq__(self, other):
        return (
            type(other) is type(self)
            and self._type == other._type
            and _np.array_equal(self._a, other._a)
            and self._meta == other._meta
        )

    def __reduce__(self):
        return (_restore, (type(self).__name__, int(self._type), self._a.tobytes(), self._meta))

    # -- kvwire --
    def _rows(self) -> bytes:
        """(addr, len, dev) rows as little-endian u64 bytes."""
        return _np.ascontiguousarray(self._a, dtype="<u8").tobytes()


def _b(x) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


class nixlXferDList(_DList):
    """Transfer descriptors `(addr, len, devId)`."""


class nixlRegDList(_DList):
    """Registration descriptors `(addr, len, devId, metaInfo)`; an `Nx3`
    array gets empty metaInfo."""

    _WIDTH = 4

    def _row(self, i):
        a = self._a[i]
        return (int(a[0]), int(a[1]), int(a[2]), self._meta[i])

    def trim(self) -> nixlXferDList:
        """The list without metaInfo, as a transfer list."""
        out = nixlXferDList(self._type)
        out._a = self._a.copy()
        out._meta = [b""] * len(out._a)
        return out


class nixlRemoteDList(_DList):
    """Remote descriptors `(addr, len, devId, agentName)`: only NIXL's GPU
    device API uses them, which kvwire does not offer."""

    _WIDTH = 4

    def _row(self, i):
        a = self._a[i]
        return (int(a[0]), int(a[1]), int(a[2]), self._meta[i].decode())


def _restore(kind, mem, rows, meta):
    cls = {"nixlXferDList": nixlXferDList, "nixlRegDList": nixlRegDList, "nixlRemoteDList": nixlRemoteDList}[kind]
    out = cls(mem)
    out._a = _np.frombuffer(rows, dtype="<u8").astype(_np.uint64).reshape(-1, 3)
    out._meta = list(meta)
    return out


class nixlAgentConfig:
    """Agent configuration (`nixlAgentConfig`)."""

    def __init__(self, useProgThread=True, useListenThread=False, listenPort=DEFAULT_COMM_PORT,
                 syncMode=NIXL_THREAD_SYNC_DEFAULT, captureTelemetry=False, pthrDelay=0, lthrDelay=100000,
                 etcdWatchTimeout=5000000):
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = nixl_thread_sync_t(int(syncMode))
        self.captureTelemetry = captureTelemetry
        self.pthrDelay = pthrDelay
        self.lthrDelay = lthrDelay
        self.etcdWatchTimeout = etcdWatchTimeout


class nixlXferTelemetry:
    """Telemetry of a finished transfer: `startTime` (µs since the Unix
    epoch), `postDuration` and `xferDuration` (µs, rounded up, never 0),
    `totalBytes`, `descCount` (descriptors as the caller gave them),
    `backendName`."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount", "backendName")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0, backendName=""):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount
        self.backendName = backendName

    def __repr__(self):
        return "nixlXferTelemetry(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


from ._agent import nixlAgent  # noqa: E402,F401
