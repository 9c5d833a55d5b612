//! hubcast: a live device data gateway (ux4iot-compatible).
//!
//! The data path, as the modules are laid out:
//!
//! - [`config`]: flags and environment → [`config::Settings`]; [`connection_string`] parsing.
//! - [`runtime`]: one monoio runtime per core, SO_REUSEPORT listeners, the cross-core
//!   [`runtime::mesh`] and the one routing function ([`runtime::routing`]).
//! - [`ingest`]: the one message type every source feeds, body parsing (raw value spans) on the
//!   owning core, fault counters, and the simulated fleet.
//! - [`amqp`]: the IoT Hub / Event Hubs consumer (fe2o3-amqp on its own tokio thread),
//!   feeding the cores through [`runtime::Ingress`].
//! - [`shard`]: a core's state — devices (last values, twin, connection state, per-session
//!   grants and subscriptions) and sessions.
//! - [`http`]: HTTP/1.1 connections; [`api`]: the REST endpoints of SPEC.md.
//! - [`hub`]: the IoT Hub service REST client (twin, desired properties, direct methods),
//!   on its own thread behind a bounded queue.
//! - [`cluster`]: several instances on Redis (`--redis-url`): shared sessions and grants,
//!   live data across instances.
//! - [`logging`], [`status`]: operations; [`shutdown`]: graceful SIGTERM/SIGINT shutdown;
//!   [`owner`]: one process per port.
//!
//! Modules import only from their own layer or below (`scripts/layers.toml`, checked by
//! `scripts/layers.py` in the test suite; today's exceptions in `scripts/layers-baseline.txt`).

pub mod amqp;
pub mod api;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod connection_string;
pub mod http;
pub mod hub;
pub mod ids;
pub mod ingest;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod owner;
pub mod push;
pub mod runtime;
pub mod sas;
pub mod shard;
pub mod shutdown;
pub mod status;
pub mod store;
pub mod timefmt;
pub mod tls;
pub mod transport;

/// Process-wide services every core can reach; none of them is on the message path.
pub struct Shared {
    pub log: logging::LogControl,
    pub status: status::StatusBoard,
    /// Metrics of sources running outside the cores (the AMQP consumer), read at scrape time.
    pub external_metrics: std::sync::OnceLock<Box<dyn Fn() -> metrics::ExternalSeries + Send + Sync>>,
    /// The IoT Hub service client; `None` without a (well-formed) service connection string.
    pub hub: Option<hub::HubClient>,
    /// Scale-out on Redis (`--redis-url`); `None`: one instance.
    pub cluster: Option<std::sync::Arc<cluster::Cluster>>,
    /// The same, as the runtime sees it: started beside every core.
    pub plugin: Option<std::sync::Arc<dyn runtime::relay::CorePlugin>>,
}
