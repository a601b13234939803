#!/usr/bin/env bash
# kvwire's NIXL backend plugin (libplugin_KVWIRE.so) inside real NIXL 1.5.1:
#  1. builds the plugin (scripts/nixl-plugin-build.sh) and checks its
#     nixlBackendEngine vtable slot by slot against the wheel's
#     libplugin_POSIX.so;
#  2. a venv (target/nixl-plugin-venv) with the real `nixl==1.5.1` +
#     `nixl-cu12==1.5.1` wheels from PyPI (without their torch dependency:
#     NIXL's Python API needs only numpy), numpy and pytest;
#  3. NIXL_PLUGIN_DIR at target/nixl-plugin: the Python tests
#     (nixl-plugin/tests/test_real_nixl.py: plugin listed, options refused,
#     two-process WRITE+READ with notifications on shm and tcp, a killed
#     peer -> NIXL's remote-disconnect error, release in flight, loopback);
#  4. our C++ test against the wheel's libnixl.so (nixl-plugin/tests/
#     agent_test.cpp, NIXL's C++ agent API), on shm and tcp;
#  5. kvwire's NIXL contract suite, the vLLM- / SGLang-shaped flows and the dead-peer suite
#     (python/nixl-compat/tests) against real NIXL with backend KVWIRE
#     (KVWIRE_NIXL_REAL=1 makes their conftest use real NIXL's agent).
#
# Needs: cargo, g++, python3 with venv, PyPI. Without python3, g++ or PyPI it
# prints "nixl-plugin-tests: skipped: <reason>" (an error with
# KVWIRE_REQUIRE_PYTHON=1). Env: PYTEST_ARGS; KVWIRE_NIXL_PLUGIN_BUILD_ONLY=1
# builds the venv, the plugin and the C++ test binary and runs nothing (used
# by scripts/nixl-plugin-softroce-check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
. scripts/suite-lib.sh
name=nixl-plugin-tests
command -v python3 >/dev/null || suite_unavailable $name KVWIRE_REQUIRE_PYTHON "no python3 (apt-get install -y python3 python3-venv)"
command -v g++ >/dev/null || suite_unavailable $name KVWIRE_REQUIRE_PYTHON "no g++ (apt-get install -y g++)"
python3 -c "import venv, ensurepip" 2>/dev/null || suite_unavailable $name KVWIRE_REQUIRE_PYTHON "no python3-venv (apt-get install -y python3-venv)"

venv=$root/target/nixl-plugin-venv
if ! "$venv/bin/python" -c "import nixl._api, numpy, pytest, pytest_timeout" 2>/dev/null; then
    python3 -m venv "$venv"
    if ! "$venv/bin/pip" install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1" ||
        ! "$venv/bin/pip" install -q numpy pytest pytest-timeout; then
        suite_unavailable $name KVWIRE_REQUIRE_PYTHON "cannot install nixl==1.5.1 / nixl-cu12==1.5.1 from PyPI"
    fi
fi
libs=$("$venv/bin/python" - <<'PY'
import glob, os, nixl_cu12
d = os.path.join(os.path.dirname(os.path.dirname(nixl_cu12.__file__)), ".nixl_cu12.mesonpy.libs")
assert os.path.exists(os.path.join(d, "libnixl.so")), d
print(d)
PY
)

scripts/nixl-plugin-build.sh --check-abi "$libs"
export NIXL_PLUGIN_DIR=$root/target/nixl-plugin
g++ -std=c++20 -O1 -g -Wall -Wextra -Werror -Inixl-plugin nixl-plugin/tests/agent_test.cpp \
    -L"$libs" -l:libnixl.so -l:libnixl_build.so -Wl,-rpath,"$libs" -o "$NIXL_PLUGIN_DIR/agent_test"
[ "${KVWIRE_NIXL_PLUGIN_BUILD_ONLY:-0}" = 1 ] && exit 0

# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} nixl-plugin/tests

for t in shm tcp; do
    timeout 300 "$NIXL_PLUGIN_DIR/agent_test" "$t"
done
# kvwire's NIXL contract suite and the vLLM- / SGLang-shaped two-process
# flows against real NIXL + KVWIRE, on shm and tcp. Deselected: tests of the
# kvwire `nixl` package's own surface that real NIXL's core does not share
# (docs/NIXL.md lists them with the reason of each):
#   names_enums_and_errors, plugins_backends, telemetry_fields, utils_buffers,
#   metadata_listener: the package's extra enums, plugin names, telemetry
#     field, _utils and _listener;
#   bad_backend_init_params: real NIXL turns every backend init failure into
#     NIXL_ERR_BACKEND (test_real_nixl.py checks those refusals);
#   released_handles: real NIXL's binding posts a released handle (a
#     use-after-free inside nixlAgent::postXferReq, before any backend call).
deselect="names_enums_and_errors or plugins_backends or telemetry_fields or utils_buffers or metadata_listener"
deselect="$deselect or bad_backend_init_params or released_handles"
for t in shm tcp; do
    # shellcheck disable=SC2086
    KVWIRE_NIXL_REAL=1 KVWIRE_NIXL_TEST_BACKENDS=KVWIRE KVWIRE_TRANSPORT=$t NIXL_LOG_LEVEL=WARN \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} -k "not ($deselect)" \
        python/nixl-compat/tests/test_nixl_contract.py python/nixl-compat/tests/test_nixl_two_process.py \
        python/nixl-compat/tests/test_nixl_sglang.py python/nixl-compat/tests/test_nixl_dead_peer.py
done
echo "nixl-plugin-tests: passed"
