#!/usr/bin/env bash
# Build the GPU check's test executables here (release, feature `cuda`) and
# copy them, stripped, into DIR (default .gpu-stage, git-ignored), so that a
# GPU machine without Rust or network runs them as they are:
#
#   scripts/gpu-stage.sh                           # here
#   GPU_CHECK_BINS=.gpu-stage scripts/gpu-check.sh # there (carry .gpu-stage)
#
# The executables load libcuda and libibverbs at run time, so they need
# nothing from this machine beyond glibc. Prints the staged files and sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-stage}
mkdir -p "$dir"
json=$(cargo test --release --features cuda --test cuda_gpu --test cuda_nogpu --test cuda_verbs --no-run \
    --message-format=json 2>/dev/null)
for t in cuda_gpu cuda_nogpu cuda_verbs; do
    exe=$(printf '%s\n' "$json" | grep -F "\"name\":\"$t\"" | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)
    [[ -n "$exe" ]] || { echo "gpu-stage: no executable for $t" >&2; exit 1; }
    cp "$exe" "$dir/$t"
    strip "$dir/$t" 2>/dev/null || true
done
ls -l "$dir"
du -sh "$dir"
