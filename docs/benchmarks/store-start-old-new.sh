#!/bin/bash
# Start to serving with the stored state of DIR, old vs new binary alternating, N runs each.
DIR=$1; N=${2:-3}; shift 2
for run in $(seq 1 $N); do
  for b in "$@"; do
    rm -f /tmp/sc.out
    T0=$(date +%s%N)
    $b --bind 127.0.0.1 --port 0 --cores 2 --primary-admin-secret k --data-dir "$DIR" --log-level verbose > /tmp/sc.out 2> /tmp/sc.err &
    PID=$!
    while ! grep -q "listening on" /tmp/sc.out 2>/dev/null; do sleep 0.01; done
    T1=$(date +%s%N)
    URL=$(grep -o "http://127.0.0.1:[0-9]*" /tmp/sc.out | head -1)
    code=$(curl -s -o /dev/null -w "%{http_code}" -H "Shared-Access-Key: k" $URL/lastValue/dev-000001)
    echo "run $run $b: start to serving $(( (T1-T0)/1000000 )) ms (GET /lastValue $code); $(grep 'stored state loaded' /tmp/sc.err | grep -o 'ms=[0-9]*'); restored $(grep 'stored state restored' /tmp/sc.err | grep -o 'ms=[0-9]*' | tr '\n' ' ')"
    kill -9 $PID; wait $PID 2>/dev/null
  done
done
