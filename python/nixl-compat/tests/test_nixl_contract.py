"""Contract tests of kvwire's `nixl` package in one process: two agents
(and loopback), on the shm and tcp transports, bytes verified."""

import ctypes
import logging
import importlib.metadata
import socket
import time
import uuid

import numpy as np
import pytest

import nixl._bindings as B
import nixl._utils as U
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

KIB = 1024


def agent(backend, **kw):
    return nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[backend], **kw))


def wait(a, h, limit=10.0):
    deadline = time.time() + limit
    while True:
        s = a.check_xfer_state(h)
        if s == "DONE" or time.time() > deadline:
            return s


def buffers(a, b, size, seed=1):
    src = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    ra = a.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
    rb = b.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
    return src, dst, ra, rb


def test_distribution_version_passes_vllms_gate():
    dists = importlib.metadata.packages_distributions()["nixl"]
    version = importlib.metadata.version(dists[0])
    major, minor = (int(x) for x in version.split(".")[:2])
    assert (major, minor) >= (1, 5), version


def test_names_enums_and_errors():
    with pytest.raises(ValueError):
        nixl_agent("")
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        nixl_agent_config(sync_mode=1)
    assert B.NIXL_SUCCESS == 0 and B.NIXL_IN_PROG == 1 and B.NIXL_ERR_NO_TELEMETRY == -12
    assert B.DRAM_SEG == B.nixl_mem_t.DRAM_SEG and B.NIXL_WRITE == 1
    errors = [n for n in dir(B) if n.startswith("nixl") and n.endswith("Error")]
    assert len(errors) == 12 and all(issubclass(getattr(B, n), RuntimeError) for n in errors)
    assert list(nixl_thread_sync_t)[1].value == B.NIXL_THREAD_SYNC_STRICT


def test_descriptor_inputs_and_bad_shapes(backend):
    a = agent(backend)
    assert a.get_xfer_descs([(1, 2, 3, 4)], "DRAM") is None
    assert a.get_xfer_descs([(1, 2, 0)]) is None
    with pytest.raises(KeyError):
        a.get_xfer_descs([(1, 2, 0)], "V-RAM")
    with pytest.raises(KeyError):
        a.make_prepped_xfer("RD", 0, [], 0, [])
    assert a.get_reg_descs(B.nixlXferDList(B.DRAM_SEG)) is None
    arr = np.array([[10, 20, 0], [30, 40, 0]], dtype=np.uint64)
    d = a.get_xfer_descs(arr, "DRAM")
    assert d.descCount() == 2 and d[1] == (30, 40, 0)
    assert a.get_xfer_descs(np.zeros((2, 4), dtype=np.uint64), "DRAM") is None
    r = a.get_reg_descs(arr, "DRAM")
    assert r[0] == (10, 20, 0, b"") and r.trim() == B.nixlXferDList(B.DRAM_SEG, [(10, 20, 0), (30, 40, 0)])
    assert a.deserialize_descs(a.get_serialized_descs(r)) == r


def test_write_read_and_repost_of_a_finished_handle(backend):
    a, b = agent(backend), agent(backend)
    size = 256 * KIB
    src, dst, _, _ = buffers(a, b, size)
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    local = a.get_xfer_descs([(src.ctypes.data, size, 0)], "DRAM")
    remote = a.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", local, remote, b.name, b"w1")
    assert a.transfer(h) in ("DONE", "PROC")
    assert wait(a, h) == "DONE"
    assert np.array_equal(src, dst)
    # Repost the finished handle, with a new notification, after changing the source.
    src[:] = 7
    assert a.transfer(h, b"w2") in ("DONE", "PROC")
    assert wait(a, h) == "DONE" and (dst == 7).all()
    deadline, seen = time.time() + 5, set()
    while seen != {b"w1", b"w2"}:
        seen |= {t for t in (b"w1", b"w2") if t not in seen and b.check_remote_xfer_done(a.name, t)}
        assert time.time() < deadline, b.notifs
    a.release_xfer_handle(h)


def test_small_write_then_released_handles_raise_typed_errors(backend):
    # A 4 KiB WRITE (on shm copied inside transfer()): DONE with the data in
    # place before its notification is seen. Then every use of a released
    # request or dlist handle is nixlInvalidParamError (was a TypeError from
    # int(None)); releasing twice stays a no-op.
    a, b = agent(backend), agent(backend)
    size = 4 * KIB
    src, dst, _, _ = buffers(a, b, size)
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data, size, 0)], "DRAM")
    remote = a.prep_xfer_dlist(b.name, [(dst.ctypes.data, size, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", local, [0], remote, [0], b"small")
    assert a.transfer(h) in ("DONE", "PROC")
    assert wait(a, h) == "DONE"
    deadline = time.time() + 5
    while not b.check_remote_xfer_done(a.name, b"small"):
        assert time.time() < deadline
    assert np.array_equal(src, dst)
    a.release_xfer_handle(h)
    a.release_xfer_handle(h)
    with pytest.raises(B.nixlInvalidParamError):
        a.transfer(h)
    with pytest.raises(B.nixlInvalidParamError):
        a.check_xfer_state(h)
    a.release_dlist_handle(local)
    a.release_dlist_handle(local)
    with pytest.raises(B.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", local, [0], remote, [0])


def test_read_is_posted_by_transfer(backend):
    a, b = agent(backend), agent(backend)
    size = 64 * KIB
    src, dst, _, _ = buffers(a, b, size)
    a.add_remote_agent(b.get_agent_metadata())
    dst[:] = 3
    local = a.get_xfer_descs([(src.ctypes.data, size, 0)], "DRAM")
    remote = a.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM")
    h = a.initialize_xfer("READ", local, remote, b.name)
    with pytest.raises(B.nixlNotPostedError):
        a.check_xfer_state(h)
    a.transfer(h)
    assert wait(a, h) == "DONE" and (src == 3).all()


def test_repost_of_an_active_handle_raises(backend):
    a, b = agent(backend), agent(backend)
    size = 64 << 20
    src, dst, _, _ = buffers(a, b, size)
    a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(src.ctypes.data + i * 4096, 4096, 0) for i in range(size // 4096)], "DRAM")
    remote = a.get_xfer_descs([(dst.ctypes.data + i * 4096, 4096, 0) for i in range(size // 4096)][::-1], "DRAM")
    h = a.initialize_xfer("WRITE", local, remote, b.name)
    for _ in range(10):
        if a.transfer(h) == "PROC":
            with pytest.raises(B.nixlRepostActiveError):
                a.transfer(h)
            break
        # Finished at once: try again (the repost of a finished handle is allowed).
    else:
        pytest.fail("64 MiB in 4 KiB pages never stayed in progress long enough to repost")
    # Releasing the active handle cancels it and returns once nothing moves.
    a.release_xfer_handle(h)


def test_prep_time_not_found(backend):
    a, b = agent(backend), agent(backend)
    src, dst, _, _ = buffers(a, b, 8 * KIB)
    with pytest.raises(B.nixlNotFoundError):
        a.prep_xfer_dlist("", [(src.ctypes.data + 4 * KIB, 8 * KIB, 0)], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(dst.ctypes.data, 8, 0)], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    with pytest.raises(B.nixlNotFoundError):
        a.prep_xfer_dlist(b.name, [(dst.ctypes.data + 1, 8 * KIB, 0)], "DRAM")
    a.prep_xfer_dlist(b.name, [(dst.ctypes.data + 1, 8, 0)], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 8, 0)], "DRAM"),
                          a.get_xfer_descs([(12345, 8, 0)], "DRAM"), b.name)
    assert a.check_remote_metadata(b.name)
    assert a.check_remote_metadata(b.name, a.get_xfer_descs([(dst.ctypes.data, 8, 0)], "DRAM"))
    assert not a.check_remote_metadata(b.name, a.get_xfer_descs([(12345, 8, 0)], "DRAM"))


def test_nx5_strided_lists_expand_and_indices_count_blocks(backend):
    a, b = agent(backend, capture_telemetry=True), agent(backend)
    blocks, block, stride = 8, 1 * KIB, 4 * KIB
    size = blocks * stride
    src, dst, _, _ = buffers(a, b, size)
    a.add_remote_agent(b.get_agent_metadata())
    ls = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[src.ctypes.data, block, 0, stride, blocks]], np.uint64), "DRAM")
    rs = a.prep_xfer_dlist(b.name, np.array([[dst.ctypes.data, block, 0, stride, blocks]], np.uint64), "DRAM")
    with pytest.raises(ValueError):
        a.prep_xfer_dlist(b.name, np.zeros((1, 5), np.uint64))
    li, ri = np.array([7, 0, 3], np.int32), np.array([1, 6, 3], np.int32)
    h = a.make_prepped_xfer("WRITE", ls, li, rs, ri, b"nx5")
    a.transfer(h)
    assert wait(a, h) == "DONE"
    for i, r in zip(li, ri):
        assert np.array_equal(dst[r * stride:r * stride + block], src[i * stride:i * stride + block])
    untouched = [j for j in range(blocks) if j not in ri]
    assert all((dst[j * stride:j * stride + block] == 0).all() for j in untouched)
    t = a.get_xfer_telemetry(h)
    assert (t.descCount, t.totalBytes) == (3, 3 * block)
    # index lists of different widths (int32 array, Python list) still pair up
    h2 = a.make_prepped_xfer("WRITE", ls, np.array([5], np.int32), rs, [2])
    a.transfer(h2)
    assert wait(a, h2) == "DONE"
    assert np.array_equal(dst[2 * stride:2 * stride + block], src[5 * stride:5 * stride + block])
    with pytest.raises(B.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", ls, [blocks], rs, [0])
    a.release_xfer_handle(h)
    a.release_dlist_handle(ls)
    a.release_dlist_handle(rs)


def test_loopback_to_the_own_name(backend):
    a = agent(backend)
    buf = np.zeros(16 * KIB, np.uint8)
    buf[:4 * KIB] = np.arange(4 * KIB) % 251
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    ls = a.prep_xfer_dlist("", [(buf.ctypes.data, 4 * KIB, 0)], "DRAM")
    rs = a.prep_xfer_dlist(a.name, [(buf.ctypes.data + 8 * KIB, 4 * KIB, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", ls, [0], rs, [0], b"self")
    a.transfer(h)
    assert wait(a, h) == "DONE"
    assert np.array_equal(buf[:4 * KIB], buf[8 * KIB:12 * KIB])
    deadline = time.time() + 5
    while not a.check_remote_xfer_done(a.name, b"self"):
        assert time.time() < deadline


def test_standalone_notification_with_a_nul_byte(backend):
    a, b = agent(backend), agent(backend)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    a.send_notif(b.name, b"n\0tification")
    b.send_notif(a.name.encode(), b"back")
    got, deadline = {}, time.time() + 5
    while len(got.get(a.name, [])) < 1 and time.time() < deadline:
        for k, v in b.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
    assert got[a.name] == [b"n\0tification"]
    deadline = time.time() + 5
    while not a.check_remote_xfer_done(b.name, b"ba"):
        assert time.time() < deadline
    with pytest.raises(B.nixlNotFoundError):
        a.send_notif("nobody", b"x")


def _telemetry_run(backend, capture):
    a, b = agent(backend, capture_telemetry=capture), agent(backend)
    src, dst, _, _ = buffers(a, b, 128)
    a.add_remote_agent(b.get_agent_metadata())
    l = a.get_xfer_descs([(src.ctypes.data, 64, 0), (src.ctypes.data + 64, 64, 0)], "DRAM")
    r = a.get_xfer_descs([(dst.ctypes.data, 64, 0), (dst.ctypes.data + 64, 64, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", l, r, b.name, b"t")
    a.transfer(h)
    assert wait(a, h) == "DONE"
    return a, h


def test_telemetry_fields_and_env_precedence(backend, monkeypatch):
    a, h = _telemetry_run(backend, capture=True)
    t = a.get_xfer_telemetry(h)
    assert (t.descCount, t.totalBytes) == (2, 128)
    assert t.startTime > 0 and t.postDuration > 0 and t.xferDuration >= t.postDuration
    assert t.backendName == backend
    a, h = _telemetry_run(backend, capture=False)
    with pytest.raises(B.nixlNoTelemetryError):
        a.get_xfer_telemetry(h)
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    a, h = _telemetry_run(backend, capture=False)
    assert a.get_xfer_telemetry(h).descCount == 2
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "no")
    a, h = _telemetry_run(backend, capture=True)
    with pytest.raises(B.nixlNoTelemetryError):
        a.get_xfer_telemetry(h)


def test_reload_after_reregistering_and_changed_connection_info(backend):
    a, b = agent(backend), agent(backend)
    src, dst, _, _ = buffers(a, b, 4 * KIB)
    a.add_remote_agent(b.get_agent_metadata())
    extra = np.zeros(4 * KIB, np.uint8)
    b.register_memory([(extra.ctypes.data, extra.nbytes, 0, "")], "DRAM")
    with pytest.raises(B.nixlNotFoundError):
        a.prep_xfer_dlist(b.name, [(extra.ctypes.data, 4 * KIB, 0)], "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    rs = a.prep_xfer_dlist(b.name, [(extra.ctypes.data, 4 * KIB, 0)], "DRAM")
    ls = a.prep_xfer_dlist("", [(src.ctypes.data, 4 * KIB, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", ls, [0], rs, [0])
    a.transfer(h)
    assert wait(a, h) == "DONE" and np.array_equal(extra, src)
    impostor = nixl_agent(b.name, nixl_agent_config(backends=[backend]))
    with pytest.raises(B.nixlNotAllowedError):
        a.add_remote_agent(impostor.get_agent_metadata())
    a.remove_remote_agent(b.name)
    assert not a.check_remote_metadata(b.name)
    assert a.add_remote_agent(impostor.get_agent_metadata()) == b.name.encode()


def test_plugins_backends_and_unsupported_features(backend):
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
    assert {"UCX", "KVWIRE_SHM", "KVWIRE_TCP", "KVWIRE_VERBS"} <= set(a.get_plugin_list())
    assert a.get_plugin_params("UVX") == {} and a.get_backend_params("UVX") == {}
    with pytest.raises(B.nixlNotFoundError):
        a.create_backend("UVX")
    a.create_backend(backend, {"num_threads": "2"})
    assert backend in a.backends and "DRAM_SEG" in a.get_backend_mem_types(backend)
    with pytest.raises(B.nixlNotSupportedError, match="FILE/OBJ/BLOCK"):
        a.register_memory([(0, 0, 0, "file")], "FILE")
    with pytest.raises(B.nixlNotSupportedError, match="GPU device API"):
        a.prep_mem_view(None)
    with pytest.raises(B.nixlNotSupportedError):
        a.query_memory([(0, 0, 0, "f")], backend, "FILE")
    other = "KVWIRE_TCP" if backend == "KVWIRE_SHM" else "KVWIRE_SHM"
    with pytest.raises(B.nixlNotSupportedError, match="one kvwire transport per agent"):
        a.create_backend(other)


@pytest.mark.parametrize("key,value", [
    ("peer_timeout_ms", "0"),  # was a silent 1 ms peer timeout
    ("peer_timeout_ms", "abc"),  # was ValueError
    ("peer_timeout_ms", "-5"),  # was OverflowError
    ("peer_timeout_ms", str(86_400_001)),
    ("num_threads", "-1"),  # was silently 2
    ("num_threads", "x"),
])
def test_bad_backend_init_params_raise_invalid_param(backend, key, value):
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
    with pytest.raises(B.nixlInvalidParamError, match=key):
        a.create_backend(backend, {key: value})
    # a good value still works on the same agent
    a.create_backend(backend, {"peer_timeout_ms": "2000", "num_threads": "2"})


def test_metadata_listener_send_fetch_invalidate(backend, caplog):
    target = agent(backend, enable_listen_thread=True, listen_port=0)
    port = target.agent._listener.port
    buf = np.zeros(4096, np.uint8)
    target.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    init = agent(backend, enable_listen_thread=True, listen_port=0)
    init.fetch_remote_metadata(target.name, "127.0.0.1", port)
    init.send_local_metadata("127.0.0.1", port)
    deadline = time.time() + 5
    while not (init.check_remote_metadata(target.name) and target.check_remote_metadata(init.name)):
        assert time.time() < deadline
    init.invalidate_local_metadata("127.0.0.1", port)
    while target.check_remote_metadata(init.name):
        assert time.time() < deadline
    with pytest.raises(B.nixlNotSupportedError, match="etcd"):
        init.send_local_metadata()
    # no listener on the port: logged and returned, as NIXL (which queues
    # these sends to a worker and returns success), never a bare OSError
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with caplog.at_level(logging.ERROR):
        assert init.send_local_metadata("127.0.0.1", port) is None
        assert init.invalidate_local_metadata("127.0.0.1", port) is None
    assert sum(f"127.0.0.1:{port}" in r.getMessage() for r in caplog.records) == 2


def test_metadata_listener_of_a_dropped_agent_lets_it_be_freed(backend):
    """NIXL frees an agent on destruction; its metadata listener held ours
    alive (serving, loadable, its memory registered) after the owner
    dropped it."""
    import gc
    import weakref

    target = agent(backend, enable_listen_thread=True, listen_port=0)
    port = target.agent._listener.port
    gone = weakref.ref(target.agent)
    del target
    gc.collect()
    assert gone() is None, "the dropped agent is still referenced"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_utils_buffers():
    a, b = U.malloc_passthru(256), U.malloc_passthru(256)
    U.ba_buf(a, 256)
    U.ba_buf(b, 256)
    U.verify_transfer(a, b, 256)
    ctypes.memset(b + 17, 0xFF, 1)
    with pytest.raises(AssertionError):
        U.verify_transfer(a, b, 256)
    U.free_passthru(a)
    U.free_passthru(b)


def test_a_silent_peer_holds_only_its_own_add_remote_agent(backend):
    # A peer whose metadata names a data port that never answers (a hung
    # prefill): add_remote_agent of it waits for the handshake (at most
    # peer_timeout_ms) and raises; meanwhile the agent loads and writes to a
    # healthy peer from another thread. The handshake runs without the GIL
    # and without the agent's core lock.
    import select
    import threading

    if backend != "KVWIRE_TCP":
        pytest.skip("the silent peer is made with kvwire tcp's advertise option")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)  # connections complete in the kernel; nobody accepts or answers

    def make(**params):
        x = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
        x.create_backend(backend, {"peer_timeout_ms": "4000", **params})
        return x

    try:
        a, b = make(), make()
        c = make(**{"kvwire.advertise": f"127.0.0.1:{hole.getsockname()[1]}"})
        out = {}

        def load_silent(i):
            try:
                out[i] = a.add_remote_agent(c.get_agent_metadata())
            except Exception as e:  # noqa: BLE001 - the class is checked below
                out[i] = e

        t = threading.Thread(target=load_silent, args=(0,))
        t.start()
        assert select.select([hole], [], [], 10)[0], "the silent peer was never dialled"
        # Two more loads of it queue behind that dial and take its answer
        # (the same error, naming the same local port): one dial, not three
        # in a row.
        queued = [threading.Thread(target=load_silent, args=(i,)) for i in (1, 2)]
        for q in queued:
            q.start()
        src, dst, _, _ = buffers(a, b, 64 * KIB, seed=9)
        assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
        local = a.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM")
        remote = a.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
        h = a.initialize_xfer("WRITE", local, remote, b.name)
        assert a.transfer(h) in ("DONE", "PROC")
        assert wait(a, h) == "DONE" and (dst == src).all()
        a.release_xfer_handle(h)
        assert t.is_alive(), "the healthy peer's load and write waited for the silent one's handshake"
        for x in [t, *queued]:
            x.join(30)
            assert not x.is_alive()
        assert all(isinstance(e, RuntimeError) for e in out.values()) and len(out) == 3, out
        assert len({str(e) for e in out.values()}) == 1, out
        hole.setblocking(False)  # each dial left one connection in the hole's queue
        dials = 0
        while True:
            try:
                hole.accept()[0].close()
                dials += 1
            except BlockingIOError:
                break
        assert dials == 1, f"{dials} dials of the silent peer"
        assert not a.check_remote_metadata(c.name)
    finally:
        hole.close()
