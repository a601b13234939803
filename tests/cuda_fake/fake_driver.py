"""Run a Python check script under the fake CUDA driver (libcuda.c beside
this file, device memory there is host memory), in a subprocess so that the
fake libcuda is the one loaded. Shared by the fake-driver pytest files of
python/tests, python/nixl-compat/tests and python/mooncake-compat/tests.

`run(check, tmp_path, cc_required)` builds libcuda.so.1 into `tmp_path`
and returns the finished `subprocess.CompletedProcess` of `python check`.
Without a C compiler the calling test is skipped, or fails when
`cc_required` (the callers pass `KVWIRE_REQUIRE_CC == "1"` where CI demands
the compiler)."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

FAKE_C = pathlib.Path(__file__).resolve().parent / "libcuda.c"


def run(check, tmp_path, cc_required=False):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None or not FAKE_C.exists():
        why = "needs a C compiler and tests/cuda_fake/libcuda.c (source checkout) to build the fake driver"
        if cc_required:
            pytest.fail(f"{why} and KVWIRE_REQUIRE_CC=1")
        pytest.skip(why)
    so = tmp_path / "libcuda.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(so), str(FAKE_C)], check=True)
    (tmp_path / "libcuda.so").symlink_to("libcuda.so.1")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    return subprocess.run([sys.executable, str(check)], env=env, capture_output=True, text=True, timeout=120)
