#!/usr/bin/env python3
"""What a plain TCP byte stream moves between two endpoints: the ceiling any
TCP transfer engine (kvwire's tcp backend, Mooncake's TCP transport) works
under on that path, measured in the same run as the engines.

No framing, no descriptors, no per-page work: each of STREAMS connections
sends BYTES from one buffer in 1 MiB `send` calls and the receiver reads them
with 1 MiB `recv_into` calls into one buffer (the two kernel copies per byte a
TCP transfer pays; the GIL is released in both calls). Reported: GB/s of the
whole phase (first byte sent to last byte acknowledged by the receiver), best
of REPS.

Usage:
  tcp_ceiling.py serve HOST PORT            # answers any number of runs, exits after IDLE_S (60) idle
  tcp_ceiling.py send HOST PORT [STREAMS] [BYTES] [REPS]
                                            # prints one JSON line
STREAMS default 1, BYTES default 256 MiB (split between the streams), REPS 3.
"""
import json
import socket
import struct
import sys
import threading
import time

CHUNK = 1 << 20
IDLE_S = 60


def recv_exact(s, n):
    b = bytearray(n)
    v = memoryview(b)
    while n:
        k = s.recv_into(v[len(b) - n:], n)
        if k == 0:
            raise ConnectionError("peer closed")
        n -= k
    return bytes(b)


def serve(host, port):
    ls = socket.create_server((host, port), reuse_port=False)
    ls.settimeout(IDLE_S)
    buf = bytearray(CHUNK * 16)

    def one(conn):
        with conn:
            view = memoryview(buf)
            (total,) = struct.unpack("!Q", recv_exact(conn, 8))
            left, at = total, 0
            while left:
                k = conn.recv_into(view[at:at + min(CHUNK, left)])
                if k == 0:
                    return
                left -= k
                at = (at + k) % (len(buf) - CHUNK)
            conn.sendall(b"k")

    while True:
        try:
            conn, _ = ls.accept()
        except socket.timeout:
            return
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def send(host, port, streams, total, reps):
    per = total // streams
    buf = memoryview(bytearray(b"\x01" * (CHUNK * 16)))
    best = None
    for _ in range(reps):
        socks = [socket.create_connection((host, port), timeout=60) for _ in range(streams)]
        start = threading.Barrier(streams + 1)
        errors = []

        def one(s):
            try:
                stream(s)
            except OSError as e:
                errors.append(e)

        def stream(s):
            start.wait()
            s.sendall(struct.pack("!Q", per))
            left, at = per, 0
            while left:
                k = s.send(buf[at:at + min(CHUNK, left)])
                left -= k
                at = (at + k) % (len(buf) - CHUNK)
            if recv_exact(s, 1) != b"k":
                raise ConnectionError("bad acknowledgement")

        ts = [threading.Thread(target=one, args=(s,)) for s in socks]
        for t in ts:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        for s in socks:
            s.close()
        if errors:
            raise SystemExit(f"tcp_ceiling: {errors[0]}")
        best = dt if best is None else min(best, dt)
    return {"streams": streams, "bytes": per * streams, "reps": reps, "gbps": round(per * streams / best / 1e9, 3)}


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("serve", "send"):
        raise SystemExit(__doc__)
    host, port = sys.argv[2], int(sys.argv[3])
    if sys.argv[1] == "serve":
        serve(host, port)
        return
    streams = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    total = int(sys.argv[5]) if len(sys.argv) > 5 else 256 << 20
    reps = int(sys.argv[6]) if len(sys.argv) > 6 else 3
    if streams < 1 or total < streams or reps < 1:
        raise SystemExit("STREAMS, BYTES and REPS must be positive (BYTES >= STREAMS)")
    print(json.dumps(send(host, port, streams, total, reps)))


if __name__ == "__main__":
    main()
