#!/bin/bash
# Issue 25 item 4: POST /ingest per hubcast CPU-second, OLD and NEW alternating, the store
# off (--data-dir none) and on (the default store in a fresh data dir, fsync every 1 s).
#   docs/benchmarks/issue25-ingest-old-new.sh OLD_HUBCAST NEW_HUBCAST HUBCAST_LOAD [ROUNDS]
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-5}
run() { # LABEL BIN STORE
  local args=()
  [ "$3" = off ] && args=(--hubcast-arg=--data-dir=none)
  echo "=== round $round $1 store=$3"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 5 "${args[@]}" ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -n 2
}
for round in $(seq 1 "$ROUNDS"); do
  run old "$OLD" off; run new "$NEW" off; run old "$OLD" on; run new "$NEW" on
done
