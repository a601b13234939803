"""nixl_cuda_check.py against the fake CUDA driver (tests/cuda_fake/libcuda.c,
device memory there is host memory), in a subprocess so that the fake
libcuda is the one loaded. scripts/gpu-check.sh runs the same check on a
real GPU (row nixl_vram_descriptors)."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

FAKE_C = pathlib.Path(__file__).resolve().parents[3] / "tests" / "cuda_fake" / "libcuda.c"
CHECK = pathlib.Path(__file__).resolve().parent / "nixl_cuda_check.py"


def test_vram_descriptors_with_the_fake_driver(tmp_path):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None or not FAKE_C.exists():
        if os.environ.get("KVWIRE_REQUIRE_CC") == "1":
            pytest.fail("no C compiler or tests/cuda_fake/libcuda.c and KVWIRE_REQUIRE_CC=1")
        pytest.skip("needs a C compiler and tests/cuda_fake/libcuda.c (source checkout)")
    so = tmp_path / "libcuda.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(so), str(FAKE_C)], check=True)
    (tmp_path / "libcuda.so").symlink_to("libcuda.so.1")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    r = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "NIXL-CUDA-CHECK-OK" in r.stdout, r.stdout + r.stderr
