"""Issue 30, newcomer: ``options=`` takes what a user would pass (a dict,
``key=value`` strings, ``(key, value)`` pairs), and says what it takes
otherwise."""

import numpy as np
import pytest

import kvwire

TAKES = "options takes a dict"


def engine(name, transport="shm", **kw):
    mem = [[kvwire.KVCacheMemory(False, [np.zeros((4, 16), np.uint8)])]]
    return kvwire.KVTransferEngine(name, mem, transport=transport, **kw)


@pytest.mark.parametrize(
    "options",
    [
        None,
        {},
        {"cma": "allow"},
        "cma=allow",
        ["cma=allow"],
        ("cma=deny", "cma=allow"),
        [("cma", "allow")],
    ],
)
def test_accepted_forms(options):
    engine("opt-ok", options=options).cleanup()


def test_dict_with_int_values_on_tcp():
    a = engine("opt-tcp-a", "tcp", options={"conns_per_peer": 3, "listen": "127.0.0.1:0"})
    b = engine("opt-tcp-b", "tcp", options=["listen=127.0.0.1:0", "conns_per_peer=1"])
    try:
        a.connect(b.metadata)
        b.connect(a.metadata)
        req = a.initiate_send_transfer(b.metadata, [1], [2])
        b.sync_and_release(req, timeout_s=10)
        a.sync_and_release(req, timeout_s=10)
    finally:
        a.cleanup()
        b.cleanup()


@pytest.mark.parametrize(
    "options, exc, match",
    [
        (5, TypeError, TAKES),
        (["cma"], ValueError, r'option "cma" is not key=value; ' + TAKES),
        ("=allow", ValueError, "is not key=value"),
        ({"cma": 1.5}, TypeError, 'option "cma": the value must be a str or an int, got float'),
        ({"cma": True}, TypeError, "got bool"),
        ({1: "x"}, TypeError, "option keys must be str, got int"),
        ([("cma", "allow", "x")], TypeError, "an option is a tuple"),
        ({"no_such_option": "1"}, ValueError, "no_such_option"),
    ],
)
def test_refusals_say_what_it_takes(options, exc, match):
    with pytest.raises(exc, match=match):
        engine("opt-bad", options=options)


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        engine("opt-unknown", options={"conns_per_peer": 2})  # a tcp option on shm
    assert "cma" in str(info.value) and "allow_uids" in str(info.value)
