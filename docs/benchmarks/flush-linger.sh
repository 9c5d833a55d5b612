#!/bin/sh
# Issue 13 item 1 (docs/benchmarks/2026-11-25-flush-policy.md): OLD hubcast (no flush policy) against
# NEW with the policy off (--socket-linger-us 0), at 500 µs and at 5 ms (the default),
# interleaved, each run on a fresh hubcast --cores 1 pinned to CPU 0 (the harness on CPU 1),
# the fan-out of batch-frames.sh: C=1000 clients x S=10 of D=1000 devices, POST /ingest batches
# of 64, 16 in flight per publisher connection; max rate with P=4 and P=16 connections, and
# 5,000 messages/s in (50,000 deliveries/s) with P=4.
#   docs/benchmarks/flush-linger.sh OLD_HUBCAST NEW_HUBCAST [HUBCAST_LOAD] [ROUNDS] > out.txt
OLD=$1; NEW=$2; L=${3:-target/release/hubcast-load}; ROUNDS=${4:-4}
ulimit -n 20000
run() { # round label binary rate fleet-conns [hubcast-arg]
  echo "### round=$1 $2 rate=$4 P=$5"
  $L --spawn "$3" --cores 1 --pin --warmup 1 --duration 4 ${6:+--hubcast-arg=$6} \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$5" --pipeline 16 --rate "$4" --transport ws 2>&1 | tail -n 2
}
configs() { # round rate P
  run "$1" old "$OLD" "$2" "$3"
  run "$1" new-off "$NEW" "$2" "$3" --socket-linger-us=0
  run "$1" new-500us "$NEW" "$2" "$3" --socket-linger-us=500
  run "$1" new-5ms "$NEW" "$2" "$3" --socket-linger-us=5000
}
for round in $(seq "$ROUNDS"); do
  configs "$round" 0 4
  configs "$round" 0 16
  configs "$round" 5000 4
done
