#!/bin/bash
# The log's reserved blocks alone: the same build with (new) and without (noreserve) the
# fallocate call, POST /ingest with the default store in a fresh data dir, alternating.
#   docs/benchmarks/issue25-store-reserve-ab.sh HUBCAST_LOAD ROUNDS LABEL=BIN...
L=$1; ROUNDS=$2; shift 2
for round in $(seq 1 "$ROUNDS"); do
  for lb in "$@"; do
    echo "=== round $round ${lb%%=*} http store=on"; uptime
    $L --spawn "${lb#*=}" --cores 1 --pin --warmup 1 --duration 5 ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -n 2
  done
done
