#!/usr/bin/env bash
# The vLLM-shaped flow of kvwire's `nixl` package (python/nixl-compat/tests,
# test_vllm_shaped_pull_flow) on the verbs transport, in the Soft-RoCE guest
# of scripts/softroce-vm.sh: backend KVWIRE_VERBS, and UCX (the alias picks
# verbs because the guest's rxe ports are ACTIVE). This process (decode) uses
# rxe0, its child peer (prefill) rxe1, chosen through UCX_NET_DEVICES as a
# UCX user would.
#
# Python is not in the guest: the venv's interpreter, standard library,
# site-packages and shared libraries are staged into the shared directory
# (softroce_stage_python in scripts/softroce-lib.sh).
#
# Builds with scripts/nixl-tests.sh (KVWIRE_NIXL_BUILD_ONLY=1; venv
# target/nixl-venv). One-time set-up: `bash scripts/softroce-vm.sh install`.
# Where the guest cannot run here it prints "nixl-softroce-check: skipped:
# <reason>" and exits 0; with KVWIRE_REQUIRE_SOFTROCE=1 (CI) it fails (125).
# Guest runs are serialized with other users of the guest by
# flock /tmp/kvwire-softroce.lock.
#
# Env: SOFTROCE_TIMEOUT (default 900), PYTEST_ARGS (extra pytest args).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=nixl-softroce-check
. "$repo/scripts/softroce-lib.sh"
softroce_preflight "$name" "$repo"
softroce_python_preflight "$name"
cd "$repo"
venv=${KVWIRE_NIXL_VENV:-$repo/target/nixl-venv}
KVWIRE_NIXL_VENV=$venv KVWIRE_NIXL_BUILD_ONLY=1 bash scripts/nixl-tests.sh
py=$venv/bin/python
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-900}

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-nixl-softroce.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp -r python/nixl-compat/tests "$stage/tests"
echo "$name: $(softroce_stage_python "$py" "$stage")"

softroce_run_staged_python "$stage" \
    "UCX_NET_DEVICES=rxe0 KVWIRE_NIXL_TEST_PEER_DEVICE=rxe1 KVWIRE_NIXL_TEST_BACKENDS=KVWIRE_VERBS,UCX KVWIRE_NIXL_TEST_EXPECT_TRANSPORT=verbs" \
    "cd tests && /host/python3 -c 'import nixl._api, kvwire; print(\"python in the guest:\", kvwire.__file__)' && \
/host/python3 -m pytest -v --color=no -p no:cacheprovider --timeout=600 -k \"vllm_shaped or sglang_shaped_flow\" ${PYTEST_ARGS:-} test_nixl_two_process.py test_nixl_sglang.py"
