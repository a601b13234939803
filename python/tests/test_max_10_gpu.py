"""Item 10: KVCacheMemory takes CUDA tensors (__cuda_array_interface__ with
__dlpack_device__ == (kDLCUDA, id)) as VRAM on that GPU, through
kvwire::cuda::ExternalDeviceMemory; MAX's device-type validation (mixed
host/GPU groups refused with ValueError) applies. Run against the fake
driver tests/cuda_fake/libcuda.c (device memory there is host memory), in a
subprocess so that the fake libcuda is the one loaded; scripts/gpu-check.sh
covers a real GPU."""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

FAKE_C = pathlib.Path(__file__).resolve().parents[2] / "tests" / "cuda_fake" / "libcuda.c"

CHILD = textwrap.dedent(
    """
    import ctypes
    import numpy as np
    import kvwire

    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuInit(0) == 0
    ptr = ctypes.c_uint64()
    assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(8 * 64)) == 0

    class FakeCudaTensor:
        def __init__(self, ptr, shape, typestr="|u1", device=(2, 0), readonly=False):
            self.ptr, self.shape, self.typestr, self.device, self.readonly = ptr, shape, typestr, device, readonly

        @property
        def __cuda_array_interface__(self):
            return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, self.readonly),
                    "strides": None, "version": 3}

        def __dlpack_device__(self):
            return self.device

    t = FakeCudaTensor(ptr.value, (8, 64))
    m = kvwire.KVCacheMemory(False, [t])
    assert (m.total_num_pages, m.bytes_per_page) == (8, 64)
    assert m.buffers[0] is t
    for bad, what in [(FakeCudaTensor(ptr.value, (8, 64), typestr="<f4"), "uint8"),
                      (FakeCudaTensor(ptr.value, (512,)), "2-D"),
                      (FakeCudaTensor(ptr.value, (8, 64), readonly=True), "read-only"),
                      (FakeCudaTensor(ptr.value, (8, 64), device=(1, 0)), "CUDA")]:
        try:
            kvwire.KVCacheMemory(False, [bad])
        except ValueError as e:
            assert what in str(e), (what, str(e))
        else:
            raise AssertionError("accepted " + what)
    host = kvwire.KVCacheMemory(False, [np.zeros((8, 64), np.uint8)])
    # MAX: "Mixed device tensors detected" (in a group) / one memory type (across groups): ValueError.
    for memory in ([[m, host]], [[kvwire.KVCacheMemory(False, [t, np.zeros((8, 64), np.uint8)])]]):
        try:
            kvwire.KVTransferEngine("gpu-mixed", memory)
        except ValueError as e:
            assert "host and device" in str(e), str(e)
        else:
            raise AssertionError("mixed host/GPU engine accepted")
    print("GPU-OK")
    """
)


def test_cuda_tensors_against_the_fake_driver(tmp_path):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None or not FAKE_C.exists():
        pytest.skip("needs a C compiler and tests/cuda_fake/libcuda.c (source checkout) to build the fake driver")
    so = tmp_path / "libcuda.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(so), str(FAKE_C)], check=True)
    (tmp_path / "libcuda.so").symlink_to("libcuda.so.1")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "GPU-OK" in r.stdout, r.stdout + r.stderr
