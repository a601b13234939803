"""Not provided by kvwire: importing this module raises ImportError."""

raise ImportError(
    "mooncake.pg (kvwire): mooncake.pg (process groups / elastic EP over Mooncake's C++ engine, TransferEngine.get_engine()) needs Mooncake's C++ engine object, which kvwire does not have; use torch.distributed process groups (gloo/nccl)."
)
