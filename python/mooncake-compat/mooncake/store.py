"""``mooncake.store`` as far as kvwire can honestly provide it.

Mooncake Store (a distributed KV object store with a master service,
``MooncakeDistributedStore``) is not part of kvwire: kvwire provides the
transfer engine only (``mooncake.engine.TransferEngine``). What this module
gives, so that code written for Mooncake 0.3's wheel imports and fails at the
point of use with the reason (not with an ``ImportError`` that hides which
feature is missing):

- ``ReplicateConfig``: the store's replication settings, a plain settings
  object with the fields and defaults of Mooncake's ``ReplicateConfig``
  (``mooncake-store/include/replica.h``; bound read-write in
  ``mooncake-integration/store/store_py.cpp``).
- ``MooncakeDistributedStore``: constructing one works, as in Mooncake (its
  constructor connects to nothing); every store operation (``setup``,
  ``put``, ``get``, ``register_buffer`` …) raises ``NotImplementedError``
  naming the reason and the alternative, and any other attribute raises
  ``AttributeError`` with the same text.
- ``BufferPool`` (also ``mooncake.BufferPool`` / ``mooncake.RegisteredBufferPool``,
  one class as in Mooncake's ``mooncake/buffer_pool.py``): a pool of buffers
  registered with a store; constructing one raises ``NotImplementedError``.
"""

from __future__ import annotations

__all__ = ["BufferPool", "MooncakeDistributedStore", "ReplicateConfig", "STORE_NOT_PROVIDED"]

#: The reason every store operation gives.
STORE_NOT_PROVIDED = (
    "Mooncake Store is not provided by kvwire (mooncake-kvwire ships only the transfer engine, "
    "mooncake.engine.TransferEngine); for the distributed KV store (MooncakeDistributedStore, its "
    "master service, BufferPool) install Mooncake's own wheel (mooncake-transfer-engine) instead"
)

# The operations of Mooncake 0.3's MooncakeDistributedStore binding
# (mooncake-integration/store/store_py.cpp), each raising with the reason.
_STORE_METHODS = (
    "setup", "init_all", "setup_dummy", "close", "put", "put_parts", "put_batch", "put_from",
    "put_tensor", "get", "get_batch", "get_buffer", "get_into", "get_tensor", "get_size",
    "get_hostname", "remove", "remove_by_regex", "remove_all", "is_exist", "batch_is_exist",
    "batch_get_buffer", "batch_get_into", "batch_put_from", "batch_get_tensor",
    "batch_put_tensor", "register_buffer", "unregister_buffer", "alloc_from_mem_pool",
    "get_replica_desc", "batch_get_replica_desc", "upsert", "upsert_from",
)


def _not_provided(name: str):
    def op(self, *args, **kwargs):
        raise NotImplementedError(f"MooncakeDistributedStore.{name}: {STORE_NOT_PROVIDED}")

    op.__name__ = name
    op.__doc__ = f"Raises NotImplementedError: {STORE_NOT_PROVIDED}."
    return op


class ReplicateConfig:
    """Replication settings of a store put, with Mooncake's fields and defaults.

    Plain data: no store is contacted. ``group_ids`` is ``None`` (no group)
    or a list of group names, as Mooncake's ``std::optional<std::vector<std::string>>``.
    """

    __slots__ = (
        "replica_num", "nof_replica_num", "with_soft_pin", "with_hard_pin",
        "preferred_segments", "preferred_segment", "preferred_nof_segments",
        "prefer_alloc_in_same_node", "group_ids",
    )

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segments: list[str] = []
        self.preferred_segment = ""
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list[str] | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"ReplicateConfig({fields})"

    __str__ = __repr__


class MooncakeDistributedStore:
    """Mooncake Store's client: constructible, every operation raises.

    Raises:
        NotImplementedError: from every store operation (``setup``, ``put``,
            ``get`` …), naming the reason (``STORE_NOT_PROVIDED``).
        AttributeError: for any other attribute, with the same reason.
    """

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        raise AttributeError(f"MooncakeDistributedStore has no attribute {name!r}: {STORE_NOT_PROVIDED}")

    def __repr__(self) -> str:
        return "MooncakeDistributedStore(not provided by kvwire)"


for _name in _STORE_METHODS:
    setattr(MooncakeDistributedStore, _name, _not_provided(_name))
del _name


class BufferPool:
    """Mooncake's pool of store-registered buffers: constructing one raises.

    Raises:
        NotImplementedError: always, naming the reason (``STORE_NOT_PROVIDED``).
    """

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"BufferPool: {STORE_NOT_PROVIDED}")
