#!/usr/bin/env python3
# Self Ir per function from a callgrind output: cg-self.py FILE [N] [DIVISOR]
import sys, collections
from cgfile import self_costs
path = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 40
div = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
cost = collections.Counter()
for _, fn, counts in self_costs(path):
    if counts:
        cost[fn] += int(counts[0])
total = sum(cost.values())
print(f"total {total} ({total/div:.1f} per unit)")
for f, v in cost.most_common(N):
    print(f"{v/div:9.1f} {f[:150]}")
