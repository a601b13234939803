#!/usr/bin/env bash
# Run NIXL's own Python tests (ai-dynamo/nixl test/python) against kvwire's
# `nixl` package, from a scratch directory you lay out. Fetches nothing and
# never copies NIXL's files into this repository.
#
# Lay out the scratch directory once (outside this repo), e.g. from a NIXL
# checkout at the release you compare against:
#   git -C <nixl-checkout> archive <tag-or-commit> test/python examples/python \
#       | tar -x -C /tmp/nixl-peer
# so that /tmp/nixl-peer/test/python/{conftest.py,test_nixl_api.py,...} exist.
# NIXL's tests import torch: install a CPU torch into the venv first
#   target/nixl-venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
# (or from PyPI), then build the packages with scripts/nixl-tests.sh.
#
# Usage: scripts/nixl-peer-tests.sh <scratch-dir> [backend]   (backend: UCX, the
# default of NIXL's conftest, maps to kvwire's best transport; or KVWIRE_SHM/KVWIRE_TCP)
# Env: KVWIRE_NIXL_VENV (default target/nixl-venv), PYTEST_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
scratch=${1:?usage: scripts/nixl-peer-tests.sh <scratch-dir> [backend]}
backend=${2:-UCX}
venv=${KVWIRE_NIXL_VENV:-$root/target/nixl-venv}
case "$(cd "$scratch" && pwd)" in
    "$root"*) echo "nixl-peer-tests: the scratch dir must be outside the repository" >&2; exit 2 ;;
esac
[ -f "$scratch/test/python/test_nixl_api.py" ] || { echo "nixl-peer-tests: no test/python/test_nixl_api.py under $scratch" >&2; exit 2; }
"$venv/bin/python" -c "import nixl._api, kvwire" || { echo "nixl-peer-tests: run scripts/nixl-tests.sh first" >&2; exit 2; }
"$venv/bin/python" -c "import torch" 2>/dev/null || { echo "nixl-peer-tests: NIXL's tests need torch in $venv" >&2; exit 2; }
cd "$scratch"
# NIXL's own CI recipe (.gitlab/test_python.sh): pytest -s test/python, then prep_xfer_perf.
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -s -p no:cacheprovider -rs --backend "$backend" ${PYTEST_ARGS:-} test/python
for mode in list array; do
    [ -f test/python/prep_xfer_perf.py ] && "$venv/bin/python" test/python/prep_xfer_perf.py "$mode"
done
