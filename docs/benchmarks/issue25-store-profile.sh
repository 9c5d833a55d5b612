#!/bin/bash
# Issue 25 item 4 (2026-11-28): where the store's cost goes. hubcast on CPU 0 (--cores 1, the
# default store in a fresh data dir, or --data-dir none), the harness's POST /ingest load on
# CPU 1 (10,000 devices, batches of 500, 4 connections); once messages flow, for 5 s:
#   strace: `strace -c -f` of every hubcast thread (syscalls per commit; slows hubcast down);
#   perf:   `perf record -g`, its samples put in groups by issue25-store-profile.py.
# The store's commits and bytes over the same window come from /metrics.
#   docs/benchmarks/issue25-store-profile.sh strace|perf HUBCAST HUBCAST_LOAD store|none
TOOL=$1; BIN=$(realpath "$2"); LOAD=$(realpath "$3"); DATA=$4
OUT=$(mktemp -d)
D=none; [ "$DATA" = store ] && D=$OUT/data
PORT=$((18000 + RANDOM % 1000)); KEY=k
taskset -c 0 "$BIN" --bind 127.0.0.1 --port $PORT --primary-admin-secret $KEY --log-level warn --cores 1 --data-dir "$D" > "$OUT/hubcast.log" 2>&1 &
HP=$!
sleep 1
taskset -c 1 "$LOAD" --url http://127.0.0.1:$PORT --admin-key $KEY --warmup 3 --duration 10 ingest --devices 10000 --batch 500 --fleet-conns 4 > "$OUT/load.txt" 2>&1 &
LP=$!
sleep 5
m() { curl -s -H "shared-access-key: $KEY" http://127.0.0.1:$PORT/metrics | awk '/^hubcast_messages_in_total/ {s+=$2} /^hubcast_store_commits_total/ {c=$2} /^hubcast_store_bytes_written_total/ {b=$2} END {print s+0, c+0, b+0}'; }
read -r a0 c0 b0 < <(m)
case $TOOL in
  strace) strace -c -f -p $HP -o "$OUT/strace.txt" & SP=$!; sleep 5; kill -INT $SP; wait $SP ;;
  perf) perf record -g -p $HP -o "$OUT/perf.data" -- sleep 5 > /dev/null 2>&1 ;;
esac
read -r a1 c1 b1 < <(m)
n=$((a1 - a0)); c=$((c1 - c0))
echo "$(basename "$BIN") data-dir=$DATA: $n messages, $c commits ($((n / (c > 0 ? c : 1))) messages each), $(((b1 - b0) / (n > 0 ? n : 1))) bytes per message"
wait $LP
kill $HP; wait $HP 2>/dev/null
case $TOOL in
  strace) grep -E "calls|write|sync|unlink|fallocate|rename|total" "$OUT/strace.txt" ;;
  perf) perf script -i "$OUT/perf.data" -F comm,period,ip,sym 2>/dev/null | python3 "$(dirname "$0")/issue25-store-profile.py" ;;
esac
