"""Item 3: TransferReqData decoding accepts what msgspec accepts for MAX
26.7's struct, with the same values, and rejects what it rejects with the
matching class: kvwire.DecodeError <-> msgspec.DecodeError (malformed,
truncated, trailing data), kvwire.ValidationError <-> msgspec.ValidationError
(wrong type or tag, missing field). Both are ValueErrors, as msgspec's."""

import pytest

import kvwire

BASE = (
    '"dst_name":"d","src_name":"s","transfer_name":"t","transfer_ids":[],'
    '"src_idxs":{},"dst_idxs":{},"src_replica_idx":0,"dst_replica_idx":0'
)
CANON = '{"type":"TransferReqData",' + BASE + "}"


def j(body):
    return "{" + body + "}"


OK = [
    # (input, canonical re-encoding)
    (j(BASE), CANON),  # missing "type" tag
    (j(BASE + ',"type":"TransferReqData"'), CANON),  # tag anywhere
    (j('"dst_name":"x",' + BASE), CANON),  # duplicate key: the last wins
    (j(BASE.replace('"src_idxs":{}', '"src_idxs":{"0":[1],"1":[],"0":[2]}')),
     CANON.replace('"src_idxs":{}', '"src_idxs":{"0":[2],"1":[]}')),
    (j(BASE.replace('"src_replica_idx":0', '"src_replica_idx":-3')),
     CANON.replace('"src_replica_idx":0', '"src_replica_idx":-3')),  # negative: refused at use
    (j(BASE.replace('"transfer_ids":[]', '"transfer_ids":[18446744073709551615,-9223372036854775808]')),
     CANON.replace('"transfer_ids":[]', '"transfer_ids":[18446744073709551615,-9223372036854775808]')),
    (j(BASE + ',"extra":[1,{"a":null}],"local_shards_used":[0,0,0]'), CANON[:-1] + ',"local_shards_used":[0,0,0]}'),
    (j(BASE + ',"is_read":false,"tp_shard_count":0'), CANON),  # defaults given explicitly
    ("  " + CANON + "\n", CANON),  # whitespace
]

ERR = [
    ('{"type":"X",' + BASE + "}", kvwire.ValidationError),
    ('{"type":null,' + BASE + "}", kvwire.ValidationError),
    (j(BASE.replace('"transfer_ids":[]', '"transfer_ids":[1.0]')), kvwire.ValidationError),
    (j(BASE.replace('"transfer_ids":[]', '"transfer_ids":[true]')), kvwire.ValidationError),
    (j(BASE.replace('"src_idxs":{}', '"src_idxs":[1]')), kvwire.ValidationError),  # MAX 26.7: a dict
    (j(BASE + ',"is_read":1'), kvwire.ValidationError),
    (j(BASE.replace('"src_replica_idx":0', '"src_replica_idx":1e3')), kvwire.ValidationError),
    (j(BASE.replace('"dst_name":"d",', "")), kvwire.ValidationError),
    ("[1]", kvwire.ValidationError),
    ("{}", kvwire.ValidationError),
    ('{"dst_name":"d"', kvwire.DecodeError),
    (CANON + " x", kvwire.DecodeError),
    ("", kvwire.DecodeError),
    ("nope", kvwire.DecodeError),
]


@pytest.mark.parametrize("text, canon", OK)
def test_accepts_what_msgspec_accepts(text, canon):
    r = kvwire.TransferReqData.from_json(text)
    assert r.to_json() == canon
    assert kvwire.TransferReqData.from_msgpack(r.to_msgpack()) == r


@pytest.mark.parametrize("text, exc", ERR)
def test_rejects_what_msgspec_rejects(text, exc):
    with pytest.raises(exc) as info:
        kvwire.TransferReqData.from_json(text)
    if exc is kvwire.DecodeError:
        assert not isinstance(info.value, kvwire.ValidationError)
    assert isinstance(info.value, ValueError)


def test_class_hierarchy_is_msgspecs():
    assert issubclass(kvwire.ValidationError, kvwire.DecodeError)
    assert issubclass(kvwire.DecodeError, ValueError)


def test_values_outside_64_bits_decode_as_msgspec_decodes_them():
    # msgspec's JSON decoder returns a Python int of any size, and so does
    # kvwire's; the engine refuses what NIXL's 64-bit handles cannot carry
    # when it is handed the request (test_max_12_msgspec_struct.py).
    r = kvwire.TransferReqData.from_json(j(BASE.replace('"transfer_ids":[]', '"transfer_ids":[18446744073709551616]')))
    assert r.transfer_ids == [2**64]


def test_negative_replica_is_refused_at_use_with_value_error():
    import numpy as np

    mem = [[kvwire.KVCacheMemory(False, [np.zeros((4, 16), np.uint8)])]]
    e = kvwire.KVTransferEngine("len-use", mem)
    try:
        r = kvwire.TransferReqData.from_json(j(BASE.replace('"src_replica_idx":0', '"src_replica_idx":-1')))
        assert r.src_replica_idx == -1
        with pytest.raises(ValueError, match="src_replica_idx -1"):
            e.is_complete(r)
    finally:
        e.cleanup()


msgspec = pytest.importorskip("msgspec", reason="msgspec (test-only) cross-checks against MAX's struct definitions")


@pytest.mark.parametrize("text, canon", OK)
def test_msgspec_agrees_on_accepts(text, canon):
    import maxdefs

    assert msgspec.json.encode(msgspec.json.decode(text, type=maxdefs.TransferReqData)).decode() == canon


@pytest.mark.parametrize("text, exc", ERR)
def test_msgspec_agrees_on_rejects(text, exc):
    import maxdefs

    theirs = msgspec.ValidationError if exc is kvwire.ValidationError else msgspec.DecodeError
    with pytest.raises(theirs) as info:
        msgspec.json.decode(text, type=maxdefs.TransferReqData)
    if theirs is msgspec.DecodeError:
        assert not isinstance(info.value, msgspec.ValidationError)
