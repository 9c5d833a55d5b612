#!/bin/bash
# The pause a store snapshot adds to live delivery, old vs new binary alternating: each run
# starts BIN on a fresh copy of DIR (1,000,000 devices' state, e.g. from store-start.sh), then
# the fan-out harness sends RATE messages/s over the 1,000,000 devices for SECS seconds, so
# each core's log passes 64 MiB and it writes a snapshot of its 500,000 devices while clients
# receive: the harness prints delivery latency (p50/p99/max); the snapshot's own log line says
# how long it took and (new binary) its longest slice.
# usage: store-snapshot-pause.sh DIR LOADBIN RATE SECS RUNS BIN...
DIR=$1; LOAD=$2; RATE=$3; SECS=$4; RUNS=$5; shift 5
for run in $(seq 1 $RUNS); do
  for b in "$@"; do
    rm -rf /tmp/hcpause; cp -r "$DIR" /tmp/hcpause
    rm -f /tmp/hp.out
    $b --bind 127.0.0.1 --port 0 --cores 2 --primary-admin-secret k --data-dir /tmp/hcpause --log-level verbose > /tmp/hp.out 2> /tmp/hp.err &
    PID=$!
    while ! grep -q "listening on" /tmp/hp.out 2>/dev/null; do sleep 0.05; done
    URL=$(grep -o "http://127.0.0.1:[0-9]*" /tmp/hp.out | head -1)
    echo "== run $run $b (load $(cut -d' ' -f1 /proc/loadavg))"
    $LOAD --url $URL --admin-key k --pid $PID --warmup 1 --duration $SECS fanout --devices 1000000 --rate $RATE --clients 200 --subs 5 2>&1 | tail -2
    grep "snapshot encoded" /tmp/hp.err | sed 's/.*DEBUG//'
    curl -s -H "Shared-Access-Key: k" $URL/metrics | grep -E "^hubcast_store_snapshot" 
    kill -9 $PID; wait $PID 2>/dev/null
  done
done
rm -rf /tmp/hcpause
