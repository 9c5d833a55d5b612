# The workloads of the side-by-side scripts, written once (sourced by final-old-new.sh,
# write-pool.sh, mimalloc-default.sh, issue10-final.sh, issue13-final.sh and the others that
# `grep -l shapes.sh docs/benchmarks/*.sh` lists). Each prints a
# "=== round R LABEL SHAPE" line, the machine's load, then the harness's result lines.
# Needs $L (hubcast-load) and $round. Every run: a fresh `hubcast --cores 1` pinned to CPU 0,
# the harness on CPU 1, memory-only (but `ingest_store ... on`); cg, pair and redis_pair at the
# end count instructions under callgrind instead.
ulimit -n 20000

# Issue 10's ingest: 10,000 devices, POST /ingest batches of 500 on 4 connections.
#   ingest LABEL BIN [PIPELINE]
ingest() {
  echo "=== round $round $1 ingest${3:+ pipeline=$3}"; uptime
  $L --spawn "$2" --cores 1 --pin --hubcast-arg=--data-dir=none ingest --devices 10000 --batch 500 --fleet-conns 4 ${3:+--pipeline $3} 2>&1 | tail -n 2
}

# Issue 10's fan-out: 10,000 sockets, 1,000 subscribers per device, the fleet asking 1,000 and
# 2,000 msgs/s in batches of 50 on 2 connections.   fanout10 LABEL BIN
fanout10() {
  echo "=== round $round $1 fanout10"; uptime
  $L --spawn "$2" --cores 1 --pin --hubcast-arg=--data-dir=none fanout --clients 10000 --devices 10 --batch 50 --fleet-conns 2 --rate 1000,2000 2>&1 | tail -n 3
}

# Issue 13's fan-out: C=1000 x S=10 of D=1000, batches of 64, 16 in flight per publisher
# connection.   fanout13 LABEL BIN RATE P
fanout13() {
  echo "=== round $round $1 fanout13 rate=$3 P=$4"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$4" --pipeline 16 --rate "$3" --transport ws 2>&1 | tail -n 2
}

# Issue 13's three shapes in turn.   fanout13_all LABEL BIN
fanout13_all() {
  fanout13 "$1" "$2" 0 4
  fanout13 "$1" "$2" 0 16
  fanout13 "$1" "$2" 5000 4
}

# Issue 25 item 4's ingest with the store off (--data-dir none) or on (the default store in a
# fresh data dir, fsync every 1 s): 10,000 devices, POST /ingest batches of 500 on 4
# connections; the header names the run.   ingest_store HEADER BIN on|off
ingest_store() {
  local args=()
  [ "$3" = off ] && args=(--hubcast-arg=--data-dir=none)
  echo "=== round $round $1"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 5 "${args[@]}" ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -n 2
}

# Issue 24's cost: issue 13's C=1000 x S=10 of D=1000 at full rate (P=4) with connection state
# recovery's window WINDOW (120, the default, or 0: off), over TRANSPORT (socketio, ws,
# ws-offsets).   recovery_fanout LABEL BIN WINDOW TRANSPORT
recovery_fanout() {
  echo "=== round $round $1 window=$3 transport=$4"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none --hubcast-arg=--recovery-window="$3" \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 4 --pipeline 16 --rate 0 --transport "$4" 2>&1 | tail -n 3
}

# Issue 24's instruction counts (recovery-instructions.sh under callgrind), OLD and NEW at
# once, their lines prefixed with the label. Needs $D (this folder), $L, $OLD, $NEW, and for
# redis_pair $REDIS_A / $REDIS_B (a redis-server of its own per build).
cg() { # LABEL BIN WINDOW [hubcast args]
  local label=$1 bin=$2 w=$3; shift 3
  bash "$D/recovery-instructions.sh" "$bin" "$w" "$L" "$@" 2>&1 | grep -v '^sending command' | sed "s/^/[$label] /"
}
pair() { # LABEL WINDOW [hubcast args]: OLD and NEW at once
  local label=$1 w=$2; shift 2
  cg "old $label" "$OLD" "$w" "$@" > /tmp/cg-old.$$ & cg "new $label" "$NEW" "$w" "$@" > /tmp/cg-new.$$; wait
  cat /tmp/cg-old.$$ /tmp/cg-new.$$
}
redis_pair() { # LABEL WINDOW: each build on its own redis-server
  local label=$1 w=$2
  redis-cli -p "$REDIS_A" flushall > /dev/null; redis-cli -p "$REDIS_B" flushall > /dev/null
  cg "old $label" "$OLD" "$w" --redis-url "redis://127.0.0.1:$REDIS_A" > /tmp/cg-old.$$ &
  cg "new $label" "$NEW" "$w" --redis-url "redis://127.0.0.1:$REDIS_B" > /tmp/cg-new.$$; wait
  cat /tmp/cg-old.$$ /tmp/cg-new.$$
}
