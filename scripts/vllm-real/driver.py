#!/usr/bin/env python3
"""Drive vLLM 0.34's unchanged MooncakeConnector (v1/mooncake/mooncake_connector.py) on CPU.

Two processes, as a P/D pair runs it:
  prefill (kv_producer): VllmConfig + KVTransferConfig(MooncakeConnector), gloo
     world of 1, connector built by KVConnectorFactory (WORKER role), CPU bf16
     KV cache in the CPU_ATTN layout [num_blocks, kv_heads, block, 2*head]
     filled with a per-(layer, block) pattern, register_kv_caches (starts the
     bootstrap server + sender listener), then per request the two metadata
     steps the scheduler produces (update_state_after_alloc -> empty block
     list; request_finished -> block ids), bound + start_load_kv, then polls
     get_finished until every request reports finished sending.
  decode (kv_consumer): same config, sentinel-filled cache, register_kv_caches,
     metadata with reqs_to_recv (do_remote_prefill params: transfer_id,
     remote_engine_id, remote_bootstrap_addr), start_load_kv, polls
     get_finished until all requests are finished recving, then checks every
     destination block byte for byte and that no other block changed.
Metadata is built with MooncakeConnectorMetadata.add_new_req, the method the
connector's scheduler side (build_connector_meta) uses.
`mooncake` comes from PYTHONPATH (scripts/vllm-real-check.sh sets it: kvwire's
package or the real mooncake-transfer-engine-non-cuda wheel). Our own
harness: vLLM's code is imported from the installed vllm wheel, never copied
here; tinyllama/config.json is a made-up 4-layer config (no weights load).
"""
import json, os, subprocess, sys, time, traceback

ROOT = os.path.dirname(os.path.abspath(__file__))
LOGS = os.environ.get("H_LOGDIR", "/tmp/kvwire-vllm-logs")
T0 = time.time()
NUM_LAYERS = 4
BLOCK = 32           # CPU_ATTN kernel block sizes are MultipleOf(32)
KV_HEADS = 2
HEAD = 64
NUM_BLOCKS = int(os.environ.get("H_BLOCKS", 64))
N_REQS = int(os.environ.get("H_REQS", 5))
MAX_BLOCKS = int(os.environ.get("H_MAX_BLOCKS", 8))
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def log(m):
    print(f"[{os.environ.get('ROLE','?')} {time.strftime('%H:%M:%S')} +{time.time()-T0:.1f}s] {m}", flush=True)


def plan():
    import numpy as np
    rng = np.random.default_rng(4321)
    src_free = list(rng.permutation(NUM_BLOCKS)); dst_free = list(rng.permutation(NUM_BLOCKS))
    out = []
    for i in range(N_REQS):
        n = int(rng.integers(1, MAX_BLOCKS + 1))
        out.append(dict(req=f"req-{i}", tid=f"xfer-{i:04d}",
                        src=[int(src_free.pop()) for _ in range(n)],
                        dst=[int(dst_free.pop()) for _ in range(n)]))
    return out


def pattern(layer, block, nbytes):
    import numpy as np
    return np.random.default_rng(layer * 1000003 + block * 7919 + 11).integers(0, 256, nbytes, dtype=np.uint8)


class Tracing:
    calls = {}
    def __init__(self, inner): object.__setattr__(self, "_inner", inner)
    def __getattr__(self, name):
        a = getattr(self._inner, name)
        if not callable(a): return a
        def w(*args, **kw):
            c = Tracing.calls.setdefault(name, {"n": 0, "nonzero": [], "exc": [], "args": []}); c["n"] += 1
            if len(c["args"]) < 3:
                c["args"].append([f"list[{len(x)}] sum={sum(x) if x and isinstance(x[0], int) else None}"
                                  if isinstance(x, list) else repr(x)[:80] for x in args])
            try: r = a(*args, **kw)
            except Exception as e:
                c["exc"].append(repr(e)[:300]); log(f"engine.{name} raised {e!r}"); raise
            if isinstance(r, int) and r != 0 and name not in ("get_rpc_port",) and len(c["nonzero"]) < 5:
                c["nonzero"].append(r); log(f"engine.{name} -> {r}")
            return r
        return w


def setup(role, engine_id, dist_port):
    import torch
    if not torch.accelerator.is_available():
        # CUDA-built torch without a driver raises in current_device_index();
        # record it and stand in the value a CPU worker gets (device 0).
        try:
            torch.accelerator.current_device_index()
        except Exception as e:
            log(f"NOTE torch.accelerator.current_device_index() raises here: {e!r}; shimmed to 0 (no vLLM change)")
            torch.accelerator.current_device_index = lambda: 0
    import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector as mc
    from vllm.config import VllmConfig, ModelConfig, CacheConfig, KVTransferConfig, DeviceConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, ensure_model_parallel_initialized
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor, KVCacheGroupSpec, FullAttentionSpec
    import mooncake, mooncake.engine
    log(f"mooncake from {os.path.dirname(mooncake.__file__)}")
    orig = mooncake.engine.TransferEngine
    mc.TransferEngine = lambda: Tracing(orig())
    ktc = KVTransferConfig(kv_connector="MooncakeConnector", kv_role=role, engine_id=engine_id,
                           kv_connector_extra_config={"mooncake_protocol": os.environ.get("H_PROTOCOL", "tcp"),
                                                      "num_workers": 4})
    mcfg = ModelConfig(model=os.path.join(ROOT, "tinyllama"), skip_tokenizer_init=True, dtype="bfloat16",
                       max_model_len=2048, seed=0)
    vcfg = VllmConfig(model_config=mcfg, cache_config=CacheConfig(block_size=BLOCK),
                      device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)
    log(f"VllmConfig built; platform={type(__import__('vllm.platforms').platforms.current_platform).__name__}")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS,
                        kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS, layers=[l], layer_stride=page * NUM_BLOCKS,
                                                        block_stride=page) for l in LAYERS],
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec)])
    cm = set_current_vllm_config(vcfg); cm.__enter__()
    # What EngineCore does before building the KV cache: resolve one layout
    # from the workers' backends' supported layouts (CPU_ATTN: LBHNC).
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    layout = resolve_kv_cache_layout(vcfg, [[l.name for l in CPUAttentionBackend.supported_kv_cache_layouts()]], [spec])
    kcc.kv_cache_layout = layout.name
    log(f"kv cache layout resolved: {layout.name}")
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
                                 local_rank=0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)
    conn = KVConnectorFactory.create_connector(vcfg, KVConnectorRole.WORKER, kcc)
    log(f"connector {type(conn).__name__} built, page={page}B, worker block_size={conn.connector_worker.block_size}")
    caches = {l: torch.empty((NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD), dtype=torch.bfloat16) for l in LAYERS}
    return mc, conn, caches, page


def u8(t):
    return t.view(__import__("torch").uint8).numpy().reshape(NUM_BLOCKS, -1)


def run_meta(conn, meta):
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    conn.clear_connector_metadata()


def role_main(args):
    out = {"role": args.role, "tag": args.tag, "ok": False}
    # decode's own bootstrap port differs (matters for kv_both); it pulls from P's
    bport = int(os.environ.get("H_P_BPORT") or os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"])
    try:
        producer = args.role == "prefill"
        both = os.environ.get("H_KV_BOTH") == "1"
        mc, conn, caches, page = setup("kv_both" if both else ("kv_producer" if producer else "kv_consumer"),
                                       "engine-P" if producer else "engine-D", args.dist_port)
        for li, l in enumerate(LAYERS):
            a = u8(caches[l])
            if producer:
                for b in range(NUM_BLOCKS): a[b] = pattern(li, b, page)
            else:
                a[:] = 0xEE
        t = time.time(); conn.register_kv_caches(caches); log(f"register_kv_caches {time.time()-t:.2f}s")
        if os.environ.get("H_SLEEP_CYCLE") == "1":
            # sleep mode (supports_sleep_mode): drop and re-register the KV memory
            conn.unregister_kv_caches(); conn.restore_kv_caches(); log("unregister_kv_caches + restore_kv_caches done")
        reqs = plan()
        pending = {r["req"] for r in reqs}
        if producer:
            m1 = mc.MooncakeConnectorMetadata()
            for r in reqs:   # update_state_after_alloc(do_remote_decode) -> empty list
                m1.add_new_req(r["req"], [], {"transfer_id": r["tid"], "do_remote_decode": True}, load_remote_cache=False)
            run_meta(conn, m1)
            delay = float(os.environ.get("H_FINISH_DELAY", 0))
            if delay:  # let decode's pull arrive before request_finished
                open(args.ready_file, "w").write("ready")
                log("ready after alloc step; waiting for decode's pull request")
                t = time.time()
                while not os.path.exists(args.ready_file + ".pulled") and time.time() - t < 120: time.sleep(0.05)
                log(f"decode has asked (start_load_kv done); request_finished in {delay}s")
                time.sleep(delay)
            m2 = mc.MooncakeConnectorMetadata()
            for r in reqs:   # request_finished(FINISHED_LENGTH_CAPPED) -> block ids
                m2.add_new_req(r["req"], [list(r["src"])], {"transfer_id": r["tid"], "do_remote_decode": True}, load_remote_cache=False)
            run_meta(conn, m2)
            open(args.ready_file, "w").write("ready")
            log("prefill ready; waiting for sends")
        else:
            m = mc.MooncakeConnectorMetadata()
            for r in reqs:
                m.add_new_req(r["req"], [list(r["dst"])], {"transfer_id": r["tid"], "do_remote_prefill": True,
                              "remote_engine_id": "engine-P", "remote_bootstrap_addr": f"http://127.0.0.1:{bport}"})
            t_start = time.time(); run_meta(conn, m)
            open(args.ready_file + ".pulled", "w").write("x")
            kd = float(os.environ.get("H_KILL_DECODE_AFTER_S", 0))
            if kd:
                time.sleep(kd); log("scenario: decode exits hard before prefill writes"); os._exit(4)
        deadline = time.time() + args.timeout
        done = set()
        while pending - done and time.time() < deadline:
            if os.environ.get("H_KILL_PREFILL_AFTER_READY") == "1" and producer:
                log("scenario: prefill exits hard without sending"); os._exit(3)
            s, r = conn.get_finished(set())
            got = (s or set()) if producer else (r or set())
            if got: log(f"get_finished -> {'sent' if producer else 'recvd'} {sorted(got)}")
            done |= got
            time.sleep(0.02)
        out["finished"] = sorted(done); out["missing"] = sorted(pending - done)
        if not producer:
            out["recv_wall_s"] = round(time.time() - t_start, 3)
            out["load_errors"] = sorted(conn.get_block_ids_with_load_errors())
            mism, stray, checked = [], 0, 0
            dst_src = {}
            for r in reqs:
                for s_, d_ in zip(r["src"], r["dst"]): dst_src[d_] = s_
            for li, l in enumerate(LAYERS):
                a = u8(caches[l])
                for b in range(NUM_BLOCKS):
                    if b in dst_src:
                        checked += page
                        if not (a[b] == pattern(li, dst_src[b], page)).all(): mism.append((li, b))
                    elif not (a[b] == 0xEE).all(): stray += 1
            out.update(mismatch=mism[:20], n_mismatch=len(mism), stray=stray, bytes_checked=checked,
                       blocks=len(dst_src))
            out["ok"] = not out["missing"] and not mism and not stray and not out["load_errors"]
        else:
            out["ok"] = not out["missing"]
            time.sleep(1.0)
    except Exception as e:
        out["error"] = repr(e); out["traceback"] = traceback.format_exc()[-4000:]
        log(traceback.format_exc())
    out["engine_calls"] = Tracing.calls
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0 if out["ok"] else 1)


def run_pair(args):
    os.makedirs(LOGS, exist_ok=True)
    ready = f"{LOGS}/ready-{args.tag}-{os.getpid()}"
    if os.path.exists(ready): os.remove(ready)
    bport, dport = 18000 + os.getpid() % 1000, 19000 + os.getpid() % 1000
    env = dict(os.environ, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bport))
    procs = {}
    for role, dp in (("prefill", dport), ("decode", dport + 1)):
        if role == "decode":
            t = time.time()
            while not os.path.exists(ready) and time.time() - t < 240 and procs["prefill"].poll() is None: time.sleep(0.2)
        lf = open(f"{LOGS}/{args.tag}-{role}.log", "w")
        procs[role] = subprocess.Popen([sys.executable, __file__, "role", "--role", role, "--tag", args.tag,
                                        "--dist-port", str(dp), "--ready-file", ready, "--timeout", str(args.timeout)],
                                       env=dict(env, ROLE=role, **({"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bport + 1), "H_P_BPORT": str(bport)} if role == "decode" else {}), **({"PYTHONPATH": env["PYTHONPATH_D"]} if role == "decode" and env.get("PYTHONPATH_D") else {})), stdout=lf, stderr=subprocess.STDOUT)
    for role, p in procs.items():
        try: p.wait(timeout=args.timeout + 240)
        except subprocess.TimeoutExpired: p.kill()
    summ = {}
    for role in procs:
        res = [l for l in open(f"{LOGS}/{args.tag}-{role}.log") if l.startswith("RESULT ")]
        summ[role] = json.loads(res[-1][7:]) if res else {"role": role, "ok": False, "error": "no RESULT line"}
        r = dict(summ[role]); r.pop("traceback", None)
        print(json.dumps(r))
    json.dump(summ, open(f"{LOGS}/summary-{args.tag}.json", "w"), indent=1)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["run", "role"])
    ap.add_argument("--role"); ap.add_argument("--tag", default="x")
    ap.add_argument("--dist-port", type=int); ap.add_argument("--ready-file")
    ap.add_argument("--timeout", type=float, default=60)
    a = ap.parse_args()
    run_pair(a) if a.cmd == "run" else role_main(a)
