"""Item 10: KVCacheMemory takes CUDA tensors (__cuda_array_interface__ with
__dlpack_device__ == (kDLCUDA, id)) as VRAM on that GPU, through
kvwire::cuda::ExternalDeviceMemory; MAX's device-type validation (mixed
host/GPU groups refused with ValueError) applies. Run against the fake
driver tests/cuda_fake/libcuda.c (device memory there is host memory), in a
subprocess so that the fake libcuda is the one loaded. The check is
cuda_tensor_check.py, which scripts/gpu-check.sh also runs (its
python_cuda_tensors_as_vram row) on a real GPU."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

FAKE_C = pathlib.Path(__file__).resolve().parents[2] / "tests" / "cuda_fake" / "libcuda.c"

# The check itself, shared with scripts/gpu-check.sh's python row (real GPU).
CHECK = pathlib.Path(__file__).resolve().parent / "cuda_tensor_check.py"


def test_cuda_tensors_against_the_fake_driver(tmp_path):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None or not FAKE_C.exists():
        pytest.skip("needs a C compiler and tests/cuda_fake/libcuda.c (source checkout) to build the fake driver")
    so = tmp_path / "libcuda.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(so), str(FAKE_C)], check=True)
    (tmp_path / "libcuda.so").symlink_to("libcuda.so.1")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    r = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "GPU-OK" in r.stdout, r.stdout + r.stderr
