from ._kvwire import (
    DecodeError as DecodeError,
    HostTierConnector as HostTierConnector,
    KVCacheMemory as KVCacheMemory,
    KVConnector as KVConnector,
    KVConnectorTransfer as KVConnectorTransfer,
    KVLoadFailed as KVLoadFailed,
    KVLoadRefused as KVLoadRefused,
    KVTransferEngine as KVTransferEngine,
    KVTransferEngineMetadata as KVTransferEngineMetadata,
    TensorAgentMetadata as TensorAgentMetadata,
    TransferError as TransferError,
    ValidationError as ValidationError,
    metrics_text as metrics_text,
)
from ._max import (
    BlockCount as BlockCount,
    ByteCount as ByteCount,
    CompletedTransfer as CompletedTransfer,
    KVCacheGroupId as KVCacheGroupId,
    KVCacheMetrics as KVCacheMetrics,
    MemoryType as MemoryType,
    NullConnector as NullConnector,
    dkv_tier_degraded as dkv_tier_degraded,
)
from ._reqdata import TransferReqData as TransferReqData
