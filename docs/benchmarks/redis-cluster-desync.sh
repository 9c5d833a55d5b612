#!/bin/bash
# Repeats redis-cluster.sh's cluster "2-socket" case to catch the SSUBSCRIBE desync (docs/design/redis-cluster.md
# "Known gaps"): fresh A and B on a private 3-master cluster each run, a WebSocket on B, PUT /subscriptions
# of 1,000 devices on A; counts B's desync warnings and link restarts.
#   RUNS=8 bash docs/benchmarks/redis-cluster-desync.sh [hubcast]
set -u
H=${1:-target/release/hubcast}; SUBS=$(dirname "$(realpath "$0")")/redis-cluster-subs.py; KEY=hubcast-load-key; CP=7120; PA=18191; PB=18192
OUT=$(mktemp -d /tmp/cbench-desync.XXXX); pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
CPORTS="$CP $((CP+1)) $((CP+2))"
for p in $CPORTS; do taskset -c 1 nice -n 5 redis-server --bind 127.0.0.1 --port $p --cluster-enabled yes --cluster-config-file "$OUT/nodes-$p.conf" --cluster-node-timeout 1000 --save '' --appendonly no --dir "$OUT" >/dev/null 2>&1 & pids+=($!); done
for p in $CPORTS; do for _ in $(seq 100); do redis-cli -p $p ping >/dev/null 2>&1 && break; sleep 0.1; done; done
redis-cli --cluster create $(for p in $CPORTS; do echo 127.0.0.1:$p; done) --cluster-replicas 0 --cluster-yes >/dev/null
for p in $CPORTS; do for _ in $(seq 200); do redis-cli -p $p cluster info | grep -q cluster_state:ok && break; sleep 0.1; done; done
SEEDS=redis://127.0.0.1:$CP,redis://127.0.0.1:$((CP+1)),redis://127.0.0.1:$((CP+2))
for i in $(seq ${RUNS:-8}); do
  for p in $CPORTS; do redis-cli -p $p flushall >/dev/null; done
  for id in a b; do port=$PA; [ $id = b ] && port=$PB
    taskset -c 0 nice -n 5 $H --bind 127.0.0.1 --port $port --cores 1 --data-dir none --client-rate 0 --primary-admin-secret $KEY --instance-id $id --redis-prefix bench --redis-cluster-nodes $SEEDS --lease-ttl 60 > $OUT/$id-$i.log 2>&1 & pids+=($!); eval "P$id=$!"
  done
  for u in $PA:a $PB:b; do for _ in $(seq 200); do curl -s -H "Shared-Access-Key: $KEY" http://127.0.0.1:${u%:*}/metrics | grep -q "^hubcast_redis_connected{instance=\"${u#*:}\"} 1" && break; sleep 0.1; done; done
  echo "run $i: $(nice python3 "$SUBS" socket http://127.0.0.1:$PA http://127.0.0.1:$PB $KEY $(echo $CPORTS | tr ' ' ,) 1000 | cut -d' ' -f1-2) desync_warnings=$(grep -c 'answered with something else' $OUT/b-$i.log) link_gave_up=$(grep -c 'could not be subscribed' $OUT/b-$i.log) load=$(cut -d' ' -f1 /proc/loadavg)"
  kill $Pa $Pb; while kill -0 $Pa 2>/dev/null || kill -0 $Pb 2>/dev/null; do sleep 0.1; done
  for port in $PA $PB; do while (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; do sleep 0.1; done; done
done
echo "logs: $OUT"
