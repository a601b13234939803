#!/usr/bin/env bash
# Side-by-side Mooncake-API benchmark (issue 25): bench/compare/mooncake_api_bench.py,
# one script written against mooncake.engine.TransferEngine, run in one go with
#   - kvwire's `mooncake` on shm and on tcp, and the real
#     mooncake-transfer-engine-non-cuda wheel over TCP, on one host (127.0.0.1);
#   - kvwire's own Rust path on the same sizes (`kvwire bench --scatter`), as the
#     one-host reference;
#   - kvwire's `mooncake` (tcp) and the real wheel (TCP) across two network
#     namespaces joined by a veth pair (initiator 10.77.0.1, target 10.77.0.2).
# 256 MiB of 4 KiB / 64 KiB / 1 MiB pages scattered by a permutation, batch
# write and read, bytes verified. Prints a table and writes
# target/mooncake-api-bench.json (one JSON object per run).
#
# Needs: scripts/mooncake-tests.sh run once (target/mooncake-venv), PyPI for
# `pip install mooncake-transfer-engine-non-cuda numpy` into
# target/mooncake-real-venv (and libibverbs1: apt-get install -y libibverbs1);
# root and iproute2 for the namespaces (skipped otherwise, or with MC_BENCH_NETNS=0).
# Real Mooncake gets MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and
# MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER = 65535, else its TCP transport rejects
# a batch of more than 1,024 pages (docs/MOONCAKE.md); both get the same calls.
# Env: MC_BENCH_BYTES, MC_BENCH_REPS, MC_BENCH_BATCH (see the .py), KVWIRE_BIN
# (the kvwire binary; default target/release/kvwire, built when missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
ours="$root/target/mooncake-venv/bin/python"
real_venv="$root/target/mooncake-real-venv"
[ -x "$ours" ] || { echo "run scripts/mooncake-tests.sh first" >&2; exit 2; }
if [ ! -x "$real_venv/bin/python" ]; then
    python3 -m venv "$real_venv"
    "$real_venv/bin/pip" install -q mooncake-transfer-engine-non-cuda numpy
fi
real="$real_venv/bin/python"
kvwire=${KVWIRE_BIN:-$root/target/release/kvwire}
[ -x "$kvwire" ] || { cargo build --release --bin kvwire; kvwire=$root/target/release/kvwire; }
script="$root/bench/compare/mooncake_api_bench.py"
out="$root/target/mooncake-api-bench.json"
logs="$root/target/mooncake-api-bench"
mkdir -p "$logs"
: > "$out"
export MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535
run() {  # run <label> <env...> <python>
    local label=$1; shift
    echo "== $label" >&2
    env "$@" "$script" 2>"$logs/$(echo "$label" | tr ' /,' '___').err" |
        sed "s/^{/{\"label\": \"$label\", /" >> "$out"
}
cd /tmp
run "kvwire mooncake, shm, one host" KVWIRE_MOONCAKE_TRANSPORT=shm "$ours"
run "kvwire mooncake, tcp, one host" KVWIRE_MOONCAKE_TRANSPORT=tcp "$ours"
run "Mooncake 0.3.13.post1 TCP, one host" "$real"

# kvwire's Rust path, same sizes and scatter
bytes=${MC_BENCH_BYTES:-$((256 << 20))}
for t in shm tcp; do
    for op in write read; do
        for page in 4096 65536 1048576; do
            "$kvwire" bench --transport $t --op $op --block-size "$page" --blocks $(( bytes / page )) --scatter \
                --iters "${MC_BENCH_REPS:-3}" --json 2>/dev/null |
                sed "s/^{/{\"label\": \"kvwire Rust path, $t, one host\", /" >> "$out"
        done
    done
done

if [ "${MC_BENCH_NETNS:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then
    A="mcb-a-$$"; B="mcb-b-$$"
    cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; }
    trap cleanup EXIT
    ip netns add "$A"; ip netns add "$B"
    ip link add "mcb$$a" netns "$A" type veth peer name "mcb$$b" netns "$B"
    ip -n "$A" addr add 10.77.0.1/24 dev "mcb$$a"; ip -n "$B" addr add 10.77.0.2/24 dev "mcb$$b"
    for n in "$A" "$B"; do ip -n "$n" link set lo up; done
    ip -n "$A" link set "mcb$$a" up; ip -n "$B" link set "mcb$$b" up
    ns=(MC_BENCH_HOST=10.77.0.1 MC_BENCH_TARGET_HOST=10.77.0.2 "MC_BENCH_TARGET_PREFIX=ip netns exec $B")
    # a remote asker needs the deployment token to get kvwire's metadata (docs/MOONCAKE.md)
    run "kvwire mooncake, tcp, two netns" ip netns exec "$A" env KVWIRE_MOONCAKE_TRANSPORT=tcp \
        KVWIRE_MOONCAKE_TOKEN=bench-$$ "${ns[@]}" "$ours"
    run "Mooncake 0.3.13.post1 TCP, two netns" ip netns exec "$A" env "${ns[@]}" "$real"
else
    echo "mooncake-api-bench: namespaces skipped (needs root and iproute2; MC_BENCH_NETNS=0 skips)" >&2
fi

"$ours" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print(f"{'run':42} {'page':>8} {'op':5} {'GB/s':>7} {'caller CPU ns/page':>18}")
for r in rows:
    if "results" in r:
        for x in r["results"]:
            print(f"{r['label']:42} {x['page']:>8} {x['op']:5} {x['gbps']:>7} {x['caller_cpu_ns_per_page']:>18}")
    else:  # kvwire bench
        print(f"{r['label']:42} {r['block_size']:>8} {r['op'].upper():5} {r['gb_per_s']:>7.3f} {r.get('post_cpu_ns_per_block', ''):>18}")
PY
