#!/usr/bin/env bash
# Build kvwire's C ABI (capi/: libkvwire_c.so + libkvwire_c.a), check that
# include/kvwire.h matches what cbindgen generates (when cbindgen is
# installed, or always with --regen, which installs it and rewrites the
# header), then compile tests/c/capi_test.c with gcc against both the shared
# and the static library and run it.
#
# Needs: cargo, gcc. On a fresh Debian machine:  apt-get install -y gcc
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
target=${CARGO_TARGET_DIR:-$root/target/capi}
export CARGO_TARGET_DIR=$target

cargo build --manifest-path capi/Cargo.toml
lib=$target/debug

if [ "${1:-}" = "--regen" ]; then
    command -v cbindgen >/dev/null || cargo install --locked cbindgen
    cbindgen --config capi/cbindgen.toml --crate kvwire-capi --output include/kvwire.h capi
elif command -v cbindgen >/dev/null; then
    tmp=$(mktemp)
    cbindgen --config capi/cbindgen.toml --crate kvwire-capi --output "$tmp" capi
    if ! diff -u include/kvwire.h "$tmp"; then
        echo "capi-tests: include/kvwire.h is stale; run scripts/capi-tests.sh --regen" >&2
        exit 1
    fi
    rm -f "$tmp"
fi

out=$target/c-tests
mkdir -p "$out"
cflags=(-std=c11 -Wall -Wextra -Werror -O1 -g -Iinclude)
gcc "${cflags[@]}" tests/c/capi_test.c -L"$lib" -lkvwire_c -Wl,-rpath,"$lib" -o "$out/capi_test_shared"
gcc "${cflags[@]}" tests/c/capi_test.c "$lib/libkvwire_c.a" -lpthread -ldl -lm -o "$out/capi_test_static"
# The header must also compile as C++.
if command -v g++ >/dev/null; then
    echo '#include "kvwire.h"' | g++ -x c++ -std=c++17 -Wall -Werror -Iinclude -fsyntax-only -
fi
"$out/capi_test_shared"
"$out/capi_test_static"
