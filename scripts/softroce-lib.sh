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
