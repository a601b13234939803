"""Contract of mooncake.engine.TransferEngine (kvwire) in one process: every
call, its Mooncake return codes, bytes verified, on shm and tcp."""

import ctypes
import importlib
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import mooncake.engine as me
from mooncake import _rpc
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

PAGE = 4096


def reg(engine, n, fill=None):
    a = np.zeros(n, dtype=np.uint8) if fill is None else np.frombuffer(np.random.default_rng(fill).bytes(n),
                                                                         dtype=np.uint8).copy()
    assert engine.register_memory(a.ctypes.data, a.nbytes) == 0
    return a


def opened(engines, fill):
    """(a, b, src, dst): a page registered on each engine, written from a
    to b once (the session open, b's description cached by a)."""
    a, b = engines
    src, dst = reg(a, PAGE, fill=fill), reg(b, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    return a, b, src, dst


def register_again(engine, a):
    """Unregister `a` and register it again: new keys at the same address,
    so a peer's cached description of `engine` is stale."""
    assert engine.unregister_memory(a.ctypes.data) == 0
    assert engine.register_memory(a.ctypes.data, a.nbytes) == 0


# -- setup ----------------------------------------------------------------

def test_initialize_p2p_session_and_rpc_port(transport):
    e = TransferEngine()
    assert e.get_rpc_port() == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    port = e.get_rpc_port()
    assert 15000 <= port <= 17000
    assert e.session_id == f"127.0.0.1:{port}"
    assert e._transport == transport
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1, "a second initialize must fail"
    e.close()


def test_rpc_port_range_env(transport, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("MC_MIN_RPC_PORT", str(free))
    monkeypatch.setenv("MC_MAX_RPC_PORT", str(free))
    e = TransferEngine()
    assert e.initialize("127.0.0.1:12345", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.get_rpc_port() == free
    e2 = TransferEngine()
    assert e2.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1, "the only port is taken"
    e.close()


def test_initialize_ext_and_bad_arguments(transport):
    e = TransferEngine()
    assert e.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    e.close()
    assert TransferEngine().initialize("127.0.0.1", "http://127.0.0.1:8080/metadata", "tcp", "") == -1
    assert TransferEngine().initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == -1
    assert TransferEngine().initialize("", "P2PHANDSHAKE", "tcp", "") == -1


def test_failed_initialize_can_be_retried(transport):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "etcd://127.0.0.1:1", "efa", "") == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e._etcd is None, "the failed etcd attempt left nothing behind"
    assert e.send_probe(e.session_id) == 0
    e.close()


def test_protocol_to_transport_rule(monkeypatch):
    monkeypatch.delenv("KVWIRE_MOONCAKE_TRANSPORT", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setattr(me, "_active_rdma_port", lambda: False)
    assert me.transport_for("tcp", "127.0.0.1") == ("shm", "")
    assert me.transport_for("tcp", "localhost") == ("shm", "")
    assert me.transport_for("rdma", "127.0.0.1") == ("shm", ""), "rdma without a NIC falls back like Mooncake"
    assert me.transport_for("tcp", "192.0.2.7") == ("tcp", "")
    t, why = me.transport_for("efa", "127.0.0.1")
    assert t is None and "efa" in why
    monkeypatch.setattr(me, "_active_rdma_port", lambda: True)
    assert me.transport_for("rdma", "192.0.2.7") == ("verbs", "")
    assert me.transport_for("tcp", "192.0.2.7") == ("tcp", "")
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert me.transport_for("rdma", "127.0.0.1") == ("tcp", "")
    monkeypatch.setenv("MC_FORCE_TCP", "false")
    assert me.transport_for("rdma", "192.0.2.7") == ("verbs", "")
    monkeypatch.setenv("KVWIRE_MOONCAKE_TRANSPORT", "tcp")
    assert me.transport_for("rdma", "127.0.0.1") == ("tcp", "")
    monkeypatch.setenv("KVWIRE_MOONCAKE_TRANSPORT", "carrier-pigeon")
    assert me.transport_for("tcp", "127.0.0.1")[0] is None


def test_device_name_forms():
    assert me._first_device("") == ""
    assert me._first_device("mlx5_0") == "mlx5_0"
    assert me._first_device("mlx5_1:1,mlx5_0") == "mlx5_1"
    assert me._first_device('{"0": "mlx5_2,mlx5_3", "1": "mlx5_4"}') == "mlx5_2"
    assert me._first_device('{"0": ["mlx5_5"]}') == "mlx5_5"
    assert me._first_device("{not json") == ""


def test_mc_force_tcp_initializes_tcp(monkeypatch):
    monkeypatch.delenv("KVWIRE_MOONCAKE_TRANSPORT", raising=False)
    monkeypatch.setenv("MC_FORCE_TCP", "true")
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert e._transport == "tcp"
    e.close()


def test_unsupported_protocol_returns_minus_one(monkeypatch):
    monkeypatch.delenv("KVWIRE_MOONCAKE_TRANSPORT", raising=False)
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1


def test_transfer_timeout_env(monkeypatch):
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    assert TransferEngine()._timeout == 30
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    assert TransferEngine()._timeout == 5, "clamped to >= 5 s as Mooncake's binding does"
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "12")
    assert TransferEngine()._timeout == 12


def test_topology_and_unsupported_parts(transport):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert isinstance(e.get_local_topology(), str) and e.get_local_topology().startswith("{")
    with pytest.raises(NotImplementedError, match="torch.distributed"):
        e.get_engine()
    with pytest.raises(NotImplementedError, match="C\\+\\+ engine"):
        e.get_engine_ptr()
    with pytest.raises(NotImplementedError, match="CUDA stream"):
        e.transfer_write_on_cuda("x:1", 0, 0, 1, 0)
    assert e.warmup_efa_segment("x:1") == 0
    for mod in ("mooncake.pg", "mooncake.ep", "mooncake.allocator"):
        sys.modules.pop(mod, None)
        with pytest.raises(ImportError, match="kvwire"):
            importlib.import_module(mod)
    assert TransferOpcode.Read == 0 and TransferOpcode.Write == 1 and me.Write == TransferOpcode.Write
    assert me.SUPPORT_CUDA is False
    assert TransferEngine.TransferOpcode.Write == 1
    with pytest.raises(AttributeError, match="coro-RPC"):
        me.create_rpc_server  # noqa: B018
    assert not hasattr(me, "SharedSegment")
    e.close()


def test_store_imports_and_raises_at_use():
    """Mooncake Store is not provided: its module imports (as Mooncake's own
    test_import_structure.py expects) and fails at the first store operation,
    naming the reason; BufferPool is one class under both names and refuses
    construction."""
    import mooncake
    from mooncake.store import STORE_NOT_PROVIDED, BufferPool, MooncakeDistributedStore, ReplicateConfig

    store = MooncakeDistributedStore()
    for call in (lambda: store.setup("h", "P2PHANDSHAKE", 1 << 30, 1 << 28, "tcp", "", "127.0.0.1:50051"),
                 lambda: store.put("k", b"v"), lambda: store.get("k"),
                 lambda: store.register_buffer(0, 4096), lambda: store.close()):
        with pytest.raises(NotImplementedError, match="Mooncake Store is not provided by kvwire"):
            call()
    with pytest.raises(AttributeError, match="not provided by kvwire"):
        store.no_such_operation  # noqa: B018
    assert not hasattr(store, "no_such_operation")
    cfg = ReplicateConfig()
    assert (cfg.replica_num, cfg.with_soft_pin, cfg.preferred_segment, cfg.group_ids) == (1, False, "", None)
    cfg.group_ids = ["group-a", ""]
    assert cfg.group_ids == ["group-a", ""]
    with pytest.raises(AttributeError):
        cfg.no_such_field = 1
    assert mooncake.BufferPool is mooncake.RegisteredBufferPool is BufferPool
    with pytest.raises(NotImplementedError, match="BufferPool"):
        BufferPool(store, 1 << 20)
    assert "transfer engine" in STORE_NOT_PROVIDED
    with pytest.raises(AttributeError):
        mooncake.NoSuchThing  # noqa: B018


# -- memory ---------------------------------------------------------------

def test_register_unregister_and_codes(transport):
    e = TransferEngine()
    a = np.zeros(1 << 16, dtype=np.uint8)
    assert e.register_memory(a.ctypes.data, a.nbytes) < 0, "before initialize"
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.register_memory(a.ctypes.data, a.nbytes, "cpu:0") == 0
    assert e.register_memory(a.ctypes.data, a.nbytes) < 0, "registered twice"
    assert e.register_memory(a.ctypes.data + 4096, 4096) < 0, "overlaps a registration"
    assert e.get_first_buffer_address(e.session_id) == a.ctypes.data
    assert e.unregister_memory(a.ctypes.data) == 0
    assert e.unregister_memory(a.ctypes.data) < 0, "not registered"
    assert e.get_first_buffer_address(e.session_id) == 0
    bufs = [np.zeros(8192, dtype=np.uint8) for _ in range(4)]
    addrs = [b.ctypes.data for b in bufs]
    assert e.batch_register_memory(addrs, [8192] * 4) == 0
    assert e.batch_register_memory(addrs[:1], [8192, 8192]) < 0, "length mismatch"
    assert e.batch_unregister_memory(addrs) == 0
    # all or nothing: the second entry fails, the first is rolled back
    assert e.batch_register_memory([addrs[0], addrs[0]], [8192, 8192]) < 0
    assert e.register_memory(addrs[0], 8192) == 0, "rolled back, so it can be registered again"
    # Overlaps are refused here although kvwire's engine accepts them (as
    # NIXL does): Mooncake refuses them, within one list too, all or nothing.
    assert e.batch_register_memory([addrs[1], addrs[1] + 4096], [8192, 4096]) == -7
    assert e.register_memory(addrs[1], 8192) == 0, "the refused list was rolled back"
    assert e.register_memory(addrs[1] + 4096, 8192) == -7, "overlaps the end of a registration"
    assert e.register_memory(addrs[1] - 4096, 8192) == -7, "overlaps the start of a registration"
    e.close()


def test_managed_buffers_and_bytes(transport):
    e = TransferEngine()
    assert e.allocate_managed_buffer(4096) == 0, "before initialize"
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.get_first_buffer_address(e.session_id) == 0
    p = e.allocate_managed_buffer(1 << 20)
    assert p != 0
    assert e.get_first_buffer_address(e.session_id) == p
    assert e.write_bytes_to_buffer(p + 10, b"abcdef", 6) == 0
    assert e.read_bytes_from_buffer(p + 10, 6) == b"abcdef"
    assert e.write_bytes_to_buffer(p, b"xyz", 2) == 0
    assert e.read_bytes_from_buffer(p, 3) == b"xy\0"
    assert e.allocate_managed_buffer(0) == 0
    # More than this machine has available: 0 at once (its pages would be
    # faulted in at allocation: the OOM killer, not a code, answered before)
    with open("/proc/meminfo") as f:
        avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    assert e.allocate_managed_buffer(2 * avail) == 0
    assert e.get_first_buffer_address(e.session_id) == p
    assert e.free_managed_buffer(p, 1 << 20) == 0
    assert e.free_managed_buffer(p, 1 << 20) < 0
    assert e.get_first_buffer_address(e.session_id) == 0
    e.close()


def test_free_managed_buffer_after_unregister_memory_frees_it(transport):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    p = e.allocate_managed_buffer(1 << 20)
    assert p != 0
    assert e.unregister_memory(p) == 0
    # it used to answer -3 (unregistering again) and keep the memory for good
    assert e.free_managed_buffer(p, 1 << 20) == 0
    assert p not in e._managed
    assert e.free_managed_buffer(p, 1 << 20) < 0, "freed once"
    e.close()


def test_close_then_initialize_starts_from_no_registrations(transport):
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src, dst = reg(a, PAGE, fill=7), reg(b, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    a.close()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    # the old registrations and sessions went with the old core: the same
    # buffer registers again (it answered -7), and transfers from it move
    assert a.get_first_buffer_address(a.session_id) == 0
    assert a.register_memory(src.ctypes.data, PAGE) == 0
    dst[:] = 0
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    assert bytes(dst) == bytes(src)
    a.close()
    b.close()


def test_an_engine_dropped_without_close_is_torn_down(transport):
    """Mooncake has no close(): its destructor frees the engine. An engine
    its owner drops must not stay alive (its rpc server held it) and
    writable by peers in memory the owner may free."""
    import gc
    import weakref

    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src, dst = reg(a, PAGE, fill=8), reg(b, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    session, port, gone = b.session_id, b.get_rpc_port(), weakref.ref(b)
    dst[:] = 0
    del b
    gc.collect()
    assert gone() is None, "the dropped engine is still referenced"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert a.transfer_sync_write(session, src.ctypes.data, dst.ctypes.data, PAGE) < 0
    assert not dst.any(), "a write reached a dropped engine's registration"
    a.close()


def test_bytes_helpers_refuse_negative_lengths_and_non_bytes_sources(transport):
    # A negative length was memmove'd as a huge size_t (SIGSEGV) and read
    # up to the next NUL; an int source was taken as that many zero bytes.
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    p = e.allocate_managed_buffer(4096)
    assert p != 0
    assert e.write_bytes_to_buffer(p, b"keep", 4) == 0
    with pytest.raises(TypeError, match="negative"):
        e.write_bytes_to_buffer(p, b"abc", -1)
    with pytest.raises(TypeError, match="negative"):
        e.read_bytes_from_buffer(p, -1)
    with pytest.raises(TypeError, match="bytes or str"):
        e.write_bytes_to_buffer(p, 5, 5)
    assert e.read_bytes_from_buffer(p, 4) == b"keep", "a refused call wrote nothing"
    assert e.write_bytes_to_buffer(p, "hé", 3) == 0  # str: UTF-8, as Mooncake's char*
    assert e.read_bytes_from_buffer(p, 3) == "hé".encode()
    assert e.free_managed_buffer(p, 4096) == 0
    e.close()


def test_bytes_helpers_take_addresses_and_lengths_as_pybind11_does(transport):
    # A negative address or one past 2**64 was wrapped by ctypes (SIGSEGV,
    # or 2**70 read address 0); a length of 2 GiB or more was cut by
    # ctypes.string_at's C int (2**31 + 16 raised SystemError, 2**32 + 16
    # returned 16 bytes). Floats and strings are no addresses.
    import mmap

    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    p = e.allocate_managed_buffer(4096)
    assert p != 0
    for bad in (-1, 1 << 64, (1 << 64) + 4096, 1 << 70, float(p), str(p)):
        with pytest.raises(TypeError):
            e.write_bytes_to_buffer(bad, b"x", 1)
        with pytest.raises(TypeError):
            e.read_bytes_from_buffer(bad, 8)
    with pytest.raises(TypeError):
        e.read_bytes_from_buffer(p, 8.0)
    assert e.read_bytes_from_buffer(np.uint64(p), 0) == b""
    n = (1 << 31) + 16
    m = mmap.mmap(-1, n)  # untouched: the zero page, read without faulting in 2 GiB
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        m[n - 3:n] = b"end"
        got = e.read_bytes_from_buffer(addr, n)
        assert len(got) == n and got[-3:] == b"end"
        del got, addr
    finally:
        m.close()
    assert e.free_managed_buffer(p, 4096) == 0
    e.close()


def test_floats_and_strings_are_refused_not_truncated(transport):
    # register_memory(float, ...), allocate_managed_buffer(4096.7) and
    # transfer_check_status(1.5) read int(x): 1.5 checked (and freed) batch 1.
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    a = np.zeros(8192, dtype=np.uint8)
    assert e.register_memory(float(a.ctypes.data), 4096) < 0
    assert e.register_memory(a.ctypes.data, 4096.9) < 0
    assert e.register_memory(str(a.ctypes.data), "4096") < 0
    assert e.batch_register_memory([a.ctypes.data], [4096.0]) < 0
    assert e.get_first_buffer_address(e.session_id) == 0, "nothing was registered"
    assert e.register_memory(np.uint64(a.ctypes.data), np.int64(8192)) == 0, "numpy ints are ints"
    assert e.unregister_memory(float(a.ctypes.data)) < 0
    assert e.batch_unregister_memory([str(a.ctypes.data)]) < 0
    assert e.unregister_memory(a.ctypes.data) == 0
    assert e.allocate_managed_buffer(4096.7) == 0
    p = e.allocate_managed_buffer(4096)
    assert p != 0
    assert e.free_managed_buffer(float(p), 4096) < 0
    assert e.free_managed_buffer(p, 4096) == 0
    b = TransferEngine()
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src, dst = reg(e, PAGE, fill=3), reg(b, PAGE)
    bid = e.transfer_submit_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE)
    assert bid != 0
    for bad in (bid + 0.5, float(bid), str(bid)):
        assert e.transfer_check_status(bad) == -1
        assert e.get_batch_transfer_status([bad]) == -1
    assert e.get_batch_transfer_status([bid]) == 0, "the refused checks left the batch alone"
    assert bytes(dst) == bytes(src)
    b.close()
    e.close()


def test_batch_ids_kept_across_close_and_initialize_name_no_new_transfer(transport):
    # The new core numbered its requests from 1 again: an id of the closed
    # engine checked after initialize answered for (and released) a
    # transfer of the new one, whose own status then failed.
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    dst = reg(b, 1 << 20)
    src = reg(a, 1 << 20, fill=4)
    old = [a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [1 << 20])
           for _ in range(4)]
    assert all(old)
    a.close()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    dst[:] = 0
    new = [a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [1 << 20])
           for _ in range(4)]
    assert all(new) and not set(new) & set(old)
    for bid in old:
        assert a.transfer_check_status(bid) == -1, "a closed engine's batch is no transfer of the new one"
    assert a.get_batch_transfer_status(new) == 0
    assert bytes(dst) == bytes(src)
    a.close()
    b.close()


def test_rpc_server_keeps_accepting_after_failed_accepts():
    # EMFILE from accept() (an asker holding many connections) stopped the
    # accept thread for good; now it backs off and keeps serving.
    import errno

    class Flaky:
        def __init__(self, sock, failures):
            self.sock, self.failures = sock, failures

        def accept(self):
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    flaky = Flaky(sock, 3)
    server = _rpc.RpcServer(flaky, lambda: b'{"agent": "flaky"}')
    try:
        assert _rpc.describe("127.0.0.1", server.port, timeout=10)["agent"] == "flaky"
        assert flaky.failures == 0, "the three failed accepts were retried"
    finally:
        server.close()


def test_rpc_server_bounds_connections_and_request_frames():
    # 100 silent askers hold at most MAX_OPEN connections (and threads): each
    # new one shuts the oldest down, so a real asker is served at once; a
    # request frame above MAX_REQUEST is refused unread.
    import struct
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = _rpc.RpcServer(sock, lambda: b'{"agent": "bounded"}')
    silent = []
    try:
        for _ in range(100):
            c = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            assert c.recv(64)[4:9] == _rpc.MAGIC  # served: the challenge came
            silent.append(c)
        t = time.monotonic()
        assert _rpc.describe("127.0.0.1", server.port, timeout=10)["agent"] == "bounded"
        assert time.monotonic() - t < _rpc.IO_TIMEOUT_S, "not held up by the silent askers"
        held = [th for th in threading.enumerate() if th.name == "mooncake-kvwire-rpc-conn"]
        assert len(held) <= _rpc.MAX_OPEN
        assert len(server._open) <= _rpc.MAX_OPEN
        closed = 0
        for c in silent[:100 - _rpc.MAX_OPEN]:
            c.settimeout(5)
            closed += c.recv(1) == b""
        assert closed == 100 - _rpc.MAX_OPEN, "the oldest were shut down"
        big = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        big.recv(64)
        big.sendall(struct.pack(">I", _rpc.MAX_REQUEST + 1) + b"M")
        big.settimeout(5)
        try:
            answer = big.recv(64)
        except ConnectionResetError:  # closed with our byte unread
            answer = b""
        assert answer == b"", "closed without an answer"
        big.close()
    finally:
        for c in silent:
            c.close()
        server.close()


def test_managed_memory_is_mapped_by_shm_peers():
    """``allocate_managed_buffer``'s allocator (the core's ``alloc_host``) is
    kvwire-owned memfd memory: an shm target that denies cross-memory attach
    (``cma=deny``) cannot register a numpy buffer by address (nor a part of
    this memory), but registers the whole of this memory, which its peers map
    and write into."""
    from kvwire._kvwire import NixlCore, NixlCoreError
    n = 16 * PAGE
    a = NixlCore(f"mc-memfd-a-{os.getpid()}", "shm", 2, 5000, [])
    b = NixlCore(f"mc-memfd-b-{os.getpid()}", "shm", 2, 5000, [("cma", "deny")])
    src = np.frombuffer(np.random.default_rng(13).bytes(n), dtype=np.uint8).copy()
    a.register(src.ctypes.data, n, "DRAM", 0)
    plain = np.zeros(n, np.uint8)
    with pytest.raises(NixlCoreError) as e:
        b.register(plain.ctypes.data, n, "DRAM", 0)
    assert "cross-memory attach" in e.value.args[1]
    dst = b.alloc_host(n)
    assert ctypes.string_at(dst, n) == bytes(n), "zeroed"
    b.register(dst, n, "DRAM", 0)  # the whole of it, once: its memfd goes to peers
    with pytest.raises(NixlCoreError) as e:
        b.register(dst, n // 2, "DRAM", 0)  # a part of it is plain memory to shm
    assert "cross-memory attach" in e.value.args[1]
    agent = a.load(b.metadata())
    pages = list(range(16))
    rid, total = a.create_scattered("WRITE", [src.ctypes.data + i * PAGE for i in pages], agent,
                                    [dst + (15 - i) * PAGE for i in pages], [PAGE] * 16, None, post=True)
    assert total == n and a.wait(rid, 30.0) == 0
    a.release(rid)
    got = np.frombuffer(ctypes.string_at(dst, n), dtype=np.uint8).reshape(16, PAGE)
    assert (got[::-1] == src.reshape(16, PAGE)).all()
    b.deregister(dst, n)
    b.free_host(dst)
    with pytest.raises(NixlCoreError):
        b.free_host(dst)
    with pytest.raises(ValueError):
        b.alloc_host(0)


def test_managed_buffer_as_a_transfer_target(engines):
    a, b = engines
    n = 8 * PAGE
    src = reg(a, n, fill=14)
    dst = b.allocate_managed_buffer(n)
    assert dst != 0
    assert a.batch_transfer_sync_write(b.session_id, [src.ctypes.data + i * PAGE for i in range(8)],
                                       [dst + (7 - i) * PAGE for i in range(8)], [PAGE] * 8) == 0
    got = np.frombuffer(b.read_bytes_from_buffer(dst, n), dtype=np.uint8).reshape(8, PAGE)
    assert (got[::-1] == src.reshape(8, PAGE)).all()
    back = reg(a, n)
    assert a.batch_transfer_sync_read(b.session_id, [back.ctypes.data], [dst], [n]) == 0
    assert (back == np.frombuffer(b.read_bytes_from_buffer(dst, n), dtype=np.uint8)).all()
    assert b.free_managed_buffer(dst, n) == 0


# -- transfers ------------------------------------------------------------

def test_sync_write_read_single(engines):
    a, b = engines
    src, dst = reg(a, 1 << 16, fill=1), reg(b, 1 << 16)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data + 100, dst.ctypes.data + 5000, 3000) == 0
    assert (dst[5000:8000] == src[100:3100]).all()
    assert not dst[:5000].any() and not dst[8000:].any(), "only the named range is written"
    back = reg(a, 4096)
    assert a.transfer_sync_read(b.session_id, back.ctypes.data, dst.ctypes.data + 5000, 3000) == 0
    assert (back[:3000] == src[100:3100]).all()
    assert a.transfer_sync(b.session_id, back.ctypes.data, dst.ctypes.data, 16, TransferOpcode.Read) == 0
    assert not back[:16].any()
    assert a.transfer_sync(b.session_id, src.ctypes.data, dst.ctypes.data, 16, TransferOpcode.Write) == 0
    assert (dst[:16] == src[:16]).all()
    assert a.get_first_buffer_address(b.session_id) == dst.ctypes.data


def test_batch_sync_scattered_pages(engines):
    a, b = engines
    n = 512
    src, dst = reg(a, n * PAGE, fill=2), reg(b, n * PAGE)
    perm = np.random.default_rng(3).permutation(n)
    srcs = [src.ctypes.data + i * PAGE for i in range(n)]
    dsts = [dst.ctypes.data + int(p) * PAGE for p in perm]
    assert a.batch_transfer_sync_write(b.session_id, srcs, dsts, [PAGE] * n) == 0
    d, s = dst.reshape(n, PAGE), src.reshape(n, PAGE)
    assert (d[perm] == s).all()
    back = reg(a, n * PAGE)
    backs = [back.ctypes.data + i * PAGE for i in range(n)]
    assert a.batch_transfer_sync_read(b.session_id, backs, dsts, [PAGE] * n) == 0
    assert (back == src).all()
    assert a.batch_transfer_sync(b.session_id, backs[:2], dsts[:2], [PAGE, PAGE], TransferOpcode.Read) == 0
    assert a.batch_transfer_sync_write(b.session_id, [], [], []) == 0, "an empty batch moves nothing"


def test_async_batches_and_submit(engines):
    a, b = engines
    src, dst = reg(a, 64 * PAGE, fill=4), reg(b, 64 * PAGE)
    ids = []
    for half in (0, 32):
        srcs = [src.ctypes.data + (half + i) * PAGE for i in range(32)]
        dsts = [dst.ctypes.data + (half + i) * PAGE for i in range(32)]
        bid = a.batch_transfer_async_write(b.session_id, srcs, dsts, [PAGE] * 32)
        assert bid != 0
        ids.append(bid)
    assert a.get_batch_transfer_status(ids) == 0
    assert (dst == src).all()
    back = reg(a, 64 * PAGE)
    bid = a.batch_transfer_async_read(b.session_id, [back.ctypes.data], [dst.ctypes.data], [64 * PAGE])
    assert bid != 0 and a.get_batch_transfer_status([bid]) == 0
    assert (back == src).all()
    bid = a.batch_transfer_async(b.session_id, [back.ctypes.data], [dst.ctypes.data], [PAGE], TransferOpcode.Read)
    assert bid != 0 and a.get_batch_transfer_status([bid]) == 0

    dst[:] = 0
    bid = a.transfer_submit_write(b.session_id, src.ctypes.data, dst.ctypes.data + PAGE, PAGE)
    assert bid != 0
    deadline = time.monotonic() + 10
    while (rc := a.transfer_check_status(bid)) == 0:
        assert time.monotonic() < deadline
    assert rc == 1
    assert (dst[PAGE:2 * PAGE] == src[:PAGE]).all()
    assert bid not in a._batches, "a finished id is freed"
    assert a.transfer_check_status(bid) == 1, "a freed id answers its final result again"
    assert a.get_batch_transfer_status([bid]) == 0
    assert a.transfer_check_status(12345678) == -1, "an id never handed out"
    assert a.get_batch_transfer_status([12345678]) == -1, "unknown id"


def test_freed_ids_keep_their_answer_for_a_bounded_while(engines, monkeypatch):
    # A thread that checks an id another thread just finished gets that
    # answer; only the last _FINISHED_KEPT freed ids are kept.
    import mooncake.engine as me

    monkeypatch.setattr(me, "_FINISHED_KEPT", 4)
    a, b = engines
    src, dst = reg(a, PAGE, fill=21), reg(b, PAGE)
    ids = []
    for _ in range(6):
        bid = a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [PAGE])
        assert bid != 0 and a.get_batch_transfer_status([bid]) == 0
        ids.append(bid)
    assert len(a._finished) == 4 and not a._batches
    assert [a.transfer_check_status(i) for i in ids] == [-1, -1, 1, 1, 1, 1]


def checker(a, bid, got):
    """A thread body: poll transfer_check_status(bid) until it is not 0 (at
    most 30 s) and append the answer to `got`."""

    def check():
        deadline = time.monotonic() + 30
        while (r := a.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
            pass
        got.append(r)

    return check


def test_check_status_and_batch_status_of_one_id_in_two_threads(engines):
    # get_batch_transfer_status keeps the batch findable while it waits, so
    # a transfer_check_status of the same id meanwhile is never "unknown".
    import threading

    a, b = engines
    src, dst = reg(a, 256 * PAGE, fill=22), reg(b, 256 * PAGE)
    for _ in range(20):
        dst[:] = 0
        bid = a.batch_transfer_async_write(b.session_id, [src.ctypes.data + i * PAGE for i in range(256)],
                                           [dst.ctypes.data + i * PAGE for i in range(256)], [PAGE] * 256)
        assert bid != 0
        got = []
        check = checker(a, bid, got)

        t = threading.Thread(target=check)
        t.start()
        rc = a.get_batch_transfer_status([bid])
        t.join()
        assert (rc, got) == (0, [1]) and (dst == src).all() and not a._batches


def test_failed_async_status(engines):
    a, b = engines
    src, dst = reg(a, PAGE, fill=11), reg(b, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, 8) == 0  # caches b's regions
    dst[:] = 0
    assert b.unregister_memory(dst.ctypes.data) == 0
    # Accepted against the cached description and refused by the target
    # (tcp), or refused at submission (shm checks when it posts): 0 is
    # Mooncake's failed submission, otherwise the status must say -1.
    bid = a.transfer_submit_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE)
    if bid != 0:
        deadline = time.monotonic() + 10
        while (rc := a.transfer_check_status(bid)) == 0:
            assert time.monotonic() < deadline
        assert rc == -1
    bid = a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [PAGE])
    assert bid == 0 or a.get_batch_transfer_status([bid]) == -1
    assert not dst.any()


def test_notifications(engines):
    a, b = engines
    src, dst = reg(a, PAGE, fill=5), reg(b, PAGE)
    assert a.transfer_sync(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE, TransferOpcode.Write,
                           TransferNotify("req-7", "kv done")) == 0
    assert (dst == src).all()
    assert a.batch_transfer_sync(b.session_id, [src.ctypes.data], [dst.ctypes.data], [8], TransferOpcode.Write,
                                 notify=TransferNotify("req-8", "aux")) == 0
    got, deadline = [], time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += b.get_notifies()
        time.sleep(0.01)
    assert sorted((n.name, n.msg) for n in got) == [("req-7", "kv done"), ("req-8", "aux")]
    assert b.get_notifies() == []
    # Nothing to move: the notification still goes (Mooncake sends it when
    # the empty batch completes), in every argument form.
    assert a.transfer_sync(b.session_id, src.ctypes.data, dst.ctypes.data, 0, TransferOpcode.Write,
                           TransferNotify("req-9", "empty")) == 0
    assert a.batch_transfer_sync(b.session_id, [], [], [], TransferOpcode.Read, TransferNotify("req-10", "")) == 0
    assert a.batch_transfer_sync(b.session_id, np.array([src.ctypes.data], np.uint64),
                                 np.array([dst.ctypes.data], np.uint64), np.array([0], np.int64),
                                 TransferOpcode.Write, TransferNotify("req-11", "arrays")) == 0
    got, deadline = [], time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        got += b.get_notifies()
        time.sleep(0.01)
    assert [(n.name, n.msg) for n in got] == [("req-9", "empty"), ("req-10", ""), ("req-11", "arrays")]
    # Lengths that are not all integers 0 are refused, never read as "nothing to move".
    for bad in ([None], [0.0], [np.array([PAGE])]):
        assert a.batch_transfer_sync(b.session_id, [src.ctypes.data], [dst.ctypes.data], bad, TransferOpcode.Write,
                                     TransferNotify("bad", "x")) == -1
    # Past kvwire's 64 KiB notification limit: -1, no bytes moved, nothing delivered.
    dst[:] = 0
    for n in (PAGE, 0):
        assert a.transfer_sync(b.session_id, src.ctypes.data, dst.ctypes.data, n, TransferOpcode.Write,
                               TransferNotify("big", "x" * (64 << 10))) == -1
    time.sleep(0.2)
    assert (dst == 0).all() and b.get_notifies() == []
    # strings, as Mooncake's std::string fields (None is a TypeError there too)
    with pytest.raises(TypeError):
        TransferNotify(None, None)
    with pytest.raises(TypeError):
        TransferNotify("x", 5)
    assert TransferNotify(b"n", b"m") == TransferNotify("n", "m")
    n = TransferNotify("a", "b")
    with pytest.raises(TypeError):
        n.msg = 5
    n.name = "c"
    assert (n.name, n.msg) == ("c", "b")


# -- errors are return codes, not exceptions ------------------------------

def test_remote_range_outside_registrations(engines):
    a, b = engines
    src, dst = reg(a, 4 * PAGE, fill=6), reg(b, 4 * PAGE)
    end = dst.ctypes.data + dst.nbytes
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, end - 10, 20) == -1, "crosses the end"
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, 4096, 16) == -1, "not registered at all"
    assert a.transfer_sync_read(b.session_id, src.ctypes.data, end, 16) == -1
    # a batch with one bad entry fails as a whole and writes nothing (stricter than Mooncake)
    srcs = [src.ctypes.data, src.ctypes.data + PAGE]
    assert a.batch_transfer_sync_write(b.session_id, srcs, [dst.ctypes.data, end], [PAGE, PAGE]) == -1
    assert not dst.any()
    assert a.batch_transfer_async_write(b.session_id, srcs, [dst.ctypes.data, end], [PAGE, PAGE]) == 0
    # the session stays usable
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    assert (dst[:PAGE] == src[:PAGE]).all()


def test_local_buffer_must_be_registered(engines):
    a, b = engines
    dst = reg(b, PAGE)
    loose = np.ones(PAGE, dtype=np.uint8)
    assert a.transfer_sync_write(b.session_id, loose.ctypes.data, dst.ctypes.data, PAGE) == -1
    assert not dst.any()


def test_bad_arguments_are_codes(engines):
    a, b = engines
    src, dst = reg(a, PAGE), reg(b, PAGE)
    assert a.batch_transfer_sync_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [1, 2]) == -1
    assert a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [], [1]) == 0
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, -1) == -1
    assert a.transfer_sync_write("no-port-here", src.ctypes.data, dst.ctypes.data, 8) == -1
    assert a.transfer_sync(b.session_id, src.ctypes.data, dst.ctypes.data, 8, 7) == -1, "no opcode 7"
    assert a.batch_transfer_async(b.session_id, [src.ctypes.data], [dst.ctypes.data], [8], 7) == 0


@pytest.mark.parametrize("form", ["list", "tuple", "numpy"])
def test_batch_argument_forms_and_refusals(engines, form):
    """Lists and tuples go straight into the core (create_scattered), arrays
    through numpy: the same bytes and the same codes either way."""
    a, b = engines
    n = 8
    src, dst = reg(a, n * PAGE, fill=5), reg(b, n * PAGE)
    conv = {"list": list, "tuple": tuple, "numpy": lambda x: np.array(x, dtype=np.int64)}[form]
    srcs = [src.ctypes.data + i * PAGE for i in range(n)]
    dsts = [dst.ctypes.data + (n - 1 - i) * PAGE for i in range(n)]
    lens = [PAGE] * n
    lens[3] = 0  # a zero-length entry moves nothing
    assert a.batch_transfer_sync_write(b.session_id, conv(srcs), conv(dsts), conv(lens)) == 0
    d, s_ = dst.reshape(n, PAGE), src.reshape(n, PAGE)
    for i in range(n):
        assert (d[n - 1 - i] == (0 if i == 3 else s_[i])).all(), i
    assert a.batch_transfer_sync_write(b.session_id, conv(srcs), conv(dsts), conv([0] * n)) == 0
    assert a.batch_transfer_sync_write(b.session_id, conv(srcs), conv(dsts), conv([PAGE] * (n - 1))) == -1
    assert a.batch_transfer_sync_write(b.session_id, conv(srcs), conv(dsts), conv([PAGE, -1] + [PAGE] * (n - 2))) == -1
    assert a.batch_transfer_sync_write(b.session_id, conv([-1] + srcs[1:]), conv(dsts), conv([PAGE] * n)) == -1
    assert a.batch_transfer_sync_write(b.session_id, conv(srcs), conv([dsts[0] + n * PAGE] + dsts[1:]), conv([PAGE] * n)) == -1
    if form != "numpy":
        assert a.batch_transfer_sync_write(b.session_id, conv(["x"] + srcs[1:]), conv(dsts), conv([PAGE] * n)) == -1
        assert a.batch_transfer_sync_write(b.session_id, conv(srcs), conv(dsts), conv([1.5] * n)) == -1
        assert a.batch_transfer_sync_write(b.session_id, conv([2**64] + srcs[1:]), conv(dsts), conv([PAGE] * n)) == -1



def test_numpy_ints_in_lists_move_and_floats_are_refused(engines):
    """Mooncake's pybind11 binding takes any `__index__` int in its lists
    (numpy scalars included); float arrays are refused, never truncated."""
    a, b = engines
    n = 4
    src, dst = reg(a, n * PAGE, fill=21), reg(b, n * PAGE)
    srcs = [src.ctypes.data + i * PAGE for i in range(n)]
    dsts = [dst.ctypes.data + i * PAGE for i in range(n)]
    assert a.batch_transfer_sync_write(b.session_id, [np.int64(x) for x in srcs], [np.uint64(x) for x in dsts],
                                       [np.int32(PAGE)] * n) == 0
    assert (dst == src).all()
    dst[:] = 0
    assert a.transfer_sync_write(b.session_id, np.int64(srcs[1]), np.uint64(dsts[1]), np.int64(PAGE)) == 0
    assert (dst[PAGE:2 * PAGE] == src[PAGE:2 * PAGE]).all() and not dst[:PAGE].any()
    dst[:] = 0
    assert a.batch_transfer_sync_write(b.session_id, [np.float64(srcs[0])], [dsts[0]], [PAGE]) == -1
    assert a.batch_transfer_sync_write(b.session_id, np.array(srcs[:1], np.uint64), np.array(dsts[:1], np.uint64),
                                       np.array([100.9])) == -1
    assert a.batch_transfer_sync_write(b.session_id, np.array(srcs[:1], np.float64), np.array(dsts[:1], np.uint64),
                                       np.array([PAGE])) == -1
    assert not dst.any(), "refused calls moved nothing"

def test_columns_that_repeat_int_objects(engines):
    """The core converts a repeated int object once (the usual
    ``[page_len] * n`` lengths column): values that change mid-column, a
    repeated address and a bad element after repeats still come out right."""
    a, b = engines
    n = 8
    src, dst = reg(a, n * PAGE, fill=11), reg(b, n * PAGE)
    half = int(str(PAGE // 2))  # a distinct object
    lens = [PAGE] * n
    lens[2], lens[5] = half, half
    srcs = [src.ctypes.data + i * PAGE for i in range(n)]
    dsts = [dst.ctypes.data + i * PAGE for i in range(n)]
    assert a.batch_transfer_sync_write(b.session_id, srcs, dsts, lens) == 0
    d, s_ = dst.reshape(n, PAGE), src.reshape(n, PAGE)
    for i in range(n):
        k = PAGE // 2 if i in (2, 5) else PAGE
        assert (d[i, :k] == s_[i, :k]).all() and (d[i, k:] == 0).all(), i
    one = src.ctypes.data
    assert a.batch_transfer_sync_write(b.session_id, [one] * n, dsts, [PAGE] * n) == 0
    assert (d == s_[0]).all(), "one source address repeated n times"
    assert a.batch_transfer_sync_write(b.session_id, srcs, dsts, [PAGE] * (n - 1) + ["x"]) == -1
    assert a.batch_transfer_sync_write(b.session_id, srcs, dsts, [PAGE] * (n - 1) + [-PAGE]) == -1


def test_core_wait_and_one_call_post(engines):
    """The core calls under the sync path: ``create_scattered(post=True)``
    creates and posts in one call and leaves no request behind when the post
    is refused; ``wait`` sleeps until the request ends (GIL released) and
    answers as ``state``."""
    from kvwire._kvwire import NixlCoreError
    a, b = engines
    n = 64
    src, dst = reg(a, n * PAGE, fill=12), reg(b, n * PAGE)
    assert a.batch_transfer_sync_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [8]) == 0
    core, agent = a._core, a._session(b.session_id).agent
    srcs = [src.ctypes.data + i * PAGE for i in range(n)]
    dsts = [dst.ctypes.data + (n - 1 - i) * PAGE for i in range(n)]
    rid, total = core.create_scattered("WRITE", srcs, agent, dsts, [PAGE] * n, None, post=True)
    assert total == n * PAGE
    assert core.wait(rid, 30.0) == 0
    assert core.wait(rid, 0.0) == 0, "a finished request answers at once"
    assert (dst.reshape(n, PAGE)[::-1] == src.reshape(n, PAGE)).all()
    core.release(rid)
    with pytest.raises(NixlCoreError) as e:
        core.create_scattered("WRITE", srcs, agent, [dsts[0] + n * PAGE] + dsts[1:], [PAGE] * n, None, post=True)
    assert e.value.args[0] == -4  # NOT_FOUND, as create's own check says it
    with pytest.raises(NixlCoreError) as e:
        core.state(rid + 1)
    assert "unknown" in e.value.args[1], "the refused request was left behind"
    with pytest.raises(NixlCoreError):
        core.wait(rid, 1.0)  # released: unknown
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            core.wait(rid, bad)
    # Unposted: NOT_POSTED at once, not a wait until the timeout.
    rid2, _ = core.create_scattered("WRITE", srcs, agent, dsts, [PAGE] * n, None)
    t = time.monotonic()
    with pytest.raises(NixlCoreError) as e:
        core.wait(rid2, 30.0)
    assert e.value.args[0] == -1 and time.monotonic() - t < 10
    core.release(rid2)


def test_core_lists_in_blocks_and_reused_descriptor_vectors(engines):
    """``create_scattered`` reads the lists in blocks of rows (items looked
    up and prefetched, then converted) into descriptor vectors that released
    requests leave behind: a bad element in a later block is named by its
    index, and a short request after a long one moves its own rows only (no
    descriptor of the earlier request left over)."""
    a, b = engines
    n, w = 5000, 8  # over the 4,096 descriptors a released vector must hold to be kept
    src, dst = reg(a, n * w, fill=21), reg(b, n * w)
    a.batch_transfer_sync_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [8])
    core, agent = a._core, a._session(b.session_id).agent
    srcs = [src.ctypes.data + i * w for i in range(n)]
    dsts = [dst.ctypes.data + (n - 1 - i) * w for i in range(n)]
    for bad_at in (0, 31, 32, 70, n - 1):
        bad = list(srcs)
        bad[bad_at] = "x"
        with pytest.raises(TypeError, match=f"element {bad_at} is str"):
            core.create_scattered("WRITE", bad, agent, dsts, [w] * n, None)
        neg = list(dsts)
        neg[bad_at] = -5
        with pytest.raises(OverflowError):
            core.create_scattered("WRITE", srcs, agent, neg, [w] * n, None)
    rid, total = core.create_scattered("WRITE", srcs, agent, dsts, [w] * n, None, post=True)
    assert total == n * w and core.wait(rid, 30.0) == 0
    core.release(rid)  # its vectors are kept for the next request
    assert (dst.reshape(n, w)[::-1] == src.reshape(n, w)).all()
    dst[:] = 0
    rid, total = core.create_scattered("WRITE", srcs[:3], agent, dsts[:3], [w] * 3, None, post=True)
    assert total == 3 * w and core.wait(rid, 30.0) == 0
    core.release(rid)
    d = dst.reshape(n, w)
    assert (d[n - 3:][::-1] == src.reshape(n, w)[:3]).all()
    assert (d[:n - 3] == 0).all(), "only the short request's rows moved"
    rid, total = core.create_scattered("WRITE", srcs, agent, dsts, [w] * n, None, post=True)
    assert total == n * w and core.wait(rid, 30.0) == 0
    core.release(rid)
    assert (dst.reshape(n, w)[::-1] == src.reshape(n, w)).all()


def test_unknown_and_dead_sessions(engines):
    a, b = engines
    src = reg(a, PAGE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    t = time.monotonic()
    assert a.transfer_sync_write(closed, src.ctypes.data, 0, 16) == -1
    assert a.batch_transfer_sync_read(closed, [src.ctypes.data], [0], [16]) == -1
    assert a.transfer_submit_write(closed, src.ctypes.data, 0, 16) == 0
    assert a.send_probe(closed) == -102
    assert time.monotonic() - t < 5, "a closed port fails fast"
    # Mooncake's own test name: an unresolvable host (its lookup time is the resolver's)
    assert a.batch_transfer_async_write("unreachable_peer:9", [0], [0], [16]) == 0
    assert a.send_probe("unreachable_peer:9") != 0
    assert a.send_probe(b.session_id) == 0
    assert a.send_probe(a.session_id) == 0
    # a port past 65535 is no session (it used to wrap to port - 65536)
    wrapped = f"127.0.0.1:{int(b.session_id.rsplit(':', 1)[1]) + 65536}"
    assert a.send_probe(wrapped) != 0
    assert a.transfer_sync_write(wrapped, src.ctypes.data, 0, 16) == -1
    assert a.send_probe("127.0.0.1:0") != 0
    # digits other than ASCII are no port (int() refuses "²", reads "٣" as 3)
    for odd in ("127.0.0.1:²", "127.0.0.1:٣", "[::1]:①"):
        assert a.send_probe(odd) != 0
        assert a.transfer_sync_write(odd, src.ctypes.data, 0, 16) == -1
        assert a.batch_transfer_async_write(odd, [src.ctypes.data], [0], [16]) == 0
        assert a.get_first_buffer_address(odd) == 0


def test_peer_registers_after_session_opened(engines):
    a, b = engines
    src, first = reg(a, PAGE, fill=8), reg(b, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, first.ctypes.data, PAGE) == 0
    later = reg(b, PAGE)  # a's cached description does not have it yet
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, later.ctypes.data, PAGE) == 0
    assert (later == src).all()


def test_peer_unregisters_after_session_opened(engines):
    a, b, src, dst = opened(engines, 9)
    dst[:] = 0
    assert b.unregister_memory(dst.ctypes.data) == 0
    # a still caches the old description; the target checks its current registrations
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == -1
    assert not dst.any()


def test_peer_registers_again_at_the_same_address(engines):
    # The target unregisters and registers the same memory again (new keys);
    # the initiator's cached description names the old ones. Mooncake fetches
    # a segment's description again when it changes; so does this package:
    # the refused transfer is posted once more with the new description.
    a, b, src, dst = opened(engines, 12)
    for op in ("write", "read"):
        register_again(b, dst)
        if op == "write":
            dst[:] = 0
            assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
            assert (dst == src).all()
        else:
            src2 = reg(a, PAGE)
            assert a.batch_transfer_sync_read(b.session_id, [src2.ctypes.data], [dst.ctypes.data], [PAGE]) == 0
            assert (src2 == src).all()
    # registered again shorter: the part still registered is reached, the
    # rest refused with nothing written
    assert b.unregister_memory(dst.ctypes.data) == 0
    assert b.register_memory(dst.ctypes.data, PAGE // 2) == 0
    dst[:] = 0
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == -1
    assert not dst.any()
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE // 2) == 0
    assert (dst[:PAGE // 2] == src[:PAGE // 2]).all() and not dst[PAGE // 2:].any()


@pytest.mark.parametrize("reuse", ["cleared", "refilled"])
def test_async_retry_posts_what_was_given_not_the_callers_reused_lists(engines, reuse):
    # Mooncake's binding copies the lists at the call: the caller may clear
    # or refill them for its next batch at once. A batch posted again after
    # a refusal (the target registered again) must move what was given then.
    a, b = engines
    x, y = reg(b, PAGE), reg(b, PAGE)
    s1, s2 = reg(a, PAGE, fill=15), reg(a, PAGE, fill=16)
    assert a.transfer_sync_write(b.session_id, s1.ctypes.data, y.ctypes.data, PAGE) == 0  # session open
    y[:] = 0
    for check in ("get_batch_transfer_status", "transfer_check_status"):
        x[:] = 0
        register_again(b, x)  # new keys, a's description is stale
        bufs, peers, lens = [s1.ctypes.data], [x.ctypes.data], [PAGE]
        bid = a.batch_transfer_async_write(b.session_id, bufs, peers, lens)
        assert bid != 0
        if reuse == "cleared":
            bufs.clear(), peers.clear(), lens.clear()
        else:
            bufs[0], peers[0] = s2.ctypes.data, y.ctypes.data
        if check == "get_batch_transfer_status":
            assert a.get_batch_transfer_status([bid]) == 0
        else:
            deadline = time.monotonic() + 30
            while (r := a.transfer_check_status(bid)) == 0:
                assert time.monotonic() < deadline
            assert r == 1
        assert (x == s1).all(), (reuse, check)
        assert not y.any(), (reuse, check)


def test_a_slow_rpc_port_bounds_the_retry_check(engines, monkeypatch):
    # The description is fetched again with at most 1 s for the rpc port:
    # no call waits the 5 s rpc timeout for it, and a port that did not
    # answer in time does not make the session forgotten.
    a, b, src, dst = opened(engines, 17)
    real = b._server._describe
    monkeypatch.setattr(b._server, "_describe", lambda: time.sleep(3) or real())
    register_again(b, dst)
    t = time.monotonic()
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == -1
    t, took = time.monotonic(), time.monotonic() - t
    bid = a.transfer_submit_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE)
    while bid and (r := a.transfer_check_status(bid)) == 0:
        pass
    took = max(took, time.monotonic() - t)
    assert took < 2.5, f"a refused call took {took:.1f} s"
    assert b.session_id in a._sessions, "not forgotten for a slow answer"
    monkeypatch.setattr(b._server, "_describe", real)
    dst[:] = 0
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    assert (dst == src).all()


def test_two_threads_checking_one_refused_batch(engines):
    # Both poll the same id while it is refused and posted again: one
    # repost, both get 1 (the id is freed once; a thread checking after the
    # free gets the kept answer), the bytes land.
    import threading

    a, b, src, dst = opened(engines, 18)
    for _ in range(4):
        dst[:] = 0
        register_again(b, dst)
        bid = a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [PAGE])
        assert bid != 0
        got = []
        check = checker(a, bid, got)

        threads = [threading.Thread(target=check) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == [1, 1] and (dst == src).all()
        assert not a._batches


def test_close_during_a_retry_is_a_code(engines, monkeypatch):
    import threading

    a, b, src, dst = opened(engines, 19)
    real = b._server._describe
    monkeypatch.setattr(b._server, "_describe", lambda: time.sleep(0.5) or real())  # the retry waits here
    register_again(b, dst)
    got = []

    def call():
        try:
            got.append(a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE))
        except Exception as e:  # noqa: BLE001 - what the test looks for
            got.append(e)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.2)
    a.close()
    t.join(10)
    assert got == [-1]


def test_batch_status_with_an_unknown_id_leaves_the_batches(engines):
    a, b = engines
    src, dst = reg(a, PAGE, fill=20), reg(b, PAGE)
    bid = a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [PAGE])
    assert bid != 0
    assert a.get_batch_transfer_status([bid, 987654]) == -1
    assert a.get_batch_transfer_status([bid, bid]) == 0  # still there; each id once
    assert (dst == src).all() and not a._batches


def test_rpc_exchange_has_one_deadline():
    # A peer that answers in small pieces, each within a socket timeout,
    # used to stretch an exchange to any length; the timeout is now the
    # whole exchange's.
    import threading

    ls = socket.create_server(("127.0.0.1", 0))

    def drip():
        c, _ = ls.accept()
        hello = _rpc.MAGIC + b"n" * 16
        frame = len(hello).to_bytes(4, "big") + hello
        try:
            for byte in frame:
                c.sendall(bytes([byte]))
                time.sleep(0.2)
        except OSError:
            pass
        c.close()

    threading.Thread(target=drip, daemon=True).start()
    t = time.monotonic()
    with pytest.raises(OSError):
        _rpc.describe("127.0.0.1", ls.getsockname()[1], timeout=1.0)
    assert time.monotonic() - t < 1.5
    ls.close()


def test_refused_transfer_to_an_unchanged_target_is_not_retried(engines, monkeypatch):
    # A refusal that a stale description does not explain fails at once:
    # the description is fetched again once, found unchanged, no second post.
    a, b, src, dst = opened(engines, 13)
    posts, stale = [], []  # posts: the first, and each post again (a new request or the same)
    real_submit, real_stale, real_repost = a._submit, a._stale, a._repost
    monkeypatch.setattr(a, "_submit", lambda *x, **k: posts.append(1) or real_submit(*x, **k))
    monkeypatch.setattr(a, "_stale", lambda *x: stale.append(real_stale(*x)) or stale[-1])
    monkeypatch.setattr(a, "_repost", lambda *x: real_repost(*x) and (posts.append(1) or True))
    register_again(b, dst)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    assert (posts, stale) == ([1, 1], [True])
    # b's core refuses the access now (its key deregistered behind the
    # package's back) while b still hands out the description a has
    posts.clear(), stale.clear()
    frozen = b._describe()
    monkeypatch.setattr(b._server, "_describe", lambda: frozen)
    b._core.deregister(dst.ctypes.data, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == -1
    assert len(posts) == 1 and stale == [False]


def test_loopback_to_own_session(engines):
    a, _ = engines
    x, y = reg(a, PAGE, fill=10), reg(a, PAGE)
    assert a.transfer_sync_write(a.session_id, x.ctypes.data, y.ctypes.data, PAGE) == 0
    assert (x == y).all()


def test_transfer_before_initialize_is_a_code():
    e = TransferEngine()
    assert e.transfer_sync_write("127.0.0.1:1", 0, 0, 8) == -1
    assert e.transfer_submit_write("127.0.0.1:1", 0, 0, 8) == 0
    assert e.get_notifies() == []
    assert e.send_probe("127.0.0.1:1") < 0


# -- the rpc port hands metadata only to local or token-holding askers -----

def test_rpc_owner_lookup_finds_this_process():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    assert _rpc.socket_owner_uid(conn.getpeername(), conn.getsockname()) == os.getuid()
    assert _rpc.is_local_same_user(conn)
    for s in (c, conn, srv):
        s.close()


def test_rpc_token(transport, monkeypatch):
    monkeypatch.setenv("KVWIRE_MOONCAKE_TOKEN", "s3cret")
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert _rpc.describe("127.0.0.1", e.get_rpc_port())["agent"] == e.session_id
    monkeypatch.setenv("KVWIRE_MOONCAKE_TOKEN", "wrong")
    with pytest.raises(_rpc.RpcRefused, match="KVWIRE_MOONCAKE_TOKEN"):
        _rpc.describe("127.0.0.1", e.get_rpc_port())
    assert _rpc.probe("127.0.0.1", e.get_rpc_port()), "probes need no token"
    e.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to ask as another uid")
def test_rpc_refuses_another_local_user(transport):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    code = ("import os, sys; sys.path[:0] = %r\n"
            "from mooncake import _rpc\n"
            "import socket; socket.getaddrinfo('127.0.0.1', 1); ''.encode('idna')\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n    _rpc.describe('127.0.0.1', %d); print('served')\n"
            "except _rpc.RpcRefused as e:\n    print('refused', e)\n") % (sys.path, e.get_rpc_port())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.startswith("refused"), out.stdout + out.stderr
    assert "not a local process of this user" in out.stdout
    e.close()


# -- the asker takes a description only from a trusted server ---------------

def _fake_rpc_server(answer):
    """A raw MCKV2 rpc port that answers every describe with `answer`
    (bytes after the "+", i.e. seal + JSON); returns (port, close)."""
    import threading

    ls = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            with c:
                try:
                    _rpc.send_frame(c, _rpc.MAGIC + os.urandom(_rpc.NONCE_BYTES))
                    _rpc.recv_frame(c)
                    _rpc.send_frame(c, b"+" + answer)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return ls.getsockname()[1], ls.close


def test_describe_checks_the_servers_seal_or_uid(transport, monkeypatch):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    real = e._describe()
    port, close = _fake_rpc_server(b"\0" * 32 + real)
    try:
        # a server of this uid here: trusted without a token (its seal is zeros)
        assert _rpc.describe("127.0.0.1", port)["agent"] == e.session_id
        # the same answer from a server that is not ours (the uid lookup
        # finds another owner, or none: another host) is refused
        monkeypatch.setattr(_rpc._net, "tcp_peer_uid", lambda *a: None)
        with pytest.raises(_rpc.RpcUntrusted, match="not a local process of this user"):
            _rpc.describe("127.0.0.1", port)
        monkeypatch.setattr(_rpc._net, "tcp_peer_uid", lambda *a: os.getuid() + 1)
        with pytest.raises(_rpc.RpcUntrusted):
            _rpc.describe("127.0.0.1", port)
        # with a token, a zero (or any forged) seal is refused too ...
        monkeypatch.setenv("KVWIRE_MOONCAKE_TOKEN", "s3cret")
        with pytest.raises(_rpc.RpcUntrusted, match="did not prove KVWIRE_MOONCAKE_TOKEN"):
            _rpc.describe("127.0.0.1", port)
        # ... and a real engine that holds the token proves it: served and trusted
        t = TransferEngine()
        assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert _rpc.describe("127.0.0.1", t.get_rpc_port())["agent"] == t.session_id
        # the transfer path: an untrusted server's session is a code, not an exception
        x = reg(e, PAGE, fill=3)
        assert e.transfer_sync_write(f"127.0.0.1:{port}", x.ctypes.data, 4096, PAGE) == -1
        t.close()
    finally:
        close()
        e.close()


@pytest.mark.parametrize("answer", [
    b"[]", b"not json", b'{"agent": 1}', b'{"agent": "x", "instance": "i", "transport": "%s", "buffers": [[1]],'
    b' "md": "AAAA"}', b'{"agent": "x", "instance": "i", "transport": "%s", "buffers": [], "md": "!!"}',
    b'{"agent": "x", "instance": "i", "transport": "%s", "buffers": [[1, -2]], "md": "AAAA"}',
    b'{"agent": "x", "instance": "i", "transport": "%s", "buffers": [], "md": "AAAA"}',
    b"[" * 200000 + b"]" * 200000,  # RecursionError in json.loads
])
def test_malformed_descriptions_are_codes(transport, answer):
    # a same-uid server (trusted) whose description is malformed: every
    # call that opens the session returns Mooncake's code, none raises
    answer = answer.replace(b"%s", transport.encode())
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    port, close = _fake_rpc_server(b"\0" * 32 + answer)
    try:
        x = reg(e, PAGE, fill=4)
        session = f"127.0.0.1:{port}"
        assert e.transfer_sync_write(session, x.ctypes.data, 4096, PAGE) == -1
        assert e.batch_transfer_sync_read(session, [x.ctypes.data], [4096], [PAGE]) == -1
        assert e.transfer_submit_write(session, x.ctypes.data, 4096, PAGE) == 0
        assert e.get_first_buffer_address(session) == 0
        assert (x == np.frombuffer(np.random.default_rng(4).bytes(PAGE), dtype=np.uint8)).all()
    finally:
        close()
        e.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to serve as another uid")
def test_another_user_on_a_dead_peers_rpc_port_is_not_a_session(monkeypatch):
    # b dies; a process of another user runs an engine of its own and
    # answers on b's rpc port with that engine's description. a must not
    # take it: no address of the impostor's, and a write to its buffer is
    # -1 with not a byte landing there (before the asker checked the
    # server, the write landed). tcp: on shm the kernel already refuses
    # cross-memory attach to another uid.
    monkeypatch.setenv("KVWIRE_MOONCAKE_TRANSPORT", "tcp")
    monkeypatch.delenv("KVWIRE_MOONCAKE_TOKEN", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src, dst = reg(a, PAGE, fill=5), reg(b, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    port, session = b.get_rpc_port(), b.session_id
    b.close()
    a._drop(session)  # a forgets b, as after b's death
    code = ("import os, sys, time, socket, struct; sys.path[:0] = %r\n"
            "import numpy as np\n"
            "from mooncake.engine import TransferEngine\n"
            "e = TransferEngine(); assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
            "buf = np.zeros(%d, dtype=np.uint8); assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', %d)); s.listen(8)\n"
            "print(buf.ctypes.data, flush=True)\n"
            "def frame(c, b): c.sendall(struct.pack('>I', len(b)) + b)\n"
            "def serve():\n"
            "    while True:\n"
            "        c, _ = s.accept()\n"
            "        try:\n"
            "            frame(c, %r + os.urandom(16)); c.recv(4096)\n"
            "            frame(c, b'+' + bytes(32) + e._describe())\n"
            "        except OSError:\n"
            "            pass\n"
            "        c.close()\n"
            "import threading; threading.Thread(target=serve, daemon=True).start()\n"
            "sys.stdin.readline(); print(int(buf.any()), flush=True)\n") % (sys.path, PAGE, port, _rpc.MAGIC)
    imp = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        imp_addr = int(imp.stdout.readline())
        with pytest.raises(_rpc.RpcUntrusted):
            _rpc.describe("127.0.0.1", port)
        assert a.get_first_buffer_address(session) == 0
        assert a.transfer_sync_write(session, src.ctypes.data, imp_addr, PAGE) == -1
        assert a.batch_transfer_sync_write(session, [src.ctypes.data], [imp_addr], [PAGE]) == -1
        imp.stdin.write("\n")
        imp.stdin.flush()
        assert imp.stdout.readline().strip() == "0", "a byte reached the impostor's buffer"
    finally:
        imp.kill()
        imp.wait()
        a.close()


def _relay(to_port):
    """A TCP relay on a port of its own to 127.0.0.1:`to_port` (a process on a
    dead peer's port passing the exchange to a live peer); returns (port,
    bytes it saw from the asker, bytes it saw from the live peer, close)."""
    import threading

    ls = socket.create_server(("127.0.0.1", 0))
    up, down = bytearray(), bytearray()

    def pump(src, dst, seen):
        try:
            while True:
                b = src.recv(65536)
                if not b:
                    break
                seen += b
                dst.sendall(b)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def serve():
        try:
            c, _ = ls.accept()
        except OSError:
            return
        r = socket.create_connection(("127.0.0.1", to_port))
        threading.Thread(target=pump, args=(c, r, up), daemon=True).start()
        pump(r, c, down)

    threading.Thread(target=serve, daemon=True).start()
    return ls.getsockname()[1], up, down, ls.close


def test_a_relay_to_a_live_peer_gets_no_description(transport, monkeypatch):
    # With a token, a process on a dead peer's port (another user: the
    # asker's uid check fails) relays the describe to a live token-holding
    # peer. The asker's proof is bound to the address it dialled, so the
    # live peer refuses it and its description (and secret) never crosses
    # the relay.
    monkeypatch.setenv("KVWIRE_MOONCAKE_TOKEN", "s3cret")
    live = TransferEngine()
    assert live.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    port, up, down, close = _relay(live.get_rpc_port())
    monkeypatch.setattr(_rpc._net, "tcp_peer_uid", lambda *a: None)  # the relay is not ours
    try:
        with pytest.raises(_rpc.RpcRefused, match="relay"):
            _rpc.describe("127.0.0.1", port)
        time.sleep(0.2)
        assert b'"md"' not in bytes(down) and live._instance.encode() not in bytes(down), \
            "the live peer's description crossed the relay"
        # direct, the same token is served (the refusal is the address binding)
        assert _rpc.describe("127.0.0.1", live.get_rpc_port())["agent"] == live.session_id
    finally:
        close()
        live.close()


def test_a_loopback_address_in_a_proof_names_its_namespace():
    # 127.0.0.1:P is the same text in every network namespace and on every
    # host, so a seal for it alone would vouch for another namespace's
    # 127.0.0.1:P to a relay; the bound address also carries the boot id
    # and network namespace (other addresses are bound as they are).
    from kvwire import _net

    here = _net.addr_bytes(("127.0.0.1", 15001))
    assert here.startswith(b"127.0.0.1:15001@") and here == _net.addr_bytes(("::ffff:127.0.0.1", 15001))
    assert _net.addr_bytes(("192.0.2.7", 15001)) == b"192.0.2.7:15001"
    code = "import sys; sys.path[:0] = %r; from kvwire import _net; print(_net.addr_bytes(('127.0.0.1', 15001)))"
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", code % (sys.path,)], capture_output=True, text=True,
                         timeout=30)
    if out.returncode != 0:
        pytest.skip(f"skipped: cannot make a network namespace here ({out.stderr.strip()[:120]})")
    other = eval(out.stdout.strip())  # noqa: S307 - our own child's repr of bytes
    assert other.startswith(b"127.0.0.1:15001@") and other != here


def test_an_overlong_port_is_a_code(engines):
    # int() raises past 4,300 digits: a session (or etcd record) with such a
    # port is Mooncake's code, never an exception
    a, _ = engines
    x = reg(a, PAGE, fill=6)
    name = "127.0.0.1:" + "1" * 5000
    assert a.transfer_sync_write(name, x.ctypes.data, 4096, PAGE) == -1
    assert a.batch_transfer_sync_write(name, [x.ctypes.data], [4096], [PAGE]) == -1
    assert a.get_first_buffer_address(name) == 0
    assert a.send_probe(name) == me.ERR_SOCKET


def test_a_silent_peer_holds_only_its_own_session(monkeypatch):
    # A peer whose rpc port answers but whose data port never does (a hung
    # or overloaded prefill): the first transfer to it waits for its
    # handshake (at most MC_TRANSFER_TIMEOUT) and fails; meanwhile every
    # other call of the engine — first contact with a healthy peer,
    # registration, probes — goes on. Before, the handshake ran under the
    # engine's lock and held them all.
    import select
    import threading

    monkeypatch.setenv("KVWIRE_MOONCAKE_TRANSPORT", "tcp")
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)  # the kernel completes connections; nobody ever accepts or answers
    real = me.NixlCore

    def advertising_the_hole(name, transport, threads, timeout_ms, options):
        return real(name, transport, threads, timeout_ms,
                    options + [("advertise", f"127.0.0.1:{hole.getsockname()[1]}")])

    engines = []
    try:
        for silent in (False, True, False):
            if silent:
                monkeypatch.setattr(me, "NixlCore", advertising_the_hole)
            e = TransferEngine()
            engines.append(e)
            assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            monkeypatch.setattr(me, "NixlCore", real)
        a, c, b = engines
        src, bdst, cdst = reg(a, PAGE, fill=23), reg(b, PAGE), reg(c, PAGE)

        class CountingLoads:
            def __init__(self, core):
                self.core, self.loads = core, 0

            def load(self, md):
                self.loads += threading.current_thread().name.startswith("silent")
                return self.core.load(md)

            def __getattr__(self, attr):
                return getattr(self.core, attr)

        a._core = counting = CountingLoads(a._core)
        rc = {}

        def silent_write(name):
            rc[threading.current_thread().name] = a.transfer_sync_write(name, src.ctypes.data, cdst.ctypes.data,
                                                                          PAGE)

        t = threading.Thread(target=silent_write, args=(c.session_id,), name="silent-0")
        t.start()
        assert select.select([hole], [], [], 10)[0], "the silent peer was never dialled"
        assert t.is_alive()
        # Two more callers of the same peer (one under another name) queue
        # behind that dial and take its failure: one dial, not three in a row.
        alias = f"localhost:{c.session_id.rsplit(':', 1)[1]}"
        queued = [threading.Thread(target=silent_write, args=(n,), name=f"silent-{i}")
                  for i, n in enumerate((c.session_id, alias), 1)]
        for q in queued:
            q.start()
        while sum(s.users for s in a._load_locks.values()) < 3:
            assert t.is_alive(), "the first dial ended before the others queued"
            time.sleep(0.01)
        # All of this while the dial to the silent peer is pending (its
        # first buffer is in its description: no dial needed):
        assert a.get_first_buffer_address(c.session_id) == cdst.ctypes.data
        assert a.transfer_sync_write(b.session_id, src.ctypes.data, bdst.ctypes.data, PAGE) == 0
        assert (bdst == src).all()
        more = reg(a, PAGE)
        assert a.send_probe(b.session_id) == 0
        assert a.batch_transfer_sync_read(b.session_id, [more.ctypes.data], [bdst.ctypes.data], [PAGE]) == 0
        assert (more == src).all()
        assert a.unregister_memory(more.ctypes.data) == 0
        assert t.is_alive(), "the calls above waited for the silent peer's handshake"
        for x in [t, *queued]:
            x.join(30)
            assert not x.is_alive()
        assert set(rc.values()) == {-1} and len(rc) == 3, rc
        assert counting.loads == 1, f"{counting.loads} dials of the silent peer"
        assert (cdst == 0).all()
    finally:
        for e in engines:
            e.close()
        hole.close()


def test_one_peer_under_two_names_shares_its_agent(engines):
    # SGLang names a peer by the host it was told; one machine may be told
    # as 127.0.0.1 and as localhost. The second name's first contact must
    # not reconnect the agent under transfers in flight under the first.
    a, b = engines
    n = 64 << 20
    src, dst, scratch = reg(a, n, fill=41), reg(b, n), reg(a, PAGE)
    alias = f"localhost:{b.session_id.rsplit(':', 1)[1]}"
    assert a.send_probe(b.session_id) == 0
    for round_ in range(3):
        dst[:] = 0
        bid = a.batch_transfer_async_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [n])
        assert bid != 0
        assert a.transfer_sync_read(alias, scratch.ctypes.data, dst.ctypes.data, PAGE) == 0
        assert a.get_batch_transfer_status([bid]) == 0, f"round {round_}: the write under the first name failed"
        assert (dst == src).all()
        if round_ == 0:
            assert alias in a._sessions and b.session_id in a._sessions
            a._sessions.pop(alias)  # the next round's alias contact loads again
    # A dead alias (its rpc port unreachable) is dropped without the agent.
    assert a.transfer_sync_write(alias, scratch.ctypes.data, dst.ctypes.data, PAGE) == 0
    a._drop(alias)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0


def restarted(engine, monkeypatch, host="127.0.0.1"):
    """Close `engine` and start a new one on its rpc port (the same session
    name, another instance): a peer restarted in place, calling itself
    `host` (its agent name is host:port)."""
    port = engine.session_id.rsplit(":", 1)[1]
    engine.close()
    monkeypatch.setenv("MC_MIN_RPC_PORT", port)
    monkeypatch.setenv("MC_MAX_RPC_PORT", port)
    e = TransferEngine()
    assert e.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0
    assert e.session_id == f"{host}:{port}"
    return e


def test_late_failures_of_a_dead_instance_leave_its_restart_alone(engines, monkeypatch):
    # A batch in flight when the peer died, checked only after the session
    # reconnected to the restarted peer, must not unload the new connection
    # (it used to: every transfer in flight to the restart failed).
    a, b = engines
    n = 256 << 20  # still in flight when the peer closes
    src, dst = reg(a, n, fill=43), reg(b, n)
    name = b.session_id
    assert a.transfer_sync_write(name, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    half = n // 2
    seen, old = (a.batch_transfer_async_write(name, [src.ctypes.data + o], [dst.ctypes.data + o], [half])
                 for o in (0, half))
    assert seen != 0 and old != 0
    b2 = restarted(b, monkeypatch)
    try:
        dst2 = reg(b2, n)
        # One failure is seen before the restart is reached: it drops the
        # session it went out on (the dead one's), and the dead peer is known.
        while (r := a.transfer_check_status(seen)) == 0:
            time.sleep(0.01)
        assert r == -1
        # The first transfers may still meet the dead instance (-1); one
        # of them finds it dead and the next one loads the restart.
        for _ in range(20):
            if a.transfer_sync_write(name, src.ctypes.data, dst2.ctypes.data, PAGE) == 0:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the restarted peer was never reached")
        new = a.batch_transfer_async_write(name, [src.ctypes.data], [dst2.ctypes.data], [n])
        assert new != 0
        assert a.transfer_check_status(old) == -1  # cut by the close, checked only now
        assert a.get_batch_transfer_status([new]) == 0, "the old batch's failure unloaded the restarted peer"
        assert (dst2 == src).all()
    finally:
        b2.close()


def test_notify_only_calls_reach_a_restarted_peer(engines, monkeypatch):
    # Calls that move nothing but a notification find a dead session and
    # load the restart as data transfers do (they used to return -1 for
    # ever, until a data transfer dropped the dead session).
    a, b = engines
    src, dst = reg(a, PAGE), reg(b, PAGE)
    name = b.session_id
    assert a.transfer_sync(name, src.ctypes.data, dst.ctypes.data, 0, TransferOpcode.Write,
                           TransferNotify("r", "before")) == 0
    b2 = restarted(b, monkeypatch)
    try:
        got = []
        for i in range(20):  # a notification sent before the death is seen may be lost: send again
            if a.transfer_sync(name, src.ctypes.data, 0, 0, TransferOpcode.Write, TransferNotify("r", str(i))) == 0:
                deadline = time.monotonic() + 1
                while not got and time.monotonic() < deadline:
                    got += b2.get_notifies()
                    time.sleep(0.01)
                if got:
                    break
            time.sleep(0.05)
        assert got and got[0].name == "r", "no notification reached the restarted peer"
    finally:
        b2.close()


@pytest.mark.parametrize("restart_as", ["127.0.0.1", "localhost"])
def test_a_description_of_a_dead_instance_does_not_unload_its_restart(engines, monkeypatch, restart_as):
    # A caller that fetched the peer's description before the peer restarted
    # and loads it after another call loaded the restart fetches again
    # instead of unloading the live connection and the transfers in flight
    # on it: the restart loaded under another name of the same agent, or
    # (restarted under another host name: another agent) under this name.
    import threading

    a, b = engines
    n = 128 << 20
    src, dst = reg(a, n, fill=47), reg(b, PAGE)
    name, alias = b.session_id, f"localhost:{b.session_id.rsplit(':', 1)[1]}"
    real, held, go = _rpc.describe, threading.Event(), threading.Event()

    def describe(*args, **kw):
        d = real(*args, **kw)
        if threading.current_thread().name == "stale" and not go.is_set():
            held.set()
            go.wait(30)
        return d

    monkeypatch.setattr(_rpc, "describe", describe)
    rc = {}
    t = threading.Thread(name="stale", target=lambda: rc.setdefault(
        "stale", a.transfer_sync_write(name, src.ctypes.data, dst.ctypes.data, PAGE)))
    t.start()
    assert held.wait(10)  # it holds the old instance's description
    b2 = restarted(b, monkeypatch, restart_as)
    live = alias if restart_as == "127.0.0.1" else name
    try:
        dst2 = reg(b2, n)
        assert a.transfer_sync_write(live, src.ctypes.data, dst2.ctypes.data, PAGE) == 0
        bid = a.batch_transfer_async_write(live, [src.ctypes.data], [dst2.ctypes.data], [n])
        go.set()
        t.join(30)
        # Its own write names the dead instance's buffer: refused, after it
        # loaded the restart's description.
        assert rc["stale"] == -1
        assert a.get_batch_transfer_status([bid]) == 0, "the stale description unloaded the restarted peer"
        assert (dst2 == src).all()
        assert {name, live} <= set(a._sessions)
    finally:
        b2.close()


def test_notify_only_calls_reload_a_session_whose_agent_was_unloaded(engines):
    # The core answers "unknown remote agent" once the session's agent is no
    # longer loaded (a drop under another name raced with this name's
    # load): the call drops the session, so the next one loads it again
    # (notify-only calls used to fail for ever there).
    a, b = engines
    src, dst = reg(a, PAGE), reg(b, PAGE)
    assert a.transfer_sync_write(b.session_id, src.ctypes.data, dst.ctypes.data, PAGE) == 0
    a._core.forget(a._sessions[b.session_id].agent)
    rcs = [a.transfer_sync(b.session_id, src.ctypes.data, dst.ctypes.data, 0, TransferOpcode.Write,
                           TransferNotify("n", str(i))) for i in range(2)]
    assert rcs == [-1, 0]
    got, deadline = [], time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        got += b.get_notifies()
    assert [x.msg for x in got] == ["1"]


def test_close_and_initialize_start_a_new_instance_with_no_loads_of_the_old(monkeypatch):
    # A load of the closed core still dialling does not hold (or answer for)
    # the loads of the core made by the next initialize, and peers see the
    # re-initialized engine as a new instance.
    import select
    import threading

    monkeypatch.setenv("KVWIRE_MOONCAKE_TRANSPORT", "tcp")
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    real = me.NixlCore
    monkeypatch.setattr(me, "NixlCore", lambda n, t, th, ms, opts: real(
        n, t, th, ms, opts + [("advertise", f"127.0.0.1:{hole.getsockname()[1]}")]))
    c = TransferEngine()
    assert c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    monkeypatch.setattr(me, "NixlCore", real)
    a = TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src, cdst = reg(a, PAGE), reg(c, PAGE)
        t = threading.Thread(target=a.transfer_sync_write, args=(c.session_id, src.ctypes.data, cdst.ctypes.data,
                                                                 PAGE))
        t.start()
        assert select.select([hole], [], [], 10)[0]
        first = a._instance
        a.close()
        assert a._load_locks == {}
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert a._instance != first
        t.join(30)
        assert a._load_locks == {}, "the closed core's load left its slot in the new one"
    finally:
        a.close()
        c.close()
        hole.close()
