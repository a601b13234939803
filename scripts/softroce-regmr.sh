#!/usr/bin/env bash
# ibv_reg_mr / ibv_dereg_mr seconds per GiB on rxe in the Soft-RoCE guest
# (scripts/softroce-vm.sh), for a buffer of 4 KiB pages, of transparent huge
# pages (madvise MADV_HUGEPAGE) and of hugetlbfs pages (MAP_HUGETLB, 2 MiB;
# the guest reserves them just before that run), each touched before it is
# registered; what backs each buffer (KernelPageSize, AnonHugePages from
# /proc/self/smaps) is printed beside its times
# (crates/kvwire-verbs/examples/reg_mr.rs). Then, in the same boot unless
# SCALE=0, the 112,000-descriptor post (issue 29): `kvwire bench` of one
# WRITE of 112,000 scattered 4 KiB blocks, rxe1 -> rxe0, whose JSON gives
# the caller's prep+post wall and CPU time per descriptor
# (post_ns_per_block, post_cpu_ns_per_block).
#
#   scripts/softroce-regmr.sh             # 1 GiB, 5 rounds each
#   MIB=256 ROUNDS=3 SCALE=0 scripts/softroce-regmr.sh   # smaller, no post bench
#
# The guest is a TCG-emulated x86 (no KVM here): absolute times are those of
# the emulated CPU; the ratios between page sizes are what carries over.
# Skips (exit 0) where the harness cannot run, as scripts/softroce-tests.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$repo/scripts/softroce-lib.sh"
softroce_preflight softroce-regmr "$repo"
cd "$repo"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-1200}
MIB=${MIB:-1024}
# the 1 GiB buffer, the hugetlb pool of the same size, the kernel's own
export SOFTROCE_MEM=${SOFTROCE_MEM:-$((2 * MIB + 1536))}
cargo build --release -p kvwire-verbs --example reg_mr >&2
cargo build --release --bin kvwire >&2
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-softroce-regmr.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp "$CARGO_TARGET_DIR/release/examples/reg_mr" "$stage/reg_mr"
cp "$CARGO_TARGET_DIR/release/kvwire" "$stage/kvwire"
cat > "$stage/regmr.sh" <<'GUEST'
#!/bin/sh
# Runs in the guest (dash + busybox).
set -u
echo "guest: $(uname -r), THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
./reg_mr --device rxe0 --mib "$MIB" --rounds "$ROUNDS" --kinds 4k,thp
echo $((MIB / 2)) > /proc/sys/vm/nr_hugepages
echo "hugetlb pool: $(grep HugePages_Total /proc/meminfo)"
./reg_mr --device rxe0 --mib "$MIB" --rounds "$ROUNDS" --kinds hugetlb
echo 0 > /proc/sys/vm/nr_hugepages
[ "$SCALE" = 0 ] && exit 0
G=$SOFTROCE_GID_IDX
echo "### kvwire bench: one WRITE of 112000 scattered 4 KiB blocks, rxe1 -> rxe0"
./kvwire bench --transport verbs --op write --device rxe1 --target-device rxe0 \
  --option gid_index="$G" --target-option gid_index="$G" \
  --block-size 4096 --blocks 112000 --iters "$SCALE_ITERS" --warmup 1 --lat-iters 1 --scatter --json
GUEST
chmod +x "$stage/regmr.sh"
# serialized with the other guest users (nixl/mooncake-softroce-check.sh)
flock /tmp/kvwire-softroce.lock bash "$softroce_vm" run "$stage" \
  env MIB="$MIB" ROUNDS="${ROUNDS:-5}" SCALE="${SCALE:-1}" SCALE_ITERS="${SCALE_ITERS:-3}" ./regmr.sh
