#!/bin/bash
# A data dir written by main's build (store format 5) started by this build (format 6, logs used
# again): every value back, then writing goes on through several snapshots (logs written over
# the spare), a kill -9, and a restart. Real binaries, one core, a small --snapshot-log-bytes.
#   docs/benchmarks/store-reuse-migration.sh OLD_HUBCAST NEW_HUBCAST
OLD=$1; NEW=$2
D=$(mktemp -d); P=$((20000 + RANDOM % 20000)); K=migration-key
start() { # BIN NAME
  "$1" --bind 127.0.0.1 --port $P --data-dir "$D" --cores 1 --primary-admin-secret $K \
    --snapshot-log-bytes 300000 --log-level verbose > "$D.$2.log" 2>&1 &
  PID=$!
  for _ in $(seq 200); do curl -s -o /dev/null "http://127.0.0.1:$P/version" && return; sleep 0.05; done
  echo "no answer from $2"; exit 1
}
rounds() { # FROM TO: each of 500 devices gets {"n": round}
  for r in $(seq "$1" "$2"); do
    body=$(python3 -c "import json;print(json.dumps([{'deviceId':f'dev-{d}','body':{'n':$r}} for d in range(500)]))")
    curl -s -o /dev/null -w '' -H "Shared-Access-Key: $K" -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$P/ingest"
  done
}
check() { # WANT: every device's n
  bad=0
  for d in $(seq 0 5 499); do
    n=$(curl -s -H "Shared-Access-Key: $K" "http://127.0.0.1:$P/lastValue/dev-$d/n" | python3 -c 'import json,sys;print(json.load(sys.stdin)["data"]["n"])')
    [ "$n" = "$1" ] || bad=$((bad + 1))
  done
  echo "devices (every 5th of 500) whose n is not $1: $bad of 100"
}
files() { ls -l "$D" | awk 'NR>1{print $5, $9}'; for f in "$D"/*.log "$D"/*.snap; do [ -f "$f" ] && printf '%s version %d\n' "$(basename "$f")" "$(od -An -tu4 -j8 -N4 "$f")"; done; }
echo "=== main's build writes 40 rounds, kill -9"; start "$OLD" old; rounds 1 40; kill -9 $PID; wait $PID 2>/dev/null; files
echo "=== this build starts on it"; start "$NEW" new1; check 40
grep -E "WARN|ERROR" "$D.new1.log" | head -5
echo "=== this build writes 100 more rounds (snapshots, logs written over the spare), kill -9"; rounds 41 140
echo "logs written over the spare: $(grep -c 'store log written over the spare' "$D.new1.log")"; echo "snapshots: $(grep -c 'store snapshot written' "$D.new1.log")"
kill -9 $PID; wait $PID 2>/dev/null; files
echo "=== this build starts again"; start "$NEW" new2; check 140
grep -E "WARN|ERROR" "$D.new2.log" | head -5
kill $PID; wait $PID 2>/dev/null
rm -rf "$D" "$D".*.log
