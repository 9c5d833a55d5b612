# Shared by redis-cluster.sh and redis-cluster-capacity.sh (sourced): one redis-server and a
# cluster of 3 masters (no replicas) on private ports, pinned to CPU 1, and the helpers both
# scripts drive hubcast and Redis with. Needs RP, CP, PA, PB, N, OUT, KEY, the array pids;
# HZ (Redis's default 10) and NODE_TIMEOUT (1000 ms unless set) for the servers; BIN, the
# hubcast binary start_hubcast runs.

redis_up() { # sets CPORTS and SEEDS
  taskset -c 1 $N redis-server --bind 127.0.0.1 --port $RP --hz ${HZ:-10} --save '' --appendonly no --dir "$OUT" >/dev/null 2>&1 & pids+=($!)
  CPORTS="$CP $((CP+1)) $((CP+2))"
  for p in $CPORTS; do
    taskset -c 1 $N redis-server --bind 127.0.0.1 --port $p --hz ${HZ:-10} --cluster-enabled yes --cluster-config-file "$OUT/nodes-$p.conf" \
      --cluster-node-timeout ${NODE_TIMEOUT:-1000} --save '' --appendonly no --dir "$OUT" >/dev/null 2>&1 & pids+=($!)
  done
  for p in $RP $CPORTS; do for _ in $(seq 100); do redis-cli -p $p ping >/dev/null 2>&1 && break; sleep 0.1; done; done
  redis-cli --cluster create $(for p in $CPORTS; do echo 127.0.0.1:$p; done) --cluster-replicas 0 --cluster-yes >/dev/null
  for p in $CPORTS; do for _ in $(seq 200); do redis-cli -p $p cluster info | grep -q cluster_state:ok && break; sleep 0.1; done; done
  SEEDS=$(for p in $CPORTS; do printf 'redis://127.0.0.1:%s,' $p; done); SEEDS=${SEEDS%,}
}
nodes_report() {
  redis-cli -p $CP cluster nodes | awk '{print "  master " $2 " slots " $9}'
  echo "  control slot ({bench}): $(redis-cli -p $CP cluster keyslot bench)"
}

start_hubcast() { # port id engine-flags... (log: $OUT/hubcast-<id>-$PHASE.log)
  local port=$1 id=$2; shift 2
  taskset -c 0 $N "$BIN" --bind 127.0.0.1 --port "$port" --cores 1 --data-dir none --client-rate 0 --primary-admin-secret $KEY \
    --instance-id "$id" --redis-prefix bench "$@" >"$OUT/hubcast-$id-$PHASE.log" 2>&1 &
  echo $!
}
# Stops instances and waits until they are gone and their ports free (they are not children
# of this shell: started in $(…), so `wait` cannot be used).
stop() {
  kill "$@" 2>/dev/null
  for p in "$@"; do while kill -0 $p 2>/dev/null; do sleep 0.1; done; done
  for port in $PA $PB; do while (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; do sleep 0.1; done; done
}
wait_connected() { # url id
  for _ in $(seq 200); do
    curl -s -H "Shared-Access-Key: $KEY" "$1/metrics" | grep -q "^hubcast_redis_connected{instance=\"$2\"} 1" && return 0
    sleep 0.1
  done
  echo "instance $2 not connected to Redis" >&2; return 1
}
# Warnings the instances logged in a phase (the first two kinds of each, with counts).
warns() { for f in "$OUT"/hubcast-*-"$1".log; do
  n=$(grep -c ' WARN \| ERROR ' "$f"); [ "$n" -gt 0 ] && echo "LOG $(basename "$f"): $n WARN/ERROR lines; $(grep ' WARN \| ERROR ' "$f" | sed -E 's/^[^ ]+ +//; s/(answer|reason)=.*/\1=…/' | sort | uniq -c | sort -rn | head -3 | tr -s ' ' | tr '\n' ';')"
done; return 0; }
flush() { for p in $NODES; do redis-cli -p $p flushall >/dev/null; done; }
cpu_of() { redis-cli -p "$1" info cpu | tr -d '\r' | awk -F: '$1=="used_cpu_sys"{s=$2} $1=="used_cpu_user"{u=$2} END{printf "%.6f", s+u}'; }
engine_flags() { if [ "$1" = single ]; then echo "--redis-url redis://127.0.0.1:$RP"; else echo "--redis-cluster-nodes $SEEDS"; fi; }
nodes_of() { if [ "$1" = single ]; then echo $RP; else echo $CPORTS; fi; }
