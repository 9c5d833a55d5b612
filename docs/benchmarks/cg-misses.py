#!/usr/bin/env python3
# D1 and LL misses per function (self cost) from a callgrind output made with --cache-sim=yes:
#   cg-misses.py FILE [N] [DIVISOR]
# Columns: D1 misses (read + write), LL misses (read + write), Ir; each divided by DIVISOR
# (deliveries in the counted window), the N functions with the most D1 misses first.
import sys, collections
from cgfile import self_costs
path = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 30
div = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
cost = collections.defaultdict(lambda: [0] * 9); events = None
for events, fn, counts in self_costs(path):
    row = cost[fn]
    for i, v in enumerate(counts[:9]):
        row[i] += int(v)
ix = {e: i for i, e in enumerate(events or [])}
def get(row, e): return row[ix[e]] if e in ix else 0
rows = [(get(r, 'D1mr') + get(r, 'D1mw'), get(r, 'DLmr') + get(r, 'DLmw'), get(r, 'Ir'), f) for f, r in cost.items()]
rows.sort(reverse=True)
tot = [sum(r[i] for r in rows) for i in range(3)]
print(f"total per delivery: D1 misses {tot[0]/div:.2f}, LL misses {tot[1]/div:.3f}, Ir {tot[2]/div:.0f}")
for d1, ll, ir, f in rows[:N]:
    print(f"{d1/div:8.3f} D1 {ll/div:7.3f} LL {ir/div:8.1f} Ir  {f[:110]}")
