"""``TransferReqData`` as MAX 26.7 declares it: a ``msgspec.Struct`` with
``tag=True, kw_only=True, omit_defaults=True`` and MAX's fields, types,
defaults and order (``max/pipelines/kv_cache/paged_kv_cache/transfer_engine.py``).

Being the same kind of struct, a request is encoded and decoded by msgspec
itself exactly as MAX's is: ``msgspec.msgpack.encode(req)``,
``msgspec.json.encode(req)``, ``msgspec.msgpack.decode(b, type=TransferReqData)``
give MAX's bytes and MAX's values (integers of any size from JSON, msgspec's
``ValidationError`` messages). The engine checks the values when it is handed
a request (``ValueError`` for a negative replica, an index msgpack or a 64-bit
NIXL handle cannot carry), as MAX's engine fails at use.

Imported only when msgspec is installed (a declared dependency of the
package); without it ``kvwire.TransferReqData`` is the extension's own class,
with the same constructor, attributes and ``to_*`` / ``from_*`` methods.
"""

from __future__ import annotations

from typing import Union

import msgspec

from ._kvwire import DecodeError, ValidationError

_Buffer = Union[str, bytes, bytearray, memoryview]


def _decode(decode, data: _Buffer, cls):
    try:
        return decode(data, type=cls)
    except msgspec.ValidationError as e:
        raise ValidationError(str(e)) from e
    except msgspec.DecodeError as e:
        raise DecodeError(str(e)) from e


class TransferReqData(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Metadata of one transfer request (MAX's ``TransferReqData``).

    Safe to send between threads and processes: with msgspec as MAX does,
    with ``to_json()`` / ``to_msgpack()`` and their ``from_*``, or pickle.
    ``src_idxs`` / ``dst_idxs`` may also hold one ``list[int]`` for every leaf
    (kvwire's shorthand; MAX's decoder, and so ``from_json``, takes the dict).
    """

    dst_name: str
    """Base name of the destination engine."""
    src_name: str
    """Base name of the source engine."""
    transfer_name: str
    """Transfer name (a UUID v4; also the notification payload)."""
    transfer_ids: list[int]
    """One transfer handle per posted ``(src_shard, dst_shard)`` pair."""
    src_idxs: dict[str, list[int]]
    """Source page indices, keyed by leaf id."""
    dst_idxs: dict[str, list[int]]
    """Destination page indices, keyed by leaf id."""
    src_replica_idx: int
    """DP replica on the source engine."""
    dst_replica_idx: int
    """DP replica on the destination engine."""
    is_read: bool = False
    """True for a READ (pull) started by the destination."""
    tp_shard_count: int = 0
    """Shard requests posted; 0 = all shards."""
    local_shards_used: list[int] = []
    """Initiator TP shard owning each ``transfer_ids[i]``; empty = ``0..n-1``."""

    def to_bytes(self) -> bytes:
        """``msgspec.json.encode(req)``."""
        return msgspec.json.encode(self)

    def to_json(self) -> str:
        """``to_bytes()`` as ``str``."""
        return msgspec.json.encode(self).decode()

    def to_msgpack(self) -> bytes:
        """``msgspec.msgpack.encode(req)`` (what MAX's ZMQ sockets carry).

        Raises ``OverflowError`` for an integer msgpack cannot carry, as msgspec does.
        """
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_json(cls, data: _Buffer) -> "TransferReqData":
        """``msgspec.json.decode(data, type=TransferReqData)``, raising
        ``kvwire.DecodeError`` / ``kvwire.ValidationError`` (``ValueError``s)
        with msgspec's message where msgspec raises its own."""
        return _decode(msgspec.json.decode, data, cls)

    @classmethod
    def from_bytes(cls, data: _Buffer) -> "TransferReqData":
        """Same as ``from_json``."""
        return _decode(msgspec.json.decode, data, cls)

    @classmethod
    def from_msgpack(cls, data: Union[bytes, bytearray, memoryview]) -> "TransferReqData":
        """``msgspec.msgpack.decode(data, type=TransferReqData)``; raises as ``from_json``."""
        return _decode(msgspec.msgpack.decode, data, cls)
