//! Several hubcast instances behind one load balancer, sharing one Redis (`--redis-url`) or
//! one Redis Cluster (`--redis-cluster-nodes`; `conn.rs`, `names.rs` and `shards.rs`, its sharded
//! pub/sub for device channels, are all that differ).
//!
//! Without either none of this runs. With one:
//! - **Sessions are shared.** A session lives in Redis (`<prefix>:session:<id>`: its access
//!   on every device, in the durable store's encoding) and as a copy on each instance that
//!   uses it. An instance that meets an unknown session id (a REST call, a socket) loads it
//!   from Redis first (`ensure_session`). A request's changes (grants, revokes, subscribes,
//!   unsubscribes) are computed on Redis's copy, written and published on `<prefix>:ops` as
//!   one change at the session's next version (`Command::Change`: two round trips), and
//!   applied here before the client is answered; the other instances apply it to their
//!   copies where it is newer, so a grant revoked on one instance stops delivery on every
//!   other. A delete is written and published likewise.
//! - **Live data crosses once per interested instance.** An instance *watches* a device
//!   while a session with a socket on it subscribes to the device; it then subscribes to
//!   the Redis channel `<prefix>:device:<id>` and announces it (`<prefix>:watching:<instance>`
//!   and `<prefix>:watch`). The core that ingests a device message publishes it once, only
//!   when another instance watches the device; Redis hands it to each watching instance
//!   once, whose device core applies it as a replica (last values, then its own sockets).
//! - A session's key expires `grace + 2 × refresh` after the last instance holding a copy
//!   stopped refreshing it (copies expire locally after `--session-grace-period` idle).
//!
//! The rest of the gateway never names this module: each core holds the session directory
//! (`app::directory::Directory`), which the plugin here replaces on every core with its Redis
//! engine (`Redis`: the functions below, each falling back to `app::directory::local` for the
//! copy here), and the event stream consumer holds [`Cluster`] as its `app::directory::Leases`.
//! Only main.rs names it, to start it with `--redis-url` or `--redis-cluster-nodes`.
//!
//! The Redis client runs on its own thread ([`link`]); cores reach it through one command
//! queue bounded in count and bytes (`queue.rs`) and it reaches them through one bounded
//! queue per core. Back-pressure: a full command queue refuses a change (503 to the client)
//! and drops a publication (counted in `hubcast_redis_dropped_total`); a full core queue makes the link wait, so
//! Redis buffers the instance's pub/sub output up to its `client-output-buffer-limit` and
//! then drops the connection (the link reconnects and logs it).

mod adopt;
mod conn;
mod lease;
mod link;
mod names;
mod queue;
mod resend;
mod resync;
pub mod ring;
mod ringask;
mod shards;
pub mod wire;

pub use conn::Engine;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_channel::oneshot;
use hashbrown::{HashMap, HashSet};

use crate::config::Settings;
use crate::ids::SessionId;
use crate::ingest::IngestMessage;
use crate::model::{Checked, Rejection};
use crate::app::relay::{CorePlugin, Relay, RingMiss};
use crate::app::recovery::Verdict;
use crate::shard::devices::{Decided, Kept};
use crate::app::Core;
use crate::app::directory::{local, Directory, Leases, Membership, Pending, View};
use crate::shard::{ask, DeviceOp, Grants, Subscriptions, TelemetryView, Viewer};
use crate::timefmt::Millis;
pub use crate::app::directory::{Owned, ReadKind, StreamPlan};
pub use wire::SharedOp;

/// Batches waiting for one core from the Redis thread.
const INBOUND: usize = 256;
/// Device messages one core holds for Redis between two flushes, and their bytes.
const OUTBOX_MESSAGES: usize = 4096;
const OUTBOX_BYTES: usize = 4 << 20;

/// A session's whole access on one device (`None`: none).
pub type AccessOn = Option<(Grants, Subscriptions)>;

/// What a [`Command::Change`] did: the session's version after it, its whole access on every
/// device the request touched, and whether each change was permitted (in the request's
/// order); `None` when the session is in Redis no more.
pub(crate) type Changed = Option<(u64, Vec<(Box<str>, AccessOn)>, Vec<bool>)>;

/// A session as Redis holds it: its version and its access per device.
pub(crate) type Loaded = Option<(u64, Vec<SharedOp>)>;

pub(crate) enum Command {
    /// Write a change to Redis and publish it; answers whether a deleted session existed.
    Save { op: SharedOp, reply: oneshot::Sender<Result<bool, String>> },
    /// One request's changes to a session's access, computed on Redis's copy (the source of
    /// truth): read once (`HMGET`), written with their one publication by one script that
    /// checks the session's version `v` (tried again if another instance changed the
    /// session meanwhile). Two round trips whatever the number of devices.
    Change { session: SessionId, changes: Vec<(Box<str>, AccessChange)>, reply: oneshot::Sender<Result<Changed, String>> },
    /// Read a session from Redis: its access per device, `None` if there is no such session.
    Load { session: SessionId, reply: oneshot::Sender<Result<Loaded, String>> },
    /// Device messages to publish, each on its device's channel (payloads of [`wire`]).
    Publish(Vec<(Box<str>, Vec<u8>)>),
    /// Devices this instance started or stopped watching.
    Watch(Vec<(Box<str>, bool)>),
    /// Sessions held here: keep their Redis keys alive.
    Refresh(Vec<SessionId>),
    /// The partitions of the event stream this instance reads (at every connect), for leases.
    Stream(StreamPlan),
    /// Graceful shutdown: checkpoint, give every lease up, leave (answered when done).
    Leave(std::sync::mpsc::Sender<()>),
    /// Ask the other instances for a device this instance holds nothing current of: the
    /// freshest holder's answer (typed) and when its newest data was produced, `None` when
    /// no instance holds it (or nothing newer than `newer_than`).
    Read { device: Box<str>, kind: wire::ReadKind, newer_than: Option<Millis>, reply: oneshot::Sender<Result<Option<(Millis, View)>, String>> },
    /// SIGTERM: hand a session's recovery history to another live instance (adopt.rs).
    Adopt { session: SessionId, devices: Vec<Box<str>>, blob: Vec<u8>, left: Duration, to: Option<Arc<str>> },
    /// A client came back here with a pid of a history another instance holds: ask it
    /// (`P:stream:<session>` names it) to hand the history over (adopt.rs, step 6b).
    Take { session: SessionId },
    /// Asked for a history by instance `to`: there is none to give.
    GiveNone { session: SessionId, to: Arc<str> },
    /// Adopting: one of `cores` device cores handed its watch changes for the session over
    /// (0: the history was not taken).
    AdoptWatching { session: SessionId, cores: usize },
    /// Stopping: the verdict on a history handed over; not kept with a `tail`: the frames
    /// the history took in since, for the adopter to stitch in (push/stitch.rs).
    AdoptVerdict { session: SessionId, kept: bool, tail: Option<Vec<u8>> },
    /// Stopping: answered once every history handed over has its verdict.
    Settle(std::sync::mpsc::Sender<()>),
    /// Design step 11: for each other instance with a presence key, how long ago (ms, by
    /// Redis's clock: the key's TTL less what is left of it) it last renewed it; `None` for
    /// one whose key went meanwhile (on a Redis Cluster: the `instances` sorted set's scores,
    /// when each presence expires).
    Staleness(oneshot::Sender<Result<Vec<Staleness>, String>>),
    /// Design step 11: ask every other instance for its rings of a session's devices
    /// (`ringask::encode_ask`'s payload, published on `P:read`).
    RingsAsk(Vec<u8>),
    /// The answer to instance `to`'s ask, after this core's publications before it.
    RingsAnswer { to: Arc<str>, payload: Vec<u8> },
}

/// An other instance and how long ago (ms) it renewed its presence key (`None`: gone).
pub(crate) type Staleness = (Box<str>, Option<i64>);

pub(crate) enum Inbound {
    /// Apply a shared change to the copy here, on the device's core for an access change
    /// (in the queue of the device's messages: in force before any later one), on the
    /// session's core otherwise; `done` (this instance's own change) is answered once it is.
    Op(SharedOp, Option<oneshot::Sender<()>>),
    /// Another instance's device messages, all of devices this core owns.
    Messages(Vec<IngestMessage>),
    /// Devices of this core that other instances started or stopped watching.
    RemoteWatch(Vec<(Box<str>, bool)>),
    /// The link to Redis is back after an outage: values learnt from the others are no
    /// longer current (before any message of the new connection: same queue).
    Reconnected,
    /// A session of this core changed in Redis unseen here (a change missed, resync.rs): its
    /// accesses as Redis holds them at version `v`, in place of the copy's.
    Reload { session: SessionId, v: u64, accesses: Vec<SharedOp> },
    /// This core's applied marks (source partition → sequence number), for checkpoints;
    /// also how the lease task knows the core is alive (a core that answers no longer is
    /// stalled, see cluster/lease.rs).
    Applied(oneshot::Sender<Vec<(Box<str>, i64)>>),
    /// Another instance's read of a device of this core: the typed view (as the admin key
    /// reads it; the asking instance filters by its session's grants) and how new the data is.
    /// `None` when the data here is not newer than `newer_than` (the asker's own copy).
    Read { device: Box<str>, kind: wire::ReadKind, newer_than: Option<Millis>, reply: oneshot::Sender<Option<(Millis, View)>> },
    /// Another instance's recovery history for a session of this core (adopt.rs), charged
    /// `charged` bytes to `Stats::inbound_bytes` until the core has installed it; `None`: it
    /// would have passed `--redis-inbound-bytes`, so it is refused.
    Adopt { session: SessionId, blob: Option<Vec<u8>>, charged: u64 },
    /// A handed session's adopter watches its devices: a mark to its session's core after
    /// this core's earlier deliveries (adopt.rs).
    /// `device`: on a cluster, the device whose channel brought it (marks are counted per
    /// device there, per core on one Redis).
    AdoptMark { session: SessionId, cores: usize, device: Option<Box<str>> },
    /// The verdict on a history adopted here (a `tail` charged to `--redis-inbound-bytes`
    /// by `charged` until the core has read it).
    AdoptVerdict { session: SessionId, kept: bool, tail: Option<Vec<u8>>, charged: u64 },
    /// Instance `to` asks for the history of a session of this core (step 6b).
    Give { session: SessionId, to: Arc<str> },
    /// No history is coming for the session: its waiting CONNECTs go on.
    TakeDone { session: SessionId },
    /// Instance `to` asks what this core's rings hold of `devices` after their cuts, for
    /// `session` (its core `reply_core` there); one of `of` answers (ringask.rs).
    RingsAsk { to: Arc<str>, session: SessionId, reply_core: u32, of: u32, devices: Vec<(Arc<str>, Option<u32>)> },
    /// Another instance's answer to this core's ask (ringask.rs), charged `charged` bytes to
    /// `Stats::inbound_bytes` until read here.
    RingsAnswer { payload: Vec<u8>, charged: u64 },
}

/// A change to one session's access on one device (see [`Command::Change`]).
#[derive(Debug, Clone)]
pub enum AccessChange {
    Grant(crate::model::Grant),
    Revoke(crate::model::Grant),
    Subscribe(crate::model::Subscription),
    Unsubscribe(crate::model::Subscription),
}

impl AccessChange {
    /// Applies the change; whether it was permitted.
    pub fn apply(&self, access: &mut crate::shard::access::Access) -> bool {
        match self {
            AccessChange::Grant(g) => {
                access.add_grant(g);
                true
            }
            AccessChange::Revoke(g) => {
                access.revoke(g);
                true
            }
            AccessChange::Subscribe(s) => access.subscribe(s),
            AccessChange::Unsubscribe(s) => access.unsubscribe(s),
        }
    }
}

/// Counters of the link, read by `GET /metrics`.
#[derive(Default)]
pub struct Stats {
    pub connected: AtomicU64,
    pub published: AtomicU64,
    /// Pipelines of device messages sent (`PUBLISH`es on one Redis; one per master on a
    /// cluster): publications queued together go together (queue.rs, `coalesce`).
    pub publish_pipelines: AtomicU64,
    pub received: AtomicU64,
    pub dropped: AtomicU64,
    pub undecodable: AtomicU64,
    pub reconnects: AtomicU64,
    /// Watches (instance, device) corrected by reading the instances' `watching` sets: an
    /// announcement on the `watch` channel was missed (link.rs, `check_watches`).
    pub watch_resyncs: AtomicU64,
    /// Held sessions whose version was read from Redis (resync.rs), and those read again
    /// (or dropped, deleted) because a change to them had been missed.
    pub sessions_checked: AtomicU64,
    pub sessions_reloaded: AtomicU64,
    /// Device messages received again (a sequence number not newer than the last applied
    /// from its origin for its device: published again after a slot move), not applied.
    pub duplicates: AtomicU64,
    /// A Redis Cluster: messages published again because fewer instances received them than
    /// watch their device (a slot moving), and those given up after 2 s or past the bounds.
    pub republished: AtomicU64,
    pub republish_given_up: AtomicU64,
    /// A Redis Cluster: other instances the publisher no longer counts as watchers, their
    /// presence not renewed for a heartbeat and a second (resend.rs, `Probe`).
    pub dead_watchers: AtomicU64,
    /// Queries of who is dead started (resend.rs, `Probe`), and 1 while one waits for its
    /// answer: the publications never wait for it, so a test sees one go out meanwhile.
    pub dead_probes: AtomicU64,
    pub dead_probe_pending: AtomicU64,
    pub instances: AtomicU64,
    /// Charged bytes of the device rings of every core (ring.rs; wrapping adds of signed
    /// changes).
    pub ring_bytes: AtomicU64,
    pub watched_here: AtomicU64,
    pub watched_elsewhere: AtomicU64,
    pub leases: AtomicU64,
    pub takeovers: AtomicU64,
    pub replayed: AtomicU64,
    /// Cores of this instance that have not answered for 3 × `--lease-ttl` (cluster/lease.rs).
    pub stalled: AtomicU64,
    /// Bytes received from Redis that the cores have not taken yet (bounded by
    /// `--redis-inbound-bytes`, see `link::pubsub`), and the times the bound was passed.
    pub inbound_bytes: AtomicU64,
    pub overruns: AtomicU64,
    /// A Redis Cluster's sharded pub/sub (cluster/shards.rs): masters in the slot map,
    /// subscriber connections open, slot moves seen, resubscriptions per reason, map reads.
    pub cluster_masters: AtomicU64,
    pub shard_connections: AtomicU64,
    pub slot_moves: AtomicU64,
    pub resubscribes: [AtomicU64; 5],
    pub topology_refreshes: AtomicU64,
    /// Recovery histories handed over and adopted, by outcome (`adopt::OUTCOMES`).
    pub adoptions: [AtomicU64; 14],
    /// Bytes of the commands waiting for the Redis thread (bounded by `--redis-command-bytes`,
    /// cluster/queue.rs), and the commands refused because the queue was full.
    pub command_bytes: AtomicU64,
    pub commands_refused: AtomicU64,
}

/// How long a graceful stop waits for its partition leases to be handed over.
const LEAVE_WAIT: Duration = Duration::from_secs(3);

pub struct Cluster {
    pub instance: Arc<str>,
    pub stats: Arc<Stats>,
    commands: queue::Sender,
    /// Each core takes its queue once, at start (never touched on the message path).
    inbound: Mutex<Vec<Option<async_channel::Receiver<Inbound>>>>,
    refresh: Duration,
    /// How long [`Cluster::leave`] waits for the verdicts on histories handed over.
    settle_wait: Duration,
    /// What the Redis thread takes when it starts.
    link: Mutex<Option<LinkParts>>,
    owned: tokio::sync::watch::Receiver<Owned>,
    /// On a Redis Cluster (`--redis-cluster-nodes`).
    cluster: bool,
}

type LinkParts = (link::Options, queue::Receiver, Vec<async_channel::Sender<Inbound>>, tokio::sync::watch::Sender<Owned>);

impl Cluster {
    /// Prepares the link; [`Cluster::run`] starts its thread once the process is assembled.
    /// `Err` names what is wrong with `--redis-ca-file` or the engine's URLs.
    pub fn new(settings: &Settings, engine: Engine) -> Result<Arc<Self>, String> {
        let c = &settings.config;
        let instance: Arc<str> = match &c.instance_id {
            Some(id) => id.as_str().into(),
            None => format!("{:016x}", u64::from_le_bytes(random8())).into(),
        };
        let grace = settings.session_grace_period();
        let refresh = (grace / 3).clamp(Duration::from_millis(50), Duration::from_secs(60));
        let stats: Arc<Stats> = Arc::default();
        let (commands, command_rx) = queue::bounded(stats.clone(), c.redis_command_bytes);
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..settings.cores).map(|_| async_channel::bounded(INBOUND)).unzip();
        let ca = match &c.redis_ca_file {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| format!("--redis-ca-file {}: {e}", path.display()))?;
                if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
                    return Err(format!("--redis-ca-file {}: no PEM certificate in it", path.display()));
                }
                Some(pem)
            }
            None => None,
        };
        conn::check(&engine, ca.as_deref())?;
        let options = link::Options {
            names: names::Names::new(&c.redis_prefix, engine.is_cluster()),
            engine,
            ca,
            instance: instance.clone(),
            session_ttl: grace + 2 * refresh + Duration::from_secs(1),
            lease_ttl: Duration::from_secs(c.lease_ttl),
            inbound_bytes: c.redis_inbound_bytes,
            refresh,
        };
        let (owned_tx, owned) = tokio::sync::watch::channel(Owned::default());
        Ok(Arc::new(Self {
            instance,
            stats,
            commands,
            inbound: Mutex::new(receivers.into_iter().map(Some).collect()),
            refresh,
            settle_wait: settings.recovery_settle_wait(),
            cluster: options.engine.is_cluster(),
            link: Mutex::new(Some((options, command_rx, senders, owned_tx))),
            owned,
        }))
    }

    /// Starts the Redis thread; `status` is told when the link is up (`None`) or down (why),
    /// for `GET /status`.
    pub fn run(&self, status: impl Fn(Option<String>) + Send + 'static) -> std::io::Result<()> {
        let Some((options, commands, cores, owned)) = self.link.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        link::start(options, commands, cores, owned, self.stats.clone(), Box::new(status))
    }

    /// The event stream consumer's side of partition leases: it names its stream and
    /// partitions at every connect, and reads only the partitions in [`Owned`] (watched).
    pub fn stream(&self, plan: StreamPlan) -> bool {
        self.commands.try_send(Command::Stream(plan)).is_ok()
    }

    /// Graceful shutdown, once the event stream consumer has stopped: checkpoints what the
    /// cores applied, gives every partition lease up and leaves Redis, so the other instances
    /// take the partitions over at their next heartbeat with no event applied twice. Waits
    /// at most 3 s (and never past `deadline`).
    pub fn leave(&self, deadline: std::time::Instant) {
        // Recovery histories handed over (adopt.rs) get their verdicts first: they need this
        // instance's cores and link, both still up. At most `--recovery-handoff-wait`; the adopters
        // void the rest.
        let (settled, wait) = std::sync::mpsc::channel();
        if self.commands.try_send(Command::Settle(settled)).is_ok() {
            // The leases' hand-over below keeps its 3 s of the deadline whatever the wait is set
            // to: partitions left to expire would stall for a lease TTL.
            let left = deadline.saturating_duration_since(std::time::Instant::now()).saturating_sub(LEAVE_WAIT).min(self.settle_wait);
            if wait.recv_timeout(left).is_err() {
                tracing::warn!("recovery histories handed over without a verdict in time: their adopters drop them");
            }
        }
        // The stopping side's outcomes are counted after the listener closed: no scrape sees
        // them, so they are logged once here (since the start; received..refused are the
        // adopter's and were scraped while it ran).
        let n = |i: usize| self.stats.adoptions[i].load(Ordering::Relaxed);
        if (adopt::SENT..=adopt::UNSUPPORTED).any(|i| n(i) > 0) {
            tracing::info!(
                sent = n(adopt::SENT),
                kept = n(adopt::KEPT),
                voided = n(adopt::VOIDED),
                tail_sent = n(adopt::TAIL_SENT),
                refused_by_peer = n(adopt::REFUSED_BY_PEER),
                no_peer = n(adopt::NO_PEER),
                too_large = n(adopt::TOO_LARGE),
                over_bound = n(adopt::OVER_BOUND),
                unsupported = n(adopt::UNSUPPORTED),
                "recovery histories of this instance by outcome (hubcast_redis_adoptions_total; the stop's are never scraped)"
            );
        }
        let (done, left) = std::sync::mpsc::channel();
        if self.commands.try_send(Command::Leave(done)).is_ok() {
            let wait = deadline.saturating_duration_since(std::time::Instant::now()).min(LEAVE_WAIT);
            if left.recv_timeout(wait).is_err() {
                tracing::warn!("could not hand the partition leases over in time; the others take them when they expire");
            }
        }
    }

    pub fn owned(&self) -> tokio::sync::watch::Receiver<Owned> {
        self.owned.clone()
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T, String>>) -> Command) -> Result<T, String> {
        let (tx, rx) = oneshot::channel();
        if self.commands.try_send(make(tx)).is_err() {
            return Err("too many changes waiting for Redis".into());
        }
        match monoio::time::timeout(Duration::from_secs(10), rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err("the Redis link stopped".into()),
            Err(_) => Err("Redis did not answer within 10 s".into()),
        }
    }

    /// Writes a change to Redis and publishes it to the other instances.
    pub async fn save(&self, op: SharedOp) -> Checked<bool> {
        self.call(|reply| Command::Save { op, reply }).await.map_err(unavailable)
    }

    /// Metrics of the link, as `GET /metrics` series.
    pub fn series(&self) -> crate::metrics::ExternalSeries {
        let s = &self.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let label = format!("{{instance=\"{}\"}}", self.instance);
        let owned: Vec<(String, String, String, u64)> = self
            .owned
            .borrow()
            .partitions
            .keys()
            .map(|p| {
                let labels = format!("{{instance=\"{}\",partition=\"{p}\"}}", self.instance);
                ("hubcast_redis_partition_owned".to_string(), "1 for each event stream partition this instance reads (holds the lease on).".to_string(), labels, 1)
            })
            .collect();
        owned.into_iter().chain(vec![
            ("hubcast_redis_connected".into(), "1 while the link to Redis is up.".into(), label.clone(), get(&s.connected)),
            ("hubcast_redis_instances".into(), "Live hubcast instances seen on Redis, this one included.".into(), label.clone(), get(&s.instances)),
            ("hubcast_redis_watched_devices".into(), "Devices this instance receives from the others (a socket here subscribes).".into(), label.clone(), get(&s.watched_here)),
            ("hubcast_redis_watched_elsewhere_devices".into(), "Devices other instances watch: their messages ingested here are published.".into(), label.clone(), get(&s.watched_elsewhere)),
            ("hubcast_redis_published_total".into(), "Device messages published to Redis for other instances.".into(), label.clone(), get(&s.published)),
            ("hubcast_redis_publish_pipelines_total".into(), "Pipelines of device messages sent to Redis (one per master on a cluster); publications queued together share one.".into(), label.clone(), get(&s.publish_pipelines)),
            ("hubcast_redis_received_total".into(), "Device messages received from other instances through Redis.".into(), label.clone(), get(&s.received)),
            ("hubcast_redis_dropped_total".into(), "Device messages not published: the link's queue was full or Redis was down.".into(), label.clone(), get(&s.dropped)),
            ("hubcast_redis_undecodable_total".into(), "Payloads from Redis that did not decode (skipped).".into(), label.clone(), get(&s.undecodable)),
            ("hubcast_redis_partition_leases".into(), "Event stream partitions this instance holds a lease on (and reads).".into(), label.clone(), get(&s.leases)),
            ("hubcast_redis_partition_takeovers_total".into(), "Partition leases taken that another instance held before (it left, died, or gave it up to balance); events after its last checkpoint may be applied twice.".into(), label.clone(), get(&s.takeovers)),
            ("hubcast_redis_partition_replayed_events_total".into(), "Events read again after taking a partition over: the previous holder had handed them to its cores past its last checkpoint (at its last heartbeat; at most a heartbeat more).".into(), label.clone(), get(&s.replayed)),
            ("hubcast_redis_stalled_cores".into(), "Cores of this instance silent for 3 x --lease-ttl: while any is, the instance holds no partition lease.".into(), label.clone(), get(&s.stalled)),
            ("hubcast_redis_reconnects_total".into(), "Times the link to Redis was lost and made again.".into(), label.clone(), get(&s.reconnects)),
            ("hubcast_redis_inbound_bytes".into(), "Bytes received from Redis that the cores have not taken yet (bounded by --redis-inbound-bytes).".into(), label.clone(), get(&s.inbound_bytes)),
            ("hubcast_redis_command_bytes".into(), "Bytes of the commands (publications, changes, reads) waiting for the Redis thread (bounded by --redis-command-bytes).".into(), label.clone(), get(&s.command_bytes)),
            ("hubcast_redis_commands_refused_total".into(), "Commands refused because the queue to the Redis thread was full (1,024 commands or --redis-command-bytes): a publication dropped, a change answered 503.".into(), label.clone(), get(&s.commands_refused)),
            ("hubcast_redis_overruns_total".into(), "Times the cores fell --redis-inbound-bytes behind what Redis sent: the subscriber was dropped and made again (messages meanwhile lost, as in an outage).".into(), label.clone(), get(&s.overruns)),
            ("hubcast_redis_duplicates_dropped_total".into(), "Device messages received again from another instance (published again after a slot move) and not applied twice.".into(), label.clone(), get(&s.duplicates)),
            ("hubcast_recovery_ring_bytes".into(), "Charged bytes of the device rings kept for rebuilding a history on this instance after another died (docs/design/recovery.md steps 10-11; bounded per core by --recovery-core-bytes).".into(), label.clone(), get(&s.ring_bytes)),
            ("hubcast_redis_watch_resyncs_total".into(), "Watches (instance, device) corrected by reading the instances' watching sets: an announcement on the watch channel was missed.".into(), label.clone(), get(&s.watch_resyncs)),
            ("hubcast_redis_sessions_checked_total".into(), "Sessions held here whose version was read from Redis: all of them after each (re)connect, and those with a change missing.".into(), label.clone(), get(&s.sessions_checked)),
            ("hubcast_redis_sessions_reloaded_total".into(), "Sessions held here read again from Redis (or dropped, deleted) because a change to them was missed: published while the link was down, or never published.".into(), label.clone(), get(&s.sessions_reloaded)),
        ])
        .chain(adopt::OUTCOMES.iter().enumerate().map(|(i, outcome)| {
            let labels = format!("{{instance=\"{}\",outcome=\"{outcome}\"}}", self.instance);
            ("hubcast_redis_adoptions_total".to_string(), "Recovery histories at SIGTERM (docs/design/recovery.md step 6), by outcome: handed over (sent, kept, voided, tail_sent, refused_by_peer) or not (no_peer, too_large, over_bound; unsupported: no longer counted), and taken in from a stopping instance (received, confirmed, stitched, lost, refused).".to_string(), labels, get(&s.adoptions[i]))
        }))
        .chain(self.cluster_series(&label))
        .collect()
    }
}

impl Cluster {
    /// A Redis Cluster's series (none on one Redis).
    fn cluster_series(&self, label: &str) -> Vec<(String, String, String, u64)> {
        if !self.cluster {
            return Vec::new();
        }
        let s = &self.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out: Vec<(String, String, String, u64)> = vec![
            ("hubcast_redis_cluster_masters".into(), "Masters in the Redis Cluster's slot map as last read.".into(), label.to_string(), get(&s.cluster_masters)),
            ("hubcast_redis_pubsub_connections".into(), "Pub/sub connections open: one for control channels, at most one sharded subscriber per master.".into(), label.to_string(), get(&s.shard_connections) + get(&s.connected)),
            ("hubcast_redis_slot_moves_total".into(), "Device channels a master unsubscribed unasked (their slot moved): subscribed again on the new master.".into(), label.to_string(), get(&s.slot_moves)),
            ("hubcast_redis_topology_refreshes_total".into(), "Times the slot map was read (CLUSTER SLOTS).".into(), label.to_string(), get(&s.topology_refreshes)),
            ("hubcast_redis_republished_total".into(), "Device messages published again: fewer instances received them than watch their device (its slot was moving, or a watcher was killed and not yet known dead).".into(), label.to_string(), get(&s.republished)),
            ("hubcast_redis_republish_given_up_total".into(), "Device messages no longer published again: still short of their watchers after 2 s, or past the bounds of what waits (64 messages or 256 KiB a device, 16 MiB in all).".into(), label.to_string(), get(&s.republish_given_up)),
            ("hubcast_redis_dead_watchers".into(), "Other instances not counted as watchers of device messages at the last probe (made while messages wait for their watchers, and every second while any is counted here): their presence was not renewed for a heartbeat and a second (killed or frozen, its presence not yet expired).".into(), label.to_string(), get(&s.dead_watchers)),
            ("hubcast_redis_dead_probes_total".into(), "Queries of who is dead started (while device messages wait for their watchers, and every second while an instance is counted dead).".into(), label.to_string(), get(&s.dead_probes)),
            ("hubcast_redis_dead_probe_pending".into(), "1 while a query of who is dead waits for its answer (at most 1 s; publications go on meanwhile): long stretches of 1 mean the master holding the instances key is slow.".into(), label.to_string(), get(&s.dead_probe_pending)),
        ];
        for (i, reason) in shards::REASONS.iter().enumerate() {
            let labels = format!("{{instance=\"{}\",reason=\"{reason}\"}}", self.instance);
            out.push(("hubcast_redis_resubscribes_total".into(), "Device channels subscribed again, by why: moved (MOVED), sunsubscribe (a slot move), reconnect (a subscriber lost), desync (a reply that was not its confirmation), full (the push queue was full).".into(), labels, get(&s.resubscribes[i])));
        }
        out
    }
}

fn random8() -> [u8; 8] {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    b
}

fn unavailable(reason: String) -> Rejection {
    Rejection::new(503, format!("Redis unavailable: {reason}; the change may be applied on this instance only, retry"))
}

/// Per core: the relay (app/relay.rs) and the task applying what other instances send.
impl CorePlugin for Cluster {
    fn start(self: Arc<Self>, core: &Rc<Core>) {
        core.set_directory(Rc::new(Redis(self.clone())));
        let Some(inbound) = self.inbound.lock().unwrap_or_else(|e| e.into_inner()).get_mut(core.index).and_then(Option::take) else {
            return;
        };
        {
            let mut devices = core.devices.borrow_mut();
            devices.track_watches();
            let loaded = devices.loaded_not_current();
            if loaded > 0 {
                tracing::info!(core = core.index, devices = loaded, "values loaded from the durable store are not current: reads ask the other instances for newer data until each device's next message");
            }
        }
        monoio::spawn(follow_partitions(core.clone(), self.owned()));
        let relay = Rc::new(CoreRelay {
            owned: self.owned(),
            instance: self.instance.clone(),
            commands: self.commands.clone(),
            stats: self.stats.clone(),
            remote: RefCell::default(),
            outbox: RefCell::default(),
            pending_watch: RefCell::default(),
            // From the clock, so that an instance started again under the same id goes on
            // above what it published before (one message per nanosecond would catch up).
            seq: std::cell::Cell::new(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)),
            cluster: self.cluster,
            adopt_blob_max: adopt::blob_max(core.settings.config.recovery_session_bytes),
            adopt_budget: std::cell::Cell::new(adopt::SEND_BYTES / core.cores().max(1)),
            rings: core.recovery.window.map(|w| RefCell::new(ring::Rings::new(w, core.recovery.core_bytes))),
            heartbeat: (Duration::from_secs(core.settings.config.lease_ttl) / 3).clamp(Duration::from_millis(100), Duration::from_secs(2)),
        });
        *core.relay.borrow_mut() = Some(relay.clone());
        core.recovery.cuts.set(core.recovery.window.is_some());
        monoio::spawn(serve(core.clone(), relay, inbound));
        monoio::spawn(refresh(core.clone(), self.commands.clone(), self.refresh));
    }
}

struct CoreRelay {
    /// The partitions this instance reads (the lease holder's, on the Redis thread).
    owned: tokio::sync::watch::Receiver<Owned>,
    instance: Arc<str>,
    commands: queue::Sender,
    stats: Arc<Stats>,
    /// Devices of this core that another instance watches.
    remote: RefCell<HashSet<Box<str>>>,
    outbox: RefCell<Outbox>,
    /// Watch changes the command queue had no room for (latest per device), sent later.
    pending_watch: RefCell<HashMap<Box<str>, bool>>,
    /// The last sequence number published from this core (wire v2): a device's messages
    /// all go through its one core, so each device's numbers grow.
    seq: std::cell::Cell<u64>,
    /// On a Redis Cluster (rings answers on device channels: ringask.rs).
    cluster: bool,
    /// The largest recovery history handed over, and what this core may still send (adopt.rs).
    adopt_blob_max: usize,
    adopt_budget: std::cell::Cell<usize>,
    /// Device rings (ring.rs, design step 10); `None` with recovery off.
    rings: Option<RefCell<ring::Rings>>,
    /// How often every instance renews its presence (`--lease-ttl` / 3, 100 ms to 2 s).
    heartbeat: Duration,
}

#[derive(Default)]
struct Outbox {
    items: Vec<(Box<str>, Vec<u8>)>,
    bytes: usize,
}

impl Relay for CoreRelay {
    fn ring_after(&self, device: &str, cut: Option<u32>) -> Result<Vec<Kept>, RingMiss> {
        let Some(rings) = &self.rings else { return Err(RingMiss::Lost("recovery is off".into())) };
        let rings = rings.borrow();
        let now = std::time::Instant::now();
        rings.after(device, cut, now).map_err(|lost| match lost {
            ring::Lost::CutNotHeld => RingMiss::NotHeld { origin: rings.holds_here(device, now) },
            lost => RingMiss::Lost(format!("{lost:?}")),
        })
    }

    fn ring_lead(&self, device: &str, cut: u32, quiet: Duration) -> Option<(Vec<Kept>, bool)> {
        self.rings.as_ref()?.borrow().lead(device, cut, std::time::Instant::now(), quiet)
    }

    fn rings_ask(&self, session: SessionId, reply_core: usize, devices: &[(Arc<str>, Option<u32>)]) -> bool {
        // After this core's watch changes (same queue): refused when they could not be sent.
        self.send_pending_watch();
        if !self.pending_watch.borrow().is_empty() {
            return false;
        }
        let payload = ringask::encode_ask(&self.instance, session, reply_core as u32, devices);
        self.commands.try_send(Command::RingsAsk(payload)).is_ok()
    }

    fn peers_staleness(&self) -> Option<oneshot::Receiver<crate::app::relay::Staleness>> {
        let (tx, rx) = oneshot::channel();
        self.commands.try_send(Command::Staleness(tx)).ok()?;
        Some(rx)
    }

    fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    fn ring(&self, msg: &IngestMessage, here: bool, now: std::time::Instant, decided: &dyn Fn() -> Decided) {
        let Some(rings) = &self.rings else { return };
        let watched = here && self.remote.borrow().contains(&*msg.device_id);
        let mut rings = rings.borrow_mut();
        if !rings.may_keep(&msg.device_id, here, watched) {
            return;
        }
        let change = rings.note(msg, decided, here, watched, now);
        if change != 0 {
            self.stats.ring_bytes.fetch_add(change as u64, Ordering::Relaxed);
        }
    }

    fn offer(&self, msg: &IngestMessage) {
        if !self.remote.borrow().contains(&*msg.device_id) {
            return;
        }
        let mut outbox = self.outbox.borrow_mut();
        // Bounded: beyond it the message is not published (counted), never queued unbounded.
        if outbox.items.len() >= OUTBOX_MESSAGES || outbox.bytes + msg.body.len() > OUTBOX_BYTES {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let seq = self.seq.get() + 1;
        self.seq.set(seq);
        let payload = wire::encode_message(&self.instance, seq, msg);
        outbox.bytes += payload.len();
        outbox.items.push((msg.device_id.clone(), payload));
    }

    fn flush(&self) {
        let items = {
            let mut outbox = self.outbox.borrow_mut();
            outbox.bytes = 0;
            std::mem::take(&mut outbox.items)
        };
        if !items.is_empty() {
            let n = items.len() as u64;
            if self.commands.try_send(Command::Publish(items)).is_err() {
                self.stats.dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
        self.send_pending_watch();
    }

    /// A plain broker's queue has no lease (every instance takes a share of its messages,
    /// so none holds a device's current value alone): never read here alone, so its values
    /// are not current and reads ask the others (the freshest wins).
    fn reads_partition(&self, partition: &str) -> bool {
        self.owned.borrow().partitions.contains_key(partition)
    }

    fn watch(&self, changes: Vec<(Box<str>, bool)>) {
        let mut pending = self.pending_watch.borrow_mut();
        for (device, on) in changes {
            pending.insert(device, on);
        }
        drop(pending);
        self.send_pending_watch();
    }

    /// Bounded (adopt.rs): what is not sent stays with this instance, counted by why.
    fn adopt(&self, session: SessionId, devices: Vec<Box<str>>, blob: Vec<u8>, left: Duration, to: Option<&str>) -> bool {
        // A stop's hand-over is charged to its budget; an instance asked by name (step 6b)
        // gives one history per CONNECT asking (bounded by the connections).
        let charged = if to.is_some() { 0 } else { blob.len() };
        let outcome = if self.stats.instances.load(Ordering::Relaxed) <= 1 {
            Some(adopt::NO_PEER)
        } else if blob.len() > self.adopt_blob_max {
            Some(adopt::TOO_LARGE)
        } else if charged > self.adopt_budget.get() {
            Some(adopt::OVER_BOUND)
        } else {
            None
        };
        if let Some(outcome) = outcome {
            self.stats.adoptions[outcome].fetch_add(1, Ordering::Relaxed);
            tracing::info!(session = %session, bytes = blob.len(), outcome = adopt::OUTCOMES[outcome], "recovery history not handed over: its client will not recover elsewhere");
            return false;
        }
        let to = to.map(Arc::from);
        if self.commands.try_send(Command::Adopt { session, devices, blob, left, to }).is_err() {
            self.stats.adoptions[adopt::OVER_BOUND].fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.adopt_budget.set(self.adopt_budget.get() - charged);
        true
    }

    fn take(&self, session: SessionId) {
        // Not sent (the queue full): the CONNECT waits its time and goes on without it.
        let _ = self.commands.try_send(Command::Take { session });
    }

    fn give_none(&self, session: SessionId, to: &str) {
        let _ = self.commands.try_send(Command::GiveNone { session, to: to.into() });
    }

    fn adopt_verdict(&self, session: SessionId, kept: bool, tail: Option<Vec<u8>>) {
        // A stop's tails are charged to its hand-over budget with its histories (Redis would
        // drop the adopter's subscriber past its pub/sub output buffer); one past it is not
        // sent, the verdict is `voided`. An instance asked by name (step 6b) is bounded by
        // the CONNECTs asking, as its histories are.
        let tail = tail.filter(|t| {
            if !crate::shutdown::STOPPING.is_stopping() {
                return true;
            }
            let fits = t.len() <= self.adopt_budget.get();
            if fits {
                self.adopt_budget.set(self.adopt_budget.get() - t.len());
            } else {
                tracing::info!(session = %session, bytes = t.len(), "a hand-over's tail past the stop's budget is not sent: voided (its client gets recovered false)");
            }
            fits
        });
        let verdict = Command::AdoptVerdict { session, kept, tail };
        if let Err(e) = self.commands.try_send(verdict) {
            // Never dropped: the adopter would wait its full time and void the history. A
            // tail is not kept waiting for room (the verdict goes as `voided`).
            let e = match e {
                Command::AdoptVerdict { session, kept, .. } => Command::AdoptVerdict { session, kept, tail: None },
                other => other,
            };
            let commands = self.commands.clone();
            monoio::spawn(async move {
                let _ = commands.send(e).await;
            });
        }
    }

    /// After this core's watch changes (sent first, in the same queue): when they could not
    /// be sent (the queue full), the adoption is refused rather than claimed on a device
    /// this instance may not receive yet.
    fn adopt_watching(&self, session: SessionId, cores: usize) {
        self.send_pending_watch();
        let cores = if self.pending_watch.borrow().is_empty() { cores } else { 0 };
        let report = Command::AdoptWatching { session, cores };
        if let Err(e) = self.commands.try_send(report) {
            let commands = self.commands.clone();
            monoio::spawn(async move {
                let _ = commands.send(e).await;
            });
        }
    }
}

impl CoreRelay {
    /// A Redis Cluster's answer to instance `to`'s ask: one per device, each on the device's
    /// own channel behind this core's earlier publications of it (design step 11 h): the
    /// outbox goes first, then the answers, each numbered in this core's sequence of device
    /// messages. Bounded as on one Redis (an answer past `adopt_blob_max` is a refusal; the
    /// command queue full: not sent, the asker's deadline refuses).
    /// Returns its outcome by `metrics::RING_ANSWERS` (over_bound when a device's answer was
    /// replaced by a refusal).
    fn answer_on_devices(&self, to: &str, session: SessionId, reply_core: u32, of: u32, parts: Vec<(Arc<str>, ringask::Part)>) -> usize {
        self.flush();
        let mut outcome = 0;
        let items: Vec<(Box<str>, Vec<u8>)> = parts
            .into_iter()
            .map(|(device, part)| {
                let mut answer = ringask::encode_answer(&self.instance, session, reply_core, of, &Ok(vec![(device.clone(), part)]));
                if answer.len() > self.adopt_blob_max {
                    answer = ringask::encode_answer(&self.instance, session, reply_core, of, &Err(format!("over {} bytes", self.adopt_blob_max)));
                    outcome = 1;
                }
                let seq = self.seq.get() + 1;
                self.seq.set(seq);
                (Box::from(&*device), ringask::encode_on_device(to, &self.instance, seq, &answer))
            })
            .collect();
        if self.commands.try_send(Command::Publish(items)).is_err() {
            tracing::debug!(session = %session, "a rings answer was not sent: the Redis command queue is full");
            outcome = 2;
        }
        outcome
    }

    /// Bounded by the devices of this core: one pending entry per device at most.
    fn send_pending_watch(&self) {
        let mut pending = self.pending_watch.borrow_mut();
        if pending.is_empty() {
            return;
        }
        let changes: Vec<_> = pending.drain().collect();
        if let Err(Command::Watch(changes)) = self.commands.try_send(Command::Watch(changes)) {
            pending.extend(changes);
        }
    }
}

/// Applies what the Redis thread hands this core.
async fn serve(core: Rc<Core>, relay: Rc<CoreRelay>, inbound: async_channel::Receiver<Inbound>) {
    while let Ok(item) = inbound.recv().await {
        match item {
            Inbound::Op(op, done) => {
                // Awaited here: this core's later inbound items (the device's messages) wait
                // until the change is in force.
                apply_remote(&core, op).await;
                if let Some(done) = done {
                    let _ = done.send(());
                }
            }
            Inbound::Messages(batch) => {
                // Charged by the link when it queued them (`link::flush_messages`).
                let charged: usize = batch.iter().map(IngestMessage::charge).sum();
                core.mesh.wait_for_room().await;
                core.ingest_replicas(batch);
                relay.stats.inbound_bytes.fetch_sub(charged as u64, Ordering::Relaxed);
            }
            Inbound::Applied(reply) => {
                let _ = reply.send(core.applied.borrow().iter().map(|(k, v)| (k.clone(), *v)).collect());
            }
            Inbound::Read { device, kind, newer_than, reply } => {
                // On this, the device's core: read as the admin, typed (the link encodes it);
                // nothing when the data here is not newer than the asker's own copy.
                let viewer = Viewer::Admin;
                let found = match kind {
                    wire::ReadKind::Telemetry(key) => {
                        let asked = ask(|reply| DeviceOp::ReadTelemetry { device, key, viewer, reply });
                        core.ask_device(asked).await.and_then(Result::ok).map(|l| (l.newest, View::Telemetry(l.view)))
                    }
                    wire::ReadKind::Twin => {
                        let asked = ask(|reply| DeviceOp::ReadTwin { device, viewer, reply });
                        core.ask_device(asked).await.and_then(Result::ok).map(|l| (l.newest, View::Twin(l.view)))
                    }
                    wire::ReadKind::ConnectionState => {
                        let asked = ask(|reply| DeviceOp::ReadConnectionState { device, viewer, reply });
                        core.ask_device(asked).await.and_then(Result::ok).map(|l| (l.newest, View::Connection(l.view)))
                    }
                };
                let _ = reply.send(found.filter(|(newest, _)| newer_than.is_none_or(|t| *newest > t)));
            }
            Inbound::Adopt { session, blob, charged } => {
                monoio::spawn(adopt::adopt_here(core.clone(), session, blob, charged, relay.stats.clone()));
            }
            Inbound::AdoptMark { session, cores, device } => adopt::mark(&core, session, cores, device),
            Inbound::Give { session, to } => core.give_stream(session, &to),
            Inbound::TakeDone { session } => core.recovery_take_done(session),
            Inbound::RingsAsk { to, session, reply_core, of, devices } => {
                let parts: Vec<(Arc<str>, ringask::Part)> = devices
                    .into_iter()
                    .map(|(device, cut)| {
                        let part = match core.ring_read(relay.ring_after(&device, cut)) {
                            Ok(msgs) => ringask::Part::Msgs(msgs),
                            Err(miss) => ringask::Part::Miss(miss),
                        };
                        (device, part)
                    })
                    .collect();
                if relay.cluster {
                    let outcome = relay.answer_on_devices(&to, session, reply_core, of, parts);
                    crate::metrics::CoreMetrics::count(&core.metrics.ring_answers, outcome);
                } else {
                    // By `metrics::RING_ANSWERS`: sent, over_bound (a refusal sent instead), unsent.
                    let mut outcome = 0;
                    let mut payload = ringask::encode_answer(&relay.instance, session, reply_core, of, &Ok(parts));
                    if payload.len() > relay.adopt_blob_max {
                        payload = ringask::encode_answer(&relay.instance, session, reply_core, of, &Err(format!("over {} bytes", relay.adopt_blob_max)));
                        outcome = 1;
                    }
                    // What this core offered before it read its rings is published first.
                    relay.flush();
                    if relay.commands.try_send(Command::RingsAnswer { to, payload }).is_err() {
                        tracing::debug!(session = %session, "a rings answer was not sent: the Redis command queue is full");
                        outcome = 2;
                    }
                    crate::metrics::CoreMetrics::count(&core.metrics.ring_answers, outcome);
                }
            }
            Inbound::RingsAnswer { payload, charged } => {
                let decoded = ringask::decode_answer(&payload);
                drop(payload);
                relay.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
                match decoded {
                    Some((from, session, of, parts)) => {
                        let parts = parts.map(|parts| {
                            parts
                                .into_iter()
                                .map(|(device, part)| match part {
                                    ringask::Part::Msgs(msgs) => (device, Ok(msgs)),
                                    ringask::Part::Miss(miss) => (device, Err(miss)),
                                })
                                .collect()
                        });
                        core.rings_remote(session, from, of, parts);
                    }
                    None => {
                        relay.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Inbound::AdoptVerdict { session, kept, tail, charged } => {
                let verdict = core.adoption_verdict(session, kept, tail.as_deref());
                drop(tail);
                relay.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
                if let Some(verdict) = verdict {
                    let outcome = match verdict {
                        Verdict::Kept => adopt::CONFIRMED,
                        Verdict::Stitched => adopt::STITCHED,
                        Verdict::Voided => adopt::LOST,
                    };
                    relay.stats.adoptions[outcome].fetch_add(1, Ordering::Relaxed);
                    tracing::info!(session = %session, verdict = ?verdict, "recovery history adopted from a stopping instance");
                }
            }
            Inbound::Reload { session, v, accesses } => reload(&core, session, v, accesses).await,
            Inbound::Reconnected => {
                let marked = core.devices.borrow_mut().replicas_not_current();
                if marked > 0 {
                    tracing::info!(core = core.index, devices = marked, "values learnt from other instances before the Redis outage are no longer current: reads ask the others for newer data");
                }
            }
            Inbound::RemoteWatch(changes) => {
                // Counted here, once the core publishes accordingly (the metric tests wait on).
                let mut remote = relay.remote.borrow_mut();
                for (device, on) in changes {
                    if on {
                        if remote.insert(device) {
                            relay.stats.watched_elsewhere.fetch_add(1, Ordering::Relaxed);
                        }
                    } else if remote.remove(&device) {
                        relay.stats.watched_elsewhere.fetch_sub(1, Ordering::Relaxed);
                    }
                }
            }
        }
        relay.send_pending_watch();
    }
}

/// Follows the partitions this instance reads: when one is given up or taken by another
/// instance, the values this core ingested from it are no longer current (its new reader
/// has newer), so reads of those devices ask the others. `watch` is executor-agnostic.
async fn follow_partitions(core: Rc<Core>, mut owned: tokio::sync::watch::Receiver<Owned>) {
    while owned.changed().await.is_ok() {
        let read: HashSet<String> = owned.borrow_and_update().partitions.keys().cloned().collect();
        let marked = core.devices.borrow_mut().partitions_read(|p| read.contains(p));
        if marked > 0 {
            tracing::debug!(core = core.index, devices = marked, "partitions read elsewhere now: their devices' values here are no longer current");
        }
    }
}

/// Another instance's change, applied to the copy here (if this instance holds one).
async fn apply_remote(core: &Rc<Core>, op: SharedOp) {
    match op {
        SharedOp::Create(_) => {}
        SharedOp::Delete(id) => {
            local::delete(core, id).await;
        }
        SharedOp::DeleteAll => {
            local::delete_all(core).await;
        }
        SharedOp::Access { session, device, access } => {
            set_accesses(core, session, 0, vec![(device, access)]).await;
        }
        // Run on the devices' core (the link splits an op per core), which waits until it is
        // in force before taking its next inbound item.
        SharedOp::Accesses { session, v, changes } => {
            set_accesses(core, session, v, changes).await;
        }
    }
}

/// A session's whole access on some devices, at version `v`, into the copy here; waits until
/// it is in force. A session this instance holds no copy of drops it (false).
async fn set_accesses(core: &Rc<Core>, session: SessionId, v: u64, changes: Vec<(Box<str>, AccessOn)>) -> bool {
    let (ops, done): (Vec<DeviceOp>, Vec<_>) =
        changes.into_iter().map(|(device, access)| ask(|done| DeviceOp::SetAccess { device, session, access, v, done: Some(done) })).unzip();
    if !local::scoped(core, session, true, ops).await {
        return false;
    }
    for done in done {
        let _ = done.await;
    }
    true
}

/// Keeps the Redis keys of this core's sessions alive. The first list goes at start: the
/// sessions restored from the durable store are then known to the link, which checks them
/// against Redis at its next heartbeat (they may have changed while this instance was down,
/// cluster/resync.rs).
async fn refresh(core: Rc<Core>, commands: queue::Sender, every: Duration) {
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
            monoio::time::sleep(every).await;
        }
        if crate::shutdown::STOPPING.is_stopping() {
            return;
        }
        let ids = core.sessions.borrow().ids();
        if !ids.is_empty() {
            let _ = commands.try_send(Command::Refresh(ids));
        }
    }
}

/// The Redis engine of the session directory (app/directory.rs), installed on every core
/// by the plugin: each call is one of the functions below.
struct Redis(Arc<Cluster>);

impl Directory for Redis {
    fn ensure<'a>(&'a self, core: &'a Rc<Core>, session: SessionId) -> Pending<'a, bool> {
        Box::pin(ensure_session(&self.0, core, session))
    }

    fn refresh<'a>(&'a self, core: &'a Rc<Core>, session: SessionId) -> Pending<'a, bool> {
        Box::pin(refresh_session(&self.0, core, session))
    }

    fn create<'a>(&'a self, core: &'a Rc<Core>, id: SessionId) -> Pending<'a, bool> {
        Box::pin(create_session(&self.0, core, id))
    }

    fn delete<'a>(&'a self, core: &'a Rc<Core>, id: SessionId) -> Pending<'a, bool> {
        Box::pin(delete_session(&self.0, core, id))
    }

    fn delete_all<'a>(&'a self, core: &'a Rc<Core>) -> Pending<'a, ()> {
        Box::pin(delete_all(&self.0, core))
    }

    fn scoped<'a>(&'a self, core: &'a Rc<Core>, session: SessionId, register_devices: bool, ops: Vec<DeviceOp>) -> Pending<'a, bool> {
        Box::pin(scoped(&self.0, core, session, register_devices, ops))
    }

    fn read_elsewhere<'a>(&'a self, core: &'a Rc<Core>, viewer: Viewer, device: &'a str, kind: ReadKind, newer_than: Option<Millis>) -> Pending<'a, Option<(Millis, View)>> {
        Box::pin(read_elsewhere(&self.0, core, viewer, device, kind, newer_than))
    }

    fn membership(&self) -> Option<Membership> {
        Some(Membership {
            instance: self.0.instance.clone(),
            instances: self.0.stats.instances.load(Ordering::Relaxed),
            partitions: self.0.owned.borrow().partitions.keys().cloned().collect(),
        })
    }
}

/// The event stream consumer's partition leases, kept in Redis.
impl Leases for Cluster {
    fn stream(&self, plan: StreamPlan) -> bool {
        Cluster::stream(self, plan)
    }

    fn owned(&self) -> tokio::sync::watch::Receiver<Owned> {
        Cluster::owned(self)
    }
}

/// Makes sure this instance holds its copy of `session`, loading it from Redis when it does
/// not; false when the session exists nowhere.
async fn ensure_session(cluster: &Cluster, core: &Rc<Core>, session: SessionId) -> Checked<bool> {
    if local::scoped(core, session, false, Vec::new()).await {
        return Ok(true);
    }
    let loaded = cluster.call(|reply| Command::Load { session, reply }).await.map_err(unavailable)?;
    let Some((v, accesses)) = loaded else { return Ok(false) };
    // `false` is a session created meanwhile by a concurrent request, or the process at
    // maxSessions; the fill below tells them apart.
    local::create(core, session).await;
    if !install(core, session, v, accesses).await {
        return Err(Rejection::new(503, "session limit reached (maxSessions)"));
    }
    tracing::debug!(session = %session, "session loaded from Redis");
    Ok(true)
}

/// Takes a session's accesses as Redis holds them (at version `v`) into the copy here; false
/// without a copy.
async fn install(core: &Rc<Core>, session: SessionId, v: u64, accesses: Vec<SharedOp>) -> bool {
    let changes = accesses
        .into_iter()
        .filter_map(|op| match op {
            SharedOp::Access { device, access, .. } => Some((device, access)),
            _ => None,
        })
        .collect();
    set_accesses(core, session, v, changes).await
}

/// A session's accesses as Redis holds them at version `v`, in place of the copy here: every
/// device the copy knows that Redis no longer holds is emptied at `v` (a change missed may
/// have removed it). Nothing when the session is not held here.
async fn reload(core: &Rc<Core>, session: SessionId, v: u64, accesses: Vec<SharedOp>) {
    let mut changes: Vec<(Box<str>, AccessOn)> = accesses
        .into_iter()
        .filter_map(|op| match op {
            SharedOp::Access { device, access, .. } => Some((device, access)),
            _ => None,
        })
        .collect();
    let held: Vec<Box<str>> = {
        let sessions = core.sessions.borrow();
        let Some(record) = sessions.get(session) else { return };
        let in_redis: HashSet<&str> = changes.iter().map(|(d, _)| &**d).collect();
        record.devices.iter().filter(|d| !in_redis.contains(d)).map(Box::from).collect()
    };
    changes.extend(held.into_iter().map(|d| (d, None)));
    set_accesses(core, session, v, changes).await;
}

/// How a change's caller is answered once the change is in force here.
enum Answer {
    Done(crate::shard::Reply<()>),
    Permitted(crate::shard::Reply<bool>, bool),
}

/// A permission was refused here: with Redis, this instance's copy of the session may lag a
/// change another instance has just made (it answered after writing Redis; the published
/// change is on its way). Reads the session again from Redis and applies it; true when the
/// caller should try once more.
async fn refresh_session(cluster: &Cluster, core: &Rc<Core>, session: SessionId) -> Checked<bool> {
    let Some((v, accesses)) = cluster.call(|reply| Command::Load { session, reply }).await.map_err(unavailable)? else {
        return Ok(false);
    };
    if accesses.is_empty() {
        return Ok(false);
    }
    Ok(install(core, session, v, accesses).await)
}

/// `POST /session`: with Redis the new session is written there too (a failure undoes it
/// here and answers 503). `false`: `maxSessions` reached.
async fn create_session(cluster: &Cluster, core: &Rc<Core>, id: SessionId) -> Checked<bool> {
    if !local::create(core, id).await {
        return Ok(false);
    }
    if let Err(e) = cluster.save(SharedOp::Create(id)).await {
        local::delete(core, id).await;
        return Err(e);
    }
    Ok(true)
}

/// `DELETE /sessions/:id`: gone from Redis (published: every instance closes its sockets) and
/// from here; whether it existed anywhere.
async fn delete_session(cluster: &Cluster, core: &Rc<Core>, id: SessionId) -> Checked<bool> {
    let existed = cluster.save(SharedOp::Delete(id)).await?;
    Ok(local::delete(core, id).await || existed)
}

/// `DELETE /sessions`: every session, on every instance.
async fn delete_all(cluster: &Cluster, core: &Rc<Core>) -> Checked<()> {
    cluster.save(SharedOp::DeleteAll).await?;
    local::delete_all(core).await;
    Ok(())
}

/// A session-scoped batch from the REST API (false: no such session). With Redis, the
/// session is loaded first when this instance has no copy, and the batch's changes (grant,
/// revoke, subscribe, unsubscribe) are computed on Redis's copy of the session's access,
/// written and published as one change (two round trips whatever their number), then taken
/// into the copy here at the session's new version before their callers are answered (no
/// wait for the publication to come back). Every instance applies a change only if its
/// version is newer than what it holds, so a change of another instance published earlier
/// but applied here later can never undo this one, nor this one's own publication undo a
/// later change.
async fn scoped(cluster: &Cluster, core: &Rc<Core>, session: SessionId, register_devices: bool, ops: Vec<DeviceOp>) -> Checked<bool> {
    if !ensure_session(cluster, core, session).await? {
        return Ok(false);
    }
    let mut local = Vec::with_capacity(ops.len());
    let mut answers: Vec<Answer> = Vec::new();
    let mut changes = Vec::new();
    for op in ops {
        let (device, change, answer) = match op {
            DeviceOp::Grant { device, grant, done, .. } => (device, AccessChange::Grant(grant), Answer::Done(done)),
            DeviceOp::Revoke { device, grant, done, .. } => (device, AccessChange::Revoke(grant), Answer::Done(done)),
            DeviceOp::Subscribe { device, sub, permitted, .. } => (device, AccessChange::Subscribe(sub), Answer::Permitted(permitted, false)),
            DeviceOp::Unsubscribe { device, sub, permitted, .. } => (device, AccessChange::Unsubscribe(sub), Answer::Permitted(permitted, false)),
            other => {
                local.push(other);
                continue;
            }
        };
        changes.push((device, change));
        answers.push(answer);
    }
    if !changes.is_empty() {
        let changed = cluster.call(|reply| Command::Change { session, changes, reply }).await.map_err(unavailable)?;
        // `None`: deleted meanwhile (on another instance), as one node would answer.
        let Some((v, accesses, permitted)) = changed else { return Ok(false) };
        if !accesses.is_empty() && !set_accesses(core, session, v, accesses).await {
            return Ok(false);
        }
        for (answer, permitted) in answers.iter_mut().zip(permitted) {
            if let Answer::Permitted(_, p) = answer {
                *p = permitted;
            }
        }
    }
    let found = local::scoped(core, session, register_devices, local).await;
    for answer in answers {
        match answer {
            Answer::Done(tx) => {
                let _ = tx.send(());
            }
            Answer::Permitted(tx, permitted) => {
                let _ = tx.send(permitted);
            }
        }
    }
    Ok(found)
}

/// A read that found nothing current here (404, or a copy that is not current): with Redis,
/// the instances that hold the device are asked for data newer than `newer_than` (the
/// freshest answer wins), so reads answer the same on every instance. The grant was checked
/// here; an all-keys telemetry read keeps only the keys the session's grants cover (on the
/// typed values: nothing is parsed or rendered here). `None` when no instance holds the
/// device (or nothing newer), or holds nothing the session may see.
async fn read_elsewhere(cluster: &Cluster, core: &Rc<Core>, viewer: Viewer, device: &str, kind: ReadKind, newer_than: Option<Millis>) -> Checked<Option<(Millis, View)>> {
    let found = cluster.call(|reply| Command::Read { device: device.into(), kind: kind.clone(), newer_than, reply }).await.map_err(unavailable)?;
    let Some((newest, mut view)) = found else { return Ok(None) };
    if !view.answers(&kind) {
        tracing::warn!(device, ?kind, "another instance answered a read with data of another kind; ignored");
        return Ok(None);
    }
    if let (Viewer::Session(session), View::Telemetry(TelemetryView::All(values))) = (viewer, &mut view) {
        let asked = ask(|reply| DeviceOp::ReadAccess { device: device.into(), session, reply });
        let Some(Some((grants, _))) = core.ask_device(asked).await else { return Ok(None) };
        values.retain(|(key, _, _)| grants.telemetry.contains_key(key));
        if values.is_empty() {
            return Ok(None);
        }
    }
    Ok(Some((newest, view)))
}
