# Sourced by the suite scripts: one way to say that a suite cannot run here.
#
# suite_unavailable NAME REQUIRE_VAR REASON: prints "NAME: skipped: REASON"
# and exits 0, or -- when $REQUIRE_VAR is 1 (CI sets every KVWIRE_REQUIRE_*)
# -- prints "NAME: error: REASON" on stderr and exits 125.
# suite_part_skipped NAME REQUIRE_VAR REASON: the same for one part of a
# suite ("NAME: skipped (part): REASON"), returning instead of exiting.
# scripts/test.sh collects these lines into its summary.

suite_unavailable() {
  if [ "${!2:-0}" = 1 ]; then
    echo "$1: error: $3 ($2=1)" >&2
    exit 125
  fi
  echo "$1: skipped: $3"
  exit 0
}

suite_part_skipped() {
  if [ "${!2:-0}" = 1 ]; then
    echo "$1: error: $3 ($2=1)" >&2
    exit 125
  fi
  echo "$1: skipped (part): $3"
}
