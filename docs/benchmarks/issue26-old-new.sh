#!/bin/bash
# Side by side: main before this session (82aa7cf) and after (c0c640a), alternating rounds.
L=/work/ci-clone/target/release/hubcast-load
NEW=/work/ci-clone/target/release/hubcast
OLD=docs/benchmarks/issue26-old-hubcast.sh   # drops --client-rate, which 82aa7cf does not know
source /work/main/docs/benchmarks/shapes.sh
for round in 1 2 3 4 5; do
  fanout13 old "$OLD" 0 4
  fanout13 new "$NEW" 0 4
  ingest old "$OLD"
  ingest new "$NEW"
done
