#!/usr/bin/env bash
# Run tests/cuda_verbs.rs in the Soft-RoCE guest (rxe0 <-> rxe1) against the
# fake CUDA driver (tests/cuda_fake/libcuda.c): VRAM registration through the
# verbs transport's fallback chain and one-sided WRITE/READ of "VRAM", without
# a GPU. Not a GPU check (see docs/GPU.md). One-time set-up as for
# scripts/softroce-tests.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$repo/scripts/softroce-lib.sh"
softroce_preflight cuda-softroce-check "$repo"
command -v gcc >/dev/null || softroce_unavailable cuda-softroce-check "no gcc for the fake libcuda"
cd "$repo"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-600}
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-cuda-softroce.XXXXXX")
trap 'rm -rf "$stage"' EXIT
exe=$(cargo test -p kvwire --features cuda --no-run --message-format=json --test cuda_verbs |
  sed -n 's/.*"executable":"\([^"]*\/cuda_verbs-[^"]*\)".*/\1/p' | head -1)
[ -n "$exe" ] || { echo "cuda-softroce-check: no cuda_verbs binary built" >&2; exit 125; }
cp "$exe" "$stage/cuda_verbs"
gcc -shared -fPIC -O1 -Wall -o "$stage/libcuda.so.1" tests/cuda_fake/libcuda.c
bash "$softroce_vm" run "$stage" \
  "LD_LIBRARY_PATH=/host KVWIRE_REQUIRE_GPU=1 KVWIRE_REQUIRE_RDMA=1 RUST_LOG=info ./cuda_verbs --include-ignored --test-threads=1 --nocapture $*"
