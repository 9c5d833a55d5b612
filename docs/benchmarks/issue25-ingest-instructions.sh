#!/bin/bash
# Issue 25 item 4 (2026-11-28): instructions per ingested message of a whole hubcast process,
# several release binaries alternating in one run, counted by callgrind with
# loadtest/scripts/{ingest,amqp}-instructions.sh (one core, epoll; pinned to one CPU with
# taskset, which only keeps the run from spreading over the shared machine).
#   MODE=http|store|amqp docs/benchmarks/issue25-ingest-instructions.sh HUBCAST_LOAD ROUNDS BIN...
# http: POST /ingest, --data-dir none; store: the same with the default store in a fresh
# data dir (STORE=1); amqp: the AMQP endpoint, 4 partitions, the default store.
L=$1; ROUNDS=$2; shift 2
for round in $(seq 1 "$ROUNDS"); do
  for bin in "$@"; do
    echo "=== $MODE round $round $(basename "$bin")"; uptime
    case $MODE in
      http) taskset -c 1 loadtest/scripts/ingest-instructions.sh "$bin" "$L" 2>&1 | tail -n 1 ;;
      store) STORE=1 taskset -c 1 loadtest/scripts/ingest-instructions.sh "$bin" "$L" 2>&1 | tail -n 1 ;;
      amqp) taskset -c 1 loadtest/scripts/amqp-instructions.sh "$bin" "$L" 2>&1 | tail -n 1 ;;
    esac
  done
done
