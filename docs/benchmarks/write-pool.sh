#!/usr/bin/env bash
# Write buffers from a per-core pool and queues that reserve their last drain's size
# (docs/benchmarks/2026-11-27-write-pool.md): OLD and NEW alternating, fresh
# `hubcast --cores 1` pinned to CPU 0, harness on CPU 1, memory-only; issue 10's fan-out shape
# and issue 13's at max rate with 4 publishers.
#   docs/benchmarks/write-pool.sh OLD_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-4}
. "$(dirname "$0")/shapes.sh"
for round in $(seq "$ROUNDS"); do
  fanout10 old "$OLD"; fanout13 old "$OLD" 0 4
  fanout10 new "$NEW"; fanout13 new "$NEW" 0 4
done
