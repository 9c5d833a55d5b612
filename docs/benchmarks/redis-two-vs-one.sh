#!/bin/bash
# Issue 12: fan-out through Redis (clients on instance B, fleet posting to instance A, every
# message crossing once) vs one instance alone (clients and fleet on A), side by side, runs
# alternating. hubcast instances (--cores 1 each) on CPU 0, the harness and redis-server on
# CPU 1 (a 2-core machine: this measures the hop's latency and costs, not scaling).
# CPU seconds of every process are read from /proc around each run.
#   bash docs/benchmarks/redis-two-vs-one.sh [hubcast] [hubcast-load] [runs]
set -u
H=${1:-target/release/hubcast}; L=${2:-target/release/hubcast-load}; RUNS=${3:-3}
KEY=hubcast-load-key
ARGS="--clients 1000 --subs 10 --devices 1000 --rate 5000,20000,50000,100000"
RP=6391; PA=18081; PB=18082
cpu() { awk '{print $14+$15}' /proc/$1/stat; }   # utime+stime in clock ticks
tick=$(getconf CLK_TCK)
start_hubcast() { # port extra...
  local port=$1; shift
  taskset -c 0 "$H" --bind 127.0.0.1 --port "$port" --cores 1 --data-dir none --primary-admin-secret $KEY "$@" >/dev/null 2>&1 &
  echo $!
}
wait_up() { for _ in $(seq 1 100); do curl -sf -o /dev/null "http://127.0.0.1:$1/status" && return 0; sleep 0.1; done; echo "port $1 not up" >&2; return 1; }
metric() { curl -s -H "Shared-Access-Key: $KEY" "http://127.0.0.1:$1/metrics" | awk -v s="$2" '$1==s {print $2}'; }

taskset -c 1 redis-server --port $RP --save '' --appendonly no >/dev/null 2>&1 &
REDIS=$!
sleep 0.5
trap 'kill $REDIS 2>/dev/null' EXIT

for run in $(seq 1 "$RUNS"); do
  echo "== run $run: one instance (clients and fleet on A)"
  A=$(start_hubcast $PA); wait_up $PA
  a0=$(cpu $A)
  taskset -c 1 "$L" --url http://127.0.0.1:$PA --pid $A --warmup 1 --duration 5 fanout $ARGS 2>&1 | tail -7
  a1=$(cpu $A)
  echo "cpu_s A=$(echo "($a1-$a0)/$tick" | bc -l | cut -c1-5) in=$(metric $PA 'hubcast_messages_in_total{source="Telemetry"}')"
  kill $A; wait $A 2>/dev/null

  echo "== run $run: two instances on Redis (clients on B, fleet posting to A)"
  redis-cli -p $RP flushall >/dev/null
  A=$(start_hubcast $PA --redis-url redis://127.0.0.1:$RP --instance-id a); B=$(start_hubcast $PB --redis-url redis://127.0.0.1:$RP --instance-id b)
  wait_up $PA; wait_up $PB
  a0=$(cpu $A); b0=$(cpu $B); r0=$(cpu $REDIS)
  taskset -c 1 "$L" --url http://127.0.0.1:$PB --pid $B --warmup 1 --duration 5 fanout $ARGS --fleet-target http://127.0.0.1:$PA 2>&1 | tail -7
  a1=$(cpu $A); b1=$(cpu $B); r1=$(cpu $REDIS)
  pub=$(metric $PA 'hubcast_redis_published_total{instance="a"}')
  echo "cpu_s A=$(echo "($a1-$a0)/$tick" | bc -l | cut -c1-5) B=$(echo "($b1-$b0)/$tick" | bc -l | cut -c1-5) redis=$(echo "($r1-$r0)/$tick" | bc -l | cut -c1-5) published=$pub received=$(metric $PB 'hubcast_redis_received_total{instance="b"}') redis_cpu_ms_per_1000=$(echo "($r1-$r0)/$tick*1000*1000/$pub" | bc -l | cut -c1-6)"
  kill $A $B; wait $A $B 2>/dev/null
done
