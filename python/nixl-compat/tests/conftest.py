import json
import os
import subprocess
import sys

import pytest

BACKENDS = ["KVWIRE_SHM", "KVWIRE_TCP"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    return request.param


class Peer:
    """The child process of nixl_peer.py."""

    def __init__(self):
        here = os.path.dirname(os.path.abspath(__file__))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(here, "nixl_peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"peer died on {cmd['op']}"
        return json.loads(line)

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
            except Exception:  # noqa: BLE001
                pass
            self.proc.wait(timeout=10)


@pytest.fixture
def peer_factory():
    peers = []

    def make():
        p = Peer()
        peers.append(p)
        return p

    yield make
    for p in peers:
        if p.proc.poll() is None:
            p.kill()
