#!/usr/bin/env bash
# Run NIXL's own Python tests (ai-dynamo/nixl test/python) and its
# expanded_two_peers.py example with real NIXL 1.5.1 and backend KVWIRE (our
# plugin), from a scratch directory you lay out as for scripts/nixl-peer-tests.sh:
#   git -C <nixl-checkout> archive <tag-or-commit> test/python examples/python \
#       | tar -x -C /tmp/nixl-peer
# Fetches no NIXL source and copies none into this repository.
#
# NIXL's tests import torch. PyPI's torch is built for CUDA 13, and the `nixl`
# meta package then loads the `nixl-cu13` wheel, so this venv
# (target/nixl-peer-venv) holds nixl==1.5.1, nixl-cu13==1.5.1, torch (with its
# CUDA runtime wheels, ~4 GB; no GPU is used), numpy and pytest. The plugin is
# symlinked into that wheel's plugins/ directory, beside UCX and POSIX, which
# NIXL's tests also create.
#
# Usage: scripts/nixl-plugin-peer-tests.sh <scratch-dir>     Env: PYTEST_ARGS
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
scratch=${1:?usage: scripts/nixl-plugin-peer-tests.sh <scratch-dir>}
case "$(cd "$scratch" && pwd)" in
    "$root"*) echo "nixl-plugin-peer-tests: the scratch dir must be outside the repository" >&2; exit 2 ;;
esac
[ -f "$scratch/test/python/test_nixl_api.py" ] || { echo "nixl-plugin-peer-tests: no test/python/test_nixl_api.py under $scratch" >&2; exit 2; }
venv=$root/target/nixl-peer-venv
if ! "$venv/bin/python" -c "import nixl._api, torch, pytest" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q torch numpy pytest
    "$venv/bin/python" -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"
fi
libs=$("$venv/bin/python" -c 'import os, nixl._api as a; d = os.path.dirname(os.path.dirname(a.__file__)); p = os.path.basename(os.path.dirname(a.__file__)); print(os.path.join(d, "." + p + ".mesonpy.libs"))')
scripts/nixl-plugin-build.sh --check-abi "$libs"
ln -sf "$root/target/nixl-plugin/libplugin_KVWIRE.so" "$libs/plugins/"
py=$venv/bin/python
cd "$scratch"
for t in shm tcp; do
    echo "== NIXL test/python, backend KVWIRE, transport $t"
    # shellcheck disable=SC2086
    # hard_exit: see nixl-plugin/tests/hard_exit.py (UCX's libnl crashes at process exit).
    PYTHONPATH=$root/nixl-plugin/tests KVWIRE_TRANSPORT=$t "$py" -m pytest -q -p no:cacheprovider -p hard_exit -rs \
        --backend KVWIRE ${PYTEST_ARGS:-} test/python
    for run in 1 2 3; do
        port=$((20000 + RANDOM % 20000))
        KVWIRE_TRANSPORT=$t timeout 120 "$py" examples/python/expanded_two_peers.py --mode target --ip 127.0.0.1 \
            --port "$port" --backend KVWIRE > /tmp/kvwire-nixl-ex-target.log 2>&1 & tpid=$!
        sleep 3
        KVWIRE_TRANSPORT=$t timeout 120 "$py" examples/python/expanded_two_peers.py --mode initiator --ip 127.0.0.1 \
            --port "$port" --backend KVWIRE > /tmp/kvwire-nixl-ex-initiator.log 2>&1
        wait "$tpid"
        grep -q "verification passed" /tmp/kvwire-nixl-ex-target.log
        grep -q "final data verification passed" /tmp/kvwire-nixl-ex-initiator.log
        echo "expanded_two_peers.py ($t) run $run: initiator and target verified their data"
    done
done
