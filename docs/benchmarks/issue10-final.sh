#!/usr/bin/env bash
# Issue 10's two CPU-second goals with main's default build (mimalloc): OLD10 (2d7a317) and NEW
# alternating, 5 rounds, fresh `hubcast --cores 1` pinned to CPU 0, harness on CPU 1, memory-only.
#   docs/benchmarks/issue10-final.sh OLD10_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD10=$1; NEW=$2; L=$3; ROUNDS=${4:-5}
ulimit -n 20000
for round in $(seq "$ROUNDS"); do
  for which in old10 new; do
    if [ $which = old10 ]; then BIN=$OLD10; else BIN=$NEW; fi
    echo "=== round $round $which ingest"; uptime
    $L --spawn "$BIN" --cores 1 --pin --hubcast-arg=--data-dir=none ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -n 2
    echo "=== round $round $which fanout10"; uptime
    $L --spawn "$BIN" --cores 1 --pin --hubcast-arg=--data-dir=none fanout --clients 10000 --devices 10 --batch 50 --fleet-conns 2 --rate 1000,2000 2>&1 | tail -n 3
  done
done
