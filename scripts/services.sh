#!/usr/bin/env bash
# Local services the tests talk to, started if they are not running (idempotent):
# - RabbitMQ on 127.0.0.1:5672 (guest/guest) with AMQP 1.0 (tests/amqp_rabbitmq.rs).
# - Redis: redis-server installed; tests/cluster.rs starts its own on free ports (and
#   kills and restarts them; socat puts TLS in front of one); one is also started on
#   127.0.0.1:6379 for trying by hand.
# - A Redis Cluster of 3 masters on 127.0.0.1:7000-7002 (conf in /tmp/hubcast-cluster/), for
#   trying `--redis-cluster-nodes` by hand and the benchmark; tests/cluster.rs starts its own
#   clusters on free ports (tests/common/redis.rs, `RedisCluster`). Needs Redis 7 (sharded
#   pub/sub).
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

CLUSTER_DIR=/tmp/hubcast-cluster
CLUSTER_PORTS=(7000 7001 7002)

cluster_state_ok() { redis-cli -p "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }

ensure_redis_cluster() {
  local version major
  version=$(redis-server --version | sed -E 's/.* v=([0-9.]+).*/\1/')
  major=${version%%.*}
  if ! [[ "$major" =~ ^[0-9]+$ ]] || (( major < 7 )); then
    log "redis-server $version is older than 7 (no sharded pub/sub): not starting the Redis Cluster"
    return 1
  fi
  mkdir -p "$CLUSTER_DIR"
  local p
  for p in "${CLUSTER_PORTS[@]}"; do
    if ! redis-cli -p "$p" ping >/dev/null 2>&1; then
      log "starting cluster node on 127.0.0.1:$p"
      redis-server --bind 127.0.0.1 --port "$p" --cluster-enabled yes \
        --cluster-config-file "$CLUSTER_DIR/nodes-$p.conf" --cluster-node-timeout 1000 \
        --save '' --appendonly no --dir "$CLUSTER_DIR" --logfile "$CLUSTER_DIR/redis-$p.log" \
        --daemonize yes >/dev/null
    fi
  done
  for p in "${CLUSTER_PORTS[@]}"; do
    for _ in $(seq 1 40); do
      redis-cli -p "$p" ping >/dev/null 2>&1 && break
      sleep 0.25
    done
    if ! redis-cli -p "$p" ping >/dev/null 2>&1; then
      log "cluster node 127.0.0.1:$p does not answer (see $CLUSTER_DIR/redis-$p.log)"
      return 1
    fi
  done
  # Nodes restarted with their conf files come back as the same cluster: created only once.
  if ! cluster_state_ok "${CLUSTER_PORTS[0]}"; then
    local known
    known=$(redis-cli -p "${CLUSTER_PORTS[0]}" cluster info | tr -d '\r' | sed -n 's/^cluster_known_nodes://p')
    if [[ "$known" == 1 ]]; then
      log "creating the Redis Cluster (3 masters, no replicas)"
      local addrs=()
      for p in "${CLUSTER_PORTS[@]}"; do addrs+=("127.0.0.1:$p"); done
      redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
    fi
  fi
  for p in "${CLUSTER_PORTS[@]}"; do
    for _ in $(seq 1 80); do
      cluster_state_ok "$p" && break
      sleep 0.25
    done
    if ! cluster_state_ok "$p"; then
      log "the Redis Cluster is not ok on 127.0.0.1:$p (to start afresh: stop its nodes, remove $CLUSTER_DIR)"
      return 1
    fi
  done
  log "Redis Cluster $version ready: redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002"
}

ensure_rabbitmq
ensure_redis
ensure_redis_cluster
