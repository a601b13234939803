#!/usr/bin/env bash
# Build kvwire's C ABI (capi/: libkvwire_c.so + libkvwire_c.a), check that
# include/kvwire.h matches what cbindgen generates (when cbindgen is
# installed, or always with --regen, which installs it and rewrites the
# header), then compile tests/c/capi_test.c with gcc against both the shared
# and the static library and run it, and build and run the example of
# docs/CAPI.md (examples/c/two_engines.c).
#
# Needs: cargo, gcc. On a fresh Debian machine:  apt-get install -y gcc
# Exits non-zero on any failure. Without gcc it prints
# "capi-tests: skipped: <reason>" (a failure with KVWIRE_REQUIRE_CC=1); without
# cbindgen the header check alone is skipped ("skipped (part)"; a failure with
# KVWIRE_REQUIRE_CBINDGEN=1).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
. scripts/suite-lib.sh
command -v gcc >/dev/null || suite_unavailable capi-tests KVWIRE_REQUIRE_CC "no gcc (apt-get install -y gcc)"
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
    echo "capi-tests: include/kvwire.h matches cbindgen's output"
else
    suite_part_skipped capi-tests KVWIRE_REQUIRE_CBINDGEN \
        "header check: no cbindgen (cargo install --locked cbindgen)"
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
# The example of docs/CAPI.md, built as that page says.
gcc -std=c11 -Wall -Wextra -Werror -Iinclude examples/c/two_engines.c -L"$lib" -lkvwire_c -Wl,-rpath,"$lib" \
    -o "$out/two_engines"
"$out/two_engines"
# The two-host example (run across network namespaces by scripts/netns-tests.sh),
# here on one host over loopback.
gcc -std=c11 -D_DEFAULT_SOURCE -Wall -Wextra -Werror -Iinclude examples/c/remote.c -L"$lib" -lkvwire_c \
    -Wl,-rpath,"$lib" -o "$out/remote"
md=$(mktemp -u "${TMPDIR:-/tmp}/kvwire-capi-md.XXXXXX")
"$out/remote" target "$md" "listen=127.0.0.1:0" & tpid=$!
"$out/remote" initiator "$md" "listen=127.0.0.1:0"
wait "$tpid"
rm -f "$md"
