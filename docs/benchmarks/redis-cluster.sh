#!/bin/bash
# Issue 23's measurement (docs/design/redis-cluster.md §4 step 8): the same cross-instance
# traffic on one redis-server and on a 3-master Redis Cluster, side by side, the engine order
# alternating from round to round.
#
# Traffic: two hubcast instances (--cores 1 each); the fleet posts to A (POST /ingest, D=1000
# devices, fixed rates), C=1000 plain WebSocket clients on B, one device each, so every
# message crosses Redis once (A publishes it, B receives it and delivers it once).
# Measured in each fan-out window (hubcast-load --step-hook reads Redis at both edges):
#   - Redis CPU (INFO CPU used_cpu_sys+used_cpu_user: CPU time, so robust to a busy machine)
#     per 1,000 messages A published, on the single Redis and on EACH master, and the ratio
#     per master vs single (issue 23's goal: <= 0.4);
#   - where the messages went (cmdstat_spublish / cmdstat_publish calls per node);
#   - end-to-end p50/p99 through one hop (the harness's sentAt latency) and delivered/s;
#   - an idle baseline: each node's CPU over 5 s with both instances up, no traffic.
# Then PUT /subscriptions of 1,000 devices on A (redis-cluster-subs.py): one instance; two
# (B holds a copy of the session); two with a socket on B (B starts watching all 1,000: time
# until A knows it). Redis commands from INFO commandstats on every node.
#
# Private Redis servers (not the shared 6379 / 7000-7002): one on $RP, a cluster on $CP..+2,
# all on CPU 1 with the harness; both hubcast instances on CPU 0. Everything under nice.
#   bash docs/benchmarks/redis-cluster.sh [hubcast] [hubcast-load] [rounds]
# Two hubcast builds side by side: NEW=path/to/other/hubcast adds an engine `cluster-new`
# (the cluster run with that binary) to every round, in alternating order; SUBS=0 skips the
# PUT /subscriptions phases; BATCH=n posts n messages per POST /ingest (500; small batches are
# many small publications, what coalescing them acts on).
set -u
if [ "${1:-}" = hook ]; then
  # hubcast-load --step-hook: one line per node at each window edge.
  pub=$(curl -s -H "Shared-Access-Key: $KEY" "$URL_A/metrics" | awk '$1=="hubcast_redis_published_total{instance=\"a\"}" {print $2}')
  rec=$(curl -s -H "Shared-Access-Key: $KEY" "$URL_B/metrics" | awk '$1=="hubcast_redis_received_total{instance=\"b\"}" {print $2}')
  ticks() { awk '{print $14+$15}' /proc/$1/stat; }   # utime+stime, clock ticks
  ta=$(ticks $A_PID); tb=$(ticks $B_PID)
  for p in $NODES; do
    redis-cli -p "$p" info all | tr -d '\r' | awk -v e="$HUBCAST_LOAD_STEP" -v r="$HUBCAST_LOAD_RATE" -v p="$p" -v pub="$pub" -v rec="$rec" -v ta="$ta" -v tb="$tb" -F'[:,=]' '
      $1=="used_cpu_sys" {s=$2} $1=="used_cpu_user" {u=$2} $1=="total_reads_processed" {rd=$2}
      $1=="cmdstat_spublish" {sp=$3; us+=$5} $1=="cmdstat_publish" {pp=$3; us+=$5}
      $1=="total_net_input_bytes" {ib=$2} $1=="total_net_output_bytes" {ob=$2} $1=="total_writes_processed" {wr=$2}
      END {printf "%s %s %s cpu=%.6f spublish=%d publish=%d published=%d received=%d reads=%d a_ticks=%d b_ticks=%d usec=%d in=%d out=%d writes=%d\n", e, r, p, s+u, sp, pp, pub, rec, rd, ta, tb, us, ib, ob, wr}'
  done >> "$HOOK_LOG"
  exit 0
fi
H=${1:-target/release/hubcast}; L=${2:-target/release/hubcast-load}; ROUNDS=${3:-3}
export KEY=hubcast-load-key
RP=${RP:-6393}; CP=${CP:-7110}; PA=18181; PB=18182
export URL_A=http://127.0.0.1:$PA URL_B=http://127.0.0.1:$PB
RATES=${RATES:-5000,20000}; BATCH=${BATCH:-500}   # messages per POST /ingest
NEW=${NEW:-}; SUBS_PHASE=${SUBS:-1}
OUT=$(mktemp -d /tmp/redis-cluster-bench.XXXX)
SELF=$(realpath "$0"); SUBS=$(dirname "$SELF")/redis-cluster-subs.py
N="nice -n 5"
exec > >(tee "$OUT/all.txt") 2>&1
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; }   # no `wait`: the tee of the output would never end
trap cleanup EXIT

# Redis: one server, one cluster of 3 masters (no replicas), private ports.
. "$(dirname "$0")/redis-cluster-common.sh"
redis_up
echo "redis: $(redis-server --version | cut -d' ' -f3); single on $RP; cluster masters on $CPORTS"
nodes_report

binary_of() { if [ "$1" = cluster-new ]; then echo "$NEW"; else echo "$H"; fi; }

traffic() { # engine round
  PHASE=traffic-$1-$2; BIN=$(binary_of "$1"); export NODES; NODES=$(nodes_of "$1"); flush
  # Redis's own idle (no instance connected), 5 s.
  local bare=""; declare -A c0
  for p in $NODES; do c0[$p]=$(cpu_of $p); done; sleep 5
  for p in $NODES; do bare+=" $p=$(echo "($(cpu_of $p)-${c0[$p]})*1000" | bc -l | xargs printf '%.1f')ms"; done
  local A B; A=$(start_hubcast $PA a $(engine_flags "$1")); B=$(start_hubcast $PB b $(engine_flags "$1")); pids+=($A $B)
  wait_connected $URL_A a && wait_connected $URL_B b || { stop $A $B; return 1; }
  echo "=== round $2 traffic $1 ($(uptime | sed 's/.*load/load/'))"
  echo "bare 5 s (no instance), Redis CPU:$bare"
  # Idle baseline: both instances up, no traffic, 5 s.
  local idle=""
  for p in $NODES; do c0[$p]=$(cpu_of $p); done; sleep 5
  for p in $NODES; do idle+=" $p=$(echo "($(cpu_of $p)-${c0[$p]})*1000" | bc -l | xargs printf '%.1f')ms"; done
  echo "idle 5 s, Redis CPU:$idle"
  export HOOK_LOG="$OUT/hook-$1-$2.log"; : > "$HOOK_LOG"
  export A_PID=$A B_PID=$B
  taskset -c 1 $N "$L" --url $URL_B --pid $B --warmup 1 --duration 5 --step-hook "bash $SELF hook" --json "$OUT/fanout-$1-$2.json" \
    fanout --clients 1000 --subs 1 --devices 1000 --rate "$RATES" --batch "$BATCH" --fleet-target $URL_A 2>&1 | grep -v '^machine\|^pinning' | tail -4
  cat "$HOOK_LOG"
  # Per rate: per node CPU ms per 1,000 messages published by A, and the share of them.
  awk -v eng="$1" -v round="$2" -v tick="$(getconf CLK_TCK)" '
    { split($4,c,"="); split($5,s,"="); split($6,q,"="); split($7,pb,"="); split($8,rc,"="); split($9,rd,"="); split($10,ta,"="); split($11,tb,"=")
      split($12,us,"="); split($13,ib,"="); split($14,ob,"="); split($15,wr,"=")
      k=$2" "$3; if ($1=="begin") {c0[k]=c[2]; s0[k]=s[2]; q0[k]=q[2]; d0[k]=rd[2]; p0[$2]=pb[2]; r0[$2]=rc[2]; a0[$2]=ta[2]; b0[$2]=tb[2]; u0[k]=us[2]; i0[k]=ib[2]; o0[k]=ob[2]; w0[k]=wr[2]}
      else {dc[k]=c[2]-c0[k]; ds[k]=s[2]-s0[k]; dq[k]=q[2]-q0[k]; dd[k]=rd[2]-d0[k]; dp[$2]=pb[2]-p0[$2]; dr[$2]=rc[2]-r0[$2]; da[$2]=ta[2]-a0[$2]; db[$2]=tb[2]-b0[$2]; du[k]=us[2]-u0[k]; di[k]=ib[2]-i0[k]; do_[k]=ob[2]-o0[k]; dw[k]=wr[2]-w0[k]; keys[k]=1} }
    END { for (k in keys) { split(k,a," "); r=a[1]; n=dp[r] ? dp[r] : 1;
            printf "RESULT %s round=%s rate=%s node=%s published=%d received=%d cpu_ms=%.1f cpu_ms_per_1000=%.3f spublish=%d publish=%d reads_per_1000=%.1f a_cpu_ms_per_1000=%.2f b_cpu_ms_per_1000=%.2f cmd_ms_per_1000=%.3f writes_per_1000=%.1f in_bytes_per_msg=%.0f out_bytes_per_msg=%.0f\n",
              eng, round, r, a[2], dp[r], dr[r], dc[k]*1000, dc[k]*1e6/n, ds[k], dq[k], dd[k]*1000/n, da[r]*1e6/tick/n, db[r]*1e6/tick/n, du[k]/n, dw[k]*1000/n, di[k]/n, do_[k]/n } }' "$HOOK_LOG" | sort
  jq -r --arg e "$1" --arg r "$2" '.results[0].rows[] | "LATENCY \($e) round=\($r) rate=\(.rate) delivered_msg_s=\(.delivered_msg_s|floor) p50_ms=\(.p50_ms) p99_ms=\(.p99_ms) hubcast_b_cpu=\(.hubcast_cpu)"' "$OUT/fanout-$1-$2.json"
  stop $A $B
  warns "$PHASE"
}

subscriptions() { # engine round
  PHASE=subs-$1-$2; BIN=$(binary_of "$1"); export NODES; NODES=$(nodes_of "$1"); flush
  local ports; ports=$(echo $NODES | tr ' ' ,)
  local A B; A=$(start_hubcast $PA a $(engine_flags "$1") --lease-ttl 60); pids+=($A)
  wait_connected $URL_A a || { stop $A; return 1; }
  echo "SUBS $1 round=$2 instances=1 $($N python3 "$SUBS" one $URL_A $URL_B $KEY "$ports" 1000)"
  B=$(start_hubcast $PB b $(engine_flags "$1") --lease-ttl 60); pids+=($B)
  wait_connected $URL_B b || { stop $A $B; return 1; }
  echo "SUBS $1 round=$2 instances=2-copy $($N python3 "$SUBS" copy $URL_A $URL_B $KEY "$ports" 1000)"
  echo "SUBS $1 round=$2 instances=2-socket $($N python3 "$SUBS" socket $URL_A $URL_B $KEY "$ports" 1000)"
  stop $A $B
  warns "$PHASE"
}

for round in $(seq "$ROUNDS"); do
  if [ -n "$NEW" ]; then
    if [ $((round % 2)) = 1 ]; then order="single cluster cluster-new"; else order="cluster-new cluster single"; fi
  elif [ $((round % 2)) = 1 ]; then order="single cluster"; else order="cluster single"; fi
  for e in $order; do traffic $e $round; done
  if [ "$SUBS_PHASE" = 1 ]; then for e in $order; do subscriptions $e $round; done; fi
done
echo "raw files: $OUT"
echo "=== summary (medians over rounds, [min-max])"
python3 - "$OUT/all.txt" $RP $CPORTS <<'PY'
import re, statistics, sys
text = open(sys.argv[1]).read().splitlines()
single, masters = sys.argv[2], sys.argv[3:]
kv = lambda line: dict(re.findall(r"(\S+)=(\S+)", line))
def med(xs):
    xs = sorted(xs)
    return f"{statistics.median(xs):.3g} [{xs[0]:.3g}-{xs[-1]:.3g}]" if xs else "-"
res = [(l.split()[1], kv(l)) for l in text if l.startswith("RESULT ")]
lat = [(l.split()[1], kv(l)) for l in text if l.startswith("LATENCY ")]
for rate in sorted({d["rate"] for _, d in res}, key=float):
    rows = [(e, d) for e, d in res if d["rate"] == rate]
    per = lambda e, node: {d["round"]: float(d["cpu_ms_per_1000"]) for x, d in rows if x == e and d["node"] == node}
    s = per("single", single)
    print(f"rate {float(rate):.0f} msg/s: Redis CPU ms per 1,000 messages crossing")
    print(f"  single {single}: {med(list(s.values()))}")
    clusters = [e for e in ("cluster", "cluster-new") if any(x == e for x, _ in rows)]
    for ce in clusters:
        total = {}
        for m in masters:
            c = per(ce, m)
            sp = [int(d["spublish"]) / max(1, int(d["published"])) for x, d in rows if x == ce and d["node"] == m]
            ratios = [c[r] / s[r] for r in c if r in s and s[r] > 0]
            for r, v in c.items(): total[r] = total.get(r, 0) + v
            print(f"  {ce} master {m}: {med(list(c.values()))}, ratio to single {med(ratios)}, share of SPUBLISH {med(sp)}")
        print(f"  {ce}, all masters: {med(list(total.values()))}, ratio to single {med([total[r] / s[r] for r in total if r in s and s[r] > 0])}")
    for e, nodes in [("single", [single])] + [(ce, masters) for ce in clusters]:
        ds = [d for x, d in rows if x == e and d["node"] == nodes[0]]
        reads = [float(d["reads_per_1000"]) for x, d in rows if x == e]
        print(f"  {e}: hubcast A (ingest, publish) CPU ms per 1,000 {med([float(d['a_cpu_ms_per_1000']) for d in ds])}, B (receive, deliver) {med([float(d['b_cpu_ms_per_1000']) for d in ds])}; Redis reads per 1,000 messages per node {med(reads)}")
        alln = [d for x, d in rows if x == e and "cmd_ms_per_1000" in d]
        if alln:
            print(f"  {e}: per node, of the CPU per 1,000 messages, in the command itself (commandstats usec) {med([float(d['cmd_ms_per_1000']) for d in alln])} ms; writes per 1,000 {med([float(d['writes_per_1000']) for d in alln])}; bytes in / out per message {med([float(d['in_bytes_per_msg']) for d in alln])} / {med([float(d['out_bytes_per_msg']) for d in alln])}")
    for e in ["single"] + clusters:
        ls = [d for x, d in lat if x == e and d["rate"] == rate]
        if ls:
            print(f"  {e}: delivered/s {med([float(d['delivered_msg_s']) for d in ls])}, p50 ms {med([float(d['p50_ms']) for d in ls])}, p99 ms {med([float(d['p99_ms']) for d in ls])}")
print("Idle Redis CPU, ms per s per node (bare: no instance connected; idle: both instances up, no traffic)")
eng = None
idle = {}
for l in text:
    m = re.match(r"=== round \d+ traffic (\S+)", l)
    if m: eng = m.group(1)
    for kind in ("bare", "idle"):
        if l.startswith(kind + " 5 s") and eng:
            for node, ms in re.findall(r"(\d+)=([\d.]+)ms", l):
                idle.setdefault((eng, kind), []).append(float(ms) / 5)
for (e, kind), xs in sorted(idle.items()):
    print(f"  {e} {kind}: {med(xs)}")
subs = [(l.split()[1], kv(l)) for l in text if l.startswith("SUBS ")]
print("PUT /subscriptions of 1,000 devices")
for e in ("single", "cluster", "cluster-new"):
    for mode in ("1", "2-copy", "2-socket"):
        ds = [d for x, d in subs if x == e and d["instances"] == mode and "put_ms" in d]
        if ds:
            ready = [float(d["ready_ms"]) for d in ds if not d["ready_ms"].startswith("never")]
            never = [d["ready_ms"] for d in ds if d["ready_ms"].startswith("never")]
            print(f"  {e} instances={mode}: answered in ms {med([float(d['put_ms']) for d in ds])}, all watched (A knows) in ms {med(ready)}" + (f", never in {len(never)} of {len(ds)} rounds: {never}" if never else ""))
PY
