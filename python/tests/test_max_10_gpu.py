"""Item 10: KVCacheMemory takes CUDA tensors (__cuda_array_interface__ with
__dlpack_device__ == (kDLCUDA, id)) as VRAM on that GPU, through
kvwire::cuda::ExternalDeviceMemory; MAX's device-type validation (mixed
host/GPU groups refused with ValueError) applies. Run against the fake
driver tests/cuda_fake/libcuda.c (device memory there is host memory), in a
subprocess so that the fake libcuda is the one loaded. The check is
cuda_tensor_check.py, which scripts/gpu-check.sh also runs (its
python_cuda_tensors_as_vram row) on a real GPU."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "cuda_fake"))
import fake_driver  # noqa: E402

# The check itself, shared with scripts/gpu-check.sh's python row (real GPU).
CHECK = pathlib.Path(__file__).resolve().parent / "cuda_tensor_check.py"


def test_cuda_tensors_against_the_fake_driver(tmp_path):
    r = fake_driver.run(CHECK, tmp_path)
    assert r.returncode == 0 and "GPU-OK" in r.stdout, r.stdout + r.stderr
