#!/bin/sh
# Issue 13 items 1-2 (docs/benchmarks/2026-11-25-batched-frames.md): old hubcast (one envelope per frame)
# against new with the ws client and the batched ws-batch client, interleaved, each run on a
# fresh hubcast --cores 1 pinned to CPU 0 (the harness on CPU 1).
#   docs/benchmarks/batch-frames.sh OLD_HUBCAST NEW_HUBCAST [HUBCAST_LOAD] > out.txt
OLD=$1; NEW=$2; L=${3:-target/release/hubcast-load}
run() { # round label binary transport rate fleet-conns
  echo "### round=$1 $2 transport=$4 rate=$5 P=$6"
  $L --spawn "$3" --cores 1 --pin --warmup 1 --duration 4 \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$6" --pipeline 16 --rate "$5" --transport "$4" 2>&1
}
for round in 1 2 3 4 5 6 7; do for p in 4 16; do   # max rate
  run $round old "$OLD" ws 0 $p; run $round new "$NEW" ws 0 $p; run $round new "$NEW" ws-batch 0 $p
done; done
for round in 1 2 3 4; do                            # 20,000 msgs/s in, 200,000 deliveries/s
  run $round old "$OLD" ws 20000 4; run $round new "$NEW" ws 20000 4; run $round new "$NEW" ws-batch 20000 4
done
