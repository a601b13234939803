"""Mooncake's Python package name, provided by kvwire (distribution
``mooncake-kvwire``): ``mooncake.engine.TransferEngine`` with Mooncake
Transfer Engine 0.3's Python semantics over kvwire's shm / tcp / verbs
transports. See docs/MOONCAKE.md.

Only the transfer engine is provided. ``mooncake.store``, ``mooncake.pg``,
``mooncake.ep`` and the allocators are separate Mooncake features: importing
them raises ``ImportError`` naming the reason.
"""

__version__ = "0.3.13+kvwire.0.1.0"
