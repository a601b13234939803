"""The plain-Python types of MAX 26.7's KV API, with MAX's names, fields,
defaults and checks, so that code written against ``max.nn.kv_cache`` and
``max.pipelines.kv_cache`` runs unchanged against kvwire:

- ``MemoryType``: ``nixl.MemoryType`` (``max._core.nixl``), an ``enum.Enum``
  with NIXL's integer values; metadata carries it as that integer.
- ``KVCacheGroupId``: ``max.nn.kv_cache.cache_params.KVCacheGroupId``.
- ``KVCacheMetrics``: ``max.nn.kv_cache.metrics.KVCacheMetrics``.
- ``ByteCount``, ``BlockCount``, ``CompletedTransfer``, ``NullConnector``:
  ``max.pipelines.kv_cache.kv_connector`` and ``connectors.null_connector``.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence


class MemoryType(enum.Enum):
    """NIXL's memory segment type; kvwire engines use ``DRAM`` and ``VRAM``."""

    DRAM = 0
    VRAM = 1
    BLK = 2
    OBJ = 3
    FILE = 4


_GROUP_TYPES = ("full", "sliding_window", "recurrent", "scratch")


@dataclass(frozen=True)
class KVCacheGroupId:
    """The caches a model reuses and evicts together (MAX's fields and checks).

    ``type`` is ``"full"``, ``"sliding_window"``, ``"recurrent"`` or
    ``"scratch"``; ``window_size`` (tokens, query token included) is ``-1``
    except for a sliding window, where it must be greater than 1.
    """

    type: str
    window_size: int = -1

    def __post_init__(self) -> None:
        # As MAX: ``type`` is a Literal hint, not checked; the window is.
        if self.type == "sliding_window":
            if self.window_size <= 1:
                raise ValueError(
                    f"Window size must be greater than 1 for sliding window groups, got {self.window_size}."
                )
        elif self.type in _GROUP_TYPES and self.window_size != -1:
            raise ValueError(f"Window size must be -1 for {self.type} groups.")

    def is_full(self) -> bool:
        return self.type == "full"

    def is_sliding_window(self) -> bool:
        return self.type == "sliding_window"

    def is_recurrent(self) -> bool:
        return self.type == "recurrent"

    def is_scratch(self) -> bool:
        return self.type == "scratch"

    def blocks_in_window(self, page_size: int) -> int:
        """Blocks a sliding window reaches back (``-1`` for a full group)."""
        if self.is_scratch():
            raise ValueError("a scratch group has no window: it holds one block per request")
        if self.is_full():
            return -1
        return -(-(self.window_size - 1) // page_size)

    @classmethod
    def full(cls) -> "KVCacheGroupId":
        return cls(type="full")

    @classmethod
    def recurrent(cls) -> "KVCacheGroupId":
        return cls(type="recurrent")

    @classmethod
    def scratch(cls) -> "KVCacheGroupId":
        return cls(type="scratch")

    def __repr__(self) -> str:
        if self.type == "sliding_window":
            return f"sliding_window_group({self.window_size})"
        return f"{self.type}_group"


def _add_by_key(a: Mapping, b: Mapping) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def dkv_tier_degraded(connected_clients: int, total_clients: int) -> bool:
    """True when a dKV tier exists but not every replica is connected to it."""
    return total_clients > 0 and connected_clients < total_clients


@dataclass
class KVCacheMetrics:
    """Per-window transfer counters and live gauges, MAX 26.7's field set.

    Device figures are in blocks, the connector's host and disk tiers in
    bytes, latencies in milliseconds. ``+`` sums every field except
    ``nixl_read_latency_max_ms`` (the max) and merges the per-key dicts.
    """

    input_tokens: int = 0
    cache_tokens: int = 0
    device_blocks_served: int = 0
    h2d_bytes_copied: int = 0
    d2h_bytes_copied: int = 0
    cross_replica_blocks_copied: int = 0
    cross_replica_bytes_copied: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    inflight_disk_ops: int = 0
    connector_loads_refused: int = 0
    connector_load_failures: int = 0
    connector_offload_blocks_dropped: int = 0
    nixl_read_blocks: int = 0
    nixl_write_blocks: int = 0
    nixl_read_latency_total_ms: float = 0.0
    nixl_read_latency_count: int = 0
    nixl_read_latency_max_ms: float = 0.0
    nixl_write_latency_total_ms: float = 0.0
    nixl_write_latency_count: int = 0
    rpc_acquire_latency_total_ms: float = 0.0
    rpc_acquire_latency_count: int = 0
    rpc_read_latency_total_ms: float = 0.0
    rpc_read_latency_count: int = 0
    nixl_read_bytes: int = 0
    nixl_write_bytes: int = 0
    dkv_connected_clients: int = 0
    dkv_total_clients: int = 0
    dkv_reconnect_attempts: int = 0
    dkv_peer_attaches: int = 0
    dkv_peer_attach_failures: int = 0
    dkv_peers_dropped: int = 0
    dkv_peer_loads: int = 0
    dkv_peer_load_failures: int = 0
    dkv_peer_transfer_failures: int = 0
    dkv_peer_metadata_refreshes: int = 0
    dkv_peer_metadata_refresh_failures: int = 0
    dkv_hints_rejected: int = 0
    dkv_hints_rejected_by_reason: Dict[str, int] = field(default_factory=dict)
    dkv_rpc_calls: Dict[str, int] = field(default_factory=dict)
    dkv_rpc_time_ms: Dict[str, float] = field(default_factory=dict)
    dkv_rpc_socket_wait_ms: Dict[str, float] = field(default_factory=dict)
    dkv_lock_waits: Dict[str, int] = field(default_factory=dict)
    dkv_lock_wait_ms: Dict[str, float] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cache_tokens

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def nixl_read_latency_avg_ms(self) -> float:
        n = self.nixl_read_latency_count
        return self.nixl_read_latency_total_ms / n if n else 0.0

    @property
    def nixl_write_latency_avg_ms(self) -> float:
        n = self.nixl_write_latency_count
        return self.nixl_write_latency_total_ms / n if n else 0.0

    @property
    def rpc_acquire_latency_avg_ms(self) -> float:
        n = self.rpc_acquire_latency_count
        return self.rpc_acquire_latency_total_ms / n if n else 0.0

    @property
    def rpc_read_latency_avg_ms(self) -> float:
        n = self.rpc_read_latency_count
        return self.rpc_read_latency_total_ms / n if n else 0.0

    @property
    def nixl_read_gib_per_s(self) -> float:
        ms = self.nixl_read_latency_total_ms
        return (self.nixl_read_bytes / (1 << 30)) / (ms / 1000) if ms > 0 else 0.0

    @property
    def nixl_write_gib_per_s(self) -> float:
        ms = self.nixl_write_latency_total_ms
        return (self.nixl_write_bytes / (1 << 30)) / (ms / 1000) if ms > 0 else 0.0

    @property
    def dkv_degraded(self) -> bool:
        return dkv_tier_degraded(self.dkv_connected_clients, self.dkv_total_clients)

    def __add__(self, other: "KVCacheMetrics") -> "KVCacheMetrics":
        out = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "nixl_read_latency_max_ms":
                out[f.name] = max(a, b)
            elif isinstance(a, dict):
                out[f.name] = _add_by_key(a, b)
            else:
                out[f.name] = a + b
        return type(self)(**out)


# MAX 26.7 declares both counts ``@dataclass(frozen=True, slots=True)``
# (``max/pipelines/kv_cache/kv_connector.py``): plain records, neither
# tuples (not unpackable, not indexable) nor related to each other.
# ``slots=`` needs Python 3.10; on 3.9 they keep a ``__dict__``.
_SLOTS = {"slots": True} if sys.version_info >= (3, 10) else {}


@dataclass(frozen=True, **_SLOTS)
class BlockCount:
    """A point-in-time snapshot of a device block pool's occupancy (blocks)."""

    free: int
    total: int

    @property
    def used(self) -> int:
        """Blocks in use."""
        return self.total - self.free

    @property
    def used_pct(self) -> float:
        """Percentage of blocks in use, in ``[0, 100]``; ``0`` when ``total`` is ``0``."""
        return 100 * self.used / self.total if self.total else 0.0

    @property
    def free_pct(self) -> float:
        """Percentage of blocks free, in ``[0, 100]``; ``0`` when ``total`` is ``0``."""
        return 100 * self.free / self.total if self.total else 0.0


@dataclass(frozen=True, **_SLOTS)
class ByteCount:
    """A point-in-time snapshot of a connector's host or disk tier occupancy (bytes)."""

    free: int
    total: int

    @property
    def used(self) -> int:
        """Bytes in use."""
        return self.total - self.free

    @property
    def used_pct(self) -> float:
        """Percentage of bytes in use, in ``[0, 100]``; ``0`` when ``total`` is ``0``."""
        return 100 * self.used / self.total if self.total else 0.0

    @property
    def free_pct(self) -> float:
        """Percentage of bytes free, in ``[0, 100]``; ``0`` when ``total`` is ``0``."""
        return 100 * self.free / self.total if self.total else 0.0


class CompletedTransfer:
    """A transfer already complete: nothing pinned, nothing to wait for."""

    def __init__(self, g0_blocks_per_leaf: Optional[Mapping[str, Sequence[int]]] = None) -> None:
        self._g0_blocks_per_leaf = g0_blocks_per_leaf or {}

    @property
    def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
        return self._g0_blocks_per_leaf

    def is_complete(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"CompletedTransfer({dict(self._g0_blocks_per_leaf)!r})"


class NullConnector:
    """No external cache, as MAX's: one ``"full"`` leaf, every block absent,
    every load and offload an already-completed transfer. Accepts any input
    (hashes of any length, any block ids), as MAX's does."""

    @property
    def leaves(self) -> Dict[str, KVCacheGroupId]:
        return {"full": KVCacheGroupId.full()}

    @property
    def name(self) -> str:
        return "NullConnector"

    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: Optional[bytes] = None) -> Dict[str, List[bool]]:
        return {leaf_id: [False] * len(block_hashes) for leaf_id in self.leaves}

    def load(self, block_ids, block_hashes, replica_idx: int = 0, hint: Optional[bytes] = None) -> CompletedTransfer:
        return CompletedTransfer()

    def offload(self, block_ids, block_hashes, replica_idx: int = 0) -> CompletedTransfer:
        return CompletedTransfer()

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        return None

    def poll_transfers(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        return None

    @property
    def host_byte_count(self) -> ByteCount:
        return ByteCount(free=0, total=0)

    @property
    def disk_byte_count(self) -> ByteCount:
        return ByteCount(free=0, total=0)

    @property
    def metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics()

    def take_metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics()
