#!/usr/bin/env bash
# The flush policy's saturation test on a CPU taken by other work (issue 25 item 2): OLD and NEW
# hubcast alternating at 5,000 and 20,000 msgs/s in (C=1000 S=10, P=16, default store), with a
# busy loop of our own on hubcast's CPU 0 (same priority) beside whatever else runs there.
#
#   docs/benchmarks/peers-linger-ab.sh OLD NEW HUBCAST_LOAD [ROUNDS]
set -u
OLD=${1:?old hubcast}; NEW=${2:?new hubcast}; L=${3:?hubcast-load}; ROUNDS=${4:-4}
taskset -c 0 sh -c 'while :; do :; done' &
hog=$!
trap 'kill $hog' EXIT
for rate in 5000 20000; do
  for round in $(seq 1 "$ROUNDS"); do
    # The order swaps each round.
    if (( round % 2 )); then pair=("old|$OLD||" "new|$NEW||"); else pair=("new|$NEW||" "old|$OLD||"); fi
    PS=16 RATE=$rate bash "$(dirname "$0")/peers-p99-ab.sh" "$L" 1 "${pair[@]}" | sed "s/^round 1/rate $rate round $round/"
  done
done
