"""Not provided by kvwire: importing this module raises ImportError."""

raise ImportError(
    "mooncake.store (kvwire): Mooncake Store (a distributed KV object store with a master service) is not part of kvwire; kvwire provides only the transfer engine (mooncake.engine.TransferEngine). Install Mooncake's own wheel for the store."
)
