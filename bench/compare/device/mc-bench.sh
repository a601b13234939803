#!/usr/bin/env bash
# One-host Mooncake-API bench on the device machine's 16 cores: kvwire's
# `mooncake` package (shm numpy target, shm managed target, tcp) beside
# kvwire's Rust path, same sizes; JSON lines into $OUT/mc-bench.json.
R=$(pwd); S=$R/.gpu-stage; out=$OUT/mc-bench.json; : > "$out"
export PYTHONPATH=$S/python PYTHONUNBUFFERED=1
cd /tmp
run() { local label=$1; shift; echo "== $label"; env "$@" timeout 120 python3 "$R/bench/compare/mooncake_api_bench.py" 2>>"$OUT/mc-bench.err" | sed "s/^{/{\"label\": \"$label\", /" >> "$out"; }
run "kvwire mooncake, shm, one host" KVWIRE_MOONCAKE_TRANSPORT=shm
run "kvwire mooncake, shm, managed target" KVWIRE_MOONCAKE_TRANSPORT=shm MC_BENCH_TARGET_MEMORY=managed
run "kvwire mooncake, tcp, one host" KVWIRE_MOONCAKE_TRANSPORT=tcp
for t in shm tcp; do for op in write read; do for page in 4096 65536 1048576; do
  timeout 60 "$S/kvwire" bench --transport $t --op $op --block-size $page --blocks $(( (256<<20) / page )) --scatter --iters 3 --json 2>>"$OUT/mc-bench.err" | sed "s/^{/{\"label\": \"kvwire Rust path, $t, one host\", /" >> "$out"
  [ $t = shm ] && timeout 60 "$S/kvwire" bench --transport shm --op $op --block-size $page --blocks $(( (256<<20) / page )) --scatter --target-memory plain --iters 3 --json 2>>"$OUT/mc-bench.err" | sed "s/^{/{\"label\": \"kvwire Rust path, shm, plain memory, one host\", /" >> "$out"
done; done; done
echo "== done"; wc -l "$out"; tail -5 "$OUT/mc-bench.err"
