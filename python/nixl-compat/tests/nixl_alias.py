"""Run the suite against the bare real-NIXL wheel: with
KVWIRE_NIXL_TEST_MODULE=nixl_cu12 (nixl-cu12 installed with --no-deps has no
top-level `nixl`), `nixl`, `nixl._api` and `nixl._bindings` are that wheel's
modules. Imported first by conftest.py and by the peer processes."""

import importlib
import os
import sys

_MOD = os.environ.get("KVWIRE_NIXL_TEST_MODULE", "")
if _MOD and _MOD != "nixl":
    sys.modules["nixl"] = importlib.import_module(_MOD)
    for _sub in ("_api", "_bindings"):
        sys.modules["nixl." + _sub] = importlib.import_module(_MOD + "." + _sub)
