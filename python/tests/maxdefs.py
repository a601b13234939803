"""MAX 26.7's msgspec structs, re-declared from their public definitions in
``max/pipelines/kv_cache/paged_kv_cache/transfer_engine.py`` (field names,
types, defaults, struct options) so tests can compare kvwire's bytes with
msgspec's. Imports msgspec (a test-only dependency); tests skip without it."""

import enum

import msgspec


class MemoryType(enum.Enum):  # max._core.nixl.MemoryType
    DRAM = 0
    VRAM = 1
    BLK = 2
    OBJ = 3
    FILE = 4


class TensorAgentMetadata(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    agent_name: str
    metadata: bytes
    base_addrs: list[int]
    device_id: int
    region_splits: list[list[int]] = msgspec.field(default_factory=list)


class TransferEngineMetadata(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    name: str
    memory_type: MemoryType
    hostname: str
    agents_meta: list[list[TensorAgentMetadata]]


class KVTransferEngineMetadata(TransferEngineMetadata):
    leaf_ids: list[str]
    num_pages_per_group: list[int]
    bytes_per_page: int
    bytes_per_group: list[int]
    replicated_per_group: list[bool] = []


class TransferReqData(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    dst_name: str
    src_name: str
    transfer_name: str
    transfer_ids: list[int]
    src_idxs: dict[str, list[int]]
    dst_idxs: dict[str, list[int]]
    src_replica_idx: int
    dst_replica_idx: int
    is_read: bool = False
    tp_shard_count: int = 0
    local_shards_used: list[int] = []
