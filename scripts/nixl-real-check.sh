#!/usr/bin/env bash
# The dead-peer and telemetry-exporter suites (python/nixl-compat/tests/
# test_nixl_dead_peer.py, test_nixl_telemetry.py)
# against REAL NIXL: nixl-cu12==1.5.1 from PyPI (UCX, CPU-only with DRAM
# segments) in target/nixl-ref-venv, backend UCX, two processes on this host.
# The same tests run against kvwire's `nixl` in scripts/nixl-tests.sh, so
# their expectations are NIXL's, not ours.
#
# Needs python3 with venv and PyPI. Without them it prints
# "nixl-real-check: skipped: <reason>" and exits 0, unless
# KVWIRE_REQUIRE_PYTHON=1 (then it fails).
# Env: KVWIRE_NIXL_REF_VENV (default target/nixl-ref-venv), PYTEST_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
. scripts/suite-lib.sh
venv=${KVWIRE_NIXL_REF_VENV:-$root/target/nixl-ref-venv}
skip() { suite_unavailable nixl-real-check KVWIRE_REQUIRE_PYTHON "$1"; }
command -v python3 >/dev/null || skip "python3 not found (apt-get install -y python3 python3-venv)"
python3 -c "import venv, ensurepip" 2>/dev/null || skip "python3 venv/ensurepip missing (apt-get install python3-venv)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# --no-deps: nixl-cu12 declares torch but needs it only for tensor inputs.
if ! "$venv/bin/python" -c "import nixl_cu12._api" 2>/dev/null; then
    "$venv/bin/pip" install -q --no-deps nixl-cu12==1.5.1 || skip "pip could not install nixl-cu12==1.5.1 (no PyPI?)"
fi
"$venv/bin/pip" install -q numpy pytest pytest-timeout || skip "pip could not install numpy/pytest (no PyPI?)"
cd "$root/python/nixl-compat/tests"
# UCX over loopback TCP and shared memory; no RDMA device needed.
# shellcheck disable=SC2086
# -p hard_exit (nixl-plugin/tests/hard_exit.py): pytest ends with os._exit
# after its report, as NIXL's UCX plugin can segfault at interpreter exit
# (libnl's destructor), after every test passed.
KVWIRE_NIXL_TEST_MODULE=nixl_cu12 KVWIRE_NIXL_TEST_BACKENDS=UCX UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} \
    PYTHONPATH="$root/nixl-plugin/tests${PYTHONPATH:+:$PYTHONPATH}" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -p hard_exit --timeout=120 ${PYTEST_ARGS:-} \
    test_nixl_dead_peer.py test_nixl_telemetry.py
