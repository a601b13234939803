from ._kvwire import (
    HostTierConnector as HostTierConnector,
    KVCacheGroupId as KVCacheGroupId,
    KVCacheMemory as KVCacheMemory,
    KVConnector as KVConnector,
    KVConnectorTransfer as KVConnectorTransfer,
    KVLoadFailed as KVLoadFailed,
    KVLoadRefused as KVLoadRefused,
    KVTransferEngine as KVTransferEngine,
    KVTransferEngineMetadata as KVTransferEngineMetadata,
    NullConnector as NullConnector,
    TransferError as TransferError,
    TransferReqData as TransferReqData,
)
