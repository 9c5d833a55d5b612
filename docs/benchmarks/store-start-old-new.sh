#!/bin/bash
# Start to serving with the stored state of DIR, old vs new binary alternating, N runs each:
# wall time to the "listening on" line, the CPU time (user + system, all threads) spent until
# then (from /proc/<pid>/stat: less sensitive to a shared machine than wall time), the RSS,
# and the load average when the run began.
# usage: store-start-old-new.sh DIR N BIN...
DIR=$1; N=${2:-3}; shift 2
TICK=$(getconf CLK_TCK)
for run in $(seq 1 $N); do
  for b in "$@"; do
    rm -f /tmp/sc.out
    LOAD=$(cut -d' ' -f1 /proc/loadavg)
    T0=$(date +%s%N)
    $b --bind 127.0.0.1 --port 0 --cores 2 --primary-admin-secret k --data-dir "$DIR" --log-level verbose > /tmp/sc.out 2> /tmp/sc.err &
    PID=$!
    while ! grep -q "listening on" /tmp/sc.out 2>/dev/null; do sleep 0.01; done
    T1=$(date +%s%N)
    read -r UT ST <<< "$(awk '{print $14, $15}' /proc/$PID/stat)"
    RSS=$(awk '/VmRSS/ {print int($2/1024)}' /proc/$PID/status)
    URL=$(grep -o "http://127.0.0.1:[0-9]*" /tmp/sc.out | head -1)
    code=$(curl -s -o /dev/null -w "%{http_code}" -H "Shared-Access-Key: k" $URL/lastValue/dev-000001)
    echo "run $run $b: start to serving $(( (T1-T0)/1000000 )) ms, CPU $(( (UT+ST)*1000/TICK )) ms (user $(( UT*1000/TICK )), sys $(( ST*1000/TICK ))), RSS ${RSS} MiB, load $LOAD (GET /lastValue $code); loaded $(grep 'stored state loaded' /tmp/sc.err | grep -o 'ms=[0-9]*'); restored $(grep 'stored state restored' /tmp/sc.err | grep -o 'ms=[0-9]*' | tr '\n' ' ')"
    kill -9 $PID; wait $PID 2>/dev/null
  done
done
