#!/usr/bin/env bash
# Issue 10's two CPU-second goals with main's default build (mimalloc): OLD10 (2d7a317) and NEW
# alternating, 5 rounds, fresh `hubcast --cores 1` pinned to CPU 0, harness on CPU 1, memory-only.
#   docs/benchmarks/issue10-final.sh OLD10_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD10=$1; NEW=$2; L=$3; ROUNDS=${4:-5}
. "$(dirname "$0")/shapes.sh"
for round in $(seq "$ROUNDS"); do
  ingest old10 "$OLD10"; fanout10 old10 "$OLD10"
  ingest new "$NEW"; fanout10 new "$NEW"
done
