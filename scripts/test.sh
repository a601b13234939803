#!/usr/bin/env bash
# The project's test command (README line 2; .ci/run calls it).
# Lints, then every test; hardware-dependent suites run where their hardware
# or harness exists and say "skipped: <reason>" elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --no-default-features -- -D warnings
cargo build --release --bins
# Release: the replay and bench tests move gigabytes and verify every byte.
cargo test --release --all-targets
# The cuda layer against a fake libcuda (host memory as "VRAM"): our side of
# every driver call, without a GPU. The real GPU check is scripts/gpu-check.sh.
if command -v gcc >/dev/null; then FAKE=1 bash scripts/gpu-check.sh; else echo "gpu-check (fake driver): skipped: no gcc"; fi
for suite in scripts/softroce-tests.sh scripts/cuda-softroce-check.sh scripts/netns-tests.sh scripts/python-tests.sh scripts/capi-tests.sh; do
  if [ -f "$suite" ]; then bash "$suite"; fi
done
