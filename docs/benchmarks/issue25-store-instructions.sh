#!/bin/bash
# Issue 25 item 4 (2026-11-28, what the store costs): instructions per message of a whole
# hubcast process (callgrind, loadtest/scripts/{ingest,amqp}-instructions.sh), several release
# binaries in turn: POST /ingest with the default store (2 rounds), without it (1 round), AMQP
# with the default store (2 rounds, each from a fresh working directory: the AMQP script runs
# hubcast in ./hubcast-data, and an older build refuses a newer store format).
#   docs/benchmarks/issue25-store-instructions.sh HUBCAST_LOAD LABEL=HUBCAST...
L=$(realpath "$1"); shift
S=$(realpath loadtest/scripts)
for round in 1 2; do for lb in "$@"; do
  echo "=== store round $round ${lb%%=*}"; uptime
  STORE=1 taskset -c 1 "$S/ingest-instructions.sh" "$(realpath "${lb#*=}")" "$L" 2>&1 | tail -n 1
done; done
for lb in "$@"; do
  echo "=== http round 1 ${lb%%=*}"; uptime
  taskset -c 1 "$S/ingest-instructions.sh" "$(realpath "${lb#*=}")" "$L" 2>&1 | tail -n 1
done
for round in 1 2; do for lb in "$@"; do
  echo "=== amqp round $round ${lb%%=*}"; uptime
  bin=$(realpath "${lb#*=}"); d=$(mktemp -d)
  (cd "$d" && taskset -c 1 "$S/amqp-instructions.sh" "$bin" "$L" 2>&1 | tail -n 1)
  rm -rf "$d/hubcast-data"
done; done
