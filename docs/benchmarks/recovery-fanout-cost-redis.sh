#!/bin/bash
# recovery-hot-path-ab.sh's run with --redis-url (one instance on a redis-server of its own, flushed
# before each run): the offset's device part (steps 10-11) is made only with Redis and a window.
# callgrind could not run this shape with Redis: under valgrind the harness's 1,000 session grants
# answer 503 (the session's optimistic write retried 8 times), so CPU time only.
#   L=… BASE=OLD/hubcast NEW=NEW/hubcast REDIS=6397 ROUNDS=3 bash docs/benchmarks/recovery-fanout-cost-redis.sh
. "$(dirname "$0")/shapes.sh"
R=${REDIS:-6397}
run() { # LABEL BIN WINDOW
  redis-cli -p "$R" flushall > /dev/null
  echo "=== round $round $1 window=$3 transport=socketio redis"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none --hubcast-arg=--recovery-window="$3" \
    --hubcast-arg=--redis-url="redis://127.0.0.1:$R" \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 4 --pipeline 16 --rate 0 --transport socketio 2>&1 | tail -n 3
}
for round in $(seq "${ROUNDS:-3}"); do
  run base-on "$BASE" 120; run base-off "$BASE" 0; run new-on "$NEW" 120; run new-off "$NEW" 0
done
