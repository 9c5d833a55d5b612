#!/bin/bash
#   L=target/release/hubcast-load BASE=OLD/hubcast NEW=NEW/hubcast ROUNDS=5 bash docs/benchmarks/recovery-hot-path-ab.sh
# Socket.IO clients only: base and new, recovery on and off, alternating, ROUNDS rounds (recovery-cost.sh's run line).
. "$(dirname "$0")/shapes.sh"
run() { # LABEL BIN WINDOW
  echo "=== round $round $1 window=$3 transport=socketio"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none --hubcast-arg=--recovery-window="$3" \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 4 --pipeline 16 --rate 0 --transport socketio 2>&1 | tail -n 3
}
for round in $(seq "${ROUNDS:-5}"); do
  run base-on "$BASE" 120; run base-off "$BASE" 0; run new-on "$NEW" 120; run new-off "$NEW" 0
done
