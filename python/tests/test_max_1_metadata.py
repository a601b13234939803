"""Item 1: engine metadata as MAX 26.7's msgspec structs (field set, order,
types; memory_type as nixl.MemoryType's integer; bytes_per_page,
region_splits), decoded from the bytes MAX produces, with MAX's attributes."""

import json
import pickle

import numpy as np
import pytest

import kvwire

# msgspec.json.encode of MAX 26.7's KVTransferEngineMetadata (msgspec 0.23),
# one replica, one shard, one group of 4 pages x 16 bytes; the agent blob is
# two bytes (MAX puts NIXL's blob there).
MAX_JSON = (
    b'{"type":"KVTransferEngineMetadata","leaf_ids":["0"],"num_pages_per_group":[4],'
    b'"bytes_per_page":16,"bytes_per_group":[16],"replicated_per_group":[false],"name":"p",'
    b'"memory_type":0,"hostname":"h","agents_meta":[[{"type":"TensorAgentMetadata",'
    b'"agent_name":"p_0_0","metadata":"AQI=","base_addrs":[4096],"device_id":0,"region_splits":[[]]}]]}'
)
ENGINE_KEYS = [
    "type", "leaf_ids", "num_pages_per_group", "bytes_per_page", "bytes_per_group",
    "replicated_per_group", "name", "memory_type", "hostname", "agents_meta",
]
AGENT_KEYS = ["type", "agent_name", "metadata", "base_addrs", "device_id", "region_splits"]


def engine(name, tp=2, groups=((8, 64), (8, 16))):
    mem = [[kvwire.KVCacheMemory(False, [np.zeros(g, np.uint8) for _ in range(tp)]) for g in groups]]
    return kvwire.KVTransferEngine(name, mem, leaf_ids=[f"l{i}" for i in range(len(groups))])


def test_decodes_max_json_and_exposes_max_attributes():
    md = kvwire.KVTransferEngineMetadata.from_bytes(MAX_JSON)
    assert (md.name, md.hostname, md.leaf_ids, md.num_pages_per_group) == ("p", "h", ["0"], [4])
    assert (md.bytes_per_page, md.bytes_per_group, md.replicated_per_group) == (16, [16], [False])
    assert md.memory_type is kvwire.MemoryType.DRAM and md.memory_type.value == 0
    [[a]] = md.agents_meta
    assert isinstance(a, kvwire.TensorAgentMetadata)
    assert (a.agent_name, a.metadata, a.base_addrs, a.device_id, a.region_splits) == (
        "p_0_0", b"\x01\x02", [4096], 0, [[]])
    # Re-encoded byte for byte.
    assert md.to_bytes() == MAX_JSON
    assert kvwire.KVTransferEngineMetadata.from_msgpack(md.to_msgpack()) == md


def test_engine_metadata_has_max_field_order_and_types():
    e = engine("md-order")
    try:
        md = e.metadata
        doc = json.loads(md.to_bytes())
        assert list(doc) == ENGINE_KEYS
        assert list(doc["agents_meta"][0][0]) == AGENT_KEYS
        assert doc["type"] == "KVTransferEngineMetadata" and doc["memory_type"] == 0
        assert doc["bytes_per_page"] == 80 == md.bytes_per_page == e.bytes_per_page
        assert doc["agents_meta"][0][1]["region_splits"] == [[], []]
        assert [a.agent_name for a in md.agents_meta[0]] == ["md-order_0_0", "md-order_0_1"]
        assert all(isinstance(a.metadata, bytes) and a.metadata for a in md.agents_meta[0])
        assert pickle.loads(pickle.dumps(md)) == md
        assert kvwire.KVTransferEngineMetadata.from_bytes(md.to_json()) == md
    finally:
        e.cleanup()


def test_memory_type_enum_is_nixls():
    assert [(m.name, m.value) for m in kvwire.MemoryType] == [
        ("DRAM", 0), ("VRAM", 1), ("BLK", 2), ("OBJ", 3), ("FILE", 4)]
    for bad, exc in [(b'"memory_type":7', kvwire.ValidationError), (b'"memory_type":"DRAM"', kvwire.ValidationError),
                     (b'"memory_type":2', kvwire.ValidationError)]:
        with pytest.raises(exc):
            kvwire.KVTransferEngineMetadata.from_bytes(MAX_JSON.replace(b'"memory_type":0', bad))


def test_decoding_is_as_lenient_as_msgspec():
    no_tags = MAX_JSON.replace(b'"type":"KVTransferEngineMetadata",', b"").replace(b'"type":"TensorAgentMetadata",', b"")
    assert kvwire.KVTransferEngineMetadata.from_bytes(no_tags).to_bytes() == MAX_JSON
    dup = MAX_JSON.replace(b'"hostname":"h"', b'"hostname":"x","hostname":"h","future_field":{"a":[1]}')
    assert kvwire.KVTransferEngineMetadata.from_bytes(dup).to_bytes() == MAX_JSON
    with pytest.raises(kvwire.DecodeError):
        kvwire.KVTransferEngineMetadata.from_bytes(MAX_JSON[:-3])
    with pytest.raises(kvwire.ValidationError):
        kvwire.KVTransferEngineMetadata.from_bytes(MAX_JSON.replace(b'"bytes_per_page":16,', b""))


msgspec = pytest.importorskip("msgspec", reason="msgspec (test-only) cross-checks against MAX's struct definitions")


def test_kvwire_bytes_equal_msgspecs_for_maxs_structs():
    import maxdefs

    e = engine("md-cross")
    try:
        md = e.metadata
        mx = msgspec.json.decode(md.to_bytes(), type=maxdefs.KVTransferEngineMetadata)
        assert mx.memory_type is maxdefs.MemoryType.DRAM
        assert msgspec.json.encode(mx) == md.to_bytes()
        assert msgspec.msgpack.encode(mx) == md.to_msgpack()
        assert msgspec.msgpack.decode(md.to_msgpack(), type=maxdefs.KVTransferEngineMetadata) == mx
        # And what msgspec encodes from MAX's struct, kvwire decodes to the same bytes.
        assert kvwire.KVTransferEngineMetadata.from_bytes(msgspec.json.encode(mx)).to_bytes() == md.to_bytes()
        assert kvwire.KVTransferEngineMetadata.from_msgpack(msgspec.msgpack.encode(mx)) == md
    finally:
        e.cleanup()
