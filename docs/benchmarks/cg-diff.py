#!/usr/bin/env python3
import sys
# Two outputs of cg-self.py: the functions whose self cost moved most (second - first): cg-diff.py A B [N]
def load(p):
    d={}
    for l in open(p).readlines()[1:]:
        v,f=l.strip().split(' ',1); d[f]=float(v)
    return d
a=load(sys.argv[1]); b=load(sys.argv[2])
keys=set(a)|set(b)
rows=sorted(keys,key=lambda k:-abs(b.get(k,0)-a.get(k,0)))
for k in rows[:int(sys.argv[3]) if len(sys.argv)>3 else 30]:
    print(f"{a.get(k,0):8.1f} {b.get(k,0):8.1f} {b.get(k,0)-a.get(k,0):+8.1f} {k[:120]}")
