"""The prefill -> decode hand-off shown in docs/PYTHON.md (and the README), verbatim."""


def test_readme_example():
    import numpy as np

    import kvwire

    prefill_kv = np.random.randint(0, 256, (64, 4096), dtype=np.uint8)  # [num_pages, bytes_per_page]
    decode_kv = np.zeros((64, 4096), dtype=np.uint8)
    prefill = kvwire.KVTransferEngine("prefill", [[kvwire.KVCacheMemory(False, [prefill_kv])]])
    decode = kvwire.KVTransferEngine("decode", [[kvwire.KVCacheMemory(False, [decode_kv])]])
    # Metadata and requests cross processes as bytes (ZMQ, HTTP, ...).
    prefill.connect(kvwire.KVTransferEngineMetadata.from_bytes(decode.metadata.to_bytes()))
    req = prefill.initiate_send_transfer("decode", {"0": [1, 2, 3]}, {"0": [10, 11, 12]})
    on_decode = kvwire.TransferReqData.from_json(req.to_json())
    while not decode.is_complete(on_decode):
        pass
    decode.cleanup_transfer(on_decode)
    prefill.sync_and_release(req, timeout_s=30.0)
    assert (decode_kv[10:13] == prefill_kv[1:4]).all()


def test_pip_install_brings_what_the_example_imports():
    # Issue 30, newcomer: `pip install ./python` installs numpy (the example
    # allocates its buffers with it) and msgspec (TransferReqData is a
    # msgspec.Struct, as MAX's); both are what MAX 26.7 itself requires.
    import importlib.metadata
    import re

    requires = {re.split(r"[<>=!~ ;\[]", r, 1)[0].lower() for r in importlib.metadata.requires("kvwire") or []
                if "extra ==" not in r}
    assert {"numpy", "msgspec"} <= requires, requires
