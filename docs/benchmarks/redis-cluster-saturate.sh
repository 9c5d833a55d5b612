#!/bin/bash
# Issue 23, "so capacity grows with masters": Redis CPU per publication when Redis, not the
# publisher, is the limit, one plain redis-server against one master of a 3-master cluster,
# without hubcast (this machine cannot drive hubcast past ~50,000 msg/s). redis-benchmark
# publishes as fast as the server takes them (-c 2 connections, -P 100 in flight each), on
# 1,000 channels (-r 1000), 200 bytes on the wire each, as hubcast's device channels and wire
# payloads; one subscriber connection subscribed to all 1,000 (as an instance watching them:
# SUBSCRIBE over RESP2 on one Redis, SSUBSCRIBE over RESP3 on a master, as hubcast speaks).
# A master's channels are hash-tagged into its own slots (`{tag}:device:<n>`), and the single's
# carry the same names: a few bytes more per command can take a pipeline of 100 past what
# Redis reads at once (2 reads instead of 1: measured by hand, `t:` against `{t2}:` names on
# one plain server, 10 against 20 reads per 1,000), so names of another length would not
# compare. Measured:
# used_cpu_sys + used_cpu_user per publication (INFO cpu deltas: the server's own CPU time),
# socket reads per publication, the bus messages, each round alternating the order.
#   bash docs/benchmarks/redis-cluster-saturate.sh [rounds] [publications]
set -u
ROUNDS=${1:-5}; N=${2:-1000000}
RP=6398; CP=7140
HZ=${HZ:-10}; NODE_TIMEOUT=${NODE_TIMEOUT:-15000}
OUT=$(mktemp -d /tmp/redis-saturate.XXXX)
exec > >(tee "$OUT/all.txt") 2>&1
PAYLOAD=$(head -c 150 /dev/zero | tr '\0' x)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; }
trap cleanup EXIT
wait_up() { for _ in $(seq 300); do redis-cli -p "$1" ping >/dev/null 2>&1 && return; sleep 0.1; done; }
taskset -c 1 redis-server --bind 127.0.0.1 --port $RP --hz $HZ --save '' --appendonly no --dir "$OUT" >/dev/null 2>&1 & pids+=($!)
CPORTS="$CP $((CP+1)) $((CP+2))"
for p in $CPORTS; do
  taskset -c 1 redis-server --bind 127.0.0.1 --port $p --hz $HZ --cluster-enabled yes --cluster-config-file "$OUT/nodes-$p.conf" \
    --cluster-node-timeout $NODE_TIMEOUT --save '' --appendonly no --dir "$OUT" >/dev/null 2>&1 & pids+=($!)
done
for p in $RP $CPORTS; do wait_up $p; done
redis-cli --cluster create $(for p in $CPORTS; do echo 127.0.0.1:$p; done) --cluster-replicas 0 --cluster-yes >/dev/null
for p in $CPORTS; do for _ in $(seq 300); do redis-cli -p $p cluster info | grep -q cluster_state:ok && break; sleep 0.2; done; done
# A hash tag in the first master's slots (0-5460).
for i in $(seq 1000); do tag="t$i"; [ "$(redis-cli -p $CP cluster keyslot "$tag")" -le 5460 ] && break; done
echo "redis $(redis-server --version | cut -d' ' -f3); hz $HZ; cluster-node-timeout $NODE_TIMEOUT; master $CP serves {$tag}; $N publications per case; servers on CPU 1, redis-benchmark and subscriber on CPU 0"

channels() { for i in $(seq 0 999); do printf '%s:device:%012d ' "$1" "$i"; done; }
cpu() { redis-cli -p "$1" info cpu | tr -d '\r' | awk -F: '$1=="used_cpu_sys"{s=$2} $1=="used_cpu_user"{u=$2} END{printf "%.6f", s+u}'; }
stat() { redis-cli -p "$1" info stats | tr -d '\r' | awk -F: -v k="$2" '$1==k{print $2}'; }
bus() { redis-cli -p "$1" cluster info 2>/dev/null | tr -d '\r' | awk -F: '$1=="cluster_stats_messages_sent"{print $2}'; }
case_run() { # name port subscribe publish channel-prefix [-3]
  local name=$1 port=$2 sub=$3 cmd=$4 prefix=$5 proto=${6:-}
  taskset -c 0 redis-cli $proto -p "$port" "$sub" $(channels "$prefix") >/dev/null & local s=$!
  local kind=numsub; [ "$sub" = ssubscribe ] && kind=shardnumsub
  for _ in $(seq 200); do [ "$(redis-cli -p "$port" pubsub $kind "$prefix:device:000000000999" | tail -1)" = 1 ] && break; sleep 0.1; done
  local c0 r0 b0 t0; c0=$(cpu $port); r0=$(stat $port total_reads_processed); b0=$(bus $port); t0=$(date +%s.%N)
  local rps; rps=$(taskset -c 0 redis-benchmark $proto -p "$port" -c 2 -P 100 -n "$N" -r 1000 -q "$cmd" "$prefix:device:__rand_int__" "$PAYLOAD" | tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -1)
  local c1 r1 b1 t1; c1=$(cpu $port); r1=$(stat $port total_reads_processed); b1=$(bus $port); t1=$(date +%s.%N)
  kill $s 2>/dev/null; wait $s 2>/dev/null
  echo "RESULT case=$name round=$round cpu_us_per_publication=$(echo "($c1 - $c0) * 1000000 / $N" | bc -l | xargs printf '%.4f') reads_per_1000=$(echo "($r1 - $r0) * 1000 / $N" | bc -l | xargs printf '%.2f') bus_sent=$(( ${b1:-0} - ${b0:-0} )) secs=$(echo "$t1 - $t0" | bc | xargs printf '%.2f') rate=\"$rps\" load=\"$(cut -d' ' -f1 /proc/loadavg)\""
}
for round in $(seq "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then
    case_run single-publish $RP subscribe publish "{$tag}"; case_run master-spublish $CP ssubscribe spublish "{$tag}" -3
  else
    case_run master-spublish $CP ssubscribe spublish "{$tag}" -3; case_run single-publish $RP subscribe publish "{$tag}"
  fi
done
echo "raw files: $OUT"
python3 - "$OUT/all.txt" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r'(\w+)="?([^" ]+)', l)) for l in open(sys.argv[1]) if l.startswith("RESULT ")]
by = lambda c: {r["round"]: float(r["cpu_us_per_publication"]) for r in rows if r["case"] == c}
s, m = by("single-publish"), by("master-spublish")
med = lambda xs: f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"
print(f"CPU us per publication: single {med(list(s.values()))}, master {med(list(m.values()))}")
ratios = [m[r] / s[r] for r in m if r in s]
print(f"master / single per publication {med(ratios)}; a master carrying a third of the messages: {med([x / 3 for x in ratios])} of the single's CPU")
PY
