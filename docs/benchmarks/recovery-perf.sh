#!/bin/bash
# Where recovery's CPU time goes on issue 24's fan-out (C=1000 Socket.IO clients x S=10 of
# D=1000, full rate, hubcast --cores 1 pinned to CPU 0, the harness on CPU 1: the shape of
# recovery-hot-path-ab.sh), user and kernel: for each LABEL=BIN:WINDOW, one run with perf
# sampling hubcast's CPU time (cpu-clock: this VM has no hardware counters) over the measured
# window only (the harness's --step-hook starts and stops it), plus perf stat's counts of
# syscalls and context switches in the same window. Prints the harness's line, then per run
# the samples by symbol (user and kernel), kept in $OUT (default /tmp/recovery-perf).
#   L=hubcast-load ROUNDS=1 bash docs/benchmarks/recovery-perf.sh main-on=base/hubcast:120 main-off=base/hubcast:0 ...
# Then: python3 docs/benchmarks/recovery-perf-diff.py $OUT A-LABEL B-LABEL (ns per delivery by symbol, B - A).
set -u
OUT=${OUT:-/tmp/recovery-perf}
mkdir -p "$OUT"
ulimit -n 20000
FREQ=${FREQ:-2999}
for round in $(seq "${ROUNDS:-1}"); do
  for spec in "$@"; do
    label=${spec%%=*}; rest=${spec#*=}; bin=${rest%:*}; w=${rest##*:}
    tag="$OUT/$label.$round"
    echo "=== round $round $label window=$w transport=socketio perf"; uptime
    # begin: perf record and perf stat on hubcast (the harness's child); end: stop both.
    hook="if [ \"\$HUBCAST_LOAD_STEP\" = begin ]; then
      p=\$(pgrep -P \$PPID | grep -vx \$\$ | head -n 1); echo \$p > $tag.pid
      perf record -F $FREQ -e cpu-clock -p \$p -o $tag.data > /dev/null 2>&1 & echo \$! > $tag.rec
      perf stat -e task-clock,context-switches,raw_syscalls:sys_enter,syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_sendmsg,syscalls:sys_enter_read,syscalls:sys_enter_recvfrom,syscalls:sys_enter_epoll_wait,page-faults -p \$p -o $tag.stat > /dev/null 2>&1 & echo \$! > $tag.st
      sleep 0.2
    else
      kill -INT \$(cat $tag.rec) \$(cat $tag.st); sleep 1
    fi"
    $L --spawn "$bin" --cores 1 --pin --warmup 1 --duration 4 --hubcast-arg=--data-dir=none --hubcast-arg=--recovery-window="$w" \
      --step-hook "$hook" \
      fanout --clients 1000 --subs 10 --devices 1000 --batch 64 --fleet-conns 4 --pipeline 16 --rate 0 --transport socketio 2>&1 | tail -n 3 | tee "$tag.load"
    perf report -i "$tag.data" --no-children --sort dso,sym -F sample,dso,sym --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' > "$tag.report"
    head -n 25 "$tag.report"
    cat "$tag.stat" | grep -vE '^\s*$|^#' | head -n 14
  done
done
