#!/bin/bash
# AMQP ingest with the store on vs off, alternating, 3 runs each (hubcast --cores 1 pinned, harness on the other core).
L=/tmp/hubcast-load-rel; H=/tmp/hubcast-rel
for i in 1 2 3; do
  echo "== run $i: store on"
  $L --spawn $H --cores 1 --pin --warmup 1 --duration 5 ingest --fleet amqp --devices 10000 --partitions 4 2>&1 | tail -2
  echo "== run $i: store off (--data-dir none)"
  $L --spawn $H --cores 1 --pin --warmup 1 --duration 5 --hubcast-arg=--data-dir=none ingest --fleet amqp --devices 10000 --partitions 4 2>&1 | tail -2
done
