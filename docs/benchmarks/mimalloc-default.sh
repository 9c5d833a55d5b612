#!/usr/bin/env bash
# glibc malloc vs mimalloc as hubcast's allocator (docs/BENCHMARKS.md, "The allocator"):
# the same source built twice (`cargo build --release` and `--features mimalloc`) and OLD10
# (2d7a317) for issue 10's ratios; alternating, fresh `hubcast --cores 1` pinned to CPU 0, harness
# on CPU 1, memory-only.
#   docs/benchmarks/mimalloc-default.sh OLD10_BIN GLIBC_BIN MIMALLOC_BIN HUBCAST_LOAD [ROUNDS] > out.txt
set -u
OLD10=$1; GLIBC=$2; MI=$3; L=$4; ROUNDS=${5:-4}
ulimit -n 20000
for round in $(seq "$ROUNDS"); do
  for which in old10 glibc mimalloc; do
    case $which in old10) BIN=$OLD10 ;; glibc) BIN=$GLIBC ;; mimalloc) BIN=$MI ;; esac
    echo "=== round $round $which ingest"; uptime
    $L --spawn "$BIN" --cores 1 --pin --hubcast-arg=--data-dir=none ingest --devices 10000 --batch 500 --fleet-conns 4 2>&1 | tail -n 2
    echo "=== round $round $which fanout10"; uptime
    $L --spawn "$BIN" --cores 1 --pin --hubcast-arg=--data-dir=none fanout --clients 10000 --devices 10 --batch 50 --fleet-conns 2 --rate 1000,2000 2>&1 | tail -n 3
  done
  for which in glibc mimalloc; do
    case $which in glibc) BIN=$GLIBC ;; mimalloc) BIN=$MI ;; esac
    for shape in "0 4" "0 16" "5000 4"; do
      set -- $shape
      echo "=== round $round $which fanout13 rate=$1 P=$2"; uptime
      $L --spawn "$BIN" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none \
        fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns "$2" --pipeline 16 --rate "$1" --transport ws 2>&1 | tail -n 2
    done
    echo "=== round $round $which idle"; uptime
    $L --spawn "$BIN" --cores 1 --pin idle --clients 19000 2>&1 | tail -n 2
  done
done
