#!/usr/bin/env bash
# Issues 10 and 13, final side-by-side figures on a quiet machine
# (docs/benchmarks/2026-11-27-issues-10-13-old-new.md). Release builds of three commits, each
# in its own worktree:
#   OLD10 = 2d7a317 (the last commit before issue 10), OLD13 = 405737f (main before the flush
#   policy and the one-pass ingest), NEW = main.
# Every run is a fresh `hubcast --cores 1` pinned to CPU 0 with the harness on CPU 1 (--pin),
# memory-only (--data-dir none), binaries alternating within each round.
#   docs/benchmarks/final-old-new.sh OLD10_BIN OLD13_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD10=$1; OLD13=$2; NEW=$3; L=$4; ROUNDS=${5:-5}
. "$(dirname "$0")/shapes.sh"
for round in $(seq "$ROUNDS"); do
  ingest old10 "$OLD10"; ingest new "$NEW"
  ingest old10 "$OLD10" 8; ingest new "$NEW" 8
  fanout10 old10 "$OLD10"; fanout10 new "$NEW"
  for shape in "0 4" "0 16" "5000 4"; do
    set -- $shape
    fanout13 old13 "$OLD13" "$1" "$2"; fanout13 new "$NEW" "$1" "$2"
  done
done
