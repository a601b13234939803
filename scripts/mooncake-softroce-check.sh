#!/usr/bin/env bash
# The SGLang-shaped PD flow, the vLLM MooncakeConnector subset and the
# two-process tests of kvwire's `mooncake` package (python/mooncake-compat/tests:
# test_mc_engines.py, test_mc_two_process.py) on the verbs transport, in the
# Soft-RoCE guest of scripts/softroce-vm.sh, plus the protocol rule
# (protocol="rdma" picks verbs where an RDMA port is ACTIVE). This process's
# engines use rxe0 (device_name), the child peer's rxe1.
#
# Python is not in the guest: the venv's interpreter, standard library,
# site-packages and shared libraries are staged into the shared directory
# (softroce_stage_python in scripts/softroce-lib.sh). Nothing is installed
# in the guest.
#
# Builds with scripts/mooncake-tests.sh (KVWIRE_MOONCAKE_BUILD_ONLY=1; venv
# target/mooncake-venv). One-time set-up: `bash scripts/softroce-vm.sh install`.
# Where the guest cannot run here it prints "mooncake-softroce-check: skipped:
# <reason>" and exits 0; with KVWIRE_REQUIRE_SOFTROCE=1 (CI) it fails (125).
# Guest runs are serialized with other users of the guest by
# flock /tmp/kvwire-softroce.lock.
#
# Env: SOFTROCE_TIMEOUT (default 900), PYTEST_ARGS (extra pytest args).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=mooncake-softroce-check
. "$repo/scripts/softroce-lib.sh"
softroce_preflight "$name" "$repo"
softroce_python_preflight "$name"
cd "$repo"
venv=${KVWIRE_MOONCAKE_VENV:-$repo/target/mooncake-venv}
KVWIRE_MOONCAKE_VENV=$venv KVWIRE_MOONCAKE_BUILD_ONLY=1 bash scripts/mooncake-tests.sh
py=$venv/bin/python
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-900}

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-mooncake-softroce.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp -r python/mooncake-compat/tests "$stage/tests"
echo "$name: $(softroce_stage_python "$py" "$stage")"

softroce_run_staged_python "$stage" \
    "KVWIRE_MOONCAKE_TEST_DEVICE=rxe0 KVWIRE_MOONCAKE_TEST_PEER_DEVICE=rxe1 KVWIRE_MOONCAKE_TEST_TRANSPORTS=verbs" \
    "cd tests && /host/python3 -c 'import mooncake.engine, kvwire; print(\"python in the guest:\", kvwire.__file__)' && \
/host/python3 -m pytest -v --color=no -p no:cacheprovider --timeout=600 ${PYTEST_ARGS:-} test_mc_engines.py test_mc_two_process.py"
