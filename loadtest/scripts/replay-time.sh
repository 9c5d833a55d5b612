#!/bin/bash
# Time to replay N (default 10,000) missed messages to one plain WebSocket client that comes
# back with `since=` (issue 24, "Measured"). One memory-only `hubcast --cores 1` pinned to CPU 0,
# the Node client (loadtest/scripts/replay-time.mjs, the `ws` package) on CPU 1.
# docs/benchmarks/2026-11-27-recovery-cost.md.
#
#   loadtest/scripts/replay-time.sh HUBCAST_BINARY
#
# Needs node and tests/js/node_modules (npm ci in tests/js). N, ROUNDS (default 5),
# SESSION_BYTES (--recovery-session-bytes, default 16 MiB: the 1 MiB default holds ~6,000 of
# these envelopes, so a 10,000 replay would answer recovered false / bound).
set -euo pipefail
BIN=$(realpath "$1")
HERE=$(dirname "$(realpath "$0")")
export WS_MODULE_DIR=${WS_MODULE_DIR:-$(realpath "$HERE/../../tests/js/node_modules")}
N=${N:-10000}; ROUNDS=${ROUNDS:-5}; SESSION_BYTES=${SESSION_BYTES:-16777216}
KEY=replay-time-key
HUBOUT=$(mktemp)
taskset -c 0 "$BIN" --bind 127.0.0.1 --port 0 --cores 1 --data-dir none --primary-admin-secret "$KEY" \
  --secondary-admin-secret "$KEY-2" --recovery-session-bytes "$SESSION_BYTES" > "$HUBOUT" 2>&1 &
HUB=$!
trap 'kill $HUB 2> /dev/null || true; rm -f "$HUBOUT"' EXIT
for _ in $(seq 100); do grep -q "listening on" "$HUBOUT" && break; sleep 0.1; done
PORT=$(grep -o "127.0.0.1:[0-9]*" "$HUBOUT" | head -1 | cut -d: -f2)
[ -n "$PORT" ] || { echo "hubcast did not start:"; cat "$HUBOUT"; exit 1; }
uptime
taskset -c 1 node "$HERE/replay-time.mjs" "http://127.0.0.1:$PORT" "$KEY" "$N" "$ROUNDS"
