#!/usr/bin/env bash
# Write buffers from a per-core pool and queues that reserve their last drain's size
# (docs/BENCHMARKS.md, "Final figures, 2026-11-26"): OLD and NEW alternating, fresh
# `hubcast --cores 1` pinned to CPU 0, harness on CPU 1, memory-only; issue 10's fan-out shape
# and issue 13's at max rate with 4 publishers.
#   docs/benchmarks/write-pool.sh OLD_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-4}
ulimit -n 20000
for round in $(seq "$ROUNDS"); do
  for which in old new; do
    if [ $which = old ]; then BIN=$OLD; else BIN=$NEW; fi
    echo "=== round $round $which fanout10"; uptime
    $L --spawn "$BIN" --cores 1 --pin --hubcast-arg=--data-dir=none fanout --clients 10000 --devices 10 --batch 50 --fleet-conns 2 --rate 1000,2000 2>&1 | tail -n 3
    echo "=== round $round $which fanout13 rate=0 P=4"; uptime
    $L --spawn "$BIN" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none \
      fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 4 --pipeline 16 --rate 0 --transport ws 2>&1 | tail -n 2
  done
done
