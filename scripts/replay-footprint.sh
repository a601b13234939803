#!/usr/bin/env bash
# The main job's footprint: runs `kvwire replay ARGS...` (release build) and
# reports its wall time, the peak resident memory of the prefill and decode
# processes together (sampled every 0.5 s from /proc), and the load average
# before and after, so that README/PERFORMANCE figures carry their conditions.
#
#   scripts/replay-footprint.sh                 # the whole trace, defaults
#   scripts/replay-footprint.sh --requests 500  # a shorter run
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${KVWIRE_BIN:-${CARGO_TARGET_DIR:-target}/release/kvwire}
[ -x "$bin" ] || cargo build --release --bin kvwire
load0=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s.%N)
"$bin" replay "$@" &
pid=$!
peak=0
while kill -0 "$pid" 2>/dev/null; do
  # the replay and its decode child (RSS in KiB)
  total=0
  for p in $pid $(pgrep -P "$pid" || true); do
    r=$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)
    total=$((total + ${r:-0}))
  done
  [ "$total" -gt "$peak" ] && peak=$total
  sleep 0.5
done
rc=0; wait "$pid" || rc=$?
end=$(date +%s.%N)
echo "replay-footprint: exit $rc, wall $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s," \
  "peak RSS of both processes $(awk -v k="$peak" 'BEGIN{printf "%.2f", k*1024/1e9}') GB," \
  "load average before $load0, after $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
exit "$rc"
