# Issue 24: recovery-perf.sh's samples as nanoseconds of hubcast CPU per delivery, by symbol
# (user and kernel), for two labels (every round of each summed), and B - A.
#   python3 docs/benchmarks/recovery-perf-diff.py OUT A B [TOP] [FREQ]
import sys, glob, re, collections
out, a, b = sys.argv[1:4]
top = int(sys.argv[4]) if len(sys.argv) > 4 else 40
freq = float(sys.argv[5]) if len(sys.argv) > 5 else 2999.0
def load(label):
    ns = collections.Counter(); deliveries = 0; runs = 0; writes = 0
    for rep in sorted(glob.glob(f"{out}/{label}.*.report")):
        tag = rep[:-len(".report")]
        hdr = None
        for line in open(tag + ".load"):
            if line.startswith("rate"): hdr = line.split()
            elif line.strip().startswith("max") and hdr:
                v = dict(zip(hdr, line.split()))
                d = float(v["delivered_msg_s"].replace(",", "")) * 4  # --duration 4
                deliveries += d; writes += d / float(v["frames_per_write"])
        for line in open(rep):
            m = re.match(r"\s*(\d+)\s+(\S+)\s+\[(.)\]\s+(.*)$", line)
            if m:
                ns[(m.group(2), m.group(4).strip())] += int(m.group(1)) * 1e9 / freq
        runs += 1
    return {k: v / deliveries for k, v in ns.items()}, (runs, deliveries / writes)
A, ra = load(a); B, rb = load(b)
def kern(k): return k[0].startswith("[kernel")
for name, sel in (("user", lambda k: not kern(k)), ("kernel", kern), ("all", lambda k: True)):
    ta = sum(v for k, v in A.items() if sel(k)); tb = sum(v for k, v in B.items() if sel(k))
    print(f"{name:6s} ns/delivery {a} {ta:7.1f}  {b} {tb:7.1f}  diff {tb-ta:+7.1f};  per write {ta*ra[1]/1000:5.2f} vs {tb*rb[1]/1000:5.2f} us")
print(f"runs {ra[0]} and {rb[0]}; frames per write {ra[1]:.1f} and {rb[1]:.1f}")
keys = set(A) | set(B)
rows = sorted(keys, key=lambda k: -abs(B.get(k, 0) - A.get(k, 0)))
print(f"{'diff':>7s} {a:>8s} {b:>8s}  dso symbol (ns of CPU per delivery)")
for k in rows[:top]:
    print(f"{B.get(k,0)-A.get(k,0):+7.1f} {A.get(k,0):8.1f} {B.get(k,0):8.1f}  {k[0]} {k[1][:90]}")
