#!/usr/bin/env bash
# Build the verbs test binaries on the host and run them in the Soft-RoCE
# guest (rxe0 <-> rxe1), see ../shared/softroce/README.md.
#
#   scripts/softroce-tests.sh [extra test-binary args, e.g. a test name filter]
#
# One-time set-up on a new machine (root, downloads ~460 MB):
#   $SOFTROCE_DIR/run-in-softroce-vm.sh --install-deps --prepare
# Exit status: that of the tests (124/125: guest timeout / VM failure).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
softroce=${SOFTROCE_DIR:-$repo/../shared/softroce}
[ -x "$softroce/cargo-test-in-softroce.sh" ] || softroce=/work/shared/softroce
cd "$repo"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-600}
exec "$softroce/cargo-test-in-softroce.sh" --test verbs_transport --test verbs_layer \
  -- --test-threads=1 --nocapture "$@"
