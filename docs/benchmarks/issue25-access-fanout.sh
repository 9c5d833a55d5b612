#!/usr/bin/env bash
# Issue 25 item 3's packed access entries (16 bytes, keyed 8-aligned) against the old ones
# (88 bytes, u128 key) on the fan-out, which walks every access entry of a device per message:
# issue 13's max-rate shape with 4 publishers (10 sessions per device) and issue 10's 1,000
# subscribers per device, OLD and NEW alternating, pinned, memory-only.
#   docs/benchmarks/issue25-access-fanout.sh OLD_BIN NEW_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD=$1; NEW=$2; L=$3; ROUNDS=${4:-3}
. "$(dirname "$0")/shapes.sh"
for round in $(seq "$ROUNDS"); do
  fanout13 old "$OLD" 0 4
  fanout13 new "$NEW" 0 4
  fanout10 old "$OLD"
  fanout10 new "$NEW"
done
