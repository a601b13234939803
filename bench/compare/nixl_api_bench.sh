#!/usr/bin/env bash
# Side-by-side NIXL-API benchmark: bench/compare/nixl_api_bench.py run with
# kvwire's `nixl` (KVWIRE_SHM and the UCX alias), with real nixl-cu12 1.5.1 at
# its defaults, and in NIXL's best same-host configuration
# (UCX_TLS=sysv,posix,self, ucx_error_handling_mode=none, spinning target),
# and real nixl-cu12 1.5.1 with kvwire's backend plugin (KVWIRE over shm,
# NIXL's core unchanged), in one run. Prints a table and writes
# target/nixl-api-bench.json.
#
# Needs: scripts/nixl-tests.sh run once (target/nixl-venv with kvwire + nixl;
# KVWIRE_NIXL_VENV names another such venv), PyPI for `pip install --no-deps
# nixl-cu12==1.5.1 numpy` into target/nixl-ref-venv, and for the plugin case
# scripts/nixl-plugin-tests.sh run once (target/nixl-plugin-venv and
# target/nixl-plugin/libplugin_KVWIRE.so; without them that case is skipped).
# Env: NIXL_BENCH_BYTES, NIXL_BENCH_REPS, NIXL_BENCH_PAGES.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
ours="${KVWIRE_NIXL_VENV:-$root/target/nixl-venv}/bin/python"
ref_venv="$root/target/nixl-ref-venv"
[ -x "$ours" ] || { echo "run scripts/nixl-tests.sh first" >&2; exit 2; }
if [ ! -x "$ref_venv/bin/python" ]; then
    python3 -m venv "$ref_venv"
    "$ref_venv/bin/pip" install -q --no-deps nixl-cu12==1.5.1
    "$ref_venv/bin/pip" install -q numpy
fi
script="$root/bench/compare/nixl_api_bench.py"
out="$root/target/nixl-api-bench.json"
: > "$out"
run() { echo "== $1" >&2; shift; env "$@" >> "$out"; }
run "kvwire nixl, KVWIRE_SHM" NIXL_BENCH_BACKEND=KVWIRE_SHM "$ours" "$script"
run "kvwire nixl, UCX alias" NIXL_BENCH_BACKEND=UCX "$ours" "$script"
run "NIXL 1.5.1 UCX defaults" NIXL_BENCH_MODULE=nixl_cu12 UCX_NET_DEVICES=lo "$ref_venv/bin/python" "$script"
run "NIXL 1.5.1 UCX best" NIXL_BENCH_MODULE=nixl_cu12 UCX_TLS=sysv,posix,self \
    NIXL_BENCH_PARAMS='{"ucx_error_handling_mode":"none"}' "$ref_venv/bin/python" "$script"
plugin_py="$root/target/nixl-plugin-venv/bin/python"
if [ -x "$plugin_py" ] && [ -f "$root/target/nixl-plugin/libplugin_KVWIRE.so" ]; then
    run "NIXL 1.5.1 + KVWIRE plugin (shm)" NIXL_PLUGIN_DIR="$root/target/nixl-plugin" NIXL_BENCH_MODULE=nixl_cu12 \
        NIXL_BENCH_BACKEND=KVWIRE NIXL_BENCH_PARAMS='{"kvwire_transport":"shm"}' "$plugin_py" "$script"
else
    echo "nixl_api_bench: skipping real NIXL + KVWIRE plugin (run scripts/nixl-plugin-tests.sh first)" >&2
fi
"$ours" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print(f"{'impl':34} {'page':>6} {'op':5} {'GB/s':>7} {'prep ns/d':>9} {'make+post ns/d':>14}")
for r in rows:
    tag = f"{r['module']}:{r['backend']}{' TLS=' + r['ucx_tls'] if r['ucx_tls'] else ''}"
    if r["backend"] == "KVWIRE" and r["module"] != "nixl":
        tag += " (plugin)"
    for x in r["results"]:
        print(f"{tag:34} {x['page']:>6} {x['op']:5} {x['gbps']:>7} {x['prep_ns_per_desc']:>9} {x['make_post_ns_per_desc']:>14}")
    print(f"{tag:34} one-page 4 KiB WRITE latency p50 {r['latency_us']['p50']} us, p99 {r['latency_us']['p99']} us")
PY
