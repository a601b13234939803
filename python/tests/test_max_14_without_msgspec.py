"""Without msgspec (a declared dependency that ``pip install --no-deps``
skips), ``kvwire`` still imports and ``TransferReqData`` is the extension's
class: the same constructor, attributes, bytes and ``to_*`` / ``from_*``."""

import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["msgspec"] = None  # import msgspec raises ImportError
import numpy as np
import kvwire
assert kvwire.TransferReqData is kvwire._kvwire.TransferReqData, kvwire.TransferReqData
mem = lambda: [[kvwire.KVCacheMemory(False, [np.zeros((8, 32), np.uint8)])]]
a, b = kvwire.KVTransferEngine("nm-a", mem()), kvwire.KVTransferEngine("nm-b", mem())
a.connect(b.metadata)
b.connect(a.metadata)
req = a.initiate_send_transfer(b.metadata, {"0": [1]}, {"0": [2]})
assert type(req) is kvwire.TransferReqData
wire = kvwire.TransferReqData.from_msgpack(req.to_msgpack())
assert wire == req == kvwire.TransferReqData.from_json(req.to_json())
b.sync_and_release(wire, timeout_s=10)
a.sync_and_release(req, timeout_s=10)
a.cleanup()
b.cleanup()
print("ok")
"""


def test_kvwire_works_without_msgspec():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
