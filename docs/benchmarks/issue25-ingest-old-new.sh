#!/bin/bash
# Issue 25 item 4: POST /ingest per hubcast CPU-second, OLD and NEW alternating, the store
# off (--data-dir none) and on (the default store in a fresh data dir, fsync every 1 s).
#   docs/benchmarks/issue25-ingest-old-new.sh OLD_HUBCAST NEW_HUBCAST HUBCAST_LOAD [ROUNDS]
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-5}
. "$(dirname "$0")/shapes.sh"
run() { ingest_store "$1 store=$3" "$2" "$3"; } # LABEL BIN STORE
for round in $(seq 1 "$ROUNDS"); do
  run old "$OLD" off; run new "$NEW" off; run old "$OLD" on; run new "$NEW" on
done
