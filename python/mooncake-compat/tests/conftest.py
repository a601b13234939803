import json
import os
import subprocess
import sys

import pytest

# KVWIRE_MOONCAKE_TEST_TRANSPORTS (comma separated) replaces the default
# transports the suite runs on (e.g. "verbs" in a Soft-RoCE guest).
TRANSPORTS = [t for t in os.environ.get("KVWIRE_MOONCAKE_TEST_TRANSPORTS", "shm,tcp").split(",") if t]
HERE = os.path.dirname(os.path.abspath(__file__))
# device_name of the engines in this process (the child peer's:
# KVWIRE_MOONCAKE_TEST_PEER_DEVICE), so the two sides use different NICs on verbs.
DEVICE = os.environ.get("KVWIRE_MOONCAKE_TEST_DEVICE", "")


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    """Every engine made by the test (and its peers) uses this kvwire transport."""
    monkeypatch.setenv("KVWIRE_MOONCAKE_TRANSPORT", request.param)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.delenv("KVWIRE_MOONCAKE_TOKEN", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    return request.param


class Peer:
    """A child process running mc_peer.py (its own engine)."""

    def __init__(self, env=None, script="mc_peer.py"):
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=e)

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"peer died on {cmd['op']}"
        out = json.loads(line)
        assert "error" not in out, out["error"]
        return out

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

    def make(env=None, script="mc_peer.py"):
        p = Peer(env, script)
        peers.append(p)
        return p

    yield make
    for p in peers:
        if p.proc.poll() is None:
            p.kill()


@pytest.fixture
def engines(transport):
    """Two initialized engines in this process: (initiator, target)."""
    from mooncake.engine import TransferEngine

    made = []
    for _ in range(2):
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", DEVICE) == 0
        made.append(e)
    yield made
    for e in made:
        e.close()
