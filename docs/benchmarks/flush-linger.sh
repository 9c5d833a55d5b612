#!/bin/sh
# Issue 13 item 1 (docs/BENCHMARKS.md, "Flush policy"): OLD hubcast (no flush policy) against
# NEW with the policy off (--socket-linger-us 0) and on (the default, 500 µs), interleaved,
# each run on a fresh hubcast --cores 1 pinned to CPU 0 (the harness on CPU 1), the same
# fan-out as batch-frames.sh: C=1000 clients x S=10 of D=1000 devices, POST /ingest batches of
# 64, 16 in flight per publisher connection.
#   docs/benchmarks/flush-linger.sh OLD_HUBCAST NEW_HUBCAST [HUBCAST_LOAD] [ROUNDS] > out.txt
OLD=$1; NEW=$2; L=${3:-target/release/hubcast-load}; ROUNDS=${4:-5}
run() { # round label binary rate fleet-conns [hubcast-arg]
  echo "### round=$1 $2 rate=$4 P=$5"
  $L --spawn "$3" --cores 1 --pin --warmup 1 --duration 4 ${6:+--hubcast-arg=$6} \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$5" --pipeline 16 --rate "$4" --transport ws 2>&1
}
for round in $(seq "$ROUNDS"); do
  for p in 4 16; do   # max rate
    run "$round" old "$OLD" 0 $p
    run "$round" new-off "$NEW" 0 $p --socket-linger-us=0
    run "$round" new "$NEW" 0 $p
  done
  # 5,000 device messages/s in (50,000 deliveries/s): latency when the core is not saturated
  run "$round" old "$OLD" 5000 4
  run "$round" new-off "$NEW" 5000 4 --socket-linger-us=0
  run "$round" new "$NEW" 5000 4
done
