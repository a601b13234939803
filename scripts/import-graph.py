#!/usr/bin/env python3
"""Module import graph of a Rust crate: edges from `crate::`/`super::`/
`self::` paths in each file to the file-level module they name, then the
import circles (strongly connected components) and, given a layer order,
the imports that run upward. Test code (`mod tests`, `tests/` modules,
`#[cfg(test)]` items) is skipped.

Usage: scripts/import-graph.py SRC_DIR [--layers a,b,c ...]
Exit status 1 when a circle or an upward import exists (for CI)."""
import os
import re
import sys

def modules(src):
    mods = {}
    for dp, _, fs in os.walk(src):
        for f in fs:
            if not f.endswith(".rs"):
                continue
            p = os.path.join(dp, f)
            rel = os.path.relpath(p, src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            if "tests" in rel or rel[-1:] == ["tests"] or any(x.endswith("_tests") for x in rel):
                continue
            mods[tuple(rel)] = p
    return mods

PATH = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")

def strip_tests(text):
    # drop `#[cfg(test)] mod x { ... }` blocks and `#[cfg(test)]` items roughly
    out, i = [], 0
    lines = text.split("\n")
    skip_depth = None
    depth = 0
    pending = False
    for l in lines:
        s = l.strip()
        if skip_depth is None and s.startswith("#[cfg(test)]"):
            pending = True
            continue
        if pending and skip_depth is None:
            pending = False
            if "{" in s and not s.endswith(";"):
                skip_depth = depth
            else:
                continue
        if skip_depth is not None:
            depth += l.count("{") - l.count("}")
            if depth <= skip_depth:
                skip_depth = None
            continue
        depth += l.count("{") - l.count("}")
        if s.startswith("//"):
            continue
        out.append(l)
    return "\n".join(out)

def resolve(mod, path, mods):
    parts = path.split("::")
    if parts[0] == "crate":
        base, rest = (), parts[1:]
    else:
        base = mod
        rest = parts
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                base = base[:-1]
            rest = rest[1:]
    best = None
    cur = base
    if cur in mods:
        best = cur
    for r in rest:
        cur = cur + (r,)
        if cur in mods:
            best = cur
        else:
            break
    return best

def main():
    src = sys.argv[1]
    layers = []
    if "--layers" in sys.argv:
        layers = sys.argv[sys.argv.index("--layers") + 1].split(",")
    mods = modules(src)
    edges = {}
    for m, p in mods.items():
        text = strip_tests(open(p).read())
        for path in PATH.findall(text):
            t = resolve(m, path, mods)
            if t is None or t == m or m[: len(t)] == t or t[: len(m)] == m:
                continue  # own module, an ancestor, or a child
            edges.setdefault(m, set()).add(t)
    # SCCs (Tarjan)
    index, low, stack, on, sccs, n = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            c = []
            while True:
                w = stack.pop(); on.discard(w); c.append(w)
                if w == v:
                    break
            if len(c) > 1:
                sccs.append(c)
    for v in list(mods):
        if v not in index:
            visit(v)
    bad = 0
    for c in sccs:
        bad += 1
        print("circle:", " <-> ".join("::".join(x) or "(root)" for x in sorted(c)))
    if layers:
        rank = {l: i for i, l in enumerate(layers)}
        for a, ts in sorted(edges.items()):
            for b in sorted(ts):
                ra, rb = rank.get(a[0] if a else ""), rank.get(b[0] if b else "")
                if ra is not None and rb is not None and rb > ra:
                    bad += 1
                    print(f"upward: {'::'.join(a)} -> {'::'.join(b)} ({b[0]} is above {a[0]})")
    nedges = sum(len(v) for v in edges.values())
    print(f"{len(mods)} modules, {nedges} edges, {len(sccs)} circles")
    return 1 if bad else 0

sys.exit(main())
