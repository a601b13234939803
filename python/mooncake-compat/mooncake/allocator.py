"""Not provided by kvwire: importing this module raises ImportError."""

raise ImportError(
    "mooncake.allocator (kvwire): Mooncake's NVLink/fabric allocators (mooncake.allocator) are not part of kvwire; allocate KV buffers with torch/numpy and register them with TransferEngine.register_memory."
)
