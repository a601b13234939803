"""Overlapping registrations through `nixl_agent.register_memory`, as vLLM
registers (issue 29 item 2): NIXL 1.5.1 accepts registrations that overlap,
nest in or repeat one another (`nixlLocalSection::addDescList` keeps each),
and so does kvwire. A descriptor must lie inside one registration: one
across two overlapping registrations, inside neither, is NIXL_ERR_NOT_FOUND
at `initialize_xfer` like any unregistered range. Deregistering one keeps
the bytes another still covers registered. shm and tcp, bytes verified."""

import time
import uuid

import numpy as np
import pytest

import nixl._bindings as B
from nixl._api import nixl_agent, nixl_agent_config

PAGE = 4096


def agent(backend):
    return nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[backend]))


def wait(a, h, limit=10.0):
    deadline = time.time() + limit
    while True:
        s = a.check_xfer_state(h)
        if s == "DONE" or time.time() > deadline:
            return s


class Pair:
    def __init__(self, a, b, src, dst):
        self.a, self.b, self.src, self.dst = a, b, src, dst

    def descs(self, lpage, rpage, n):
        local = self.a.get_xfer_descs([(self.src.ctypes.data + lpage * PAGE, n * PAGE, 0)], "DRAM")
        remote = self.a.get_xfer_descs([(self.dst.ctypes.data + rpage * PAGE, n * PAGE, 0)], "DRAM")
        return local, remote

    def write(self, lpage, rpage, n):
        """WRITE `n` pages from source page `lpage` to target page `rpage`."""
        local, remote = self.descs(lpage, rpage, n)
        h = self.a.initialize_xfer("WRITE", local, remote, self.b.name)
        self.a.transfer(h)
        assert wait(self.a, h) == "DONE"
        self.a.release_xfer_handle(h)
        got = self.dst[rpage * PAGE:(rpage + n) * PAGE]
        assert np.array_equal(got, self.src[lpage * PAGE:(lpage + n) * PAGE]), (lpage, rpage, n)

    def refused(self, lpage, rpage, n):
        local, remote = self.descs(lpage, rpage, n)
        before = self.dst.copy()
        with pytest.raises(B.nixlNotFoundError):
            self.a.initialize_xfer("WRITE", local, remote, self.b.name)
        assert np.array_equal(self.dst, before), "nothing moved"


def test_overlapping_nested_and_repeated_registrations(backend):
    a, b = agent(backend), agent(backend)
    src = np.random.default_rng(29).integers(0, 256, 16 * PAGE, dtype=np.uint8)
    dst = np.zeros(16 * PAGE, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    # Initiator: pages [0, 10) and [6, 16), one register_memory call each.
    ra1 = a.register_memory([(s, 10 * PAGE, 0, "")], "DRAM")
    ra2 = a.register_memory([(s + 6 * PAGE, 10 * PAGE, 0, "")], "DRAM")
    # Target: [0, 10) and [6, 16) in one list (vLLM registers its caches as
    # one list), [0, 10) again, and [12, 13) nested inside the second.
    rb_list = b.register_memory([(d, 10 * PAGE, 0, ""), (d + 6 * PAGE, 10 * PAGE, 0, "")], "DRAM")
    rb_again = b.register_memory([(d, 10 * PAGE, 0, "")], "DRAM")
    rb_nested = b.register_memory([(d + 12 * PAGE, PAGE, 0, "")], "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    p = Pair(a, b, src, dst)
    p.write(0, 0, 2)  # inside the first only
    p.write(12, 11, 4)  # inside the second only
    p.write(6, 6, 4)  # the shared pages
    p.write(12, 13, 2)  # past the nested one, inside [6, 16) that starts before it
    p.refused(4, 0, 8)  # local: across [0, 10) and [6, 16), inside neither
    p.refused(0, 4, 8)  # remote: likewise
    assert not a.check_remote_metadata(b.name, a.get_xfer_descs([(d + 4 * PAGE, 8 * PAGE, 0)], "DRAM"))
    assert a.check_remote_metadata(b.name, a.get_xfer_descs([(d + 9 * PAGE, 7 * PAGE, 0)], "DRAM"))

    # Initiator: the first goes; the shared pages stay registered through the
    # second, the first's own pages do not. Then the other order.
    a.deregister_memory(ra1)
    p.write(7, 3, 1)
    p.refused(0, 0, 1)
    ra1 = a.register_memory([(s, 10 * PAGE, 0, "")], "DRAM")
    a.deregister_memory(ra2)
    p.write(9, 5, 1)
    p.refused(15, 0, 1)

    # Target: one of the two identical registrations goes, and the nested
    # one: [0, 10) stays registered through its twin.
    b.deregister_memory(rb_again)
    b.deregister_memory(rb_nested)
    a.add_remote_agent(b.get_agent_metadata())
    p.write(2, 2, 1)
    # Then the list: [0, 10) and [6, 16) are gone, nothing is left.
    b.deregister_memory(rb_list)
    a.add_remote_agent(b.get_agent_metadata())
    p.refused(0, 0, 1)
    with pytest.raises(B.nixlNotFoundError):
        b.deregister_memory(rb_again)
    a.deregister_memory(ra1)


def test_an_identical_registration_is_deregistered_once_per_registration(backend):
    a = agent(backend)
    buf = np.zeros(4 * PAGE, dtype=np.uint8)
    reg = [(buf.ctypes.data, buf.nbytes, 0, "")]
    r1 = a.register_memory(reg, "DRAM")
    r2 = a.register_memory(reg, "DRAM")
    a.deregister_memory(r1)
    # Still registered once: prepping a local list over it works.
    a.prep_xfer_dlist("", [(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
    a.deregister_memory(r2)
    with pytest.raises(B.nixlNotFoundError):
        a.prep_xfer_dlist("", [(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        a.deregister_memory(r1)
