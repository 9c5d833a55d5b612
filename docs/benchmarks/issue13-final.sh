#!/usr/bin/env bash
# Issue 13's fan-out goals with main's default build: C=1000 x S=10 of D=1000, POST /ingest
# batches of 64, 16 in flight per publisher connection; max rate with P=4 and P=16, and 5,000
# msgs/s in (50,000 deliveries/s) with P=4; fresh `hubcast --cores 1` pinned to CPU 0, harness
# on CPU 1, memory-only.
#   docs/benchmarks/issue13-final.sh HUBCAST_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
BIN=$1; L=$2; ROUNDS=${3:-6}
. "$(dirname "$0")/shapes.sh"
for round in $(seq "$ROUNDS"); do
  fanout13_all new "$BIN"
done
