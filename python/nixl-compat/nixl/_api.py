"""`nixl._api`: NIXL 1.5.1's high-level Python API (`nixl_agent`,
`nixl_agent_config`, handle classes) over `nixl._bindings`, with NIXL's
argument handling and return conventions: bad descriptor shapes give None,
an unknown op or memory type raises KeyError, `transfer`/`check_xfer_state`
answer "DONE"/"PROC" and raise `nixl*Error` on failure, `add_remote_agent`
returns the name as bytes. Behaviour follows ai-dynamo/nixl
`src/api/python/_api.py`; the code is kvwire's.
"""

import enum
import pickle
import sys
from typing import Optional

import numpy as np

from . import _bindings as nixlBind
from .logging import get_logger

logger = get_logger(__name__)

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT


class nixl_thread_sync_t(enum.Enum):
    """Thread-synchronization modes; `.value` is the bindings' integer."""

    NIXL_THREAD_SYNC_NONE = int(nixlBind.NIXL_THREAD_SYNC_NONE)
    NIXL_THREAD_SYNC_STRICT = int(nixlBind.NIXL_THREAD_SYNC_STRICT)
    NIXL_THREAD_SYNC_RW = int(nixlBind.NIXL_THREAD_SYNC_RW)


def _is_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


class nixl_backend_handle:
    """A backend created by `create_backend`."""

    def __init__(self, value: int):
        self._handle = value

    def __eq__(self, other):
        return isinstance(other, nixl_backend_handle) and other._handle == self._handle

    def __hash__(self):
        return hash(self._handle)

    def __repr__(self):
        return f"nixl_backend_handle({self._handle})"


class nixl_prepped_dlist_handle:
    """A descriptor list prepared by `prep_xfer_dlist`; `release()` frees it
    (also done on garbage collection)."""

    def __init__(self, agent, value: int):
        self._agent = agent
        self._handle = value

    def __repr__(self):
        return f"nixl_prepped_dlist_handle({self._handle})"

    def release(self):
        if self._handle is not None:
            h, self._handle = self._handle, None
            self._agent.releasedDlistH(h)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - best effort at collection
            pass


class nixl_xfer_handle:
    """A transfer request: post it with `transfer` (again once it finished).
    `release()` cancels an active post and returns only when no byte of it
    can still move (stronger than NIXL, where release may fail)."""

    def __init__(self, agent, value: int, owner=None):
        self._agent = agent
        self._handle = value
        self._owner = owner

    def __repr__(self):
        return f"nixl_xfer_handle({self._handle})"

    def release(self):
        if self._handle is not None:
            self._agent.releaseXferReq(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001
            if self._owner is not None and self._handle is not None:
                self._owner._leaked_xfer_handles.append(self._handle)


class nixl_agent_config:
    """Agent options, as NIXL's. `num_threads` sets kvwire's copy threads;
    `backends` default to `["UCX"]` (kvwire's best transport here, see
    `nixl._agent`)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list = ["UCX"],  # noqa: B006 - NIXL's signature
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class nixl_agent:
    """A NIXL agent over kvwire. See the module docs."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all=False):
        if nixl_conf is not None and instantiate_all:
            logger.warning("instantiate_all is ignored when a config is given")
            instantiate_all = False
        conf = nixl_conf or nixl_agent_config()
        default_sync = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        cfg = nixlBind.nixlAgentConfig()
        cfg.useProgThread = conf.enable_pthread
        cfg.useListenThread = conf.enable_listen
        cfg.listenPort = conf.port
        cfg.syncMode = (conf.sync_mode or default_sync).value
        cfg.captureTelemetry = conf.capture_telemetry
        # Looked up at call time: NIXL's tests monkeypatch nixl._bindings.nixlAgent.
        self.agent = nixlBind.nixlAgent(agent_name, cfg)
        self.name = agent_name
        self.notifs = {}
        self.backends = {}
        self.backend_mems = {}
        self.backend_options = {}
        self._leaked_xfer_handles = []
        self.plugin_list = self.agent.getAvailPlugins()
        if not self.plugin_list:
            raise RuntimeError("No plugins available for NIXL, cannot start transfers!")
        self.plugin_b_options = {}
        self.plugin_mem_types = {}
        wanted = [self.plugin_list[0]] if instantiate_all else list(conf.backends)
        for b in wanted:
            if b not in self.plugin_list:
                logger.warning("Skipping backend %s: no such plugin", b)
                continue
            init = {"num_threads": str(conf.num_threads)} if conf.num_threads > 0 else {}
            self.create_backend(b, init)
        self.nixl_mems = {
            "DRAM": nixlBind.DRAM_SEG,
            "VRAM": nixlBind.VRAM_SEG,
            "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG,
            "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG,
            "cuda": nixlBind.VRAM_SEG,
        }
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        logger.info("Initialized NIXL agent %s (kvwire)", agent_name)

    def __del__(self):
        for h in list(getattr(self, "_leaked_xfer_handles", [])):
            try:
                self.agent.releaseXferReq(h)
            except Exception:  # noqa: BLE001
                pass

    def _handles(self, backends):
        return [self.backends[b]._handle for b in backends]

    # -- plugins and backends --
    def get_plugin_list(self) -> list:
        return self.plugin_list

    def _plugin(self, name):
        if name not in self.plugin_list:
            logger.warning("No plugin %s", name)
            return None
        if name not in self.plugin_b_options:
            self.plugin_b_options[name], self.plugin_mem_types[name] = self.agent.getPluginParams(name)
        return name

    def get_plugin_mem_types(self, backend: str) -> list:
        return self.plugin_mem_types[backend] if self._plugin(backend) else []

    def get_plugin_params(self, backend: str) -> dict:
        return self.plugin_b_options[backend] if self._plugin(backend) else {}

    def get_backend_mem_types(self, backend: str) -> list:
        if backend not in self.backends:
            logger.warning("Backend %s not initialized", backend)
            return []
        return self.backend_mems[backend]

    def get_backend_params(self, backend: str) -> dict:
        if backend not in self.backends:
            logger.warning("Backend %s not initialized", backend)
            return {}
        return self.backend_options[backend]

    def create_backend(self, backend: str, initParams: dict = {}):  # noqa: B006
        h = self.agent.createBackend(backend, dict(initParams))
        self.backends[backend] = nixl_backend_handle(h)
        self.backend_options[backend], self.backend_mems[backend] = self.agent.getBackendParams(h)

    # -- memory --
    def register_memory(self, reg_list, mem_type: Optional[str] = None, backends: list = []):  # noqa: B006
        descs = self.get_reg_descs(reg_list, mem_type)
        self.agent.registerMem(descs, self._handles(backends))
        return descs

    def deregister_memory(self, dereg_list, backends: list = []):  # noqa: B006
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list, backend: str, mem_type: Optional[str] = None):
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends)}")
        return self.agent.queryMem(descs, self.backends[backend]._handle)

    def make_connection(self, remote_agent: str, backends: list = []):  # noqa: B006
        self.agent.makeConnection(remote_agent, self._handles(backends))

    # -- descriptor lists and transfers --
    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type: Optional[str] = None, backends: list = []):  # noqa: B006
        agent_name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
        if agent_name == "NIXL_INIT_AGENT":
            agent_name = nixlBind.NIXL_INIT_AGENT
        handles = self._handles(backends)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            h = self.agent.prepXferDlist(agent_name, self.nixl_mems[mem_type], xfer_list, handles)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            h = self.agent.prepXferDlist(agent_name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, h)

    def estimate_xfer_cost(self, req_handle):
        duration, margin, method = self.agent.estimateXferCost(req_handle._handle)
        return duration, margin, "ANALYTICAL_BACKEND" if method == nixlBind.NIXL_COST_ANALYTICAL_BACKEND else "UNKNOWN"

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          notif_msg: bytes = b"", backends: list = [], skip_desc_merge: bool = False):  # noqa: B006
        op = self.nixl_ops[operation]
        h = self.agent.makeXferReq(op, local_xfer_side._handle, local_indices, remote_xfer_side._handle,
                                   remote_indices, notif_msg, self._handles(backends), skip_desc_merge)
        return nixl_xfer_handle(self.agent, h, self)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg: bytes = b"",
                        backends: list = []):  # noqa: B006
        op = self.nixl_ops[operation]
        remote_agent = remote_agent.decode() if isinstance(remote_agent, bytes) else remote_agent
        h = self.agent.createXferReq(op, local_descs, remote_descs, remote_agent, notif_msg, self._handles(backends))
        return nixl_xfer_handle(self.agent, h, self)

    @staticmethod
    def _state(status) -> str:
        if status == nixlBind.NIXL_SUCCESS:
            return "DONE"
        if status == nixlBind.NIXL_IN_PROG:
            return "PROC"
        return "ERR"

    def transfer(self, handle, notif_msg: bytes = b"") -> str:
        return self._state(self.agent.postXferReq(handle._handle, notif_msg))

    def check_xfer_state(self, handle) -> str:
        return self._state(self.agent.getXferStatus(handle._handle))

    def get_xfer_telemetry(self, handle):
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle) -> str:
        b = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h._handle == b)

    def release_xfer_handle(self, handle):
        handle.release()

    def release_dlist_handle(self, handle):
        handle.release()

    def prep_mem_view(self, *args, **kwargs):
        return self.agent.prepMemView(*args, **kwargs)

    def release_mem_view(self, mvh) -> None:
        self.agent.releaseMemView(mvh)

    # -- notifications --
    def get_new_notifs(self, backends: list = []) -> dict:  # noqa: B006
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: list = []) -> dict:  # noqa: B006
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag: bytes, backends: list = [],  # noqa: B006
                               tag_is_prefix=True) -> bool:
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        name = remote_agent_name.decode() if isinstance(remote_agent_name, bytes) else remote_agent_name
        msgs = self.notifs.get(name, [])
        for i, msg in enumerate(msgs):
            if (tag_is_prefix and msg.startswith(lookup_tag)) or (not tag_is_prefix and lookup_tag in msg):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name, notif_msg: bytes, backend: Optional[str] = None):
        name = remote_agent_name.decode() if isinstance(remote_agent_name, bytes) else remote_agent_name
        self.agent.genNotif(name, notif_msg, [] if backend is None else [self.backends[backend]._handle])

    # -- metadata --
    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs, inc_conn_info: bool = False, backends: list = []):  # noqa: B006
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent):
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(self, descs, inc_conn_info=False, backends=[], ip_addr="",  # noqa: B006
                                    port=DEFAULT_COMM_PORT, label=""):
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT,
                              label: str = ""):
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent, descs=None) -> bool:
        if descs is None:
            descs = nixlBind.nixlXferDList(nixlBind.DRAM_SEG)
        return self.agent.checkRemoteMD(agent, descs) == nixlBind.NIXL_SUCCESS

    # -- descriptor conversion --
    def _from_tensors(self, cls, descs):
        tensors = [descs] if _is_tensor(descs) else list(descs)
        device = tensors[0].device
        rows = np.zeros((len(tensors), 3), dtype=np.uint64)
        for i, t in enumerate(tensors):
            if t.device != device:
                return None
            if not t.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            dev = t.get_device()
            rows[i] = (t.data_ptr(), t.numel() * t.element_size(), 0 if dev == -1 else dev)
        mem = "DRAM" if tensors[0].get_device() == -1 else "VRAM"
        return cls(self.nixl_mems[mem], rows)

    def _descs(self, cls, other, width, descs, mem_type):
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            logger.error("Wrong descriptor list type: %s", type(descs).__name__)
            return None
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs.ndim == 2 and descs.shape[1] == 3:
                return cls(self.nixl_mems[mem_type], descs)
            logger.error("Nx3 shape required for a descriptor list from a numpy array")
            return None
        if _is_tensor(descs) or (isinstance(descs, (list, tuple)) and descs and _is_tensor(descs[0])):
            return self._from_tensors(cls, descs)
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if len(descs[0]) != width:
                logger.error("%d-tuple list needed", width)
                return None
            return cls(self.nixl_mems[mem_type], descs)
        return None

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None):
        return self._descs(nixlBind.nixlXferDList, nixlBind.nixlRegDList, 3, descs, mem_type)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None):
        return self._descs(nixlBind.nixlRegDList, nixlBind.nixlXferDList, 4, descs, mem_type)

    def get_remote_descs(self, descs, mem_type: Optional[str] = None):
        if isinstance(descs, nixlBind.nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None or len(descs[0]) != 4:
                logger.error("4-tuple list (addr, len, dev_id, agent_name) and a mem type needed")
                return None
            return nixlBind.nixlRemoteDList(self.nixl_mems[mem_type], descs)
        return None

    def get_serialized_descs(self, descs) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        return pickle.loads(serialized_descs)
