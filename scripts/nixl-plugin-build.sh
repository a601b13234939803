#!/usr/bin/env bash
# Build libplugin_KVWIRE.so, kvwire's backend plugin for real NIXL 1.5.1
# (the nixl-cu12 / nixl wheels' libnixl.so), from nixl-plugin/ and kvwire's
# C ABI (capi/, linked in statically, its symbols kept local):
#
#   scripts/nixl-plugin-build.sh            # -> target/nixl-plugin/libplugin_KVWIRE.so
#
# Point NIXL at it with NIXL_PLUGIN_DIR=$PWD/target/nixl-plugin (docs/NIXL.md).
# Needs cargo and g++ (C++20). With --check-abi LIBDIR (the directory holding
# the wheel's libnixl.so and plugins/), it also compares the plugin's vtable
# for nixlBackendEngine slot by slot with the wheel's libplugin_POSIX.so.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
command -v g++ >/dev/null || { echo "nixl-plugin-build: no g++ (apt-get install -y g++)" >&2; exit 2; }
target=${CARGO_TARGET_DIR:-$root/target/capi}
CARGO_TARGET_DIR=$target cargo build --release --manifest-path capi/Cargo.toml
out=$root/target/nixl-plugin
mkdir -p "$out"
g++ -std=c++20 -O2 -g -fPIC -shared -Wall -Wextra -Werror -fvisibility=hidden \
    -Iinclude -Inixl-plugin nixl-plugin/kvwire_backend.cpp \
    "$target/release/libkvwire_c.a" -Wl,--exclude-libs,ALL -Wl,--no-undefined -lpthread -ldl -lm \
    -o "$out/libplugin_KVWIRE.so"
# Exactly the two entry points NIXL's plugin manager dlsym()s are exported.
exported=$(nm -D --defined-only "$out/libplugin_KVWIRE.so" | awk '$2=="T"{print $3}' | sort | tr '\n' ' ')
if [ "$exported" != "nixl_plugin_fini nixl_plugin_init " ]; then
    echo "nixl-plugin-build: unexpected exports: $exported" >&2
    exit 1
fi
if [ "${1:-}" = "--check-abi" ]; then
    python3 scripts/nixl_vtable_check.py "$out/libplugin_KVWIRE.so" "$2/plugins/libplugin_POSIX.so"
fi
echo "nixl-plugin-build: built $out/libplugin_KVWIRE.so"
