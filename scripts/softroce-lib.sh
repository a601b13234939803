# Sourced by scripts/softroce-*.sh and cuda-softroce-check.sh: decide whether
# the Soft-RoCE guest (scripts/softroce-vm.sh) can run here.
#
# softroce_preflight NAME REPO: sets $softroce_vm to the harness. When the
# guest cannot run here (not root, no qemu/busybox/perftest, guest not
# prepared) it prints "NAME: skipped: <reason>" with the one command that
# installs what is missing and exits 0 -- unless KVWIRE_REQUIRE_SOFTROCE=1
# (CI), where it prints "NAME: error: <reason>" and exits 125.
. "$(dirname "${BASH_SOURCE[0]}")/suite-lib.sh"

softroce_unavailable() { # name reason
  suite_unavailable "$1" KVWIRE_REQUIRE_SOFTROCE "$2"
}

softroce_preflight() { # name repo
  local name=$1 repo=$2 why
  softroce_vm=$repo/scripts/softroce-vm.sh
  why=$(bash "$softroce_vm" check) || softroce_unavailable "$name" "$why"
}

# softroce_stage_python PY STAGE: stage the interpreter of venv python PY into
# STAGE for the guest, which has no Python: the base interpreter binary
# (STAGE/python3), its standard library (STAGE/py, for PYTHONHOME=/host/py),
# the venv's site-packages without pip/setuptools (STAGE/site, for
# PYTHONPATH=/host/site) and the shared libraries of every ELF file staged so
# far (STAGE/lib, for LD_LIBRARY_PATH=/host/lib). Stage other native files
# (plugins, test binaries) before calling it so their libraries come along.
# Nothing is installed in the guest.
softroce_stage_python() { # py stage
  local py=$1 stage=$2 base stdlib dynload site ver
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
  find "$stage" -name __pycache__ -prune -exec rm -rf {} +
  # The shared libraries of the interpreter and of every extension module.
  find "$stage" -type f \( -name '*.so' -o -name '*.so.*' -o -name python3 -o -perm -u+x \) -print0 |
    xargs -0 ldd 2>/dev/null | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
      case $lib in "$stage"/*) continue;; esac
      [ -e "$stage/lib/${lib##*/}" ] || cp -L "$lib" "$stage/lib/"
    done
  echo "staged $(du -sm "$stage" | cut -f1) MB (python $ver from $base)"
}

# softroce_run_staged_python STAGE ENV CMDS: run shell command line CMDS in
# the guest, from /host (STAGE), with the Python staged there by
# softroce_stage_python on its paths (PYTHONHOME, PYTHONPATH,
# LD_LIBRARY_PATH; no bytecode written) and ENV ("VAR=value ..." words)
# exported; serialized with the guest's other users by
# flock /tmp/kvwire-softroce.lock. Returns the guest command's status.
softroce_run_staged_python() { # stage env cmds
  flock /tmp/kvwire-softroce.lock bash "$softroce_vm" run "$1" \
    "cd /host && export PYTHONHOME=/host/py PYTHONPATH=/host/site LD_LIBRARY_PATH=/host/lib PYTHONDONTWRITEBYTECODE=1 $2 && $3"
}

# softroce_python_preflight NAME: python3 with venv is needed here to build
# what the guest runs ("NAME: skipped: ..." or, with KVWIRE_REQUIRE_PYTHON=1,
# an error, when it is missing).
softroce_python_preflight() { # name
  command -v python3 >/dev/null || suite_unavailable "$1" KVWIRE_REQUIRE_PYTHON "python3 not found"
  python3 -c "import venv, ensurepip" 2>/dev/null ||
    suite_unavailable "$1" KVWIRE_REQUIRE_PYTHON "python3 venv/ensurepip missing (apt-get install python3-venv)"
}
