# Sourced by scripts/sglang-real-check.sh and scripts/vllm-real-check.sh:
# the two `mooncake` implementations they compare, each installed into its
# own --target directory that a run selects by PYTHONPATH, and the scratch
# venv the engine under test runs in.

# make_engine_venv VENV MODULE SPEC REQUIREMENTS...: VENV (made when
# missing) with the pinned REQUIREMENTS files and SPEC (the engine's wheel,
# e.g. sglang==0.5.23) installed --no-deps, unless MODULE and torch import
# there already.
make_engine_venv() {
    local venv=$1 module=$2 spec=$3 req=() f
    shift 3
    for f in "$@"; do req+=(-r "$f"); done
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    if ! "$venv/bin/python" -c "import $module, torch" 2>/dev/null; then
        "$venv/bin/pip" install -q "${req[@]}"
        "$venv/bin/pip" install -q --no-deps "$spec"
    fi
}

# install_mooncake_impls VENV DIR IMPL...: "ours" (kvwire's wheel, built by
# `KVWIRE_MOONCAKE_BUILD_ONLY=1 bash scripts/mooncake-tests.sh`, and
# python/mooncake-compat) into DIR/ours, afresh each time; "real"
# (mooncake-transfer-engine-non-cuda 0.3.13.post1 from PyPI; needs
# libibverbs1) into DIR/real once.
install_mooncake_impls() {
    local venv=$1 dir=$2 impl whl
    shift 2
    for impl in "$@"; do
        case $impl in
        ours)
            whl=$(ls target/mooncake-wheels/kvwire-*.whl 2>/dev/null | head -1)
            [ -n "$whl" ] || { echo "no kvwire wheel: run KVWIRE_MOONCAKE_BUILD_ONLY=1 bash scripts/mooncake-tests.sh" >&2; exit 1; }
            rm -rf "$dir/ours"
            "$venv/bin/pip" install -q --no-deps --target "$dir/ours" "$whl" python/mooncake-compat
            ;;
        real)
            [ -d "$dir/real/mooncake" ] ||
                "$venv/bin/pip" install -q --no-deps --target "$dir/real" mooncake-transfer-engine-non-cuda==0.3.13.post1
            ;;
        *) echo "unknown implementation $impl (ours or real)" >&2; exit 2 ;;
        esac
    done
}

# split_run_args [ENV=VAL | -u ENV ...] [-- DRIVER ARGS...]: sets the arrays
# RUN_ENV (assignments for env), RUN_UNSET (-u NAME pairs for env) and
# RUN_ARGS (what follows --).
split_run_args() {
    RUN_ENV=() RUN_UNSET=() RUN_ARGS=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
        case $1 in -u) RUN_UNSET+=(-u "$2"); shift ;; *) RUN_ENV+=("$1") ;; esac
        shift
    done
    [ $# -gt 0 ] && shift
    RUN_ARGS=("$@")
}
