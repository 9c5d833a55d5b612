#!/bin/bash
# Restart on a filled data dir: wall time to the "listening on" line and the CPU time
# (user + system, all threads) hubcast spent until then, from /proc/<pid>/stat.
# usage: store-restart-cpu.sh BIN DIR RUNS
BIN=$1; DIR=$2; RUNS=${3:-3}
TICK=$(getconf CLK_TCK)
for i in $(seq 1 $RUNS); do
  rm -f /tmp/src.out
  T0=$(date +%s%N)
  $BIN --bind 127.0.0.1 --port 0 --cores 2 --primary-admin-secret k --data-dir "$DIR" --log-level info > /tmp/src.out 2>/tmp/src.err &
  PID=$!
  while ! grep -q "listening on" /tmp/src.out 2>/dev/null; do sleep 0.005; done
  T1=$(date +%s%N)
  read -r UT ST <<< "$(awk '{print $14, $15}' /proc/$PID/stat)"
  echo "run $i: start to serving $(( (T1-T0)/1000000 )) ms wall, $(( (UT+ST)*1000/TICK )) ms CPU; load average $(cut -d' ' -f1 /proc/loadavg)"
  kill -9 $PID; wait $PID 2>/dev/null
done
