#!/bin/bash
# Instructions per `POST /ingest` device message of a whole hubcast process, counted by
# callgrind (deterministic, unlike CPU time on a shared machine). See
# docs/benchmarks/2026-11-25-ingest-one-pass.md. Same method as amqp-instructions.sh.
#
#   loadtest/scripts/ingest-instructions.sh HUBCAST_BINARY [HUBCAST_LOAD_BINARY]
#
# The harness posts batches of 500 messages of 10,000 devices on 4 keep-alive connections as
# fast as hubcast answers; hubcast runs under callgrind with --cores 1, the epoll driver and
# --data-dir none. Counters are zeroed once messages flow, then dumped WINDOW seconds later;
# the instruction total of that window is divided by the hubcast_messages_in_total delta.
#
# STORE=1: the default durable store on, in a fresh data dir (instead of --data-dir none).
# CACHE=1: callgrind's cache simulation too (D1/LL misses per message; about twice as slow).
set -euo pipefail
BIN=$(realpath "$1")
LOAD=$(realpath "${2:-target/release/hubcast-load}")
WINDOW=${WINDOW:-8}
OUT=$(mktemp -d)
DATA=none
[ "${STORE:-0}" = 1 ] && DATA="$OUT/data"
CG=()
[ "${CACHE:-0}" = 1 ] && CG=(--cache-sim=yes)
PORT=$((18000 + RANDOM % 1000)); KEY=callgrind-key
"$LOAD" --url "http://127.0.0.1:$PORT" --admin-key "$KEY" --warmup 8 --duration $((WINDOW + 6)) \
  ingest --devices 10000 --batch 500 --fleet-conns 4 > "$OUT/load.txt" 2>&1 &
LOADPID=$!
valgrind --tool=callgrind "${CG[@]}" --callgrind-out-file="$OUT/cg.out" "$BIN" --bind 127.0.0.1 --port "$PORT" \
  --primary-admin-secret "$KEY" --log-level warn --cores 1 --io-driver epoll --data-dir "$DATA" \
  > "$OUT/hubcast.log" 2>&1 &
VG=$!
. "$(dirname "$0")/callgrind-window.sh"
counted_window 20000
echo "$(basename "$BIN") data-dir=${DATA##*/}: $((b - a)) messages, $IR instructions, $((IR / (b - a))) per message (callgrind output in $OUT)"
if [ "${CACHE:-0}" = 1 ]; then
  # events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
  awk -v n=$((b - a)) '/^totals:/ {printf "  per message: D1 misses %.1f (read %.1f, write %.1f), LL misses %.2f (read %.2f, write %.2f)\n", ($6+$7)/n, $6/n, $7/n, ($9+$10)/n, $9/n, $10/n}' "$OUT/cg.out.1"
fi
