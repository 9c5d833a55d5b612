#!/usr/bin/env python3
# Self Ir per function from a callgrind output: cgself.py FILE [N] [DIVISOR]
import sys, re, collections
path = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 40
div = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
names = {}; cost = collections.Counter(); fn = None; skip = False
def name(v):
    m = re.match(r'\((\d+)\)(?: (.*))?', v)
    if not m: return v
    if m.group(2) is not None: names[m.group(1)] = m.group(2)
    return names.get(m.group(1), v)
fnames = {}
for line in open(path, errors='replace'):
    line = line.rstrip('\n')
    if not line: continue
    c = line[0]
    if line.startswith('fn='):
        fn = name(line[3:]); continue
    if line.startswith(('cfn=', 'cfi=', 'cfl=', 'cob=')):
        if line.startswith('cfn='): name(line[4:])
        continue
    if line.startswith('calls='):
        skip = True; continue
    if c.isdigit() or c in '+-*':
        if skip: skip = False; continue
        parts = line.split()
        if len(parts) > 1 and fn is not None:
            cost[fn] += int(parts[1])
        continue
    if '=' in line:
        k, v = line.split('=', 1)
        if k in ('fl', 'fi', 'fe', 'ob'): pass
total = sum(cost.values())
print(f"total {total} ({total/div:.1f} per unit)")
for f, v in cost.most_common(N):
    print(f"{v/div:9.1f} {f[:150]}")
