"""GIL release, buffer lifetime, DLPack and buffer-protocol inputs."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest

import kvwire


def mem(a):
    return kvwire.KVCacheMemory(False, [a])


def test_sync_and_release_releases_the_gil():
    a = kvwire.KVTransferEngine("gil-a", [[mem(np.zeros((4, 64), np.uint8))]])
    b = kvwire.KVTransferEngine("gil-b", [[mem(np.zeros((4, 64), np.uint8))]])
    a.connect(b.metadata)
    req = a.initiate_send_transfer("gil-b", [1], [2])
    ghost = kvwire.TransferReqData.from_json(req.to_json().replace(req.transfer_name, "never"))
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    before = ticks[0]
    with pytest.raises(TimeoutError):
        b.sync_and_release(ghost, timeout_s=0.5)
    during = ticks[0] - before
    stop.set()
    t.join()
    assert during > 1000, f"the other thread ran only {during} iterations while we waited"
    a.sync_and_release(req)
    a.cleanup()
    b.cleanup()


def test_engine_keeps_buffers_alive_until_dropped():
    arr = np.zeros((4, 64), np.uint8)
    ref = weakref.ref(arr)
    eng = kvwire.KVTransferEngine("life", [[mem(arr)]])
    del arr
    gc.collect()
    assert ref() is not None, "a registered buffer was freed"
    eng.cleanup()
    del eng
    gc.collect()
    assert ref() is None, "the buffer leaked after the engine went away"


class DlpackOnly:
    """Exposes only the DLPack protocol (as a CPU torch tensor does)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_and_buffer_protocol_inputs_move_bytes():
    src = np.arange(4 * 64, dtype=np.uint32).astype(np.uint8).reshape(4, 64)
    dst_store = bytearray(4 * 64)
    a = kvwire.KVTransferEngine("dl-a", [[kvwire.KVCacheMemory(False, [DlpackOnly(src)])]])
    b = kvwire.KVTransferEngine("dl-b", [[kvwire.KVCacheMemory(False, [memoryview(dst_store).cast("B", (4, 64))])]])
    a.connect(b.metadata)
    req = a.initiate_send_transfer(b.metadata, [3], [0])
    a.sync_and_release(req)
    assert bytes(dst_store[:64]) == src[3].tobytes()
    a.cleanup()
    b.cleanup()
