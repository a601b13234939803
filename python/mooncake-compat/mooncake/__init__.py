"""Mooncake's Python package name, provided by kvwire (distribution
``mooncake-kvwire``): ``mooncake.engine.TransferEngine`` with Mooncake
Transfer Engine 0.3's Python semantics over kvwire's shm / tcp / verbs
transports. See docs/MOONCAKE.md.

Only the transfer engine is provided. ``mooncake.pg``, ``mooncake.ep`` and
the allocators are separate Mooncake features: importing them raises
``ImportError`` naming the reason. ``mooncake.store`` imports (its
``ReplicateConfig`` is plain data, ``MooncakeDistributedStore()`` constructs)
but every store operation raises ``NotImplementedError`` naming the reason;
``BufferPool`` / ``RegisteredBufferPool`` (one class, as Mooncake's
``mooncake/buffer_pool.py`` exports them) is the store's and raises when
constructed.
"""

__version__ = "0.3.13+kvwire.0.1.0"

__all__ = ["BufferPool", "RegisteredBufferPool"]


def __getattr__(name):
    # Lazy, as Mooncake's package: `mooncake.engine` users never load the store module.
    if name in ("BufferPool", "RegisteredBufferPool"):
        from mooncake.store import BufferPool

        return BufferPool
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")
