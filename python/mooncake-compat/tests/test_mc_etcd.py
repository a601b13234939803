"""metadata_server="etcd://host:port": sessions named by their segment name
(local_hostname), found through etcd. Needs the etcd binary (apt-get install
etcd-server); skipped without it unless KVWIRE_REQUIRE_ETCD=1."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import numpy as np
import pytest

from mooncake.engine import TransferEngine


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd():
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("KVWIRE_REQUIRE_ETCD") == "1":
            pytest.fail("no etcd binary and KVWIRE_REQUIRE_ETCD=1")
        pytest.skip("no etcd binary (apt-get install -y etcd-server)")
    client, peer = _free_port(), _free_port()
    data = tempfile.mkdtemp(prefix="mc-etcd-")
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen([binary, "--data-dir", data, "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            break
        except OSError:
            assert time.monotonic() < deadline, "etcd did not start"
            time.sleep(0.2)
    yield f"127.0.0.1:{client}"
    proc.kill()
    proc.wait()
    shutil.rmtree(data, ignore_errors=True)


def test_etcd_sessions(transport, etcd):
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1:7101", f"etcd://{etcd}", "tcp", "") == 0
    assert b.initialize("127.0.0.1:7102", etcd, "tcp", "") == 0, "a bare host:port is etcd, as in Mooncake"
    assert b.session_id == "127.0.0.1:7102"
    src = np.frombuffer(np.random.default_rng(1).bytes(8192), dtype=np.uint8).copy()
    dst = np.zeros(8192, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    assert a.get_first_buffer_address("127.0.0.1:7102") == dst.ctypes.data
    assert a.transfer_sync_write("127.0.0.1:7102", src.ctypes.data, dst.ctypes.data, 8192) == 0
    assert (dst == src).all()
    assert a.send_probe("127.0.0.1:7102") == 0
    assert a.transfer_sync_write("127.0.0.1:7999", src.ctypes.data, dst.ctypes.data, 8) == -1, "not in etcd"
    assert a.send_probe("127.0.0.1:7999") != 0
    b.close()
    assert a.send_probe("127.0.0.1:7102") != 0, "close removes the key"
    a.close()


def test_etcd_unreachable_fails_initialize(transport):
    assert TransferEngine().initialize("127.0.0.1:7103", f"etcd://127.0.0.1:{_free_port()}", "tcp", "") == -1
