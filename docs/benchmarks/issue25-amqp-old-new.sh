#!/bin/bash
# Issue 25 item 4: AMQP ingest per hubcast CPU-second (default store on), OLD and NEW alternating.
#   docs/benchmarks/issue25-amqp-old-new.sh OLD_HUBCAST NEW_HUBCAST HUBCAST_LOAD [ROUNDS]
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-5}
for round in $(seq 1 "$ROUNDS"); do
  for b in old new; do
    bin=$OLD; [ $b = new ] && bin=$NEW
    echo "=== round $round $b amqp"; uptime
    $L --spawn "$bin" --cores 1 --pin --duration 5 ingest --fleet amqp --devices 10000 --partitions 4 2>&1 | tail -n 2
  done
done
