#!/usr/bin/env bash
# Pool the rounds of several scripts/softroce-bench.sh outputs (saved
# stdout+stderr, one file per guest boot): per (op, size), the number of
# rounds, the median and inter-quartile range of the per-round ratios to
# perftest (kvwire's and, when present, COMPARE_BIN's), the median of the
# pairwise kvwire/COMPARE_BIN ratio with how often kvwire was ahead, and the
# best MB/s of each over all rounds (the guest runs at one of two speeds, so
# a round's neighbours can still differ by 1.6x: the peaks compare what each
# reaches when the guest is fast).
#
#   scripts/softroce-pool.sh boot1.out boot2.out ...
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 SOFTROCE_BENCH_OUTPUT..." >&2; exit 2; }
exec python3 - "$@" <<'PY'
import statistics, sys
rows = {}
peaks = {}  # (op, size) -> best MB/s of perftest, kvwire, COMPARE_BIN over every round
for path in sys.argv[1:]:
    raw = False
    for line in open(path, errors="replace"):
        if line.startswith("raw (MB/s"):
            raw = True
            continue
        if line.startswith("best of rounds"):
            raw = False
        f = line.split()
        # "  op size round perftest_MB/s kvwire_MB/s compare_MB/s"
        if raw and len(f) == 6 and float(f[3]) > 0:
            p, k, b = map(float, f[3:])
            rows.setdefault((f[0], int(f[1])), []).append((100 * k / p, 100 * b / p, k / b if b > 0 else 0))
            best = peaks.setdefault((f[0], int(f[1])), [0.0, 0.0, 0.0])
            for i, v in enumerate((p, k, b)):
                best[i] = max(best[i], v)
def q(v):
    v = sorted(v)
    qs = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return f"{statistics.median(v):6.1f}% [{qs[0]:5.1f}-{qs[2]:5.1f}]"
print(f"{len(sys.argv) - 1} boot(s); medians of per-round ratios to perftest [inter-quartile range]")
for (op, size) in sorted(rows, key=lambda k: (k[0] != "write", k[1])):
    r = rows[(op, size)]
    line = f"  {op:5} {size:6}  rounds {len(r):3}  kvwire {q([x[0] for x in r])}"
    if all(x[1] > 0 for x in r):
        pair = [x[2] for x in r]
        ahead = sum(1 for x in pair if x > 1)
        line += f"  compare {q([x[1] for x in r])}  kvwire/compare {statistics.median(pair):.3f} (ahead {ahead}/{len(r)})"
    print(line)
print("best of all rounds: perftest MB/s, kvwire MB/s (ratio) [COMPARE_BIN MB/s (ratio)]")
for (op, size) in sorted(peaks, key=lambda k: (k[0] != "write", k[1])):
    p, k, b = peaks[(op, size)]
    line = f"  {op:5} {size:6}  {p:7.2f}  {k:7.2f} ({100 * k / p:5.1f}%)"
    if b > 0:
        line += f"  {b:7.2f} ({100 * b / p:5.1f}%)"
    print(line)
PY
