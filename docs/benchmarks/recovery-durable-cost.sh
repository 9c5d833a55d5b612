# Issue 24 design step 7: what the write-ahead of the recovery histories costs
# (--recovery-durable, with a data dir) on the fan-out of recovery-cost.sh: Socket.IO clients
# (each holds a pid, so each session keeps a history), C=1000 x S=10 of D=1000 at full rate,
# a fresh data dir per run, alternating durable on, durable off (histories in memory only, as
# before step 7) and recovery off (--recovery-window 0), same binary.
#   L=target/release/hubcast-load H=target/release/hubcast ROUNDS=3 bash docs/benchmarks/recovery-durable-cost.sh
. "$(dirname "$0")/shapes.sh"
run() { # LABEL WINDOW DURABLE
  dir=$(mktemp -d)
  echo "=== round $round $1 window=$2 durable=$3"; uptime
  $L --spawn "$H" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir="$dir" --hubcast-arg=--recovery-window="$2" \
    --hubcast-arg=--recovery-durable="$3" \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 4 --pipeline 16 --rate 0 --transport socketio 2>&1 | tail -n 3
  echo "store log bytes: $(du -sb "$dir" | cut -f1)"
  rm -rf "$dir"
}
for round in $(seq "${ROUNDS:-3}"); do
  run durable 120 true; run memory 120 false; run off 0 true
done
