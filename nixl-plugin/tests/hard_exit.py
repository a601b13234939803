"""pytest plugin for scripts/nixl-plugin-peer-tests.sh: end the pytest process
with os._exit(<session status>) once the session is reported, skipping ELF
destructors. In the nixl-cu13 venv, NIXL's UCX plugin (which NIXL's own tests
create, `nixl_agent_config()` defaults to UCX) segfaults at exit inside
libnl-route's destructor (`rtnl_tc_unregister` from `_dl_fini`), with or
without the KVWIRE plugin loaded (`--backend UCX` alone does it too)."""
import os
import sys

_status = 1


def pytest_sessionfinish(session, exitstatus):
    global _status
    _status = int(exitstatus)


def pytest_unconfigure(config):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status)
