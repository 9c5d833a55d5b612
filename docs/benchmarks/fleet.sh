#!/bin/bash
# Issue 25 item 5: the fleet-scale run in one command. 1,000,000 devices through the harness's
# AMQP endpoint as fast as one hubcast core takes them, 18,000 live plain WebSockets each
# subscribed to 10 devices, the durable store on; then the same with three instances on one
# private redis-server (a free port, started and stopped by the harness), each holding a third
# of the sockets. hubcast pinned to CPU 0 (--cores 1 each), the harness and redis-server on CPU 1.
#   bash docs/benchmarks/fleet.sh [hubcast] [hubcast-load] [out-prefix]
# Writes OUT-1.txt/json and OUT-3.txt/json. Scale down with DEVICES=… SOCKETS=….
set -eu
H=${1:-target/release/hubcast}; L=${2:-target/release/hubcast-load}; OUT=${3:-/tmp/fleet}
DEVICES=${DEVICES:-1000000}; SOCKETS=${SOCKETS:-18000}; INSTANCES=${INSTANCES:-"1 3"}
# The open-file limit: the soft limit up to the hard one (the harness raises its own too).
ulimit -n "$(ulimit -Hn)"
echo "open files: $(ulimit -n); $(nproc) CPUs; load: $(cut -d' ' -f1-3 /proc/loadavg); $(git rev-parse --short HEAD 2>/dev/null)"
for n in $INSTANCES; do
  "$L" --spawn "$H" --cores 1 --pin --warmup 2 --duration 10 --json "$OUT-$n.json" \
    fleet --devices "$DEVICES" --sockets "$SOCKETS" --subs 10 --instances "$n" 2>&1 | tee "$OUT-$n.txt"
done
