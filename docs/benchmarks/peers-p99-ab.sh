#!/usr/bin/env bash
# Issue 25 item 2: what adds to hubcast's p99 at 5,000 msgs/s in (50 k deliveries/s), C=1000
# S=10 of D=1000, batches of 64, P=16 and P=4 publishers (PS="16 4"; RATE=5000 msgs/s in).
# Variants alternate within a round.
#
#   docs/benchmarks/peers-p99-ab.sh L ROUNDS 'LABEL|HUBCAST|HARNESS ARGS|HUBCAST ARGS' ...
#   e.g. 'store|/tmp/hubcast||'  'none|/tmp/hubcast||--hubcast-arg=--data-dir=none'
# Prints one line per run: label, P, load average, hubcast CPU, p50, p99, p99.9, max (ms),
# frames per socket write, how long hubcast's threads waited for a CPU (ms per second), and
# the writes the flush policy held back.
set -u
L=${1:?usage: peers-p99-ab.sh HUBCAST_LOAD ROUNDS VARIANT...}
ROUNDS=${2:?rounds}
RATE=${RATE:-5000}
PS=${PS:-16 4}
shift 2
ulimit -n 20000
for round in $(seq 1 "$ROUNDS"); do
  for P in $PS; do
    for v in "$@"; do
      IFS='|' read -r label bin harness extra <<<"$v"
      rm -f /tmp/peers-ab-$$.json
      out=$(${PRIO:-} $L $harness --spawn "$bin" --cores 1 --pin --warmup 1 --duration 4 $extra --json /tmp/peers-ab-$$.json \
        fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --pipeline 16 --fleet-conns "$P" --rate "$RATE" --transport ws 2>&1)
      python3 - "$label" "$P" "$(cut -d' ' -f1 /proc/loadavg)" "$round" /tmp/peers-ab-$$.json <<'EOF' || echo "$out"
import json, sys
label, p, load, rnd, path = sys.argv[1:]
r = json.load(open(path))["results"][0]["rows"][0]
print(f"round {rnd} {label:10s} P={p:>2} load {load:>5}  cpu {r['hubcast_cpu']:.3f}  delivered {r['delivered_msg_s']:8.0f}  "
      f"p50 {r['p50_ms']:6.2f}  p99 {r['p99_ms']:6.2f}  p999 {r['p999_ms']:6.2f}  max {r['max_ms']:6.2f}  frames/write {r.get('frames_per_write', 0):.2f}  waited {r.get('hubcast_runq_ms_s', 0):5.1f} ms/s  held {r.get('writes_held', 0):.0f}")
EOF
    done
  done
done
rm -f /tmp/peers-ab-$$.json
