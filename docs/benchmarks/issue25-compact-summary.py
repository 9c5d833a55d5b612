#!/usr/bin/env python3
"""Medians [min max] of the harness's rows in a raw output of issue25-compact-cpu.sh (or of
issue25-ingest-instructions.sh: instructions per message), per label and mode, and the
pairwise ratios of each label against the first one of its round.
    python3 docs/benchmarks/issue25-compact-summary.py RAW_OUTPUT"""
import re, statistics, sys, collections

rows = collections.defaultdict(list)  # (label, mode) -> [(round, msg_per_cpu_s, user, sys)]
cur = None
for line in open(sys.argv[1]):
    m = re.match(r"=== round (\d+) (\S+) (\S+) store=(\S+)", line)
    if m:
        cur = (int(m[1]), m[2], f"{m[3]} store={m[4]}")
        continue
    m = re.match(r"=== (\S+) round (\d+) (\S+)", line)
    if m:
        cur = (int(m[2]), m[3], m[1])
        continue
    if cur and line.startswith(" max "):
        f = [float(x.replace(",", "")) for x in line.split()[1:]]
        rows[(cur[1], cur[2])].append((cur[0], f[-1], f[5], f[6]))
        cur = None
    elif cur and "per message" in line:
        m = re.search(r"(\d+) per message", line)
        rows[(cur[1], cur[2])].append((cur[0], float(m[1]), 0, 0))
        cur = None

def med(v):
    return f"{statistics.median(v):,.0f} [{min(v):,.0f}-{max(v):,.0f}]"

labels = list(dict.fromkeys(l for l, _ in rows))
modes = list(dict.fromkeys(m for _, m in rows))
for mode in modes:
    print(f"## {mode}")
    base = dict((r, v) for r, v, _, _ in rows.get((labels[0], mode), []))
    for label in labels:
        rs = rows.get((label, mode), [])
        if not rs:
            continue
        vals = [v for _, v, _, _ in rs]
        ratios = [v / base[r] for r, v, _, _ in rs if r in base]
        us = [(u, s) for _, _, u, s in rs]
        extra = ""
        if any(u for u, _ in us):
            extra = f"  user {statistics.median(u for u, _ in us):.3f} sys {statistics.median(s for _, s in us):.3f} us/msg"
        print(f"  {label:5} {med(vals)}  / {labels[0]}: median {statistics.median(ratios):.3f} ({' '.join(f'{x:.2f}' for x in ratios)}){extra}")
# store on / off per label, pairwise by round
on_off = [m for m in modes if m.endswith("store=on") and m.replace("on", "off") in modes]
for mode in on_off:
    print(f"## {mode} / {mode.replace('store=on', 'store=off')}")
    for label in labels:
        on = dict((r, v) for r, v, _, _ in rows.get((label, mode), []))
        off = dict((r, v) for r, v, _, _ in rows.get((label, mode.replace("store=on", "store=off")), []))
        pairs = [on[r] / off[r] for r in on if r in off]
        if pairs:
            print(f"  {label:5} median {statistics.median(pairs):.3f} ({' '.join(f'{x:.2f}' for x in pairs)}); of the medians {statistics.median(on.values()) / statistics.median(off.values()):.3f}")
