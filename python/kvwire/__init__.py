"""kvwire: move paged LLM KV caches between inference engines.

The classes follow Modular MAX 26.7's KV transfer API (``max.pipelines.kv_cache``
and ``max.nn.kv_cache``), so that a MAX user can switch by changing an
import::

    from kvwire import KVCacheMemory, KVTransferEngine, TransferReqData

Every KV buffer is 2-D ``uint8`` of shape ``[num_pages, bytes_per_page]`` per
TP shard (null block included): a writable host array, or a CUDA tensor
(VRAM; tested against a fake libcuda only, see docs/GPU.md).
See docs/PYTHON.md, table "MAX 26.7 -> kvwire".
"""

from ._kvwire import (
    DecodeError,
    HostTierConnector,
    KVConnector,
    KVConnectorTransfer,
    KVCacheMemory,
    KVLoadFailed,
    KVLoadRefused,
    KVTransferEngine,
    KVTransferEngineMetadata,
    TensorAgentMetadata,
    TransferError,
    ValidationError,
    metrics_text,
)
from ._max import (
    BlockCount,
    ByteCount,
    CompletedTransfer,
    KVCacheGroupId,
    KVCacheMetrics,
    MemoryType,
    NullConnector,
    dkv_tier_degraded,
)

try:
    import msgspec as _msgspec
except ImportError:  # not installed (a declared dependency; `pip install --no-deps` skips it)
    _msgspec = None
if _msgspec is not None:
    # MAX's msgspec struct: msgspec.msgpack/json.encode(req) give MAX's bytes.
    from ._reqdata import TransferReqData
else:
    # The extension's class: the same constructor, attributes, bytes and
    # to_*/from_* methods, but msgspec cannot encode it and its decoder
    # refuses integers outside -2^63..2^64.
    from ._kvwire import TransferReqData


def _rebuild_req(fields):
    """Unpickle a ``TransferReqData`` from its constructor keywords (the
    extension's class pickles this way)."""
    return TransferReqData(**fields)


__all__ = [
    "BlockCount",
    "ByteCount",
    "CompletedTransfer",
    "DecodeError",
    "HostTierConnector",
    "KVCacheGroupId",
    "KVCacheMemory",
    "KVCacheMetrics",
    "KVConnector",
    "KVConnectorTransfer",
    "KVLoadFailed",
    "KVLoadRefused",
    "KVTransferEngine",
    "KVTransferEngineMetadata",
    "MemoryType",
    "NullConnector",
    "TensorAgentMetadata",
    "TransferError",
    "TransferReqData",
    "ValidationError",
    "dkv_tier_degraded",
    "metrics_text",
]
