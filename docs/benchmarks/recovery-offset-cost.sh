#!/bin/bash
# Issue 24's measured goal at the default core bound, OLD and NEW side by side in one run
# (docs/benchmarks/2026-11-28-recovery-offset-cost.md): instructions per delivery on issue 13's
# C=1000 x S=10 of D=1000 fan-out with Socket.IO clients, connection state recovery on
# (--recovery-window 120) and off (0), counted by callgrind (recovery-instructions.sh, CACHE=1).
#  1. on at the default --recovery-core-bytes (64 MiB): OUT_BEFORE=450000 deliveries before the
#     counted window, so the histories reach the bound (~62 MB held) and the core cuts all
#     through the window, as on a full-rate firehose; then off (the bound does not matter);
#  2. on at 4 MiB (the earlier pages' setting: the core's cut runs 16 times as often);
#  3. with --redis-url (a redis-server of its own per build, ports REDIS_A/REDIS_B), on at
#     64 MiB and off;
#  4. CPU time: recovery-hot-path-ab.sh, ROUNDS alternating rounds (say the load average).
#   L=NEW/hubcast-load OLD=OLD/hubcast NEW=NEW/hubcast bash docs/benchmarks/recovery-offset-cost.sh
set -u
D=$(dirname "$0")
export RATE=${RATE:-500} CACHE=1
REDIS_A=${REDIS_A:-6397} REDIS_B=${REDIS_B:-6398}
. "$D/shapes.sh"
echo "=== 1. callgrind, default core bound, RATE=$RATE msgs/s, $(date -u +%H:%M) UTC"; uptime
CORE_BYTES=67108864 OUT_BEFORE=450000 pair "w=120 64MiB" 120
pair "w=0" 0
echo "=== 2. callgrind, 4 MiB core bound, $(date -u +%H:%M) UTC"; uptime
CORE_BYTES=4194304 pair "w=120 4MiB" 120
echo "=== 3. callgrind with --redis-url, $(date -u +%H:%M) UTC"; uptime
CORE_BYTES=67108864 OUT_BEFORE=450000 redis_pair "w=120 64MiB redis" 120
redis_pair "w=0 redis" 0
rm -f /tmp/cg-old.$$ /tmp/cg-new.$$
[ "${ROUNDS:-5}" = 0 ] && exit 0
echo "=== 4. CPU time, $(date -u +%H:%M) UTC"
BASE=$OLD NEW=$NEW ROUNDS=${ROUNDS:-5} bash "$D/recovery-hot-path-ab.sh"
