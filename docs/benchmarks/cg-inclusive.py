#!/usr/bin/env python3
import sys,collections
# inclusive cost per delivery of call edges into functions whose name contains NEEDLE (excluding recursive edges)
path=sys.argv[1]; div=float(sys.argv[2]); needles=sys.argv[3:]
from cgfile import Names
name=Names(); fn=None; cfn=None; expect=False; agg=collections.Counter()
for line in open(path,errors='replace'):
    line=line.rstrip('\n')
    if line.startswith('fn='): fn=name(line[3:]); continue
    if line.startswith('cfn='): cfn=name(line[4:]); continue
    if line.startswith('calls='): expect=True; continue
    if expect and line and (line[0].isdigit() or line[0] in '+-*'):
        expect=False
        p=line.split()
        for n in needles:
            if n in (cfn or '') and n not in (fn or ''): agg[n]+=int(p[1])
for n in needles: print(f"{agg[n]/div:8.1f} {n}")
