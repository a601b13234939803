"""Run under a libcuda (the fake driver of tests/cuda_fake, or a real one):
kvwire's `nixl` with VRAM descriptors. Device memory from libcuda through
ctypes (cuMemAlloc on GPU 0). On the shm and tcp backends `register_memory(...,
"VRAM")` is refused with a nixl error naming the reason (kvwire moves VRAM
over verbs only) and `get_backend_mem_types` says DRAM only; DRAM still
registers. Where an RDMA port is ACTIVE the KVWIRE_VERBS backend lists
VRAM_SEG and registers the device memory (dma-buf, then nvidia-peermem).
Prints NIXL-CUDA-CHECK-OK (and one `nixl-vram:` info line)."""

import ctypes
import glob
import uuid

import numpy as np

import nixl._bindings as B
from nixl._api import nixl_agent, nixl_agent_config

lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuInit(0) == 0, "cuInit failed: no usable CUDA driver"
dev = ctypes.c_int()
assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p()
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert lib.cuCtxSetCurrent(ctx) == 0
ptr = ctypes.c_uint64()
assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0
host = np.zeros(4096, np.uint8)

for backend in ("KVWIRE_SHM", "KVWIRE_TCP"):
    a = nixl_agent("vram-" + str(uuid.uuid4()), nixl_agent_config(backends=[backend]))
    assert a.get_backend_mem_types(backend) == ["DRAM_SEG"], a.get_backend_mem_types(backend)
    try:
        a.register_memory([(ptr.value, 1 << 20, 0, "")], "VRAM")
    except B.nixlNotSupportedError as e:
        assert "host (DRAM) memory only" in str(e), e
    else:
        raise AssertionError(f"{backend} registered device memory")
    assert a.register_memory([(host.ctypes.data, host.nbytes, 0, "")], "DRAM")

active = any("ACTIVE" in open(s).read() for s in glob.glob("/sys/class/infiniband/*/ports/*/state"))
if active:
    a = nixl_agent("vram-" + str(uuid.uuid4()), nixl_agent_config(backends=["KVWIRE_VERBS"]))
    assert "VRAM_SEG" in a.get_backend_mem_types("KVWIRE_VERBS")
    a.register_memory([(ptr.value, 1 << 20, 0, "")], "VRAM")
    print("nixl-vram: registered 1 MiB of device memory on KVWIRE_VERBS")
else:
    print("nixl-vram: no ACTIVE RDMA port: the KVWIRE_VERBS VRAM registration was not tried")
print("NIXL-CUDA-CHECK-OK")
