#!/usr/bin/env bash
# Build the `kvwire` Python package (PyO3 + maturin, abi3) with pip and run
# its pytest suite (python/tests): two-process shm transfers, error paths,
# TransferReqData JSON.
#
# Needs: python3 with pip and venv, cargo. On a fresh Debian machine:
#   apt-get install -y python3 python3-pip python3-venv
# From PyPI (into a venv under target/, ignored by git): maturin, numpy, pytest.
#
# Env: KVWIRE_VENV (default target/python-venv), PYTEST_ARGS (extra args).
# Exits non-zero on any failure, including "no tests collected". Without
# python3/venv/pip, or when PyPI cannot be reached, it prints
# "python-tests: skipped: <reason>" and exits 0, unless KVWIRE_REQUIRE_PYTHON=1.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
. scripts/suite-lib.sh
venv=${KVWIRE_VENV:-$root/target/python-venv}
hint="apt-get install -y python3 python3-pip python3-venv"
command -v python3 >/dev/null || suite_unavailable python-tests KVWIRE_REQUIRE_PYTHON "no python3 ($hint)"
python3 -c 'import venv, ensurepip' 2>/dev/null ||
    suite_unavailable python-tests KVWIRE_REQUIRE_PYTHON "python3 has no venv/ensurepip ($hint)"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"  # the maturin build backend runs `maturin` from PATH
if ! "$venv/bin/python" -m pip install -q "maturin>=1.5,<2" numpy pytest; then
    suite_unavailable python-tests KVWIRE_REQUIRE_PYTHON "pip could not install maturin, numpy, pytest (no PyPI access?)"
fi

start=$(date +%s)
# --no-build-isolation: use the maturin just installed instead of fetching another.
"$venv/bin/python" -m pip install -q --no-build-isolation --force-reinstall --no-deps "$root/python"
echo "python-tests: pip install ./python took $(( $(date +%s) - start )) s"

# Run from outside the source tree so the installed wheel is what is tested.
cd "$root/python/tests"
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} .
