#!/usr/bin/env bash
# Issue 13's P=16 shape at 16 and at 4 batches in flight per publisher connection, alternating
# (what the P=16 p99 is made of: Little's law on the messages in flight).
# DEPTHS="16 8 4" picks the depths (default 16 4).
#   docs/benchmarks/fanout-p16-depth.sh HUBCAST_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
BIN=$1; L=$2; ROUNDS=${3:-4}
. "$(dirname "$0")/shapes.sh"
for round in $(seq "$ROUNDS"); do
  for depth in ${DEPTHS:-16 4}; do
    echo "=== round $round new fanout13 rate=0 P=16 pipeline=$depth"; uptime
    $L --spawn "$BIN" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none \
      fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 16 --pipeline "$depth" --rate 0 --transport ws 2>&1 | tail -n 2
  done
done
