#!/usr/bin/env python3
"""kvwire vs NIXL on the same KV-shaped workload, one table with ratios.

For every (page size, op) row it runs `kvwire bench --transport shm --scatter
--json` (which also measures, in the same process right after its transfers,
the copy ceilings of the same page pattern: 1-thread memcpy and the
`--copy-threads`-thread ceiling) and `nixl_bench.py` (NIXL's Python API over
UCX) once per NIXL configuration (`--nixl`, default: NIXL's best same-host
configuration and its defaults, see NIXL_CONFIGS), interleaved run by run
(kvwire, NIXL best, NIXL default, kvwire, ...) so machine noise hits all of
them, and reports medians and run-by-run ratios. Both sides move `--total`
bytes per transfer between two processes, destination pages a seeded random
permutation (the same permutation), and verify every byte.

  python bench/compare/compare.py --quick          # smoke test, ~1 minute
  python bench/compare/compare.py --md docs/perf-shm.md   # the published table

Writes the raw runs as JSON (`--out`) and prints Markdown tables (`--md`:
also into that file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# label -> how NIXL runs: UCX_TLS (None: unset, UCX picks), the UCX
# backend's ucx_error_handling_mode ("" for NIXL's default "peer"), and
# whether nixl_agent_config's progress thread is on (NIXL's default).
NIXL_CONFIGS = {
    # NIXL's best same-host configuration: UCX's shared-memory transports
    # only (they have no peer-failure handler, so error mode "none" is what
    # makes them usable at all), no progress thread, and the target spinning
    # on get_new_notifs (nixl_bench.py does that whenever the progress
    # thread is off).
    "best": {"tls": "sysv,posix,self", "err": "none", "prog_thread": False},
    # NIXL's defaults: UCX chooses its transports, error mode "peer",
    # progress thread on.
    "default": {"tls": None, "err": "", "prog_thread": True},
    # Single-transport variants (issue 8's table), not run unless asked.
    "shm": {"tls": "sysv,posix,self", "err": "none", "prog_thread": True},
    # cma (process_vm_writev/readv) carries RMA only; UCX needs an
    # active-message lane for wireup and NIXL's notifications: tcp.
    "cma": {"tls": "cma,tcp,self", "err": "", "prog_thread": True},
    "tcp": {"tls": "tcp", "err": "", "prog_thread": True},
}

SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20}


def human(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def find_kvwire(given: str | None) -> str:
    if given:
        return given
    cands = []
    if os.environ.get("CARGO_TARGET_DIR"):
        cands.append(os.path.join(os.environ["CARGO_TARGET_DIR"], "release", "kvwire"))
    cands.append(os.path.join(ROOT, "target", "release", "kvwire"))
    for c in cands:
        if os.access(c, os.X_OK):
            return c
    found = shutil.which("kvwire")
    if found:
        return found
    sys.exit("kvwire binary not found: run `cargo build --release` or pass --kvwire PATH")


def last_json(out: str) -> dict | None:
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                pass
    return None


def run_one(cmd: list[str], env: dict, timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    r = last_json(p.stdout)
    if r is None:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)[-400:]}
    r["exit_code"] = p.returncode
    r["wall_s"] = round(time.monotonic() - t0, 2)
    return r


BUSY = {"rustc", "cargo", "cc1", "cc1plus", "ld", "ld.lld", "rust-lld", "clippy-driver", "pytest"}


def busy_procs() -> list[str]:
    """Compilers and test runners from anyone on this machine (benchmark noise)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm in BUSY:
            found.append(comm)
    return found


def wait_quiet(max_s: float) -> tuple[bool, float]:
    """Wait up to max_s for no compiler to be running; (quiet, waited seconds)."""
    t0 = time.monotonic()
    while True:
        if not busy_procs():
            time.sleep(0.5)
            if not busy_procs():
                return True, time.monotonic() - t0
        if time.monotonic() - t0 >= max_s:
            return False, time.monotonic() - t0
        time.sleep(2)


def med(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if "error" not in r and isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description="kvwire vs NIXL (UCX) side by side")
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 run: a smoke test")
    ap.add_argument("--runs", type=int, help="runs per cell (median); default 3, quick 1")
    ap.add_argument("--total", default=None, help="bytes per transfer (default 256MiB, quick 16MiB)")
    ap.add_argument("--sizes", default="4KiB,64KiB,1MiB")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument(
        "--nixl", default="best,default", help=f"NIXL configurations to run ({','.join(NIXL_CONFIGS)})"
    )
    ap.add_argument("--no-nixl", action="store_true", help="kvwire + memcpy only")
    ap.add_argument("--iters", type=int, help="measured transfers per run (default 5, quick 2)")
    ap.add_argument("--warmup", type=int, help="unmeasured transfers per run (default 2, quick 1)")
    ap.add_argument("--lat-iters", type=int, help="one-page transfers per run (default 200, quick 20)")
    ap.add_argument("--copy-threads", type=int, default=2, help="kvwire --copy-threads")
    ap.add_argument("--kvwire", help="path of the kvwire binary (default: $CARGO_TARGET_DIR or target/release)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that has nixl-cu12 (default: this one)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per single run")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        help="before each run wait up to this many seconds until no compiler/test runner is running",
    )
    ap.add_argument("--out", default=None, help="raw results JSON (default bench/compare/results[-quick].json)")
    ap.add_argument(
        "--md",
        default=None,
        help="also write the tables into this Markdown file, between the lines "
        f"{MD_BEGIN!r} and {MD_END!r} (the whole file when it has no such lines)",
    )
    ap.add_argument(
        "--report",
        nargs="+",
        metavar="RESULTS_JSON",
        help="run nothing: print the tables of earlier raw results (several files: their runs are pooled)",
    )
    a = ap.parse_args()
    if a.report:
        raw = pool_results(a.report)
        c = raw["cells"]
        sizes = sorted({x["block_size"] for x in c})
        ops = [o for o in ("write", "read") if any(x["op"] == o for x in c)]
        labels = [t for t in NIXL_CONFIGS if any(x["system"] == f"nixl-{t}" for x in c)]
        text = report(raw, sizes, ops, labels)
        print(text)
        if a.md:
            write_md(a.md, text, a.report)
        return 0

    runs = a.runs or (1 if a.quick else 3)
    total = parse_size(a.total) if a.total else (16 << 20 if a.quick else 256 << 20)
    iters = a.iters or (2 if a.quick else 5)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    lat_iters = a.lat_iters or (20 if a.quick else 200)
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    ops = [o for o in a.ops.split(",") if o]
    nixl_labels = [] if a.no_nixl else [t for t in a.nixl.split(",") if t]
    for t in nixl_labels:
        if t not in NIXL_CONFIGS:
            sys.exit(f"unknown NIXL configuration {t!r}; known: {', '.join(NIXL_CONFIGS)}")
    kvwire = find_kvwire(a.kvwire)
    out_path = a.out or os.path.join(HERE, "results-quick.json" if a.quick else "results.json")

    systems = ["kvwire"] + [f"nixl-{t}" for t in nixl_labels]
    cells: dict[tuple[int, str, str], list[dict]] = {}
    started = time.time()
    load0 = os.getloadavg()
    for run in range(runs):
        for bs in sizes:
            blocks = total // bs
            for op in ops:
                for sysname in systems:
                    common = [
                        "--op", op, "--block-size", str(bs), "--blocks", str(blocks), "--iters", str(iters),
                        "--warmup", str(warmup), "--lat-iters", str(lat_iters), "--scatter", "--json",
                    ]  # fmt: skip
                    env = dict(os.environ)
                    if sysname == "kvwire":
                        cmd = [kvwire, "bench", "--transport", "shm", "--copy-threads", str(a.copy_threads)] + common
                    else:
                        nc = NIXL_CONFIGS[sysname.split("-", 1)[1]]
                        env.pop("UCX_TLS", None)
                        if nc["tls"] is not None:
                            env["UCX_TLS"] = nc["tls"]
                        cmd = [a.python, os.path.join(HERE, "nixl_bench.py")] + common
                        if nc["err"]:
                            cmd += ["--ucx-err-mode", nc["err"]]
                        if not nc["prog_thread"]:
                            cmd.append("--no-prog-thread")
                    quiet, waited = wait_quiet(a.wait_quiet) if a.wait_quiet else (not busy_procs(), 0.0)
                    r = run_one(cmd, env, a.timeout)
                    r["quiet_at_start"] = quiet
                    r["waited_quiet_s"] = round(waited, 1)
                    r["busy_after"] = sorted(set(busy_procs()))
                    r["load1"] = os.getloadavg()[0]
                    tls = env.get("UCX_TLS") if sysname != "kvwire" else None
                    r["cmd"] = (f"UCX_TLS={tls} " if tls else "") + " ".join(cmd)
                    cells.setdefault((bs, op, sysname), []).append(r)
                    status = r.get("error") or f"{r.get('gb_per_s', 0):.2f} GB/s verified={r.get('verified')}"
                    status += f" load={r['load1']:.2f} quiet={quiet}"
                    print(f"[run {run + 1}/{runs}] {human(bs):>7} {op:5} {sysname:9} {status}", file=sys.stderr, flush=True)
                    raw = snapshot(a, cells, started, load0, runs, total, iters, warmup, lat_iters, nixl_labels, kvwire)
                    with open(out_path, "w") as f:
                        json.dump(raw, f, indent=1)

    raw = snapshot(a, cells, started, load0, runs, total, iters, warmup, lat_iters, nixl_labels, kvwire)
    with open(out_path, "w") as f:
        json.dump(raw, f, indent=1)
    text = report(raw, sizes, ops, nixl_labels)
    print(text)
    if a.md:
        write_md(a.md, text, [out_path])
    print(f"\nraw runs: {os.path.relpath(out_path)}", file=sys.stderr)
    bad = [c for c in raw["cells"] for r in c["runs"] if "error" in r or not r.get("verified")]
    return 1 if bad else 0


def snapshot(a, cells, started, load0, runs, total, iters, warmup, lat_iters, nixl_labels, kvwire) -> dict:
    """The raw results so far (written after every run, so an interrupted run keeps them)."""
    return {
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "config": {
            "runs": runs, "total": total, "iters": iters, "warmup": warmup, "lat_iters": lat_iters,
            "copy_threads": a.copy_threads, "nixl_configs": {t: NIXL_CONFIGS[t] for t in nixl_labels},
        },  # fmt: skip
        "kvwire_binary": kvwire,
        "kvwire_git": git_rev(),
        "cells": [{"block_size": bs, "op": op, "system": s, "runs": rs} for (bs, op, s), rs in cells.items()],
    }


def report(raw: dict, sizes: list[int], ops: list[str], nixl_labels: list[str]) -> str:
    cells = {(c["block_size"], c["op"], c["system"]): c["runs"] for c in raw["cells"]}
    cfg = raw["config"]
    m = raw["machine"]
    lines = [
        f"{human(cfg['total'])} per transfer, destination pages a random permutation, two processes, "
        f"median of {cfg['runs']} interleaved run(s) x {cfg['iters']} transfers "
        f"({min(len(c['runs']) for c in raw['cells'])}–{max(len(c['runs']) for c in raw['cells'])} runs per cell present); "
        f"load average {raw['loadavg_before'][0]:.2f} before, {raw['loadavg_after'][0]:.2f} after; "
        f"{sum(1 for c in raw['cells'] for r in c['runs'] if r.get('quiet_at_start'))}/"
        f"{sum(len(c['runs']) for c in raw['cells'])} runs started with no compiler running; "
        f"{m['cpu']} x{m['nproc']}, kernel {m['kernel']}",
        "",
    ]
    hdr = ["page", "op", "memcpy 1 thread GB/s", f"ceiling {cfg['copy_threads']} threads GB/s", "kvwire GB/s"]
    hdr += ["kvwire min–max", "kvwire / ceiling"]
    hdr += [f"NIXL {t} GB/s" for t in nixl_labels]
    hdr += [f"kvwire / NIXL {t}" for t in nixl_labels]
    hdr += ["verified"]
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for bs in sizes:
        for op in ops:
            k = cells.get((bs, op, "kvwire"), [])
            kv = med(k, "gb_per_s")
            ks = [r["gb_per_s"] for r in k if "error" not in r]
            spread = f"{min(ks):.2f}–{max(ks):.2f}" if ks else "—"
            row = [human(bs), op.upper(), fmt(med(k, "memcpy_gb_per_s")), fmt(med(k, "ceiling_gb_per_s")), fmt(kv), spread]
            row.append(ratio_cell([r.get("ceiling_ratio") for r in k if "error" not in r], "%"))
            ver = all(r.get("verified") for r in k) and bool(k)
            ratios = []
            for t in nixl_labels:
                rs = cells.get((bs, op, f"nixl-{t}"), [])
                g = med(rs, "gb_per_s")
                err = next((r["error"] for r in rs if "error" in r), None)
                row.append(fmt(g) if g is not None else ("failed" if err else "—"))
                ver = ver and all(r.get("verified") for r in rs)
                # Ratios run by run (kvwire run i against NIXL run i, which ran next to it).
                ratios.append(
                    ratio_cell(
                        [
                            kr["gb_per_s"] / nr["gb_per_s"]
                            for kr, nr in zip(k, rs)
                            if "error" not in kr and "error" not in nr and nr.get("gb_per_s")
                        ],
                        "×",
                    )
                )
            row += ratios
            row.append("yes" if ver else "NO")
            lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Ratios are taken run by run (kvwire's run i against the ceiling measured in that same process, and "
        "against NIXL's run i, which ran right after it): median, and min–max over the runs.",
    ]

    if "best" in nixl_labels:
        lines += ["", *target_table(cells, sizes, ops)]

    lines += ["", "Per-page cost and one-page latency (medians):", ""]
    hdr = ["page", "op", "kvwire prep+post ns/page"]
    hdr += [f"NIXL {t} make+post ns/page" for t in nixl_labels]
    if nixl_labels:
        hdr += ["NIXL prep_xfer_dlist ns/desc (once)", "NIXL initialize_xfer ns/page"]
    hdr += ["kvwire page p50/p99 µs"] + [f"NIXL {t} page p50/p99 µs" for t in nixl_labels]
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for bs in sizes:
        for op in ops:
            k = cells.get((bs, op, "kvwire"), [])
            row = [human(bs), op.upper(), fmt(med(k, "post_ns_per_block"), ".1f")]
            preps, inits = [], []
            for t in nixl_labels:
                rs = cells.get((bs, op, f"nixl-{t}"), [])
                mk, tc = med(rs, "make_ns_per_block"), med(rs, "transfer_call_ns_per_block")
                row.append(f"{fmt(med(rs, 'post_ns_per_block'), '.0f')} ({fmt(mk, '.0f')} + {fmt(tc, '.0f')})")
                p = med(rs, "prep_dlist_ns_per_desc")
                if p is not None:
                    preps.append(p)
                i = med(rs, "initialize_xfer_ns_per_block")
                if i is not None:
                    inits.append(i)
            if nixl_labels:
                row.append(fmt(statistics.median(preps) if preps else None, ".0f"))
                row.append(fmt(statistics.median(inits) if inits else None, ".0f"))
            row.append(f"{fmt(med(k, 'page_p50_us'), '.1f')} / {fmt(med(k, 'page_p99_us'), '.1f')}")
            for t in nixl_labels:
                rs = cells.get((bs, op, f"nixl-{t}"), [])
                row.append(f"{fmt(med(rs, 'page_p50_us'), '.1f')} / {fmt(med(rs, 'page_p99_us'), '.1f')}")
            lines.append("| " + " | ".join(row) + " |")

    errors = sorted({f"{human(c['block_size'])} {c['op']} {c['system']}: {r['error']}" for c in raw["cells"] for r in c["runs"] if "error" in r})
    unverified = sorted({f"{human(c['block_size'])} {c['op']} {c['system']}" for c in raw["cells"] for r in c["runs"] if "error" not in r and not r.get("verified")})
    if errors:
        lines += ["", "Failed runs:"] + [f"- {e}" for e in errors]
    if unverified:
        lines += ["", "Runs whose verification failed (see docs/PERFORMANCE.md):"] + [f"- {u}" for u in unverified]
    return "\n".join(lines)


TARGET_X = 1.5  # issue 19: kvwire >= 1.5x NIXL's best same-host configuration


def target_table(cells: dict, sizes: list[int], ops: list[str]) -> list[str]:
    """Run by run: is kvwire >= TARGET_X x NIXL best, and where not, was that
    out of reach because TARGET_X x NIXL best exceeds the copy ceiling that
    kvwire's own process measured in the same run?"""
    lines = [
        f"kvwire >= {TARGET_X}x NIXL best, run by run (a run below it is *bound* when {TARGET_X}x NIXL best's "
        "rate exceeds the N-thread copy ceiling measured in kvwire's run next to it: no N-thread copy reaches it):",
        "",
        f"| page | op | runs | >= {TARGET_X}x | below, bound by the ceiling | below, not bound |",
        "|---|---|---|---|---|---|",
    ]
    for bs in sizes:
        for op in ops:
            met = bound = free = 0
            pairs = zip(cells.get((bs, op, "kvwire"), []), cells.get((bs, op, "nixl-best"), []))
            for k, n in pairs:
                if "error" in k or "error" in n or not n.get("gb_per_s"):
                    continue
                if k["gb_per_s"] >= TARGET_X * n["gb_per_s"]:
                    met += 1
                elif TARGET_X * n["gb_per_s"] > k.get("ceiling_gb_per_s", float("inf")):
                    bound += 1
                else:
                    free += 1
            lines.append(f"| {human(bs)} | {op.upper()} | {met + bound + free} | {met} | {bound} | {free} |")
    return lines


def ratio_cell(xs: list, unit: str) -> str:
    xs = [x for x in xs if isinstance(x, (int, float))]
    if not xs:
        return "—"
    if unit == "%":
        return f"{statistics.median(xs):.0%} ({min(xs):.0%}–{max(xs):.0%})"
    return f"{statistics.median(xs):.2f}× ({min(xs):.2f}–{max(xs):.2f})"


MD_BEGIN = "<!-- compare.py tables: begin -->"
MD_END = "<!-- compare.py tables: end -->"


def write_md(path: str, tables: str, raw_paths: list[str]) -> None:
    """Put the tables into `path` between MD_BEGIN and MD_END (or make the file)."""
    rel = " ".join(os.path.relpath(p, ROOT) for p in raw_paths)
    block = f"{MD_BEGIN}\n\nRaw runs: `{rel}`.\n\n{tables}\n\n{MD_END}"
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        old = ""
    if MD_BEGIN in old and MD_END in old:
        head, rest = old.split(MD_BEGIN, 1)
        text = head + block + rest.split(MD_END, 1)[1]
    else:
        text = old + ("\n" if old else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(f"tables written into {os.path.relpath(path)}", file=sys.stderr)


def pool_results(paths: list[str]) -> dict:
    """Merge raw result files: the runs of equal cells are pooled."""
    raws = []
    for p in paths:
        with open(p) as f:
            raws.append(json.load(f))
    out = dict(raws[0])
    cells: dict[tuple, list] = {}
    for r in raws:
        for c in r["cells"]:
            cells.setdefault((c["block_size"], c["op"], c["system"]), []).extend(c["runs"])
    out["cells"] = [{"block_size": k[0], "op": k[1], "system": k[2], "runs": v} for k, v in cells.items()]
    out["config"] = dict(out["config"], runs=sum(r["config"]["runs"] for r in raws))
    out["loadavg_after"] = raws[-1]["loadavg_after"]
    return out


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def machine() -> dict:
    cpu = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "kernel": platform.release(), "python": platform.python_version()}


def parse_size(s: str) -> int:
    s = s.strip()
    for suf, mul in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suf):
            return int(s[: -len(suf)]) * mul
    return int(s)


if __name__ == "__main__":
    sys.exit(main())
