//! hubcast: a live device data gateway (ux4iot-compatible).
//!
//! The data path, as the modules are laid out (leaf first; each layer imports only from
//! itself and the layers below, `scripts/layers.toml`):
//!
//! - base: [`ids`], [`timefmt`], [`sas`], [`logging`], [`metrics`], [`status`], [`owner`]
//!   (one process per port).
//! - [`config`]: flags and environment → [`config::Settings`]; [`connection_string`] parsing.
//! - [`model`]: grants, subscriptions and requests of SPEC.md as types.
//! - [`hub`]: the IoT Hub service REST client (twin, desired properties, direct methods),
//!   on its own thread behind a bounded queue.
//! - [`ingest`]: the one message type every source feeds, body parsing (raw value spans) on
//!   the owning core, fault counters.
//! - [`push`]: envelopes built once per message and kind, deliveries, per-socket outlets.
//! - [`shard`]: a core's state — devices (last values, twin, connection state, per-session
//!   grants and subscriptions) and sessions; pure and synchronous.
//! - [`store`]: durable state engines behind the `StateStore` seam.
//! - [`runtime`]: generic thread-per-core — one monoio runtime per core, io drivers,
//!   SO_REUSEPORT listeners, the cross-core [`runtime::mesh`] (generic over the message
//!   type), the routing function ([`runtime::routing`]).
//! - [`app`]: the per-core application the runtime runs — [`app::Core`], the one enum of
//!   cross-core messages ([`app::mesh::CoreMsg`]), clock, store, the door for outside sources
//!   ([`app::Ingress`]), the session directory every core holds ([`app::directory`]);
//!   [`shutdown`]: graceful SIGTERM/SIGINT shutdown of the cores.
//! - [`cluster`]: several instances on Redis (`--redis-url`, or a Redis Cluster): shared sessions and grants,
//!   live data across instances; the Redis engine of [`app::directory`], named only by main.rs.
//! - the network protocols: [`tls`], [`http`] (HTTP/1.1 connections, handing requests to an
//!   [`http::Service`]), [`transport`] (WebSocket, Engine.IO), [`admission`] (the connection
//!   cap and its descriptor reserve, per-client rate limits); above them [`api`], the REST
//!   endpoints of SPEC.md ([`api::Rest`]).
//! - sources: [`amqp`] (the IoT Hub / Event Hubs consumer, fe2o3-amqp on its own tokio
//!   thread, feeding the cores through [`app::Ingress`]) and [`simulate`] (`--simulate N`).
//! - main.rs wires them: settings, services, the HTTP accept loop and the plugins started
//!   beside every core.
//!
//! - [`fuzzing`] (hidden): the entry points of the fuzz targets in `fuzz/` (docs/FUZZING.md).
//!
//! `scripts/layers.py` checks the layers in the test suite; `scripts/layers-baseline.txt`
//! (the wrong-way imports allowed to remain) is empty.

pub mod admission;
pub mod amqp;
pub mod api;
pub mod app;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod connection_string;
#[doc(hidden)]
pub mod fuzzing;
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
pub mod simulate;
pub mod status;
pub mod store;
pub mod timefmt;
pub mod tls;
pub mod transport;
