//! The Redis thread: one tokio runtime with a multiplexed command connection and a pub/sub
//! connection, between the cores' command queue and their inbound queues.
//!
//! Keys and channels (`P` = `--redis-prefix`, all documented in docs/OPERATIONS.md, "Several instances on Redis"):
//! - `P:session:<id>` hash: `created`, and `a:<device>` → the session's access on the device;
//!   expires unless an instance holding the session refreshes it.
//! - `P:instance:<id>` string with a TTL, renewed every [`HEARTBEAT`]: the live instances.
//! - `P:watching:<id>` set: the devices instance `<id>` watches.
//! - channel `P:ops`: shared session changes; `P:watch`: `+<id>\t<device>` / `-<id>\t<device>`;
//!   `P:device:<device>`: the device's messages, for the instances watching it.
//!
//! Every Redis call has a deadline; a failure drops both connections, shows on `GET /status`
//! and is retried with a capped back-off, while commands are refused (changes answer 503,
//! publications are counted as dropped, watch changes are kept and announced on reconnect).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use hashbrown::{HashMap, HashSet};
use redis::aio::{MultiplexedConnection, PubSubSink, PubSubStream};

use super::wire::{self, SharedOp};
use super::{Command, Inbound, Stats};
use crate::ids::SessionId;
use crate::runtime::routing::{core_of_device, core_of_session};

/// Renews a lease only if this instance still holds it.
const RENEW: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end";
/// Gives a lease up only if this instance holds it.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";
/// The longest wait between two attempts to reach Redis.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The longest one Redis call may take before the link is considered lost.
const CALL_DEADLINE: Duration = Duration::from_secs(5);
/// Commands per pipeline when many keys are touched at once.
const CHUNK: usize = 512;
/// How long a read waits for the other instances' answers.
const READ_DEADLINE: Duration = Duration::from_millis(1000);
/// Reads waiting for answers at once (beyond: answered at once as "not found elsewhere").
const READS_PENDING: usize = 4096;

/// A read sent to the other instances, waiting for their answers.
struct PendingRead {
    reply: futures_channel::oneshot::Sender<Result<Option<(i64, wire::View)>, String>>,
    expected: usize,
    got: usize,
    best: Option<(i64, wire::View)>,
    deadline: tokio::time::Instant,
}

pub struct Options {
    pub url: String,
    /// `--redis-ca-file`: PEM roots for `rediss://` instead of the public web roots.
    pub ca: Option<Vec<u8>>,
    pub prefix: String,
    pub instance: Arc<str>,
    pub session_ttl: Duration,
    /// `--lease-ttl`: how long partition leases and the instance key live unrenewed.
    pub lease_ttl: Duration,
}

impl Options {
    /// Heartbeats renew leases and the instance key three times per TTL (at most every 2 s).
    fn heartbeat(&self) -> Duration {
        (self.lease_ttl / 3).clamp(Duration::from_millis(100), Duration::from_secs(2))
    }
}

pub fn start(
    options: Options,
    commands: async_channel::Receiver<Command>,
    cores: Vec<async_channel::Sender<Inbound>>,
    owned: tokio::sync::watch::Sender<super::Owned>,
    stats: Arc<Stats>,
    status: Box<dyn Fn(Option<String>) + Send>,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("hubcast-redis".into()).spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the Redis thread's runtime");
                return;
            }
        };
        let mut link = Link {
            o: options,
            cores,
            stats,
            status,
            local: HashSet::new(),
            remote: HashMap::new(),
            instances: HashSet::new(),
            down_since_logged: false,
            reads: HashMap::new(),
            echoes: std::collections::VecDeque::new(),
            next_read: 0,
            stream: None,
            leased: std::collections::BTreeMap::new(),
            lost: HashSet::new(),
            taken_order: HashMap::new(),
            next_take: 0,
            settle_until: None,
            checkpointed: HashMap::new(),
            owned,
            renewed_at: tokio::time::Instant::now(),
            left: false,
        };
        runtime.block_on(link.run(commands));
    })?;
    Ok(())
}

struct Link {
    o: Options,
    cores: Vec<async_channel::Sender<Inbound>>,
    stats: Arc<Stats>,
    /// Tells `GET /status` the link is up (`None`) or down, and why.
    status: Box<dyn Fn(Option<String>) + Send>,
    /// Devices this instance watches (kept while Redis is down, announced on reconnect).
    local: HashSet<Box<str>>,
    /// Device → the other live instances watching it.
    remote: HashMap<Box<str>, HashSet<Arc<str>>>,
    /// Other live instances.
    instances: HashSet<Arc<str>>,
    down_since_logged: bool,
    reads: HashMap<u64, PendingRead>,
    next_read: u64,
    /// Access changes written here, answered once their own publication comes back on the
    /// `ops` channel and is applied (see [`Link::on_own_op`]). At most one per command taken
    /// from the bounded command queue, so bounded by it.
    echoes: std::collections::VecDeque<PendingEcho>,
    /// The event stream the consumer reads, once it has said.
    stream: Option<super::StreamPlan>,
    /// Partitions leased here → the checkpoint found when the lease was taken.
    leased: std::collections::BTreeMap<String, Option<i64>>,
    /// The last checkpoint written per partition.
    checkpointed: HashMap<String, i64>,
    /// Partitions whose lease this instance lost without giving it up (a renewal refused, or
    /// given up while Redis was unreachable): taken again first, so that after a Redis
    /// restart each instance goes back to the partitions its cores hold positions for.
    lost: HashSet<String>,
    /// When each held partition was taken (a counter): to balance, the most recently taken
    /// is given up first, so an instance keeps the partitions it read longest.
    taken_order: HashMap<String, u64>,
    next_take: u64,
    /// After a reconnect, until this instant only partitions in `lost` are taken: the other
    /// instances cut off by the same outage come back within it (their back-off is at most
    /// [`MAX_BACKOFF`]) and take back their own, instead of finding them taken by whoever
    /// reconnected first.
    settle_until: Option<tokio::time::Instant>,
    owned: tokio::sync::watch::Sender<super::Owned>,
    /// When the leases were last renewed: past the TTL without Redis they are given up.
    renewed_at: tokio::time::Instant,
    /// Shut down gracefully: no lease is taken and the instance key is not renewed again.
    left: bool,
}

type Failed = String;

/// An access change written and published, waiting for its publication to come back.
struct PendingEcho {
    session: SessionId,
    device: Box<str>,
    access: super::AccessOn,
    reply: futures_channel::oneshot::Sender<Result<super::Mutated, String>>,
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = redis::RedisResult<T>>) -> Result<T, Failed> {
    match tokio::time::timeout(CALL_DEADLINE, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {} s", CALL_DEADLINE.as_secs())),
    }
}

impl Link {
    fn key(&self, kind: &str, id: &str) -> String {
        format!("{}:{kind}:{id}", self.o.prefix)
    }
    fn channel(&self, name: &str) -> String {
        format!("{}:{name}", self.o.prefix)
    }
    fn session_key(&self, id: SessionId) -> String {
        self.key("session", &id.to_string())
    }

    async fn run(&mut self, commands: async_channel::Receiver<Command>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let reason = match self.connect().await {
                Ok((mut conn, mut sink, stream)) => {
                    backoff = Duration::from_millis(100);
                    if self.stats.reconnects.load(Ordering::Relaxed) > 0 {
                        self.forget_replicas().await;
                        self.settle_until = Some(tokio::time::Instant::now() + self.o.lease_ttl + MAX_BACKOFF);
                    }
                    (self.status)(None);
                    self.stats.connected.store(1, Ordering::Relaxed);
                    tracing::info!(instance = %self.o.instance, others = self.instances.len(), "connected to Redis");
                    self.down_since_logged = false;
                    let reason = self.serve(&mut conn, &mut sink, stream, &commands).await;
                    for (_, read) in self.reads.drain() {
                        let _ = read.reply.send(Err(format!("the link to Redis was lost ({reason})")));
                    }
                    // Written, but not seen back: the copy here may miss it until the session
                    // is read again, so the caller hears that Redis failed.
                    for echo in self.echoes.drain(..) {
                        let _ = echo.reply.send(Err(format!("the link to Redis was lost ({reason})")));
                    }
                    self.stats.connected.store(0, Ordering::Relaxed);
                    self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                    reason
                }
                Err(reason) => reason,
            };
            if commands.is_closed() {
                return;
            }
            (self.status)(Some(reason.clone()));
            if !self.down_since_logged {
                tracing::warn!(reason = %reason, "Redis unreachable: changes answer 503 and live data from other instances stops until it is back; retrying");
                self.down_since_logged = true;
            } else {
                tracing::debug!(reason = %reason, "Redis still unreachable");
            }
            // Disconnected: refuse what needs Redis until the back-off has passed.
            let until = tokio::time::Instant::now() + backoff;
            // Leases not renewed may be someone else's by now: stop reading their partitions
            // a heartbeat before they can expire.
            let give_up = self.renewed_at + self.o.lease_ttl.saturating_sub(self.o.heartbeat());
            loop {
                tokio::select! {
                    command = commands.recv() => match command {
                        Ok(command) => self.refuse(command, &reason),
                        Err(_) => return,
                    },
                    _ = tokio::time::sleep_until(give_up), if !self.leased.is_empty() => {
                        tracing::warn!(partitions = self.leased.len(), "partition leases not renewed in time (Redis unreachable): reading none until they are taken again");
                        // What was lost before is someone else's by now: only these are ours.
                        self.lost = std::mem::take(&mut self.leased).into_keys().collect();
                        self.publish_owned();
                    }
                    _ = tokio::time::sleep_until(until) => break,
                }
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    fn refuse(&mut self, command: Command, reason: &str) {
        match command {
            Command::Save { reply, .. } => {
                let _ = reply.send(Err(format!("not connected ({reason})")));
            }
            Command::Load { reply, .. } => {
                let _ = reply.send(Err(format!("not connected ({reason})")));
            }
            Command::Mutate { reply, .. } => {
                let _ = reply.send(Err(format!("not connected ({reason})")));
            }
            Command::Publish(items) => {
                self.stats.dropped.fetch_add(items.len() as u64, Ordering::Relaxed);
            }
            Command::Watch(changes) => {
                for (device, on) in changes {
                    if on {
                        self.local.insert(device);
                    } else {
                        self.local.remove(&device);
                    }
                }
                self.stats.watched_here.store(self.local.len() as u64, Ordering::Relaxed);
            }
            Command::Refresh(_) => {}
            Command::Stream(plan) => self.stream = Some(plan),
            Command::Leave(done) => {
                let _ = done.send(());
            }
            Command::Read { reply, .. } => {
                let _ = reply.send(Err(format!("not connected ({reason})")));
            }
        }
    }

    async fn connect(&mut self) -> Result<(MultiplexedConnection, PubSubSink, PubSubStream), Failed> {
        let client = match &self.o.ca {
            Some(ca) => redis::Client::build_with_tls(
                self.o.url.as_str(),
                redis::TlsCertificates { client_tls: None, root_cert: Some(ca.clone()) },
            ),
            None => redis::Client::open(self.o.url.as_str()),
        }
        .map_err(|e| format!("invalid --redis-url: {e}"))?;
        // Our own deadline per call (the client's default answer timeout is 500 ms).
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CALL_DEADLINE))
            .set_response_timeout(Some(CALL_DEADLINE));
        let mut conn = within("connect", client.get_multiplexed_async_connection_with_config(&config)).await?;
        let pubsub = within("connect (pub/sub)", client.get_async_pubsub()).await?;
        let (mut sink, stream) = pubsub.split();
        let channels = [self.channel("ops"), self.channel("watch"), self.channel("read"), self.key("answer", &self.o.instance)];
        within("SUBSCRIBE", sink.subscribe(&channels)).await?;
        // Announce this instance and what it watches (after a reconnect: again, whole).
        let me = self.o.instance.clone();
        let mut pipe = redis::pipe();
        pipe.cmd("SET").arg(self.key("instance", &me)).arg(crate::timefmt::now_millis()).arg("PX").arg(self.o.lease_ttl.as_millis() as u64).ignore();
        pipe.cmd("DEL").arg(self.key("watching", &me)).ignore();
        within("SET instance", pipe.query_async::<()>(&mut conn)).await?;
        let local: Vec<Box<str>> = self.local.iter().cloned().collect();
        for chunk in local.chunks(CHUNK) {
            let mut pipe = redis::pipe();
            pipe.cmd("SADD").arg(self.key("watching", &me));
            for device in chunk {
                pipe.arg(&**device);
            }
            pipe.ignore();
            for device in chunk {
                pipe.cmd("PUBLISH").arg(self.channel("watch")).arg(format!("+{me}\t{device}")).ignore();
            }
            within("SADD watching", pipe.query_async::<()>(&mut conn)).await?;
            let channels: Vec<String> = chunk.iter().map(|d| self.key("device", d)).collect();
            within("SUBSCRIBE devices", sink.subscribe(channels)).await?;
        }
        // What the others watch, read after subscribing to `watch` so no change is missed.
        let live = self.live_instances(&mut conn).await?;
        let mut remote: HashMap<Box<str>, HashSet<Arc<str>>> = HashMap::new();
        for instance in &live {
            let devices: Vec<String> = within("SMEMBERS", redis::cmd("SMEMBERS").arg(self.key("watching", instance)).query_async(&mut conn)).await?;
            for device in devices {
                remote.entry(device.into_boxed_str()).or_default().insert(instance.clone());
            }
        }
        let mut changes: Vec<(Box<str>, bool)> = Vec::new();
        for device in self.remote.keys() {
            if !remote.contains_key(device) {
                changes.push((device.clone(), false));
            }
        }
        for device in remote.keys() {
            if !self.remote.contains_key(device) {
                changes.push((device.clone(), true));
            }
        }
        self.remote = remote;
        self.instances = live;
        self.stats.instances.store(self.instances.len() as u64 + 1, Ordering::Relaxed);
        self.send_remote_watch(changes).await;
        Ok((conn, sink, stream))
    }

    /// Other instances whose `instance` key is alive.
    async fn live_instances(&self, conn: &mut MultiplexedConnection) -> Result<HashSet<Arc<str>>, Failed> {
        let pattern = self.key("instance", "*");
        let strip = pattern.len() - 1;
        let mut cursor: u64 = 0;
        let mut out = HashSet::new();
        loop {
            let (next, keys): (u64, Vec<String>) = within(
                "SCAN",
                redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000).query_async(conn),
            )
            .await?;
            for key in keys {
                let id = &key[strip..];
                if id != &*self.o.instance {
                    out.insert(Arc::from(id));
                }
            }
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }

    async fn serve(
        &mut self,
        conn: &mut MultiplexedConnection,
        sink: &mut PubSubSink,
        stream: PubSubStream,
        commands: &async_channel::Receiver<Command>,
    ) -> Failed {
        let mut stream = stream.ready_chunks(256);
        let mut beat = tokio::time::interval(self.o.heartbeat());
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_read = self.reads.values().map(|r| r.deadline).min();
            let result = tokio::select! {
                batch = stream.next() => match batch {
                    Some(batch) => {
                        let answers = self.on_messages(batch).await;
                        self.publish_answers(answers, conn).await
                    }
                    None => Err("the pub/sub connection closed".to_string()),
                },
                _ = tokio::time::sleep_until(next_read.unwrap_or_else(tokio::time::Instant::now)), if next_read.is_some() => {
                    self.expire_reads();
                    Ok(())
                }
                command = commands.recv() => match command {
                    Ok(command) => self.on_command(command, conn, sink).await,
                    Err(_) => Err("stopped".to_string()),
                },
                _ = beat.tick() => self.heartbeat(conn).await,
            };
            if let Err(reason) = result {
                return reason;
            }
        }
    }

    async fn publish_answers(&self, answers: Vec<(String, Vec<u8>)>, conn: &mut MultiplexedConnection) -> Result<(), Failed> {
        if answers.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (channel, payload) in &answers {
            pipe.cmd("PUBLISH").arg(channel).arg(payload.as_slice()).ignore();
        }
        within("PUBLISH answers", pipe.query_async::<()>(conn)).await
    }

    /// Answers the reads whose time is up with the best answer so far.
    fn expire_reads(&mut self) {
        let now = tokio::time::Instant::now();
        let due: Vec<u64> = self.reads.iter().filter(|(_, r)| r.deadline <= now).map(|(id, _)| *id).collect();
        for id in due {
            if let Some(read) = self.reads.remove(&id) {
                let _ = read.reply.send(Ok(read.best));
            }
        }
    }

    async fn heartbeat(&mut self, conn: &mut MultiplexedConnection) -> Result<(), Failed> {
        if self.left {
            return Ok(());
        }
        let me = self.o.instance.clone();
        let set = redis::cmd("SET").arg(self.key("instance", &me)).arg(crate::timefmt::now_millis()).arg("PX").arg(self.o.lease_ttl.as_millis() as u64).to_owned();
        within("SET instance", set.query_async::<()>(conn)).await?;
        let live = self.live_instances(conn).await?;
        let gone: Vec<Arc<str>> = self.instances.iter().filter(|i| !live.contains(*i)).cloned().collect();
        if !gone.is_empty() {
            // An instance that died without saying so: forget what it watched.
            let mut changes = Vec::new();
            self.remote.retain(|device, watchers| {
                for g in &gone {
                    watchers.remove(g);
                }
                if watchers.is_empty() {
                    changes.push((device.clone(), false));
                    false
                } else {
                    true
                }
            });
            for g in &gone {
                tracing::info!(instance = %g, "instance gone from Redis");
                let _ = within("DEL watching", redis::cmd("DEL").arg(self.key("watching", g)).query_async::<()>(conn)).await;
            }
            self.send_remote_watch(changes).await;
        }
        for i in &live {
            if !self.instances.contains(i) {
                tracing::info!(instance = %i, "instance joined on Redis");
            }
        }
        self.instances = live;
        self.stats.instances.store(self.instances.len() as u64 + 1, Ordering::Relaxed);
        self.leases(conn).await
    }

    /// Graceful shutdown: a last checkpoint (`leases` writes it), every lease given up,
    /// watches withdrawn, the instance key deleted: the others rebalance at once.
    async fn leave(&mut self, conn: &mut MultiplexedConnection) -> Result<(), Failed> {
        self.leases(conn).await?;
        let me = self.o.instance.clone();
        let held: Vec<String> = std::mem::take(&mut self.leased).into_keys().collect();
        let mut pipe = redis::pipe();
        if let Some(stream) = &self.stream {
            let leases = self.key("lease", &format!("{:08x}", crc32fast::hash(stream.key.as_bytes())));
            for p in &held {
                pipe.cmd("EVAL").arg(RELEASE).arg(1).arg(format!("{leases}:{p}")).arg(&*me).ignore();
            }
        }
        for device in &self.local {
            pipe.cmd("PUBLISH").arg(self.channel("watch")).arg(format!("-{me}\t{device}")).ignore();
        }
        pipe.cmd("DEL").arg(self.key("watching", &me)).ignore();
        pipe.cmd("DEL").arg(self.key("instance", &me)).ignore();
        self.left = true;
        self.stream = None;
        within("leave", pipe.query_async::<()>(conn)).await?;
        self.publish_owned();
        tracing::info!(partitions = held.len(), "left Redis: partition leases given up, watches withdrawn");
        Ok(())
    }

    fn publish_owned(&self) {
        self.stats.leases.store(self.leased.len() as u64, Ordering::Relaxed);
        let owned = super::Owned { partitions: self.leased.clone() };
        self.owned.send_if_modified(|o| {
            if *o == owned {
                false
            } else {
                *o = owned;
                true
            }
        });
    }

    /// The cores' applied marks: source partition → the lowest mark over every core (only
    /// partitions every core has a mark for).
    async fn applied_marks(&self) -> HashMap<Box<str>, i64> {
        let mut low: HashMap<Box<str>, (i64, usize)> = HashMap::new();
        for core in &self.cores {
            let (reply, marks) = futures_channel::oneshot::channel();
            if core.send(Inbound::Applied(reply)).await.is_err() {
                return HashMap::new();
            }
            let Ok(Ok(marks)) = tokio::time::timeout(CALL_DEADLINE, marks).await else { return HashMap::new() };
            for (key, seq) in marks {
                let e = low.entry(key).or_insert((seq, 0));
                e.0 = e.0.min(seq);
                e.1 += 1;
            }
        }
        let n = self.cores.len();
        low.into_iter().filter(|(_, (_, count))| *count == n).map(|(k, (seq, _))| (k, seq)).collect()
    }

    /// Partition leases, Event Hubs' processor style: renew what is held, checkpoint it,
    /// give up what is over this instance's share (`ceil(partitions / live instances)`),
    /// and take free partitions (never held, or whose lease expired) up to it.
    async fn leases(&mut self, conn: &mut MultiplexedConnection) -> Result<(), Failed> {
        let Some(stream) = &self.stream else { return Ok(()) };
        let stream_key = format!("{:08x}", crc32fast::hash(stream.key.as_bytes()));
        let (leases, checkpoints) = (self.key("lease", &stream_key), self.key("checkpoint", &stream_key));
        let lease_key = |p: &str| format!("{leases}:{p}");
        let checkpoint_key = |p: &str| format!("{checkpoints}:{p}");
        let holders = self.key("holder", &stream_key);
        let holder_key = |p: &str| format!("{holders}:{p}");
        let handed = self.key("handed", &stream_key);
        let handed_key = |p: &str| format!("{handed}:{p}");
        let me = self.o.instance.clone();
        let ttl = self.o.lease_ttl.as_millis() as u64;
        let before = self.leased.clone();
        // 1. Renew.
        if !self.leased.is_empty() {
            let mut pipe = redis::pipe();
            for p in self.leased.keys() {
                pipe.cmd("EVAL").arg(RENEW).arg(1).arg(lease_key(p)).arg(&*me).arg(ttl);
            }
            let renewed: Vec<i64> = within("renew leases", pipe.query_async(conn)).await?;
            let lost: Vec<String> = self.leased.keys().zip(renewed).filter(|(_, ok)| *ok == 0).map(|(p, _)| p.clone()).collect();
            for p in lost {
                tracing::warn!(partition = %p, "partition lease lost (taken by another instance)");
                self.leased.remove(&p);
                self.lost.insert(p);
            }
        }
        self.renewed_at = tokio::time::Instant::now();
        // 2. Checkpoint what every core applied (or, without a store, what was handed over).
        let positions = (stream.positions)();
        let marks = if stream.marks { Some(self.applied_marks().await) } else { None };
        let mut pipe = redis::pipe();
        let mut written = Vec::new();
        let mut handed_any = false;
        for p in self.leased.keys() {
            let seq = match &marks {
                Some(marks) => marks.get(format!("{}{p}", stream.key).as_str()).copied(),
                None => positions.get(p).copied(),
            };
            if let Some(seq) = seq.filter(|s| self.checkpointed.get(p) != Some(s)) {
                pipe.cmd("SET").arg(checkpoint_key(p)).arg(seq).ignore();
                written.push((p.clone(), seq));
            }
            // What was handed to the cores, past the checkpoint: a new holder after a crash
            // counts the events between the two as applied twice.
            if let Some(handed) = positions.get(p) {
                pipe.cmd("SET").arg(handed_key(p)).arg(*handed).ignore();
                handed_any = true;
            }
        }
        if !written.is_empty() || handed_any {
            within("checkpoint", pipe.query_async::<()>(conn)).await?;
            self.checkpointed.extend(written);
        }
        // 3. Balance.
        let instances = self.instances.len() + 1;
        let share = stream.ids.len().div_ceil(instances);
        while self.leased.len() > share {
            let newest = self.leased.keys().max_by_key(|p| self.taken_order.get(*p).copied().unwrap_or(0)).cloned();
            let Some(p) = newest else { break };
            self.leased.remove(&p);
            self.taken_order.remove(&p);
            let release = redis::cmd("EVAL").arg(RELEASE).arg(1).arg(lease_key(&p)).arg(&*me).to_owned();
            within("release lease", release.query_async::<i64>(conn)).await?;
            tracing::info!(partition = %p, instances, share, "partition lease given up to balance the instances");
        }
        if self.leased.len() < share {
            // Start at a place of this instance's own, so instances do not race for one partition.
            let start = crc32fast::hash(me.as_bytes()) as usize % stream.ids.len().max(1);
            let mut order: Vec<String> = stream.ids.iter().cycle().skip(start).take(stream.ids.len()).cloned().collect();
            // Those lost first (stable: otherwise in this instance's own order); only those
            // while the instances settle after a Redis outage.
            order.sort_by_key(|p| !self.lost.contains(p));
            if self.settle_until.is_some_and(|t| tokio::time::Instant::now() < t) {
                order.retain(|p| self.lost.contains(p));
            } else {
                self.settle_until = None;
            }
            for p in order {
                if self.leased.len() >= share {
                    break;
                }
                if self.leased.contains_key(&p) {
                    continue;
                }
                let take = redis::cmd("SET").arg(lease_key(&p)).arg(&*me).arg("NX").arg("PX").arg(ttl).to_owned();
                let taken: Option<String> = within("take lease", take.query_async(conn)).await?;
                if taken.is_none() {
                    continue;
                }
                let mut pipe = redis::pipe();
                pipe.cmd("GET").arg(checkpoint_key(&p));
                pipe.cmd("SET").arg(holder_key(&p)).arg(&*me).arg("GET");
                pipe.cmd("GET").arg(handed_key(&p));
                let (checkpoint, holder, handed): (Option<i64>, Option<String>, Option<i64>) =
                    within("GET checkpoint", pipe.query_async(conn)).await?;
                if holder.as_deref().is_some_and(|h| h != &*me) {
                    self.stats.takeovers.fetch_add(1, Ordering::Relaxed);
                    // Sequence numbers are contiguous per partition: the previous holder had
                    // handed over this many events past the checkpoint it left.
                    let replayed = handed.zip(checkpoint).map_or(0, |(h, c)| (h - c).max(0) as u64);
                    self.stats.replayed.fetch_add(replayed, Ordering::Relaxed);
                }
                if let Some(seq) = checkpoint {
                    self.checkpointed.insert(p.clone(), seq);
                }
                tracing::info!(partition = %p, after_sequence_number = ?checkpoint, instances, share, "partition lease taken");
                self.lost.remove(&p);
                self.next_take += 1;
                self.taken_order.insert(p.clone(), self.next_take);
                self.leased.insert(p, checkpoint);
            }
        }
        if self.leased != before {
            self.publish_owned();
        }
        Ok(())
    }

    async fn on_command(&mut self, command: Command, conn: &mut MultiplexedConnection, sink: &mut PubSubSink) -> Result<(), Failed> {
        match command {
            Command::Save { op, reply } => {
                let result = self.save(&op, conn).await;
                let failed = result.as_ref().err().cloned();
                let _ = reply.send(result);
                if let Some(reason) = failed {
                    return Err(reason);
                }
            }
            Command::Mutate { session, device, change, reply } => {
                let result = self.mutate(session, &device, &change, conn).await;
                let failed = result.as_ref().err().cloned();
                match result {
                    // Written and published: answered when it comes back (on_own_op).
                    Ok(Some((access, true))) => self.echoes.push_back(PendingEcho { session, device, access, reply }),
                    other => {
                        let _ = reply.send(other);
                    }
                }
                if let Some(reason) = failed {
                    return Err(reason);
                }
            }
            Command::Load { session, reply } => {
                let key = self.session_key(session);
                let result: Result<std::collections::HashMap<Vec<u8>, Vec<u8>>, Failed> =
                    within("HGETALL", redis::cmd("HGETALL").arg(&key).query_async(conn)).await;
                let failed = result.as_ref().err().cloned();
                let _ = reply.send(result.map(|fields| {
                    if fields.is_empty() {
                        return None;
                    }
                    let ops = fields
                        .iter()
                        .filter(|(k, _)| k.starts_with(b"a:"))
                        .filter_map(|(_, v)| wire::decode_access(v))
                        .filter(|(_, s, _)| *s == session)
                        .map(|(device, session, access)| SharedOp::Access { session, device, access })
                        .collect();
                    Some(ops)
                }));
                if let Some(reason) = failed {
                    return Err(reason);
                }
            }
            Command::Publish(items) => {
                let n = items.len() as u64;
                let mut pipe = redis::pipe();
                for (device, payload) in &items {
                    pipe.cmd("PUBLISH").arg(self.key("device", device)).arg(payload.as_slice()).ignore();
                }
                if let Err(reason) = within("PUBLISH", pipe.query_async::<()>(conn)).await {
                    self.stats.dropped.fetch_add(n, Ordering::Relaxed);
                    return Err(reason);
                }
                self.stats.published.fetch_add(n, Ordering::Relaxed);
            }
            Command::Watch(changes) => {
                let me = self.o.instance.clone();
                let (mut on, mut off) = (Vec::new(), Vec::new());
                let mut pipe = redis::pipe();
                for (device, watch) in changes {
                    if watch == self.local.contains(&device) {
                        continue;
                    }
                    let (cmd, sign) = if watch { ("SADD", '+') } else { ("SREM", '-') };
                    pipe.cmd(cmd).arg(self.key("watching", &me)).arg(&*device).ignore();
                    pipe.cmd("PUBLISH").arg(self.channel("watch")).arg(format!("{sign}{me}\t{device}")).ignore();
                    let channel = self.key("device", &device);
                    if watch {
                        self.local.insert(device);
                        on.push(channel);
                    } else {
                        self.local.remove(&device);
                        off.push(channel);
                    }
                }
                // Subscribed before announced: once another instance knows, messages arrive.
                if !on.is_empty() {
                    within("SUBSCRIBE", sink.subscribe(on)).await?;
                }
                if !off.is_empty() {
                    within("UNSUBSCRIBE", sink.unsubscribe(off)).await?;
                }
                within("announce watch", pipe.query_async::<()>(conn)).await?;
                self.stats.watched_here.store(self.local.len() as u64, Ordering::Relaxed);
            }
            Command::Leave(done) => {
                let left = self.leave(conn).await;
                let _ = done.send(());
                left?;
            }
            Command::Stream(plan) => {
                self.stream = Some(plan);
                self.leases(conn).await?;
                // The consumer waits for this answer at every connect, changed or not.
                self.owned.send_replace(super::Owned { partitions: self.leased.clone() });
            }
            Command::Read { device, kind, newer_than, reply } => {
                if self.instances.is_empty() || self.reads.len() >= READS_PENDING {
                    let _ = reply.send(Ok(None));
                    return Ok(());
                }
                self.next_read += 1;
                let id = self.next_read;
                let publish = redis::cmd("PUBLISH").arg(self.channel("read")).arg(wire::encode_read(&self.o.instance, id, &device, &kind, newer_than)).to_owned();
                if let Err(reason) = within("PUBLISH read", publish.query_async::<()>(conn)).await {
                    let _ = reply.send(Err(reason.clone()));
                    return Err(reason);
                }
                let deadline = tokio::time::Instant::now() + READ_DEADLINE;
                self.reads.insert(id, PendingRead { reply, expected: self.instances.len(), got: 0, best: None, deadline });
            }
            Command::Refresh(ids) => {
                let ttl = self.o.session_ttl.as_millis() as u64;
                for chunk in ids.chunks(CHUNK) {
                    let mut pipe = redis::pipe();
                    for id in chunk {
                        pipe.cmd("PEXPIRE").arg(self.session_key(*id)).arg(ttl).ignore();
                    }
                    within("PEXPIRE", pipe.query_async::<()>(conn)).await?;
                }
            }
        }
        Ok(())
    }

    /// Read-modify-write of one session's access on one device, optimistic (WATCH): the
    /// change is computed on what Redis holds, written with its publication in one
    /// transaction, and tried again if another instance changed the session meanwhile.
    async fn mutate(
        &self,
        session: SessionId,
        device: &str,
        change: &super::AccessChange,
        conn: &mut MultiplexedConnection,
    ) -> Result<super::Mutated, Failed> {
        let key = self.session_key(session);
        let field = format!("a:{device}");
        let ttl = self.o.session_ttl.as_millis() as u64;
        for _ in 0..32 {
            within("WATCH", redis::cmd("WATCH").arg(&key).query_async::<()>(conn)).await?;
            let mut pipe = redis::pipe();
            pipe.cmd("EXISTS").arg(&key).cmd("HGET").arg(&key).arg(&field);
            let (exists, stored): (bool, Option<Vec<u8>>) = within("HGET access", pipe.query_async(conn)).await?;
            if !exists {
                within("UNWATCH", redis::cmd("UNWATCH").query_async::<()>(conn)).await?;
                return Ok(None);
            }
            let mut access = crate::shard::access::Access::default();
            if let Some((_, _, Some((grants, subs)))) = stored.as_deref().and_then(wire::decode_access) {
                access.grants = grants;
                access.subs = subs;
            }
            let permitted = change.apply(&mut access);
            let now = (!access.is_empty()).then(|| (access.grants.clone(), access.subs.clone()));
            if !permitted {
                within("UNWATCH", redis::cmd("UNWATCH").query_async::<()>(conn)).await?;
                return Ok(Some((now, false)));
            }
            let op = SharedOp::Access { session, device: device.into(), access: now.clone() };
            let mut tx = redis::pipe();
            tx.atomic();
            match &now {
                Some(a) => tx.cmd("HSET").arg(&key).arg(&field).arg(wire::encode_access(device, session, Some(a))).ignore(),
                None => tx.cmd("HDEL").arg(&key).arg(&field).ignore(),
            };
            tx.cmd("PEXPIRE").arg(&key).arg(ttl);
            tx.cmd("PUBLISH").arg(self.channel("ops")).arg(wire::encode_op(&self.o.instance, &op)).ignore();
            // EXEC answers nil when the session changed since WATCH: read it again.
            let done: Option<(i64,)> = within("EXEC access", tx.query_async(conn)).await?;
            if done.is_some() {
                return Ok(Some((now, true)));
            }
        }
        Err("a session changed on other instances faster than this one could write it (32 tries)".into())
    }

    async fn save(&self, op: &SharedOp, conn: &mut MultiplexedConnection) -> Result<bool, Failed> {
        let ttl = self.o.session_ttl.as_millis() as u64;
        let ops_channel = self.channel("ops");
        match op {
            SharedOp::Create(id) => {
                let key = self.session_key(*id);
                let mut pipe = redis::pipe();
                pipe.atomic().cmd("HSET").arg(&key).arg("created").arg(crate::timefmt::now_millis()).ignore();
                pipe.cmd("PEXPIRE").arg(&key).arg(ttl).ignore();
                within("HSET session", pipe.query_async::<()>(conn)).await?;
                Ok(true)
            }
            SharedOp::Delete(id) => {
                let mut pipe = redis::pipe();
                pipe.atomic().cmd("DEL").arg(self.session_key(*id));
                pipe.cmd("PUBLISH").arg(&ops_channel).arg(wire::encode_op(&self.o.instance, op)).ignore();
                let (deleted,): (i64,) = within("DEL session", pipe.query_async(conn)).await?;
                Ok(deleted > 0)
            }
            SharedOp::DeleteAll => {
                let pattern = self.key("session", "*");
                let mut cursor: u64 = 0;
                loop {
                    let (next, keys): (u64, Vec<String>) = within(
                        "SCAN",
                        redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000).query_async(conn),
                    )
                    .await?;
                    if !keys.is_empty() {
                        within("DEL sessions", redis::cmd("DEL").arg(keys).query_async::<()>(conn)).await?;
                    }
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
                let publish = redis::cmd("PUBLISH").arg(&ops_channel).arg(wire::encode_op(&self.o.instance, op)).to_owned();
                within("PUBLISH ops", publish.query_async::<()>(conn)).await?;
                Ok(true)
            }
            SharedOp::Access { session, device, access } => {
                let key = self.session_key(*session);
                let field = format!("a:{device}");
                let mut pipe = redis::pipe();
                pipe.atomic();
                match access {
                    Some(a) => pipe.cmd("HSET").arg(&key).arg(&field).arg(wire::encode_access(device, *session, Some(a))).ignore(),
                    None => pipe.cmd("HDEL").arg(&key).arg(&field).ignore(),
                };
                pipe.cmd("PEXPIRE").arg(&key).arg(ttl).ignore();
                pipe.cmd("PUBLISH").arg(&ops_channel).arg(wire::encode_op(&self.o.instance, op)).ignore();
                within("HSET access", pipe.query_async::<()>(conn)).await?;
                Ok(true)
            }
        }
    }

    /// A burst of pub/sub messages, in order: device messages are grouped per core between
    /// two control messages; a shared change waits until its core applied it (so a revoke is
    /// in force before any later message of the burst is handed over).
    async fn on_messages(&mut self, batch: Vec<redis::Msg>) -> Vec<(String, Vec<u8>)> {
        let ops = self.channel("ops");
        let watch = self.channel("watch");
        let read = self.channel("read");
        let answer = self.key("answer", &self.o.instance);
        let device_prefix = self.key("device", "");
        let mut answers = Vec::new();
        let mut per_core: Vec<Vec<crate::ingest::IngestMessage>> = (0..self.cores.len()).map(|_| Vec::new()).collect();
        for msg in batch {
            let channel = msg.get_channel_name();
            let payload = msg.get_payload_bytes();
            if channel.starts_with(&device_prefix) {
                match wire::decode_message(payload) {
                    Some((origin, m)) if origin != &*self.o.instance => {
                        self.stats.received.fetch_add(1, Ordering::Relaxed);
                        let core = core_of_device(&m.device_id, self.cores.len());
                        per_core[core].push(m);
                    }
                    Some(_) => {}
                    None => {
                        self.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if channel == ops {
                self.flush_messages(&mut per_core).await;
                match wire::decode_op(payload) {
                    Some((origin, op)) if origin != &*self.o.instance => self.apply_op(op).await,
                    Some((_, op)) => self.on_own_op(op).await,
                    None => {
                        self.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if channel == watch {
                self.flush_messages(&mut per_core).await;
                self.on_watch(payload).await;
            } else if channel == read {
                // Answered after the messages before it are applied (same core, in order).
                self.flush_messages(&mut per_core).await;
                if let Some(a) = self.answer_read(payload).await {
                    answers.push(a);
                }
            } else if channel == answer {
                self.on_answer(payload);
            }
        }
        self.flush_messages(&mut per_core).await;
        answers
    }

    /// Another instance's read: asks the device's core here; the answer for its channel.
    async fn answer_read(&self, payload: &[u8]) -> Option<(String, Vec<u8>)> {
        let Some((origin, id, device, kind, newer_than)) = wire::decode_read(payload) else {
            self.stats.undecodable.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        if origin == &*self.o.instance {
            return None;
        }
        let core = core_of_device(&device, self.cores.len());
        let (reply, answer) = futures_channel::oneshot::channel();
        let found = match self.cores[core].send(Inbound::Read { device, kind, newer_than, reply }).await {
            Ok(()) => tokio::time::timeout(READ_DEADLINE, answer).await.ok().and_then(Result::ok).flatten(),
            Err(_) => None,
        };
        let payload = wire::encode_answer(id, found.as_ref().map(|(newest, view)| (*newest, view)));
        Some((self.key("answer", origin), payload))
    }

    fn on_answer(&mut self, payload: &[u8]) {
        let Some((id, found)) = wire::decode_answer(payload) else {
            self.stats.undecodable.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Some(read) = self.reads.get_mut(&id) else { return };
        read.got += 1;
        if let Some((newest, view)) = found {
            if read.best.as_ref().is_none_or(|(n, _)| newest > *n) {
                read.best = Some((newest, view));
            }
        }
        if read.got >= read.expected {
            if let Some(read) = self.reads.remove(&id) {
                let _ = read.reply.send(Ok(read.best));
            }
        }
    }

    async fn flush_messages(&self, per_core: &mut [Vec<crate::ingest::IngestMessage>]) {
        for (core, batch) in per_core.iter_mut().enumerate() {
            if !batch.is_empty() {
                let _ = self.cores[core].send(Inbound::Messages(std::mem::take(batch))).await;
            }
        }
    }

    /// This instance's own access change, back from the `ops` channel: applied here in the
    /// channel's order like everyone else's, then answered. Redis orders every change of
    /// every instance on that channel, so a change another instance made earlier (published
    /// but not yet applied here) can no longer land after this one and undo it.
    async fn on_own_op(&mut self, op: SharedOp) {
        let SharedOp::Access { session, device, .. } = &op else { return };
        let Some(front) = self.echoes.front() else { return };
        if front.session != *session || front.device != *device {
            tracing::warn!(session = %session, device = %device, "an access change came back out of order; answering the one waiting");
        }
        let Some(echo) = self.echoes.pop_front() else { return };
        self.apply_op(op).await;
        let _ = echo.reply.send(Ok(Some((echo.access, true))));
    }

    /// After an outage, before any message of the new connection is handed over: every
    /// core forgets the values it learnt from the others (what they published meanwhile
    /// was lost with the connection).
    async fn forget_replicas(&self) {
        for core in &self.cores {
            let (done, forgotten) = futures_channel::oneshot::channel();
            if core.send(Inbound::Reconnected(done)).await.is_ok() {
                let _ = tokio::time::timeout(Duration::from_secs(10), forgotten).await;
            }
        }
    }

    async fn apply_op(&self, op: SharedOp) {
        let core = match &op {
            SharedOp::Create(id) | SharedOp::Delete(id) => core_of_session(*id, self.cores.len()),
            SharedOp::Access { session, .. } => core_of_session(*session, self.cores.len()),
            SharedOp::DeleteAll => 0,
        };
        let (done, applied) = futures_channel::oneshot::channel();
        if self.cores[core].send(Inbound::Op(op, done)).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(10), applied).await;
        }
    }

    async fn on_watch(&mut self, payload: &[u8]) {
        let Some(text) = std::str::from_utf8(payload).ok() else { return };
        let (on, rest) = match text.as_bytes().first() {
            Some(b'+') => (true, &text[1..]),
            Some(b'-') => (false, &text[1..]),
            _ => return,
        };
        let Some((instance, device)) = rest.split_once('\t') else { return };
        if instance == &*self.o.instance {
            return;
        }
        let instance: Arc<str> = instance.into();
        if !self.instances.contains(&instance) {
            self.instances.insert(instance.clone());
            self.stats.instances.store(self.instances.len() as u64 + 1, Ordering::Relaxed);
        }
        let mut change = None;
        if on {
            let watchers = self.remote.entry(device.into()).or_default();
            if watchers.is_empty() {
                change = Some((device.into(), true));
            }
            watchers.insert(instance);
        } else if let Some(watchers) = self.remote.get_mut(device) {
            watchers.remove(&instance);
            if watchers.is_empty() {
                self.remote.remove(device);
                change = Some((device.into(), false));
            }
        }
        if let Some(change) = change {
            self.send_remote_watch(vec![change]).await;
        }
    }

    async fn send_remote_watch(&self, changes: Vec<(Box<str>, bool)>) {
        if changes.is_empty() {
            return;
        }
        let mut per_core: Vec<Vec<(Box<str>, bool)>> = (0..self.cores.len()).map(|_| Vec::new()).collect();
        for (device, on) in changes {
            per_core[core_of_device(&device, self.cores.len())].push((device, on));
        }
        for (core, changes) in per_core.into_iter().enumerate() {
            if !changes.is_empty() {
                let _ = self.cores[core].send(Inbound::RemoteWatch(changes)).await;
            }
        }
    }
}
