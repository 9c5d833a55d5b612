#!/usr/bin/env python3
"""Groups `perf script -F comm,period,ip,sym` samples (stdin) of a hubcast run: user time in the
store (encode, put, CRC) or elsewhere; kernel time in the store log's write, fsync, unlink of
replaced logs, fallocate, the network; and by thread. docs/benchmarks/issue25-store-profile.sh."""
import collections, sys
tot=0; cats=collections.Counter()
def classify(comm, frames):
    # frames: list of (ip, sym), leaf first
    kern=[s for ip,s in frames if ip.startswith('ffff')]
    leaf_k = frames and frames[0][0].startswith('ffff')
    st=' '.join(s for _,s in frames)
    if not leaf_k:
        if 'store::' in frames[0][1] or 'crc32' in frames[0][1]: return 'user: store (encode, put, crc)'
        return 'user: rest'
    if 'ksys_write' in st or 'vfs_write' in st: return 'kernel: write (store log)'
    if 'fallocate' in st: return 'kernel: fallocate'
    if 'ext4_sync_file' in st or 'do_fsync' in st: return 'kernel: fsync/fdatasync'
    if 'do_unlinkat' in st: return 'kernel: unlink (old logs)'
    if 'io_uring' in st or 'tcp_' in st or 'net_rx' in st or 'sock_' in st: return 'kernel: network/io_uring'
    return 'kernel: other'
def flush(cur):
    global tot
    if not cur: return
    comm,period,frames=cur
    tot+=period
    cats[(comm,classify(comm,frames))]+=period
cur=None
for line in sys.stdin:
    if not line.strip():
        flush(cur); cur=None; continue
    if not line.startswith((' ','\t')):
        parts=line.split()
        cur=(parts[0], int(parts[-1]) if parts[-1].isdigit() else 1, [])
        continue
    p=line.strip().split(None,1)
    if cur is not None and len(p)==2:
        cur[2].append((p[0],p[1]))
flush(cur)
by=collections.Counter()
for (c,k),v in cats.items(): by[k]+=v
for k,v in sorted(by.items(), key=lambda x:-x[1]): print(f"{100*v/tot:6.2f}%  {k}")
print("by thread:")
th=collections.Counter()
for (c,k),v in cats.items(): th[c]+=v
for k,v in sorted(th.items(), key=lambda x:-x[1]): print(f"{100*v/tot:6.2f}%  {k}")
