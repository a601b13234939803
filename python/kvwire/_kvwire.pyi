"""Type stubs of the kvwire extension. Shapes are in elements of uint8 (= bytes)."""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._reqdata import TransferReqData as _Req

Options = Union[Mapping[str, Union[str, int]], str, Sequence[Union[str, Tuple[str, Union[str, int]]]]]
"""Transport options: ``{"key": value}``, ``"key=value"``, or a list of ``"key=value"`` / ``(key, value)``."""

PageIdxs = Union[Sequence[int], Mapping[str, Sequence[int]]]
"""Page indices: one list for every leaf, or ``{leaf_id: [page, ...]}``."""

class TransferError(RuntimeError):
    """A transfer or the transport under it failed; ``kind``: "peer_died", "peer_timeout", "remote_access", ..."""

    kind: Optional[str]

class DecodeError(ValueError):
    """Not JSON / msgpack, truncated, trailing data (msgspec.DecodeError)."""

class ValidationError(DecodeError):
    """Wrong type or tag, missing field (msgspec.ValidationError)."""

def metrics_text() -> str:
    """The process's metrics registry as Prometheus text (MAX's metric names)."""

class TensorAgentMetadata:
    agent_name: str
    metadata: bytes
    base_addrs: List[int]
    device_id: int
    region_splits: List[List[int]]

class KVLoadRefused(RuntimeError):
    """A connector refused a load before any byte moved."""

class KVLoadFailed(RuntimeError):
    """A connector load failed after it was accepted."""

class KVCacheMemory:
    """One logical KV tensor (a NIXL group) as one view per TP shard.

    ``buffers``: one writable host buffer per TP shard, each 2-D ``uint8``
    ``[num_pages, bytes_per_page]`` (null block included), contiguous:
    numpy arrays, CPU torch tensors (``__dlpack__``), or 2-D buffer-protocol
    objects. Kept alive by this object and every engine registering them.

    Raises:
        ValueError: no buffers, not 2-D, not uint8, not contiguous, read-only,
            shapes differ, ``replicated`` with fewer than 2 buffers.
    """

    def __init__(self, replicated: bool, buffers: Sequence[Any]) -> None: ...
    @property
    def replicated(self) -> bool: ...
    @property
    def buffers(self) -> List[Any]: ...
    @property
    def bytes_per_page(self) -> int:
        """``buffers[0].shape[1]`` (bytes)."""
    @property
    def total_num_pages(self) -> int:
        """``buffers[0].shape[0]``, null block included."""
    @property
    def host_bytes_per_page(self) -> int:
        """``bytes_per_page * (1 if replicated else len(buffers))`` (bytes)."""

class KVTransferEngineMetadata:
    """What a peer needs to connect; ``to_bytes()`` / ``from_bytes()`` round-trip, and it pickles."""

    @property
    def name(self) -> str: ...
    @property
    def hostname(self) -> str: ...
    @property
    def memory_type(self) -> Any:
        """``kvwire.MemoryType.DRAM`` or ``.VRAM``."""
    @property
    def bytes_per_page(self) -> int: ...
    @property
    def agents_meta(self) -> List[List[TensorAgentMetadata]]: ...
    def to_msgpack(self) -> bytes: ...
    @staticmethod
    def from_msgpack(data: bytes) -> "KVTransferEngineMetadata": ...
    @property
    def leaf_ids(self) -> List[str]: ...
    @property
    def num_pages_per_group(self) -> List[int]: ...
    @property
    def bytes_per_group(self) -> List[int]: ...
    @property
    def replicated_per_group(self) -> List[bool]: ...
    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    def to_json(self) -> str: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> "KVTransferEngineMetadata":
        """Raises ValueError on malformed data."""
    @staticmethod
    def from_json(text: str) -> "KVTransferEngineMetadata":
        """Raises ValueError on malformed data."""

class TransferReqData:
    """The extension's ``TransferReqData``: ``kvwire.TransferReqData`` only
    where msgspec is not installed (otherwise it is ``kvwire._reqdata``'s
    msgspec struct, MAX's own kind of class). Same constructor, attributes
    and bytes."""

    def __init__(
        self,
        *,
        dst_name: str,
        src_name: str,
        transfer_name: str,
        transfer_ids: Sequence[int],
        src_idxs: PageIdxs,
        dst_idxs: PageIdxs,
        src_replica_idx: int,
        dst_replica_idx: int,
        is_read: bool = False,
        tp_shard_count: int = 0,
        local_shards_used: Optional[Sequence[int]] = None,
    ) -> None: ...
    @property
    def dst_name(self) -> str: ...
    @property
    def src_name(self) -> str: ...
    @property
    def transfer_name(self) -> str: ...
    @property
    def transfer_ids(self) -> List[int]: ...
    @property
    def src_idxs(self) -> Union[List[int], Dict[str, List[int]]]: ...
    @property
    def dst_idxs(self) -> Union[List[int], Dict[str, List[int]]]: ...
    @property
    def src_replica_idx(self) -> int: ...
    @property
    def dst_replica_idx(self) -> int: ...
    @property
    def is_read(self) -> bool: ...
    @property
    def tp_shard_count(self) -> int: ...
    @property
    def local_shards_used(self) -> List[int]: ...
    def to_json(self) -> str:
        """Compact msgspec JSON, byte-identical to ``msgspec.json.encode(req).decode()``."""
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_json(data: Union[str, bytes]) -> "TransferReqData":
        """Raises ValueError on malformed data."""
    @staticmethod
    def from_bytes(data: Union[str, bytes]) -> "TransferReqData": ...
    def to_msgpack(self) -> bytes:
        """Byte-identical to ``msgspec.msgpack.encode(req)``."""
    @staticmethod
    def from_msgpack(data: bytes) -> "TransferReqData":
        """Raises DecodeError / ValidationError."""

class KVTransferEngine:
    """KV-cache transfer engine with DP and TP, as MAX's ``KVTransferEngine``.

    ``memory`` is ``[replica][group]``; ``leaf_ids`` defaults to ``"0"``, ``"1"``, ...
    ``transport``: ``"shm"`` (same host), ``"tcp"``, ``"verbs"``. Calls release the GIL.

    Raises:
        ValueError: MAX's ``__init__`` validation (in its order).
    """

    def __init__(
        self,
        name: str,
        memory: Sequence[Sequence[KVCacheMemory]],
        leaf_ids: Optional[Sequence[str]] = None,
        *,
        transport: str = "shm",
        peer_timeout_s: float = 5.0,
        copy_threads: int = 2,
        options: Optional[Options] = None,
    ) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def leaf_ids(self) -> List[str]: ...
    @property
    def bytes_per_group(self) -> List[int]: ...
    @property
    def num_pages_per_group(self) -> List[int]: ...
    @property
    def replicated_per_group(self) -> List[bool]: ...
    @property
    def bytes_per_page(self) -> int: ...
    @property
    def memory_type(self) -> Any: ...
    @property
    def remote_connections(self) -> Dict[str, KVTransferEngineMetadata]: ...
    @property
    def remote_agent_to_engine(self) -> Dict[str, str]: ...
    @property
    def inflight_send_transfers(self) -> Dict[str, _Req]: ...
    @property
    def inflight_read_transfers(self) -> Dict[str, _Req]: ...
    @property
    def completed_recv_transfers(self) -> Dict[str, Dict[str, int]]: ...
    @classmethod
    def from_paged_kv_cache(cls, name: str, kv_cache: Any, *, transport: str = "shm", peer_timeout_s: float = 5.0,
                            copy_threads: int = 2, options: Optional[Options] = None) -> "KVTransferEngine": ...
    @property
    def metadata(self) -> KVTransferEngineMetadata: ...
    def connect(self, remote: KVTransferEngineMetadata) -> None:
        """Raises ValueError (already connected, bytes-per-page or leaf mismatch),
        NotImplementedError (GATHER_SCATTER: sharded TP != TP')."""
    def disconnect(self, remote_name: str) -> None:
        """Raises ValueError when not connected."""
    def is_connected(self, remote_name: str) -> bool: ...
    def initiate_send_transfer(
        self,
        remote: Union[str, KVTransferEngineMetadata],
        src_idxs: PageIdxs,
        dst_idxs: PageIdxs,
        src_replica_idx: int = 0,
        dst_replica_idx: int = 0,
    ) -> _Req:
        """WRITE local pages to ``remote``. Raises ValueError, TransferError."""
    def initiate_read_transfer(
        self,
        remote: Union[str, KVTransferEngineMetadata],
        src_idxs: PageIdxs,
        dst_idxs: PageIdxs,
        src_replica_idx: int = 0,
        dst_replica_idx: int = 0,
    ) -> _Req:
        """READ ``remote``'s pages into local pages. Raises ValueError, TransferError."""
    def is_complete(self, req: Union[_Req, TransferReqData]) -> bool:
        """Either side. Raises TransferError when a shard request failed."""
    def cleanup_transfer(self, req: Union[_Req, TransferReqData]) -> None:
        """Raises ValueError when not complete or unknown."""
    def cancel_transfer(self, req: Union[_Req, TransferReqData]) -> None: ...
    def sync_and_release(self, req: Union[_Req, TransferReqData], timeout_s: float = 30.0) -> None:
        """Wait (seconds), then release. Raises TimeoutError (after cancelling)."""
    def cleanup(self) -> None: ...

class KVConnectorTransfer:
    """A connector copy. ``g0_blocks_per_leaf``: device blocks pinned until it lands (offloads)."""

    def is_complete(self) -> bool:
        """Never blocks. Raises KVLoadFailed (load) or RuntimeError (offload) when the copy failed."""
    def synchronize(self) -> None:
        """Blocks (GIL released) until the copy lands or fails."""
    @property
    def g0_blocks_per_leaf(self) -> Dict[str, List[int]]: ...

BlockHashes = Sequence[Union[bytes, int]]
"""Canonical block hashes: 8 big-endian bytes (ahash64) or 32 bytes (SHA-256); an int is taken as 8 bytes."""

class KVConnector:
    """MAX's ``KVConnector`` protocol (base of the connectors)."""

    @property
    def name(self) -> str: ...
    @property
    def leaves(self) -> Dict[str, Any]:
        """``{leaf_id: kvwire.KVCacheGroupId}``."""
    def lookup(self, block_hashes: BlockHashes, replica_idx: int = 0, hint: Optional[bytes] = None) -> Dict[str, List[bool]]:
        """Presence per leaf, one bool per hash. Reserves nothing."""
    def load(
        self,
        block_ids: Mapping[str, Sequence[int]],
        block_hashes: Mapping[str, BlockHashes],
        replica_idx: int = 0,
        hint: Optional[bytes] = None,
    ) -> KVConnectorTransfer:
        """All or nothing; must follow a ``lookup`` with the same replica and hint.
        Raises KVLoadRefused (nothing moved), KVLoadFailed, ValueError."""
    def offload(
        self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, BlockHashes], replica_idx: int = 0
    ) -> KVConnectorTransfer: ...
    def touch(self, block_hashes: BlockHashes, replica_idx: int = 0) -> None: ...
    def poll_transfers(self) -> None: ...
    def shutdown(self) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    @property
    def metrics(self) -> Any:
        """``kvwire.KVCacheMetrics``."""
    def take_metrics(self) -> Any: ...
    @property
    def host_byte_count(self) -> Any:
        """``kvwire.ByteCount``."""
    @property
    def disk_byte_count(self) -> Any: ...

class HostTierConnector(KVConnector):
    """Host-memory tier of ``capacity_bytes``, LRU by (leaf, hash), copying on a worker thread.

    ``replicas[replica_idx]`` maps leaf id -> the device ``KVCacheMemory``.
    A host row is ``host_bytes_per_page`` bytes (replicated leaves stored once, broadcast on load).
    """

    def __init__(
        self,
        replicas: Sequence[Mapping[str, KVCacheMemory]],
        capacity_bytes: int,
        leaves: Optional[Mapping[str, Any]] = None,
    ) -> None: ...
