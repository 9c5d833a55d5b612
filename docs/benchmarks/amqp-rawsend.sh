#!/bin/sh
# AMQP ingest driven by the old harness (fe2o3-amqp's acceptor, one Sender::send per message) and by the new one
# (hand-written AMQP endpoint, loadtest/src/fleet/amqp/), alternating, pinned and not (issue 13 item 4: "measure
# with a sender that is not the bottleneck"). Both drive the same hubcast: main's.
# Usage: docs/benchmarks/amqp-rawsend.sh ROUNDS
# Binaries (release): /tmp/rawsend-bins/hubcast-main and hubcast-load-old = main built apart
#   (git worktree add --detach /tmp/rawsend-old main; CARGO_TARGET_DIR=/work/reltarget-rawsend-old
#    cargo build --release --workspace --bin hubcast --bin hubcast-load);
#   /tmp/rawsend-bins/hubcast-load-new = branch rawsend (cargo build --release -p hubcast-load).
BINS=${BINS:-/tmp/rawsend-bins}
for i in $(seq 1 ${1:-3}); do
  for pin in --pin ""; do
    for h in old new; do
      # The 1-minute load counts this script's own runs (~2 busy threads); the process counts show other work.
      echo "### round=$i harness=$h pin=${pin:-none} $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)" \
        "others: rustc=$(pgrep -c rustc) valgrind=$(pgrep -fc valgrind) hubcast=$(pgrep -c hubcast)"
      $BINS/hubcast-load-$h --spawn $BINS/hubcast-main --cores 1 $pin --duration 5 \
        ingest --fleet amqp --devices 10000 --partitions 4 2>&1 | grep -v '^machine\|^== \|^fleet='
    done
  done
done
