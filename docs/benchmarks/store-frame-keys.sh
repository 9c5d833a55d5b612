#!/bin/bash
# Issue 25 item 4 (2026-11-28, store format 7: a log frame's device records share its keys and
# base time): what the default store costs, several release builds in one run.
#   1. instructions per POST /ingest message under callgrind (load-independent), the default
#      store on, and for the first build also off (loadtest/scripts/ingest-instructions.sh);
#   2. bytes written per message and where the CPU goes with the store on (perf shares:
#      issue25-store-profile.sh perf);
#   3. messages per hubcast CPU-second, ROUNDS alternating rounds, store off / on / AMQP
#      (issue25-compact-cpu.sh; medians: issue25-compact-summary.py).
#   docs/benchmarks/store-frame-keys.sh HUBCAST_LOAD ROUNDS LABEL=HUBCAST...
L=$(realpath "$1"); ROUNDS=$2; shift 2
B=$(dirname "$(realpath "$0")"); S=$(realpath "$B/../../loadtest/scripts")
first=1
for lb in "$@"; do
  bin=$(realpath "${lb#*=}")
  echo "=== instructions ${lb%%=*} store=on"; uptime
  STORE=1 taskset -c 1 "$S/ingest-instructions.sh" "$bin" "$L" 2>&1 | tail -n 1
  if [ $first = 1 ]; then
    echo "=== instructions ${lb%%=*} store=off"; uptime
    taskset -c 1 "$S/ingest-instructions.sh" "$bin" "$L" 2>&1 | tail -n 1
    first=0
  fi
done
for lb in "$@"; do
  echo "=== profile ${lb%%=*} store=on"; uptime
  bash "$B/issue25-store-profile.sh" perf "${lb#*=}" "$L" store 2>&1
done
bash "$B/issue25-compact-cpu.sh" "$L" "$ROUNDS" "$@"
