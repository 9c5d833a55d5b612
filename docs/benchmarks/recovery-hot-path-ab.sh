#!/bin/bash
#   L=target/release/hubcast-load BASE=OLD/hubcast NEW=NEW/hubcast ROUNDS=5 bash docs/benchmarks/recovery-hot-path-ab.sh
# Socket.IO clients only: base and new, recovery on and off, alternating, ROUNDS rounds (recovery-cost.sh's run line).
. "$(dirname "$0")/shapes.sh"
run() { recovery_fanout "$1" "$2" "$3" socketio; } # LABEL BIN WINDOW
for round in $(seq "${ROUNDS:-5}"); do
  run base-on "$BASE" 120; run base-off "$BASE" 0; run new-on "$NEW" 120; run new-off "$NEW" 0
done
