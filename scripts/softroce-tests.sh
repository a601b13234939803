#!/usr/bin/env bash
# Build the verbs test binaries (tests/verbs_*.rs) on the host and run them in
# the Soft-RoCE guest (rxe0 <-> rxe1) of scripts/softroce-vm.sh, with
# --include-ignored: there the tests marked as needing an RDMA device run.
#
#   scripts/softroce-tests.sh [test-binary args, e.g. a test name filter]
#
# One-time set-up on a new machine (root, downloads ~460 MB):
#   bash scripts/softroce-vm.sh install
# Exit status: that of the tests (124/125: guest timeout / VM failure).
# Where the harness cannot run here (not root, no qemu, no prepared cache) it
# prints "softroce-tests: skipped: <reason>" and exits 0; with
# KVWIRE_REQUIRE_SOFTROCE=1 (CI) that is an error instead (exit 125).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$repo/scripts/softroce-lib.sh"
softroce_preflight softroce-tests "$repo"
cd "$repo"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-900}
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-softroce.XXXXXX")
trap 'rm -rf "$stage"' EXIT
# Only the verbs test binaries (cargo also lists the kvwire binary).
cargo test -p kvwire --no-run --message-format=json --test verbs_transport --test verbs_layer --test verbs_kv --test verbs_edge --test verbs_fence \
  --test transport_contract |
  sed -n 's/.*"executable":"\([^"]*\/\(verbs_\|transport_contract\)[^"]*\)".*/\1/p' | sort -u > "$stage/.list"
# The kvwire command (crate kvwire-cli) for the replay below.
cargo build -q -p kvwire-cli --bin kvwire
[ -s "$stage/.list" ] || { echo "softroce-tests: no verbs test binaries built" >&2; exit 125; }
{
  echo '#!/bin/sh'
  echo 'rc=0'
  # In the guest a test that finds no RDMA device fails instead of passing
  # after printing "skipped" (tests/verbs_util).
  echo 'export KVWIRE_REQUIRE_RDMA=1'
  while read -r exe; do
    b=$(basename "$exe"); cp "$exe" "$stage/$b"
    # the contract suite: its verbs half (shm and tcp run in scripts/test.sh)
    filter=""; case "$b" in transport_contract*) filter="verbs::" ;; esac
    printf 'echo "### %s"; ./%s %s --include-ignored --test-threads=1 --nocapture "$@"; r=$?; [ $r = 0 ] || { echo "### %s exited $r"; [ $rc = 0 ] && rc=$r; }\n' "$b" "$b" "$filter" "$b"
  done < "$stage/.list"
  # The main job over verbs: `kvwire replay` (prefill on rxe1, its decode
  # child on rxe0) of a 4-request trace small enough for the guest (tokens
  # of the first Mooncake requests, scaled down), every byte verified.
  cp "$CARGO_TARGET_DIR/debug/kvwire" "$stage/kvwire"
  printf '%s\n' \
    '{"timestamp": 0, "input_length": 1800, "output_length": 40, "hash_ids": [0, 1, 2, 3]}' \
    '{"timestamp": 5, "input_length": 900, "output_length": 20, "hash_ids": [4, 5]}' \
    '{"timestamp": 9, "input_length": 2600, "output_length": 10, "hash_ids": [0, 1, 2, 3, 6, 7]}' \
    '{"timestamp": 12, "input_length": 300, "output_length": 5, "hash_ids": [8]}' > "$stage/trace.jsonl"
  echo 'echo "### kvwire replay --transport verbs (4 requests)"'
  echo './kvwire replay --trace trace.jsonl --transport verbs --option device=rxe1 --decode-option device=rxe0 \'
  echo '  --option gid_index=$SOFTROCE_GID_IDX --decode-option gid_index=$SOFTROCE_GID_IDX \'
  echo '  --decode-pages 64 --prefill-pages 64; r=$?; [ $r = 0 ] || { echo "### replay exited $r"; [ $rc = 0 ] && rc=$r; }'
  echo 'exit $rc'
} > "$stage/run-all.sh"
chmod +x "$stage/run-all.sh"
bash "$softroce_vm" run "$stage" ./run-all.sh "$@"
