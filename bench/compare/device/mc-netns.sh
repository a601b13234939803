#!/usr/bin/env bash
# TCP Mooncake-API bench on the device machine's 16 cores: kvwire's `mooncake`
# (tcp), the real mooncake-transfer-engine-non-cuda wheel (TCP), kvwire's Rust
# path and a plain TCP stream, across two network namespaces when the machine
# allows them (else on one host, said so). JSON lines into $OUT/mc-netns.json.
R=$(pwd); S=$R/.gpu-stage; out=$OUT/mc-netns.json; : > "$out"; err=$OUT/mc-netns.err
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/real "$R"/.whl/mooncake*.whl || exit 1
export PYTHONUNBUFFERED=1 MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=65535
cd /tmp
A=(); B=(); H=127.0.0.1; T=127.0.0.1; where="one host"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pr2 "$R"/.whl/pyroute2*.whl
if PYTHONPATH=/tmp/pr2 timeout 30 python3 "$S/netns.py" 2>>"$err"; then
    A=(python3 "$S/nsexec.py" mcb-a); B=(python3 "$S/nsexec.py" mcb-b); H=10.77.0.1; T=10.77.0.2; where="two netns"
fi
echo "where: $where"
ns=(MC_BENCH_HOST=$H MC_BENCH_TARGET_HOST=$T "MC_BENCH_TARGET_PREFIX=${B[*]}")
run() { local label=$1 pp=$2; shift 2; echo "== $label"; "${A[@]}" env PYTHONPATH="$pp" KVWIRE_MOONCAKE_TOKEN=b1 "${ns[@]}" "$@" timeout 150 python3 "$R/bench/compare/mooncake_api_bench.py" 2>>"$err" | sed "s/^{/{\"label\": \"$label, $where\", /" >> "$out"; }
run "kvwire mooncake, tcp" "$S/python" KVWIRE_MOONCAKE_TRANSPORT=tcp
run "Mooncake 0.3.13.post1 TCP" /tmp/real
"${B[@]}" python3 "$R/bench/compare/tcp_ceiling.py" serve "$T" 19650 2>>"$err" & sp=$!; sleep 0.5
for st in 1 2 4 8; do "${A[@]}" timeout 30 python3 "$R/bench/compare/tcp_ceiling.py" send "$T" 19650 $st 2>>"$err" | sed "s/^{/{\"label\": \"plain TCP stream, $where\", /" >> "$out"; done
kill $sp
for op in write read; do for page in 4096 65536 1048576; do
  "${B[@]}" env KVWIRE_TCP_LISTEN=$T:0 "$S/kvwire" bench --listen "$T:18650" --listen-timeout 30 >>"$err" 2>&1 & tp=$!
  "${A[@]}" env KVWIRE_TCP_LISTEN=$H:0 timeout 60 "$S/kvwire" bench --connect "$T:18650" --connect-timeout 20 --transport tcp --op $op --block-size $page --blocks $(( (256<<20) / page )) --scatter --iters 3 --json 2>>"$err" | sed "s/^{/{\"label\": \"kvwire Rust path, tcp, $where\", /" >> "$out"
  wait $tp
done; done
echo "== done"; wc -l "$out"; tail -4 "$err"
