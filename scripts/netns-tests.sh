#!/usr/bin/env bash
# Multi-host tests in network namespaces. First the README's two-host
# commands, exactly as README.md's "Across two hosts" shows them (read from
# the README: host B = 10.0.0.2, host A = 10.0.0.3, etcd on 10.0.0.1): the
# two-terminal bench, serve + serve --pull, replay --etcd, replay --role
# decode/prefill, and the C ABI
# example. Then: prefill and decode engines
# (`kvwire serve`) on different "hosts" find each other through etcd and move
# verified KV pages over the tcp transport; a peer killed (or frozen)
# mid-transfer fails its transfers within the peer timeout, its etcd lease
# expires, and the decode engine keeps working with the other peer.
#
# Needs root, iproute2 and etcd (Debian: etcd-server). Installs nothing.
# Topology (addresses only inside the namespaces created here):
#   kvw-hub-$$: bridge 10.0.0.1/24, etcd on 10.0.0.1:2379
#   kvw-a-$$ 10.0.0.2 (README's host B; prefill-0), kvw-b-$$ 10.0.0.3 (README's
#   host A; decode-0), kvw-c-$$ 10.0.0.4 (prefill-1)
# Everything is torn down on exit, also on failure.
# Without root/netns support or etcd it says "skipped: ..." and exits 0,
# unless KVWIRE_REQUIRE_NETNS=1.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/suite-lib.sh
skip() { suite_unavailable netns-tests KVWIRE_REQUIRE_NETNS "$*"; }
[ "$(id -u)" = 0 ] || skip "not root (network namespaces need root)"
command -v ip >/dev/null || skip "no ip (apt-get install -y iproute2)"
command -v etcd >/dev/null || skip "no etcd (apt-get install -y etcd-server)"

TARGET_DIR="${CARGO_TARGET_DIR:-target}"
KVWIRE="${KVWIRE_BIN:-}"
if [ -z "$KVWIRE" ]; then
  for p in "$TARGET_DIR/release/kvwire" "$TARGET_DIR/debug/kvwire"; do
    if [ -x "$p" ]; then KVWIRE="$p"; break; fi
  done
fi
[ -n "$KVWIRE" ] || { cargo build --release --bin kvwire; KVWIRE="$TARGET_DIR/release/kvwire"; }
KVWIRE="$(realpath "$KVWIRE")"

S=$$
HUB="kvw-hub-$S"; NA="kvw-a-$S"; NB="kvw-b-$S"; NC="kvw-c-$S"
WORK="$(mktemp -d /tmp/kvwire-netns.XXXXXX)"
PIDS=()

cleanup() {
  set +e
  for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  for n in "$NA" "$NB" "$NC" "$HUB"; do ip netns del "$n" 2>/dev/null; done
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

ip netns add "$HUB" 2>/dev/null || skip "cannot create network namespaces here"
ip -n "$HUB" link set lo up
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" addr add 10.0.0.1/24 dev br0
ip -n "$HUB" link set br0 up
i=2
for n in "$NA" "$NB" "$NC"; do
  ip netns add "$n"
  ip -n "$n" link set lo up
  ip link add "kvw$S-$i" netns "$n" type veth peer name "p$i" netns "$HUB"
  ip -n "$n" link set "kvw$S-$i" name eth0
  ip -n "$n" addr add "10.0.0.$i/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$HUB" link set "p$i" master br0
  ip -n "$HUB" link set "p$i" up
  i=$((i + 1))
done

ETCD_URL=http://10.0.0.1:2379
ip netns exec "$HUB" etcd --name kvw --data-dir "$WORK/etcd" \
  --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster kvw=http://127.0.0.1:2380 >"$WORK/etcd.log" 2>&1 &
PIDS+=($!)

PASSED=0; FAILED=0
ok() { echo "  ok: $*"; PASSED=$((PASSED + 1)); }
bad() { echo "  FAILED: $*"; FAILED=$((FAILED + 1)); }

# serve NS NAME IP LOG [args...]: start an engine in namespace NS; sets LAST_PID.
serve() {
  local ns=$1 name=$2 ip=$3 log=$4; shift 4
  ip netns exec "$ns" "$KVWIRE" serve --name "$name" --etcd "$ETCD_URL" --listen "$ip:0" \
    --ttl 2 --peer-timeout 1.5 --buffer 64MiB --page-size 64KiB --prefix "/kvwire-netns/$S/$TEST/" "$@" >"$log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

wait_for() { # wait_for FILE PATTERN SECONDS
  local t=0
  until grep -q "$2" "$1" 2>/dev/null; do
    sleep 0.1; t=$((t + 1))
    if [ "$t" -ge $(($3 * 10)) ]; then return 1; fi
  done
}

echo "netns-tests: $KVWIRE, namespaces $HUB $NA $NB $NC"
# etcd may take a moment: the first serve's lookup/publish retries through its own timeouts.
sleep 1

# The README's two-host commands: "BLOCK|HOST|COMMAND" per line of the code
# blocks under "### Across two hosts" (HOST from the "# A:" / "# B:" comment
# above the command). A block whose comment says "not run by
# scripts/netns-tests.sh" is skipped, and so are lines under no such
# comment (e.g. the etcd block for 10.0.0.1, which this script starts
# itself); lines ending in "\" are joined with the next.
readme_commands() {
  awk '/^### Across two hosts/ { s = 1; next } s && /^##/ { s = 0 }
       s && /^```/ { if (code) { code = 0 } else { code = 1; skip = 0; block++; host = "" }; next }
       s && code && /not run by scripts\/netns-tests.sh/ { skip = 1; next }
       s && code && skip { next }
       s && code && /^# [AB]/ { host = substr($2, 1, 1); next }
       s && code && /^[^#]/ && NF && host != "" { line = line $0; if (sub(/\$/, "", line)) next;
                                                  print block "|" host "|" line; line = "" }' README.md
}
REMOTE=""
if command -v gcc >/dev/null; then
  CAPI_TARGET="${CARGO_TARGET_DIR:-$PWD/target}/capi"
  # the same build as scripts/capi-tests.sh's
  CARGO_TARGET_DIR="$CAPI_TARGET" cargo build -q --manifest-path capi/Cargo.toml
  gcc -std=c11 -D_DEFAULT_SOURCE -Iinclude examples/c/remote.c -L"$CAPI_TARGET/debug" -lkvwire_c \
    -Wl,-rpath,"$CAPI_TARGET/debug" -o "$WORK/remote"
  REMOTE="$WORK/remote"
fi
# run_readme_block N: B's commands in the background in $NA, A's in the
# foreground in $NB (each must exit 0); then B's must have exited 0 (bench,
# C target) or are stopped (serve runs until killed).
run_readme_block() {
  local n=$1 line host cmd bpids=() bcmds=() rc ok_block=1 i
  while IFS='|' read -r b host cmd; do
    [ "$b" = "$n" ] || continue
    case "$cmd" in
      ./remote*) [ -n "$REMOTE" ] || { echo "netns-tests: skipped (part): README C ABI commands: no gcc"; return 0; };;
    esac
    cmd=${cmd/#kvwire /\"\$KVWIRE\" }
    cmd=${cmd/#.\/remote /\"\$REMOTE\" }
    cmd=${cmd//\/shared\/kvwire.md/\$WORK/kvwire.md}
    if [ "$host" = B ]; then
      KVWIRE=$KVWIRE REMOTE=$REMOTE WORK=$WORK ip netns exec "$NA" bash -c "exec $cmd" >"$WORK/readme-$n-B${#bpids[@]}.log" 2>&1 &
      bpids+=($!); bcmds+=("$cmd"); PIDS+=($!)
      sleep 1
    else
      echo "  A\$ $cmd"
      if ! KVWIRE=$KVWIRE REMOTE=$REMOTE WORK=$WORK timeout 300 ip netns exec "$NB" bash -c "$cmd" >"$WORK/readme-$n-A.log" 2>&1; then
        ok_block=0; bad "README: on host A: $cmd"; tail -5 "$WORK/readme-$n-A.log"
      fi
    fi
  done < <(readme_commands)
  for i in "${!bpids[@]}"; do
    local t=0
    while kill -0 "${bpids[$i]}" 2>/dev/null && [ $t -lt 100 ]; do sleep 0.1; t=$((t + 1)); done
    if kill -0 "${bpids[$i]}" 2>/dev/null; then
      case "${bcmds[$i]}" in
        *" serve "*) kill "${bpids[$i]}"; wait "${bpids[$i]}" 2>/dev/null || true;;
        *) kill -9 "${bpids[$i]}"; ok_block=0; bad "README: on host B, still running: ${bcmds[$i]}";;
      esac
    else
      rc=0; wait "${bpids[$i]}" || rc=$?
      if [ "$rc" != 0 ]; then ok_block=0; bad "README: on host B (exit $rc): ${bcmds[$i]}"; tail -5 "$WORK/readme-$n-B$i.log"; fi
    fi
  done
  [ $ok_block = 1 ] && ok "README block $n: $(readme_commands | grep -c "^$n|") command(s) across hosts"
  return 0
}

echo "test 0: the README's two-host commands"
nblocks=$(readme_commands | cut -d'|' -f1 | sort -u | wc -l)
[ "$nblocks" -ge 3 ] || bad "README: expected >= 3 command blocks under '### Across two hosts', found $nblocks"
for n in $(readme_commands | cut -d'|' -f1 | sort -un); do
  TEST="readme-$n"
  run_readme_block "$n"
done

echo "test 1: decode in $NB pulls verified pages from prefill-0 in $NA (discovered through etcd)"
TEST=basic
serve "$NA" prefill-0 10.0.0.2 "$WORK/basic-p0.log"
P0=$LAST_PID
if ! wait_for "$WORK/basic-p0.log" "^serving" 20; then cat "$WORK/basic-p0.log" "$WORK/etcd.log" | tail -20; fi
serve "$NB" decode-0 10.0.0.3 "$WORK/basic-d0.log" --pull prefill-0 --rounds 10 --pages 256
D0=$LAST_PID
if wait "$D0" && grep -q "pull summary: ok=10 failed=0" "$WORK/basic-d0.log"; then
  ok "10 rounds of 3 x 16 MiB (READ, WRITE, READ back) verified across namespaces"
else
  bad "basic pull"; cat "$WORK/basic-d0.log"
fi
if grep -q "notification from decode-0: decode-0-round-9" "$WORK/basic-p0.log"; then
  ok "prefill-0 received the WRITE notifications"
else
  bad "notifications missing"; tail -5 "$WORK/basic-p0.log"
fi
kill "$P0"

echo "test 1b: replay across namespaces over tcp: decode engines in $NA and $NC, one prefill in $NB (request j -> decode j mod 2)"
TEST=replay-roles
# decode_role NS IP: a decode engine in NS on IP:18601; sets LAST_PID.
decode_role() {
  ip netns exec "$1" "$KVWIRE" replay --role decode --listen "$2:18601" --transport tcp --option "listen=$2:0" \
    --json --wait-s 60 >"$WORK/$TEST-$1.out" 2>"$WORK/$TEST-$1.log" &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}
decode_role "$NA" 10.0.0.2; DA=$LAST_PID
decode_role "$NC" 10.0.0.4; DC=$LAST_PID
sleep 1
if ip netns exec "$NB" timeout 300 "$KVWIRE" replay --role prefill --connect 10.0.0.2:18601,10.0.0.4:18601 \
    --transport tcp --option listen=10.0.0.3:0 --requests 40 --decode-pages 2048 --json >"$WORK/$TEST-p.out" 2>"$WORK/$TEST-p.log"; then
  rc_a=0; rc_c=0
  wait "$DA" || rc_a=$?
  wait "$DC" || rc_c=$?
  if [ "$rc_a" = 0 ] && [ "$rc_c" = 0 ] && grep -q '"verified":true' "$WORK/$TEST-p.out" \
     && grep -q '"decode_engines":2' "$WORK/$TEST-p.out" \
     && cmp -s "$WORK/$TEST-p.out" "$WORK/$TEST-$NA.out" && cmp -s "$WORK/$TEST-p.out" "$WORK/$TEST-$NC.out"; then
    ok "40 requests verified on two decode hosts; the same summary on all three"
  else
    bad "replay roles: decode exits $rc_a/$rc_c or summaries differ"; cat "$WORK/$TEST-p.out" "$WORK/$TEST-$NA.out" "$WORK/$TEST-$NC.out"; tail -3 "$WORK/$TEST-$NA.log" "$WORK/$TEST-$NC.log"
  fi
else
  bad "replay --role prefill across namespaces"; tail -5 "$WORK/$TEST-p.log" "$WORK/$TEST-$NA.log" "$WORK/$TEST-$NC.log"
fi

# failure_test SIGNAL: prefill-0 gets SIGNAL mid-transfer; prefill-1 must keep serving.
failure_test() {
  local sig=$1
  TEST="fail-$sig"
  serve "$NA" prefill-0 10.0.0.2 "$WORK/$TEST-p0.log"; local p0=$LAST_PID
  serve "$NC" prefill-1 10.0.0.4 "$WORK/$TEST-p1.log"; local p1=$LAST_PID
  serve "$NB" decode-0 10.0.0.3 "$WORK/$TEST-d0.log" --pull prefill-0,prefill-1 --rounds 60 --pages 256
  local d0=$LAST_PID
  if ! wait_for "$WORK/$TEST-d0.log" "^round 3:" 60; then bad "$sig: decode never reached round 3"; cat "$WORK/$TEST-d0.log"; return; fi
  kill "-$sig" "$p0"
  local rc=0
  wait "$d0" || rc=$?
  local log="$WORK/$TEST-d0.log"
  local ms
  ms=$(sed -n 's/^peer prefill-0 failed after \([0-9]*\) ms.*/\1/p' "$log" | head -1)
  if [ -n "$ms" ] && [ "$ms" -le 3000 ]; then
    ok "$sig: prefill-0's transfer failed after $ms ms (peer timeout 1.5 s): $(grep -m1 '^peer prefill-0 failed' "$log" | cut -d: -f2-)"
  else
    bad "$sig: no timely failure of prefill-0"; cat "$log"
  fi
  if grep -q "^peer prefill-0 left etcd" "$log"; then
    ok "$sig: $(grep -m1 '^peer prefill-0 left etcd' "$log")"
  else
    bad "$sig: prefill-0 still in etcd"
  fi
  local after
  after=$(sed -n '/^peer prefill-0 failed/,$p' "$log" | grep -c "^round .*: 1 peer(s) ok" || true)
  if [ "$rc" = 0 ] && grep -q "live_peers=1" "$log" && [ "$after" -ge 10 ]; then
    ok "$sig: decode-0 kept pulling verified pages from prefill-1 ($after rounds after the failure)"
  else
    bad "$sig: survivor did not keep working (rc=$rc, rounds after=$after)"; tail -5 "$log"
  fi
  kill -CONT "$p0" 2>/dev/null || true
  kill -9 "$p0" "$p1" 2>/dev/null || true
}

echo "test 2: prefill-0 killed (SIGKILL) mid-transfer"
failure_test KILL
echo "test 3: prefill-0 frozen (SIGSTOP) mid-transfer: a silent peer"
failure_test STOP

echo "netns: $PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
