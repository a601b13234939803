#!/usr/bin/env python3
"""Compare the `nixlBackendEngine` vtable of two NIXL backend plugins slot
by slot: ours (libplugin_KVWIRE.so) against one NIXL built (the wheel's
libplugin_POSIX.so), by reading each .so's vtable symbol and the dynamic
relocations that fill its slots (readelf), and comparing the demangled
method signatures with the class name stripped. Exit 1 on any difference.

Usage: nixl_vtable_check.py OURS.so THEIRS.so
"""
import re
import subprocess
import sys


def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def demangle(names):
    out = run("c++filt", *names) if names else ""
    return out.splitlines()


def vtable_slots(so, class_re):
    syms, vt = {}, None
    for line in run("readelf", "-Ws", so).splitlines():
        p = line.split()
        if len(p) < 8 or not re.fullmatch(r"[0-9a-f]{16}", p[1]) or int(p[1], 16) == 0:
            continue
        syms.setdefault(int(p[1], 16), []).append(p[7])
        if re.fullmatch(class_re, p[7]) and p[7] != "_ZTV17nixlBackendEngine":
            vt = (int(p[1], 16), int(p[2]))
    if vt is None:
        sys.exit(f"{so}: no engine vtable matching {class_re}")
    rel = {}
    for line in run("readelf", "-Wr", so).splitlines():
        p = line.split()
        if len(p) >= 4 and re.fullmatch(r"[0-9a-f]{16}", p[0]):
            off = int(p[0], 16)
            if "RELATIVE" in p[2]:
                rel[off] = syms.get(int(p[3], 16), ["?"])
            elif len(p) >= 5:
                rel[off] = [p[4].split("@")[0]]
    base, size = vt
    slots = []
    # Identical functions (three `return true;`) may share one address, so
    # a slot is the set of every symbol at its address.
    for i in range(2, size // 8):
        meths = set()
        for d in demangle(rel.get(base + 8 * i, ["?"])):
            d = d.replace("(anonymous namespace)::", "")
            # "Class::method(args) const" -> "method(args) const"
            m = re.match(r"^(?:[\w:<>]+::)?(~?\w+\(.*)$", d)
            meth = m.group(1) if m else d
            meths.add("~dtor()" if meth.startswith("~") else meth)
        slots.append(meths)
    return size, slots


def main():
    ours, theirs = sys.argv[1], sys.argv[2]
    osz, oslots = vtable_slots(ours, r"_ZTV\w*KvwireEngine\w*")
    tsz, tslots = vtable_slots(theirs, r"_ZTV\d+nixlPosixEngine")
    bad = osz != tsz
    for i, (a, b) in enumerate(zip(oslots, tslots)):
        common = a & b
        bad |= not common
        shown = sorted(common or b)[0]
        print(f"slot {i:2} {'ok  ' if common else 'DIFF'} {shown[:110]}" + ("" if common else f"   ours: {sorted(a)}"))
    if bad:
        sys.exit(f"vtable mismatch: ours {osz} bytes, NIXL's {tsz} bytes")
    print(f"nixl vtable check: {len(oslots)} slots match {theirs}")


main()
