#!/bin/bash
# Issue 25 item 4 (2026-11-28, the compact entry and record): messages per hubcast CPU-second,
# several release binaries alternating in one run. Per round, for each binary in turn:
# POST /ingest with the store off (--data-dir none), the same with the default store (a fresh
# data dir, fsync every 1 s), then AMQP ingest (default store). The harness's ingest row: its
# last column is messages per hubcast CPU-second.
#   docs/benchmarks/issue25-compact-cpu.sh HUBCAST_LOAD ROUNDS LABEL=HUBCAST...
L=$1; ROUNDS=$2; shift 2
. "$(dirname "$0")/shapes.sh"
http() { ingest_store "$1 http store=$3" "$2" "$3"; } # LABEL BIN STORE
amqp() { # LABEL BIN
  echo "=== round $round $1 amqp store=on"; uptime
  $L --spawn "$2" --cores 1 --pin --duration 5 ingest --fleet amqp --devices 10000 --partitions 4 2>&1 | tail -n 2
}
for round in $(seq 1 "$ROUNDS"); do
  for lb in "$@"; do http "${lb%%=*}" "${lb#*=}" off; done
  for lb in "$@"; do http "${lb%%=*}" "${lb#*=}" on; done
  for lb in "$@"; do amqp "${lb%%=*}" "${lb#*=}"; done
done
