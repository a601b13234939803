#!/usr/bin/env python3
"""Drive SGLang 0.5.23's unchanged Mooncake PD-disaggregation code on CPU.

Two processes, as SGLang runs them:
  prefill: publishes a ServerArgs (role=scheduler), starts the
           MooncakeKVBootstrapServer, inits the shared Mooncake engine
           (maybe_init_shared_mooncake_transfer_engine), builds a prefill
           MooncakeKVManager over CPU torch KV/aux buffers, and for every room
           runs MooncakeKVSender: poll -> WaitingForInput, init(num_pages,
           aux_index), send(chunk 1), send(last chunk), poll -> Success.
  decode:  same, DECODE mode: try_ensure_parallel_info, MooncakeKVReceiver,
           init(prefill_dp_rank=0), send_metadata(dst_pages, aux_index),
           poll -> Success, then verifies every destination page byte for byte,
           that no other page changed, and the aux rows.

Which `mooncake` is used is decided by PYTHONPATH (scripts/sglang-real-check.sh
sets it: kvwire's package or the real mooncake-transfer-engine-non-cuda wheel).
Our own harness: SGLang's code is imported from the installed sglang wheel,
never copied here.

Usage: driver.py run [--scenario ok|kill-decode|kill-prefill]
       (spawns the two roles; prints one JSON summary line per role)
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

T0 = time.time()

# ----------------------------------------------------------------- layout
NUM_LAYERS = int(os.environ.get("H_LAYERS", 4))
PAGE_SIZE = 16
HEADS = 2
HEAD_DIM = int(os.environ.get("H_HEAD_DIM", 64))
POOL_PAGES = int(os.environ.get("H_POOL_PAGES", 96))  # pages per pool (per side)
NUM_AUX_ROWS = int(os.environ.get("H_AUX_ROWS", 128))
# aux buffers: (row shape, dtype) as MetadataBuffers-like rows
AUX_SPECS = [((16,), "int32"), ((8,), "float32"), ((1,), "int64")]


def room_plan(n_rooms, seed=1234, base=1000):
    """Deterministic per-room plan shared by both roles: prefill src pages,
    decode dst pages (both non-contiguous), aux indices."""
    import numpy as np

    rng = np.random.default_rng(seed)
    src_free = list(rng.permutation(POOL_PAGES))
    dst_free = list(rng.permutation(POOL_PAGES))
    plans = []
    for i in range(n_rooms):
        n = int(rng.integers(1, int(os.environ.get("H_MAX_PAGES", 12))))
        src = [int(src_free.pop()) for _ in range(n)]
        dst = [int(dst_free.pop()) for _ in range(n)]
        plans.append(
            dict(
                room=base + 7 * i,
                src=src,
                dst=dst,
                src_aux=i % NUM_AUX_ROWS,
                dst_aux=(NUM_AUX_ROWS - 1 - i) % NUM_AUX_ROWS,
            )
        )
    return plans


def page_pattern(layer, kv, page, nbytes):
    import numpy as np

    seed = (layer * 2 + kv) * 100003 + page * 7919 + 17
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def aux_pattern(buf_i, room, nbytes):
    import numpy as np

    return np.random.default_rng(room * 31 + buf_i).integers(
        0, 256, nbytes, dtype=np.uint8
    )


# ------------------------------------------------------------ sglang setup
def setup_sglang(mode, bootstrap_port):
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import publish, SpawnRanks

    sa = ServerArgs(
        model_path="dummy",
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
        host="127.0.0.1",
        device="cpu",
    )
    # What run_scheduler_process does (scheduler.py): publish with placement.
    publish(
        sa,
        role="scheduler",
        ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0),
    )
    # The scheduler builds its process groups (initialize_model_parallel) before
    # the KV manager; with pp_size == 1 the manager only stores pp_group, so
    # state it instead of building torch.distributed groups.
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(pp_group=None)
    # What distributed/bootstrap.py does after device selection.
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine,
        get_mooncake_transfer_engine,
    )

    log(f"sglang imported + context published at +{time.time() - T0:.2f}s")
    t = time.time()
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    log(f"engine init took {time.time() - t:.3f}s")
    eng = get_mooncake_transfer_engine()
    assert eng is not None, "mooncake engine was not initialised"
    eng.engine = TracingEngine(eng.engine)
    return sa, eng


class TracingEngine:
    """Counts the TransferEngine calls SGLang makes and their non-zero
    returns / exceptions (recorded in RESULT as engine_calls)."""

    calls = {}

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def wrapped(*args, **kw):
            c = TracingEngine.calls.setdefault(name, {"n": 0, "nonzero": [], "exc": []})
            c["n"] += 1
            try:
                r = attr(*args, **kw)
            except Exception as e:
                c["exc"].append(repr(e)[:300])
                log(f"engine.{name} raised {e!r}")
                raise
            if isinstance(r, int) and r != 0 and len(c["nonzero"]) < 5:
                c["nonzero"].append(r)
                log(f"engine.{name}(...) -> {r}")
            return r

        return wrapped


def make_buffers(fill):
    """K buffers then V buffers per layer (MHATokenToKVPool layout, torch CPU),
    plus aux rows. fill: 'pattern' (prefill) or 'sentinel' (decode)."""
    import numpy as np
    import torch

    tok = POOL_PAGES * PAGE_SIZE
    kv = []
    for kvi in range(2):
        for layer in range(NUM_LAYERS):
            t = torch.zeros((tok, HEADS, HEAD_DIM), dtype=torch.bfloat16)
            kv.append((layer, kvi, t))
    item_len = kv[0][2][0].nbytes * PAGE_SIZE
    for layer, kvi, t in kv:
        u8 = t.view(torch.uint8).numpy().reshape(POOL_PAGES, item_len)
        if fill == "pattern":
            for p in range(POOL_PAGES):
                u8[p] = page_pattern(layer, kvi, p, item_len)
        else:
            u8[:] = 0xEE
    aux = []
    for shape, dt in AUX_SPECS:
        t = torch.zeros((NUM_AUX_ROWS,) + shape, dtype=getattr(torch, dt))
        t.view(torch.uint8).numpy()[:] = 0xAB if fill != "pattern" else 0
        aux.append(t)
    return kv, item_len, aux


def make_kv_args(kv, item_len, aux, mode):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    kv_args = get_kv_class(TransferBackend.MOONCAKE, KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = None
    kv_args.kv_data_ptrs = [t.data_ptr() for _, _, t in kv]
    kv_args.kv_data_lens = [t.nbytes for _, _, t in kv]
    kv_args.kv_item_lens = [item_len for _ in kv]
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = []
    kv_args.page_size = PAGE_SIZE
    kv_args.aux_data_ptrs = [t.data_ptr() for t in aux]
    kv_args.aux_data_lens = [t.nbytes for t in aux]
    kv_args.aux_item_lens = [t[0].nbytes for t in aux]
    # setup_state_kv_args for a plain MHA pool
    kv_args.state_types = []
    kv_args.state_data_ptrs = []
    kv_args.state_data_lens = []
    kv_args.state_item_lens = []
    kv_args.state_dim_per_tensor = []
    kv_args.state_slice_outer_counts = []
    kv_args.state_layer_ids = []
    kv_args.is_hybrid_mla_backend = False
    kv_args.state_conv_shard_groups = []
    kv_args.swa_kv_cache_layout = None
    kv_args.mla_compression_ratios = None
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    if mode == "prefill":
        kv_args.rust_http_port = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = NUM_LAYERS
    return kv_args


def wait_status(objs, targets, timeout, label):
    """Poll all objs until each is in a terminal state (Success/Failed) or in
    one of `targets`. Returns {room: last status}."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    t0 = time.time()
    last = {}
    while True:
        done = True
        for room, o in objs.items():
            s = o.poll()
            last[room] = s
            if s not in targets and s not in (KVPoll.Success, KVPoll.Failed):
                done = False
        if done:
            return last
        if time.time() - t0 > timeout:
            log(f"{label}: timeout after {timeout}s, states={last}")
            return last
        time.sleep(0.01)


def log(msg):
    print(f"[{os.environ.get('ROLE', '?')} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kvpoll_name(s):
    from sglang.srt.disaggregation.base.conn import KVPoll

    return {v: k for k, v in vars(KVPoll).items() if not k.startswith("_")}.get(s, str(s))


# ------------------------------------------------------------------ roles
def role_prefill(a):
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.disaggregation.mooncake.conn import (
        MooncakeKVBootstrapServer,
        MooncakeKVManager,
        MooncakeKVSender,
    )
    from sglang.srt.runtime_context import get_disagg, get_serving

    sa, eng = setup_sglang("prefill", a.bootstrap_port)
    result = {"role": "prefill", "mooncake": mooncake_origin()}
    # start_disagg_service (managers/disagg_service.py) does exactly this:
    bs = MooncakeKVBootstrapServer(
        host=get_serving().host, port=get_disagg().disaggregation_bootstrap_port
    )
    kv, item_len, aux = make_buffers("pattern")
    kv_args = make_kv_args(kv, item_len, aux, "prefill")
    mgr = MooncakeKVManager(kv_args, DisaggregationMode.PREFILL, sa, False)
    log(f"manager up at +{time.time() - T0:.2f}s, session={mgr.get_session_id()} item_len={item_len}")
    plans = room_plan(a.rooms)
    baddr = f"127.0.0.1:{a.bootstrap_port}"
    senders = {
        p["room"]: MooncakeKVSender(mgr, bootstrap_addr=baddr, bootstrap_room=p["room"])
        for p in plans
    }
    st = wait_status(senders, (KVPoll.WaitingForInput,), a.timeout, "prefill bootstrap")
    log("after bootstrap: " + str({r: kvpoll_name(s) for r, s in st.items()}))
    def send_room(p):
        s = senders[p["room"]]
        # metadata the prefill scheduler writes into its aux row before sending
        for bi, t in enumerate(aux):
            row = t[p["src_aux"]].view(-1).view(__import__("torch").uint8).numpy()
            row[:] = aux_pattern(bi, p["room"], row.size)
        s.init(len(p["src"]), p["src_aux"])
        pages = np.array(p["src"], dtype=np.int32)
        # two chunks when possible (chunked prefill), last chunk carries aux
        cut = len(pages) // 2
        if cut > 0:
            s.send(pages[:cut])
        s.send(pages[cut:])

    todo = [p for p in plans if st[p["room"]] == KVPoll.WaitingForInput]
    if a.scenario == "kill-prefill":
        log("bootstrapped; waiting to be killed")
        time.sleep(3600)
    if a.scenario in ("kill-decode", "kill-decode-restart") and todo:
        # first room goes through (session established), then decode is
        # killed, then the other rooms are sent to the dead session
        send_room(todo[0])
        first = wait_status({todo[0]["room"]: senders[todo[0]["room"]]}, (), a.timeout, "first room")
        log(f"first room: {kvpoll_name(first[todo[0]['room']])}")
        todo = todo[1:]
        open(os.path.join(a.workdir, "prefill.ready"), "w").close()
        while not os.path.exists(os.path.join(a.workdir, "decode.killed")):
            time.sleep(0.05)
        log("decode killed; sending the rest now")
    if a.scenario == "kill-decode-mid":
        open(os.path.join(a.workdir, "prefill.ready"), "w").close()
        log("sending; decode will be killed meanwhile")
    t_send = time.time()
    for p in todo:
        send_room(p)
    st = wait_status(senders, (), a.timeout, "prefill transfer")
    dt = time.time() - t_send
    result["rooms"] = {str(r): kvpoll_name(s) for r, s in st.items()}
    result["send_to_terminal_s"] = round(dt, 3)
    result["failures"] = {
        str(r): failure_text(senders[r]) if st[r] == KVPoll.Failed else None
        for r in senders
    }
    result["ok"] = all(s == KVPoll.Success for s in st.values())
    result["engine_calls"] = TracingEngine.calls
    print("RESULT " + json.dumps(result), flush=True)
    if a.scenario == "kill-decode-restart":
        # phase 2: a new decode process (new session) asks for rooms 5000+
        plans2 = room_plan(a.rooms, base=5000)
        senders2 = {
            p["room"]: MooncakeKVSender(mgr, bootstrap_addr=baddr, bootstrap_room=p["room"])
            for p in plans2
        }
        st2 = wait_status(senders2, (KVPoll.WaitingForInput,), a.timeout, "prefill bootstrap 2")
        log("phase 2 after bootstrap: " + str({r: kvpoll_name(s) for r, s in st2.items()}))
        senders.update(senders2)
        for p in plans2:
            if st2[p["room"]] == KVPoll.WaitingForInput:
                send_room(p)
        st2 = wait_status(senders2, (), a.timeout, "prefill transfer 2")
        r2 = {
            "role": "prefill-phase2",
            "rooms": {str(r): kvpoll_name(s) for r, s in st2.items()},
            "failures": {str(r): failure_text(senders2[r]) for r in senders2 if st2[r] == KVPoll.Failed},
            "ok": all(s == KVPoll.Success for s in st2.values()),
            "engine_calls": TracingEngine.calls,
            "failed_sessions": sorted(getattr(mgr, "failed_sessions", [])),
        }
        print("RESULT2 " + json.dumps(r2), flush=True)
    # keep the bootstrap server alive until decode finished verifying
    done = os.path.join(a.workdir, "decode.done")
    t0 = time.time()
    while not os.path.exists(done) and time.time() - t0 < a.timeout:
        time.sleep(0.1)
    teardown(mgr)
    os._exit(0)


def role_decode(a):
    import numpy as np
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.disaggregation.mooncake.conn import (
        MooncakeKVManager,
        MooncakeKVReceiver,
    )

    sa, eng = setup_sglang("decode", a.bootstrap_port)
    result = {"role": "decode", "mooncake": mooncake_origin()}
    kv, item_len, aux = make_buffers("sentinel")
    kv_args = make_kv_args(kv, item_len, aux, "decode")
    mgr = MooncakeKVManager(kv_args, DisaggregationMode.DECODE, sa, False)
    log(f"manager up at +{time.time() - T0:.2f}s, session={mgr.get_session_id()}")
    baddr = f"127.0.0.1:{a.bootstrap_port}"
    t0 = time.time()
    while not mgr.try_ensure_parallel_info(baddr):
        if time.time() - t0 > a.timeout:
            raise RuntimeError("try_ensure_parallel_info never succeeded")
        time.sleep(0.2)
    plans = room_plan(a.rooms, base=a.room_base)
    recvs = {}
    for p in plans:
        r = MooncakeKVReceiver(mgr, bootstrap_addr=baddr, bootstrap_room=p["room"])
        r.init(0)
        recvs[p["room"]] = r
    st = wait_status(recvs, (KVPoll.WaitingForInput,), a.timeout, "decode prealloc")
    log("after init: " + str({r: kvpoll_name(s) for r, s in st.items()}))
    for p in plans:
        recvs[p["room"]].send_metadata(np.array(p["dst"], dtype=np.int32), p["dst_aux"], None)
    if a.scenario in ("kill-decode", "kill-decode-mid", "kill-decode-restart"):
        open(os.path.join(a.workdir, "decode.metadata_sent"), "w").close()
        log("metadata sent; waiting to be killed")
        time.sleep(3600)
    if a.scenario == "kill-prefill":
        open(os.path.join(a.workdir, "decode.metadata_sent"), "w").close()
        log("metadata sent; prefill will be killed")
    t_meta = time.time()
    st = wait_status(recvs, (), a.timeout, "decode transfer")
    result["rooms"] = {str(r): kvpoll_name(s) for r, s in st.items()}
    result["metadata_to_terminal_s"] = round(time.time() - t_meta, 3)
    result["failures"] = {
        str(r): failure_text(recvs[r]) if st[r] == KVPoll.Failed else None
        for r in recvs
    }
    # ---- verify
    bad = []
    touched = set()
    for p in plans:
        if st[p["room"]] != KVPoll.Success:
            continue
        for layer, kvi, t in kv:
            u8 = t.view(torch.uint8).numpy().reshape(POOL_PAGES, item_len)
            for sp, dp in zip(p["src"], p["dst"]):
                touched.add(dp)
                if not np.array_equal(u8[dp], page_pattern(layer, kvi, sp, item_len)):
                    bad.append(f"room {p['room']} layer {layer} kv {kvi} dst page {dp}")
        for bi, t in enumerate(aux):
            row = t[p["dst_aux"]].view(-1).view(torch.uint8).numpy()
            if not np.array_equal(row, aux_pattern(bi, p["room"], row.size)):
                bad.append(f"room {p['room']} aux buf {bi} row {p['dst_aux']}")
    untouched_bad = 0
    for layer, kvi, t in kv:
        u8 = t.view(torch.uint8).numpy().reshape(POOL_PAGES, item_len)
        for pg in range(POOL_PAGES):
            if pg not in touched and not (u8[pg] == 0xEE).all():
                untouched_bad += 1
    aux_rows = {p["dst_aux"] for p in plans if st[p["room"]] == KVPoll.Success}
    for t in aux:
        u8 = t.view(torch.uint8).numpy().reshape(NUM_AUX_ROWS, -1)
        for r in range(NUM_AUX_ROWS):
            if r not in aux_rows and not (u8[r] == 0xAB).all():
                untouched_bad += 1
    result["pages_verified"] = len(touched) * 2 * NUM_LAYERS
    result["bytes_verified"] = len(touched) * 2 * NUM_LAYERS * item_len
    result["mismatches"] = bad[:10]
    result["num_mismatches"] = len(bad)
    result["stray_writes"] = untouched_bad
    result["ok"] = (
        all(s == KVPoll.Success for s in st.values()) and not bad and untouched_bad == 0
    )
    result["engine_calls"] = TracingEngine.calls
    print("RESULT " + json.dumps(result), flush=True)
    log(f"decode done at +{time.time() - T0:.2f}s")
    open(os.path.join(a.workdir, "decode.done"), "w").close()
    teardown(mgr)
    os._exit(0)


def teardown(mgr):
    """MooncakeKVManager.teardown() (PD role switch path): stops workers,
    deregisters the buffers (batch_unregister_memory)."""
    if os.environ.get("H_TEARDOWN", "0") != "1":
        return
    import faulthandler

    # SGLang's teardown can block in zmq Context.term(); show where after 20 s
    faulthandler.dump_traceback_later(20, exit=False)
    TracingEngine.calls.pop("batch_unregister_memory", None)
    t = time.time()
    try:
        mgr.teardown()
        err = None
    except Exception as e:  # noqa: BLE001
        err = repr(e)
    print("TEARDOWN " + json.dumps({"took_s": round(time.time() - t, 3), "error": err,
          "batch_unregister_memory": TracingEngine.calls.get("batch_unregister_memory")}), flush=True)


def failure_text(obj):
    """SGLang's failure_exception() raises the KVTransferError it describes."""
    try:
        e = obj.failure_exception()
    except Exception as exc:  # noqa: BLE001
        e = exc
    return str(e)[:300]


def mooncake_origin():
    try:
        import mooncake
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            get_mooncake_transfer_engine,
        )

        info = os.path.dirname(mooncake.__file__)
        eng = get_mooncake_transfer_engine()
        inner = getattr(getattr(eng, "engine", None), "_inner", None)
        if inner is not None and hasattr(inner, "_transport"):
            info += f" (kvwire transport={inner._transport})"
        return info
    except Exception as e:  # pragma: no cover
        return f"import failed: {e}"


# ------------------------------------------------------------- orchestrator
def run(a):
    import shutil
    import socket
    import tempfile

    wd = tempfile.mkdtemp(prefix="sglh-")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    base = [sys.executable, os.path.abspath(__file__)]
    common = [
        "--bootstrap-port", str(port), "--rooms", str(a.rooms), "--workdir", wd,
        "--scenario", a.scenario, "--timeout", str(a.timeout),
    ]
    logs = {}
    procs = {}
    for role in ("prefill", "decode"):
        env = dict(os.environ, ROLE=role)
        # H_PREFILL_PYTHONPATH / H_DECODE_PYTHONPATH: a different `mooncake` per role
        if os.environ.get(f"H_{role.upper()}_PYTHONPATH"):
            env["PYTHONPATH"] = os.environ[f"H_{role.upper()}_PYTHONPATH"]
        logs[role] = open(os.path.join(a.logdir, f"{a.tag}-{a.scenario}-{role}.log"), "w")
        procs[role] = subprocess.Popen(
            base + [role] + common, env=env, stdout=logs[role], stderr=subprocess.STDOUT
        )
        if role == "prefill":
            time.sleep(a.stagger)
    t0 = time.time()
    if a.scenario in ("kill-decode", "kill-decode-mid", "kill-decode-restart"):
        while not os.path.exists(os.path.join(wd, "prefill.ready")):
            if time.time() - t0 > a.timeout or procs["prefill"].poll() is not None:
                break
            time.sleep(0.005)
        if a.scenario == "kill-decode-mid":
            time.sleep(a.kill_delay)
        procs["decode"].send_signal(signal.SIGKILL)
        procs["decode"].wait()
        open(os.path.join(wd, "decode.killed"), "w").close()
        if a.scenario == "kill-decode-restart":
            time.sleep(a.restart_delay)
            logs["decode2"] = open(os.path.join(a.logdir, f"{a.tag}-{a.scenario}-decode2.log"), "w")
            c2 = list(common)
            c2[c2.index("--scenario") + 1] = "ok"
            procs["decode2"] = subprocess.Popen(
                base + ["decode"] + c2 + ["--room-base", "5000"],
                env=dict(os.environ, ROLE="decode2"), stdout=logs["decode2"], stderr=subprocess.STDOUT,
            )
        else:
            open(os.path.join(wd, "decode.done"), "w").close()
    elif a.scenario == "kill-prefill":
        while not os.path.exists(os.path.join(wd, "decode.metadata_sent")):
            if time.time() - t0 > a.timeout or procs["decode"].poll() is not None:
                break
            time.sleep(0.05)
        procs["prefill"].send_signal(signal.SIGKILL)
        procs["prefill"].wait()
    for role, p in procs.items():
        try:
            p.wait(timeout=a.timeout + 30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        logs[role].close()
    out = {}
    for role in procs:
        path = os.path.join(a.logdir, f"{a.tag}-{a.scenario}-{role}.log")
        res = None
        for line in open(path, errors="replace"):
            if line.startswith("RESULT "):
                res = json.loads(line[7:])
            if "TEARDOWN {" in line:  # may share a line with a thread's traceback
                out[role + "-teardown"] = json.loads(line[line.index("TEARDOWN {") + 9:])
            if line.startswith("RESULT2 "):
                out[role + "-phase2"] = json.loads(line[8:])
        out[role] = res if res is not None else {"rc": procs[role].returncode, "log": path}
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps({"tag": a.tag, "scenario": a.scenario, **out}, indent=1))
    shutil.rmtree(wd, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["run", "prefill", "decode"])
    ap.add_argument("--bootstrap-port", type=int, default=0)
    ap.add_argument("--rooms", type=int, default=6)
    ap.add_argument("--workdir", default="/tmp")
    ap.add_argument("--scenario", default="ok", choices=["ok", "kill-decode", "kill-decode-mid", "kill-decode-restart", "kill-prefill"])
    ap.add_argument("--room-base", type=int, default=1000)
    ap.add_argument("--restart-delay", type=float, default=2.0)
    ap.add_argument("--kill-delay", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--stagger", type=float, default=3.0)
    ap.add_argument("--tag", default=os.environ.get("MC_TAG", "x"))
    ap.add_argument("--logdir", default=os.environ.get("H_LOGDIR", "/tmp/kvwire-sglang-logs"))
    a = ap.parse_args()
    os.makedirs(a.logdir, exist_ok=True)
    if a.role == "run":
        return run(a)
    try:
        (role_prefill if a.role == "prefill" else role_decode)(a)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)


if __name__ == "__main__":
    main()
