#!/usr/bin/env bash
# GPU check for kvwire's cuda layer (issue 6). On a machine with an NVIDIA
# GPU and driver: allocates VRAM, round-trips bytes, polls async copies by
# event query, tries dma-buf export and the registration chain, runs the host
# tier and the KV engine's validation over VRAM shard buffers, picks a NIC per
# GPU; prints a compact pass/fail table. A missing GPU fails (no skipping).
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
    cargo build --tests --features cuda -q || exit 1
    cargo test --features cuda --test cuda_gpu --test cuda_nogpu --test cuda_verbs -- --include-ignored --show-output --test-threads=1 >"$log" 2>"$err"
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
echo "overall: $([[ $rc -eq 0 ]] && echo PASS || echo FAIL)"
exit $rc
