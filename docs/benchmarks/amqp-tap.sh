#!/bin/sh
# AMQP ingest, main (fe2o3 decodes every message) against branch `tap` (device messages taken off the
# wire under fe2o3, src/amqp/tap.rs), alternating old/new per round, pinned (issue 13 item 4:
# >= 300,000 device messages per hubcast CPU-second), then callgrind instructions per message of both.
# Usage: docs/benchmarks/amqp-tap.sh ROUNDS
# Binaries (release): /tmp/tap-bins/hubcast-old and hubcast-load = main built apart
#   (git worktree add --detach /tmp/tap-old main; CARGO_TARGET_DIR=/work/reltarget-tap-old
#    cargo build --release --workspace --bin hubcast --bin hubcast-load);
#   /tmp/tap-bins/hubcast-new = this branch (CARGO_TARGET_DIR=/work/reltarget-tap cargo build --release --bin hubcast).
BINS=${BINS:-/tmp/tap-bins}
for i in $(seq 1 ${1:-4}); do
  for b in old new; do
    echo "### round=$i hubcast=$b pin=--pin $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)" \
      "others: rustc=$(pgrep -c rustc) valgrind=$(pgrep -fc valgrind) hubcast=$(pgrep -c hubcast)"
    $BINS/hubcast-load --spawn $BINS/hubcast-$b --cores 1 --pin --duration 5 \
      ingest --fleet amqp --devices 10000 --partitions 4 2>&1 | grep -v '^machine\|^== \|^fleet='
  done
done
if [ -z "$NO_CALLGRIND" ]; then
  for b in old new; do
    echo "### callgrind hubcast=$b $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
    loadtest/scripts/amqp-instructions.sh $BINS/hubcast-$b $BINS/hubcast-load
  done
fi
