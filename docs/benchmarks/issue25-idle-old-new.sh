#!/bin/bash
# Issue 25 item 3: RSS per idle WebSocket with its session, 10 grants and 10 subscriptions
# (C = 10,000 sessions over D = 1,000 devices), OLD and NEW hubcast alternating, and
# Mosquitto's RSS per client with 10 subscriptions measured in the same session, its clients
# over its WebSocket listener (as hubcast's sockets and issue 25's figure) and over TCP.
#   docs/benchmarks/issue25-idle-old-new.sh OLD_HUBCAST NEW_HUBCAST HUBCAST_LOAD [ROUNDS]
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-3}
ulimit -n 20000
for round in $(seq 1 "$ROUNDS"); do
  for b in old new; do
    bin=$OLD; [ $b = new ] && bin=$NEW
    echo "=== round $round $b idle subs=10"; uptime
    $L --spawn "$bin" --cores 1 --pin --warmup 2 --duration 3 idle --clients 10000 --subs 10 --devices 1000 2>&1 | tail -n 2
  done
  echo "=== round $round mosquitto subs=10 websockets"
  python3 "$(dirname "$0")/../../loadtest/mqtt_idle.py" --clients 10000 --subs 10 --devices 1000 --hold 3 --pin --websockets
  echo "=== round $round mosquitto subs=10"
  python3 "$(dirname "$0")/../../loadtest/mqtt_idle.py" --clients 10000 --subs 10 --devices 1000 --hold 3 --pin
done
