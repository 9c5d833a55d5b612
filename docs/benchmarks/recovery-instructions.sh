#!/bin/bash
# Instructions per delivery of a whole hubcast process on issue 13's fan-out shape (C = 1,000
# Socket.IO clients x S = 10 of D = 1,000 devices), counted by callgrind (deterministic, unlike
# CPU time on a shared machine), with connection state recovery on or off (issue 24's cost,
# docs/benchmarks/2026-11-27-recovery-hot-path.md). Same method as
# loadtest/scripts/ingest-instructions.sh: hubcast under callgrind with --cores 1, the epoll
# driver and --data-dir none; the harness asks RATE msgs/s in (RATE x 10 deliveries/s);
# counters are zeroed once OUT_BEFORE deliveries are out, then dumped WINDOW seconds later, and
# the instruction total of that window is divided by the hubcast_messages_out_total delta.
#
#   docs/benchmarks/recovery-instructions.sh HUBCAST_BINARY WINDOW_S [HUBCAST_LOAD_BINARY] [more hubcast args]
#
# WINDOW_S is --recovery-window (120: on, the default; 0: off). Under callgrind hubcast serves
# ~10,000 deliveries/s, so 64 MiB of history would take a minute to fill: CORE_BYTES (default
# 4 MiB) is passed as --recovery-core-bytes, so the histories reach the core bound within the
# warm-up and the core trims all through the counted window, as on the full-rate firehose.
# TRANSPORT: socketio (default), ws or ws-offsets. CACHE=1: callgrind's cache simulation too.
set -euo pipefail
BIN=$(realpath "$1")
RW=$2
LOAD=$(realpath "${3:-target/release/hubcast-load}")
shift 3 || shift $#
WINDOW=${WINDOW:-6}
RATE=${RATE:-1000}
OUT_BEFORE=${OUT_BEFORE:-60000}
CORE_BYTES=${CORE_BYTES:-4194304}
TRANSPORT=${TRANSPORT:-socketio}
OUT=$(mktemp -d)
CG=()
[ "${CACHE:-0}" = 1 ] && CG=(--cache-sim=yes)
ulimit -n 20000
PORT=$((18000 + RANDOM % 1000)); KEY=callgrind-key
valgrind --tool=callgrind "${CG[@]}" --callgrind-out-file="$OUT/cg.out" "$BIN" --bind 127.0.0.1 --port "$PORT" \
  --primary-admin-secret "$KEY" --log-level warn --cores 1 --io-driver epoll --data-dir none --client-rate 0 \
  --recovery-window "$RW" --recovery-core-bytes "$CORE_BYTES" "$@" > "$OUT/hubcast.log" 2>&1 &
VG=$!
# One scrape per reading (a scrape costs the core a walk over its devices: counted too).
scrape() { curl -s -H "shared-access-key: $KEY" "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt"; }
metric() {
  awk -v m="^$1" '$0 ~ m {s += $2} END {printf "%d\n", s + 0}' "$OUT/metrics.txt"
}
for _ in $(seq 1 60); do
  curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break
  sleep 1
done
# The harness runs until well after the window (its warm-up covers the OUT_BEFORE deliveries).
WARM=$((OUT_BEFORE * 2 / (RATE * 10) + 30))
"$LOAD" --url "http://127.0.0.1:$PORT" --admin-key "$KEY" --warmup "$WARM" --duration $((WINDOW + 30)) \
  fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 4 --pipeline 16 --rate "$RATE" \
  --transport "$TRANSPORT" > "$OUT/load.txt" 2>&1 &
LOADPID=$!
for _ in $(seq 1 "$WARM"); do
  scrape; [ "$(metric hubcast_messages_out_total)" -gt "$OUT_BEFORE" ] && break
  sleep 1
done
callgrind_control -z "$VG" > /dev/null
scrape; a=$(metric hubcast_messages_out_total); ia=$(metric hubcast_messages_in_total); ca=$(metric hubcast_conflated_total)
sleep "$WINDOW"
scrape; b=$(metric hubcast_messages_out_total); ib=$(metric hubcast_messages_in_total); cb=$(metric hubcast_conflated_total)
callgrind_control -d "$VG" > /dev/null
scrape; held=$(metric hubcast_recovery_history_bytes)
trimmed=$(metric 'hubcast_recovery_trimmed_bytes_total.cause="core_bound"')
sleep 2
kill "$VG"
wait "$LOADPID" || true
IR=$(awk '/^totals:/ {print $2}' "$OUT/cg.out.1")
echo "$(basename "$BIN") recovery-window=$RW transport=$TRANSPORT core-bytes=$CORE_BYTES: $((b - a)) deliveries, $IR instructions, $((IR / (b - a))) per delivery; $((ib - ia)) messages in ($((IR / (10 * (ib - ia)))) per message in / 10), $((cb - ca)) conflated; history held $held B, core-bound trimmed $trimmed B (callgrind output in $OUT)"
# Not saturated (the comparison holds) only when deliveries ~ 10 x messages in and nothing conflated.
if [ "${CACHE:-0}" = 1 ]; then
  # events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
  awk -v n=$((b - a)) '/^totals:/ {printf "  per delivery: D1 misses %.1f (read %.1f, write %.1f), LL misses %.2f (read %.2f, write %.2f)\n", ($6+$7)/n, $6/n, $7/n, ($9+$10)/n, $9/n, $10/n}' "$OUT/cg.out.1"
fi
