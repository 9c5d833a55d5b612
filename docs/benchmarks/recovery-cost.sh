# Issue 24's cost (docs/design/recovery.md step 8): fan-out per hubcast CPU-second with
# connection state recovery on (--recovery-window 120, the default) and off (0), the same
# binary, alternating, on issue 13's C=1000 x S=10 of D=1000 shape at full rate (P=4), for the
# three socket kinds: socketio (every Socket.IO socket holds a pid, so its session keeps a
# history), ws-offsets (/ws?offsets=1, also keeps one; refused with recovery off, so only "on")
# and ws (plain /ws: no history either way, the control).
#   L=target/release/hubcast-load H=target/release/hubcast ROUNDS=5 bash docs/benchmarks/recovery-cost.sh
. "$(dirname "$0")/shapes.sh"
run() { recovery_fanout "$1" "$H" "$2" "$3"; } # LABEL WINDOW TRANSPORT
for round in $(seq "${ROUNDS:-5}"); do
  run on 120 socketio; run off 0 socketio
  run on 120 ws; run off 0 ws
  run on 120 ws-offsets
done
