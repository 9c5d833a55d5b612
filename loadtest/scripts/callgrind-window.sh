# The counted window of amqp-instructions.sh and ingest-instructions.sh (sourced by both):
# hubcast under callgrind (pid $VG, writing $OUT/cg.out; the load's pid $LOADPID; its
# /metrics at $PORT with $KEY) is counted over $WINDOW seconds once it has taken in more than
# FIRST messages (the warm-up), then stopped. Sets a and b (messages taken in at the window's
# two ends) and IR (the instructions counted in it).
#   counted_window FIRST
messages_in() {
  curl -s -H "shared-access-key: $KEY" "http://127.0.0.1:$PORT/metrics" | awk '/^hubcast_messages_in_total/ {s += $2} END {print s + 0}'
}
counted_window() {
  for _ in $(seq 1 120); do
    [ "$(messages_in)" -gt "$1" ] && break
    sleep 1
  done
  callgrind_control -z "$VG" > /dev/null
  a=$(messages_in)
  sleep "$WINDOW"
  b=$(messages_in)
  callgrind_control -d "$VG" > /dev/null
  sleep 2
  kill "$VG"
  wait "$LOADPID" || true
  IR=$(awk '/^totals:/ {print $2}' "$OUT/cg.out.1")
}
