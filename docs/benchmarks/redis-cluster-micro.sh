#!/bin/bash
# Issue 23: where a cluster master's per-message excess over one Redis goes, without hubcast.
# The same pipelined publications from redis-benchmark (one connection, -P 100, 200-byte
# payloads, one channel with one subscriber) to one plain redis-server and to a master of a
# 3-master cluster, each server under callgrind: instructions per publication (Redis's own
# work, not the machine's load), by function. Also PUBLISH on the cluster master (classic
# pub/sub: copied over the bus to every node), SPUBLISH on the plain server (the sharded
# command without cluster mode), RESP2 against RESP3 (hubcast speaks RESP3 to a cluster's
# masters), and the cluster bus messages each sends per publication.
#   bash docs/benchmarks/redis-cluster-micro.sh [publications]
set -u
N=${1:-200000}
OUT=$(mktemp -d /tmp/redis-micro.XXXX)
RP=6397; CP=7130
exec > >(tee "$OUT/all.txt") 2>&1
PAYLOAD=$(head -c 150 /dev/zero | tr '\0' x)   # ~200 bytes on the wire with the channel
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; }
trap cleanup EXIT
wait_up() { for _ in $(seq 300); do redis-cli -p "$1" ping >/dev/null 2>&1 && return; sleep 0.1; done; }

# One plain server under callgrind (counters zeroed at the window's start, dumped at its end).
valgrind --tool=callgrind --callgrind-out-file="$OUT/single.%p" \
  redis-server --bind 127.0.0.1 --port $RP --save '' --appendonly no --dir "$OUT" >/dev/null 2>&1 & pids+=($!); SPID=$!
# A cluster of 3: the first master under callgrind.
CPORTS="$CP $((CP+1)) $((CP+2))"
for p in $CPORTS; do
  w=""; [ "$p" = "$CP" ] && w="valgrind --tool=callgrind --callgrind-out-file=$OUT/master.%p"
  $w redis-server --bind 127.0.0.1 --port $p --cluster-enabled yes --cluster-config-file "$OUT/nodes-$p.conf" \
    --cluster-node-timeout 15000 --save '' --appendonly no --dir "$OUT" >/dev/null 2>&1 & pids+=($!)
  [ "$p" = "$CP" ] && MPID=$!
done
for p in $RP $CPORTS; do wait_up $p; done
redis-cli --cluster create $(for p in $CPORTS; do echo 127.0.0.1:$p; done) --cluster-replicas 0 --cluster-yes >/dev/null
for p in $CPORTS; do for _ in $(seq 300); do redis-cli -p $p cluster info | grep -q cluster_state:ok && break; sleep 0.2; done; done
# A channel in a slot of the first master (slots 0-5460).
for i in $(seq 1000); do ch="t:device:d$i"; s=$(redis-cli -p $CP cluster keyslot "$ch"); [ "$s" -le 5460 ] && break; done
echo "redis $(redis-server --version | cut -d' ' -f3); channel $ch (slot $s) on master $CP; $N publications per case, -P 100, payload ${#PAYLOAD} B"
echo "load: $(uptime | sed 's/.*load/load/')"

bus() { redis-cli -p "$1" cluster info | tr -d '\r' | awk -F: '$1 ~ /^cluster_stats_messages_(sent|received|publish_sent|publishshard_sent|ping_sent|pong_sent)$/ {printf "%s=%s ", $1, $2}'; }

case_run() { # name port pid subscribe-command publish-command [protocol flag: -3]
  local name=$1 port=$2 pid=$3 sub=$4 cmd=$5 proto=${6:-}
  redis-cli $proto -p "$port" "$sub" "$ch" >/dev/null & local s=$!
  for _ in $(seq 100); do [ "$(redis-cli -p "$port" pubsub "$( [ "$sub" = ssubscribe ] && echo shardnumsub || echo numsub)" "$ch" | tail -1)" = 1 ] && break; sleep 0.1; done
  redis-cli -p "$port" config resetstat >/dev/null
  local b0; b0=$(bus $port)
  callgrind_control -z $pid >/dev/null 2>&1; local t0; t0=$(date +%s.%N)
  redis-benchmark $proto -p "$port" -c 1 -P 100 -n "$N" -q "$cmd" "$ch" "$PAYLOAD" | tr '\r' '\n' | tail -1
  callgrind_control -d "$name" $pid >/dev/null 2>&1; local t1; t1=$(date +%s.%N)
  echo "  $name: bus before: ${b0:-none}; after: $(bus $port)"
  redis-cli -p "$port" info commandstats | tr -d '\r' | grep -i "cmdstat_$cmd:" | sed "s/^/  $name: /"
  redis-cli -p "$port" info stats | tr -d '\r' | grep -E '^total_(reads|writes)_processed' | tr '\n' ' ' | sed "s/^/  $name: /"; echo
  kill $s 2>/dev/null; wait $s 2>/dev/null
  local f; f=$(ls -t "$OUT"/*."$pid".* | head -1)
  local ir; ir=$(callgrind_annotate "$f" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1}')
  echo "RESULT case=$name instructions=$ir per_publication=$(echo "$ir / $N" | bc) window_s=$(echo "$t1 - $t0" | bc)"
}
# As hubcast talks to each: RESP2 to one Redis, RESP3 to a cluster's masters (shards.rs).
case_run single-publish $RP $SPID subscribe publish
case_run cluster-spublish-resp3 $CP $MPID ssubscribe spublish -3
# What each difference costs: the protocol, the sharded command, the cluster mode, the bus.
case_run cluster-spublish $CP $MPID ssubscribe spublish
case_run single-spublish $RP $SPID ssubscribe spublish
case_run single-publish-resp3 $RP $SPID subscribe publish -3
case_run cluster-publish $CP $MPID subscribe publish
# Each server's own background over 5 s (nothing connected but the counters' reader).
for x in "single $SPID" "master $MPID"; do
  set -- $x
  callgrind_control -z $2 >/dev/null; sleep 5; callgrind_control -d idle $2 >/dev/null
  f=$(ls -t "$OUT"/*."$2".* | head -1)
  echo "RESULT case=idle-$1 (nothing connected) instructions_per_s=$(callgrind_annotate "$f" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1 / 5}')"
done
echo "raw files: $OUT"
# Net of the background: each case's instructions less its server's idle rate over its window.
python3 - "$OUT/all.txt" "$N" <<'PY'
import re, sys
N = int(sys.argv[2])
lines = [l for l in open(sys.argv[1]) if l.startswith("RESULT ")]
idle = {m.group(1): float(m.group(2)) for l in lines if (m := re.search(r"case=idle-(\w+) .*instructions_per_s=([\d.e+]+)", l))}
rows = [(re.search(r"case=(\S+)", l).group(1), dict(re.findall(r"(\w+)=([\d.]+)", l))) for l in lines if "per_publication" in l]
base = None
for case, d in rows:
    server = "single" if case.startswith("single") else "master"
    net = (float(d["instructions"]) - idle.get(server, 0) * float(d["window_s"])) / N
    base = base or net
    print(f"NET case={case} instructions_per_publication={net:.0f} vs_single_publish={net / base:.3f}")
PY
