#!/usr/bin/env bash
# Issue 10's ingest goal for the one-pass parse (branch `parse`): the `POST /ingest` row of
# issue10-old-new.sh for three binaries side by side, alternating, 3 runs: OLD (2d7a317, the
# last commit before issue 10), MAIN (main before the branch) and NEW (the branch), each
# memory-only (--data-dir none), --cores 1 --pin. Give the three binaries:
#   docs/benchmarks/issue10-ingest-parse.sh OLD_BIN MAIN_BIN NEW_BIN [HUBCAST_LOAD]
set -u
L=${4:-target/release/hubcast-load}
ulimit -n 20000
for i in 1 2 3; do
  for which in old main new; do
    case $which in old) BIN=$1 ;; main) BIN=$2 ;; new) BIN=$3 ;; esac
    echo "=== run $i $which ingest"
    $L --spawn "$BIN" --cores 1 --pin --hubcast-arg=--data-dir=none ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -n 3
  done
done
