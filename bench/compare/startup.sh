#!/usr/bin/env bash
# Start-up with many network interfaces (issue 29): bench/compare/startup.py
# for kvwire's `nixl` (KVWIRE_SHM, KVWIRE_TCP) and real NIXL 1.5.1 (UCX), each
# in a fresh network namespace with no extra interfaces and with 250 extra
# veth interfaces (125 pairs, each end with an IPv4 address), one run.
# Needs root (ip netns), target/nixl-venv (scripts/nixl-tests.sh) and
# target/nixl-ref-venv (scripts/nixl-real-check.sh). Prints JSON lines.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
ours="$root/target/nixl-venv/bin/python"
ref="$root/target/nixl-ref-venv/bin/python"
script="$root/bench/compare/startup.py"
ns=kvwire-startup-$$
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$ns"
ip -n "$ns" link set lo up
run() {  # label, then env + command
    echo "== $1 ($(ip -n "$ns" -o link | wc -l) interfaces)" >&2; shift
    ip netns exec "$ns" env "$@"
}
for extra in 0 250; do
    if [ "$extra" = 250 ]; then
        for i in $(seq 1 125); do
            ip -n "$ns" link add "va$i" type veth peer name "vb$i"
            ip -n "$ns" addr add "10.$((i / 200 + 100)).$((i % 200)).1/32" dev "va$i"
            ip -n "$ns" addr add "10.$((i / 200 + 110)).$((i % 200)).1/32" dev "vb$i"
            ip -n "$ns" link set "va$i" up
            ip -n "$ns" link set "vb$i" up
        done
    fi
    run "kvwire KVWIRE_SHM" NIXL_BENCH_BACKEND=KVWIRE_SHM "$ours" "$script"
    run "kvwire KVWIRE_TCP" NIXL_BENCH_BACKEND=KVWIRE_TCP "$ours" "$script"
    run "NIXL 1.5.1 UCX" NIXL_BENCH_MODULE=nixl_cu12 NIXL_BENCH_BACKEND=UCX "$ref" "$script" 2>/dev/null | grep '^{'
done
