#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: installs what the tests need, then cargo test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Node.js clients used by the Socket.IO tests (the real socket.io-client from npm).
if [ -f tests/js/package.json ]; then
  if ! command -v node >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
  fi
  (cd tests/js && npm ci --no-audit --no-fund --loglevel=error)
fi

# Python's http.client reads an early 413 in tests/http_framing.rs; prlimit (util-linux) caps
# memory in tests/hostile_http.rs.
if ! command -v python3 >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq python3 >/dev/null
fi
if ! command -v prlimit >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq util-linux >/dev/null
fi
# curl speaks HTTPS to the server in tests/tls.rs (trusting a throwaway CA).
if ! command -v curl >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq curl ca-certificates >/dev/null
fi

# The peer brokers of issue 25's comparison (loadtest/tests/peers.rs starts its own instances
# of each on free ports from the Debian packages' /usr/sbin binaries; their system services
# are not used). Only the missing ones are installed, and their services are neither started
# (a policy-rc.d answering 101 while apt runs, unless the machine has one of its own, as
# Docker images do: dpkg's scripts ask it before starting anything) nor left enabled, so a
# developer's machine does not end up running a broker on 1883 / 4222 it never asked for.
missing=()
[ -x /usr/sbin/nats-server ] || missing+=(nats-server)
[ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
if [ ${#missing[@]} -gt 0 ]; then
  policy=/usr/sbin/policy-rc.d
  own_policy=
  if [ ! -e "$policy" ]; then
    # Removed however the script ends (an interrupted apt too), not only on the normal path.
    trap 'rm -f "$policy"' EXIT
    printf '#!/bin/sh\n# scripts/test.sh: no service starts while it installs its packages\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    own_policy=1
  fi
  installed=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } || installed=$?
  if [ -n "$own_policy" ]; then
    rm -f "$policy"
    trap - EXIT
  fi
  [ "$installed" -eq 0 ] || exit "$installed"
  for service in "${missing[@]}"; do
    if [ -d /run/systemd/system ]; then
      systemctl disable --now "$service" >/dev/null 2>&1 || true
    elif command -v update-rc.d >/dev/null 2>&1; then
      service "$service" stop >/dev/null 2>&1 || true
      update-rc.d "$service" disable >/dev/null 2>&1 || true
    fi
  done
fi

# Operator-side checkers (issue 14): promtool, chromium (Debian), openapi-spec-validator and
# schemathesis (PyPI, in a venv under target/tools/venv); skipped quickly when already present.
bash scripts/operator-tools.sh

# Local brokers some tests talk to: RabbitMQ for tests/amqp_rabbitmq.rs, Redis and socat for
# tests/cluster*.rs. Started before the tests; if they cannot be, nothing runs (under CI=1 a
# test whose broker is missing fails rather than skips).
if ! bash scripts/services.sh; then
  echo "test.sh: scripts/services.sh could not start RabbitMQ or Redis; the tests were not run" >&2
  exit 1
fi

# Unit and integration tests (each integration test drives the real binary over sockets).
# Output is also kept in a log so the closing line can add up every runner's count.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# --no-fail-fast: a failing test binary does not hide the results of the others.
status=0
cargo test --workspace --lib --bins --tests --no-fail-fast -- --test-threads="${TEST_THREADS:-4}" 2>&1 | tee "$log" || status=$?
# Benchmarks in test mode: each one runs once, so they cannot rot.
cargo test --workspace --benches 2>&1 | tee -a "$log" || status=$?
# One closing line over all test binaries: "N passed, N failed".
awk '/^test result:/ { passed += $4; failed += $6 } END { printf "%d passed, %d failed\n", passed, failed }' "$log"
exit "$status"
