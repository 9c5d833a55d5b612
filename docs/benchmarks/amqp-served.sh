#!/bin/sh
# AMQP ingest, main (the tap hands fe2o3 a 5-byte stand-in per transfer; fe2o3 still moves every
# delivery through its tasks) against branch `owned` (the tap serves the receivers' links:
# transfers, settlement and credit; fe2o3 sees none of the deliveries), alternating old/new per
# round, pinned (issue 13 item 4: >= 300,000 device messages per hubcast CPU-second), then
# callgrind per message. The rounds are amqp-tap.sh's, with other binaries.
# Usage: docs/benchmarks/amqp-served.sh ROUNDS
# Binaries (release): $BINS/hubcast-old and hubcast-load = main (CARGO_TARGET_DIR=/work/reltarget
#   cargo build --release --workspace --bin hubcast --bin hubcast-load); $BINS/hubcast-new = this
#   branch (CARGO_TARGET_DIR=/work/reltarget-owned cargo build --release --bin hubcast).
BINS=${BINS:-/work/bins} exec "$(dirname "$0")/amqp-tap.sh" "$@"
