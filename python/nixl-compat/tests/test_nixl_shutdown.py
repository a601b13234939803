"""Interpreter shutdown with a daemon thread inside kvwire's core.

NIXL's metadata listener, or a user's thread polling `get_new_notifs`, may
be inside the Rust core with the GIL released when the interpreter exits.
Python < 3.14 ends such a thread with `pthread_exit` as it takes the GIL
back; through the extension's panic guard that aborted the whole process
("FATAL: exception not rethrown", exit 134) in 5 of 5 runs of this script
before `python/src/gil.rs`, and in a quarter of the runs of NIXL's
`expanded_two_peers.py` target.
"""

import subprocess
import sys

import pytest

SCRIPT = """
import threading, time
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("a", nixl_agent_config(backends=[{backend!r}]))
def spin():
    while True:
        agent.get_new_notifs()
threading.Thread(target=spin, daemon=True).start()
time.sleep(0.2)
print("main exiting", flush=True)
"""


@pytest.mark.parametrize("backend", ["KVWIRE_SHM", "KVWIRE_TCP"])
def test_exit_with_a_daemon_thread_polling_the_core_is_clean(backend):
    for _ in range(5):
        r = subprocess.run([sys.executable, "-c", SCRIPT.format(backend=backend)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        assert "main exiting" in r.stdout
