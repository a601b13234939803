#!/usr/bin/env bash
# Build kvwire's Python extension and the `mooncake` compatibility package
# (python/mooncake-compat, distribution `mooncake-kvwire`), install both into
# a venv under target/, and run the Mooncake contract, two-process, kill /
# restart, and SGLang- and vLLM-shaped flow tests (python/mooncake-compat/tests)
# on the shm and tcp transports, and etcd:// sessions where the etcd binary
# is installed (apt-get install -y etcd-server; else those tests skip).
#
# Needs python3 with venv and cargo. Without python3/venv it prints
# `mooncake-tests: skipped: <reason>` and exits 0, unless KVWIRE_REQUIRE_PYTHON=1 (then it fails).
# From PyPI (into the venv, ignored by git): maturin, numpy, pytest, pytest-timeout.
#
# Env: KVWIRE_MOONCAKE_VENV (default target/mooncake-venv), PYTEST_ARGS (extra args),
# KVWIRE_MOONCAKE_TEST_TRANSPORTS (default shm,tcp; e.g. verbs in a Soft-RoCE guest),
# KVWIRE_MOONCAKE_BUILD_ONLY=1 (build and install, run no tests; used by
# scripts/mooncake-peer-tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${KVWIRE_MOONCAKE_VENV:-$root/target/mooncake-venv}
. scripts/suite-lib.sh
skip() { suite_unavailable mooncake-tests KVWIRE_REQUIRE_PYTHON "$1"; }
command -v python3 >/dev/null || skip "python3 not found (apt-get install -y python3 python3-venv)"
python3 -c "import venv, ensurepip" 2>/dev/null || skip "python3 venv/ensurepip missing (apt-get install python3-venv)"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"
if ! "$venv/bin/python" -m pip install -q "maturin>=1.5,<2" numpy pytest pytest-timeout; then
    skip "pip could not install maturin, numpy, pytest, pytest-timeout (no PyPI access?)"
fi

start=$(date +%s)
# The extension, built in place (python/target keeps the build between runs).
wheels="$root/target/mooncake-wheels"
rm -rf "$wheels"
(cd "$root/python" && CARGO_TARGET_DIR="$root/python/target" maturin build --release -q -o "$wheels")
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$wheels"/kvwire-*.whl
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$root/python/mooncake-compat"
echo "mooncake-tests: build and install took $(( $(date +%s) - start )) s"
[ "${KVWIRE_MOONCAKE_BUILD_ONLY:-0}" = 1 ] && exit 0

# From outside the source tree, so the installed packages are what is tested.
cd "$root/python/mooncake-compat/tests"
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=120 ${PYTEST_ARGS:-} .
