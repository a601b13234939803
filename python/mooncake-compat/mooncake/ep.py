"""Not provided by kvwire: importing this module raises ImportError."""

raise ImportError(
    "mooncake.ep (kvwire): Mooncake EP buffers (expert-parallel all-to-all over RDMA/NVLink) are not part of kvwire."
)
