#!/usr/bin/env bash
# SGLang 0.5.23's own, unchanged Mooncake prefill/decode code
# (sglang/srt/disaggregation/mooncake/conn.py: MooncakeKVManager,
# MooncakeKVSender/Receiver, MooncakeKVBootstrapServer; and
# distributed/device_communicators/mooncake_transfer_engine.py) moving KV
# pages and aux rows between two processes on CPU, over kvwire's `mooncake`
# package ("ours") and over the real mooncake-transfer-engine-non-cuda
# 0.3.13.post1 wheel ("real"). Our driver (scripts/sglang-real/driver.py)
# publishes a ServerArgs as SGLang's scheduler does and calls the scheduler's
# steps; SGLang's code comes from its wheel, installed into a scratch venv
# (never copied here). Not part of scripts/test.sh: it downloads ~3.5 GB
# (torch 2.15 with its CUDA libraries, which import fine without a GPU).
#
# Usage: scripts/sglang-real-check.sh [ours|real ...]   (default: ours real)
# Needs: python3 with venv, PyPI; "ours" the wheel built by
# `KVWIRE_MOONCAKE_BUILD_ONLY=1 bash scripts/mooncake-tests.sh`; "real"
# libibverbs1 (apt-get install -y libibverbs1: Mooncake's engine.so links it
# even for tcp).
# Env: KVWIRE_SGLANG_VENV (default target/sglang-venv).
#
# Scenarios (each a prefill and a decode process, MOONCAKE_PROTOCOL=tcp,
# MC_FORCE_TCP=1, MC_TRANSFER_TIMEOUT=10; checked here, exit 1 on a miss):
#   ok          6 rooms, 1-11 non-contiguous pages each (368 pages), every
#               destination page and aux row verified, no other page touched
#   big         30 rooms, 8 layers (~49 MB verified)
#   rdma        SGLang's default MOONCAKE_PROTOCOL=rdma and no MC_FORCE_TCP on
#               a host without an RDMA NIC (both fall back to tcp)
#   shm         (ours) KVWIRE_MOONCAKE_TRANSPORT=shm
#   kill-decode the decode SIGKILLed after its first room: the other rooms
#               Failed through SGLang's poll(), no hang
#   restart     as kill-decode, then a new decode process gets 6 new rooms
#   kill-prefill the prefill (and bootstrap server) SIGKILLed: the decode's
#               rooms Failed, no hang
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${KVWIRE_SGLANG_VENV:-$root/target/sglang-venv}
mc=$root/target/sglang-mc
impls=("$@")
[ ${#impls[@]} -gt 0 ] || impls=(ours real)

. scripts/mooncake-impls-lib.sh
make_engine_venv "$venv" sglang sglang==0.5.23 scripts/sglang-real/requirements.txt
install_mooncake_impls "$venv" "$mc" "${impls[@]}"

logs=$(mktemp -d /tmp/kvwire-sglang-XXXXXX)
fail=0
# check IMPL NAME SCENARIO [ENV=VAL | -u ENV ...] -- [driver args]
check() {
    local impl=$1 name=$2 scen=$3; shift 3
    split_run_args "$@"
    local out="$logs/$impl-$name.json"
    env PYTHONPATH="$mc/$impl" MOONCAKE_PROTOCOL=tcp MC_FORCE_TCP=1 MC_TRANSFER_TIMEOUT=10 \
        SGLANG_DISAGGREGATION_THREAD_POOL_SIZE=4 SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL=1 \
        SGLANG_DISAGGREGATION_WAITING_TIMEOUT=60 CUDA_VISIBLE_DEVICES= H_LOGDIR="$logs" "${RUN_ENV[@]}" \
        env "${RUN_UNSET[@]}" "$venv/bin/python" scripts/sglang-real/driver.py run --scenario "$scen" --tag "$impl-$name" "${RUN_ARGS[@]}" \
        > "$out" 2> "$out.err" || true
    if "$venv/bin/python" - "$out" "$name" <<'PY'; then echo "sglang-real: $impl $name: passed"; else echo "sglang-real: $impl $name: FAILED (logs in $logs)"; fail=1; fi
import collections, json, sys
d, name = json.load(open(sys.argv[1])), sys.argv[2]
rooms = lambda r: collections.Counter((r or {}).get("rooms", {}).values())
p, q = d.get("prefill") or {}, d.get("decode") or {}
if name in ("ok", "big", "rdma", "shm"):
    good = (set(rooms(p)) == {"Success"} and q.get("ok") is True and q.get("num_mismatches") == 0
            and q.get("stray_writes") == 0)
elif name in ("kill-decode", "restart"):
    good = rooms(p)["Failed"] >= 1 and set(rooms(p)) <= {"Success", "Failed"}
    if name == "restart":
        good = good and set(rooms(d.get("prefill-phase2"))) == {"Success"} and (d.get("decode2") or {}).get("ok") is True
elif name == "kill-prefill":
    good = set(rooms(q)) == {"Failed"} and q.get("stray_writes") == 0
print(f"  {name}: prefill {dict(rooms(p))} decode {dict(rooms(q)) or q.get('rc')} verified pages "
      f"{q.get('pages_verified')} mismatches {q.get('num_mismatches')} wall {d.get('wall_s')} s")
sys.exit(0 if good else 1)
PY
}

big=(H_POOL_PAGES=1500 H_LAYERS=8 H_HEAD_DIM=128 H_MAX_PAGES=40)
for impl in "${impls[@]}"; do
    check "$impl" ok ok -- --timeout 60
    check "$impl" big ok "${big[@]}" -- --rooms 30 --timeout 120
    check "$impl" rdma ok -u MC_FORCE_TCP MOONCAKE_PROTOCOL=rdma -- --timeout 60
    [ "$impl" = ours ] && check "$impl" shm ok KVWIRE_MOONCAKE_TRANSPORT=shm -- --timeout 60
    check "$impl" kill-decode kill-decode -- --timeout 90
    check "$impl" restart kill-decode-restart SGLANG_FAILED_SESSION_PROBE_INTERVAL_S=0.5 -- --timeout 90
    check "$impl" kill-prefill kill-prefill -- --timeout 90
done
exit $fail
