#!/bin/sh
# Alternating old/new AMQP ingest runs (issue 13 item 4, hand-offs). Usage: docs/benchmarks/amqp-handoff.sh ROUNDS
# Binaries: /tmp/hubcast-old = main (fea4510) built apart (git worktree add --detach /tmp/handoff-old main;
#   CARGO_TARGET_DIR=/work/reltarget-handoff cargo build --release --bin hubcast); /tmp/hubcast-new = branch handoff
#   (cargo build --release --bin hubcast); /tmp/hubcast-load-new = the branch's harness (cargo build --release -p hubcast-load).
LOAD=${LOAD:-/tmp/hubcast-load-new}
for i in $(seq 1 ${1:-3}); do
  for pin in --pin ""; do
    for v in old new new-linger0 new-linger2; do
      case $v in
        old) bin=/tmp/hubcast-old; extra="";;
        new) bin=/tmp/hubcast-new; extra="";;
        new-linger0) bin=/tmp/hubcast-new; extra="--hubcast-arg=--event-hub-linger-ms=0";;
        new-linger2) bin=/tmp/hubcast-new; extra="--hubcast-arg=--event-hub-linger-ms=2";;
      esac
      echo "### round=$i variant=$v pin=${pin:-none} $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
      $LOAD --spawn $bin --cores 1 $pin $extra --duration 5 ingest --fleet amqp --devices 10000 --partitions 4 2>&1 | grep -v '^machine\|^pinning\|^== \|^fleet='
    done
  done
done
