"""kvwire._net, the socket helpers the `nixl` and `mooncake` packages'
side channels share: frames are bounded, the proof is HMAC-SHA256 over
nonce + data, and the uid of a local connection's other end comes from
/proc/net/tcp{,6} (None for an address that has no such connection)."""

import hashlib
import hmac
import os
import socket
import threading

import pytest

from kvwire import _net


def pair():
    ls = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(ls.getsockname(), timeout=5)
    s, _ = ls.accept()
    s.settimeout(5)
    ls.close()
    return c, s


def test_frames_round_trip_and_are_bounded():
    c, s = pair()
    with c, s:
        _net.send_frame(c, b"hello")
        assert _net.recv_frame(s, 5) == b"hello"
        _net.send_frame(c, b"")
        assert _net.recv_frame(s, 0) == b""
        _net.send_frame(c, b"x" * 6)
        with pytest.raises(ValueError, match="frame of 6 bytes exceeds 5"):
            _net.recv_frame(s, 5)


def test_a_peer_that_closes_mid_frame_is_a_connection_error():
    c, s = pair()
    with s:
        c.sendall(b"\0\0\0\x08abc")
        c.close()
        with pytest.raises(ConnectionError):
            _net.recv_frame(s, 64)


def test_proof_is_hmac_sha256_of_nonce_and_data():
    want = hmac.new(b"tok", b"nonce" + b"data", hashlib.sha256).digest()
    assert _net.proof(b"tok", b"nonce", b"data") == want
    assert len(want) == _net.PROOF_BYTES
    assert _net.proof(b"other", b"nonce", b"data") != want


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_uid_of_a_local_peer_is_this_process_s(family, host):
    try:
        ls = socket.socket(family, socket.SOCK_STREAM)
        ls.bind((host, 0))
    except OSError as e:
        pytest.skip(f"no {host} here: {e}")
    ls.listen(1)
    got = {}

    def serve():
        conn, peer = ls.accept()
        with conn:
            got["uid"] = _net.tcp_peer_uid(peer, conn.getsockname())
            got["swapped"] = _net.tcp_peer_uid(conn.getsockname(), peer)

    t = threading.Thread(target=serve)
    t.start()
    with socket.create_connection(ls.getsockname()[:2], timeout=5):
        t.join(5)
    ls.close()
    assert got["uid"] == os.geteuid()
    # this end's own entry (local = ours, remote = the peer) is ours too
    assert got["swapped"] == os.geteuid()


def test_no_such_connection_is_none():
    c, s = pair()
    with c, s:
        assert _net.tcp_peer_uid(("127.0.0.1", 1), s.getsockname()) is None
        assert _net.tcp_peer_uid(("not an address", 1), s.getsockname()) is None


def test_served_keeps_at_most_limit_and_shuts_the_oldest_down():
    made = [pair() for _ in range(4)]
    try:
        served = _net.Served(2)
        for _, s in made[:3]:
            served.add(s)
        assert len(served) == 2
        # the oldest (made[0]) was shut down: its caller sees the end
        assert made[0][0].recv(1) == b""
        assert served.take(made[1][1]) is True
        assert served.take(made[1][1]) is False, "taken already"
        assert served.take(made[0][1]) is False, "shut down for a newer one"
        served.forget(made[2][1])
        assert made[2][1].fileno() == -1 and len(served) == 0
        served.add(made[3][1])
        served.shutdown_all()
        assert made[3][0].recv(1) == b""
    finally:
        for c, s in made:
            c.close()
            s.close()
