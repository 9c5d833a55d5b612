#!/usr/bin/env bash
# Redis commands and bytes per device message with two instances, recovery on (default) vs
# off (--recovery-window 0), alternating, on a redis-server of its own (issue 24's measurement).
# usage: loadtest/scripts/recovery-redis.sh <hubcast binary> [M=20000] [rounds=3]
set -euo pipefail
BIN=$1; M=${2:-20000}; ROUNDS=${3:-3}; PORT=6391
cd "$(dirname "$0")/../.."
redis-server --port $PORT --save '' --appendonly no --daemonize yes --logfile /tmp/recovery-redis-$PORT.log
trap 'pkill -f "hubcast.*--port 1810[12]" || true; redis-cli -p $PORT shutdown nosave >/dev/null 2>&1 || true' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for mode in on off; do
    extra=(); [ $mode = off ] && extra=(--recovery-window 0)
    redis-cli -p $PORT flushall >/dev/null
    for i in a b; do
      port=$([ $i = a ] && echo 18101 || echo 18102)
      "$BIN" --port $port --cores 1 --data-dir none --primary-admin-secret test-primary \
        --redis-url redis://127.0.0.1:$PORT --instance-id $i --redis-prefix bench "${extra[@]}" > /tmp/recovery-redis-$i.log 2>&1 &
    done
    until curl -sf http://127.0.0.1:18101/status >/dev/null && curl -sf http://127.0.0.1:18102/status >/dev/null; do sleep 0.1; done
    echo "round $round recovery $mode: $(node loadtest/scripts/recovery-redis.mjs http://127.0.0.1:18101 http://127.0.0.1:18102 $PORT "$M")"
    pkill -f "hubcast.*--port 1810[12]"; while pgrep -f "hubcast.*--port 1810[12]" >/dev/null; do sleep 0.1; done
  done
done
