"""Run under a libcuda (the fake driver of tests/cuda_fake, or a real one):
mooncake.engine tells device pointers from host memory as Mooncake does for
location="*", and the shm/tcp engines refuse device memory with a code (kvwire
moves VRAM over verbs only). Prints CUDA-CHECK-OK."""

import ctypes
import os

import numpy as np

import mooncake.engine as me
from mooncake.engine import TransferEngine

lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuInit(0) == 0
dev = ctypes.c_int()
assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p()
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert lib.cuCtxSetCurrent(ctx) == 0
ptr = ctypes.c_uint64()
assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0

host = np.zeros(4096, np.uint8)
assert me._memory_of(ptr.value, "*") == ("VRAM", 0), me._memory_of(ptr.value, "*")
assert me._memory_of(host.ctypes.data, "*") == ("DRAM", 0)
assert me._memory_of(ptr.value, "cuda:3") == ("VRAM", 3)
assert me._memory_of(host.ctypes.data, "cpu:0") == ("DRAM", 0)
for transport in ("shm", "tcp"):
    os.environ["KVWIRE_MOONCAKE_TRANSPORT"] = transport
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.register_memory(ptr.value, 1 << 20) < 0, f"{transport} took device memory"
    assert e.register_memory(host.ctypes.data, host.nbytes) == 0
    assert e.register_memory(host.ctypes.data + 8192, 16, "cuda:x") < 0, "a bad location is a code"
    e.close()
print("CUDA-CHECK-OK")
