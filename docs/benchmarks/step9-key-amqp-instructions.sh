#!/bin/bash
# Design step 9 (a stable key per message): instructions per AMQP device message of a whole
# hubcast process, OLD (main before the step, cc48e90) and NEW (de9a39f) alternating, counted
# by callgrind with loadtest/scripts/amqp-instructions.sh (one core, epoll, the default
# durable store, 10,000 devices over 4 partitions, as fast as the credit allows). Pinned to
# one CPU with taskset (callgrind counts are deterministic: the pinning only keeps the run
# from spreading over the shared machine).
#   docs/benchmarks/step9-key-amqp-instructions.sh OLD_HUBCAST NEW_HUBCAST HUBCAST_LOAD [ROUNDS]
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-2}
for round in $(seq 1 "$ROUNDS"); do
  for b in old new; do
    bin=$OLD; [ $b = new ] && bin=$NEW
    echo "=== round $round $b"; uptime
    taskset -c 1 loadtest/scripts/amqp-instructions.sh "$bin" "$L" 2>&1 | tail -n 1
  done
done
