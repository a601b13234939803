"""Issue 30, MAX parity 3: KVTransferEngineMetadata decodes MAX 26.7's own
JSON and msgpack for an engine with several groups (DP 2 x TP 2, three
leaves) whose agents carry ``region_splits``, represents them, and re-encodes
MAX's bytes; an engine connects to a peer whose metadata carries them.

The literals were printed by MAX 26.7's own classes (``max==26.7.0`` wheel,
``transfer_engine.py``, native imports stubbed) under msgspec 0.23.0: a VRAM
engine where shard 0 of each replica has a group split across CUDA
allocations (MAX computes ``region_splits`` for UCX + CUDA) and shard 1 lists
one empty split list per group, as MAX's ``create_agent`` always appends one."""

import json

import numpy as np
import pytest

import kvwire

MAX_JSON = (
    b'{"type":"KVTransferEngineMetadata","leaf_ids":["0","0/scales","draft"],"num_pages_per_group":[16,16,8],'
    b'"bytes_per_page":5184,"bytes_per_group":[1024,64,4096],"replicated_per_group":[false,true,false],"name":"p",'
    b'"memory_type":1,"hostname":"gpu-node-7","agents_meta":[[{"type":"TensorAgentMetadata","agent_name":"p_0_0",'
    b'"metadata":"AAD/","base_addrs":[139637976727552,139706696204288,139775415681024],"device_id":0,'
    b'"region_splits":[[4096],[],[8192,16384]]},{"type":"TensorAgentMetadata","agent_name":"p_0_1",'
    b'"metadata":"AAH/","base_addrs":[139637977776128,139706697252864,139775416729600],"device_id":1,'
    b'"region_splits":[[],[],[]]}],[{"type":"TensorAgentMetadata","agent_name":"p_1_0","metadata":"AQD/",'
    b'"base_addrs":[139637978824704,139706698301440,139775417778176],"device_id":2,'
    b'"region_splits":[[4096],[],[8192,16384]]},{"type":"TensorAgentMetadata","agent_name":"p_1_1",'
    b'"metadata":"AQH/","base_addrs":[139637979873280,139706699350016,139775418826752],"device_id":3,'
    b'"region_splits":[[],[],[]]}]]}'
)
MAX_MSGPACK = bytes.fromhex(
    "8aa474797065b84b565472616e73666572456e67696e654d65746164617461a86c6561665f69647393a130a8302f7363"
    "616c6573a56472616674b36e756d5f70616765735f7065725f67726f757093101008ae62797465735f7065725f7061"
    "6765cd1440af62797465735f7065725f67726f757093cd040040cd1000b47265706c6963617465645f7065725f6772"
    "6f757093c2c3c2a46e616d65a170ab6d656d6f72795f7479706501a8686f73746e616d65aa6770752d6e6f64652d37"
    "ab6167656e74735f6d657461929286a474797065b354656e736f724167656e744d65746164617461aa6167656e745f"
    "6e616d65a5705f305f30a86d65746164617461c4030000ffaa626173655f616464727393cf00007f0000000000cf00"
    "007f1000000000cf00007f2000000000a96465766963655f696400ad726567696f6e5f73706c6974739391cd100090"
    "92cd2000cd400086a474797065b354656e736f724167656e744d65746164617461aa6167656e745f6e616d65a5705f"
    "305f31a86d65746164617461c4030001ffaa626173655f616464727393cf00007f0000100000cf00007f1000100000"
    "cf00007f2000100000a96465766963655f696401ad726567696f6e5f73706c697473939090909286a474797065b354"
    "656e736f724167656e744d65746164617461aa6167656e745f6e616d65a5705f315f30a86d65746164617461c40301"
    "00ffaa626173655f616464727393cf00007f0000200000cf00007f1000200000cf00007f2000200000a96465766963"
    "655f696402ad726567696f6e5f73706c6974739391cd10009092cd2000cd400086a474797065b354656e736f724167"
    "656e744d65746164617461aa6167656e745f6e616d65a5705f315f31a86d65746164617461c4030101ffaa62617365"
    "5f616464727393cf00007f0000300000cf00007f1000300000cf00007f2000300000a96465766963655f696403ad72"
    "6567696f6e5f73706c69747393909090"
)
SPLIT = [[4096], [], [8192, 16384]]
WHOLE = [[], [], []]


def check(md):
    assert (md.name, md.hostname, md.memory_type) == ("p", "gpu-node-7", kvwire.MemoryType.VRAM)
    assert (md.leaf_ids, md.num_pages_per_group) == (["0", "0/scales", "draft"], [16, 16, 8])
    assert (md.bytes_per_page, md.bytes_per_group, md.replicated_per_group) == (5184, [1024, 64, 4096], [False, True, False])
    assert (md.dp, md.tp) == (2, 2)
    agents = md.agents_meta
    assert [[a.agent_name for a in row] for row in agents] == [["p_0_0", "p_0_1"], ["p_1_0", "p_1_1"]]
    assert [[a.region_splits for a in row] for row in agents] == [[SPLIT, WHOLE], [SPLIT, WHOLE]]
    assert [[a.device_id for a in row] for row in agents] == [[0, 1], [2, 3]]
    assert agents[1][0].base_addrs == [139637978824704, 139706698301440, 139775417778176]
    assert agents[0][1].metadata == b"\x00\x01\xff"
    assert isinstance(agents[0][0], kvwire.TensorAgentMetadata)


def test_decodes_maxs_json_with_region_splits_and_reencodes_it():
    md = kvwire.KVTransferEngineMetadata.from_bytes(MAX_JSON)
    check(md)
    assert md.to_bytes() == MAX_JSON
    assert md.to_msgpack() == MAX_MSGPACK
    assert kvwire.KVTransferEngineMetadata.from_json(MAX_JSON.decode()) == md


def test_decodes_maxs_msgpack_with_region_splits():
    md = kvwire.KVTransferEngineMetadata.from_msgpack(MAX_MSGPACK)
    check(md)
    assert md.to_bytes() == MAX_JSON


def test_region_splits_shorter_than_the_groups_is_refused():
    # MAX writes one list per group; a list for another number of groups
    # cannot address them.
    bad = MAX_JSON.replace(b'"region_splits":[[4096],[],[8192,16384]]', b'"region_splits":[[4096]]', 1)
    with pytest.raises(ValueError, match="region_splits for 1 groups"):
        kvwire.KVTransferEngineMetadata.from_bytes(bad)


def test_engine_connects_to_a_peer_whose_agents_carry_region_splits():
    groups = ((8, 64), (8, 16))

    def engine(name, fill):
        bufs = [[np.full(g, fill, np.uint8) for _ in range(2)] for g in groups]
        return kvwire.KVTransferEngine(name, [[kvwire.KVCacheMemory(False, b) for b in bufs]]), bufs

    a, a_bufs = engine("rs-a", 7)
    b, b_bufs = engine("rs-b", 0)
    try:
        doc = json.loads(b.metadata.to_bytes())
        for row in doc["agents_meta"]:
            for agent in row:
                agent["region_splits"] = [[3 * 64], [5 * 16]]  # a split inside each group
        peer = kvwire.KVTransferEngineMetadata.from_bytes(json.dumps(doc, separators=(",", ":")))
        assert [a.region_splits for a in peer.agents_meta[0]] == [[[192], [80]], [[192], [80]]]
        a.connect(peer)
        b.connect(a.metadata)
        assert a.remote_connections["rs-b"].agents_meta[0][0].region_splits == [[192], [80]]
        # Pages 2..4 straddle the splits on the destination.
        req = a.initiate_send_transfer(peer, {"0": [1, 2, 3], "1": [4, 5]}, {"0": [2, 3, 4], "1": [4, 5]}, 0, 0)
        b.sync_and_release(req, timeout_s=10)
        a.sync_and_release(req, timeout_s=10)
        for shard in range(2):
            assert (b_bufs[0][shard][2:5] == 7).all() and (b_bufs[0][shard][[0, 1, 5, 6, 7]] == 0).all()
            assert (b_bufs[1][shard][4:6] == 7).all() and (b_bufs[1][shard][[0, 1, 2, 3, 6, 7]] == 0).all()
    finally:
        a.cleanup()
        b.cleanup()


msgspec = pytest.importorskip("msgspec", reason="msgspec (test-only) cross-checks against MAX's struct definitions")


def test_maxdefs_agree_with_the_literals():
    import maxdefs

    mx = msgspec.json.decode(MAX_JSON, type=maxdefs.KVTransferEngineMetadata)
    assert msgspec.msgpack.encode(mx) == MAX_MSGPACK
    assert mx.agents_meta[1][0].region_splits == SPLIT
