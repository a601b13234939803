"""TransferReqData: fields, msgspec-identical JSON, round trips."""

import pickle

import pytest

import kvwire

# Written by hand from the seed's field list, in its order, with msgspec's
# rules (tag "type" = class name first, kw_only, compact separators).
FULL = (
    '{"type":"TransferReqData","dst_name":"decode","src_name":"prefill",'
    '"transfer_name":"6f1c2a7e-0d3b-4c55-9a8e-2b1f3c4d5e6f","transfer_ids":[7,8],'
    '"src_idxs":{"0":[1,2,3],"0/scales":[1]},"dst_idxs":{"0":[4,5,6],"0/scales":[9]},'
    '"src_replica_idx":0,"dst_replica_idx":1,"is_read":true,"tp_shard_count":2,'
    '"local_shards_used":[0,0]}'
)
# omit_defaults=True: is_read=False, tp_shard_count=0, local_shards_used=[] vanish.
MINIMAL = (
    '{"type":"TransferReqData","dst_name":"d","src_name":"s","transfer_name":"t",'
    '"transfer_ids":[],"src_idxs":[1,2],"dst_idxs":[3,4],"src_replica_idx":0,"dst_replica_idx":0}'
)


def full():
    return kvwire.TransferReqData(
        dst_name="decode",
        src_name="prefill",
        transfer_name="6f1c2a7e-0d3b-4c55-9a8e-2b1f3c4d5e6f",
        transfer_ids=[7, 8],
        src_idxs={"0": [1, 2, 3], "0/scales": [1]},
        dst_idxs={"0": [4, 5, 6], "0/scales": [9]},
        src_replica_idx=0,
        dst_replica_idx=1,
        is_read=True,
        tp_shard_count=2,
        local_shards_used=[0, 0],
    )


def test_json_equals_literal_from_seed_fields():
    assert full().to_json() == FULL
    assert full().to_bytes() == FULL.encode()
    assert kvwire.TransferReqData.from_json(FULL) == full()
    assert kvwire.TransferReqData.from_json(FULL.encode()) == full()


def test_defaults_are_omitted():
    r = kvwire.TransferReqData(
        dst_name="d", src_name="s", transfer_name="t", transfer_ids=[], src_idxs=[1, 2], dst_idxs=[3, 4],
        src_replica_idx=0, dst_replica_idx=0,
    )
    assert r.to_json() == MINIMAL
    assert (r.is_read, r.tp_shard_count, r.local_shards_used) == (False, 0, [])
    assert r.src_idxs == [1, 2]


def test_fields():
    r = full()
    assert r.dst_name == "decode" and r.src_name == "prefill"
    assert r.transfer_ids == [7, 8]
    assert r.src_idxs == {"0": [1, 2, 3], "0/scales": [1]}
    assert r.dst_idxs == {"0": [4, 5, 6], "0/scales": [9]}
    assert (r.src_replica_idx, r.dst_replica_idx, r.is_read, r.tp_shard_count) == (0, 1, True, 2)
    assert r.local_shards_used == [0, 0]


def test_pickle_round_trip():
    assert pickle.loads(pickle.dumps(full())) == full()


def test_keyword_only():
    with pytest.raises(TypeError):
        kvwire.TransferReqData("d", "s", "t", [], [], [], 0, 0)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "not json",
        "{}",
        '{"type":"Other"}',
        FULL.replace('"transfer_ids":[7,8]', '"transfer_ids":[1.5,8]'),
        FULL.replace('"dst_name":"decode",', ""),
        b"\xff\xfe",
    ],
)
def test_from_json_rejects(bad):
    with pytest.raises(ValueError):
        kvwire.TransferReqData.from_json(bad)


def test_from_json_wrong_type():
    # msgspec.json.decode(42) raises TypeError too.
    with pytest.raises(TypeError):
        kvwire.TransferReqData.from_json(42)
