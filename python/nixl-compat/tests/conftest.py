import json
import os
import subprocess
import sys

import pytest

import nixl_alias  # noqa: F401  (before `nixl`: KVWIRE_NIXL_TEST_MODULE)

# KVWIRE_NIXL_TEST_BACKENDS (comma separated) replaces the default backends:
# scripts/nixl-softroce-check.sh runs the flow with KVWIRE_VERBS,UCX in the
# Soft-RoCE guest. KVWIRE_NIXL_TEST_PEER_DEVICE sets the child peer's
# UCX_NET_DEVICES (its verbs device), so the two sides use different NICs.
BACKENDS = [b for b in os.environ.get("KVWIRE_NIXL_TEST_BACKENDS", "KVWIRE_SHM,KVWIRE_TCP").split(",") if b]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    return request.param


class Peer:
    """The child process of nixl_peer.py."""

    def __init__(self, script="nixl_peer.py"):
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ)
        if os.environ.get("KVWIRE_NIXL_TEST_PEER_DEVICE"):
            env["UCX_NET_DEVICES"] = os.environ["KVWIRE_NIXL_TEST_PEER_DEVICE"]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(here, script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            assert line, f"peer died on {cmd['op']}"
            # real NIXL logs to stdout ("... NIXL INFO ..."): skip such lines
            if line.startswith("{"):
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

    def make(script="nixl_peer.py"):
        p = Peer(script)
        peers.append(p)
        return p

    yield make
    for p in peers:
        if p.proc.poll() is None:
            p.kill()
