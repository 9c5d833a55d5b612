#!/bin/bash
# Issue 24's measured goal, side by side in one run (docs/benchmarks/2026-11-28-recovery-fanout-cost.md):
# OLD and NEW hubcast, connection state recovery on (--recovery-window 120, the default) and off (0),
# on issue 13's C=1000 x S=10 of D=1000 fan-out with Socket.IO clients.
#  1. callgrind, instructions and D1 misses per delivery (recovery-instructions.sh, CACHE=1, RATE
#     msgs/s so that hubcast under valgrind keeps up: deliveries = 10 x messages in), OLD and NEW
#     run two at a time; then the same with --redis-url (a redis-server of its own per run, ports
#     REDIS_A/REDIS_B, so the two instances never see each other).
#  2. CPU time per delivery: recovery-hot-path-ab.sh (hubcast --cores 1 pinned to CPU 0, the
#     harness on CPU 1, full rate, OLD-on, OLD-off, NEW-on, NEW-off per round, ROUNDS rounds).
#   L=NEW/hubcast-load OLD=OLD/hubcast NEW=NEW/hubcast bash docs/benchmarks/recovery-fanout-cost.sh
set -u
D=$(dirname "$0")
export RATE=${RATE:-500} CACHE=1
REDIS_A=${REDIS_A:-6397} REDIS_B=${REDIS_B:-6398}
. "$D/shapes.sh"
echo "=== callgrind, RATE=$RATE msgs/s, $(date -u +%H:%M) UTC"; uptime
for w in 120 0; do
  pair "w=$w" $w
done
echo "=== callgrind with --redis-url (one instance each, its own redis-server), $(date -u +%H:%M) UTC"; uptime
for w in 120 0; do
  redis_pair "w=$w redis" $w
done
rm -f /tmp/cg-old.$$ /tmp/cg-new.$$
echo "=== CPU time, $(date -u +%H:%M) UTC"
BASE=$OLD NEW=$NEW ROUNDS=${ROUNDS:-5} bash "$D/recovery-hot-path-ab.sh"
