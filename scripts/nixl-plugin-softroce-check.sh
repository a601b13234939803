#!/usr/bin/env bash
# kvwire's NIXL backend plugin inside real NIXL 1.5.1 on the verbs transport,
# in the Soft-RoCE guest of scripts/softroce-vm.sh (issue 26):
#  1. our C++ test against the wheel's libnixl.so (nixl-plugin/tests/
#     agent_test.cpp) with kvwire_transport=verbs, agent a on rxe0 and b on
#     rxe1 (NIXL's `device_list`);
#  2. nixl-plugin/tests/test_real_nixl.py with KVWIRE_NIXL_PLUGIN_TRANSPORTS=verbs
#     (two processes, WRITE + READ with notifications, a killed peer ->
#     NIXL_ERR_REMOTE_DISCONNECT, release in flight), this process on rxe0,
#     the child on rxe1;
#  3. the vLLM- and SGLang-shaped two-process flows of python/nixl-compat/tests
#     against real NIXL with backend KVWIRE and KVWIRE_TRANSPORT=verbs (both
#     processes take the first ACTIVE port, rxe0: rxe answers on one device).
#
# Builds with scripts/nixl-plugin-tests.sh (KVWIRE_NIXL_PLUGIN_BUILD_ONLY=1;
# venv target/nixl-plugin-venv with the real nixl / nixl-cu12 1.5.1 wheels).
# Python is not in the guest: softroce_stage_python (scripts/softroce-lib.sh)
# stages the venv's interpreter, site-packages (real NIXL) and libraries.
# One-time set-up: `bash scripts/softroce-vm.sh install`. Where the guest
# cannot run here it prints "nixl-plugin-softroce-check: skipped: <reason>"
# and exits 0; with KVWIRE_REQUIRE_SOFTROCE=1 (CI) it fails (125). Guest runs
# are serialized by flock /tmp/kvwire-softroce.lock.
#
# Env: SOFTROCE_TIMEOUT (default 900), PYTEST_ARGS (extra pytest args).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=nixl-plugin-softroce-check
. "$repo/scripts/softroce-lib.sh"
softroce_preflight "$name" "$repo"
softroce_python_preflight "$name"
cd "$repo"
KVWIRE_NIXL_PLUGIN_BUILD_ONLY=1 bash scripts/nixl-plugin-tests.sh
py=$repo/target/nixl-plugin-venv/bin/python
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-900}

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-nixl-plugin-softroce.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/plugin" "$stage/tests"
cp target/nixl-plugin/libplugin_KVWIRE.so target/nixl-plugin/agent_test "$stage/plugin/"
cp -r nixl-plugin/tests "$stage/tests/plugin"
cp -r python/nixl-compat/tests "$stage/tests/compat"
echo "$name: $(softroce_stage_python "$py" "$stage")"

softroce_run_staged_python "$stage" "NIXL_PLUGIN_DIR=/host/plugin NIXL_LOG_LEVEL=WARN KVWIRE_REQUIRE_RDMA=1" \
"echo '== agent_test verbs rxe0 rxe1' && timeout 300 /host/plugin/agent_test verbs rxe0 rxe1 && \
echo '== test_real_nixl.py on verbs' && cd /host/tests/plugin && \
KVWIRE_NIXL_PLUGIN_TRANSPORTS=verbs KVWIRE_NIXL_PLUGIN_DEVICE=rxe0 KVWIRE_NIXL_PLUGIN_PEER_DEVICE=rxe1 \
/host/python3 -m pytest -v --color=no -p no:cacheprovider --timeout=600 ${PYTEST_ARGS:-} test_real_nixl.py && \
echo '== nixl-compat flows, real NIXL + KVWIRE on verbs' && cd /host/tests/compat && \
KVWIRE_NIXL_REAL=1 KVWIRE_NIXL_TEST_BACKENDS=KVWIRE KVWIRE_TRANSPORT=verbs \
/host/python3 -m pytest -v --color=no -p no:cacheprovider --timeout=600 -k \"vllm_shaped or sglang_shaped_flow\" \
${PYTEST_ARGS:-} test_nixl_two_process.py test_nixl_sglang.py && echo 'nixl-plugin-softroce-check: passed'"
