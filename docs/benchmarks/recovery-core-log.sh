#!/bin/bash
# Issue 24's measured goal, BASE (main) and NEW (the per-core log) side by side in one run
# (docs/benchmarks/2026-11-28-recovery-core-log.md), on issue 13's C=1000 x S=10 of D=1000
# fan-out with Socket.IO clients, connection state recovery on (--recovery-window 120) and
# off (0):
#  1. callgrind with its cache simulation (recovery-instructions.sh, CACHE=1): instructions,
#     D1 and LL misses per delivery at the default --recovery-core-bytes (64 MiB), both on and
#     off warmed as long (OUT_BEFORE=450000: the on histories at the bound, the core cutting
#     all through the counted window), WINDOW=10 (the socket timers' 10 s sweep in every
#     window); by function: cg-misses.py and cg-self.py on the outputs kept;
#  2. CPU time: recovery-hot-path-ab.sh, ROUNDS alternating rounds (say the load average).
#   L=hubcast-load BASE=base/hubcast NEW=new/hubcast bash docs/benchmarks/recovery-core-log.sh
set -u
D=$(dirname "$0")
export RATE=${RATE:-500} CACHE=1 WINDOW=${WINDOW:-10} OUT_BEFORE=${OUT_BEFORE:-450000} CORE_BYTES=67108864
cg() { # LABEL BIN WINDOW
  bash "$D/recovery-instructions.sh" "$2" "$3" "$L" 2>&1 | grep -v '^sending command' | sed "s/^/[$1] /"
}
pair() { # LABEL WINDOW: BASE and NEW at once
  cg "base $1" "$BASE" "$2" > /tmp/cg-base.$$ & cg "new $1" "$NEW" "$2" > /tmp/cg-new.$$; wait
  cat /tmp/cg-base.$$ /tmp/cg-new.$$
}
if [ "${CG:-1}" = 1 ]; then
  echo "=== 1. callgrind, default core bound, RATE=$RATE msgs/s, WINDOW=$WINDOW, $(date -u +%H:%M) UTC"; uptime
  pair "on" 120
  echo "=== $(date -u +%H:%M) UTC"; uptime
  pair "off" 0
  rm -f /tmp/cg-base.$$ /tmp/cg-new.$$
fi
[ "${ROUNDS:-5}" = 0 ] && exit 0
echo "=== 2. CPU time, $(date -u +%H:%M) UTC"
BASE=$BASE NEW=$NEW ROUNDS=${ROUNDS:-5} bash "$D/recovery-hot-path-ab.sh"
