#!/bin/bash
# Start-to-serving with N devices' last values stored, and bytes on disk per device.
# usage: store-start.sh BIN LOADBIN DIR DEVICES [INGEST_SECONDS (8)]
set -e
BIN=$1; LOAD=$2; DIR=$3; N=$4; SECS=${5:-8}
rm -rf "$DIR"
rm -f /tmp/sb.out
$BIN --bind 127.0.0.1 --port 0 --cores 2 --primary-admin-secret k --data-dir "$DIR" --log-level verbose > /tmp/sb.out 2> /tmp/sb.err &
PID=$!
while ! grep -q "listening on" /tmp/sb.out; do sleep 0.05; done
URL=$(grep -o "http://127.0.0.1:[0-9]*" /tmp/sb.out | head -1)
$LOAD --url $URL --admin-key k --pid $PID --warmup 0 --duration $SECS ingest --devices $N --batch 500 --fleet-conns 4 > /tmp/sb.load 2>&1 || true
DEV=$(curl -s -H "Shared-Access-Key: k" $URL/metrics | grep "^hubcast_devices " | awk '{print $2}')
echo "devices stored: $DEV"
grep "snapshot encoded" /tmp/sb.err | sed 's/.*DEBUG//' | head -5
kill -9 $PID; wait $PID 2>/dev/null || true
echo "on disk after ingest (logs, maybe a snapshot):"; du -sb "$DIR"; ls -la "$DIR"
for run in 1 2 3; do
  T0=$(date +%s%N)
  rm -f /tmp/sb.out
  $BIN --bind 127.0.0.1 --port 0 --cores 2 --primary-admin-secret k --data-dir "$DIR" --log-level verbose > /tmp/sb.out 2> /tmp/sb.err &
  PID=$!
  while ! grep -q "listening on" /tmp/sb.out 2>/dev/null; do sleep 0.01; done
  T1=$(date +%s%N)
  URL=$(grep -o "http://127.0.0.1:[0-9]*" /tmp/sb.out | head -1)
  curl -s -o /dev/null -w "first GET /lastValue: %{http_code}\n" -H "Shared-Access-Key: k" $URL/lastValue/dev-000001
  echo "run $run: start to serving $(( (T1-T0)/1000000 )) ms; $(grep 'stored state loaded' /tmp/sb.err | sed 's/.*INFO//'); $(grep 'stored state restored' /tmp/sb.err | sed 's/.*DEBUG//' | tr '\n' ' ')"
  kill -9 $PID; wait $PID 2>/dev/null || true
done
