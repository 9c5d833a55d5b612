#!/usr/bin/env bash
# Issue 13's fan-out shapes, old and new binaries alternating (the per-delivery pass of
# 2026-11-27: one clock read per write, hand-written frame headers, in-place drains, one
# allocation per envelope, a pre-sized delivery list), then new alone at P=16 with 8 and 4
# batches in flight per publisher (what the P=16 latency is made of).
#   docs/benchmarks/fanout-pass.sh OLD_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-5}
. "$(dirname "$0")/shapes.sh"
# fanout13 with another pipeline depth.   fanout13_depth LABEL BIN P DEPTH
fanout13_depth() {
  echo "=== round $round $1 fanout13 rate=0 P=$3 pipeline=$4"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$3" --pipeline "$4" --rate 0 --transport ws 2>&1 | tail -n 2
}
for round in $(seq "$ROUNDS"); do
  fanout13_all old "$OLD"
  fanout13_all new "$NEW"
done
for round in $(seq 3); do
  fanout13_depth new "$NEW" 16 8
  fanout13_depth new "$NEW" 16 4
done
