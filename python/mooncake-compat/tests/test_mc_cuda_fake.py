"""Device pointers against the fake CUDA driver (tests/cuda_fake/libcuda.c,
device memory there is host memory), in a subprocess so that the fake
libcuda is the one loaded: detection for location="*" and the shm/tcp
refusal (mc_cuda_check.py)."""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "cuda_fake"))
import fake_driver  # noqa: E402

CHECK = pathlib.Path(__file__).resolve().parent / "mc_cuda_check.py"


def test_device_pointers_with_the_fake_driver(tmp_path):
    r = fake_driver.run(CHECK, tmp_path, os.environ.get("KVWIRE_REQUIRE_CC") == "1")
    assert r.returncode == 0 and "CUDA-CHECK-OK" in r.stdout, r.stdout + r.stderr
    assert "moves host (DRAM) memory only" in r.stderr, "the refusal names the reason"
