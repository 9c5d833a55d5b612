#!/bin/bash
# Issue 23's goal, measured as it reads: "the same cross-instance traffic on one Redis and on a
# 3-master cluster: Redis CPU per message on each master <= 0.4x of the single Redis's CPU for
# the same traffic, so capacity grows with masters". Derived from redis-cluster.sh (same
# traffic shape, same hook), with:
#   - rates up to what this machine sustains (RATES, default 5,000 / 20,000 / 50,000 msg/s),
#     so that each node's fixed background weighs less;
#   - each node's background measured apart (BARE seconds with nothing connected, the same
#     config) and the CPU per message reported both raw and net of it;
#   - everything each node received in the window: every INFO commandstats delta (calls, usec),
#     socket reads/writes and bytes, and the cluster bus's messages (CLUSTER INFO
#     cluster_stats_messages_*): what goes to a master per message, and whether the bus does;
#   - the deployment settings: hz 10 and cluster-node-timeout 15000 (Redis's defaults, what
#     docs/OPERATIONS.md deploys; redis-cluster.sh used 1000), NODE_TIMEOUT / HZ to change.
# Traffic: two hubcast instances (--cores 1 each, CPU 0); the fleet posts to A (POST /ingest,
# 1,000 devices, BATCH=500 messages per post); CLIENTS WebSocket clients on B subscribed to
# SUBS devices each (default 100 x 10: every device once, every message crosses Redis once
# and is delivered once, in fewer, larger socket writes than 1,000 x 1 so B and the harness
# keep up at the higher rates; Redis's side is the same: one subscriber connection per node).
# Redis servers private (one on $RP, a cluster on $CP..+2), all on CPU 1 with the harness.
#   bash docs/benchmarks/redis-cluster-capacity.sh [hubcast] [hubcast-load] [rounds]
set -u
if [ "${1:-}" = hook ]; then
  # hubcast-load --step-hook: one line per node at each window edge, and its commandstats.
  now=$(date +%s.%N)
  pub=$(curl -s -H "Shared-Access-Key: $KEY" "$URL_A/metrics" | awk '$1=="hubcast_redis_published_total{instance=\"a\"}" {print $2}')
  rec=$(curl -s -H "Shared-Access-Key: $KEY" "$URL_B/metrics" | awk '$1=="hubcast_redis_received_total{instance=\"b\"}" {print $2}')
  # A's pipelines (messages per pipeline = how much the publisher gathered) and its drops.
  pipes=$(curl -s -H "Shared-Access-Key: $KEY" "$URL_A/metrics" | awk '$1=="hubcast_redis_publish_pipelines_total{instance=\"a\"}" {p=$2} $1=="hubcast_redis_dropped_total{instance=\"a\"}" {d=$2} END {printf "%d %d", p, d}')
  ticks() { awk '{print $14+$15}' /proc/$1/stat; }   # utime+stime, clock ticks
  ta=$(ticks $A_PID); tb=$(ticks $B_PID)
  for p in $NODES; do
    info=$(redis-cli -p "$p" info all | tr -d '\r')
    bus=$(redis-cli -p "$p" cluster info 2>/dev/null | tr -d '\r' | awk -F: '$1=="cluster_stats_messages_sent"{s=$2} $1=="cluster_stats_messages_received"{r=$2} END{printf "%d %d", s, r}')
    echo "$info" | awk -v e="$HUBCAST_LOAD_STEP" -v r="$HUBCAST_LOAD_RATE" -v p="$p" -v pub="$pub" -v rec="$rec" -v ta="$ta" -v tb="$tb" -v now="$now" -v bus="$bus" -v pipes="$pipes" -F'[:,=]' '
      $1=="used_cpu_sys" {s=$2} $1=="used_cpu_user" {u=$2} $1=="total_reads_processed" {rd=$2}
      $1=="cmdstat_spublish" {sp=$3; us+=$5} $1=="cmdstat_publish" {pp=$3; us+=$5}
      $1=="total_net_input_bytes" {ib=$2} $1=="total_net_output_bytes" {ob=$2} $1=="total_writes_processed" {wr=$2}
      END {split(bus, b, " "); split(pipes, pd, " "); printf "%s %s %s pipes=%d dropped=%d cpu=%.6f spublish=%d publish=%d published=%d received=%d reads=%d a_ticks=%d b_ticks=%d usec=%d in=%d out=%d writes=%d t=%s bus_sent=%d bus_recv=%d\n", e, r, p, pd[1], pd[2], s+u, sp, pp, pub, rec, rd, ta, tb, us, ib, ob, wr, now, b[1], b[2]}'
    echo "$info" | awk -v e="$HUBCAST_LOAD_STEP" -v r="$HUBCAST_LOAD_RATE" -v p="$p" -F'[:,=]' '/^cmdstat_/ {print "CMD", e, r, p, substr($1, 9), $3, $5}' >> "$CMD_LOG"
  done >> "$HOOK_LOG"
  exit 0
fi
H=${1:-target/release/hubcast}; L=${2:-target/release/hubcast-load}; ROUNDS=${3:-3}
export KEY=hubcast-load-key
RP=${RP:-6394}; CP=${CP:-7120}; PA=18191; PB=18192
export URL_A=http://127.0.0.1:$PA URL_B=http://127.0.0.1:$PB
RATES=${RATES:-5000,20000,50000}; BATCH=${BATCH:-500}; CLIENTS=${CLIENTS:-100}; SUBS_EACH=${SUBS:-10}
HZ=${HZ:-10}; NODE_TIMEOUT=${NODE_TIMEOUT:-15000}; BARE=${BARE:-10}
OUT=$(mktemp -d /tmp/redis-cluster-capacity.XXXX)
SELF=$(realpath "$0")
N="nice -n 5"
exec > >(tee "$OUT/all.txt") 2>&1
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; }   # no `wait`: the tee of the output would never end
trap cleanup EXIT

. "$(dirname "$0")/redis-cluster-common.sh"
redis_up
# CAP=P: each Redis server (the single one and each master) in a cgroup of its own limited to P %
# of one CPU (cgroup v1 `cpu` controller, 20 ms periods; the kernel's smallest quota is 1 ms, so
# below 5 % the period grows to 100/P ms), so that Redis, not this 2-core
# machine's hubcast instances and harness, is the limit: the highest rate each engine carries
# through hubcast is its capacity at that CPU, and capacity per master is what the goal means.
if [ -n "${CAP:-}" ]; then
  CG=/sys/fs/cgroup/cpu/hubcast-bench-$$
  period=$(( CAP >= 5 ? 20000 : 100000 / CAP )); quota=$(( CAP * period / 100 )); i=0
  for p in $RP $CPORTS; do
    mkdir -p "$CG-$p"; echo $period > "$CG-$p/cpu.cfs_period_us"; echo $quota > "$CG-$p/cpu.cfs_quota_us"
    echo "${pids[$i]}" > "$CG-$p/cgroup.procs"; i=$((i + 1))
  done
  trap 'cleanup; sleep 0.5; for p in $RP $CPORTS; do rmdir "$CG-$p" 2>/dev/null; done' EXIT
  echo "each Redis server limited to $CAP % of one CPU (cgroup $CG-<port>, quota $quota us per $period us)"
fi
echo "redis: $(redis-server --version | cut -d' ' -f3); single on $RP; cluster masters on $CPORTS; hz $HZ, cluster-node-timeout $NODE_TIMEOUT"
echo "hubcast: $H ($($H --version 2>/dev/null | head -1)); traffic: rates $RATES msg/s, $BATCH per post, $CLIENTS clients x $SUBS_EACH devices on B"
nodes_report
BIN=$H

traffic() { # engine round
  PHASE=traffic-$1-$2; export NODES; NODES=$(nodes_of "$1"); flush
  # Redis's own background (nothing connected), BARE s, per node.
  local bare=""; declare -A c0
  for p in $NODES; do c0[$p]=$(cpu_of $p); done; sleep "$BARE"
  for p in $NODES; do bare+=" $p=$(echo "($(cpu_of $p)-${c0[$p]})*1000/$BARE" | bc -l | xargs printf '%.3f')"; done
  local A B; A=$(start_hubcast $PA a $(engine_flags "$1")); B=$(start_hubcast $PB b $(engine_flags "$1")); pids+=($A $B)
  wait_connected $URL_A a && wait_connected $URL_B b || { stop $A $B; return 1; }
  echo "=== round $2 traffic $1 ($(uptime | sed 's/.*load/load/'))"
  echo "BARE $1 round=$2 ms_per_s:$bare"
  local idle=""
  for p in $NODES; do c0[$p]=$(cpu_of $p); done; sleep 5
  for p in $NODES; do idle+=" $p=$(echo "($(cpu_of $p)-${c0[$p]})*1000/5" | bc -l | xargs printf '%.3f')"; done
  echo "IDLE $1 round=$2 ms_per_s:$idle"
  export HOOK_LOG="$OUT/hook-$1-$2.log" CMD_LOG="$OUT/cmd-$1-$2.log"; : > "$HOOK_LOG"; : > "$CMD_LOG"
  export A_PID=$A B_PID=$B
  taskset -c 1 $N "$L" --url $URL_B --pid $B --warmup 1 --duration 5 --step-hook "bash $SELF hook" --json "$OUT/fanout-$1-$2.json" \
    fanout --clients "$CLIENTS" --subs "$SUBS_EACH" --devices 1000 --rate "$RATES" --batch "$BATCH" --fleet-target $URL_A 2>&1 | grep -v '^machine\|^pinning' | tail -6
  cat "$HOOK_LOG"
  # Per rate and node: CPU per 1,000 messages A published, raw and net of the node's bare
  # background over the window's length; commands, bus, reads/writes, bytes per message.
  awk -v eng="$1" -v round="$2" -v tick="$(getconf CLK_TCK)" -v bare="$bare" '
    BEGIN { n = split(bare, bs, " "); for (i = 1; i <= n; i++) { split(bs[i], kv, "="); bg[kv[1]] = kv[2] } }
    { delete f; for (i = 4; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      k = $2" "$3; split(k, a, " ")
      if ($1 == "begin") { for (x in f) b0[k, x] = f[x]; next }
      for (x in f) d[k, x] = f[x] - b0[k, x]; keys[k] = 1 }
    END { for (k in keys) { split(k, a, " "); n = d[k, "published"] ? d[k, "published"] : 1; secs = d[k, "t"]
            net = d[k, "cpu"] * 1000 - bg[a[2]] * secs
            printf "RESULT %s round=%s rate=%s node=%s secs=%.2f published=%d received=%d dropped=%d msgs_per_pipeline=%.1f cpu_ms=%.2f cpu_ms_per_1000=%.4f bg_ms_per_s=%.3f net_ms_per_1000=%.4f spublish=%d publish=%d reads_per_1000=%.2f writes_per_1000=%.2f cmd_ms_per_1000=%.4f in_bytes_per_msg=%.1f out_bytes_per_msg=%.1f bus_sent_per_1000=%.2f bus_recv_per_1000=%.2f a_cpu_ms_per_1000=%.3f b_cpu_ms_per_1000=%.3f\n",
              eng, round, a[1], a[2], secs, n, d[k, "received"], d[k, "dropped"], n / (d[k, "pipes"] ? d[k, "pipes"] : 1), d[k, "cpu"] * 1000, d[k, "cpu"] * 1e6 / n, bg[a[2]], net * 1000 / n,
              d[k, "spublish"], d[k, "publish"], d[k, "reads"] * 1000 / n, d[k, "writes"] * 1000 / n, d[k, "usec"] / n, d[k, "in"] / n, d[k, "out"] / n,
              d[k, "bus_sent"] * 1000 / n, d[k, "bus_recv"] * 1000 / n, d[k, "a_ticks"] * 1e6 / tick / n, d[k, "b_ticks"] * 1e6 / tick / n } }' "$HOOK_LOG" | sort
  # Every command each node ran in the window: calls per 1,000 messages, usec per call.
  awk -v eng="$1" -v round="$2" -v hook="$HOOK_LOG" '
    BEGIN { while ((getline l < hook) > 0) { split(l, w, " "); if (w[1] == "end") { split(w[7], p, "="); pub[w[2]] = p[2] } else { split(w[7], p, "="); pub0[w[2]] = p[2] } } }
    $2 == "begin" { c0[$3" "$4" "$5] = $6; u0[$3" "$4" "$5] = $7; next }
    { k = $3" "$4" "$5; n = pub[$3] - pub0[$3]; if (n <= 0) n = 1; dc = $6 - c0[k]; du = $7 - u0[k]
      if (dc > 0) printf "CMDS %s round=%s rate=%s node=%s cmd=%s calls=%d per_1000_msgs=%.3f usec_per_call=%.3f\n", eng, round, $3, $4, $5, dc, dc * 1000 / n, du / dc }' "$CMD_LOG" | sort
  jq -r --arg e "$1" --arg r "$2" '.results[0].rows[] | "LATENCY \($e) round=\($r) rate=\(.rate) delivered_msg_s=\(.delivered_msg_s|floor) p50_ms=\(.p50_ms) p99_ms=\(.p99_ms) hubcast_b_cpu=\(.hubcast_cpu)"' "$OUT/fanout-$1-$2.json"
  stop $A $B
  warns "$PHASE"
}

for round in $(seq "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order="single cluster"; else order="cluster single"; fi
  for e in $order; do traffic $e $round; done
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
    print(f"rate {float(rate):.0f} msg/s asked:")
    for field, what in (("cpu_ms_per_1000", "raw"), ("net_ms_per_1000", "net of each node's bare background")):
        per = lambda e, node: {d["round"]: float(d[field]) for x, d in rows if x == e and d["node"] == node}
        s = per("single", single)
        print(f"  Redis CPU ms per 1,000 messages, {what}: single {med(list(s.values()))}")
        total = {}
        for m in masters:
            c = per("cluster", m)
            for r, v in c.items(): total[r] = total.get(r, 0) + v
            print(f"    master {m}: {med(list(c.values()))}, ratio to single {med([c[r] / s[r] for r in c if r in s and s[r] > 0])}")
        print(f"    all masters: {med(list(total.values()))}, ratio to single {med([total[r] / s[r] for r in total if r in s and s[r] > 0])}")
    for e in ("single", "cluster"):
        ds = [d for x, d in rows if x == e]
        if not ds: continue
        f = lambda k: med([float(d[k]) for d in ds])
        print(f"  {e} per node: share of SPUBLISH/PUBLISH per message {med([(int(d['spublish']) + int(d['publish'])) / max(1, int(d['published'])) for d in ds])}; "
              f"bg ms/s {f('bg_ms_per_s')}; in the command (usec) ms per 1,000 {f('cmd_ms_per_1000')}; reads / writes per 1,000 {f('reads_per_1000')} / {f('writes_per_1000')}; "
              f"bytes in / out per message {f('in_bytes_per_msg')} / {f('out_bytes_per_msg')}; bus messages sent / received per 1,000 {f('bus_sent_per_1000')} / {f('bus_recv_per_1000')}")
        first = [d for d in ds if d["node"] == (single if e == "single" else masters[0])]
        print(f"  {e}: published/s {med([int(d['published']) / float(d['secs']) for d in first])}, received on B / published {med([int(d['received']) / max(1, int(d['published'])) for d in first])}; "
              f"hubcast A CPU ms per 1,000 {med([float(d['a_cpu_ms_per_1000']) for d in first])}, B {med([float(d['b_cpu_ms_per_1000']) for d in first])}")
        print(f"  {e}: messages per pipeline (A to one server) {med([float(d['msgs_per_pipeline']) for d in first])}, dropped by A {med([int(d['dropped']) for d in first])}")
        ls = [d for x, d in lat if x == e and d["rate"] == rate]
        if ls:
            print(f"  {e}: delivered/s {med([float(d['delivered_msg_s']) for d in ls])}, p50 ms {med([float(d['p50_ms']) for d in ls])}, p99 ms {med([float(d['p99_ms']) for d in ls])}")
cmds = {}
for l in text:
    if l.startswith("CMDS "):
        d = kv(l); e = l.split()[1]
        cmds.setdefault((e, d["rate"], d["cmd"]), []).append((float(d["per_1000_msgs"]), float(d["usec_per_call"])))
print("Commands per node in the window (median over rounds and nodes): calls per 1,000 messages published, usec per call")
for (e, r, c), xs in sorted(cmds.items(), key=lambda x: (x[0][0], float(x[0][1]), x[0][2])):
    print(f"  {e} rate {float(r):.0f} {c}: {med([x[0] for x in xs])} per 1,000; {med([x[1] for x in xs])} usec")
for kind in ("BARE", "IDLE"):
    vals = {}
    for l in text:
        if l.startswith(kind + " "):
            e = l.split()[1]
            for node, ms in re.findall(r"(\d+)=([\d.]+)", l.split("ms_per_s:")[1]):
                vals.setdefault(e, []).append(float(ms))
    for e, xs in sorted(vals.items()):
        print(f"  {kind.lower()} ({'nothing connected' if kind == 'BARE' else 'both instances up, no traffic'}) {e}: {med(xs)} ms/s per node")
PY
