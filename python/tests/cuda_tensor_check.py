"""CUDA tensors from Python as VRAM (MAX parity, issue 14 item 10), against
whichever libcuda the process loads: the fake driver (tests/cuda_fake,
from test_max_10_gpu.py) or a real GPU (the python row of
scripts/gpu-check.sh).

Device memory comes from libcuda itself through ctypes (primary context of
GPU 0, cuMemAlloc), wrapped in the smallest object a CUDA tensor library
hands out: ``__cuda_array_interface__`` plus ``__dlpack_device__``. Where
torch or cupy with a GPU is importable, their tensors are checked too. Host
buffers are numpy arrays when numpy is there, else 2-D memoryviews, so the
check needs nothing but the kvwire package.

Prints one ``cuda-tensors: ...`` info line and ``GPU-OK``; exits non-zero
(with the failed assertion) otherwise.
"""

import ctypes
import sys

import kvwire

PAGES, BPP = 8, 64
KDL_CUDA = 2


def cuda_alloc(nbytes):
    """(libcuda, device pointer) of `nbytes` on GPU 0, in its primary context."""
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuInit(0) == 0, "cuInit failed: no usable CUDA driver"
    dev = ctypes.c_int()
    assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0, "cuDeviceGet(0) failed"
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0, "cuDevicePrimaryCtxRetain failed"
    assert lib.cuCtxSetCurrent(ctx) == 0, "cuCtxSetCurrent failed"
    ptr = ctypes.c_uint64()
    assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0, "cuMemAlloc failed"
    return lib, ptr.value


class CudaTensor:
    """What torch/cupy CUDA tensors export, and nothing else."""

    def __init__(self, ptr, shape, typestr="|u1", device=(KDL_CUDA, 0), readonly=False):
        self.ptr, self.shape, self.typestr, self.device, self.readonly = ptr, shape, typestr, device, readonly

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, self.readonly),
                "strides": None, "version": 3}

    def __dlpack_device__(self):
        return self.device


def host_pages():
    try:
        import numpy as np
        return np.zeros((PAGES, BPP), np.uint8)
    except ImportError:
        return memoryview(bytearray(PAGES * BPP)).cast("B", (PAGES, BPP))


def library_tensors():
    """Real CUDA tensors from torch / cupy, where installed with a GPU."""
    found = []
    try:
        import torch
        if torch.cuda.is_available():
            found.append(("torch", torch.zeros((PAGES, BPP), dtype=torch.uint8, device="cuda:0")))
    except Exception:  # noqa: BLE001 - absent or broken: not what is checked here
        pass
    try:
        import cupy
        found.append(("cupy", cupy.zeros((PAGES, BPP), dtype=cupy.uint8)))
    except Exception:  # noqa: BLE001
        pass
    return found


def expect_value_error(make, what):
    try:
        make()
    except ValueError as e:
        assert what in str(e), (what, str(e))
    else:
        raise AssertionError("accepted " + what)


def main():
    _, ptr = cuda_alloc(PAGES * BPP)  # kept until exit: the memories below point into it
    t = CudaTensor(ptr, (PAGES, BPP))
    m = kvwire.KVCacheMemory(False, [t])
    assert (m.total_num_pages, m.bytes_per_page) == (PAGES, BPP)
    assert m.buffers[0] is t
    # Two shards on one GPU, as one TP group.
    t2 = CudaTensor(ptr + (PAGES // 2) * BPP, (PAGES // 2, BPP))
    assert kvwire.KVCacheMemory(False, [CudaTensor(ptr, (PAGES // 2, BPP)), t2]).total_num_pages == PAGES // 2
    for bad, what in [(CudaTensor(ptr, (PAGES, BPP), typestr="<f4"), "uint8"),
                      (CudaTensor(ptr, (PAGES * BPP,)), "2-D"),
                      (CudaTensor(ptr, (PAGES, BPP), readonly=True), "read-only"),
                      (CudaTensor(ptr, (PAGES, BPP), device=(1, 0)), "CUDA")]:
        expect_value_error(lambda: kvwire.KVCacheMemory(False, [bad]), what)
    host = kvwire.KVCacheMemory(False, [host_pages()])
    # MAX: mixed host/GPU in a group ("Mixed device tensors detected") or
    # across groups (one memory type per engine): ValueError.
    for memory in ([[m, host]], [[kvwire.KVCacheMemory(False, [t, host_pages()])]]):
        expect_value_error(lambda: kvwire.KVTransferEngine("gpu-mixed", memory), "host and device")
    libs = []
    for name, tensor in library_tensors():
        lm = kvwire.KVCacheMemory(False, [tensor])
        assert (lm.total_num_pages, lm.bytes_per_page) == (PAGES, BPP), name
        libs.append(name)
    print(f"cuda-tensors: libcuda pointer 0x{ptr:x} as VRAM; library tensors: {', '.join(libs) or 'none installed'}")
    print("GPU-OK")


if __name__ == "__main__":
    main()
    sys.exit(0)
