//! The Redis thread: one current-thread tokio runtime between the cores' command queue and
//! their inbound queues, running four tasks per connection (a cluster: five, with
//! [`super::shards`]), none of which waits on a core's answer inline:
//! - **pub/sub** (here): the subscriber connection's messages, demultiplexed into the bounded
//!   per-core queues (`send().await`: a full queue is back-pressure to Redis's output buffer).
//!   An access change goes to the *device's* core, in the same FIFO as that device's
//!   messages, so a revoke is in force before any later message without a barrier here.
//!   Another instance's read is answered by a spawned task (at most [`READS_PENDING`]).
//! - **commands** (here): the cores' commands (session changes, publications, watches,
//!   reads), on the command connection.
//! - **resync** ([`super::resync`]): the sessions held here checked against Redis's versions
//!   after a reconnect or a skipped version (a change missed), and read again if changed.
//! - **leases** ([`super::lease`]): heartbeat, live instances, partition leases and
//!   checkpoints on a connection of their own; renewal first, cores asked with a deadline;
//!   then the check of the others' `watching` sets against what `watch` said
//!   ([`check_watches`]: an announcement lost is corrected within two heartbeats).
//!
//! The command connections are one Redis or a Redis Cluster ([`super::conn`]); keys and
//! channels ([`super::names`], all documented in docs/OPERATIONS.md, "Several instances on Redis"):
//! - `P:session:<id>` hash: `created`, and `a:<device>` → the session's access on the device;
//!   expires unless an instance holding the session refreshes it.
//! - `P:gone:<id>` / `P:cleared`: a session deleted / every session deleted, for a session
//!   TTL (an instance that missed the delete drops its copy, [`super::resync`]).
//! - `P:instance:<id>` string with a TTL (a cluster: `{P}:instances`, a sorted set), renewed
//!   every heartbeat: the live instances.
//! - `P:watching:<id>` set: the devices instance `<id>` watches.
//! - channel `P:ops`: shared session changes; `P:watch`: `+<id>\t<device>` / `-<id>\t<device>`;
//!   `P:device:<device>`: the device's messages, for the instances watching it;
//!   `P:read` / `P:answer:<id>` also carry a recovery rebuild's asks of the others' device
//!   rings and their answers ([`super::ringask`]);
//!   `P:adopt:<id>`: recovery histories handed to instance `<id>` at a SIGTERM and their
//!   handshake, with `P:stream:<session>` naming the adopter ([`super::adopt`]).
//!
//! Every Redis call has a deadline; a failure drops the connections (all three tasks stop),
//! shows on `GET /status` and is retried with a capped back-off, while commands are refused
//! (changes answer 503, publications are counted as dropped, watch changes are kept and
//! announced on reconnect).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use hashbrown::{HashMap, HashSet};
use redis::aio::{PubSubSink, PubSubStream};

use super::conn::Conn;
use super::names::Names;

use super::lease::{self, Ctl, Leases};
use super::resend;
use super::resync;
use super::shards;
use super::wire::{self, SharedOp};
use super::{Command, Inbound, Stats};
use crate::ids::SessionId;
use crate::runtime::routing::{core_of_device, core_of_session};

/// The longest wait between two attempts to reach Redis.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The longest one Redis call may take before the link is considered lost.
const CALL_DEADLINE: Duration = Duration::from_secs(5);
/// Commands per pipeline when many keys are touched at once.
const CHUNK: usize = 512;
/// How long a read waits for the other instances' answers.
const READ_DEADLINE: Duration = Duration::from_millis(1000);
/// Reads waiting for answers at once (beyond: answered at once as "not found elsewhere"),
/// and other instances' reads being answered here at once (beyond: not answered; the asker's
/// deadline answers for them).
const READS_PENDING: usize = 4096;
/// Requests waiting for the shard task (subscriptions and unsubscriptions of device
/// channels; the command task waits for room).
const SHARD_REQUESTS: usize = 64;
/// Watch changes remembered while a check reads `watching` sets (beyond: the check gives up
/// and is made again a heartbeat later).
const TOUCHED: usize = 65_536;
/// Origins remembered per device for dropping messages received twice (a device's
/// partition moves between instances now and then; beyond, the oldest is forgotten).
const ORIGINS: usize = 4;
/// Tries of one change when other instances change the session meanwhile (then 503).
const CHANGE_TRIES: usize = 8;
/// Changes running at once (each its own task); beyond, the command task waits for one to
/// end (back-pressure to the bounded command queue).
const CHANGES_RUNNING: usize = 64;
/// Session changes taken from the command queue at most, running or waiting for their
/// session's turn or a running slot (past it the link waits: the queue's own bound holds).
const CHANGES_TAKEN: usize = 1024;
/// Writes every field of a change if the session is still at version `ARGV[1]`, bumps the
/// version, keeps the key alive and publishes the change, in one step: the new version; 0
/// when the session changed meanwhile (read it again); -1 when it is gone.
/// `ARGV`: version, TTL ms, ops channel (`""`: not published here, see `Ctx::op_after`), op,
/// then field / value pairs (`""`: deleted).
const CHANGE: &str = "if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end \
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0') \
if v ~= tonumber(ARGV[1]) then return 0 end \
for i = 5, #ARGV, 2 do \
if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i]) else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end \
end \
local nv = redis.call('HINCRBY', KEYS[1], 'v', 1) \
redis.call('PEXPIRE', KEYS[1], ARGV[2]) \
if ARGV[3] ~= '' then redis.call('PUBLISH', ARGV[3], ARGV[4]) end \
return nv";

/// A read sent to the other instances, waiting for their answers.
pub(super) struct PendingRead {
    reply: futures_channel::oneshot::Sender<Result<Option<(i64, wire::View)>, String>>,
    expected: usize,
    got: usize,
    best: Option<(i64, wire::View)>,
    deadline: tokio::time::Instant,
}

pub struct Options {
    /// One Redis or a Redis Cluster.
    pub engine: super::Engine,
    /// Every key and channel name (hash tags on a cluster).
    pub names: Names,
    /// `--redis-ca-file`: PEM roots for `rediss://` instead of the public web roots.
    pub ca: Option<Vec<u8>>,
    pub instance: Arc<str>,
    pub session_ttl: Duration,
    /// `--lease-ttl`: how long partition leases and the instance key live unrenewed.
    pub lease_ttl: Duration,
    /// `--redis-inbound-bytes`: what may wait between Redis and the cores (see [`pubsub`]).
    pub inbound_bytes: u64,
    /// How often each core names the sessions it holds (`Command::Refresh`).
    pub refresh: Duration,
}

impl Options {
    /// Heartbeats renew leases and the instance key three times per TTL (at most every 2 s).
    pub(super) fn heartbeat(&self) -> Duration {
        heartbeat_of(self.lease_ttl)
    }
}

/// The heartbeat of an instance whose `--lease-ttl` is `ttl`.
pub(super) fn heartbeat_of(ttl: Duration) -> Duration {
    (ttl / 3).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

/// What every task of the link reads and never changes.
pub(super) struct Ctx {
    pub o: Options,
    pub cores: Vec<async_channel::Sender<Inbound>>,
    pub stats: Arc<Stats>,
    /// Room for [`CHANGES_TAKEN`] changes taken in (the link waits for one past it).
    pub changes: Arc<tokio::sync::Semaphore>,
    /// Room for [`CHANGES_RUNNING`] changes at Redis at once, taken once a change has its
    /// session's turn (so a queue of one session's changes holds one, not all of them).
    pub running: Arc<tokio::sync::Semaphore>,
    /// One change of a session at a time from this instance, in the order they came
    /// ([`change_in_turn`]); an entry per session with a change taken in, so at most
    /// [`CHANGES_TAKEN`].
    pub changing: RefCell<HashMap<SessionId, Rc<tokio::sync::Mutex<()>>>>,
}

impl Ctx {
    pub fn key(&self, kind: &str, id: &str) -> String {
        self.o.names.key(kind, id)
    }
    pub fn channel(&self, name: &str) -> String {
        self.o.names.channel(name)
    }
    fn session_key(&self, id: SessionId) -> String {
        self.o.names.session(id)
    }

    fn is_cluster(&self) -> bool {
        self.o.names.is_cluster()
    }

    /// This instance's presence, renewed every heartbeat: its `instance` key with a TTL on
    /// one Redis; on a cluster its member of the `instances` sorted set, scored with when it
    /// expires by Redis's own clock (the script reads `TIME`), so no instance's clock counts.
    /// Either way its `instance` key holds `<time> <TTL ms>` (the time by this instance's
    /// clock on one Redis, Redis's on a cluster; only the TTL is read): how long ago an
    /// instance renewed is its own TTL less what is left, so an instance started with another
    /// `--lease-ttl` is judged by its own ([`staleness`]).
    pub fn presence(&self, pipe: &mut redis::Pipeline) {
        let (me, ttl) = (&*self.o.instance, self.o.lease_ttl.as_millis() as u64);
        if self.is_cluster() {
            pipe.cmd("EVAL").arg(PRESENT).arg(2).arg(self.o.names.instances()).arg(self.key("instance", me)).arg(me).arg(ttl).ignore();
        } else {
            let value = format!("{} {ttl}", crate::timefmt::now_millis());
            pipe.cmd("SET").arg(self.key("instance", me)).arg(value).arg("PX").arg(ttl).ignore();
        }
    }

    /// Withdraws this instance's presence (a graceful leave).
    pub fn absence(&self, pipe: &mut redis::Pipeline) {
        if self.is_cluster() {
            pipe.cmd("ZREM").arg(self.o.names.instances()).arg(&*self.o.instance).ignore();
        }
        pipe.cmd("DEL").arg(self.key("instance", &self.o.instance)).ignore();
    }

    /// A session change's publication on `ops`: in the change's transaction on one Redis.
    /// On a cluster the session's key is on its own node while every publication of this
    /// instance goes through the control node (the master of `{P}`), so that the others get
    /// its changes and its device messages in the order it made them (the cluster bus keeps
    /// one order per publishing node): written first, then published ([`Ctx::op_after`]).
    fn with_op(&self, tx: &mut redis::Pipeline, payload: &[u8]) {
        if !self.is_cluster() {
            tx.cmd("PUBLISH").arg(self.channel("ops")).arg(payload).ignore();
        }
    }

    async fn op_after(&self, payload: &[u8], conn: &mut Conn) -> Result<(), Failed> {
        if !self.is_cluster() {
            return Ok(());
        }
        within("PUBLISH ops", redis::cmd("PUBLISH").arg(self.channel("ops")).arg(payload).query_async::<()>(conn)).await
    }
}

/// A cluster's presence: this instance's member of the `instances` sorted set, scored with
/// when it expires by Redis's clock, and its `instance` key (`<time> <TTL ms>`, the TTL on
/// it: both in the control slot); answers that time.
const PRESENT: &str = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) redis.call('SET', KEYS[2], now .. ' ' .. ARGV[2], 'PX', ARGV[2]) return now";
/// A cluster's live instances: expired members dropped, the rest answered.
const LIVE: &str = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now) return redis.call('ZRANGE', KEYS[1], 0, -1)";

/// A cluster's presence probe (design step 11, "who is dead"): every member of the
/// `instances` sorted set with the milliseconds left before its score (its expiry, by Redis's
/// clock), -1 for one already expired (as `PTTL` of a key gone), and its `instance` key
/// (`ARGV[1]` and the member: in the control slot, as `KEYS[1]`; `false` when gone or
/// never written, by an older build); `[member, left, value]` each.
const PRESENCE_LEFT: &str = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) local m = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES') local out = {} for i = 1, #m, 2 do local left = tonumber(m[i + 1]) - now if left < 0 then left = -1 end out[#out + 1] = {m[i], left, redis.call('GET', ARGV[1] .. m[i])} end return out";

/// What the link's tasks share. One thread: a `RefCell`, never borrowed across an await.
pub(super) struct Shared {
    /// Devices this instance watches (kept while Redis is down, announced on reconnect).
    pub local: HashSet<Box<str>>,
    /// Device → the other live instances watching it.
    pub remote: HashMap<Box<str>, HashSet<Arc<str>>>,
    /// Other live instances.
    pub instances: HashSet<Arc<str>>,
    /// Those of them known dead at the publisher's last probe (cluster/resend.rs,
    /// `Probe`, asked again every second while any is): not counted as watchers; dropped when
    /// seen renewing again or when their presence goes.
    pub dead: HashSet<Arc<str>>,
    reads: HashMap<u64, PendingRead>,
    next_read: u64,
    /// Other instances' reads being answered here by spawned tasks.
    answering: usize,
    /// Instances whose `watching` set's size differed from what this instance learnt on the
    /// `watch` channel at the last check ([`check_watches`]).
    suspects: HashSet<Arc<str>>,
    /// While [`check_watches`] reads `watching` sets: the (instance, device) pairs the
    /// `watch` channel spoke of meanwhile (newer than, or as new as, what the read answers).
    touched: Option<HashSet<(Box<str>, Box<str>)>>,
    /// Per device watched here, the last sequence number applied from each origin (wire v2,
    /// at most [`ORIGINS`] a device): a message not newer is received again and dropped.
    /// Devices no longer watched here are forgotten every heartbeat ([`check_watches`]).
    last_seq: HashMap<Box<str>, Vec<(Box<str>, u64)>>,
    /// Recovery histories handed over and adopted (adopt.rs).
    pub adopt: super::adopt::Adoptions,
    /// The sessions held here and the version each is applied up to in order (resync.rs).
    pub versions: super::resync::Versions,
}

impl Shared {
    /// Whether message `seq` of `device` from `origin` is newer than the last applied; it is
    /// the last applied from now on if so.
    fn fresh(&mut self, origin: &str, device: &str, seq: u64) -> bool {
        let seen = self.last_seq.entry_ref(device).or_default();
        if let Some((_, last)) = seen.iter_mut().find(|(o, _)| &**o == origin) {
            if seq <= *last {
                return false;
            }
            *last = seq;
            return true;
        }
        if seen.len() >= ORIGINS {
            seen.remove(0);
        }
        seen.push((origin.into(), seq));
        true
    }
}

pub(super) type State = Rc<RefCell<Shared>>;

pub fn start(
    options: Options,
    commands: super::queue::Receiver,
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
        let lease = Leases::new(cores.len(), owned);
        let ctx = Rc::new(Ctx { o: options, cores, stats, changes: Arc::new(tokio::sync::Semaphore::new(CHANGES_TAKEN)), running: Arc::new(tokio::sync::Semaphore::new(CHANGES_RUNNING)), changing: RefCell::default() });
        let state = Rc::new(RefCell::new(Shared {
            local: HashSet::new(),
            remote: HashMap::new(),
            instances: HashSet::new(),
            dead: HashSet::new(),
            reads: HashMap::new(),
            next_read: 0,
            answering: 0,
            suspects: HashSet::new(),
            touched: None,
            last_seq: HashMap::new(),
            adopt: Default::default(),
            versions: Default::default(),
        }));
        let tasks = tokio::task::LocalSet::new();
        tasks.block_on(&runtime, run(ctx, state, lease, status, commands));
    })?;
    Ok(())
}

pub(super) type Failed = String;

pub(super) async fn within<T>(what: &str, f: impl std::future::Future<Output = redis::RedisResult<T>>) -> Result<T, Failed> {
    match tokio::time::timeout(CALL_DEADLINE, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {} s", CALL_DEADLINE.as_secs())),
    }
}

/// The connections of one session with Redis, and what the cores must learn first.
struct Conns {
    conn: Conn,
    lease_conn: Conn,
    sink: PubSubSink,
    stream: PubSubStream,
    /// Devices other instances started or stopped watching while this one was away.
    changes: Vec<(Box<str>, bool)>,
    /// A cluster: the devices this instance watches, for the shard task to subscribe and
    /// then announce.
    initial: Vec<Box<str>>,
}

async fn run(
    ctx: Rc<Ctx>,
    state: State,
    mut lease: Leases,
    status: Box<dyn Fn(Option<String>) + Send>,
    commands: super::queue::Receiver,
) {
    // Stream plans and the leave order, from the command task to the lease task: one of
    // each at a time in practice (bounded; the command task waits for room).
    let (ctl_tx, mut ctl_rx) = tokio::sync::mpsc::channel::<Ctl>(4);
    let mut backoff = Duration::from_millis(100);
    let mut down_since_logged = false;
    loop {
        let reason = match connect(&ctx, &state).await {
            Ok(conns) => {
                backoff = Duration::from_millis(100);
                let reconnected = ctx.stats.reconnects.load(Ordering::Relaxed) > 0;
                if reconnected {
                    lease.settle_until = Some(tokio::time::Instant::now() + ctx.o.lease_ttl + MAX_BACKOFF);
                }
                status(None);
                ctx.stats.connected.store(1, Ordering::Relaxed);
                tracing::info!(instance = %ctx.o.instance, others = state.borrow().instances.len(), "connected to Redis");
                down_since_logged = false;
                let reason = {
                    let pubsub = pubsub(&ctx, &state, conns.stream, conns.conn.clone(), reconnected, conns.changes);
                    // A cluster's device channels: the shard task (sharded pub/sub).
                    let (shard_tx, shard_rx) = async_channel::bounded(SHARD_REQUESTS);
                    let cluster = ctx.is_cluster();
                    let (shard_conn, initial) = (conns.conn.clone(), conns.initial);
                    let resync_conn = conns.conn.clone();
                    let shards = async {
                        if cluster {
                            shards::run(&ctx, &state, shard_conn, shard_rx, initial).await
                        } else {
                            std::future::pending().await
                        }
                    };
                    let commands = command_loop(&ctx, &state, conns.conn, conns.sink, cluster.then_some(shard_tx), &commands, &ctl_tx);
                    let leases = lease::run(&ctx, &state, &mut lease, conns.lease_conn, &mut ctl_rx);
                    // Session copies that missed a change (this connection's first pass checks
                    // every held session: what was published while away never arrives).
                    let resync = resync::run(&ctx, &state, resync_conn);
                    tokio::select! {
                        r = pubsub => r,
                        r = resync => r,
                        r = commands => r,
                        r = leases => r,
                        r = shards => r,
                    }
                };
                let lost = format!("the link to Redis was lost ({reason})");
                let reads = state.borrow_mut().reads.drain().collect::<Vec<_>>();
                for (_, read) in reads {
                    let _ = read.reply.send(Err(lost.clone()));
                }
                super::adopt::abandon(&state);
                ctx.stats.connected.store(0, Ordering::Relaxed);
                ctx.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                reason
            }
            Err(reason) => reason,
        };
        // What the command task handed the lease task and it did not take.
        while let Ok(c) = ctl_rx.try_recv() {
            refuse_ctl(&mut lease, c);
        }
        if commands.is_closed() {
            return;
        }
        status(Some(reason.clone()));
        if !down_since_logged {
            tracing::warn!(reason = %reason, "Redis unreachable: changes answer 503 and live data from other instances stops until it is back; retrying");
            down_since_logged = true;
        } else {
            tracing::debug!(reason = %reason, "Redis still unreachable");
        }
        // Disconnected: refuse what needs Redis until the back-off has passed.
        let until = tokio::time::Instant::now() + backoff;
        // Leases not renewed may be someone else's by now: stop reading their partitions
        // a heartbeat before they can expire.
        let give_up = lease.renewed_at + ctx.o.lease_ttl.saturating_sub(ctx.o.heartbeat());
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Ok(command) => refuse(&ctx, &state, &mut lease, command, &reason),
                    Err(_) => return,
                },
                _ = tokio::time::sleep_until(give_up), if !lease.leased.is_empty() => {
                    tracing::warn!(partitions = lease.leased.len(), "partition leases not renewed in time (Redis unreachable): reading none until they are taken again");
                    lease.give_up_unrenewed(&ctx.stats);
                }
                _ = tokio::time::sleep_until(until) => break,
            }
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn refuse_ctl(lease: &mut Leases, c: Ctl) {
    match c {
        Ctl::Stream(plan) => lease.stream = Some(plan),
        Ctl::Leave(done) => {
            let _ = done.send(());
        }
    }
}

fn refuse(ctx: &Ctx, state: &State, lease: &mut Leases, command: Command, reason: &str) {
    match command {
        Command::Save { reply, .. } => {
            let _ = reply.send(Err(format!("not connected ({reason})")));
        }
        Command::Load { reply, .. } => {
            let _ = reply.send(Err(format!("not connected ({reason})")));
        }
        Command::Change { reply, .. } => {
            let _ = reply.send(Err(format!("not connected ({reason})")));
        }
        Command::Publish(items) => {
            ctx.stats.dropped.fetch_add(items.len() as u64, Ordering::Relaxed);
        }
        Command::Watch(changes) => {
            let mut s = state.borrow_mut();
            for (device, on) in changes {
                if on {
                    s.local.insert(device);
                } else {
                    s.local.remove(&device);
                }
            }
            ctx.stats.watched_here.store(s.local.len() as u64, Ordering::Relaxed);
        }
        // Not connected: the sessions named are still held here (resync.rs checks them).
        Command::Refresh(ids) => state.borrow_mut().versions.refreshed(&ids, 3 * ctx.o.refresh),
        Command::Stream(plan) => refuse_ctl(lease, Ctl::Stream(plan)),
        Command::Leave(done) => refuse_ctl(lease, Ctl::Leave(done)),
        Command::Read { reply, .. } => {
            let _ = reply.send(Err(format!("not connected ({reason})")));
        }
        Command::Adopt { .. } => {
            ctx.stats.adoptions[super::adopt::NO_PEER].fetch_add(1, Ordering::Relaxed);
        }
        Command::AdoptWatching { .. } | Command::AdoptVerdict { .. } | Command::Take { .. } | Command::GiveNone { .. } => {}
        Command::Settle(done) => {
            let _ = done.send(());
        }
        Command::Staleness(reply) => {
            let _ = reply.send(Err(format!("not connected ({reason})")));
        }
        // The asker's deadline answers for them.
        Command::RingsAsk(_) | Command::RingsAnswer { .. } => {}
    }
}

async fn connect(ctx: &Ctx, state: &State) -> Result<Conns, Failed> {
    let o = &ctx.o;
    let ca = o.ca.as_deref();
    let mut conn = within("connect", super::conn::connect(&o.engine, ca, CALL_DEADLINE)).await?;
    // The lease task's own: a renewal never queues behind a burst of publications.
    let lease_conn = within("connect (leases)", super::conn::connect(&o.engine, ca, CALL_DEADLINE)).await?;
    let pubsub = within("connect (pub/sub)", super::conn::pubsub(&o.engine, ca, CALL_DEADLINE)).await?;
    let (mut sink, stream) = pubsub.split();
    let channels = [ctx.channel("ops"), ctx.channel("watch"), ctx.channel("read"), ctx.key("answer", &o.instance), ctx.key("adopt", &o.instance)];
    within("SUBSCRIBE", sink.subscribe(&channels)).await?;
    // Announce this instance and what it watches (after a reconnect: again, whole).
    let me = o.instance.clone();
    let mut pipe = redis::pipe();
    ctx.presence(&mut pipe);
    pipe.cmd("DEL").arg(ctx.key("watching", &me)).ignore();
    within("SET instance", pipe.query_async::<()>(&mut conn)).await?;
    let local: Vec<Box<str>> = state.borrow().local.iter().cloned().collect();
    // A cluster's device channels: subscribed, then announced, by the shard task.
    let mut initial = Vec::new();
    if ctx.is_cluster() {
        initial = local;
    } else {
        for chunk in local.chunks(CHUNK) {
            // Subscribed before announced: once another instance knows, messages arrive.
            let channels: Vec<String> = chunk.iter().map(|d| ctx.key("device", d)).collect();
            within("SUBSCRIBE devices", sink.subscribe(channels)).await?;
            announce(ctx, &mut conn, chunk).await?;
        }
    }
    // What the others watch, read after subscribing to `watch` so no change is missed.
    let live = live_instances(ctx, &mut conn).await?;
    let mut remote: HashMap<Box<str>, HashSet<Arc<str>>> = HashMap::new();
    for instance in &live {
        let devices: Vec<String> = within("SMEMBERS", redis::cmd("SMEMBERS").arg(ctx.key("watching", instance)).query_async(&mut conn)).await?;
        for device in devices {
            remote.entry(device.into_boxed_str()).or_default().insert(instance.clone());
        }
    }
    let mut s = state.borrow_mut();
    let mut changes: Vec<(Box<str>, bool)> = Vec::new();
    for device in s.remote.keys() {
        if !remote.contains_key(device) {
            changes.push((device.clone(), false));
        }
    }
    for device in remote.keys() {
        if !s.remote.contains_key(device) {
            changes.push((device.clone(), true));
        }
    }
    s.remote = remote;
    s.suspects.clear();
    // Subscribed to `ops` above: from here on no change is missed; what was published while
    // away is found by checking every held session (resync.rs). At the first connect every
    // session held was loaded since, or is unknown and checked anyway.
    s.versions.check_all = ctx.stats.reconnects.load(Ordering::Relaxed) > 0;
    s.instances = live;
    ctx.stats.instances.store(s.instances.len() as u64 + 1, Ordering::Relaxed);
    Ok(Conns { conn, lease_conn, sink, stream, changes, initial })
}

/// How long ago each other instance with a presence renewed it (ms, Redis's clock), `None`
/// for one whose presence is gone: what the probe of who is dead reads (design step 11 c,
/// recovery.md; `Command::Staleness`) and the publisher's (cluster/resend.rs). One Redis:
/// the instance keys' `PTTL`; a cluster: the `instances` sorted set's scores, one script.
///
/// Each instance is judged by its own `--lease-ttl` (its `instance` key names it; an older
/// build's does not, and is taken to have this instance's): renewed `its TTL − left` ago,
/// reported as if it renewed on this instance's heartbeat (`+ this heartbeat − its
/// heartbeat`), so the rule both readers apply, "not renewed for a heartbeat and a second"
/// by this instance's heartbeat, holds for its own. Before, every instance was judged by
/// the reader's TTL: one with a shorter TTL than the reader's looked long dead while alive
/// (not asked for its rings, not waited for as a watcher), one with a longer TTL alive long
/// after it died.
pub(super) async fn staleness(ctx: &Ctx, conn: &mut Conn) -> Result<Vec<(Box<str>, Option<i64>)>, Failed> {
    let mine = ctx.o.lease_ttl;
    let ago = |left: i64, value: Option<&str>| -> Option<i64> {
        (left >= 0).then(|| {
            let ttl = value.and_then(ttl_of).unwrap_or(mine);
            let shift = ctx.o.heartbeat().as_millis() as i64 - heartbeat_of(ttl).as_millis() as i64;
            ttl.as_millis() as i64 - left + shift
        })
    };
    if ctx.is_cluster() {
        // Presence is a member of the `instances` sorted set scored with when it expires
        // (Redis's clock): what is left of it, as `PTTL` answers on one Redis.
        let prefix = ctx.key("instance", "");
        let left: Vec<(String, i64, Option<String>)> = within("presence left", redis::cmd("EVAL").arg(PRESENCE_LEFT).arg(1).arg(ctx.o.names.instances()).arg(prefix).query_async(conn)).await?;
        let me = &*ctx.o.instance;
        return Ok(left.into_iter().filter(|(id, ..)| id != me).map(|(id, p, v)| (id.into_boxed_str(), ago(p, v.as_deref()))).collect());
    }
    let others: Vec<Arc<str>> = live_instances(ctx, conn).await?.into_iter().collect();
    let mut pipe = redis::pipe();
    for id in &others {
        pipe.cmd("PTTL").arg(ctx.key("instance", id));
        pipe.cmd("GET").arg(ctx.key("instance", id));
    }
    let left: Vec<(i64, Option<String>)> = if others.is_empty() {
        Vec::new()
    } else {
        let flat: Vec<redis::Value> = within("PTTL instances", pipe.query_async(conn)).await?;
        flat.chunks(2)
            .map(|pair| (redis::from_redis_value_ref(&pair[0]).unwrap_or(-2), redis::from_redis_value_ref(&pair[1]).unwrap_or(None)))
            .collect()
    };
    Ok(others.iter().zip(left).map(|(id, (p, v))| (Box::from(&**id), ago(p, v.as_deref()))).collect())
}

/// The TTL an `instance` key's value (`<time> <TTL ms>`) names; `None` for an older build's
/// (`<time>` alone) or anything else.
fn ttl_of(value: &str) -> Option<Duration> {
    let ms: u64 = value.split(' ').nth(1)?.parse().ok()?;
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// Tells the others this instance watches `devices` (its `watching` set and the `watch`
/// channel), once it receives their channels.
pub(super) async fn announce(ctx: &Ctx, conn: &mut Conn, devices: &[Box<str>]) -> Result<(), Failed> {
    let me = &*ctx.o.instance;
    for chunk in devices.chunks(CHUNK) {
        let mut pipe = redis::pipe();
        pipe.cmd("SADD").arg(ctx.key("watching", me));
        for device in chunk {
            pipe.arg(&**device);
        }
        pipe.ignore();
        for device in chunk {
            pipe.cmd("PUBLISH").arg(ctx.channel("watch")).arg(format!("+{me}\t{device}")).ignore();
        }
        within("SADD watching", pipe.query_async::<()>(conn)).await?;
    }
    Ok(())
}

/// Other instances whose presence is alive (one Redis: `SCAN` of the instance keys; a
/// cluster: the sorted set, expired members dropped first).
pub(super) async fn live_instances(ctx: &Ctx, conn: &mut Conn) -> Result<HashSet<Arc<str>>, Failed> {
    let ids: Vec<String> = if ctx.is_cluster() {
        within("live instances", redis::cmd("EVAL").arg(LIVE).arg(1).arg(ctx.o.names.instances()).query_async(conn)).await?
    } else {
        let pattern = ctx.o.names.instances_pattern();
        let strip = pattern.len() - 1;
        let keys = within("SCAN", conn.scan(&pattern)).await?;
        keys.into_iter().map(|k| k[strip..].to_string()).collect()
    };
    Ok(ids.into_iter().filter(|id| id != &*ctx.o.instance).map(Arc::from).collect())
}

/// The `watch` channel's safety net, every heartbeat (from the lease task): what this
/// instance learnt on `watch` can miss an announcement (on a cluster a classic `PUBLISH`
/// reaches only the nodes its node has a bus link to at that moment, so one made while the
/// cluster's links come back after a restart is lost; an instance that reconnects also
/// replaces its set without publishing what it dropped). So each live instance's `watching`
/// set size (`SCARD`, one pipeline) is compared with what this instance holds for it; an
/// instance that differs at two checks in a row (one may be announcements still on their
/// way) has its set read (`SMEMBERS`) and this instance's view of it corrected: devices
/// added and removed, except those the `watch` channel spoke of while the sets were read
/// (newer). Each corrected (instance, device) is counted
/// (`hubcast_redis_watch_resyncs_total`) and the check logged at `warn`: it means an
/// announcement was lost. Cores learn the devices that start or stop being watched
/// elsewhere by a task of their own (a full core queue never holds the heartbeat).
pub(super) async fn check_watches(ctx: &Ctx, state: &State, conn: &mut Conn) -> Result<(), Failed> {
    {
        let mut guard = state.borrow_mut();
        let s = &mut *guard;
        s.last_seq.retain(|device, _| s.local.contains(device));
    }
    let others: Vec<Arc<str>> = state.borrow().instances.iter().cloned().collect();
    if others.is_empty() {
        state.borrow_mut().suspects.clear();
        return Ok(());
    }
    let mut pipe = redis::pipe();
    for i in &others {
        pipe.cmd("SCARD").arg(ctx.key("watching", i));
    }
    let sizes: Vec<usize> = within("SCARD watching", pipe.query_async(conn)).await?;
    let resync: Vec<Arc<str>> = {
        let mut guard = state.borrow_mut();
        let s = &mut *guard;
        let mut known: HashMap<&Arc<str>, usize> = HashMap::new();
        for watchers in s.remote.values() {
            for i in watchers {
                *known.entry(i).or_default() += 1;
            }
        }
        let differ: HashSet<Arc<str>> =
            others.iter().zip(&sizes).filter(|(i, n)| known.get(i).copied().unwrap_or(0) != **n).map(|(i, _)| i.clone()).collect();
        let again = differ.iter().filter(|i| s.suspects.contains(*i)).cloned().collect();
        s.suspects = differ;
        again
    };
    if resync.is_empty() {
        return Ok(());
    }
    state.borrow_mut().touched = Some(HashSet::new());
    let mut pipe = redis::pipe();
    for i in &resync {
        pipe.cmd("SMEMBERS").arg(ctx.key("watching", i));
    }
    let read: Result<Vec<Vec<String>>, Failed> = within("SMEMBERS watching", pipe.query_async(conn)).await;
    let touched = state.borrow_mut().touched.take();
    let (Some(touched), sets) = (touched, read?) else { return Ok(()) };
    let (mut added, mut removed) = (0usize, 0usize);
    let mut changes: WatchChanges = Vec::new();
    {
        let mut s = state.borrow_mut();
        for (i, set) in resync.iter().zip(sets) {
            if !s.instances.contains(i) {
                continue; // gone meanwhile
            }
            let fresh = |d: &str| !touched.contains(&(Box::from(&**i), Box::from(d)));
            let set: HashSet<Box<str>> = set.into_iter().map(String::into_boxed_str).collect();
            for device in &set {
                if !fresh(device) {
                    continue;
                }
                let watchers = s.remote.entry(device.clone()).or_default();
                if watchers.insert(i.clone()) {
                    added += 1;
                    if watchers.len() == 1 {
                        changes.push((device.clone(), true));
                    }
                }
            }
            s.remote.retain(|device, watchers| {
                if watchers.contains(i) && !set.contains(device) && fresh(device) {
                    watchers.remove(i);
                    removed += 1;
                    if watchers.is_empty() {
                        changes.push((device.clone(), false));
                        return false;
                    }
                }
                true
            });
            s.suspects.remove(i);
        }
    }
    if added + removed == 0 {
        return Ok(());
    }
    ctx.stats.watch_resyncs.fetch_add((added + removed) as u64, Ordering::Relaxed);
    tracing::warn!(
        instances = resync.len(),
        added,
        removed,
        "watches corrected from the instances' watching sets: an announcement on the watch channel was missed"
    );
    let sends = remote_watch_batches(ctx, changes);
    tokio::task::spawn_local(async move {
        for (core, batch) in sends {
            let _ = core.send(Inbound::RemoteWatch(batch)).await;
        }
    });
    Ok(())
}

/// How many of the other live instances take a share of the partitions: those without a
/// stalled core (`P:stalled:<instance>`). Announces this instance's own stalled cores first
/// (`None`: none), in the same round trip.
pub(super) async fn instances_taking_a_share(ctx: &Ctx, state: &State, stalled: Option<&str>, conn: &mut Conn) -> Result<usize, Failed> {
    let others: Vec<Arc<str>> = state.borrow().instances.iter().cloned().collect();
    let mine = ctx.key("stalled", &ctx.o.instance);
    let mut pipe = redis::pipe();
    match stalled {
        Some(cores) => pipe.cmd("SET").arg(mine).arg(cores).arg("PX").arg(ctx.o.lease_ttl.as_millis() as u64).ignore(),
        None => pipe.cmd("DEL").arg(mine).ignore(),
    };
    for i in &others {
        pipe.cmd("EXISTS").arg(ctx.key("stalled", i));
    }
    let stalled: Vec<i64> = within("stalled instances", pipe.query_async(conn)).await?;
    Ok(stalled.iter().filter(|s| **s == 0).count())
}

/// Devices other instances started (`true`) or stopped watching.
pub(super) type WatchChanges = Vec<(Box<str>, bool)>;

/// Remote watch changes grouped per device core, with the core's queue.
pub(super) fn remote_watch_batches(ctx: &Ctx, changes: WatchChanges) -> Vec<(async_channel::Sender<Inbound>, WatchChanges)> {
    let mut per_core: Vec<Vec<(Box<str>, bool)>> = (0..ctx.cores.len()).map(|_| Vec::new()).collect();
    for (device, on) in changes {
        per_core[core_of_device(&device, ctx.cores.len())].push((device, on));
    }
    per_core.into_iter().enumerate().filter(|(_, c)| !c.is_empty()).map(|(core, c)| (ctx.cores[core].clone(), c)).collect()
}

async fn send_remote_watch(ctx: &Ctx, changes: Vec<(Box<str>, bool)>) {
    for (core, batch) in remote_watch_batches(ctx, changes) {
        let _ = core.send(Inbound::RemoteWatch(batch)).await;
    }
}

/// The pub/sub task: until the subscriber connection fails.
async fn pubsub(
    ctx: &Rc<Ctx>,
    state: &State,
    stream: PubSubStream,
    conn: Conn,
    reconnected: bool,
    changes: Vec<(Box<str>, bool)>,
) -> Failed {
    // Before any message of this connection, in each core's queue: after an outage, forget
    // the values learnt from the others (what they published meanwhile was lost with the
    // connection); and what the others watch now.
    if reconnected {
        for core in &ctx.cores {
            let _ = core.send(Inbound::Reconnected).await;
        }
    }
    send_remote_watch(ctx, changes).await;
    let mut stream = stream.ready_chunks(256);
    // **Bounded in bytes.** The redis crate reads the connection into an unbounded queue
    // whenever its driver runs, whether or not this task takes the messages: were this task
    // to wait on a full core queue before reading on, that queue would grow without bound
    // while a core is behind. So one future reads the stream without pause into `held`,
    // and another applies what is held, in order (a core's queue full: it waits). What waits
    // between Redis and the cores (held here, queued for a core and not yet taken) is charged
    // to `inbound_bytes`; past `--redis-inbound-bytes` the subscriber is dropped: the link
    // reconnects as after an outage (what was published meanwhile is lost; values learnt
    // from the others stop being current), which is what Redis's own pub/sub
    // `client-output-buffer-limit` does to a client that reads too slowly. Counted in
    // `hubcast_redis_overruns_total`, logged at WARN.
    let held: RefCell<VecDeque<(Vec<redis::Msg>, u64)>> = RefCell::default();
    let charged = std::cell::Cell::new(0u64);
    let arrived = tokio::sync::Notify::new();
    let read = async {
        loop {
            let Some(batch) = stream.next().await else { return "the pub/sub connection closed".to_string() };
            let bytes: u64 = batch.iter().map(|m| m.get_payload_bytes().len() as u64 + 64).sum();
            let before = ctx.stats.inbound_bytes.fetch_add(bytes, Ordering::Relaxed);
            charged.set(charged.get() + bytes);
            if before > 0 && before + bytes > ctx.o.inbound_bytes {
                return overrun(ctx, before + bytes);
            }
            held.borrow_mut().push_back((batch, bytes));
            arrived.notify_one();
        }
    };
    let apply = async {
        loop {
            let next = held.borrow_mut().pop_front();
            match next {
                Some((batch, bytes)) => {
                    on_messages(ctx, state, &conn, batch).await;
                    ctx.stats.inbound_bytes.fetch_sub(bytes, Ordering::Relaxed);
                    charged.set(charged.get() - bytes);
                }
                None => arrived.notified().await,
            }
        }
    };
    let reason = tokio::select! {
        reason = read => reason,
        _ = apply => unreachable!("applies for ever"),
    };
    // What was held (or being applied) goes with the connection.
    ctx.stats.inbound_bytes.fetch_sub(charged.get(), Ordering::Relaxed);
    reason
}

/// The cores are `waiting` bytes behind Redis, past `--redis-inbound-bytes`: counted, logged,
/// and the reason the subscriber is dropped.
pub(super) fn overrun(ctx: &Ctx, waiting: u64) -> Failed {
    ctx.stats.overruns.fetch_add(1, Ordering::Relaxed);
    let reason = format!("the cores fell behind Redis: {waiting} bytes waiting, more than --redis-inbound-bytes {}", ctx.o.inbound_bytes);
    tracing::warn!(waiting, bound = ctx.o.inbound_bytes, "the cores fell behind what Redis sends: dropping the subscriber and connecting again (messages meanwhile are lost, as in an outage)");
    reason
}

/// The command task: until a Redis call fails.
async fn command_loop(
    ctx: &Rc<Ctx>,
    state: &State,
    mut conn: Conn,
    mut sink: PubSubSink,
    shards: Option<async_channel::Sender<shards::Req>>,
    commands: &super::queue::Receiver,
    ctl: &tokio::sync::mpsc::Sender<Ctl>,
) -> Failed {
    // A cluster's device messages short of their watchers (a slot moving), published again.
    let mut resend = resend::Resend::default();
    // Who is dead, asked by a task of its own (resend.rs): its answer applied when it comes.
    let mut probe = resend::Probe::default();
    loop {
        let next_read = state.borrow().reads.values().map(|r| r.deadline).min();
        let probe_due = probe.due(state, &resend);
        let result = tokio::select! {
            answer = probe.answer() => {
                probe.apply(ctx, state, answer);
                Ok(())
            }
            _ = tokio::time::sleep_until(probe_due.unwrap_or_else(tokio::time::Instant::now)), if probe_due.is_some() => {
                probe.ask(ctx, &conn);
                Ok(())
            }
            _ = tokio::time::sleep_until(next_read.unwrap_or_else(tokio::time::Instant::now)), if next_read.is_some() => {
                expire_reads(state);
                Ok(())
            }
            _ = tokio::time::sleep_until(resend.due.unwrap_or_else(tokio::time::Instant::now)), if resend.due.is_some() => {
                resend::again(ctx, state, &conn, &mut resend).await
            }
            command = commands.recv() => match command {
                // Publications queued together go together (queue.rs, `coalesce`: bounded,
                // order kept); what ended the gathering is served right after them.
                Ok(Command::Publish(items)) => {
                    let (items, next) = commands.coalesce(items, super::queue::COALESCE_WINDOW).await;
                    match on_command(ctx, state, Command::Publish(items), &mut conn, &mut sink, shards.as_ref(), &mut resend).await {
                        Ok(()) => match next {
                            Some(next) => serve(ctx, state, next, &mut conn, &mut sink, shards.as_ref(), &mut resend, ctl).await,
                            None => Ok(()),
                        },
                        Err(reason) => Err(reason),
                    }
                }
                command => serve(ctx, state, command, &mut conn, &mut sink, shards.as_ref(), &mut resend, ctl).await,
            },
        };
        if let Err(reason) = result {
            resend.abandon(ctx);
            return reason;
        }
    }
}

/// One command taken from the queue (or its end).
#[allow(clippy::too_many_arguments)]
async fn serve(
    ctx: &Rc<Ctx>,
    state: &State,
    command: Result<Command, async_channel::RecvError>,
    conn: &mut Conn,
    sink: &mut PubSubSink,
    shards: Option<&async_channel::Sender<shards::Req>>,
    resend: &mut resend::Resend,
    ctl: &tokio::sync::mpsc::Sender<Ctl>,
) -> Result<(), Failed> {
    match command {
        Ok(Command::Stream(plan)) => ctl.send(Ctl::Stream(plan)).await.map_err(|_| "stopped".to_string()),
        Ok(Command::Leave(done)) => ctl.send(Ctl::Leave(done)).await.map_err(|_| "stopped".to_string()),
        Ok(command) => on_command(ctx, state, command, conn, sink, shards, resend).await,
        Err(_) => Err("stopped".to_string()),
    }
}

/// Answers the reads whose time is up with the best answer so far.
fn expire_reads(state: &State) {
    let now = tokio::time::Instant::now();
    let mut s = state.borrow_mut();
    let due: Vec<u64> = s.reads.iter().filter(|(_, r)| r.deadline <= now).map(|(id, _)| *id).collect();
    for id in due {
        if let Some(read) = s.reads.remove(&id) {
            let _ = read.reply.send(Ok(read.best));
        }
    }
}

async fn on_command(
    ctx: &Rc<Ctx>,
    state: &State,
    command: Command,
    conn: &mut Conn,
    sink: &mut PubSubSink,
    shards: Option<&async_channel::Sender<shards::Req>>,
    resend: &mut resend::Resend,
) -> Result<(), Failed> {
    let Some(command) = super::adopt::on_command(ctx, state, conn, command).await? else { return Ok(()) };
    match command {
        Command::Save { op, reply } => {
            let result = save(ctx, &op, conn).await;
            if result.is_ok() {
                let mut s = state.borrow_mut();
                match op {
                    SharedOp::Create(id) => s.versions.created(id),
                    SharedOp::Delete(id) => s.versions.gone(id),
                    SharedOp::DeleteAll => s.versions.clear(),
                    SharedOp::Access { .. } | SharedOp::Accesses { .. } => {}
                }
            }
            let failed = result.as_ref().err().cloned();
            let _ = reply.send(result);
            if let Some(reason) = failed {
                return Err(reason);
            }
        }
        Command::Change { session, changes, reply } => {
            // A task of its own: a session changed by many instances at once (retries) holds
            // no other command; a failed change answers 503 and leaves the link up.
            let Ok(taken) = ctx.changes.clone().acquire_owned().await else { return Ok(()) };
            let (ctx, mut conn) = (ctx.clone(), conn.clone());
            tokio::task::spawn_local(async move {
                let _ = reply.send(change_in_turn(&ctx, session, changes, &mut conn).await);
                drop(taken);
            });
        }
        Command::Load { session, reply } => {
            let key = ctx.session_key(session);
            let result: Result<std::collections::HashMap<Vec<u8>, Vec<u8>>, Failed> =
                within("HGETALL", redis::cmd("HGETALL").arg(&key).query_async(conn)).await;
            let failed = result.as_ref().err().cloned();
            let loaded = result.map(|fields| parse_session(session, &fields));
            if let Ok(Some((v, _))) = &loaded {
                state.borrow_mut().versions.loaded(session, *v);
            }
            let _ = reply.send(loaded);
            if let Some(reason) = failed {
                return Err(reason);
            }
        }
        Command::Publish(items) => {
            if ctx.is_cluster() {
                // Sharded: each to its channel's master, counted against its watchers.
                return resend::publish(ctx, state, &*conn, items, resend).await;
            }
            let n = items.len() as u64;
            let mut pipe = redis::pipe();
            for (device, payload) in &items {
                pipe.cmd("PUBLISH").arg(ctx.key("device", device)).arg(payload.as_slice()).ignore();
            }
            ctx.stats.publish_pipelines.fetch_add(1, Ordering::Relaxed);
            if let Err(reason) = within("PUBLISH", pipe.query_async::<()>(conn)).await {
                ctx.stats.dropped.fetch_add(n, Ordering::Relaxed);
                return Err(reason);
            }
            ctx.stats.published.fetch_add(n, Ordering::Relaxed);
        }
        Command::Watch(changes) => {
            let me = ctx.o.instance.clone();
            let (mut on, mut off) = (Vec::new(), Vec::new());
            let mut pipe = redis::pipe();
            {
                let mut s = state.borrow_mut();
                for (device, watch) in changes {
                    if watch == s.local.contains(&device) {
                        continue;
                    }
                    let (cmd, sign) = if watch { ("SADD", '+') } else { ("SREM", '-') };
                    pipe.cmd(cmd).arg(ctx.key("watching", &me)).arg(&*device).ignore();
                    pipe.cmd("PUBLISH").arg(ctx.channel("watch")).arg(format!("{sign}{me}\t{device}")).ignore();
                    let channel = ctx.key("device", &device);
                    if watch {
                        s.local.insert(device);
                        on.push(channel);
                    } else {
                        s.local.remove(&device);
                        off.push(channel);
                    }
                }
                ctx.stats.watched_here.store(s.local.len() as u64, Ordering::Relaxed);
            }
            // Subscribed before announced: once another instance knows, messages arrive.
            if let Some(shards) = shards {
                if !on.is_empty() {
                    let (reply, done) = futures_channel::oneshot::channel();
                    shards.send(shards::Req::Subscribe(on, reply)).await.map_err(|_| "the shard task stopped".to_string())?;
                    done.await.map_err(|_| "the shard task stopped".to_string())??;
                }
                if !off.is_empty() {
                    shards.send(shards::Req::Unsubscribe(off)).await.map_err(|_| "the shard task stopped".to_string())?;
                }
            } else {
                if !on.is_empty() {
                    within("SUBSCRIBE", sink.subscribe(on)).await?;
                }
                if !off.is_empty() {
                    within("UNSUBSCRIBE", sink.unsubscribe(off)).await?;
                }
            }
            within("announce watch", pipe.query_async::<()>(conn)).await?;
        }
        // Handed to the lease task by the command loop; adoption's above.
        Command::Stream(_) | Command::Leave(_) => {}
        Command::Adopt { .. } | Command::AdoptWatching { .. } | Command::AdoptVerdict { .. } | Command::Settle(_) | Command::Take { .. } | Command::GiveNone { .. } => {}
        Command::Staleness(reply) => {
            let _ = reply.send(Ok(staleness(ctx, conn).await?));
        }
        Command::RingsAsk(payload) => {
            let publish = redis::cmd("PUBLISH").arg(ctx.channel("read")).arg(payload).to_owned();
            within("PUBLISH rings ask", publish.query_async::<()>(conn)).await?;
        }
        Command::RingsAnswer { to, payload } => {
            let publish = redis::cmd("PUBLISH").arg(ctx.key("answer", &to)).arg(payload).to_owned();
            within("PUBLISH rings answer", publish.query_async::<()>(conn)).await?;
        }
        Command::Read { device, kind, newer_than, reply } => {
            // Waiting before it is asked: the answers come on the pub/sub connection, which
            // may deliver them before this task sees its PUBLISH answered.
            let id = {
                let mut s = state.borrow_mut();
                if s.instances.is_empty() || s.reads.len() >= READS_PENDING {
                    let _ = reply.send(Ok(None));
                    return Ok(());
                }
                s.next_read += 1;
                let id = s.next_read;
                let deadline = tokio::time::Instant::now() + READ_DEADLINE;
                let expected = s.instances.len();
                s.reads.insert(id, PendingRead { reply, expected, got: 0, best: None, deadline });
                id
            };
            let publish = redis::cmd("PUBLISH").arg(ctx.channel("read")).arg(wire::encode_read(&ctx.o.instance, id, &device, &kind, newer_than)).to_owned();
            if let Err(reason) = within("PUBLISH read", publish.query_async::<()>(conn)).await {
                if let Some(read) = state.borrow_mut().reads.remove(&id) {
                    let _ = read.reply.send(Err(reason.clone()));
                }
                return Err(reason);
            }
        }
        Command::Refresh(ids) => {
            state.borrow_mut().versions.refreshed(&ids, 3 * ctx.o.refresh);
            let ttl = ctx.o.session_ttl.as_millis() as u64;
            for chunk in ids.chunks(CHUNK) {
                let mut pipe = redis::pipe();
                for id in chunk {
                    pipe.cmd("PEXPIRE").arg(ctx.session_key(*id)).arg(ttl).ignore();
                }
                within("PEXPIRE", conn.each(&pipe)).await?;
            }
        }
    }
    Ok(())
}

/// A session's hash as `HGETALL` answers it: its version and its access per device (`None`:
/// no such session).
pub(super) fn parse_session(session: SessionId, fields: &std::collections::HashMap<Vec<u8>, Vec<u8>>) -> super::Loaded {
    if fields.is_empty() {
        return None;
    }
    let v = fields.get(&b"v"[..]).and_then(|v| std::str::from_utf8(v).ok()?.parse().ok()).unwrap_or(0);
    let ops = fields
        .iter()
        .filter(|(k, _)| k.starts_with(b"a:"))
        .filter_map(|(_, v)| wire::decode_access(v))
        .filter(|(_, s, _)| *s == session)
        .map(|(device, session, access)| SharedOp::Access { session, device, access })
        .collect();
    Some((v, ops))
}

/// [`change`], one of a session at a time from this instance, in the order they came
/// (`tokio::sync::Mutex` is fair). Why: changes of one session race on its version, and the
/// loser reads again; N requests at once for one session (a backend granting a session its
/// devices in parallel) made the last need N tries, past [`CHANGE_TRIES`]: a 503 with no other
/// instance involved. In turn, only changes from other instances can cost a retry.
async fn change_in_turn(ctx: &Ctx, session: SessionId, changes: Vec<(Box<str>, super::AccessChange)>, conn: &mut Conn) -> Result<super::Changed, Failed> {
    let turn = ctx.changing.borrow_mut().entry(session).or_default().clone();
    let result = {
        let _mine = turn.lock().await;
        match ctx.running.acquire().await {
            Ok(_running) => change(ctx, session, changes, conn).await,
            Err(_) => Err("the Redis link is closing".to_string()),
        }
    };
    drop(turn);
    let mut changing = ctx.changing.borrow_mut();
    if changing.get(&session).is_some_and(|t| Rc::strong_count(t) == 1) {
        changing.remove(&session);
    }
    result
}

/// One request's changes to a session (see [`Command::Change`]): read its version and the
/// devices' accesses (`HMGET`), compute every change in Rust (`AccessChange::apply`, the one
/// place of the access rules), then one [`CHANGE`] script writes them and publishes one
/// `SharedOp::Accesses` if the version still holds; else read again, at most
/// [`CHANGE_TRIES`] times.
async fn change(ctx: &Ctx, session: SessionId, changes: Vec<(Box<str>, super::AccessChange)>, conn: &mut Conn) -> Result<super::Changed, Failed> {
    let key = ctx.session_key(session);
    let ttl = ctx.o.session_ttl.as_millis() as u64;
    // The devices touched, each once, in the request's order.
    let mut devices: Vec<&str> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (device, _) in &changes {
        index.entry(&**device).or_insert_with(|| {
            devices.push(device);
            devices.len() - 1
        });
    }
    for _ in 0..CHANGE_TRIES {
        let mut read = redis::cmd("HMGET");
        read.arg(&key).arg("created").arg("v");
        for device in &devices {
            read.arg(format!("a:{device}"));
        }
        let fields: Vec<Option<Vec<u8>>> = within("HMGET session", read.query_async(conn)).await?;
        if fields.len() != devices.len() + 2 {
            return Err(format!("HMGET session: {} fields answered for {}", fields.len(), devices.len() + 2));
        }
        if fields[0].is_none() {
            return Ok(None);
        }
        let v: u64 = fields[1].as_deref().and_then(|v| std::str::from_utf8(v).ok()?.parse().ok()).unwrap_or(0);
        let mut accesses: Vec<crate::shard::access::Access> = fields[2..]
            .iter()
            .map(|stored| {
                match stored.as_deref().and_then(wire::decode_access) {
                    Some((_, _, Some((grants, subs)))) => crate::shard::access::Access::new(grants, subs),
                    _ => crate::shard::access::Access::default(),
                }
            })
            .collect();
        let mut written = vec![false; devices.len()];
        let permitted: Vec<bool> = changes
            .iter()
            .map(|(device, change)| {
                let i = index[&**device];
                let ok = change.apply(&mut accesses[i]);
                written[i] |= ok;
                ok
            })
            .collect();
        let whole = |a: &crate::shard::access::Access| (!a.is_empty()).then(|| (a.grants(), a.subs()));
        let after: Vec<(Box<str>, super::AccessOn)> =
            devices.iter().zip(&accesses).zip(&written).filter(|(_, w)| **w).map(|((d, a), _)| (Box::from(*d), whole(a))).collect();
        if after.is_empty() {
            // Nothing permitted: nothing to write.
            return Ok(Some((v, after, permitted)));
        }
        let op = SharedOp::Accesses { session, v: v + 1, changes: after };
        let mut call = redis::cmd("EVAL");
        let payload = wire::encode_op(&ctx.o.instance, &op);
        // Published by the script on one Redis; on a cluster after it, from the control node
        // (`Ctx::op_after`: one publishing node per instance).
        let channel = if ctx.is_cluster() { String::new() } else { ctx.channel("ops") };
        call.arg(CHANGE).arg(1).arg(&key).arg(v).arg(ttl).arg(channel).arg(if ctx.is_cluster() { &[][..] } else { &payload[..] });
        let SharedOp::Accesses { changes: after, .. } = op else { unreachable!() };
        for (device, access) in &after {
            call.arg(format!("a:{device}"));
            match access {
                Some(a) => call.arg(wire::encode_access(device, session, Some(a))),
                None => call.arg(""),
            };
        }
        let done: i64 = within("EVAL change", call.query_async(conn)).await?;
        match done {
            -1 => return Ok(None),
            0 => continue,
            nv => {
                ctx.op_after(&payload, conn).await?;
                return Ok(Some((nv as u64, after, permitted)));
            }
        }
    }
    Err(format!("a session changed on other instances faster than this one could write it ({CHANGE_TRIES} tries)"))
}

async fn save(ctx: &Ctx, op: &SharedOp, conn: &mut Conn) -> Result<bool, Failed> {
    let ttl = ctx.o.session_ttl.as_millis() as u64;
    let ops_channel = ctx.channel("ops");
    match op {
        SharedOp::Create(id) => {
            let key = ctx.session_key(*id);
            let mut pipe = redis::pipe();
            pipe.atomic().cmd("HSET").arg(&key).arg("created").arg(crate::timefmt::now_millis()).ignore();
            pipe.cmd("PEXPIRE").arg(&key).arg(ttl).ignore();
            within("HSET session", pipe.query_async::<()>(conn)).await?;
            Ok(true)
        }
        SharedOp::Delete(id) => {
            let key = ctx.session_key(*id);
            let mut pipe = redis::pipe();
            pipe.atomic().cmd("DEL").arg(&key);
            // Its tombstone: an instance that missed this delete drops its copy (resync.rs).
            pipe.cmd("SET").arg(ctx.o.names.gone(*id)).arg(1).arg("PX").arg(ttl).ignore();
            let payload = wire::encode_op(&ctx.o.instance, op);
            ctx.with_op(&mut pipe, &payload);
            let (deleted,): (i64,) = within("DEL session", pipe.query_async(&mut conn.at(&key))).await?;
            ctx.op_after(&payload, conn).await?;
            Ok(deleted > 0)
        }
        SharedOp::DeleteAll => {
            // Before the keys go: an instance that missed this drops its copies (resync.rs).
            let mark = redis::cmd("SET").arg(ctx.o.names.cleared()).arg(crate::timefmt::now_millis()).arg("PX").arg(ttl).to_owned();
            within("SET cleared", mark.query_async::<()>(conn)).await?;
            let keys = within("SCAN", conn.scan(&ctx.o.names.sessions_pattern())).await?;
            for chunk in keys.chunks(CHUNK) {
                within("DEL sessions", redis::cmd("DEL").arg(chunk).query_async::<()>(conn)).await?;
            }
            let publish = redis::cmd("PUBLISH").arg(&ops_channel).arg(wire::encode_op(&ctx.o.instance, op)).to_owned();
            within("PUBLISH ops", publish.query_async::<()>(conn)).await?;
            Ok(true)
        }
        // Access changes go through `Command::Change` (versioned, one script).
        SharedOp::Access { .. } | SharedOp::Accesses { .. } => Err("an access change is not saved as such".to_string()),
    }
}

/// A burst of pub/sub messages, in order: device messages are grouped per core between two
/// control messages, each handed to its core's queue in the order Redis gave them. Nothing
/// here waits for a core's answer.
pub(super) async fn on_messages(ctx: &Rc<Ctx>, state: &State, conn: &Conn, batch: Vec<redis::Msg>) {
    let ops = ctx.channel("ops");
    let watch = ctx.channel("watch");
    let read = ctx.channel("read");
    let answer = ctx.key("answer", &ctx.o.instance);
    let adopt = ctx.key("adopt", &ctx.o.instance);
    let device_prefix = ctx.key("device", "");
    let mut per_core: Vec<Vec<crate::ingest::IngestMessage>> = (0..ctx.cores.len()).map(|_| Vec::new()).collect();
    for msg in batch {
        let channel = msg.get_channel_name();
        let payload = msg.get_payload_bytes();
        if channel.starts_with(&device_prefix) {
            if payload.first() == Some(&super::adopt::DEVICE_MARK) {
                // A cluster's adoption mark, behind the device's messages published before it.
                flush_messages(ctx, &mut per_core).await;
                super::adopt::on_device_mark(ctx, &channel[device_prefix.len()..], payload).await;
                continue;
            }
            if payload.first() == Some(&super::ringask::DEVICE_ANSWER) {
                // A cluster's rings answer, behind the device's messages published before it.
                let Some((to, origin, seq, answer)) = super::ringask::decode_on_device(payload) else {
                    ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let device = &channel[device_prefix.len()..];
                if origin == &*ctx.o.instance || !state.borrow_mut().fresh(origin, device, seq) || to != &*ctx.o.instance {
                    continue;
                }
                flush_messages(ctx, &mut per_core).await;
                super::ringask::on_answer(ctx, answer).await;
                continue;
            }
            match wire::decode_message(payload) {
                Some((origin, seq, m)) if origin != &*ctx.o.instance => {
                    // Published again after a slot move (cluster/resend.rs): applied once.
                    if seq.is_some_and(|seq| !state.borrow_mut().fresh(origin, &m.device_id, seq)) {
                        ctx.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    ctx.stats.received.fetch_add(1, Ordering::Relaxed);
                    let core = core_of_device(&m.device_id, ctx.cores.len());
                    per_core[core].push(m);
                }
                Some(_) => {}
                None => {
                    ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else if channel == ops {
            flush_messages(ctx, &mut per_core).await;
            let decoded = wire::decode_op(payload);
            if let Some((_, op)) = &decoded {
                // Own changes too: each version counts once its publication is here (resync.rs).
                let mut s = state.borrow_mut();
                match op {
                    SharedOp::Accesses { session, v, .. } => s.versions.applied(*session, *v),
                    SharedOp::Delete(id) => s.versions.gone(*id),
                    SharedOp::DeleteAll => s.versions.clear(),
                    SharedOp::Create(_) | SharedOp::Access { .. } => {}
                }
            }
            match decoded {
                Some((origin, op)) if origin != &*ctx.o.instance => route_op(ctx, op).await,
                // This instance's own: applied here when its change was answered.
                Some(_) => {}
                None => {
                    ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else if channel == watch {
            flush_messages(ctx, &mut per_core).await;
            on_watch(ctx, state, payload).await;
        } else if channel == read {
            // Asked of the core after the messages before it (same queue, in order).
            flush_messages(ctx, &mut per_core).await;
            if payload.first() == Some(&super::ringask::ASK) {
                super::ringask::on_ask(ctx, payload).await;
            } else {
                spawn_answer(ctx, state, conn, payload);
            }
        } else if channel == answer {
            if payload.first() == Some(&super::ringask::ANSWER) {
                // After the device messages before it are with their cores (ringask.rs).
                flush_messages(ctx, &mut per_core).await;
                super::ringask::on_answer(ctx, payload).await;
            } else {
                on_answer(ctx, state, payload);
            }
        } else if channel == adopt {
            // After the device messages before it are with their cores (adopt.rs, step 2).
            flush_messages(ctx, &mut per_core).await;
            super::adopt::on_message(ctx, state, conn, payload).await;
        }
    }
    flush_messages(ctx, &mut per_core).await;
}

/// Another instance's read, answered by a task of its own: it asks the device's core here
/// (at most [`READ_DEADLINE`]) and publishes the answer on the asker's channel.
fn spawn_answer(ctx: &Rc<Ctx>, state: &State, conn: &Conn, payload: &[u8]) {
    let Some((origin, id, device, kind, newer_than)) = wire::decode_read(payload) else {
        ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
        return;
    };
    if origin == &*ctx.o.instance {
        return;
    }
    {
        let mut s = state.borrow_mut();
        if s.answering >= READS_PENDING {
            return;
        }
        s.answering += 1;
    }
    let channel = ctx.key("answer", origin);
    let (ctx, state, mut conn) = (ctx.clone(), state.clone(), conn.clone());
    tokio::task::spawn_local(async move {
        let payload = answer_read(&ctx, id, device, kind, newer_than).await;
        let publish = redis::cmd("PUBLISH").arg(channel).arg(payload).to_owned();
        if let Err(reason) = within("PUBLISH answer", publish.query_async::<()>(&mut conn)).await {
            tracing::debug!(reason = %reason, "a read's answer was not published");
        }
        state.borrow_mut().answering -= 1;
    });
}

/// Another instance's read: asks the device's core here; the answer's payload.
async fn answer_read(ctx: &Ctx, id: u64, device: Box<str>, kind: wire::ReadKind, newer_than: Option<crate::timefmt::Millis>) -> Vec<u8> {
    let core = core_of_device(&device, ctx.cores.len());
    let (reply, answer) = futures_channel::oneshot::channel();
    let asked = async {
        ctx.cores[core].send(Inbound::Read { device, kind, newer_than, reply }).await.ok()?;
        answer.await.ok().flatten()
    };
    let found = tokio::time::timeout(READ_DEADLINE, asked).await.ok().flatten();
    wire::encode_answer(id, found.as_ref().map(|(newest, view)| (*newest, view)))
}

fn on_answer(ctx: &Ctx, state: &State, payload: &[u8]) {
    let Some((id, found)) = wire::decode_answer(payload) else {
        ctx.stats.undecodable.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let mut s = state.borrow_mut();
    let Some(read) = s.reads.get_mut(&id) else { return };
    read.got += 1;
    if let Some((newest, view)) = found {
        if read.best.as_ref().is_none_or(|(n, _)| newest > *n) {
            read.best = Some((newest, view));
        }
    }
    if read.got >= read.expected {
        if let Some(read) = s.reads.remove(&id) {
            let _ = read.reply.send(Ok(read.best));
        }
    }
}

async fn flush_messages(ctx: &Ctx, per_core: &mut [Vec<crate::ingest::IngestMessage>]) {
    for (core, batch) in per_core.iter_mut().enumerate() {
        if !batch.is_empty() {
            // Released by the core once it has taken them (`cluster::serve`).
            let bytes: usize = batch.iter().map(crate::ingest::IngestMessage::charge).sum();
            ctx.stats.inbound_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            if ctx.cores[core].send(Inbound::Messages(std::mem::take(batch))).await.is_err() {
                ctx.stats.inbound_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
            }
        }
    }
}

/// Hands a shared change to the queue of the core it is applied on: an access change to its
/// devices' cores (split per core: the queue of those devices' messages, so it is in force
/// before any later one), a session's to the session's core.
async fn route_op(ctx: &Ctx, op: SharedOp) {
    let cores = ctx.cores.len();
    let per_core: Vec<(usize, SharedOp)> = match op {
        SharedOp::Create(id) | SharedOp::Delete(id) => vec![(core_of_session(id, cores), op)],
        SharedOp::DeleteAll => vec![(0, op)],
        SharedOp::Access { ref device, .. } => vec![(core_of_device(device, cores), op)],
        SharedOp::Accesses { session, v, changes } => {
            let mut split: Vec<Vec<(Box<str>, super::AccessOn)>> = (0..cores).map(|_| Vec::new()).collect();
            for (device, access) in changes {
                split[core_of_device(&device, cores)].push((device, access));
            }
            split.into_iter().enumerate().filter(|(_, c)| !c.is_empty()).map(|(core, changes)| (core, SharedOp::Accesses { session, v, changes })).collect()
        }
    };
    for (core, op) in per_core {
        let _ = ctx.cores[core].send(Inbound::Op(op, None)).await;
    }
}

async fn on_watch(ctx: &Ctx, state: &State, payload: &[u8]) {
    let Some(text) = std::str::from_utf8(payload).ok() else { return };
    let (on, rest) = match text.as_bytes().first() {
        Some(b'+') => (true, &text[1..]),
        Some(b'-') => (false, &text[1..]),
        _ => return,
    };
    let Some((instance, device)) = rest.split_once('\t') else { return };
    if instance == &*ctx.o.instance {
        return;
    }
    let instance: Arc<str> = instance.into();
    let mut change = None;
    {
        let mut s = state.borrow_mut();
        if let Some(touched) = s.touched.as_mut() {
            if touched.len() < TOUCHED {
                touched.insert((Box::from(&*instance), Box::from(device)));
            } else {
                // Too many changes meanwhile: that check gives up (tried at the next one).
                s.touched = None;
            }
        }
        if !s.instances.contains(&instance) {
            s.instances.insert(instance.clone());
            ctx.stats.instances.store(s.instances.len() as u64 + 1, Ordering::Relaxed);
        }
        if on {
            let watchers = s.remote.entry(device.into()).or_default();
            if watchers.is_empty() {
                change = Some((device.into(), true));
            }
            watchers.insert(instance);
        } else if let Some(watchers) = s.remote.get_mut(device) {
            watchers.remove(&instance);
            if watchers.is_empty() {
                s.remote.remove(device);
                change = Some((device.into(), false));
            }
        }
    }
    if let Some(change) = change {
        send_remote_watch(ctx, vec![change]).await;
    }
}
