# The workloads of the 2026-11-27 side-by-side scripts (sourced by final-old-new.sh,
# write-pool.sh, mimalloc-default.sh, issue10-final.sh, issue13-final.sh). Each prints a
# "=== round R LABEL SHAPE" line, the machine's load, then the harness's result lines.
# Needs $L (hubcast-load) and $round. Every run: a fresh `hubcast --cores 1` pinned to CPU 0,
# the harness on CPU 1, memory-only.
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
