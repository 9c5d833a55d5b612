//! Ingest from IoT Hub / Event Hubs over AMQP 1.0 (fe2o3-amqp).
//!
//! fe2o3-amqp needs tokio, and the cores run monoio, so the consumer lives on a thread of
//! its own (`hubcast-amqp`) with a current-thread tokio runtime. It does AMQP only: it reads
//! the device id from each message's annotations, routes the raw body to the owning core
//! through [`Ingress`], and never parses a body (except, for a plain Event Hub message with
//! no device id anywhere else, to find `customDeviceIdKey` in it).
//!
//! The supervisor ([`Supervisor::run`]) connects, authenticates, lists the partitions,
//! attaches one receiver per partition and waits for any of them to fail; then it reports
//! the reason on `GET /status` (503), waits a capped exponential back-off with jitter, and
//! connects again, resuming each partition after the last message it handed to the cores.
//! Several instances: when the partitions leased here change, the links of those taken are
//! attached and those given up detached on the open connection (`move_partitions`), so the
//! partitions kept never wait for a reconnect while a peer dies, joins or comes back.
//!
//! - [`connect`]: endpoints, TLS, SASL, the IoT Hub redirect, `$cbs` and `$management`;
//! - [`partition`]: one partition's receive loop, flow control and position;
//! - [`map`]: AMQP message → [`crate::ingest::IngestMessage`];
//! - [`tap`]: under fe2o3, serves the receivers' links from the wire (messages, settlement,
//!   credit; `--event-hub-read-raw`), so fe2o3 neither moves nor decodes each delivery;
//! - [`encoded`]: the fields hubcast uses, read straight from a message's encoded bytes;
//! - [`sas`]: SAS tokens.

pub mod connect;
pub mod encoded;
pub mod map;
pub mod partition;
pub mod reader;
pub mod tap;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::Session;
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout, Instant};

use crate::config::Settings;
use crate::connection_string::EventHubConnection;
use crate::app::Ingress;
use crate::app::directory::{Leases, Owned, StreamPlan};
use crate::timefmt::now_millis;
use connect::{Endpoint, IotHubHost, NodeError, NodeLink};
use map::MapSettings;
use partition::{End, Positions};
pub use crate::config::StartPosition;

/// First retry delay after a failure; doubled per failure in a row, up to [`BACKOFF_CAP`].
const BACKOFF_BASE: Duration = Duration::from_millis(200);
const BACKOFF_CAP: Duration = Duration::from_secs(30);

/// Counters of the consumer, for `GET /metrics`.
pub struct Stats {
    /// 1 while every partition receiver is attached.
    pub connected: AtomicU64,
    /// Connections established (the first one and every reconnect).
    pub connects: AtomicU64,
    /// Messages received from the event stream, usable or not.
    pub received: AtomicU64,
    /// Messages without `x-opt-sequence-number`: applied unordered, at least once.
    pub unsequenced: AtomicU64,
    /// Batches handed to the cores (see [`partition::HandOff`]): received ÷ hand-offs is the
    /// number of messages each carried.
    pub handoffs: AtomicU64,
    /// Messages read from their bytes as taken off the wire by the tap ([`tap`]).
    pub raw_reads: AtomicU64,
    /// Messages fe2o3 decoded whole (the tap off, or a link it does not serve).
    pub decoded_reads: AtomicU64,
}

pub static STATS: Stats = Stats {
    connected: AtomicU64::new(0),
    connects: AtomicU64::new(0),
    received: AtomicU64::new(0),
    unsequenced: AtomicU64::new(0),
    handoffs: AtomicU64::new(0),
    raw_reads: AtomicU64::new(0),
    decoded_reads: AtomicU64::new(0),
};

/// Messages enqueued in each partition but not yet received, as last measured (every
/// `LAG_INTERVAL`, from `$management`). Written by the consumer thread, read by scrapes.
pub static PARTITION_LAG: Mutex<Vec<(String, i64)>> = Mutex::new(Vec::new());

/// How often partition lag is measured: the default of the hidden `--amqp-lag-interval-ms`.
pub const LAG_INTERVAL: Duration = Duration::from_secs(5);

impl Stats {
    /// The counters as `GET /metrics` series.
    pub fn series(&self) -> crate::metrics::ExternalSeries {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("hubcast_amqp_connected", "1 while every partition receiver of the event stream is attached.", get(&self.connected)),
            ("hubcast_amqp_connects_total", "AMQP connections established to the event stream (reconnects included).", get(&self.connects)),
            ("hubcast_amqp_messages_received_total", "Messages received from the event stream.", get(&self.received)),
            (
                "hubcast_amqp_handoffs_total",
                "Batches of event stream messages handed to the cores (messages received / hand-offs = messages per hand-off).",
                get(&self.handoffs),
            ),
            (
                "hubcast_amqp_raw_reads_total",
                "Event stream messages read from their bytes as taken off the wire (--event-hub-read-raw), not decoded whole by fe2o3.",
                get(&self.raw_reads),
            ),
            (
                "hubcast_amqp_decoded_reads_total",
                "Event stream messages decoded whole by fe2o3 (--event-hub-read-raw false, or a link the tap does not serve).",
                get(&self.decoded_reads),
            ),
            (
                "hubcast_amqp_messages_unsequenced_total",
                "Messages without a sequence number, applied unordered (at least once).",
                get(&self.unsequenced),
            ),
        ]
        .into_iter()
        .map(|(name, help, v)| (name.to_string(), help.to_string(), String::new(), v))
        .chain(PARTITION_LAG.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(partition, lag)| {
            (
                "hubcast_amqp_partition_lag".to_string(),
                "Messages enqueued in a partition and not yet received (measured every 5 s).".to_string(),
                format!("{{partition=\"{partition}\"}}"),
                (*lag).max(0) as u64,
            )
        }))
        .collect()
    }
}


/// How to authenticate to the Event Hub.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Auth {
    /// SASL PLAIN with the key name and the key.
    Plain,
    /// SASL ANONYMOUS, then a SAS token put on `$cbs`, renewed before it expires.
    Cbs,
}

/// What the connection string points at.
#[derive(Clone, Debug)]
pub enum Origin {
    EventHub(Endpoint),
    /// An IoT Hub: ask it (redirect) where its built-in endpoint is.
    IotHub(IotHubHost),
}

/// Everything the consumer needs, checked at start-up.
#[derive(Clone, Debug)]
pub struct Plan {
    pub origin: Origin,
    pub key_name: String,
    pub key: String,
    pub consumer_group: String,
    /// `None`: CBS over TLS, PLAIN without.
    pub auth: Option<Auth>,
    pub start: StartPosition,
    pub token_ttl: Duration,
    pub prefetch: u32,
    /// While a partition is busy, at most one hand-off to the cores per this long
    /// (`--event-hub-linger-ms`; see [`partition::HandOff`]).
    pub linger: Duration,
    /// `--event-hub-read-raw`: the receivers' links served from the wire under fe2o3 ([`tap`]).
    pub read_raw: bool,
    pub map: MapSettings,
    /// Roots trusted for amqps (public web roots, plus `--event-hub-ca-file`).
    pub tls: Arc<tokio_rustls::rustls::ClientConfig>,
    /// How often partition lag is measured ([`LAG_INTERVAL`] unless overridden).
    pub lag_interval: Duration,
    /// Names this stream and consumer group (stored positions, Redis leases and checkpoints).
    pub stream_key: String,
}

impl Plan {
    /// The consumer's plan; `Err` names what is wrong with the configuration.
    pub fn new(connection: &EventHubConnection, settings: &Settings) -> Result<Self, String> {
        let c = &settings.config;
        let bad = |e: String| format!("EventHub connection string misformed ({e}). Please check the iotHubEventHubConnectionString environment variable");
        let origin = match (&connection.endpoint, &connection.host_name) {
            (Some(url), _) => {
                let (tls, host, port) = connect::parse_url(url).map_err(bad)?;
                let entity = connection
                    .entity_path
                    .clone()
                    .filter(|e| !e.is_empty())
                    .ok_or_else(|| bad("missing EntityPath".into()))?;
                Origin::EventHub(Endpoint { tls, dial_host: host.clone(), port, hostname: host, entity })
            }
            (None, Some(host)) => {
                let (tls, host, port) = connect::parse_url(host).map_err(bad)?;
                Origin::IotHub(IotHubHost { tls, host, port })
            }
            (None, None) => return Err(bad("missing Endpoint or HostName".into())),
        };
        let auth = match c.event_hub_auth.as_str() {
            "plain" => Some(Auth::Plain),
            "cbs" => Some(Auth::Cbs),
            _ => None,
        };
        Ok(Self {
            origin,
            key_name: connection.key_name.clone(),
            key: connection.key.clone(),
            consumer_group: c.event_hub_consumer_group.clone(),
            auth,
            start: c.event_hub_start_position.clone(),
            token_ttl: Duration::from_secs(c.event_hub_token_ttl),
            prefetch: c.event_hub_prefetch,
            linger: Duration::from_millis(c.event_hub_linger_ms),
            read_raw: c.event_hub_read_raw,
            tls: connect::tls_config(c.event_hub_ca_file.as_deref())
                .map_err(|e| format!("{e}. Please check --event-hub-ca-file (EVENT_HUB_CA_FILE)"))?,
            map: MapSettings {
                custom_device_id_key: c.custom_device_id_key.clone(),
                max_message_bytes: usize::try_from(c.max_message_bytes).unwrap_or(usize::MAX),
            },
            lag_interval: Duration::from_millis(c.amqp_lag_interval_ms),
            stream_key: crate::app::source_prefix(settings),
        })
    }

    fn auth_for(&self, endpoint: &Endpoint) -> Auth {
        self.auth.unwrap_or(if endpoint.tls && !is_queue_address(&endpoint.entity) { Auth::Cbs } else { Auth::Plain })
    }
}

/// An `EntityPath` that starts with `/` is a broker's queue address (RabbitMQ's `/queue/x`,
/// `/amq/queue/x`, `/queues/x`), never an Event Hub name (those cannot contain `/`): it is
/// read as one plain AMQP queue, without `$management`, partitions or start position.
pub fn is_queue_address(entity: &str) -> bool {
    entity.starts_with('/')
}

/// Where the consumer reports its link for `GET /status` (its slot on the status board):
/// `Ok(())` connected, `Err(reason)` not (or no longer) connected.
pub type ReportStatus = Arc<dyn Fn(Result<(), String>) + Send + Sync>;

/// Starts the consumer thread. `leases`: several instances share the stream (scale-out on
/// Redis): it reads only the partitions leased to this instance.
pub fn start(plan: Plan, status: ReportStatus, leases: Option<Arc<dyn Leases>>, ingress: Ingress) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("hubcast-amqp".into()).spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the AMQP runtime; no device messages will be read");
                status(Err(format!("cannot start the AMQP runtime: {e}")));
                return;
            }
        };
        let supervisor = Supervisor {
            container_id: format!("hubcast-{}", crate::ids::random_token(8)),
            map: Arc::new(plan.map.clone()),
            plan,
            status,
            leases,
            positions: Arc::new(Mutex::new(stored_positions(&ingress))),
            ingress,
        };
        runtime.block_on(supervisor.run());
    })
}

/// Positions the durable store holds for this stream and consumer group: where each
/// partition resumes (`--event-hub-start-position` applies to the others).
fn stored_positions(ingress: &Ingress) -> HashMap<String, map::Position> {
    let stored = ingress.stored_positions();
    for (partition, seq) in &stored {
        tracing::info!(partition = %partition, after_sequence_number = seq, "resuming at the stored position");
    }
    stored.into_iter().map(|(p, seq)| (p, map::Position { sequence: Some(seq), ..Default::default() })).collect()
}

/// Why one connection ended.
enum Stop {
    /// Reconnect after a back-off. `worked`: it had been connected (resets the back-off).
    Retry { reason: String, worked: bool },
    /// Several instances: a partition taken cannot be attached on the open connection (see
    /// `move_partitions`); read the new set on a new one at once (no back-off).
    Rebalance,
    /// The cores are gone: the process is stopping.
    Shutdown,
}

/// A leased partition resumes after the later of its position here and `checkpoint` (where
/// the instance that held it before stopped, or the lease came with).
fn resume_after(positions: &mut HashMap<String, map::Position>, partition: &str, checkpoint: i64) {
    let known = positions.entry(partition.to_owned()).or_default();
    if known.sequence.is_none_or(|s| s < checkpoint) {
        *known = map::Position { sequence: Some(checkpoint), ..Default::default() };
    }
}

fn retry(reason: impl Into<String>) -> Stop {
    Stop::Retry { reason: reason.into(), worked: false }
}

pub struct Supervisor {
    plan: Plan,
    map: Arc<MapSettings>,
    status: ReportStatus,
    leases: Option<Arc<dyn Leases>>,
    ingress: Ingress,
    container_id: String,
    positions: Positions,
}

async fn begin(connection: &mut ConnectionHandle<()>) -> Result<fe2o3_amqp::session::SessionHandle<()>, Stop> {
    match timeout(connect::CALL_TIMEOUT, Session::begin(connection)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(retry(format!("cannot begin an AMQP session: {e}"))),
        Err(_) => Err(retry("no answer to an AMQP session begin")),
    }
}

/// Capped exponential back-off with jitter: 200 ms, 400 ms, … 30 s, each shortened by up
/// to half at random so that many gateways do not reconnect in step.
pub fn backoff(failures: u32) -> Duration {
    let full = BACKOFF_BASE.saturating_mul(1u32 << failures.min(16)).min(BACKOFF_CAP);
    full.mul_f64(0.5 + fastrand::f64() / 2.0)
}

/// A partition link's name: the container's, then the partition's.
fn link_name(container_id: &str, label: &str) -> String {
    format!("{}-{}", container_id, label.replace('/', "_"))
}

/// Resolves (true) when the set of leased partitions differs from the one being read.
async fn lease_change(leases: &mut Option<(tokio::sync::watch::Receiver<Owned>, Owned)>) -> bool {
    let Some((rx, reading)) = leases.as_mut() else { return std::future::pending().await };
    loop {
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
        let now = rx.borrow_and_update().partitions.keys().cloned().collect::<Vec<_>>();
        if now != reading.partitions.keys().cloned().collect::<Vec<_>>() {
            return true;
        }
    }
}

impl Supervisor {
    /// Spawns the task reading one attached partition; the switch that releases it.
    fn spawn_partition(
        &self,
        tasks: &mut JoinSet<End>,
        receiver: fe2o3_amqp::Receiver,
        name: String,
        label: String,
        tap: Option<tap::TapHandle>,
    ) -> tokio::sync::watch::Sender<bool> {
        let (release, released) = tokio::sync::watch::channel(false);
        tasks.spawn(partition::consume(
            receiver,
            name,
            label,
            self.positions.clone(),
            self.ingress.clone(),
            self.map.clone(),
            partition::HandOff { linger: self.plan.linger, prefetch: self.plan.prefetch },
            tap,
            released,
        ));
        release
    }

    /// The partitions leased here changed while connected: the links of those given up are
    /// detached (each after the batch it is handing over) and those taken are attached on the
    /// open session, each resuming after the later of its position here and the checkpoint
    /// its lease came with. The partitions kept are not touched: an instance taking over a
    /// dead peer's partitions, or giving one up to an instance that joins, reads its own on
    /// without a gap. `Err`: reconnect instead (an attach failed, or a partition taken has no
    /// position at all with `--event-hub-start-position latest`, which the connect pins
    /// through `$management`).
    #[allow(clippy::too_many_arguments)]
    async fn move_partitions(
        &self,
        leases: &mut Option<(tokio::sync::watch::Receiver<Owned>, Owned)>,
        receivers: &mut fe2o3_amqp::session::SessionHandle<()>,
        tasks: &mut JoinSet<End>,
        releases: &mut HashMap<String, tokio::sync::watch::Sender<bool>>,
        partitions: &RefCell<Vec<String>>,
        entity: &str,
        tap: Option<&tap::TapHandle>,
    ) -> Result<(), Stop> {
        let Some((rx, reading)) = leases.as_mut() else { return Ok(()) };
        let now = rx.borrow_and_update().clone();
        let given_up: Vec<String> = reading.partitions.keys().filter(|p| !now.partitions.contains_key(*p)).cloned().collect();
        let taken: Vec<String> = now.partitions.keys().filter(|p| !reading.partitions.contains_key(*p)).cloned().collect();
        {
            let mut positions = self.positions.lock().unwrap_or_else(|e| e.into_inner());
            for p in &taken {
                if let Some(Some(seq)) = now.partitions.get(p) {
                    resume_after(&mut positions, p, *seq);
                }
                if !positions.contains_key(p) && self.plan.start == StartPosition::Latest {
                    return Err(Stop::Rebalance);
                }
            }
        }
        for p in &given_up {
            if let Some(release) = releases.remove(p) {
                let _ = release.send(true);
            }
        }
        for p in &taken {
            let position = self.positions.lock().unwrap_or_else(|e| e.into_inner()).get(p).cloned();
            let filter = partition::start_filter(position.as_ref(), &self.plan.start);
            let address = format!("{}/ConsumerGroups/{}/Partitions/{}", entity, self.plan.consumer_group, p);
            let name = link_name(&self.container_id, p);
            let receiver = partition::attach(receivers, name.clone(), &address, Some(&filter), self.plan.prefetch)
                .await
                .map_err(|reason| Stop::Retry { reason, worked: true })?;
            tracing::debug!(partition = %p, filter = %filter, "receiver attached");
            releases.insert(p.clone(), self.spawn_partition(tasks, receiver, name, p.clone(), tap.cloned()));
        }
        *partitions.borrow_mut() = now.partitions.keys().cloned().collect();
        tracing::info!(
            taken = ?taken,
            given_up = ?given_up,
            partitions = ?now.partitions.keys().collect::<Vec<_>>(),
            "partition leases changed: links moved on the open connection, the others read on"
        );
        *reading = now;
        Ok(())
    }

    /// Several instances: names this stream's partitions to the Redis link, waits briefly for
    /// its leases, and resumes each leased partition after the later of the position known
    /// here and the checkpoint in Redis (where the instance that held it before stopped).
    async fn leased_partitions(
        &self,
        holder: &dyn Leases,
        ids: &[String],
    ) -> (Owned, tokio::sync::watch::Receiver<Owned>) {
        let positions = self.positions.clone();
        let handed = move || {
            let positions = positions.lock().unwrap_or_else(|e| e.into_inner());
            positions.iter().filter_map(|(p, pos)| Some((p.clone(), pos.sequence?))).collect()
        };
        let mut rx = holder.owned();
        rx.borrow_and_update();
        let plan = StreamPlan {
            key: self.plan.stream_key.clone(),
            ids: ids.to_vec(),
            positions: Arc::new(handed),
            marks: self.ingress.has_source(),
        };
        if holder.stream(plan) {
            // The first balance follows at once unless Redis is down; the set may also be
            // unchanged (a reconnect), so do not wait long.
            let _ = timeout(Duration::from_secs(2), rx.changed()).await;
        }
        let owned = rx.borrow_and_update().clone();
        let mut positions = self.positions.lock().unwrap_or_else(|e| e.into_inner());
        for (p, checkpoint) in &owned.partitions {
            if let Some(seq) = checkpoint {
                resume_after(&mut positions, p, *seq);
            }
        }
        tracing::info!(partitions = ?owned.partitions.keys().collect::<Vec<_>>(), of = ids.len(), "reading the partitions leased to this instance");
        (owned, rx)
    }

    pub async fn run(self) {
        let mut failures = 0u32;
        loop {
            if crate::shutdown::STOPPING.is_stopping() {
                tracing::info!("shutting down: the event hub consumer ends");
                return;
            }
            match self.connect_and_consume().await {
                Stop::Shutdown => {
                    tracing::info!("the event hub consumer stopped: partition links detached, connection closed");
                    return;
                }
                Stop::Rebalance => {
                    tracing::info!("partition leases changed: reconnecting to read the partitions now held");
                }
                Stop::Retry { reason, worked } => {
                    if worked {
                        failures = 0;
                    }
                    let delay = backoff(failures);
                    failures = failures.saturating_add(1);
                    tracing::warn!(reason = %reason, retry_in_ms = delay.as_millis() as u64, "event hub not connected");
                    (self.status)(Err(reason));
                    tokio::select! {
                        _ = sleep(delay) => {}
                        _ = crate::shutdown::STOPPING.wait() => {}
                    }
                }
            }
        }
    }

    async fn connect_and_consume(&self) -> Stop {
        let endpoint = match &self.plan.origin {
            Origin::EventHub(e) => e.clone(),
            Origin::IotHub(hub) => {
                match connect::follow_redirect(hub, &self.plan.tls, &self.plan.key_name, &self.plan.key, &self.container_id).await {
                    Ok(e) => {
                        tracing::info!(endpoint = %e.describe(), "IoT Hub redirected to its built-in endpoint");
                        e
                    }
                    Err(e) => return retry(format!("IoT Hub redirect: {e}")),
                }
            }
        };
        let auth = self.plan.auth_for(&endpoint);
        let profile = match auth {
            Auth::Plain => SaslProfile::Plain { username: self.plan.key_name.clone(), password: self.plan.key.clone() },
            Auth::Cbs => SaslProfile::Anonymous,
        };
        // The tap's table dies with the connection (and with it any message not handed over).
        let tap = self.plan.read_raw.then(tap::TapHandle::new);
        let mut connection = match connect::open(&endpoint, &self.plan.tls, profile, &self.container_id, tap.clone()).await {
            Ok(c) => c,
            Err(e) => return retry(e),
        };
        let stop = self.consume(&mut connection, &endpoint, auth, tap).await;
        let _ = timeout(Duration::from_secs(2), connection.close()).await;
        stop
    }

    /// A fresh SAS token for the endpoint and when it expires (seconds since the epoch).
    fn token(&self, endpoint: &Endpoint) -> Result<(String, i64), String> {
        let expiry = now_millis() / 1000 + self.plan.token_ttl.as_secs() as i64;
        let token = crate::sas::token(&endpoint.audience(), &self.plan.key_name, &self.plan.key, crate::sas::KeyConvention::Raw, expiry)?;
        Ok((token, expiry))
    }

    /// How long until a token expiring at `expiry` (seconds) is renewed: a fifth of its
    /// lifetime (at most five minutes) before it ends.
    fn renewal_delay(&self, expiry: i64) -> Duration {
        let margin = (self.plan.token_ttl / 5).min(Duration::from_secs(300));
        let left = Duration::from_millis(u64::try_from(expiry * 1000 - now_millis()).unwrap_or(0));
        left.saturating_sub(margin)
    }

    /// Measures every partition's lag (last enqueued sequence number minus the last one
    /// received) every `lag_interval` ([`LAG_INTERVAL`]), for ever; the caller drops it with the connection.
    async fn measure_lag(
        &self,
        link: &mut NodeLink,
        entity: &str,
        partitions: &RefCell<Vec<String>>,
        token: &RefCell<Option<String>>,
    ) -> std::convert::Infallible {
        let mut tick = tokio::time::interval(self.plan.lag_interval);
        loop {
            tick.tick().await;
            // The partitions read now (they change in place when leases move).
            let partitions = partitions.borrow().clone();
            let mut lags = Vec::with_capacity(partitions.len());
            for id in partitions.iter().map(String::as_str) {
                let token = token.borrow().clone();
                match connect::last_sequence_number(link, entity, id, token.as_deref()).await {
                    Ok(last) => {
                        let received = self.positions.lock().unwrap_or_else(|e| e.into_inner())
                            .get(id).and_then(|p| p.sequence).unwrap_or(-1);
                        lags.push((id.to_string(), last - received));
                    }
                    Err(e) => {
                        tracing::debug!(partition = %id, error = %e, "cannot measure partition lag");
                    }
                }
            }
            *PARTITION_LAG.lock().unwrap_or_else(|e| e.into_inner()) = lags;
        }
    }

    async fn consume(&self, connection: &mut ConnectionHandle<()>, endpoint: &Endpoint, auth: Auth, tap: Option<tap::TapHandle>) -> Stop {
        // Control session ($cbs, $management) apart from the receivers: a broker that
        // refuses $management by ending the session leaves the receivers untouched.
        let mut control = match begin(connection).await {
            Ok(s) => s,
            Err(stop) => return stop,
        };
        let mut cbs = None;
        let mut token = None;
        let mut renew_at = Instant::now();
        if auth == Auth::Cbs {
            let mut link = match NodeLink::attach(&mut control, "$cbs", &self.container_id).await {
                Ok(l) => l,
                Err(e) => return retry(format!("CBS: {e}")),
            };
            let (t, expiry) = match self.token(endpoint) {
                Ok(t) => t,
                Err(e) => return retry(e),
            };
            if let Err(e) = connect::put_token(&mut link, &endpoint.audience(), &t, expiry).await {
                return retry(format!("CBS authorization: {e}"));
            }
            cbs = Some(link);
            token = Some(t);
            renew_at = Instant::now() + self.renewal_delay(expiry);
        }

        // Several instances on Redis: the partitions this instance holds leases on.
        let mut leases: Option<(tokio::sync::watch::Receiver<Owned>, Owned)> = None;
        // The partitions, or the entity itself when it is a queue of a plain AMQP broker.
        let mut addresses: Vec<(String, String, Option<String>)> = Vec::new(); // (label, address, filter)
        let mut lag_link: Option<NodeLink> = None;
        let management = if is_queue_address(&endpoint.entity) {
            Err(NodeError::Missing("EntityPath is a queue address".into()))
        } else {
            NodeLink::attach(&mut control, "$management", &self.container_id).await
        };
        match management {
            Ok(mut mgmt) => {
                let mut ids = match connect::partition_ids(&mut mgmt, &endpoint.entity, token.as_deref()).await {
                    Ok(ids) => ids,
                    Err(e) => return retry(format!("cannot list partitions: {e}")),
                };
                if let Some(holder) = &self.leases {
                    let (owned, rx) = self.leased_partitions(holder.as_ref(), &ids).await;
                    ids.retain(|id| owned.partitions.contains_key(id));
                    leases = Some((rx, owned));
                }
                for id in ids {
                    let known = self.positions.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned();
                    let mut position = known;
                    if position.is_none() && self.plan.start == StartPosition::Latest {
                        // Pin "latest" to a sequence number now, so that a reconnect before
                        // the first message neither skips nor repeats anything.
                        match connect::last_sequence_number(&mut mgmt, &endpoint.entity, &id, token.as_deref()).await {
                            Ok(seq) => {
                                let p = map::Position { sequence: Some(seq), ..Default::default() };
                                self.positions.lock().unwrap_or_else(|e| e.into_inner()).insert(id.clone(), p.clone());
                                position = Some(p);
                                // Stored too: a restart before the first event resumes here.
                                if !self.ingress.send_marked(Vec::new(), Vec::new(), &id, Some(seq)).await {
                                    return Stop::Shutdown;
                                }
                            }
                            Err(e) => tracing::warn!(partition = %id, error = %e, "cannot read the partition's last sequence number; starting at @latest"),
                        }
                    }
                    let filter = partition::start_filter(position.as_ref(), &self.plan.start);
                    let address = format!("{}/ConsumerGroups/{}/Partitions/{}", endpoint.entity, self.plan.consumer_group, id);
                    addresses.push((id, address, Some(filter)));
                }
                lag_link = Some(mgmt);
            }
            Err(NodeError::Missing(e)) => {
                if !is_queue_address(&endpoint.entity) {
                    tracing::warn!(
                        reason = %e,
                        address = %endpoint.entity,
                        "the broker has no $management node: reading EntityPath as one plain AMQP queue (no partitions, no start position)"
                    );
                }
                addresses.push((endpoint.entity.clone(), endpoint.entity.clone(), None));
            }
            Err(e) => return retry(format!("$management: {e}")),
        }

        // The receivers' session is the one tapped: the next one fe2o3 begins.
        if let Some(tap) = &tap {
            tap.arm(self.map.max_message_bytes);
        }
        let mut receivers = match begin(connection).await {
            Ok(s) => s,
            Err(stop) => return stop,
        };
        let mut tasks = JoinSet::new();
        // Each partition task's release switch (its lease moved to another instance).
        let mut releases: HashMap<String, tokio::sync::watch::Sender<bool>> = HashMap::new();
        for (label, address, filter) in &addresses {
            let name = link_name(&self.container_id, label);
            match partition::attach(&mut receivers, name.clone(), address, filter.as_deref(), self.plan.prefetch).await {
                Ok(receiver) => {
                    tracing::debug!(partition = %label, filter = filter.as_deref().unwrap_or("-"), "receiver attached");
                    releases.insert(label.clone(), self.spawn_partition(&mut tasks, receiver, name, label.clone(), tap.clone()));
                }
                Err(e) => {
                    tasks.shutdown().await;
                    return retry(e);
                }
            }
        }
        (self.status)(Ok(()));
        STATS.connected.store(1, Ordering::Relaxed);
        STATS.connects.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            endpoint = %endpoint.describe(),
            partitions = addresses.len(),
            consumer_group = %self.plan.consumer_group,
            ?auth,
            "event hub connected"
        );

        // Wait for the first partition to end; meanwhile keep the CBS token fresh and measure lag.
        // The lag measurement is a branch of its own, polled alongside the others: a
        // `$management` call waiting for an answer (up to its 15 s timeout on a dead
        // connection) never keeps the loop from seeing a partition end.
        let token = RefCell::new(token);
        let partitions = RefCell::new(addresses.iter().map(|(id, _, _)| id.clone()).collect::<Vec<_>>());
        let lag = async {
            match lag_link.as_mut() {
                Some(link) => self.measure_lag(link, &endpoint.entity, &partitions, &token).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(lag);
        let stop = loop {
            tokio::select! {
                // Graceful shutdown: each partition task sees it too and detaches its link.
                _ = crate::shutdown::STOPPING.wait() => break Stop::Shutdown,
                never = &mut lag => match never {},
                owned = lease_change(&mut leases) => if owned {
                    // Partitions taken or given up: links attached and detached on this
                    // connection; the others read on (a reconnect would stop them all).
                    if let Err(stop) = self.move_partitions(&mut leases, &mut receivers, &mut tasks, &mut releases, &partitions, &endpoint.entity, tap.as_ref()).await {
                        break stop;
                    }
                },
                ended = tasks.join_next(), if !tasks.is_empty() || leases.is_none() => {
                    break match ended {
                        // Its lease moved: detached on purpose, the others read on.
                        Some(Ok(End::Released)) => continue,
                        Some(Ok(End::CoresGone)) => Stop::Shutdown,
                        Some(Ok(End::Lost(reason))) => Stop::Retry { reason, worked: true },
                        Some(Err(e)) => Stop::Retry { reason: format!("a partition receiver failed: {e}"), worked: true },
                        None => Stop::Retry { reason: "no partition to read".into(), worked: true },
                    };
                }
                _ = tokio::time::sleep_until(renew_at), if cbs.is_some() => {
                    let link = cbs.as_mut().expect("guarded by the select condition");
                    let renewed = match self.token(endpoint) {
                        Ok((t, expiry)) => connect::put_token(link, &endpoint.audience(), &t, expiry).await.map(|()| (t, expiry)).map_err(|e| e.to_string()),
                        Err(e) => Err(e),
                    };
                    match renewed {
                        Ok((t, expiry)) => {
                            tracing::debug!(expiry, "CBS token renewed");
                            *token.borrow_mut() = Some(t);
                            renew_at = Instant::now() + self.renewal_delay(expiry);
                        }
                        Err(e) => break Stop::Retry { reason: format!("CBS token renewal: {e}"), worked: true },
                    }
                }
            }
        };
        // Show the loss at once; closing and draining below may take a few seconds.
        if let Stop::Retry { reason, .. } = &stop {
            (self.status)(Err(reason.clone()));
        }
        STATS.connected.store(0, Ordering::Relaxed);
        if crate::shutdown::STOPPING.is_stopping() {
            // Links first (each partition task closes its own), then the sessions; the caller
            // closes the connection.
            if timeout(Duration::from_secs(5), async { while tasks.join_next().await.is_some() {} }).await.is_err() {
                tasks.shutdown().await;
            }
            drop(cbs);
            let _ = timeout(Duration::from_secs(2), receivers.end()).await;
            let _ = timeout(Duration::from_secs(2), control.end()).await;
            return Stop::Shutdown;
        }
        // Let the other partitions finish the batch they are handing over; once the
        // connection closes their receivers fail and they return.
        let _ = timeout(Duration::from_secs(2), connection.close()).await;
        if timeout(Duration::from_secs(10), async { while tasks.join_next().await.is_some() {} }).await.is_err() {
            tasks.shutdown().await;
        }
        stop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_position_parses_keywords_and_times() {
        assert_eq!(StartPosition::parse("latest"), Ok(StartPosition::Latest));
        assert_eq!(StartPosition::parse("earliest"), Ok(StartPosition::Earliest));
        assert_eq!(
            StartPosition::parse("2024-01-02T03:04:05Z"),
            Ok(StartPosition::EnqueuedAfter(crate::timefmt::parse_iso("2024-01-02T03:04:05Z").unwrap()))
        );
        assert!(StartPosition::parse("tomorrow").unwrap_err().contains("tomorrow"));
    }

    #[test]
    fn backoff_grows_to_a_cap_with_jitter() {
        for failures in 0..40 {
            let d = backoff(failures);
            let full = BACKOFF_BASE.saturating_mul(1u32 << failures.min(16)).min(BACKOFF_CAP);
            assert!(d >= full / 2 && d <= full, "{failures}: {d:?}");
        }
        assert!(backoff(100) <= BACKOFF_CAP);
    }
}
