#!/usr/bin/env bash
# Local services the tests talk to, started if they are not running (idempotent):
# - RabbitMQ on 127.0.0.1:5672 (guest/guest) with AMQP 1.0 (tests/amqp_rabbitmq.rs).
# - Redis: redis-server installed; tests/cluster.rs starts its own on free ports (and
#   kills and restarts them; socat puts TLS in front of one); one is also started on
#   127.0.0.1:6379 for trying by hand.
# Called by scripts/test.sh; safe to run by hand.
set -euo pipefail

log() { echo "services: $*" >&2; }

ensure_rabbitmq() {
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    log "installing rabbitmq-server"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
  fi
  if ! timeout 30 rabbitmqctl -q status >/dev/null 2>&1; then
    log "starting RabbitMQ"
    rabbitmq-server -detached
  fi
  timeout 90 rabbitmqctl -q await_startup
  # RabbitMQ 3.x serves AMQP 1.0 through a plugin; in 4.x it is built in.
  local version
  version=$(timeout 30 rabbitmqctl -q version 2>/dev/null || echo unknown)
  if [[ "$version" == 3.* ]]; then
    if ! timeout 30 rabbitmq-plugins -q list -e rabbitmq_amqp1_0 2>/dev/null | grep -q 'rabbitmq_amqp1_0'; then
      log "enabling rabbitmq_amqp1_0 (RabbitMQ $version)"
      timeout 60 rabbitmq-plugins -q enable rabbitmq_amqp1_0 >/dev/null
    fi
  fi
  for _ in $(seq 1 60); do
    if (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
      log "RabbitMQ $version ready on 127.0.0.1:5672 (AMQP 1.0)"
      return 0
    fi
    sleep 0.5
  done
  log "RabbitMQ is not listening on 127.0.0.1:5672"
  return 1
}

ensure_redis() {
  if ! command -v redis-server >/dev/null 2>&1 || ! command -v socat >/dev/null 2>&1; then
    # socat puts TLS in front of a test redis-server (tests/cluster.rs: rediss://).
    log "installing redis-server and socat"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server socat >/dev/null
  fi
  if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    log "starting redis-server on 127.0.0.1:6379"
    redis-server --bind 127.0.0.1 --port 6379 --daemonize yes --save '' --appendonly no >/dev/null
  fi
  for _ in $(seq 1 40); do
    if (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
      log "$(redis-server --version | cut -d' ' -f1-3) ready on 127.0.0.1:6379"
      return 0
    fi
    sleep 0.25
  done
  log "Redis is not listening on 127.0.0.1:6379"
  return 1
}

ensure_rabbitmq
ensure_redis
