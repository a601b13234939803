#!/usr/bin/env bash
# Run Mooncake's own Transfer Engine Python tests (kvcache-ai/Mooncake
# mooncake-wheel/tests) against kvwire's `mooncake` package, or against the
# real `mooncake-transfer-engine-non-cuda` wheel from PyPI, from a scratch
# directory you lay out. Fetches no test sources and never copies Mooncake's
# files into this repository (CI cannot reach GitHub: give it a directory).
#
# Lay out the scratch directory once (outside this repo), from a Mooncake
# checkout at the revision you compare against:
#   git -C <mooncake-checkout> archive <rev> mooncake-wheel/tests | tar -x -C /tmp/mc-peer
# so that /tmp/mc-peer/mooncake-wheel/tests/transfer_engine_target.py exists.
# (Mooncake publishes no sdist on PyPI; the tests are only in its repository.)
#
# Usage: scripts/mooncake-peer-tests.sh <scratch-dir> [real|ours|ours-tcp ...]
#   (default: real ours ours-tcp)
#   ours: target/mooncake-venv, built by scripts/mooncake-tests.sh
#         (KVWIRE_MOONCAKE_BUILD_ONLY=1 builds it without running the suite);
#         on 127.0.0.1 kvwire's rule picks shm;
#   ours-tcp: the same with KVWIRE_MOONCAKE_TRANSPORT=tcp;
#   real: target/mooncake-real-venv, made here with
#         `pip install mooncake-transfer-engine-non-cuda numpy pytest`
#         (needs libibverbs1: apt-get install -y libibverbs1).
#
# What runs, as Mooncake's scripts/run_tests.sh pairs them, with
# PROTOCOL=tcp MC_METADATA_SERVER=P2PHANDSHAKE:
#   transfer_engine_target.py in the background, then
#   transfer_engine_initiator_test.py (pytest) against it;
#   test_import_structure.py (its store and BufferPool parts import and
#   construct what kvwire's `mooncake.store` provides: ReplicateConfig, a
#   MooncakeDistributedStore whose operations raise, the BufferPool alias).
# Not run: the tests that need CUDA, an RDMA NIC, torch or Mooncake Store
# (test_transfer_on_cuda.py, test_transfer_on_hip.py, test_regmr_overhead.py,
# test_mooncake_ep.py, the store, CLI and buffer-pool tests).
#
# With P2PHANDSHAKE the target's rpc port is random (Mooncake's rule, in
# MC_MIN_RPC_PORT..MC_MAX_RPC_PORT), while the tests name the target by
# TARGET_SERVER_NAME (default 127.0.0.1:12345): this script gives the target
# a two-port range (real Mooncake takes its TCP data port from the same
# range), finds which of the target's listening ports is the rpc port (the
# one where get_first_buffer_address answers), and passes
# TARGET_SERVER_NAME=127.0.0.1:<that port> to the initiator.
#
# Env: CIRCLE (initiator iterations, Mooncake's default 1000), PYTEST_ARGS.
# Prints one line per implementation:
#   mooncake-peer-tests[<impl>]: initiator: <pytest summary>; import_structure: <pytest summary>
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
scratch=${1:?usage: scripts/mooncake-peer-tests.sh <scratch-dir> [ours|real ...]}
shift
impls=("$@")
[ ${#impls[@]} -eq 0 ] && impls=(real ours ours-tcp)
scratch=$(cd "$scratch" && pwd)
case "$scratch" in
    "$root"*) echo "mooncake-peer-tests: the scratch dir must be outside the repository" >&2; exit 2 ;;
esac
tests="$scratch/mooncake-wheel/tests"
[ -f "$tests/transfer_engine_target.py" ] && [ -f "$tests/transfer_engine_initiator_test.py" ] ||
    { echo "mooncake-peer-tests: no mooncake-wheel/tests/transfer_engine_{target,initiator_test}.py under $scratch" >&2; exit 2; }

venv_for() {
    case "$1" in
        ours|ours-tcp) echo "${KVWIRE_MOONCAKE_VENV:-$root/target/mooncake-venv}" ;;
        real) echo "$root/target/mooncake-real-venv" ;;
        *) echo "mooncake-peer-tests: unknown implementation $1 (real|ours|ours-tcp)" >&2; exit 2 ;;
    esac
}

# The rpc port among `pid`'s listening TCP ports: the one where the
# implementation under test finds a registered buffer.
find_rpc_port() {
    "$1" - "$2" <<'EOF'
import os, sys
pid = sys.argv[1]
inodes = set()
for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
ports = []
for path in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
    with open(path) as f:
        for line in f.read().splitlines()[1:]:
            c = line.split()
            if c[3] == "0A" and c[9] in inodes:
                ports.append(int(c[1].rsplit(":", 1)[1], 16))
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
for p in sorted(set(ports)):
    if e.get_first_buffer_address(f"127.0.0.1:{p}") != 0:
        print(p)
        break
EOF
}

summary() { grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)|no tests ran" "$1" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//' || true; }

for impl in "${impls[@]}"; do
    venv=$(venv_for "$impl")
    if [ "$impl" = real ] && [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q mooncake-transfer-engine-non-cuda numpy pytest
    fi
    if [ "$impl" = ours-tcp ]; then export KVWIRE_MOONCAKE_TRANSPORT=tcp; else unset KVWIRE_MOONCAKE_TRANSPORT; fi
    "$venv/bin/python" -c "import mooncake.engine" ||
        { echo "mooncake-peer-tests[$impl]: cannot import mooncake.engine from $venv" >&2; exit 2; }
    logs="$root/target/mooncake-peer-tests/$impl"
    rm -rf "$logs" && mkdir -p "$logs"
    base=$(( 20000 + RANDOM % 20000 ))
    cd "$tests"
    export PROTOCOL=tcp MC_METADATA_SERVER=P2PHANDSHAKE
    MC_MIN_RPC_PORT=$base MC_MAX_RPC_PORT=$(( base + 1 )) TARGET_SERVER_NAME=127.0.0.1:$base \
        "$venv/bin/python" -u transfer_engine_target.py > "$logs/target.log" 2>&1 &
    target=$!
    for _ in $(seq 1 200); do
        grep -q "Target server ready" "$logs/target.log" && break
        kill -0 $target 2>/dev/null || break
        sleep 0.1
    done
    port=""
    if kill -0 $target 2>/dev/null; then
        port=$(find_rpc_port "$venv/bin/python" $target 2>"$logs/find-port.log" | tail -1 || true)
    fi
    if [ -z "$port" ]; then
        echo "mooncake-peer-tests[$impl]: the target did not come up (see $logs/target.log)" >&2
        kill $target 2>/dev/null || true
        initiator="target did not start"
    else
        # shellcheck disable=SC2086
        TARGET_SERVER_NAME=127.0.0.1:$port timeout 900 "$venv/bin/python" -m pytest -p no:cacheprovider -rA \
            ${PYTEST_ARGS:-} transfer_engine_initiator_test.py > "$logs/initiator.log" 2>&1 || true
        kill $target 2>/dev/null || true
        initiator=$(summary "$logs/initiator.log")
    fi
    wait $target 2>/dev/null || true
    # shellcheck disable=SC2086
    timeout 300 "$venv/bin/python" -m pytest -p no:cacheprovider -rA ${PYTEST_ARGS:-} test_import_structure.py \
        > "$logs/import_structure.log" 2>&1 || true
    cd "$root"
    echo "mooncake-peer-tests[$impl]: initiator: ${initiator:-?}; import_structure: $(summary "$logs/import_structure.log") (logs: $logs)"
    grep -hE "^(PASSED|FAILED|SKIPPED|ERROR) " "$logs/initiator.log" "$logs/import_structure.log" 2>/dev/null | sed "s/^/  [$impl] /" || true
done
