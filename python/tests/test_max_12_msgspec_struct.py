"""Issue 30, MAX parity 1 and 2: kvwire's TransferReqData is encoded and
decoded by msgspec itself, as MAX 26.7's struct is (``msgspec.msgpack.encode(req)``
on MAX's ZMQ path, ``msgspec.json.encode(req)``), byte for byte; decoding
takes what msgspec takes for MAX's struct (integers of any size from JSON) and
rejects a float index with msgspec's message naming the float.

The literals below were printed by MAX 26.7's own class
(``max/pipelines/kv_cache/paged_kv_cache/transfer_engine.py`` from the
``max==26.7.0`` wheel, its native imports stubbed) under msgspec 0.23.0."""

import pickle

import numpy as np
import pytest

import kvwire

msgspec = pytest.importorskip("msgspec", reason="msgspec is what MAX encodes requests with")

KW = dict(
    dst_name="decode", src_name="prefill", transfer_name="6f1c2a7e-0d3b-4c55-9a8e-2b1f3c4d5e6f",
    transfer_ids=[2**64 - 1, 7, 2**32], src_idxs={"0": [1, 2, 3], "0/scales": [1]},
    dst_idxs={"0": [4, 5, 6], "0/scales": [9]}, src_replica_idx=0, dst_replica_idx=1, is_read=True,
    tp_shard_count=2, local_shards_used=[0, 1, 1],
)
# msgspec.msgpack.encode(max.pipelines.kv_cache.TransferReqData(**KW))
MAX_MSGPACK = bytes.fromhex(
    "8ca474797065af5472616e7366657252657144617461a86473745f6e616d65a66465636f6465a87372635f6e616d65"
    "a770726566696c6cad7472616e736665725f6e616d65d92436663163326137652d306433622d346335352d39613865"
    "2d326231663363346435653666ac7472616e736665725f69647393cfffffffffffffffff07cf0000000100000000a8"
    "7372635f6964787382a13093010203a8302f7363616c65739101a86473745f6964787382a13093040506a8302f7363"
    "616c65739109af7372635f7265706c6963615f69647800af6473745f7265706c6963615f69647801a769735f726561"
    "64c3ae74705f73686172645f636f756e7402b16c6f63616c5f7368617264735f7573656493000101"
)
# msgspec.json.encode(max.pipelines.kv_cache.TransferReqData(**KW))
MAX_JSON = (
    b'{"type":"TransferReqData","dst_name":"decode","src_name":"prefill",'
    b'"transfer_name":"6f1c2a7e-0d3b-4c55-9a8e-2b1f3c4d5e6f","transfer_ids":[18446744073709551615,7,4294967296],'
    b'"src_idxs":{"0":[1,2,3],"0/scales":[1]},"dst_idxs":{"0":[4,5,6],"0/scales":[9]},"src_replica_idx":0,'
    b'"dst_replica_idx":1,"is_read":true,"tp_shard_count":2,"local_shards_used":[0,1,1]}'
)
# Integers msgpack cannot carry, which msgspec's JSON decoder returns as Python ints.
BIG_JSON = (
    b'{"type":"TransferReqData","dst_name":"d","src_name":"s","transfer_name":"t",'
    b'"transfer_ids":[18446744073709551616,340282366920938463463374607431768211456,-9223372036854775809],'
    b'"src_idxs":{"0":[18446744073709551616]},"dst_idxs":{"0":[2]},"src_replica_idx":18446744073709551616,'
    b'"dst_replica_idx":0}'
)
BASE = BIG_JSON.replace(b"[18446744073709551616,340282366920938463463374607431768211456,-9223372036854775809]", b"[1]")
BASE = BASE.replace(b"18446744073709551616", b"1")
# (fragment replacing its field in BASE, msgspec.ValidationError's message for MAX's struct)
FLOATS = [
    (b'"transfer_ids":[1.0]', "Expected `int`, got `float` - at `$.transfer_ids[0]`"),
    (b'"transfer_ids":[1.5]', "Expected `int`, got `float` - at `$.transfer_ids[0]`"),
    (b'"src_idxs":{"0":[2.0]}', "Expected `int`, got `float` - at `$.src_idxs[...][0]`"),
    (b'"dst_idxs":{"0":[1,2,3.25]}', "Expected `int`, got `float` - at `$.dst_idxs[...][2]`"),
    (b'"src_replica_idx":0.0', "Expected `int`, got `float` - at `$.src_replica_idx`"),
    (b'"src_replica_idx":1e3', "Expected `int`, got `float` - at `$.src_replica_idx`"),
]
# msgspec.msgpack.encode of a dict shaped as the struct, transfer_ids=[1.0]
MSGPACK_FLOAT = bytes.fromhex(
    "89a474797065af5472616e7366657252657144617461a86473745f6e616d65a164a87372635f6e616d65a173ad7472"
    "616e736665725f6e616d65a174ac7472616e736665725f69647391cb3ff0000000000000a87372635f6964787380a8"
    "6473745f6964787380af7372635f7265706c6963615f69647800af6473745f7265706c6963615f69647800"
)


def with_field(frag):
    key = frag.split(b":", 1)[0]
    start = BASE.index(key)
    end = BASE.index(b',"', start + len(key))
    return BASE[:start] + frag + BASE[end:]


def test_msgspec_encodes_kvwire_requests_as_maxs():
    r = kvwire.TransferReqData(**KW)
    assert isinstance(r, msgspec.Struct)
    assert msgspec.msgpack.encode(r) == MAX_MSGPACK
    assert msgspec.json.encode(r) == MAX_JSON
    # kvwire's own methods say the same.
    assert (r.to_msgpack(), r.to_bytes(), r.to_json()) == (MAX_MSGPACK, MAX_JSON, MAX_JSON.decode())
    # Inside whatever message carries it, as msgspec encodes any struct.
    assert msgspec.msgpack.encode([r, {"k": r}])[:1] == b"\x92"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([r, {"k": r}])) == [
        msgspec.msgpack.decode(MAX_MSGPACK), {"k": msgspec.msgpack.decode(MAX_MSGPACK)}]


def test_msgspec_decodes_maxs_bytes_into_kvwire_requests():
    r = kvwire.TransferReqData(**KW)
    assert msgspec.msgpack.decode(MAX_MSGPACK, type=kvwire.TransferReqData) == r
    assert msgspec.json.decode(MAX_JSON, type=kvwire.TransferReqData) == r
    assert msgspec.json.decode(MAX_JSON.decode(), type=kvwire.TransferReqData) == r
    assert kvwire.TransferReqData.from_msgpack(MAX_MSGPACK) == r == kvwire.TransferReqData.from_json(MAX_JSON)
    assert msgspec.msgpack.Decoder(kvwire.TransferReqData).decode(MAX_MSGPACK) == r
    assert msgspec.structs.asdict(r) == KW
    assert pickle.loads(pickle.dumps(r)) == r


def test_engine_requests_travel_by_msgspec():
    mem = lambda: [[kvwire.KVCacheMemory(False, [np.arange(8 * 32, dtype=np.uint8).reshape(8, 32)])]]
    a, b = kvwire.KVTransferEngine("ms-a", mem()), kvwire.KVTransferEngine("ms-b", mem())
    try:
        a.connect(b.metadata)
        b.connect(a.metadata)
        req = a.initiate_send_transfer(b.metadata, {"0": [1, 2]}, {"0": [3, 4]}, 0, 0)
        assert isinstance(req, kvwire.TransferReqData) and isinstance(req, msgspec.Struct)
        on_b = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=kvwire.TransferReqData)
        assert on_b == req
        # MAX's own struct, decoded from the same bytes, is taken too.
        import maxdefs

        assert b.is_complete(msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=maxdefs.TransferReqData)) in (
            True, False)
        b.sync_and_release(on_b, timeout_s=10)
        a.sync_and_release(msgspec.json.decode(msgspec.json.encode(req), type=kvwire.TransferReqData), timeout_s=10)
        assert a.inflight_send_transfers == {}
    finally:
        a.cleanup()
        b.cleanup()


def test_integers_beyond_64_bits_decode_as_msgspec_decodes_them():
    r = msgspec.json.decode(BIG_JSON, type=kvwire.TransferReqData)
    assert r.transfer_ids == [2**64, 2**128, -(2**63) - 1]
    assert (r.src_idxs, r.src_replica_idx) == ({"0": [2**64]}, 2**64)
    assert kvwire.TransferReqData.from_json(BIG_JSON) == r
    assert msgspec.json.encode(r) == BIG_JSON == r.to_bytes()
    # msgpack cannot carry them: MAX's struct raises the same.
    with pytest.raises(OverflowError, match=r"can't serialize ints < -2\*\*63 or > 2\*\*64 - 1"):
        msgspec.msgpack.encode(r)
    with pytest.raises(OverflowError):
        r.to_msgpack()


def test_integers_beyond_64_bits_are_refused_by_the_engine_at_use():
    e = kvwire.KVTransferEngine("ms-big", [[kvwire.KVCacheMemory(False, [np.zeros((4, 16), np.uint8)])]])
    try:
        r = kvwire.TransferReqData.from_json(BIG_JSON)
        with pytest.raises(ValueError, match="18446744073709551616"):
            e.is_complete(r)
    finally:
        e.cleanup()


@pytest.mark.parametrize("frag, message", FLOATS)
def test_a_float_index_is_refused_with_msgspecs_message(frag, message):
    text = with_field(frag)
    with pytest.raises(msgspec.ValidationError) as theirs:
        msgspec.json.decode(text, type=kvwire.TransferReqData)
    assert str(theirs.value) == message
    with pytest.raises(kvwire.ValidationError) as ours:
        kvwire.TransferReqData.from_json(text)
    assert str(ours.value) == message and isinstance(ours.value, ValueError)


def test_a_float_index_in_msgpack_is_refused_with_msgspecs_message():
    message = "Expected `int`, got `float` - at `$.transfer_ids[0]`"
    with pytest.raises(msgspec.ValidationError, match=message.replace("$", r"\$").replace("[", r"\[")):
        msgspec.msgpack.decode(MSGPACK_FLOAT, type=kvwire.TransferReqData)
    with pytest.raises(kvwire.ValidationError) as ours:
        kvwire.TransferReqData.from_msgpack(MSGPACK_FLOAT)
    assert str(ours.value) == message


def test_same_struct_shape_as_maxs():
    import maxdefs

    ours, theirs = kvwire.TransferReqData, maxdefs.TransferReqData
    assert ours.__struct_fields__ == theirs.__struct_fields__
    def shape(cls):
        return [(f.name, f.type, f.required, f.default,
                 f.default_factory() if f.default_factory is not msgspec.NODEFAULT else None)
                for f in msgspec.structs.fields(cls)]

    assert shape(ours) == shape(theirs)
    for opt in ("tag", "tag_field", "omit_defaults", "frozen", "eq", "array_like", "forbid_unknown_fields", "order"):
        assert getattr(ours.__struct_config__, opt) == getattr(theirs.__struct_config__, opt), opt
    with pytest.raises(TypeError):
        ours("d", "s", "t", [], {}, {}, 0, 0)
