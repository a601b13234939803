#!/usr/bin/env bash
# One-host TCP Mooncake-API bench on the device's 16 cores with the
# core-scaled default conns_per_peer: kvwire's `mooncake` (tcp), the real
# wheel, kvwire's Rust path at the default and at conns_per_peer 2 and 4.
R=$(pwd); S=$R/.gpu-stage; out=$OUT/mc-conns.json; : > "$out"; err=$OUT/mc-conns.err
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/real "$R"/.whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535
cd /tmp; nproc
run() { local label=$1 pp=$2; shift 2; echo "== $label"; env PYTHONPATH="$pp" "$@" timeout 150 python3 "$R/bench/compare/mooncake_api_bench.py" 2>>"$err" | sed "s/^{/{\"label\": \"$label\", /" >> "$out"; }
run "kvwire mooncake, tcp, one host" "$S/python" KVWIRE_MOONCAKE_TRANSPORT=tcp
run "Mooncake 0.3.13.post1 TCP, one host" /tmp/real
rb() { local label=$1 page=$2 op=$3; shift 3; timeout 60 "$S/kvwire" bench --transport tcp --op $op --block-size $page --blocks $(( (256<<20) / page )) --scatter --iters 3 --json "$@" 2>>"$err" | sed "s/^{/{\"label\": \"$label\", /" >> "$out"; }
for op in write read; do for page in 4096 65536 1048576; do rb "kvwire Rust path, tcp, default" $page $op; done; done
for c in 2 4; do for op in write read; do for page in 65536 1048576; do rb "kvwire Rust path, tcp, conns $c" $page $op --option conns_per_peer=$c; done; done; done
echo "== done"; wc -l "$out"; grep -v "^I1204\|^kvwire \|^mooncake " "$err" | tail -4
