"""kvwire: move paged LLM KV caches between inference engines.

The classes follow Modular MAX's KV transfer API (``max.pipelines.kv_cache``
and ``max.nn.kv_cache``), so that a MAX user can switch by changing an
import::

    from kvwire import KVCacheMemory, KVTransferEngine, TransferReqData

Every KV buffer is a writable host array, 2-D ``uint8`` of shape
``[num_pages, bytes_per_page]`` per TP shard (null block included).
See docs/PYTHON.md.
"""

from ._kvwire import (
    HostTierConnector,
    KVCacheGroupId,
    KVConnector,
    KVConnectorTransfer,
    NullConnector,
    KVCacheMemory,
    KVLoadFailed,
    KVLoadRefused,
    KVTransferEngine,
    KVTransferEngineMetadata,
    TransferError,
    TransferReqData,
)

__all__ = [
    "HostTierConnector",
    "KVCacheGroupId",
    "KVConnector",
    "KVConnectorTransfer",
    "NullConnector",
    "KVCacheMemory",
    "KVLoadFailed",
    "KVLoadRefused",
    "KVTransferEngine",
    "KVTransferEngineMetadata",
    "TransferError",
    "TransferReqData",
]
