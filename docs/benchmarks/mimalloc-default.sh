#!/usr/bin/env bash
# glibc malloc vs mimalloc as hubcast's allocator (docs/benchmarks/2026-11-27-allocator.md):
# the same source built twice (`cargo build --release` and `--features mimalloc`) and OLD10
# (2d7a317) for issue 10's ratios; alternating, fresh `hubcast --cores 1` pinned to CPU 0, harness
# on CPU 1, memory-only.
#   docs/benchmarks/mimalloc-default.sh OLD10_BIN GLIBC_BIN MIMALLOC_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD10=$1; GLIBC=$2; MI=$3; L=$4; ROUNDS=${5:-4}
. "$(dirname "$0")/shapes.sh"
for round in $(seq "$ROUNDS"); do
  for which in old10 glibc mimalloc; do
    case $which in old10) BIN=$OLD10 ;; glibc) BIN=$GLIBC ;; mimalloc) BIN=$MI ;; esac
    ingest $which "$BIN"; fanout10 $which "$BIN"
  done
  for which in glibc mimalloc; do
    case $which in glibc) BIN=$GLIBC ;; mimalloc) BIN=$MI ;; esac
    fanout13_all $which "$BIN"
    echo "=== round $round $which idle"; uptime
    $L --spawn "$BIN" --cores 1 --pin idle --clients 19000 2>&1 | tail -n 2
  done
done
