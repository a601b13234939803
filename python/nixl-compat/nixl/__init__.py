"""NIXL's Python API over kvwire.

`nixl._api`, `nixl._bindings`, `nixl._utils` and `nixl.logging` behave as
NIXL 1.5.1's (ai-dynamo/nixl `src/api/python/_api.py`,
`src/bindings/python/nixl_bindings.cpp`), so vLLM's NixlConnector and
SGLang's NIXL backend run unchanged; the data moves over kvwire's shm, tcp or
verbs transport. Both sides of a transfer must use this package: there is no
wire interoperability with real NIXL agents. See docs/NIXL.md.
"""

from ._api import (  # noqa: F401
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
