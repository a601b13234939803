#!/usr/bin/env bash
# Side-by-side Mooncake-API benchmark (issue 25): bench/compare/mooncake_api_bench.py,
# one script written against mooncake.engine.TransferEngine, run in one go with
#   - kvwire's `mooncake` on shm and on tcp, and the real
#     mooncake-transfer-engine-non-cuda wheel over TCP, on one host (127.0.0.1);
#   - kvwire's own Rust path on the same sizes (`kvwire bench --scatter`), as the
#     one-host reference; on shm twice: the target's buffer a kvwire HostBuffer
#     (its memfd mapped by the initiator) and registered by address only
#     (`--target-memory plain`, as the Python target's numpy buffer: both then
#     copy by cross-memory attach);
#   - kvwire's `mooncake` (tcp), the real wheel (TCP) and kvwire's Rust path
#     (`kvwire bench --listen` / `--connect`, tcp) across two network
#     namespaces joined by a veth pair (initiator 10.77.0.1, target 10.77.0.2);
#   - the TCP ceiling of each path: a plain byte stream over 1, 2 and 4
#     connections (bench/compare/tcp_ceiling.py), on one host and across the
#     namespaces.
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
# Env: MC_BENCH_BYTES, MC_BENCH_REPS, MC_BENCH_WARMUP, MC_BENCH_BATCH (see the .py;
# REPS and WARMUP also set `kvwire bench --iters / --warmup`), KVWIRE_BIN
# (the kvwire binary; default target/release/kvwire, built when missing),
# MC_BENCH_ROUNDS (default 1): repeat the whole set, rounds interleaved, and
# report each cell's best round and the median over the rounds of each round's median
# (the load of a shared machine moves between runs).
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
bytes=${MC_BENCH_BYTES:-$((256 << 20))}
netns=0
if [ "${MC_BENCH_NETNS:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then
    netns=1
    A="mcb-a-$$"; B="mcb-b-$$"
    cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; }
    trap cleanup EXIT
    ip netns add "$A"; ip netns add "$B"
    ip link add "mcb$$a" netns "$A" type veth peer name "mcb$$b" netns "$B"
    ip -n "$A" addr add 10.77.0.1/24 dev "mcb$$a"; ip -n "$B" addr add 10.77.0.2/24 dev "mcb$$b"
    for n in "$A" "$B"; do ip -n "$n" link set lo up; done
    ip -n "$A" link set "mcb$$a" up; ip -n "$B" link set "mcb$$b" up
    ns=(MC_BENCH_HOST=10.77.0.1 MC_BENCH_TARGET_HOST=10.77.0.2 "MC_BENCH_TARGET_PREFIX=ip netns exec $B")
else
    echo "mooncake-api-bench: namespaces skipped (needs root and iproute2; MC_BENCH_NETNS=0 skips)" >&2
fi
for round in $(seq 1 "${MC_BENCH_ROUNDS:-1}"); do
echo "== round $round" >&2
run "kvwire mooncake, shm, one host" KVWIRE_MOONCAKE_TRANSPORT=shm "$ours"
# The target's buffer from allocate_managed_buffer (kvwire: its own memfd
# memory, which shm maps, like the Rust path's HostBuffer target).
run "kvwire mooncake, shm, managed target" KVWIRE_MOONCAKE_TRANSPORT=shm MC_BENCH_TARGET_MEMORY=managed "$ours"
run "kvwire mooncake, tcp, one host" KVWIRE_MOONCAKE_TRANSPORT=tcp "$ours"
run "Mooncake 0.3.13.post1 TCP, one host" "$real"

# kvwire's Rust path, same sizes and scatter
for t in shm tcp; do
    for op in write read; do
        for page in 4096 65536 1048576; do
            "$kvwire" bench --transport $t --op $op --block-size "$page" --blocks $(( bytes / page )) --scatter \
                --iters "${MC_BENCH_REPS:-3}" --warmup "${MC_BENCH_WARMUP:-2}" --json 2>/dev/null |
                sed "s/^{/{\"label\": \"kvwire Rust path, $t, one host\", /" >> "$out"
            if [ "$t" = shm ]; then
                # The same with the target's buffer registered by address only,
                # as the Python target's numpy buffer is: shm then copies by
                # cross-memory attach in both (like for like).
                "$kvwire" bench --transport shm --op $op --block-size "$page" --blocks $(( bytes / page )) --scatter \
                    --target-memory plain --iters "${MC_BENCH_REPS:-3}" --warmup "${MC_BENCH_WARMUP:-2}" --json 2>/dev/null |
                    sed "s/^{/{\"label\": \"kvwire Rust path, shm, plain memory, one host\", /" >> "$out"
            fi
        done
    done
done

# The TCP ceiling of a path: a plain byte stream (bench/compare/tcp_ceiling.py:
# no framing, 1 MiB sends, 1, 2 and 4 connections), what any TCP engine works under.
ceiling() {  # ceiling <label> <target prefix...> -- <initiator prefix...> <host>
    local label=$1; shift
    local tgt=() ini=()
    while [ "$1" != -- ]; do tgt+=("$1"); shift; done; shift
    while [ $# -gt 1 ]; do ini+=("$1"); shift; done
    local host=$1 port=$(( 19600 + $$ % 300 ))
    "${tgt[@]}" "$ours" "$root/bench/compare/tcp_ceiling.py" serve "$host" "$port" 2>"$logs/ceiling-serve.err" &
    local spid=$!
    sleep 0.5
    for streams in 1 2 4; do
        "${ini[@]}" "$ours" "$root/bench/compare/tcp_ceiling.py" send "$host" "$port" "$streams" "$bytes" \
            "${MC_BENCH_REPS:-3}" 2>>"$logs/ceiling-send.err" |
            sed "s/^{/{\"label\": \"$label\", /" >> "$out" || true
    done
    kill "$spid" 2>/dev/null || true
    wait "$spid" 2>/dev/null || true
}
ceiling "plain TCP stream, one host" env -- env 127.0.0.1

if [ "$netns" = 1 ]; then
    ceiling "plain TCP stream, two netns" ip netns exec "$B" -- ip netns exec "$A" 10.77.0.2
    # a remote asker needs the deployment token to get kvwire's metadata (docs/MOONCAKE.md)
    run "kvwire mooncake, tcp, two netns" ip netns exec "$A" env KVWIRE_MOONCAKE_TRANSPORT=tcp \
        KVWIRE_MOONCAKE_TOKEN=bench-$$ "${ns[@]}" "$ours"
    run "Mooncake 0.3.13.post1 TCP, two netns" ip netns exec "$A" env "${ns[@]}" "$real"
    # kvwire's Rust path across the same namespaces (`bench --listen` in B,
    # `bench --connect` from A): where the tcp link itself tops out.
    port=$(( 18600 + $$ % 1000 ))
    for op in write read; do
        for page in 4096 65536 1048576; do
            ip netns exec "$B" env KVWIRE_TCP_LISTEN=10.77.0.2:0 "$kvwire" bench --listen "10.77.0.2:$port" \
                --listen-timeout 60 >"$logs/rust-netns-target.log" 2>&1 &
            tpid=$!
            ip netns exec "$A" env KVWIRE_TCP_LISTEN=10.77.0.1:0 "$kvwire" bench --connect "10.77.0.2:$port" \
                --connect-timeout 30 --transport tcp --op $op --block-size "$page" --blocks $(( bytes / page )) \
                --scatter --iters "${MC_BENCH_REPS:-3}" --warmup "${MC_BENCH_WARMUP:-2}" --json 2>>"$logs/rust-netns-initiator.err" |
                sed "s/^{/{\"label\": \"kvwire Rust path, tcp, two netns\", /" >> "$out" || true
            wait "$tpid" || true
        done
    done
fi
done

"$ours" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
import statistics
# (label, page, op) -> [(GB/s best, GB/s median, CPU ns/page)], one per round.
# Best: the fastest rep (Python) or the mean of the back-to-back transfers
# (`kvwire bench`); median: the median rep (Python) or the median transfer's
# latency (`kvwire bench`, p50) — the like-for-like pair the docs' ratios use.
cells_by = {}
for r in rows:
    if "results" in r:
        cells = [(x["page"], x["op"], x["gbps"], x.get("gbps_median", x["gbps"]), x["caller_cpu_ns_per_page"])
                 for x in r["results"]]
    elif "streams" in r:  # tcp_ceiling.py: a plain stream over `streams` connections
        cells = [(f"{r['streams']} conn", "SEND", r["gbps"], r["gbps"], "-")]
    else:
        med = round(r["bytes_per_transfer"] / r["p50_us"] / 1e3, 3) if r.get("p50_us") else r["gb_per_s"]
        cells = [(r["block_size"], r["op"].upper(), round(r["gb_per_s"], 3), med,
                  round(r.get("post_cpu_ns_per_block", 0), 1))]
    for page, op, gbps, med, cpu in cells:
        cells_by.setdefault((r["label"], page, op), []).append((gbps, med, cpu))
print(f"{'run':42} {'page':>8} {'op':5} {'GB/s best':>9} {'GB/s median':>11} {'caller CPU ns/page':>18} {'rounds':>6}")
for (label, page, op), rs in cells_by.items():
    gbps, _, cpu = max(rs, key=lambda x: x[0])
    med = round(statistics.median(x[1] for x in rs), 3)
    print(f"{label:42} {page:>8} {op:5} {gbps:>9} {med:>11} {cpu:>18} {len(rs):>6}")
# Like for like (the same memory kind on both sides): the package's median
# over the Rust path's median, and kvwire over real Mooncake across the namespaces.
pairs = [("kvwire mooncake, shm, one host", "kvwire Rust path, shm, plain memory, one host"),
         ("kvwire mooncake, shm, managed target", "kvwire Rust path, shm, one host"),
         ("kvwire mooncake, tcp, one host", "kvwire Rust path, tcp, one host"),
         ("kvwire mooncake, tcp, two netns", "Mooncake 0.3.13.post1 TCP, two netns")]
print(f"\n{'ratio of medians':82} {'page':>8} {'op':5} {'ratio':>6}")
for a, b in pairs:
    for (label, page, op), rs in cells_by.items():
        other = cells_by.get((b, page, op))
        if label == a and other:
            ratio = statistics.median(x[1] for x in rs) / statistics.median(x[1] for x in other)
            print(f"{a + ' / ' + b:82} {page:>8} {op:5} {ratio:>6.2f}")
PY
