#!/usr/bin/env bash
# GPU check for kvwire's cuda layer (issue 6). On a machine with an NVIDIA
# GPU and driver: allocates VRAM, round-trips bytes, polls async copies by
# event query, tries dma-buf export and the registration chain, runs the host
# tier and the KV engine's validation over VRAM shard buffers, picks a NIC per
# GPU, and (row python_cuda_tensors_as_vram) hands CUDA tensors from Python
# (`__cuda_array_interface__` + `__dlpack_device__`) to kvwire.KVCacheMemory
# as VRAM; prints a compact pass/fail table. A missing GPU fails (no skipping).
#
# The python row needs the kvwire Python package: the one staged by
# scripts/gpu-stage.sh (GPU_CHECK_BINS/python), else the venv of
# scripts/python-tests.sh (KVWIRE_VENV, default target/python-venv), else
# python3's own. Without one the row says "skip" with the reason (a failure
# under KVWIRE_REQUIRE_PYTHON=1 on a real GPU; with FAKE=1 the same check is
# python-tests' test_max_10_gpu.py).
#
#   scripts/gpu-check.sh            # build (debug) and run, ~1-2 min after the build
#   FAKE=1 scripts/gpu-check.sh     # same tests against tests/cuda_fake/libcuda.c
#   GPU_CHECK_BINS=.gpu-stage scripts/gpu-check.sh
#                                   # run test executables staged by scripts/gpu-stage.sh
#                                   # (no cargo: for a machine without Rust or network)
#
# Exit status: 0 when every row passes.
set -uo pipefail
cd "$(dirname "$0")/.."
export KVWIRE_REQUIRE_GPU=1
if [[ "${FAKE:-0}" == 1 ]]; then
    dir=$(mktemp -d)
    gcc -shared -fPIC -O1 -Wall -o "$dir/libcuda.so.1" tests/cuda_fake/libcuda.c || exit 1
    ln -s libcuda.so.1 "$dir/libcuda.so"
    export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # a PCIe function that exists here, so the NIC lookup resolves it
    export FAKE_CUDA_BUS_ID=${FAKE_CUDA_BUS_ID:-$(ls /sys/bus/pci/devices 2>/dev/null | head -1)}
    echo "using the FAKE driver in $dir (not a GPU check)"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader
log=$(mktemp)
err=$(mktemp)
# libtest's lines go to stdout, the tests' skip/info lines to stderr: keep
# them apart so neither splits the other.
if [[ -n "${GPU_CHECK_BINS:-}" ]]; then
    rc=0
    for t in cuda_gpu cuda_nogpu cuda_verbs; do
        [[ -x "$GPU_CHECK_BINS/$t" ]] || { echo "no $GPU_CHECK_BINS/$t (run scripts/gpu-stage.sh)"; exit 1; }
        "$GPU_CHECK_BINS/$t" --include-ignored --show-output --test-threads=1 >>"$log" 2>>"$err" || rc=$?
    done
else
    cargo build -p kvwire --tests --features cuda -q || exit 1
    cargo test -p kvwire --features cuda --test cuda_gpu --test cuda_nogpu --test cuda_verbs -- --include-ignored --show-output --test-threads=1 >"$log" 2>"$err"
    rc=$?
fi
grep -hE "^(cuda::probe|dma-buf export|GPU [0-9]+ \(|registration_path_is_reported: GPU)" "$log" "$err" | sed 's/^/  info: /'
skipped=$(sed -n -E 's/^([a-z0-9_]+): skipped: .*/\1/p' "$err" | sort -u | tr '\n' ' ')
printf '%-66s %s\n' TEST RESULT
grep -E "^test .* \.\.\. " "$log" | sed -E 's/^test ([^ ]+) \.\.\. .*(ok|FAILED)$/\1 \2/' |
    awk -v skipped=" $skipped" '{ r = ($NF == "ok" ? "pass" : "FAIL"); if (r == "pass" && index(skipped, " " $1 " ")) r = "skip"; printf "%-66s %s\n", $1, r }'
if [[ $rc -ne 0 ]]; then
    echo "--- failures ---"
    sed -n '/^failures:/,$p' "$log" | head -60
    grep -E "^error" -A5 "$err" | head -20
fi

# Python row (MAX parity, issue 14 item 10): python/tests/cuda_tensor_check.py.
py_row=python_cuda_tensors_as_vram
py_out=$(mktemp)
root=$(pwd)
venv=${KVWIRE_VENV:-$root/target/python-venv}
py=() py_path="" py_skip=""
if [[ -n "${GPU_CHECK_BINS:-}" && -d "$GPU_CHECK_BINS/python/kvwire" ]]; then
    py=(python3) py_path="$(cd "$GPU_CHECK_BINS/python" && pwd)"
elif [[ -x "$venv/bin/python" ]]; then
    py=("$venv/bin/python")
elif command -v python3 >/dev/null; then
    py=(python3)
else
    py_skip="no python3"
fi
if [[ -z "$py_skip" ]] && ! (cd /tmp && PYTHONPATH="$py_path" "${py[@]}" -c "import kvwire") >/dev/null 2>&1; then
    py_skip="no kvwire Python package for ${py[*]} (scripts/python-tests.sh builds one; scripts/gpu-stage.sh stages one)"
fi
if [[ -n "$py_skip" ]]; then
    echo "  info: $py_row: skipped: $py_skip"
    py_result=skip
    # On the fake driver the same check runs in scripts/python-tests.sh
    # (python/tests/test_max_10_gpu.py), which scripts/test.sh runs after
    # this step: only a real-GPU run must have the package.
    [[ "${KVWIRE_REQUIRE_PYTHON:-0}" == 1 && "${FAKE:-0}" != 1 ]] && { py_result=FAIL; rc=1; }
# From /tmp, so that python/kvwire (sources without the extension) is not what is imported.
elif (cd /tmp && PYTHONPATH="$py_path" timeout 120 "${py[@]}" "$root/python/tests/cuda_tensor_check.py") >"$py_out" 2>&1 &&
    grep -q '^GPU-OK$' "$py_out"; then
    sed -n 's/^cuda-tensors: /  info: cuda-tensors: /p' "$py_out"
    py_result=pass
else
    py_result=FAIL
    rc=1
fi
printf '%-66s %s\n' "$py_row" "$py_result"
if [[ "$py_result" == FAIL && -s "$py_out" ]]; then
    echo "--- $py_row ---"
    tail -20 "$py_out"
fi
echo "overall: $([[ $rc -eq 0 ]] && echo PASS || echo FAIL)"
exit $rc
