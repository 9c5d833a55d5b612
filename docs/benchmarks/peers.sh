#!/usr/bin/env bash
# Issue 25 items 1-2: hubcast beside NATS 2.9 and Mosquitto 2.0 over their WebSocket listeners,
# the same fan-out shapes, each server pinned to CPU 0 and the harness to CPU 1, loopback.
#
#   docs/benchmarks/peers.sh H L [ROUNDS] [ROWS]
#     H: hubcast (release), L: hubcast-load (release), ROUNDS: 3, ROWS: all of the list below
#     OUT=dir (default /tmp/peers-<time>): one JSON per run, then the medians
#     (docs/benchmarks/peers-summary.py OUT).
#
# Each run starts its own server: hubcast `--cores 1 --pin` with its default durable store in
# a fresh data dir (hubcast-load --spawn); nats-server / mosquitto started by `hubcast-load
# peer` on free loopback ports with a config of its own (NATS `websocket { no_tls: true }`,
# Mosquitto `listener N` + `protocol websockets`; not the system instances on 4222 / 1883),
# pinned to CPU 0 as taskset would. Servers alternate within a round, and the order rotates
# from one round to the next.
#
# PRIO='chrt -f 10': the harness and the server it starts run SCHED_FIFO (inherited), so that
# other work on a shared machine does not take their CPUs (each server's run-queue wait is in
# its row: server_runq_ms_s / hubcast_runq_ms_s). Meant for the fixed-rate rows, which use a
# fraction of a CPU; at max rate the two would hold both CPUs (the kernel leaves others 5 %).
#
# Shapes (C clients x S of D=1000 devices, P publisher connections, batches of 64 with one
# send time each, at most 16 batches unanswered per publisher):
#   max16   C=1000 S=10, max rate, P=16       max4   the same, P=4
#   wide    C=100 S=100, max rate, P=16
#   r20k    C=1000 S=10, 20,000 msgs/s in, P=16
#   r5k16   C=1000 S=10, 5,000 msgs/s in (50 k out), P=16
#   r5k4    the same, P=4
set -u
H=${1:?usage: peers.sh HUBCAST HUBCAST_LOAD [ROUNDS] [ROWS]}
L=${2:?usage: peers.sh HUBCAST HUBCAST_LOAD [ROUNDS] [ROWS]}
ROUNDS=${3:-3}
ROWS=${4:-max16 max4 wide r20k r5k16 r5k4}
OUT=${OUT:-/tmp/peers-$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$OUT"
ulimit -n 20000

shape() {
  local base="--devices 1000 --batch 64 --pipeline 16"
  case $1 in
    max16) echo "$base --clients 1000 --subs 10 --fleet-conns 16 --rate 0" ;;
    max4) echo "$base --clients 1000 --subs 10 --fleet-conns 4 --rate 0" ;;
    wide) echo "$base --clients 100 --subs 100 --fleet-conns 16 --rate 0" ;;
    r20k) echo "$base --clients 1000 --subs 10 --fleet-conns 16 --rate 20000" ;;
    r5k16) echo "$base --clients 1000 --subs 10 --fleet-conns 16 --rate 5000" ;;
    r5k4) echo "$base --clients 1000 --subs 10 --fleet-conns 4 --rate 5000" ;;
    *) echo "unknown row $1" >&2; exit 2 ;;
  esac
}

run() { # SERVER ROW ROUND
  local json="$OUT/$2-$1-$3.json"
  echo "=== round $3 $1 $2"
  uptime
  case $1 in
    hubcast) ${PRIO:-} $L --spawn "$H" --cores 1 --pin --warmup 1 --duration 4 --json "$json" fanout $(shape "$2") --transport ws 2>&1 | tail -n 2 ;;
    *) ${PRIO:-} $L --cores 1 --pin --warmup 1 --duration 4 --json "$json" peer --peer "$1" $(shape "$2") 2>&1 | tail -n 2 ;;
  esac
}

servers=(hubcast nats mosquitto)
for round in $(seq 1 "$ROUNDS"); do
  for row in $ROWS; do
    for i in 0 1 2; do
      run "${servers[$(( (i + round - 1) % 3 ))]}" "$row" "$round"
    done
  done
done
python3 "$(dirname "$0")/peers-summary.py" "$OUT"
