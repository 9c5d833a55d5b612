#!/bin/bash
# Issue 25 item 4 (2026-11-28, the finished log's sync off the core): which hubcast thread
# waits in fdatasync/fsync and unlink, and how long. hubcast on CPU 0 (--cores 1, the default
# store in a fresh data dir), the harness's POST /ingest load on CPU 1 (10,000 devices,
# batches of 500, 4 connections); once messages flow, `strace -f -T` of those calls for 8 s
# (strace slows hubcast down: counts and waits, not rates), summed per thread name.
#   docs/benchmarks/issue25-store-core-wait.sh HUBCAST HUBCAST_LOAD
BIN=$(realpath "$1"); LOAD=$(realpath "$2")
OUT=$(mktemp -d)
PORT=$((18000 + RANDOM % 1000)); KEY=k
taskset -c 0 "$BIN" --bind 127.0.0.1 --port $PORT --primary-admin-secret $KEY --log-level warn --cores 1 --data-dir "$OUT/data" > "$OUT/hubcast.log" 2>&1 &
HP=$!
sleep 1
taskset -c 1 "$LOAD" --url http://127.0.0.1:$PORT --admin-key $KEY --warmup 3 --duration 12 ingest --devices 10000 --batch 500 --fleet-conns 4 > "$OUT/load.txt" 2>&1 &
LP=$!
sleep 4
strace -f -T -e trace=fdatasync,fsync,unlink,unlinkat,prctl -p $HP -o "$OUT/strace.txt" & SP=$!
sleep 8
for t in /proc/$HP/task/*; do echo "${t##*/} $(cat "$t/comm")"; done > "$OUT/threads.txt"
kill -INT $SP; wait $SP
wait $LP
kill $HP; wait $HP 2>/dev/null
echo "$(basename "$BIN"): $(uptime)"
python3 - "$OUT/threads.txt" "$OUT/strace.txt" <<'PY'
import re, sys, collections
names = dict(l.split(None, 1) for l in open(sys.argv[1]).read().split("\n") if l.strip())
acc = collections.defaultdict(list)
for line in open(sys.argv[2]):
    # Threads started while traced (the snapshot threads) are named by their PR_SET_NAME.
    n = re.match(r"(?:\[pid\s+)?(\d+)\]?\s+prctl\(PR_SET_NAME, \"([^\"]*)\"", line.strip())
    if n:
        names[n[1]] = n[2]
        continue
    m = re.match(r"(?:\[pid\s+)?(\d+)\]?\s+(\w+)\(.*<([\d.]+)>$", line.strip())
    if m:
        acc[(names.get(m[1], m[1]).strip(), m[2])].append(float(m[3]) * 1e3)
print(f"{'thread':<22} {'call':<10} {'calls':>5} {'total ms':>9} {'max ms':>7}")
for (t, call), v in sorted(acc.items()):
    print(f"{t:<22} {call:<10} {len(v):>5} {sum(v):>9.1f} {max(v):>7.1f}")
PY
rm -rf "$OUT"
