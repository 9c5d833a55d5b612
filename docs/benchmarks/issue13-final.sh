#!/usr/bin/env bash
# Issue 13's fan-out goals with main's default build: C=1000 x S=10 of D=1000, POST /ingest
# batches of 64, 16 in flight per publisher connection; max rate with P=4 and P=16, and 5,000
# msgs/s in (50,000 deliveries/s) with P=4; fresh `hubcast --cores 1` pinned to CPU 0, harness
# on CPU 1, memory-only.
#   docs/benchmarks/issue13-final.sh HUBCAST_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
BIN=$1; L=$2; ROUNDS=${3:-6}
ulimit -n 20000
for round in $(seq "$ROUNDS"); do
  for shape in "0 4" "0 16" "5000 4"; do
    set -- $shape
    echo "=== round $round new fanout13 rate=$1 P=$2"; uptime
    $L --spawn "$BIN" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none \
      fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$2" --pipeline 16 --rate "$1" --transport ws 2>&1 | tail -n 2
  done
done
