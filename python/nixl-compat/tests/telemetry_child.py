"""Child of test_nixl_telemetry.py: two agents in this process move 3 WRITEs
and 1 READ of 1 MiB, register 1 MiB each and deregister one, fail one
transfer, then print the Prometheus exposition scraped from this process's
NIXL exporter. Args: backend port."""

import os
import sys
import time
import urllib.request

import numpy as np

import nixl_alias  # noqa: F401  (before `nixl`: KVWIRE_NIXL_TEST_MODULE)
from nixl._api import nixl_agent, nixl_agent_config

backend, port = sys.argv[1], int(sys.argv[2])
a = nixl_agent("A", nixl_agent_config(backends=[backend]))
b = nixl_agent("B", nixl_agent_config(backends=[backend]))
src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
dst = np.zeros(1 << 20, np.uint8)
a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
a.add_remote_agent(b.get_agent_metadata())
lo = a.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM")
re_ = a.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
for op in ("WRITE", "WRITE", "WRITE", "READ"):
    h = a.initialize_xfer(op, lo, re_, "B", b"x")
    a.transfer(h)
    while a.check_xfer_state(h) == "PROC":
        pass
    for _ in range(3):  # polling a finished request again counts nothing
        assert a.check_xfer_state(h) == "DONE"
    a.release_xfer_handle(h)
assert np.array_equal(src, dst)
extra = np.zeros(4096, np.uint8)
reg = b.get_reg_descs([(extra.ctypes.data, extra.nbytes, 0, "")], "DRAM")
b.register_memory(reg)
b.deregister_memory(reg)
time.sleep(1.5)  # NIXL's exporter publishes from a worker thread
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode(), flush=True)
# real NIXL 1.5.1 can crash in its exporter's teardown at interpreter exit;
# what it printed is what is checked
os._exit(0)
