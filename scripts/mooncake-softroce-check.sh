#!/usr/bin/env bash
# The SGLang-shaped PD flow, the vLLM MooncakeConnector subset and the
# two-process tests of kvwire's `mooncake` package (python/mooncake-compat/tests:
# test_mc_engines.py, test_mc_two_process.py) on the verbs transport, in the
# Soft-RoCE guest of scripts/softroce-vm.sh, plus the protocol rule
# (protocol="rdma" picks verbs where an RDMA port is ACTIVE). This process's
# engines use rxe0 (device_name), the child peer's rxe1.
#
# Python is not in the guest, so the venv's interpreter is staged into the
# shared directory as scripts/nixl-softroce-check.sh does: the base
# interpreter binary, its standard library (PYTHONHOME), the venv's
# site-packages with the built kvwire and mooncake packages (PYTHONPATH), and
# the shared libraries of every ELF file there (LD_LIBRARY_PATH). Nothing is
# installed in the guest.
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
command -v python3 >/dev/null || suite_unavailable "$name" KVWIRE_REQUIRE_PYTHON "python3 not found"
python3 -c "import venv, ensurepip" 2>/dev/null ||
  suite_unavailable "$name" KVWIRE_REQUIRE_PYTHON "python3 venv/ensurepip missing (apt-get install python3-venv)"
cd "$repo"
venv=${KVWIRE_MOONCAKE_VENV:-$repo/target/mooncake-venv}
KVWIRE_MOONCAKE_VENV=$venv KVWIRE_MOONCAKE_BUILD_ONLY=1 bash scripts/mooncake-tests.sh
py=$venv/bin/python
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-900}

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-mooncake-softroce.XXXXXX")
trap 'rm -rf "$stage"' EXIT
# Where the interpreter's parts are: base binary, stdlib, lib-dynload, venv site-packages.
read -r base stdlib dynload site ver < <("$py" - <<'PY'
import os, sys, sysconfig
dyn = next((p for p in sys.path if p.endswith("lib-dynload")), "")
print(os.path.realpath(sys._base_executable), os.path.dirname(os.__file__), dyn or "-",
      sysconfig.get_paths()["purelib"], "python%d.%d" % sys.version_info[:2])
PY
)
cp -L "$base" "$stage/python3"
mkdir -p "$stage/py/lib/$ver" "$stage/site" "$stage/lib"
tar -C "$stdlib" -cf - --exclude=./test --exclude=./idlelib --exclude=./tkinter --exclude=./turtledemo \
  --exclude=./ensurepip --exclude=./site-packages --exclude=./dist-packages --exclude=./lib2to3 \
  --exclude='./config-*' . | tar -C "$stage/py/lib/$ver" -xf -
if [ "$dynload" != - ] && [ ! -d "$stage/py/lib/$ver/lib-dynload" ]; then
  cp -rL "$dynload" "$stage/py/lib/$ver/lib-dynload"
fi
tar -C "$site" -cf - --exclude=./pip --exclude='./pip-*' --exclude=./setuptools --exclude='./setuptools-*' \
  --exclude=./_distutils_hack --exclude='./maturin*' . | tar -C "$stage/site" -xf -
cp -r python/mooncake-compat/tests "$stage/tests"
find "$stage" -name __pycache__ -path '*/tests/*' -prune -exec rm -rf {} +
# The shared libraries of the interpreter and of every extension module.
find "$stage" -type f \( -name '*.so' -o -name '*.so.*' -o -name python3 \) -print0 |
  xargs -0 ldd 2>/dev/null | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case $lib in "$stage"/*) continue;; esac
    [ -e "$stage/lib/${lib##*/}" ] || cp -L "$lib" "$stage/lib/"
  done
echo "$name: staged $(du -sm "$stage" | cut -f1) MB (python $ver from $base)"

guest_cmd="cd /host && export PYTHONHOME=/host/py PYTHONPATH=/host/site LD_LIBRARY_PATH=/host/lib \
PYTHONDONTWRITEBYTECODE=1 KVWIRE_MOONCAKE_TEST_DEVICE=rxe0 KVWIRE_MOONCAKE_TEST_PEER_DEVICE=rxe1 \
KVWIRE_MOONCAKE_TEST_TRANSPORTS=verbs && cd tests && \
/host/python3 -c 'import mooncake.engine, kvwire; print(\"python in the guest:\", kvwire.__file__)' && \
/host/python3 -m pytest -v --color=no -p no:cacheprovider --timeout=600 ${PYTEST_ARGS:-} test_mc_engines.py test_mc_two_process.py"
flock /tmp/kvwire-softroce.lock bash "$softroce_vm" run "$stage" "$guest_cmd"
