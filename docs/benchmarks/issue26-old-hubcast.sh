#!/bin/bash
# The old binary (82aa7cf) has no --client-rate: drop it, keep the rest.
args=()
skip=0
for a in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  if [ "$a" = "--client-rate" ]; then skip=1; continue; fi
  args+=("$a")
done
exec "${OLD_HUBCAST:-/work/wt-old/target/release/hubcast}" "${args[@]}"
