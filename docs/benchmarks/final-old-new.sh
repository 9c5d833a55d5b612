#!/usr/bin/env bash
# Issues 10 and 13, final side-by-side figures on a quiet machine (docs/BENCHMARKS.md,
# "Final figures, 2026-11-26"). Release builds of three commits, each in its own worktree:
#   OLD10 = 2d7a317 (the last commit before issue 10), OLD13 = 405737f (main before the flush
#   policy and the one-pass ingest), NEW = main.
# Every run is a fresh `hubcast --cores 1` pinned to CPU 0 with the harness on CPU 1 (--pin),
# memory-only (--data-dir none), binaries alternating within each round.
#   docs/benchmarks/final-old-new.sh OLD10_BIN OLD13_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD10=$1; OLD13=$2; NEW=$3; L=$4; ROUNDS=${5:-5}
ulimit -n 20000
ingest() { # label bin [pipeline]: issue 10's ingest shape; with a pipeline depth the server is kept saturated
  echo "=== round $round $1 ingest pipeline=${3:-1}"; uptime
  $L --spawn "$2" --cores 1 --pin --hubcast-arg=--data-dir=none ingest --devices 10000 --batch 500 --fleet-conns 4 ${3:+--pipeline $3} 2>&1 | tail -n 2
}
fanout10() { # label bin: issue 10's fan-out shape (10,000 sockets, 1,000 subscribers per device)
  echo "=== round $round $1 fanout10"; uptime
  $L --spawn "$2" --cores 1 --pin --hubcast-arg=--data-dir=none fanout --clients 10000 --devices 10 --batch 50 --fleet-conns 2 --rate 1000,2000 2>&1 | tail -n 3
}
fanout13() { # label bin rate P: issue 13's shape (C=1000 x S=10 of D=1000, batches of 64, 16 in flight)
  echo "=== round $round $1 fanout13 rate=$3 P=$4"; uptime
  $L --spawn "$2" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none \
    fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$4" --pipeline 16 --rate "$3" --transport ws 2>&1 | tail -n 2
}
for round in $(seq "$ROUNDS"); do
  ingest old10 "$OLD10"; ingest new "$NEW"
  ingest old10 "$OLD10" 8; ingest new "$NEW" 8
  fanout10 old10 "$OLD10"; fanout10 new "$NEW"
  for shape in "0 4" "0 16" "5000 4"; do
    set -- $shape
    fanout13 old13 "$OLD13" "$1" "$2"; fanout13 new "$NEW" "$1" "$2"
  done
done
