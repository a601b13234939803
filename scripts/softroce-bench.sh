#!/usr/bin/env bash
# kvwire's verbs transport next to perftest (ib_write_bw / ib_read_bw) in one
# Soft-RoCE guest boot (scripts/softroce-vm.sh): same device pair
# (server/target rxe0 at 192.0.2.1, client/initiator rxe1), GID index, message
# size, QP count and about the same bytes; prints every raw result and the
# kvwire/perftest bandwidth ratio per (op, size).
#
#   scripts/softroce-bench.sh            # 2 rounds, 4 KiB and 64 KiB, WRITE and READ
#   ROUNDS=3 MB=16 QPS=1 scripts/softroce-bench.sh
#   KV_ARGS="--option post_bytes=0" scripts/softroce-bench.sh  # extra kvwire options
#   PIPELINE=2 scripts/softroce-bench.sh # 2 kvwire transfers in flight, a stream as perftest's
#   COMPARE_BIN=../old/target/release/kvwire ROUNDS=6 scripts/softroce-bench.sh
#                                        # A/B: that build runs right after ours in every round
#   COMPARE_BIN=target/release/kvwire COMPARE_ARGS="--option post_bytes=0" scripts/softroce-bench.sh
#                                        # A/B of an option on one build (COMPARE_ARGS: the second run only)
#
# The guest moves only 20-60 MB/s (CPU emulation): totals are a few MB per run
# (MB, default 8) and only the ratio means anything. Each round runs perftest
# then kvwire (then COMPARE_BIN's kvwire) for every case; printed are the best
# of the rounds and the median of the per-round ratios (each against the
# perftest run just before it: the guest's speed drifts by 2x between runs,
# so only neighbours compare).
# kvwire uses --scatter so each block stays one work request (contiguous
# blocks would coalesce into one large WR, unlike perftest's -s messages).
# KV_ARGS: extra `kvwire bench` arguments (default none: kvwire's stock
# settings). The guest has 2 emulated vCPUs that also run the software NIC;
# on rxe (and siw) kvwire ends a post_send batch at 64 KiB (post_bytes), so
# the kernel requester that each post_send runs works on the posting thread's
# CPU (docs/PERFORMANCE.md). Earlier tuning, for comparison:
#   KV_ARGS="--option idle_yields=0 --target-option idle_yields=0 --poll-wait --wait-sleep-us 1000 --option max_send_wr=128"
# Skips (exit 0) where the harness cannot run, as scripts/softroce-tests.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$repo/scripts/softroce-lib.sh"
softroce_preflight softroce-bench "$repo"
cd "$repo"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-900}
cargo build --release --bin kvwire >&2
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-softroce-bench.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp "$CARGO_TARGET_DIR/release/kvwire" "$stage/kvwire"
if [ -n "${COMPARE_BIN:-}" ]; then
  cp "$COMPARE_BIN" "$stage/kvwire-b"
elif [ -n "${COMPARE_ARGS:-}" ]; then
  echo "softroce-bench: COMPARE_ARGS needs COMPARE_BIN (the build to run them with)" >&2
  exit 2
fi
cat > "$stage/bench.sh" <<'GUEST'
#!/bin/sh
# Runs in the guest (dash + busybox).
set -u
G=$SOFTROCE_GID_IDX; SRV=$SOFTROCE_SRV_IP
ROUNDS=${ROUNDS:-2}; MB=${MB:-8}; QPS=${QPS:-1}; KV_ARGS=${KV_ARGS:-}; COMPARE_ARGS=${COMPARE_ARGS:-}
: > results.txt
pt() { # op size iters -> MB/s (perftest MB = 2^20 B) average
  tool=ib_$1_bw
  $tool -d rxe0 -x "$G" -s "$2" -q "$QPS" -n "$3" -F > pt-srv.log 2>&1 &
  sp=$!
  sleep 1
  $tool -d rxe1 -x "$G" -s "$2" -q "$QPS" -n "$3" -F "$SRV" > pt-cli.log 2>&1
  wait $sp
  cat pt-cli.log >&2
  awk -v s="$2" '$1 == s && NF >= 5 {print $4}' pt-cli.log | tail -1
}
kv() { # bin op size blocks iters [extra args] -> GB/s (1e9 B/s)
  bin=$1; op=$2; size=$3; blocks=$4; iters=$5; shift 5
  "$bin" bench --transport verbs --op "$op" --device rxe1 --target-device rxe0 \
    --option gid_index="$G" --target-option gid_index="$G" \
    --option qps_per_peer="$QPS" --target-option qps_per_peer="$QPS" \
    --block-size "$size" --blocks "$blocks" --iters "$iters" --warmup 1 --lat-iters 2 --scatter --pipeline "${PIPELINE:-1}" --json $KV_ARGS "$@" > kv.json 2> kv.err
  cat kv.json kv.err >&2
  sed -n 's/.*"gb_per_s":\([0-9.e+-]*\).*/\1/p' kv.json
}
for r in $(seq 1 "$ROUNDS"); do
  for op in write read; do
    for size in 4096 65536; do
      n=$((MB * 1048576 / size))          # perftest messages
      blocks=$((n / 4)); iters=4          # kvwire: the same bytes in 4 transfers
      echo "### round $r: ib_${op}_bw -s $size -q $QPS -n $n" >&2
      p=$(pt "$op" "$size" "$n")
      echo "### round $r: kvwire bench --op $op --block-size $size --blocks $blocks --iters $iters" >&2
      k=$(kv ./kvwire "$op" "$size" "$blocks" "$iters")
      b=0
      if [ -x ./kvwire-b ]; then
        echo "### round $r: COMPARE_BIN bench --op $op --block-size $size" >&2
        b=$(kv ./kvwire-b "$op" "$size" "$blocks" "$iters" $COMPARE_ARGS)
      fi
      echo "$op $size $r ${p:-0} ${k:-0} ${b:-0}" >> results.txt
    done
  done
done
echo
echo "kvwire extra args: ${KV_ARGS:-(none)}; compare_bin extra args: ${COMPARE_ARGS:-(none)}"
echo "raw (MB/s = 1e6 B/s): op size round perftest kvwire compare_bin"
awk '{printf "  %-5s %6d %d %8.2f %8.2f %8.2f\n", $1, $2, $3, $4 * 1048576 / 1e6, $5 * 1000, $6 * 1000}' results.txt
echo "best of rounds: op size perftest_MB/s kvwire_MB/s ratio [compare_bin_MB/s ratio]"
awk '{k = $1 " " $2; p = $4 * 1048576 / 1e6; v = $5 * 1000; w = $6 * 1000;
      if (p > bp[k]) bp[k] = p; if (v > bv[k]) bv[k] = v; if (w > bw[k]) bw[k] = w}
     END {for (k in bp) {
            printf "  %-11s %8.2f %8.2f %6.1f%%", k, bp[k], bv[k], (bp[k] > 0 ? 100 * bv[k] / bp[k] : 0)
            if (bw[k] > 0) printf " %8.2f %6.1f%%", bw[k], 100 * bw[k] / bp[k]
            printf "\n"}}' results.txt | sort
echo "median of per-round ratios: op size kvwire [compare_bin]"
for k in "write 4096" "write 65536" "read 4096" "read 65536"; do
  med() { # column -> median of column/perftest in % over the rounds of $k
    awk -v k="$k" -v c="$1" '$1 " " $2 == k && $4 > 0 {printf "%.1f\n", 100 * $c * 1000 / ($4 * 1048576 / 1e6)}' results.txt |
      sort -n | awk '{a[NR] = $1} END {if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) "%"}'
  }
  line="  $k: $(med 5)"
  if [ -x ./kvwire-b ]; then line="$line $(med 6)"; fi
  echo "$line"
done
GUEST
chmod +x "$stage/bench.sh"
KV_ARGS=${KV_ARGS:-}
bash "$softroce_vm" run "$stage" env ROUNDS="${ROUNDS:-2}" PIPELINE="${PIPELINE:-1}" MB="${MB:-8}" QPS="${QPS:-1}" KV_ARGS="$KV_ARGS" COMPARE_ARGS="${COMPARE_ARGS:-}" ./bench.sh
