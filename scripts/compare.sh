#!/usr/bin/env bash
# kvwire vs NIXL side by side (issues 8, 19). Two commands for anyone:
#   scripts/compare.sh --quick     # smoke test: small sizes, one run
#   scripts/compare.sh             # the published table, written into docs/perf-shm.md:
#                                  # 256 MiB scattered, 4 KiB/64 KiB/1 MiB, WRITE+READ,
#                                  # kvwire with its same-run copy ceilings, NIXL's best
#                                  # same-host configuration and its defaults, 3 interleaved runs
# Extra arguments go to bench/compare/compare.py (see --help there).
# Env: COMPARE_VENV (default bench/compare/.venv), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${COMPARE_VENV:-bench/compare/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # --no-deps: nixl-cu12 declares torch (~5 GB with CUDA wheels) but the
  # harness never hands it tensors; requirements.txt lists what is imported.
  "$venv/bin/pip" install -q --no-deps -r bench/compare/requirements.txt
fi
cargo build --release --bin kvwire
case " $* " in
  *" --quick "* | *" --report "* | *" --md "*) exec "$venv/bin/python" bench/compare/compare.py "$@" ;;
  *) exec "$venv/bin/python" bench/compare/compare.py --md docs/perf-shm.md "$@" ;;
esac
