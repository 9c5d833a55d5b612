#!/bin/bash
# Ingest (POST /ingest) with the store on vs off, alternating, 3 runs each.
L=/tmp/hubcast-load-bench; H=/tmp/hubcast-store-bench
for i in 1 2 3; do
  echo "== run $i: store on (--data-dir <fresh temp dir>, --fsync-interval 1000)"
  $L --spawn $H --cores 2 --warmup 1 --duration 5 ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -2
  echo "== run $i: store off (--data-dir none)"
  $L --spawn $H --cores 2 --warmup 1 --duration 5 --hubcast-arg=--data-dir=none ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -2
done
