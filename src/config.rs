//! Configuration: command-line flags and environment variables.
//!
//! Every deployment parameter of ux4iot is accepted under its SPEC name as a flag
//! (`--connectionStateCacheTTL`), in kebab case (`--connection-state-cache-ttl`) and as an
//! environment variable in SCREAMING_SNAKE form (`CONNECTION_STATE_CACHE_TTL`) or in its
//! original camelCase spelling (`connectionStateCacheTTL`, as Azure deployments set it).
//! Older names (`throttlingParameter`, `customTimestampProperty`) are aliases.
//! An invalid value stops start-up with clap's message, which names the parameter.

use std::net::IpAddr;

use clap::Parser;

use crate::connection_string::{EventHubConnection, ServiceConnection};

/// Longest accepted device id, in bytes (IoT Hub's own limit is 128 characters).
pub const MAX_DEVICE_ID_LEN: usize = 128;
/// Longest accepted telemetry key or direct method name, in bytes.
pub const MAX_KEY_LEN: usize = 256;
/// Longest accepted request head (request line plus headers), in bytes.
pub const MAX_REQUEST_HEAD_BYTES: usize = 16 * 1024;
/// Upper bound of flags in seconds (one year): larger values are refused at start, so no
/// deadline computed from them can overflow.
pub const MAX_SECONDS: i64 = 31_536_000;
/// Upper bound of flags in milliseconds (one day).
pub const MAX_MILLIS: i64 = 86_400_000;

#[derive(Parser, Debug, Clone)]
#[command(name = "hubcast", version, about = "Live device data gateway (ux4iot-compatible)")]
pub struct Config {
    /// Address to listen on.
    #[arg(long, env = "BIND", default_value = "0.0.0.0")]
    pub bind: IpAddr,

    /// TCP port to listen on (0 = pick a free port; the chosen one is printed).
    #[arg(long, env = "PORT", default_value_t = 8080)]
    pub port: u16,

    /// Number of cores (runtimes) to run; default: all available cores.
    #[arg(long, env = "CORES", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub cores: Option<u16>,

    /// I/O driver: `auto` (io_uring, falling back to epoll), `uring` or `epoll`.
    #[arg(long, env = "IO_DRIVER", default_value = "auto", value_parser = ["auto", "uring", "epoll"])]
    pub io_driver: String,

    /// Run a built-in fleet of N simulated devices (no Azure account needed).
    #[arg(long, env = "SIMULATE", default_value_t = 0)]
    pub simulate: u32,

    /// Primary admin secret (the Shared-Access-Key). Generated at start when neither secret is set.
    #[arg(long = "primary-admin-secret", visible_alias = "primaryAdminSecret", env = "PRIMARY_ADMIN_SECRET")]
    pub primary_admin_secret: Option<String>,

    /// Secondary admin secret; accepted like the primary one.
    #[arg(long = "secondary-admin-secret", visible_alias = "secondaryAdminSecret", env = "SECONDARY_ADMIN_SECRET")]
    pub secondary_admin_secret: Option<String>,

    /// Public base URL printed in the admin connection string (default: http://<bind>:<port>).
    #[arg(long = "public-url", env = "PUBLIC_URL")]
    pub public_url: Option<String>,

    /// Log level: error, warn, info, verbose or debug. Changeable at runtime with PUT /logLevel/:level.
    #[arg(long = "log-level", visible_alias = "logLevel", env = "LOG_LEVEL", default_value = "info",
          value_parser = ["error", "warn", "info", "verbose", "debug"])]
    pub log_level: String,

    /// Event Hub (or IoT Hub built-in endpoint) connection string for device messages.
    #[arg(long = "iot-hub-event-hub-connection-string", visible_alias = "iotHubEventHubConnectionString",
          env = "IOT_HUB_EVENT_HUB_CONNECTION_STRING")]
    pub iot_hub_event_hub_connection_string: Option<String>,

    /// Consumer group of the event stream.
    #[arg(long = "event-hub-consumer-group", visible_alias = "eventHubConsumerGroup",
          env = "EVENT_HUB_CONSUMER_GROUP", default_value = "$Default")]
    pub event_hub_consumer_group: String,

    /// Where each partition is read from the first time: `latest` (messages enqueued from now
    /// on), `earliest` (everything the hub retains) or an ISO 8601 time (messages enqueued after it).
    #[arg(long = "event-hub-start-position", env = "EVENT_HUB_START_POSITION", default_value = "latest",
          value_parser = StartPosition::parse)]
    pub event_hub_start_position: StartPosition,

    /// Authentication to the event stream: `auto` (CBS over TLS, SASL PLAIN on amqp://),
    /// `cbs` (SAS token on $cbs, renewed) or `plain` (SASL PLAIN with key name and key).
    #[arg(long = "event-hub-auth", env = "EVENT_HUB_AUTH", default_value = "auto",
          value_parser = ["auto", "cbs", "plain"])]
    pub event_hub_auth: String,

    /// Lifetime in seconds of the SAS tokens put on $cbs (renewed before they expire).
    #[arg(long = "event-hub-token-ttl", env = "EVENT_HUB_TOKEN_TTL", default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(2..=86_400))]
    pub event_hub_token_ttl: u64,

    /// Link credit per partition: the most messages received and not yet taken by the cores.
    #[arg(long = "event-hub-prefetch", env = "EVENT_HUB_PREFETCH", default_value_t = 300,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub event_hub_prefetch: u32,

    /// Bytes of event stream messages waiting for each core (besides 64 batches); past it
    /// the source waits and grants no more link credit (app/ingress.rs).
    #[arg(long = "event-hub-queue-bytes", env = "EVENT_HUB_QUEUE_BYTES", default_value_t = 32 << 20,
          value_parser = clap::value_parser!(u64).range(65_536..=u32::MAX as u64))]
    pub event_hub_queue_bytes: u64,

    /// While a partition's stream is busy, hand its messages to the cores at most once per
    /// this many milliseconds (fewer, larger hand-offs); a quiet stream hands over at once. 0: always at once.
    #[arg(long = "event-hub-linger-ms", env = "EVENT_HUB_LINGER_MS", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(0..=1_000))]
    pub event_hub_linger_ms: u64,

    /// Serve the receivers' links from the wire under fe2o3 (src/amqp/tap.rs): messages' bytes
    /// go straight to the partitions, the tap settles and grants credit. false: fe2o3 receives and decodes all.
    #[arg(long = "event-hub-read-raw", env = "EVENT_HUB_READ_RAW", default_value_t = true,
          action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub event_hub_read_raw: bool,

    /// PEM file of extra root certificates trusted for amqps (besides the public web roots).
    #[arg(long = "event-hub-ca-file", env = "EVENT_HUB_CA_FILE")]
    pub event_hub_ca_file: Option<std::path::PathBuf>,

    /// Largest device message body read from the event stream, in bytes (larger: counted, skipped).
    #[arg(long = "max-message-bytes", visible_alias = "maxMessageBytes", env = "MAX_MESSAGE_BYTES",
          default_value_t = 1024 * 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_message_bytes: u64,

    /// IoT Hub service connection string (enables twin reads, direct methods, desired properties).
    #[arg(long = "iot-hub-service-connection-string", visible_alias = "iotHubServiceConnectionString",
          env = "IOT_HUB_SERVICE_CONNECTION_STRING")]
    pub iot_hub_service_connection_string: Option<String>,

    /// Minimum milliseconds between telemetry pushes per session and device (-1 = off).
    #[arg(long = "throttling-interval", visible_aliases = ["throttlingInterval", "throttlingParameter", "throttling-parameter"],
          env = "THROTTLING_INTERVAL", default_value_t = -1, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..=MAX_MILLIS))]
    pub throttling_interval: i64,

    /// Seconds a connection state stays valid without news from the device (0 or -1 = forever).
    #[arg(long = "connection-state-cache-ttl", visible_alias = "connectionStateCacheTTL",
          env = "CONNECTION_STATE_CACHE_TTL", default_value_t = 60, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..=MAX_SECONDS))]
    pub connection_state_cache_ttl: i64,

    /// Seconds a device twin read from the hub is cached (-1 = no cache, 0 = forever).
    #[arg(long = "device-twin-cache-ttl", visible_alias = "deviceTwinCacheTTL",
          env = "DEVICE_TWIN_CACHE_TTL", default_value_t = -1, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..=MAX_SECONDS))]
    pub device_twin_cache_ttl: i64,

    /// Body key holding the message timestamp.
    #[arg(long = "custom-timestamp-key", visible_aliases = ["customTimestampKey", "customTimestampProperty", "custom-timestamp-property"],
          env = "CUSTOM_TIMESTAMP_KEY", default_value = "_ts")]
    pub custom_timestamp_key: String,

    /// Body key holding the device id (plain Event Hub input).
    #[arg(long = "custom-device-id-key", visible_alias = "customDeviceIdKey",
          env = "CUSTOM_DEVICE_ID_KEY", default_value = "deviceId")]
    pub custom_device_id_key: String,

    /// Body key holding a boolean connection state (empty = not used).
    #[arg(long = "custom-connection-state-key", visible_alias = "customConnectionStateKey",
          env = "CUSTOM_CONNECTION_STATE_KEY", default_value = "")]
    pub custom_connection_state_key: String,

    /// Publish "connected" whenever telemetry arrives.
    #[arg(long = "connection-state-on-telemetry", visible_alias = "connectionStateOnTelemetry",
          env = "CONNECTION_STATE_ON_TELEMETRY", default_value_t = true, action = clap::ArgAction::Set)]
    pub connection_state_on_telemetry: bool,

    /// Seconds a session without activity (no request, no open socket) is kept.
    #[arg(long = "session-grace-period", visible_alias = "sessionGracePeriod",
          env = "SESSION_GRACE_PERIOD", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS as u64))]
    pub session_grace_period: u64,

    /// Largest accepted request body in bytes (larger: 413).
    #[arg(long = "max-body-bytes", visible_alias = "maxBodyBytes", env = "MAX_BODY_BYTES",
          default_value_t = 1024 * 1024, value_parser = clap::value_parser!(u64).range(64..))]
    pub max_body_bytes: u64,

    /// Most simultaneous client connections, HTTP and live sockets, in the whole process.
    #[arg(long = "max-connections", visible_alias = "maxConnections", env = "MAX_CONNECTIONS",
          default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,

    /// Most live sessions in the whole process.
    #[arg(long = "max-sessions", visible_alias = "maxSessions", env = "MAX_SESSIONS",
          default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_sessions: u64,

    /// Open files kept back from client connections for the process's own use (store logs
    /// and snapshots, Redis, the IoT Hub client, TLS reloads, a health check over the cap):
    /// client connections are capped at the open-file limit minus this, or at
    /// --max-connections if lower.
    #[arg(long = "fd-reserve", env = "FD_RESERVE", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(32..))]
    pub fd_reserve: u64,

    /// New sessions and live-socket handshakes (`POST /session`, Engine.IO and WebSocket
    /// handshakes, none of which need a key) allowed per second per client address, shared
    /// out over the cores (a fraction is allowed: 0.5 is one every two seconds); 0 turns the
    /// limit off. Beyond it: 429 with Retry-After.
    #[arg(long = "client-rate", env = "CLIENT_RATE", default_value_t = 50.0, value_parser = parse_rate)]
    pub client_rate: f64,

    /// How many of those a client address may make at once before the rate applies (the
    /// token bucket's size), shared out over the cores.
    #[arg(long = "client-burst", env = "CLIENT_BURST", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub client_burst: u64,

    /// Proxies whose `X-Forwarded-For` names the client (addresses or CIDRs, comma-separated);
    /// from any other peer the header is ignored and the TCP peer is the client.
    #[arg(long = "trusted-proxies", env = "TRUSTED_PROXIES", value_delimiter = ',', value_parser = parse_proxy)]
    pub trusted_proxies: Vec<TrustedProxy>,

    /// Seconds a session that never got a grant nor a socket is kept without activity (at
    /// most --session-grace-period), so unused sessions cannot pile up to --max-sessions.
    #[arg(long = "unused-session-ttl", env = "UNUSED_SESSION_TTL", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS as u64))]
    pub unused_session_ttl: u64,

    /// Milliseconds between server pings on live sockets (Engine.IO `pingInterval`).
    #[arg(long = "ping-interval", visible_alias = "pingInterval", env = "PING_INTERVAL",
          default_value_t = 25_000, value_parser = clap::value_parser!(u64).range(100..=MAX_MILLIS as u64))]
    pub ping_interval: u64,

    /// Milliseconds a client has to answer a ping before its socket is closed.
    #[arg(long = "ping-timeout", visible_alias = "pingTimeout", env = "PING_TIMEOUT",
          default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=MAX_MILLIS as u64))]
    pub ping_timeout: u64,

    /// Messages waiting on one socket beyond which its telemetry is conflated (newest per device).
    #[arg(long = "socket-queue-soft-limit", env = "SOCKET_QUEUE_SOFT_LIMIT", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub socket_queue_soft_limit: u64,

    /// Messages waiting on one socket beyond which it is closed as a slow consumer.
    #[arg(long = "socket-queue-hard-limit", env = "SOCKET_QUEUE_HARD_LIMIT", default_value_t = 8192,
          value_parser = clap::value_parser!(u64).range(2..))]
    pub socket_queue_hard_limit: u64,

    /// Bytes waiting on one socket beyond which its telemetry is conflated (newest per device).
    #[arg(long = "socket-queue-soft-bytes", env = "SOCKET_QUEUE_SOFT_BYTES", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 40))]
    pub socket_queue_soft_bytes: u64,

    /// Bytes waiting on one socket beyond which it is closed as a slow consumer (one frame
    /// larger than this may still wait alone).
    #[arg(long = "socket-queue-hard-bytes", env = "SOCKET_QUEUE_HARD_BYTES", default_value_t = 8 << 20,
          value_parser = clap::value_parser!(u64).range(2048..=1 << 40))]
    pub socket_queue_hard_bytes: u64,

    /// Microseconds a busy socket's write may be held back so it carries more frames, only
    /// while its core is saturated (src/push/linger.rs); `0`: never held.
    #[arg(long = "socket-linger-us", env = "SOCKET_LINGER_US", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub socket_linger_us: u64,

    /// Seconds a Socket.IO client that lost its connection may come back with its pid and
    /// offset and get every event it missed (connection state recovery; Socket.IO's
    /// `maxDisconnectionDuration`). 0: off (no pid, no offsets: today's bytes).
    #[arg(long = "recovery-window", env = "RECOVERY_WINDOW", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub recovery_window: u64,

    /// Bytes of recovery history kept per session (frame + 40 each); also the most one replay sends.
    #[arg(long = "recovery-session-bytes", env = "RECOVERY_SESSION_BYTES", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 40))]
    pub recovery_session_bytes: u64,

    /// Bytes of recovery history kept per core, all sessions together; beyond, the largest
    /// histories are trimmed first (their clients then come back with `recovered` false).
    #[arg(long = "recovery-core-bytes", env = "RECOVERY_CORE_BYTES", default_value_t = 64 << 20,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 40))]
    pub recovery_core_bytes: u64,

    /// With `--data-dir`: write every frame appended to a recovery history to the store before
    /// it reaches a socket, so a `kill -9` and a restart on the same data dir replay what was
    /// committed (false: only a graceful shutdown keeps the histories).
    #[arg(long = "recovery-durable", env = "RECOVERY_DURABLE", default_value_t = true,
          action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub recovery_durable: bool,

    /// With `--redis-url`: on SIGTERM, hand each away client's recovery history to another
    /// live instance (adoption, docs/design/recovery.md step 6), so a client that reconnects
    /// there recovers. Unset: on with `--data-dir none`, off with a data dir (the histories
    /// then wait in it for a restart on the same data dir, step 5).
    #[arg(long = "recovery-handoff", env = "RECOVERY_HANDOFF",
          action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub recovery_handoff: Option<bool>,

    /// With `--recovery-handoff`: seconds a SIGTERM waits for the adopters' verdicts on the
    /// histories it handed over (within `--shutdown-timeout`, less the leases'
    /// 3 s); an adopter waits a second more (by its own setting: the same on every instance)
    /// for its verdict before voiding the history. Raise it where adopters are slow to
    /// subscribe (a loaded or paused instance).
    #[arg(long = "recovery-handoff-wait", env = "RECOVERY_HANDOFF_WAIT", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..=300))]
    pub recovery_handoff_wait: u64,

    /// Items (deliveries, device messages, operations) one core's cross-core inbox holds; beyond,
    /// senders keep a backlog, conflate telemetry and slow their sources down.
    #[arg(long = "mesh-inbox-messages", env = "MESH_INBOX_MESSAGES", default_value_t = 65_536,
          value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    pub mesh_inbox_messages: u64,

    /// Bytes one core's cross-core inbox holds (an estimate of what its items carry).
    #[arg(long = "mesh-inbox-bytes", env = "MESH_INBOX_BYTES", default_value_t = 64 << 20,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 40))]
    pub mesh_inbox_bytes: u64,

    /// Serve GET /metrics without the admin key (for a Prometheus scraper inside a private network).
    #[arg(long = "metrics-open", env = "METRICS_OPEN", default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub metrics_open: bool,

    /// ux4iot deployment-template parameters that only shape the Azure infrastructure. Accepted
    /// (and validated) so the same parameter set can be passed; they change nothing here.
    #[arg(long = "sku", env = "SKU", value_parser = ["small", "standard"], hide = true)]
    pub sku: Option<String>,
    #[arg(long = "server-version", visible_alias = "serverVersion", env = "SERVER_VERSION", hide = true)]
    pub server_version: Option<String>,
    #[arg(long = "redis-version", visible_alias = "redisVersion", env = "REDIS_VERSION", hide = true)]
    pub redis_version: Option<String>,
    #[arg(long = "log-analytics-traces-table-tier", visible_alias = "logAnalyticsTracesTableTier",
          env = "LOG_ANALYTICS_TRACES_TABLE_TIER", value_parser = ["Basic", "Analytics"], hide = true)]
    pub log_analytics_traces_table_tier: Option<String>,

    /// Test-only timing overrides, in milliseconds (hidden from --help): they let the test suite
    /// wait a fraction of a second where the documented flags count whole seconds or the
    /// duration is fixed. Each one, when given, replaces the documented setting.
    #[arg(long = "connection-state-cache-ttl-ms", env = "CONNECTION_STATE_CACHE_TTL_MS", hide = true,
          value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub connection_state_cache_ttl_ms: Option<u64>,
    #[arg(long = "session-grace-period-ms", env = "SESSION_GRACE_PERIOD_MS", hide = true,
          value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub session_grace_period_ms: Option<u64>,
    #[arg(long = "device-twin-cache-ttl-ms", env = "DEVICE_TWIN_CACHE_TTL_MS", hide = true,
          value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub device_twin_cache_ttl_ms: Option<u64>,
    /// Added to a direct method's device timeouts for the hub's own answer (default 5 s).
    #[arg(long = "iot-hub-method-timeout-margin-ms", env = "IOT_HUB_METHOD_TIMEOUT_MARGIN_MS", hide = true,
          default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub iot_hub_method_timeout_margin_ms: u64,
    /// How often the event stream's partition lag is measured (default 5 s).
    #[arg(long = "amqp-lag-interval-ms", env = "AMQP_LAG_INTERVAL_MS", hide = true,
          default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub amqp_lag_interval_ms: u64,

    /// Seconds an idle keep-alive HTTP connection stays open.
    #[arg(long = "http-idle-timeout", visible_alias = "httpIdleTimeout", env = "HTTP_IDLE_TIMEOUT",
          default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub http_idle_timeout: u64,

    /// Base URL of the IoT Hub service API (default: https://<HostName of the service connection
    /// string>). For a proxy or a local test double; the SAS token stays scoped to HostName.
    #[arg(long = "iot-hub-service-url", env = "IOT_HUB_SERVICE_URL")]
    pub iot_hub_service_url: Option<String>,

    /// Allow a plain `http://` --iot-hub-service-url (local test doubles only: it sends the SAS token in clear).
    #[arg(long = "iot-hub-allow-insecure-http", env = "IOT_HUB_ALLOW_INSECURE_HTTP", default_value_t = false,
          action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub iot_hub_allow_insecure_http: bool,

    /// Most IoT Hub requests in flight at once (and open connections to the hub).
    #[arg(long = "iot-hub-max-concurrency", env = "IOT_HUB_MAX_CONCURRENCY", default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub iot_hub_max_concurrency: u64,

    /// Most IoT Hub requests waiting for a free slot; beyond: 503 "IoT Hub client busy".
    #[arg(long = "iot-hub-queue-size", env = "IOT_HUB_QUEUE_SIZE", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub iot_hub_queue_size: u64,

    /// Seconds a twin read or desired-property patch may take, queueing included (then 504).
    #[arg(long = "iot-hub-timeout", env = "IOT_HUB_TIMEOUT", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=600))]
    pub iot_hub_timeout: u64,

    /// Advanced: lifetime in seconds of the SAS tokens signed for the IoT Hub (renewed when a quarter is left).
    #[arg(long = "iot-hub-sas-token-lifetime", env = "IOT_HUB_SAS_TOKEN_LIFETIME", default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(2..=31_536_000))]
    pub iot_hub_sas_token_lifetime: u64,

    /// Seconds a graceful shutdown (SIGTERM/SIGINT) may take; past it the process exits anyway
    /// with status 1. A second signal exits at once.
    #[arg(long = "shutdown-timeout", env = "SHUTDOWN_TIMEOUT", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub shutdown_timeout: u64,

    /// Log line format on stderr: `text` (human) or `json` (one object per line: time, level,
    /// target, message, fields).
    #[arg(long = "log-format", env = "LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,

    /// TLS certificate chain (PEM, leaf first): with --tls-key the port serves HTTPS and WSS.
    /// Reloaded on SIGHUP and when the file changes.
    #[arg(long = "tls-cert", env = "TLS_CERT", value_name = "PEM_FILE")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// Private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long = "tls-key", env = "TLS_KEY", value_name = "PEM_FILE")]
    pub tls_key: Option<std::path::PathBuf>,

    /// Directory of the durable state (last values, twins, connection states, sessions, AMQP
    /// positions); `none`: memory only, nothing survives a restart. One hubcast per directory.
    #[arg(long = "data-dir", env = "DATA_DIR", default_value = "./hubcast-data",
          value_parser = DataDir::parse)]
    pub data_dir: DataDir,

    /// Milliseconds between syncs of the durable state to disk (0: sync every commit). A commit
    /// survives a crash of the process at once, and a power loss after at most this long.
    #[arg(long = "fsync-interval", env = "FSYNC_INTERVAL", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub fsync_interval: u64,

    /// Bytes a core's store log grows to (and past twice its last snapshot) before the core
    /// writes a snapshot of its state, which replaces the log: bounds the log a start replays.
    #[arg(long = "snapshot-log-bytes", env = "SNAPSHOT_LOG_BYTES", default_value_t = 64 << 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub snapshot_log_bytes: u64,

    /// Start even when a store file is damaged (a checksum mismatch in a snapshot or inside a
    /// log, a cut-off snapshot, a bad manifest, a file the manifest names missing): each damaged
    /// file is renamed aside (`<name>.damaged-<time>`), what is valid is loaded and the loss is
    /// logged and counted in /metrics. Without it such a start stops, naming the file and offset.
    /// A log whose last commit was cut by a crash is loaded either way.
    #[arg(long = "store-start-damaged", env = "STORE_START_DAMAGED", default_value_t = false,
          action = clap::ArgAction::SetTrue, value_parser = clap::builder::BoolishValueParser::new())]
    pub store_start_damaged: bool,

    /// Devices a core writes into a snapshot per turn of its event loop before it serves
    /// what waits (bounds the pause a snapshot adds to live delivery).
    #[arg(long = "snapshot-slice-devices", env = "SNAPSHOT_SLICE_DEVICES", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub snapshot_slice_devices: u64,

    /// Redis (6 or newer, or Valkey) shared by several hubcast instances behind one load
    /// balancer: `redis://[:PASSWORD@]HOST[:PORT][/DB]`, `rediss://` for TLS. Unset: one instance.
    #[arg(long = "redis-url", env = "REDIS_URL", value_parser = parse_redis_url)]
    pub redis_url: Option<String>,

    /// A Redis Cluster (Redis 7 or newer) instead of one Redis: some of its nodes as seeds,
    /// comma-separated (`redis://[:PASSWORD@]HOST:PORT,…`, all `redis://` or all `rediss://`);
    /// the others are discovered. Not together with `--redis-url`.
    #[arg(long = "redis-cluster-nodes", env = "REDIS_CLUSTER_NODES", value_parser = parse_redis_seeds)]
    pub redis_cluster_nodes: Option<RedisSeeds>,

    /// Prefix of every Redis key and channel, so several deployments share one Redis.
    #[arg(long = "redis-prefix", env = "REDIS_PREFIX", default_value = "hubcast",
          value_parser = parse_redis_prefix)]
    pub redis_prefix: String,

    /// This instance's name among the instances on one Redis (`/status`, `/metrics`);
    /// generated when unset. Two live instances must not share one.
    #[arg(long = "instance-id", env = "INSTANCE_ID", value_parser = parse_redis_prefix)]
    pub instance_id: Option<String>,

    /// PEM file of the root certificates trusted for a `rediss://` Redis (instead of the
    /// public web roots): a private CA, or a managed Redis's own.
    #[arg(long = "redis-ca-file", env = "REDIS_CA_FILE")]
    pub redis_ca_file: Option<std::path::PathBuf>,

    /// Seconds an instance's partition leases (and its presence) last in Redis without being
    /// renewed: after a crash the others take its partitions over within this, plus a heartbeat.
    #[arg(long = "lease-ttl", env = "LEASE_TTL", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=300))]
    pub lease_ttl: u64,

    /// Bytes received from Redis (other instances' device messages and changes) that the cores
    /// have not taken yet; past it the link drops its subscriber and reconnects, as after an
    /// outage (Redis's own `client-output-buffer-limit` for pub/sub does the same).
    #[arg(long = "redis-inbound-bytes", env = "REDIS_INBOUND_BYTES", default_value_t = 64 << 20,
          value_parser = clap::value_parser!(u64).range(65_536..=1 << 40))]
    pub redis_inbound_bytes: u64,

    /// Bytes of the commands (device messages to publish, session changes, reads) waiting for
    /// the Redis thread, besides their count (1,024); past it a publication is dropped and a
    /// change answers 503, as when the queue is full (never waits; cluster/queue.rs).
    #[arg(long = "redis-command-bytes", env = "REDIS_COMMAND_BYTES", default_value_t = 64 << 20,
          value_parser = clap::value_parser!(u64).range(65_536..=1 << 40))]
    pub redis_command_bytes: u64,
}

fn parse_redis_url(s: &str) -> Result<String, String> {
    if s.starts_with("redis://") || s.starts_with("rediss://") || s.starts_with("valkey://") || s.starts_with("valkeys://") {
        Ok(s.to_string())
    } else {
        Err("expected a URL starting with redis:// or rediss:// (TLS)".into())
    }
}

/// `--redis-cluster-nodes`: the seed URLs, each as `--redis-url` accepts it, one scheme.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSeeds(pub Vec<String>);

fn parse_redis_seeds(s: &str) -> Result<RedisSeeds, String> {
    let seeds: Vec<String> = s.split(',').map(str::trim).map(str::to_string).collect();
    if seeds.iter().any(String::is_empty) {
        return Err("expected comma-separated URLs (redis://host:port,redis://host:port), found an empty one".into());
    }
    for seed in &seeds {
        parse_redis_url(seed).map_err(|e| format!("{seed:?}: {e}"))?;
    }
    let tls = |u: &str| u.starts_with("rediss://") || u.starts_with("valkeys://");
    if seeds.iter().any(|u| tls(u)) && !seeds.iter().all(|u| tls(u)) {
        return Err("the seeds mix TLS (rediss://) and plain (redis://) URLs: one cluster speaks one".into());
    }
    Ok(RedisSeeds(seeds))
}

/// Prefixes and instance ids: 1–64 of `A-Z a-z 0-9 - _ .` (they are parts of Redis keys).
fn parse_redis_prefix(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(s.to_string())
    } else {
        Err("expected 1 to 64 of A-Z, a-z, 0-9, '-', '_', '.'".into())
    }
}

/// A proxy named by `--trusted-proxies`: an address, or a network in CIDR form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrustedProxy {
    pub net: IpAddr,
    pub prefix: u8,
}

impl TrustedProxy {
    pub fn contains(&self, ip: IpAddr) -> bool {
        fn masked(bytes: &[u8], prefix: u8) -> impl Iterator<Item = u8> + '_ {
            bytes.iter().enumerate().map(move |(i, b)| {
                let bits = (prefix as usize).saturating_sub(i * 8).min(8) as u32;
                b & (0xffu16 << (8 - bits)) as u8
            })
        }
        let ip = match (self.net, ip) {
            (IpAddr::V6(_), IpAddr::V4(v4)) => IpAddr::V6(v4.to_ipv6_mapped()),
            (IpAddr::V4(_), IpAddr::V6(v6)) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            _ => ip,
        };
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => masked(&n.octets(), self.prefix).eq(masked(&a.octets(), self.prefix)),
            (IpAddr::V6(n), IpAddr::V6(a)) => masked(&n.octets(), self.prefix).eq(masked(&a.octets(), self.prefix)),
            _ => false,
        }
    }
}

/// A rate per second: finite, not negative.
fn parse_rate(s: &str) -> Result<f64, String> {
    s.trim().parse::<f64>().ok().filter(|r| r.is_finite() && *r >= 0.0).ok_or_else(|| format!("{s:?} is not a rate per second (a number, 0 or more)"))
}

/// `10.0.0.1`, `10.0.0.0/8`, `::1`, `fd00::/8`.
fn parse_proxy(s: &str) -> Result<TrustedProxy, String> {
    let s = s.trim();
    let (addr, prefix) = s.split_once('/').map_or((s, None), |(a, p)| (a, Some(p)));
    let net: IpAddr = addr.parse().map_err(|_| format!("{s:?} is not an IP address or a CIDR (10.0.0.0/8, fd00::/8)"))?;
    let max = if net.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix {
        None => max,
        Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {max}"))?,
    };
    Ok(TrustedProxy { net, prefix })
}

/// The parts of the configuration derived once at start-up.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: Config,
    pub cores: usize,
    pub admin_secrets: Vec<String>,
    /// `Err(message)` when the connection string was given but malformed: reported by GET /status.
    pub event_hub: Option<Result<EventHubConnection, String>>,
    pub service: Option<Result<ServiceConnection, String>>,
}

impl Settings {
    pub fn iot_hub_api_enabled(&self) -> bool {
        matches!(self.service, Some(Ok(_)))
    }

    /// How long a twin read from the IoT Hub is served from the cache (`deviceTwinCacheTTL`).
    pub fn twin_cache_ttl(&self) -> TwinCacheTtl {
        if let Some(ms) = self.config.device_twin_cache_ttl_ms {
            return TwinCacheTtl::For(std::time::Duration::from_millis(ms));
        }
        match self.config.device_twin_cache_ttl {
            ttl if ttl < 0 => TwinCacheTtl::Off,
            0 => TwinCacheTtl::Forever,
            secs => TwinCacheTtl::For(std::time::Duration::from_secs(secs as u64)),
        }
    }
}

impl Settings {
    /// How long a connection state stays valid without news (`connectionStateCacheTTL`);
    /// `None`: for ever.
    pub fn connection_state_ttl(&self) -> Option<std::time::Duration> {
        match (self.config.connection_state_cache_ttl_ms, self.config.connection_state_cache_ttl) {
            (Some(ms), _) => Some(std::time::Duration::from_millis(ms)),
            (None, secs) => (secs > 0).then(|| std::time::Duration::from_secs(secs as u64)),
        }
    }

    /// How long a Socket.IO client may be away and still recover (`--recovery-window`);
    /// `None`: recovery is off.
    pub fn recovery_window(&self) -> Option<std::time::Duration> {
        (self.config.recovery_window > 0).then(|| std::time::Duration::from_secs(self.config.recovery_window))
    }

    /// Whether a SIGTERM hands the recovery histories to another instance (`--recovery-handoff`;
    /// unset: only when there is no data dir to keep them for a restart).
    pub fn recovery_handoff(&self) -> bool {
        self.config.recovery_handoff.unwrap_or(matches!(self.config.data_dir, DataDir::Memory))
    }

    /// How long a stopping instance waits for its adopters' verdicts (`--recovery-handoff-wait`).
    pub fn recovery_settle_wait(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.config.recovery_handoff_wait)
    }

    /// How long an adopter waits for the verdict: a second past the stopping side's wait, so
    /// a verdict given at its end still arrives in time.
    pub fn recovery_verdict_wait(&self) -> std::time::Duration {
        self.recovery_settle_wait() + std::time::Duration::from_secs(1)
    }

    /// How long a session without activity is kept (`sessionGracePeriod`).
    pub fn session_grace_period(&self) -> std::time::Duration {
        match self.config.session_grace_period_ms {
            Some(ms) => std::time::Duration::from_millis(ms),
            None => std::time::Duration::from_secs(self.config.session_grace_period),
        }
    }
}

/// Copy camelCase environment variables (`connectionStateCacheTTL`) to the SCREAMING_SNAKE names
/// clap reads, unless the latter is set. Runs before any thread exists.
pub fn normalise_environment() {
    const CAMEL: &[(&str, &str)] = &[
        ("primaryAdminSecret", "PRIMARY_ADMIN_SECRET"),
        ("secondaryAdminSecret", "SECONDARY_ADMIN_SECRET"),
        ("logLevel", "LOG_LEVEL"),
        ("iotHubEventHubConnectionString", "IOT_HUB_EVENT_HUB_CONNECTION_STRING"),
        ("eventHubConsumerGroup", "EVENT_HUB_CONSUMER_GROUP"),
        ("iotHubServiceConnectionString", "IOT_HUB_SERVICE_CONNECTION_STRING"),
        ("throttlingInterval", "THROTTLING_INTERVAL"),
        ("throttlingParameter", "THROTTLING_INTERVAL"),
        ("THROTTLING_PARAMETER", "THROTTLING_INTERVAL"),
        ("connectionStateCacheTTL", "CONNECTION_STATE_CACHE_TTL"),
        ("deviceTwinCacheTTL", "DEVICE_TWIN_CACHE_TTL"),
        ("customTimestampKey", "CUSTOM_TIMESTAMP_KEY"),
        ("customTimestampProperty", "CUSTOM_TIMESTAMP_KEY"),
        ("CUSTOM_TIMESTAMP_PROPERTY", "CUSTOM_TIMESTAMP_KEY"),
        ("customDeviceIdKey", "CUSTOM_DEVICE_ID_KEY"),
        ("customConnectionStateKey", "CUSTOM_CONNECTION_STATE_KEY"),
        ("connectionStateOnTelemetry", "CONNECTION_STATE_ON_TELEMETRY"),
        ("sessionGracePeriod", "SESSION_GRACE_PERIOD"),
        ("maxBodyBytes", "MAX_BODY_BYTES"),
        ("maxMessageBytes", "MAX_MESSAGE_BYTES"),
        ("maxConnections", "MAX_CONNECTIONS"),
        ("maxSessions", "MAX_SESSIONS"),
        ("pingInterval", "PING_INTERVAL"),
        ("pingTimeout", "PING_TIMEOUT"),
        ("sku", "SKU"),
        ("serverVersion", "SERVER_VERSION"),
        ("redisVersion", "REDIS_VERSION"),
        ("logAnalyticsTracesTableTier", "LOG_ANALYTICS_TRACES_TABLE_TIER"),
    ];
    for (camel, screaming) in CAMEL {
        if std::env::var_os(screaming).is_none() {
            if let Some(value) = std::env::var_os(camel) {
                // Safety: called at the top of main, before any other thread is started.
                unsafe { std::env::set_var(screaming, value) };
            }
        }
    }
}

impl Config {
    /// Derive the start-up settings; generates an admin secret when none is configured.
    pub fn settle(self) -> Settings {
        let cores = self
            .cores
            .map(usize::from)
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        let mut admin_secrets: Vec<String> = [&self.primary_admin_secret, &self.secondary_admin_secret]
            .into_iter()
            .flatten()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        if admin_secrets.is_empty() {
            admin_secrets.push(crate::ids::random_token(32));
        }
        let non_empty = |s: &Option<String>| s.as_ref().filter(|s| !s.trim().is_empty()).cloned();
        let event_hub = non_empty(&self.iot_hub_event_hub_connection_string).map(|s| {
            EventHubConnection::parse(&s).map_err(|e| {
                format!("EventHub connection string misformed ({e}). Please check the iotHubEventHubConnectionString environment variable")
            })
        });
        let service = non_empty(&self.iot_hub_service_connection_string).map(|s| {
            ServiceConnection::parse(&s).map_err(|e| {
                format!("IoTHub connection string misformed ({e}). Please check the iotHubServiceConnectionString environment variable")
            })
        });
        Settings { config: self, cores, admin_secrets, event_hub, service }
    }
}

/// Where a partition is read from the first time (later: after the last message received).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartPosition {
    /// Only messages enqueued after hubcast connected.
    Latest,
    /// Everything the hub still retains.
    Earliest,
    /// Messages enqueued after this time.
    EnqueuedAfter(crate::timefmt::Millis),
}

impl StartPosition {
    /// `latest`, `earliest` or an ISO 8601 time (the clap value parser).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "latest" => Ok(Self::Latest),
            "earliest" => Ok(Self::Earliest),
            t => crate::timefmt::parse_iso(t)
                .map(Self::EnqueuedAfter)
                .ok_or_else(|| format!("`{t}` is neither `latest`, `earliest` nor an ISO 8601 time")),
        }
    }
}

/// Where the state lives: `--data-dir`, or nowhere (`--data-dir none`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataDir {
    Memory,
    Dir(std::path::PathBuf),
}

impl DataDir {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "" => Err("empty; give a directory, or `none` for memory only".into()),
            "none" => Ok(Self::Memory),
            dir => Ok(Self::Dir(std::path::PathBuf::from(dir))),
        }
    }
}

/// `deviceTwinCacheTTL`: how long a twin read from the IoT Hub is served from the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TwinCacheTtl {
    /// `-1`: never; every read asks the hub.
    Off,
    /// `0`: the first hub read is kept (and kept current by twin change events).
    Forever,
    For(std::time::Duration),
}
