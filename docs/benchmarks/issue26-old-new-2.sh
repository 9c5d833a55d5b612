#!/bin/bash
# More fan-out rounds, new first in each pair (order bias check).
L=/work/ci-clone/target/release/hubcast-load
NEW=/work/ci-clone/target/release/hubcast
OLD=docs/benchmarks/issue26-old-hubcast.sh   # drops --client-rate, which 82aa7cf does not know
source /work/main/docs/benchmarks/shapes.sh
for round in 6 7 8 9 10 11 12 13; do
  fanout13 new "$NEW" 0 4
  fanout13 old "$OLD" 0 4
done
