"""Not provided by kvwire: importing this module raises ImportError."""

raise ImportError(
    "mooncake.mooncake_config (kvwire): mooncake_config belongs to Mooncake Store, which kvwire does not provide."
)
