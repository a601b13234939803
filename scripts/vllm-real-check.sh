#!/usr/bin/env bash
# vLLM 0.34.0's own, unchanged MooncakeConnector
# (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py,
# worker side: register_kv_caches, start_load_kv, get_finished) pulling KV
# blocks from a prefill (kv_producer) into a decode (kv_consumer) process on
# CPU, over kvwire's `mooncake` package ("ours") and over the real
# mooncake-transfer-engine-non-cuda 0.3.13.post1 wheel ("real"). Our driver
# (scripts/vllm-real/driver.py) builds the VllmConfig (a made-up 4-layer
# config, no weights), a gloo world of one and the connector by
# KVConnectorFactory as vLLM's engine core does, and hands it the metadata
# the connector's scheduler side builds (MooncakeConnectorMetadata.add_new_req);
# vLLM's code comes from its wheel, installed into a scratch venv (never
# copied here). Not part of scripts/test.sh: it downloads ~3.5 GB (torch 2.15
# with its CUDA libraries; vLLM 0.34 asks for 2.14, the connector path loads
# none of vLLM's compiled code). The one torch call that needs a GPU driver
# there (`torch.accelerator.current_device_index()` in the connector worker's
# __init__) is answered with device 0 by the driver, as a CPU worker has.
#
# Usage: scripts/vllm-real-check.sh [ours|real ...]   (default: ours real)
# Needs: python3 with venv, PyPI; "ours" the wheel built by
# `KVWIRE_MOONCAKE_BUILD_ONLY=1 bash scripts/mooncake-tests.sh`; "real"
# libibverbs1 (apt-get install -y libibverbs1).
# Env: KVWIRE_VLLM_VENV (default target/vllm-venv).
#
# Scenarios (checked here, exit 1 on a miss; MC_FORCE_TCP=1, tcp):
#   ok        5 requests, 24 non-contiguous blocks, every destination block
#             verified and no other block changed
#   big       30 requests, <= 16 blocks each, 512-block caches
#   early     the decode's pull arrives 3 s before the prefill's
#             request_finished
#   rdma      vLLM's default mooncake_protocol rdma, no MC_FORCE_TCP, on a
#             host without an RDMA NIC (both fall back to tcp)
#   sleep     sleep mode: the KV caches unregistered and registered again
#             (unregister_kv_caches + restore_kv_caches) before the transfer
#   both      kv_both on both sides
#   kill-decode the decode exits after asking, before the prefill writes:
#             the prefill's batch_transfer_sync_write returns -1, no raise,
#             no hang
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${KVWIRE_VLLM_VENV:-$root/target/vllm-venv}
mc=$root/target/vllm-mc
impls=("$@")
[ ${#impls[@]} -gt 0 ] || impls=(ours real)

. scripts/mooncake-impls-lib.sh
make_engine_venv "$venv" vllm vllm==0.34.0 scripts/sglang-real/requirements.txt scripts/vllm-real/requirements.txt
install_mooncake_impls "$venv" "$mc" "${impls[@]}"

logs=$(mktemp -d /tmp/kvwire-vllm-XXXXXX)
fail=0
# check IMPL NAME [ENV=VAL | -u ENV ...] -- [driver args]
check() {
    local impl=$1 name=$2; shift 2
    split_run_args "$@"
    local out="$logs/$impl-$name.jsonl"
    env PYTHONPATH="$mc/$impl" MC_FORCE_TCP=1 MC_TRANSFER_TIMEOUT=10 VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= \
        VLLM_MOONCAKE_CONNECTOR_TIMEOUT=5 OMP_NUM_THREADS=1 H_LOGDIR="$logs" "${RUN_ENV[@]}" \
        env "${RUN_UNSET[@]}" "$venv/bin/python" scripts/vllm-real/driver.py run --tag "$impl-$name" "${RUN_ARGS[@]}" \
        > "$out" 2> "$out.err" || true
    if "$venv/bin/python" - "$out" "$name" <<'PY'; then echo "vllm-real: $impl $name: passed"; else echo "vllm-real: $impl $name: FAILED (logs in $logs)"; fail=1; fi
import json, sys
rows = {d["role"]: d for d in (json.loads(l) for l in open(sys.argv[1]) if l.startswith("{"))}
p, q, name = rows.get("prefill", {}), rows.get("decode", {}), sys.argv[2]
calls = p.get("engine_calls", {})
raised = [c["exc"] for c in calls.values() if c["exc"]] + [c["exc"] for c in q.get("engine_calls", {}).values() if c["exc"]]
if name == "kill-decode":
    good = calls.get("batch_transfer_sync_write", {}).get("nonzero", [])[:1] == [-1] and not raised
else:
    good = p.get("ok") is True and q.get("ok") is True and not raised
print(f"  {name}: prefill ok {p.get('ok')} decode ok {q.get('ok')} blocks {q.get('blocks')} mismatches "
      f"{q.get('n_mismatch')} stray {q.get('stray')} load errors {q.get('load_errors')} sync_write codes "
      f"{calls.get('batch_transfer_sync_write', {}).get('nonzero')} raised {raised}")
sys.exit(0 if good else 1)
PY
}

for impl in "${impls[@]}"; do
    check "$impl" ok
    check "$impl" big H_REQS=30 H_BLOCKS=512 H_MAX_BLOCKS=16
    check "$impl" early H_FINISH_DELAY=3
    check "$impl" rdma -u MC_FORCE_TCP H_PROTOCOL=rdma
    check "$impl" sleep H_SLEEP_CYCLE=1
    check "$impl" both H_KV_BOTH=1
    check "$impl" kill-decode H_FINISH_DELAY=4 H_KILL_DECODE_AFTER_S=1 -- --timeout 15
done
exit $fail
