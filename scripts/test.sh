#!/usr/bin/env bash
# The project's test command (README, second command; .ci/run calls it).
# Lints, every Rust test and doc-test, then the suites that need hardware or
# tools: each runs where what it needs exists and says "skipped: <reason>"
# elsewhere (a failure instead where KVWIRE_REQUIRE_* is set, as in CI).
# Ends with a summary: what ran, what was ignored or skipped and why, each
# step's wall time and the total.
# Exit status: 0 when nothing failed.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-test.XXXXXX")
trap 'rm -rf "$logs"' EXIT
ran=() skipped=() failed=()

# step NAME CMD...: run CMD with its output shown and logged; record the result.
step() {
  local name=$1 log="$logs/${1//[^A-Za-z0-9_.-]/_}.log" rc
  shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local took="$((SECONDS - t0)) s"
  local why part
  # only the suite's own verdict ("NAME: skipped: ..."), not its tests' lines
  why=$(grep -F "$name: skipped: " "$log" | grep "^$name: " | tail -1 | sed "s/^$name: skipped: //")
  part=$(grep -F "$name: skipped (part): " "$log" | grep "^$name: " | sed "s/^$name: skipped (part): //" | paste -sd';' -)
  if [ "$rc" != 0 ]; then
    failed+=("$name (exit $rc, $took)")
  elif [ -n "$why" ]; then
    skipped+=("$name: $why ($took)")
  else
    ran+=("$name, $took${part:+ (skipped part: $part)}")
  fi
  return "$rc"
}

# libtest's totals over a log: "P passed, F failed, I ignored" and the
# ignored tests counted by reason.
libtest_totals() {
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i-1); if ($(i) ~ /^failed/) f += $(i-1); if ($(i) ~ /^ignored/) g += $(i-1) } }
       END { printf "%d passed, %d failed, %d ignored", p, f, g }' "$1"
}
ignored_reasons() {
  sed -n -E 's/^test .* \.\.\. ignored, (.*)$/\1/p' "$1" | sort | uniq -c | sort -rn |
    awk '{ n = $1; $1 = ""; printf "  ignored: %d test(s) by cargo test: %s\n", n, substr($0, 2) }'
}

summary() {
  echo
  echo "=== summary"
  local l
  for l in "${ran[@]+"${ran[@]}"}"; do echo "  ran:     $l"; done
  [ -s "$logs/ignored.txt" ] && cat "$logs/ignored.txt"
  for l in "${skipped[@]+"${skipped[@]}"}"; do echo "  skipped: $l"; done
  for l in "${failed[@]+"${failed[@]}"}"; do echo "  FAILED:  $l"; done
  echo "  total:   $((SECONDS / 60)) min $((SECONDS % 60)) s"
  if [ ${#failed[@]} -eq 0 ]; then echo "overall: PASS"; else echo "overall: FAIL"; fi
}

# Lints and the build: nothing after them means much if they fail.
lint_ok=1
step fmt cargo fmt --all --check || lint_ok=0
[ $lint_ok = 1 ] && { step clippy cargo clippy --workspace --all-targets -- -D warnings || lint_ok=0; }
[ $lint_ok = 1 ] && { step "clippy (no default features)" cargo clippy -p kvwire --all-targets --no-default-features -- -D warnings || lint_ok=0; }
[ $lint_ok = 1 ] && { step build cargo build --release --bins || lint_ok=0; }
# Layering: no import circle and no upward import inside the core or the CLI
# (docs/ARCHITECTURE.md).
[ $lint_ok = 1 ] && { step "import graph" sh -c 'python3 scripts/import-graph.py src --layers accept,metrics,sidechannel,transport,engine,cuda,kv,connector && python3 scripts/import-graph.py crates/kvwire-cli/src' || lint_ok=0; }
if [ $lint_ok = 0 ]; then summary; exit 1; fi

# Release: the replay and bench tests move gigabytes and verify every byte.
# Tests that need hardware are #[ignore]d with their reason; the hardware
# suites below run them with --include-ignored.
if step "cargo test" cargo test --release --workspace --exclude kvwire-python --all-targets; then
  ran[${#ran[@]}-1]="cargo test --workspace --all-targets (less the Python crate, tested by its suites): $(libtest_totals "$logs/cargo_test.log")"
fi
ignored_reasons "$logs/cargo_test.log" >"$logs/ignored.txt"
# The etcd tests are #[ignore]d ("needs etcd"); run them where etcd exists.
if [ -n "${KVWIRE_ETCD:-}" ] || command -v etcd >/dev/null; then
  if step "etcd tests" cargo test --release -p kvwire-cli --test discovery_etcd -- --ignored --skip child_publisher; then
    ran[${#ran[@]}-1]="etcd tests (crates/kvwire-cli/tests/discovery_etcd.rs --ignored): $(libtest_totals "$logs/etcd_tests.log")"
  fi
elif [ "${KVWIRE_REQUIRE_ETCD:-0}" = 1 ]; then
  failed+=("crates/kvwire-cli/tests/discovery_etcd.rs: no etcd and KVWIRE_REQUIRE_ETCD=1")
else
  skipped+=("crates/kvwire-cli/tests/discovery_etcd.rs: no etcd (apt-get install -y etcd-server); its tests are reported as ignored")
fi
if step "doc-tests" cargo test --release --workspace --exclude kvwire-python --doc; then
  ran[${#ran[@]}-1]="doc-tests (lib docs and README): $(libtest_totals "$logs/doc-tests.log")"
fi

# The cuda layer against a fake libcuda (host memory as "VRAM"): our side of
# every driver call, without a GPU. The real GPU check is scripts/gpu-check.sh.
if command -v gcc >/dev/null; then
  step "gpu-check (fake driver)" env FAKE=1 bash scripts/gpu-check.sh
elif [ "${KVWIRE_REQUIRE_CC:-0}" = 1 ]; then
  failed+=("gpu-check (fake driver): no gcc and KVWIRE_REQUIRE_CC=1")
else
  skipped+=("gpu-check (fake driver): no gcc (apt-get install -y gcc)")
fi
skipped+=("gpu-check (real GPU): not part of this command; run scripts/gpu-check.sh on a machine with an NVIDIA GPU")

for suite in softroce-tests cuda-softroce-check netns-tests python-tests nixl-tests nixl-real-check nixl-softroce-check mooncake-tests mooncake-softroce-check capi-tests nixl-plugin-tests nixl-plugin-softroce-check; do
  [ -f "scripts/$suite.sh" ] && step "$suite" bash "scripts/$suite.sh"
done
summary
[ ${#failed[@]} -eq 0 ]
