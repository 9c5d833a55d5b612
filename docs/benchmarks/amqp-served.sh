#!/bin/sh
# AMQP ingest, main (the tap hands fe2o3 a 5-byte stand-in per transfer; fe2o3 still moves every
# delivery through its tasks) against branch `owned` (the tap serves the receivers' links: transfers,
# settlement and credit, fe2o3 sees none of the deliveries), alternating old/new per round, pinned
# (issue 13 item 4: >= 300,000 device messages per hubcast CPU-second), then callgrind per message.
# Usage: docs/benchmarks/amqp-served.sh ROUNDS
# Binaries (release): $BINS/hubcast-old and hubcast-load = main (CARGO_TARGET_DIR=/work/reltarget
#   cargo build --release --workspace --bin hubcast --bin hubcast-load); $BINS/hubcast-new = this
#   branch (CARGO_TARGET_DIR=/work/reltarget-owned cargo build --release --bin hubcast).
BINS=${BINS:-/work/bins}
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
