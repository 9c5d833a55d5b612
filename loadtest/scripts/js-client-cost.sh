#!/bin/bash
# A JavaScript client's CPU per delivered message: one envelope per frame vs batched frames
# (/ws?batch=1), against one hubcast pinned to CPU 0 (--cores 1); the Node client and the
# fleet (hubcast-load ingest, POST /ingest) on CPU 1. docs/benchmarks/2026-11-25-batched-frames.md.
#
#   loadtest/scripts/js-client-cost.sh HUBCAST_BINARY [HUBCAST_LOAD_BINARY]
#
# Needs node and the `ws` package (tests/js/node_modules has it: npm ci in tests/js).
# RATE device messages/s in (default 50000), CLIENTS × SUBS subscriptions over DEVICES devices
# (default 200 × 10 over 1000: 2 subscribers per device, RATE × 2 deliveries/s), ROUNDS.
set -euo pipefail
BIN=$(realpath "$1")
LOAD=$(realpath "${2:-target/release/hubcast-load}")
HERE=$(dirname "$(realpath "$0")")
export WS_MODULE_DIR=${WS_MODULE_DIR:-$(realpath "$HERE/../../tests/js/node_modules")}
RATE=${RATE:-50000}; CLIENTS=${CLIENTS:-200}; SUBS=${SUBS:-10}; DEVICES=${DEVICES:-1000}; ROUNDS=${ROUNDS:-3}
KEY=js-client-cost-key
for round in $(seq "$ROUNDS"); do for mode in plain batch; do
  OUT=$(mktemp); HUBOUT=$(mktemp)
  # A fresh, memory-only hubcast each time, on a free port (read from its "listening on" line).
  taskset -c 0 "$BIN" --bind 127.0.0.1 --port 0 --cores 1 --data-dir none --primary-admin-secret "$KEY" \
    --secondary-admin-secret "$KEY-2" > "$HUBOUT" 2>&1 &
  HUB=$!
  for _ in $(seq 100); do grep -q "listening on" "$HUBOUT" && break; sleep 0.1; done
  PORT=$(grep -o "127.0.0.1:[0-9]*" "$HUBOUT" | head -1 | cut -d: -f2)
  [ -n "$PORT" ] || { echo "hubcast did not start:"; cat "$HUBOUT"; kill "$HUB"; exit 1; }
  taskset -c 1 node "$HERE/js-client-cost.mjs" "http://127.0.0.1:$PORT" "$KEY" "$CLIENTS" "$SUBS" "$DEVICES" "$mode" 2 5 > "$OUT" &
  CLIENT=$!
  until grep -q ready "$OUT"; do kill -0 "$CLIENT" || { kill "$HUB"; exit 1; }; sleep 0.1; done
  taskset -c 1 "$LOAD" --url "http://127.0.0.1:$PORT" --admin-key "$KEY" --pid "$HUB" --warmup 0 --duration 9 \
    ingest --devices "$DEVICES" --rate "$RATE" --batch 64 --fleet-conns 2 > /dev/null 2>&1 &
  FLEET=$!
  wait "$CLIENT"
  echo "round $round: $(grep '^{' "$OUT")"
  kill "$FLEET" 2> /dev/null || true; wait "$FLEET" 2> /dev/null || true
  kill "$HUB"; wait "$HUB" 2> /dev/null || true
  rm -f "$OUT" "$HUBOUT"
done; done
