#!/bin/bash
# Instructions per AMQP device message of a whole hubcast process, counted by callgrind
# (deterministic, unlike CPU time on a shared machine). docs/benchmarks/2026-11-25-amqp-encoded-branch.md.
#
#   loadtest/scripts/amqp-instructions.sh HUBCAST_BINARY [HUBCAST_LOAD_BINARY]
#
# The harness's AMQP endpoint sends as fast as hubcast's link credit allows (RATE=0; set RATE
# for a paced run); hubcast runs under callgrind with --cores 1 and the epoll driver. Counters
# are zeroed once messages flow, then dumped WINDOW seconds later; the instruction total of
# that window is divided by the hubcast_messages_in_total delta over it.
set -euo pipefail
BIN=$(realpath "$1")
LOAD=$(realpath "${2:-target/release/hubcast-load}")
RATE=${RATE:-0}
WINDOW=${WINDOW:-8}
OUT=$(mktemp -d)
PORT=$((18000 + RANDOM % 1000)); APORT=$((19000 + RANDOM % 1000)); KEY=callgrind-key
"$LOAD" --url "http://127.0.0.1:$PORT" --admin-key "$KEY" --warmup 8 --duration $((WINDOW + 6)) \
  ingest --fleet amqp --amqp-port "$APORT" --devices 10000 --partitions 4 --rate "$RATE" > "$OUT/load.txt" 2>&1 &
LOADPID=$!
sleep 1
valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.out" "$BIN" --bind 127.0.0.1 --port "$PORT" \
  --primary-admin-secret "$KEY" --log-level warn --cores 1 --io-driver epoll --event-hub-prefetch 2000 \
  --iot-hub-event-hub-connection-string "Endpoint=amqp://127.0.0.1:$APORT/;SharedAccessKeyName=load;SharedAccessKey=bG9hZC10ZXN0LWtleQ==;EntityPath=load-hub" \
  > "$OUT/hubcast.log" 2>&1 &
VG=$!
. "$(dirname "$0")/callgrind-window.sh"
counted_window 3000
echo "$(basename "$BIN"): $((b - a)) messages, $IR instructions, $((IR / (b - a))) per message (callgrind output in $OUT)"
