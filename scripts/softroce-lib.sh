# Shared by scripts/softroce-*.sh (sourced): find the Soft-RoCE harness
# (../shared/softroce, see its README) and decide whether it can run here.
#
# softroce_preflight: sets $softroce to the harness directory. When the
# harness cannot run (not found, not root, no qemu or host tools, no prepared
# cache), it prints "<name>: skipped: <reason>" and exits 0 -- unless
# KVWIRE_REQUIRE_SOFTROCE=1 (CI), where it prints "<name>: error: <reason>"
# and exits 125 (a missing guest is then a failure, not a skip).

softroce_unavailable() { # name reason
  if [ "${KVWIRE_REQUIRE_SOFTROCE:-0}" = 1 ]; then
    echo "$1: error: $2 (KVWIRE_REQUIRE_SOFTROCE=1)" >&2
    exit 125
  fi
  echo "$1: skipped: $2"
  exit 0
}

softroce_preflight() { # name repo
  local name=$1 repo=$2 t cache
  softroce=${SOFTROCE_DIR:-$repo/../shared/softroce}
  [ -x "$softroce/run-in-softroce-vm.sh" ] || softroce=/work/shared/softroce
  [ -x "$softroce/run-in-softroce-vm.sh" ] ||
    softroce_unavailable "$name" "no Soft-RoCE harness (set SOFTROCE_DIR to ../shared/softroce)"
  [ "$(id -u)" = 0 ] || softroce_unavailable "$name" "not root (the Soft-RoCE harness needs root)"
  for t in qemu-system-x86_64 busybox cpio ib_write_bw; do
    command -v "$t" >/dev/null ||
      softroce_unavailable "$name" "no $t on the host (run $softroce/run-in-softroce-vm.sh --install-deps --prepare)"
  done
  cache=${SOFTROCE_CACHE:-/var/tmp/softroce-cache}
  compgen -G "$cache/linux-image-*/.done" >/dev/null ||
    softroce_unavailable "$name" "no prepared guest in $cache (run $softroce/run-in-softroce-vm.sh --prepare)"
}
