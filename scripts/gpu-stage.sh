#!/usr/bin/env bash
# Build the GPU check's test executables here (release, feature `cuda`) and
# copy them, stripped, into DIR (default .gpu-stage, git-ignored), so that a
# GPU machine without Rust or network runs them as they are:
#
#   scripts/gpu-stage.sh                           # here
#   GPU_CHECK_BINS=.gpu-stage scripts/gpu-check.sh # there (carry .gpu-stage)
#
# The executables load libcuda and libibverbs at run time, so they need
# nothing from this machine beyond glibc. Prints the staged files and sizes.
#
# Also stages the kvwire Python package (release, abi3: CPython >= 3.9) for
# gpu-check.sh's python row, unpacked in DIR/python (the GPU machine runs it
# with PYTHONPATH, no pip). That needs maturin: from the venv of
# scripts/python-tests.sh (KVWIRE_VENV, default target/python-venv) or PATH;
# without it the package is not staged, with the reason printed, and the
# row says "skip" there. GPU_STAGE_PYTHON=0 leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-stage}
mkdir -p "$dir"
json=$(cargo test -p kvwire --release --features cuda --test cuda_gpu --test cuda_nogpu --test cuda_verbs --no-run \
    --message-format=json 2>/dev/null)
for t in cuda_gpu cuda_nogpu cuda_verbs; do
    exe=$(printf '%s\n' "$json" | grep -F "\"name\":\"$t\"" | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)
    [[ -n "$exe" ]] || { echo "gpu-stage: no executable for $t" >&2; exit 1; }
    cp "$exe" "$dir/$t"
    strip "$dir/$t" 2>/dev/null || true
done

venv=${KVWIRE_VENV:-$(pwd)/target/python-venv}
maturin=$(command -v "$venv/bin/maturin" maturin 2>/dev/null | head -1 || true)
if [[ "${GPU_STAGE_PYTHON:-1}" == 0 ]]; then
    echo "gpu-stage: python package not staged (GPU_STAGE_PYTHON=0)"
elif [[ -z "$maturin" ]]; then
    echo "gpu-stage: python package not staged: no maturin (run scripts/python-tests.sh once)"
else
    wheels=$(mktemp -d)
    "$maturin" build --release --quiet -m python/Cargo.toml -o "$wheels" >&2
    rm -rf "$dir/python"
    python3 -m zipfile -e "$wheels"/kvwire-*.whl "$dir/python"
    rm -rf "$dir/python"/kvwire-*.dist-info "$wheels"
    strip --strip-unneeded "$dir/python/kvwire/"_kvwire*.so 2>/dev/null || true
fi
ls -l "$dir" "$dir/python/kvwire" 2>/dev/null
du -sh "$dir"
