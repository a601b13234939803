"""nixl_cuda_check.py against the fake CUDA driver (tests/cuda_fake/libcuda.c,
device memory there is host memory), in a subprocess so that the fake
libcuda is the one loaded. scripts/gpu-check.sh runs the same check on a
real GPU (row nixl_vram_descriptors)."""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "cuda_fake"))
import fake_driver  # noqa: E402

CHECK = pathlib.Path(__file__).resolve().parent / "nixl_cuda_check.py"


def test_vram_descriptors_with_the_fake_driver(tmp_path):
    r = fake_driver.run(CHECK, tmp_path, os.environ.get("KVWIRE_REQUIRE_CC") == "1")
    assert r.returncode == 0 and "NIXL-CUDA-CHECK-OK" in r.stdout, r.stdout + r.stderr
