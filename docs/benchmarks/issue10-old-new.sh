#!/usr/bin/env bash
# Issue 10's measurement: the binary from before issue 10 (ecd0e5d^) against
# main, both memory-only (--data-dir none), alternating, 3 runs. OLD: `git worktree add OLD ecd0e5d^`
# and `cargo build --release` there.
set -u
# from the repository root
L=target/release/hubcast-load
NEW=target/release/hubcast
ulimit -n 20000
for i in 1 2 3; do
  for which in old new; do
    if [ $which = old ]; then BIN=OLD/hubcast; else BIN=$NEW; fi; EXTRA=(--hubcast-arg=--data-dir=none)
    echo "=== run $i $which ingest"
    $L --spawn $BIN --cores 1 --pin "${EXTRA[@]}" --json $which-ingest-$i.json ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -n 8
    echo "=== run $i $which fanout"
    $L --spawn $BIN --cores 1 --pin "${EXTRA[@]}" --json $which-fanout-$i.json fanout --clients 10000 --devices 10 --batch 50 --fleet-conns 2 --rate 1000,2000 2>&1 | tail -n 10
  done
done
