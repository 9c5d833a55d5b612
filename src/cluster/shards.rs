//! Sharded pub/sub on a Redis Cluster (docs/design/redis-cluster.md §1, §2 "Reshard and
//! failover", step 6): device channels over `SSUBSCRIBE`/`SPUBLISH`, so each device message
//! goes to the master of its channel's slot only (and the masters share the traffic), not to
//! every node as a classic `PUBLISH` does.
//!
//! A task of the Redis thread owns **at most one subscriber connection per master**, built
//! from the redis crate's parts (a RESP3 multiplexed connection with a push sender), not the
//! crate's cluster `ssubscribe`, which in 1.8.1 forgets a channel on the server's unsolicited
//! `sunsubscribe` and resubscribes a node's channels in one cross-slot command. Here:
//! - `SSUBSCRIBE`/`SUNSUBSCRIBE` go **one per slot** (all of a command's channels in one
//!   slot), and the confirmation answered is checked against what was asked: a mismatch means
//!   an unsolicited push was taken for a reply, so that master's subscriber is rebuilt
//!   (`reason="desync"`).
//! - The trap of a slot move: the old owner unsubscribes the channel with a `sunsubscribe`
//!   push nobody asked for. It is counted (`hubcast_redis_slot_moves_total`), the slot map is
//!   read again (`CLUSTER SLOTS`) and the channel subscribed on its new master.
//! - `MOVED` on `SSUBSCRIBE`: the map is read again and the channel tried there (3 tries,
//!   50 ms apart). A subscriber connection lost (`Disconnection` push): its channels are
//!   placed again by the new map. The map is also read every 30 s (a failover nobody here
//!   saw), moving channels whose master changed and closing subscribers of former masters.
//! - Bounds: pushes wait in one queue bounded by `--redis-inbound-bytes`, as one Redis's
//!   link is, each push charged what it holds (its strings and its own size, see
//!   [`push_bytes`]), so at most that bound ÷ 200-odd bytes of them; past it the push is
//!   dropped and that subscriber is rebuilt (`reason="full"`, counted in
//!   `hubcast_redis_overruns_total`; its messages meanwhile are lost, as with any pub/sub
//!   outage).
//!
//! A message published while a slot moves is published again until every watcher got it
//! (cluster/resend.rs, step 7).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_channel::oneshot;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{PushInfo, PushKind, Value};

use super::conn::Conn;
use super::link::{within, Ctx, Failed, State};
use super::Engine;

/// How often the slot map is read when nothing asked for it.
const REFRESH: Duration = Duration::from_secs(30);
/// Tries of one subscription when `MOVED` answers it.
const TRIES: usize = 3;
/// Messages handed over at once.
const BATCH: usize = 256;

/// Why channels were subscribed again (`hubcast_redis_resubscribes_total{reason}`).
#[derive(Clone, Copy)]
pub(super) enum Reason {
    Moved = 0,
    Sunsubscribe = 1,
    Reconnect = 2,
    Desync = 3,
    Full = 4,
}

pub(super) const REASONS: [&str; 5] = ["moved", "sunsubscribe", "reconnect", "desync", "full"];

/// What the command task asks of the shard task.
pub(super) enum Req {
    /// Device channels to receive: answered once every one is confirmed by its master.
    Subscribe(Vec<String>, oneshot::Sender<Result<(), Failed>>),
    Unsubscribe(Vec<String>),
}

/// A channel's hash slot, as Redis computes it: CRC16 (XMODEM) of the hash tag if there is
/// one (`{…}`, not empty), else of the whole name, modulo 16384.
pub(super) fn slot(channel: &str) -> u16 {
    let k = channel.as_bytes();
    let tagged = k.iter().position(|b| *b == b'{').and_then(|open| {
        let close = k[open + 1..].iter().position(|b| *b == b'}')?;
        (close > 0).then(|| &k[open + 1..open + 1 + close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(k)) % 16384
}

type Addr = (String, u16);

/// The cluster's slot map: `(first slot, last slot, master)`, sorted; empty until read.
#[derive(Default)]
struct SlotMap(Vec<(u16, u16, Addr)>);

impl SlotMap {
    /// `CLUSTER SLOTS` through `conn`, counted in `hubcast_redis_topology_refreshes_total`.
    async fn read(ctx: &Ctx, conn: &mut Conn) -> Result<Self, Failed> {
        let map = within("CLUSTER SLOTS", super::conn::slot_map(conn)).await?;
        ctx.stats.topology_refreshes.fetch_add(1, Ordering::Relaxed);
        Ok(Self(map))
    }

    fn owner(&self, slot: u16) -> Option<&Addr> {
        let i = self.0.partition_point(|(_, last, _)| *last < slot);
        self.0.get(i).filter(|(first, _, _)| *first <= slot).map(|(_, _, a)| a)
    }

    fn masters(&self) -> HashSet<&Addr> {
        self.0.iter().map(|(_, _, a)| a).collect()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

struct Sub {
    conn: MultiplexedConnection,
    channels: HashSet<String>,
    /// Set by the push sender when the queue was full.
    overflow: Arc<AtomicBool>,
}

struct Shards<'a> {
    ctx: &'a Rc<Ctx>,
    state: &'a State,
    conn: Conn,
    map: SlotMap,
    subs: HashMap<Addr, Sub>,
    /// Every device channel this instance receives.
    want: HashSet<String>,
    tx: async_channel::Sender<Push>,
}

/// A push from a subscriber, with the bytes charged for it to `Stats::inbound_bytes`.
type Push = (Arc<Addr>, PushInfo, u64);

/// What a push is charged: its strings, its values and itself, so that the byte bound is also
/// a bound on how many wait (a device message: ~200 bytes of strings + ~250 of its own).
fn push_bytes(info: &PushInfo) -> u64 {
    let strings: u64 = info.data.iter().map(|v| match v {
        Value::BulkString(b) => b.len() as u64,
        _ => 0,
    }).sum();
    strings + (std::mem::size_of::<Push>() + info.data.len() * std::mem::size_of::<Value>()) as u64 + 64
}

/// The shard task: until a Redis call fails (the link then reconnects everything).
/// `initial`: the devices this instance watches (after a reconnect), subscribed and then
/// announced to the others, so none of their messages is published before it receives them.
pub(super) async fn run(ctx: &Rc<Ctx>, state: &State, conn: Conn, reqs: async_channel::Receiver<Req>, initial: Vec<Box<str>>) -> Failed {
    // Unbounded as a channel, bounded in the push sender by the bytes it holds (`Shards::sub`).
    // It was `bounded(4096)` pushes (~1 MB of device messages): three masters answering after
    // a 20 ms stall passed it, the subscribers were rebuilt while the bursts went on and B
    // received < 1 % (docs/benchmarks/2026-11-28-redis-cluster-capacity.md §4).
    let (tx, rx) = async_channel::unbounded();
    let mut s = Shards { ctx, state, conn, map: SlotMap::default(), subs: HashMap::new(), want: HashSet::new(), tx };
    let result = s.serve(&reqs, &rx, initial).await;
    ctx.stats.shard_connections.store(0, Ordering::Relaxed);
    // Pushes not taken go with the subscribers.
    while let Ok((_, _, bytes)) = rx.try_recv() {
        ctx.stats.inbound_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }
    match result {
        Ok(()) => "stopped".to_string(),
        Err(reason) => reason,
    }
}

impl Shards<'_> {
    async fn serve(&mut self, reqs: &async_channel::Receiver<Req>, rx: &async_channel::Receiver<Push>, initial: Vec<Box<str>>) -> Result<(), Failed> {
        self.refresh().await?;
        let channels: Vec<String> = initial.iter().map(|d| self.ctx.key("device", d)).collect();
        self.want.extend(channels.iter().cloned());
        self.place(channels, None).await?;
        super::link::announce(self.ctx, &mut self.conn, &initial).await?;
        let mut tick = tokio::time::interval(REFRESH);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                req = reqs.recv() => match req {
                    Ok(Req::Subscribe(channels, reply)) => {
                        let fresh: Vec<String> = channels.into_iter().filter(|c| self.want.insert(c.clone())).collect();
                        let result = self.place(fresh, None).await;
                        let failed = result.as_ref().err().cloned();
                        let _ = reply.send(result);
                        if let Some(reason) = failed {
                            return Err(reason);
                        }
                    }
                    Ok(Req::Unsubscribe(channels)) => self.unsubscribe(channels).await?,
                    Err(_) => return Ok(()),
                },
                push = rx.recv() => {
                    let Ok(first) = push else { return Ok(()) };
                    let mut pushes = vec![first];
                    while pushes.len() < BATCH {
                        match rx.try_recv() {
                            Ok(p) => pushes.push(p),
                            Err(_) => break,
                        }
                    }
                    self.on_pushes(pushes).await?;
                }
                _ = tick.tick() => {
                    self.refresh().await?;
                    self.rebalance().await?;
                }
            }
        }
    }

    fn owner(&self, slot: u16) -> Option<Addr> {
        self.map.owner(slot).cloned()
    }

    /// Reads the slot map again; closes subscribers of nodes that are no longer masters and
    /// places their channels by the new map.
    async fn refresh(&mut self) -> Result<(), Failed> {
        self.map = SlotMap::read(self.ctx, &mut self.conn).await?;
        let masters = self.map.masters();
        self.ctx.stats.cluster_masters.store(masters.len() as u64, Ordering::Relaxed);
        let gone: Vec<Addr> = self.subs.keys().filter(|a| !masters.contains(a)).cloned().collect();
        let mut orphans = Vec::new();
        for a in gone {
            if let Some(sub) = self.subs.remove(&a) {
                orphans.extend(sub.channels);
            }
        }
        self.count_connections();
        if !orphans.is_empty() {
            Box::pin(self.place(orphans, Some(Reason::Reconnect))).await?;
        }
        Ok(())
    }

    /// Channels whose master changed under a subscriber that still serves (a move nobody
    /// announced to this instance): moved to their master.
    async fn rebalance(&mut self) -> Result<(), Failed> {
        let mut misplaced = Vec::new();
        let owners: Vec<(Addr, Vec<String>)> = self
            .subs
            .iter()
            .map(|(a, sub)| (a.clone(), sub.channels.iter().filter(|c| self.owner(slot(c)).as_ref() != Some(a)).cloned().collect()))
            .collect();
        for (a, channels) in owners {
            if let Some(sub) = self.subs.get_mut(&a) {
                for c in &channels {
                    sub.channels.remove(c);
                }
            }
            misplaced.extend(channels);
        }
        if misplaced.is_empty() {
            return Ok(());
        }
        self.place(misplaced, Some(Reason::Moved)).await
    }

    fn count_connections(&self) {
        self.ctx.stats.shard_connections.store(self.subs.len() as u64, Ordering::Relaxed);
    }

    fn count(&self, reason: Reason, n: usize) {
        self.ctx.stats.resubscribes[reason as usize].fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The subscriber of master `a`, opened if there is none.
    async fn sub(&mut self, a: &Addr) -> Result<MultiplexedConnection, Failed> {
        if let Some(sub) = self.subs.get(a) {
            return Ok(sub.conn.clone());
        }
        let client = node_client(self.ctx, a, "shard subscriber")?;
        let overflow = Arc::new(AtomicBool::new(false));
        let (tx, addr, full) = (self.tx.clone(), Arc::new(a.clone()), overflow.clone());
        let (stats, bound) = (self.ctx.stats.clone(), self.ctx.o.inbound_bytes);
        // Never blocks the connection: more than `--redis-inbound-bytes` waiting between
        // Redis and the cores (charged here, released once the cores took it: see
        // `link::pubsub`) drops the push and marks the subscriber for a rebuild (messages
        // meanwhile lost, as in an outage; counted in `overruns`). One `Arc` of the address
        // per subscriber, not a `String` per push.
        let sender = move |info: PushInfo| -> Result<(), ()> {
            let bytes = push_bytes(&info);
            let before = stats.inbound_bytes.fetch_add(bytes, Ordering::Relaxed);
            let over = before > 0 && before + bytes > bound;
            if over || tx.try_send((addr.clone(), info, bytes)).is_err() {
                stats.inbound_bytes.fetch_sub(bytes, Ordering::Relaxed);
                if !full.swap(true, Ordering::Relaxed) && over {
                    stats.overruns.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(())
        };
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_push_sender(sender);
        let mut conn = within("connect (shard subscriber)", client.get_multiplexed_async_connection_with_config(&config)).await?;
        let name = format!("hubcast-{}-shard", self.ctx.o.instance);
        within("CLIENT SETNAME", redis::cmd("CLIENT").arg("SETNAME").arg(name).query_async::<()>(&mut conn)).await?;
        self.subs.insert(a.clone(), Sub { conn: conn.clone(), channels: HashSet::new(), overflow });
        self.count_connections();
        Ok(conn)
    }

    /// Subscribes `channels` on their masters, one `SSUBSCRIBE` per slot, confirmations
    /// checked; `MOVED` and desyncs are placed again after a fresh map. `reason`: why they
    /// are subscribed again (`None`: first time).
    async fn place(&mut self, mut channels: Vec<String>, reason: Option<Reason>) -> Result<(), Failed> {
        if let Some(r) = reason {
            self.count(r, channels.len());
        }
        for attempt in 0..TRIES {
            channels.retain(|c| self.want.contains(c));
            if channels.is_empty() {
                return Ok(());
            }
            let mut groups: BTreeMap<Addr, BTreeMap<u16, Vec<String>>> = BTreeMap::new();
            for c in channels.drain(..) {
                let s = slot(&c);
                let Some(owner) = self.owner(s) else { return Err(format!("no master serves slot {s} (the cluster is not ok)")) };
                groups.entry(owner).or_default().entry(s).or_default().push(c);
            }
            let mut again = Vec::new();
            let mut conns = Vec::new();
            for (a, slots) in groups {
                let conn = self.sub(&a).await?;
                conns.push((a, conn, slots));
            }
            // One `SSUBSCRIBE` in flight per master (the masters at once): several at once on
            // one connection had their confirmations matched to the wrong commands (2 of 14
            // runs watching 1,000 devices at once, docs/benchmarks/redis-cluster-desync.txt),
            // and each retry sent them the same way again. After an answer that is not a
            // confirmation the rest of that master's slots wait for the rebuilt subscriber.
            let per_master = conns.into_iter().map(|(a, mut conn, slots)| async move {
                let mut answers = Vec::new();
                let mut stopped = false;
                for chans in slots.into_values() {
                    if stopped {
                        answers.push((chans, None));
                        continue;
                    }
                    let answer = tokio::time::timeout(Duration::from_secs(5), redis::cmd("SSUBSCRIBE").arg(&chans).query_async::<Value>(&mut conn)).await;
                    stopped = !matches!(&answer, Ok(Ok(v)) if confirms(v, &PushKind::SSubscribe, &chans));
                    answers.push((chans, Some(answer)));
                }
                (a, answers)
            });
            let mut desynced: HashSet<Addr> = HashSet::new();
            for (chans, answer, a) in futures_util::future::join_all(per_master).await.into_iter().flat_map(|(a, answers)| answers.into_iter().map(move |(c, r)| (c, r, a.clone()))) {
                let Some(answer) = answer.filter(|_| !desynced.contains(&a)) else {
                    // Not sent, or sent on a subscriber since found out of step.
                    again.extend(chans);
                    continue;
                };
                match answer {
                    Ok(Ok(v)) if confirms(&v, &PushKind::SSubscribe, &chans) => {
                        if let Some(sub) = self.subs.get_mut(&a) {
                            sub.channels.extend(chans);
                        }
                    }
                    Ok(Ok(v)) => {
                        tracing::warn!(master = %format!("{}:{}", a.0, a.1), answer = ?v, "SSUBSCRIBE answered with something else than its confirmations: rebuilding that subscriber");
                        desynced.insert(a.clone());
                        self.count(Reason::Desync, chans.len());
                        if let Some(sub) = self.subs.remove(&a) {
                            again.extend(sub.channels);
                        }
                        self.count_connections();
                        again.extend(chans);
                    }
                    Ok(Err(e)) if e.redirect_node().is_some() => {
                        self.count(Reason::Moved, chans.len());
                        again.extend(chans);
                    }
                    Ok(Err(e)) => return Err(format!("SSUBSCRIBE: {e}")),
                    Err(_) => return Err("SSUBSCRIBE: no answer within 5 s".into()),
                }
            }
            if again.is_empty() {
                return Ok(());
            }
            channels = again;
            tokio::time::sleep(Duration::from_millis(50 * (attempt as u64 + 1))).await;
            self.map = SlotMap::read(self.ctx, &mut self.conn).await?;
        }
        Err(format!("{} device channels could not be subscribed on their masters ({TRIES} tries)", channels.len()))
    }

    async fn unsubscribe(&mut self, channels: Vec<String>) -> Result<(), Failed> {
        let mut groups: BTreeMap<Addr, BTreeMap<u16, Vec<String>>> = BTreeMap::new();
        for c in channels {
            self.want.remove(&c);
            if let Some((a, sub)) = self.subs.iter_mut().find(|(_, sub)| sub.channels.contains(&c)) {
                sub.channels.remove(&c);
                groups.entry(a.clone()).or_default().entry(slot(&c)).or_default().push(c);
            }
        }
        for (a, slots) in groups {
            let Some(sub) = self.subs.get(&a) else { continue };
            let mut conn = sub.conn.clone();
            for chans in slots.into_values() {
                // A failure here is that subscriber's loss, seen as its `Disconnection`.
                let _ = tokio::time::timeout(Duration::from_secs(5), redis::cmd("SUNSUBSCRIBE").arg(&chans).query_async::<Value>(&mut conn)).await;
            }
        }
        Ok(())
    }

    async fn on_pushes(&mut self, pushes: Vec<Push>) -> Result<(), Failed> {
        let charged: u64 = pushes.iter().map(|p| p.2).sum();
        let result = self.take_pushes(pushes).await;
        self.ctx.stats.inbound_bytes.fetch_sub(charged, Ordering::Relaxed);
        result
    }

    async fn take_pushes(&mut self, pushes: Vec<Push>) -> Result<(), Failed> {
        let mut messages = Vec::new();
        let mut moved = Vec::new();
        let mut lost: HashSet<Addr> = HashSet::new();
        for (a, info, _) in pushes {
            match info.kind {
                PushKind::SMessage => messages.extend(redis::Msg::from_push_info(info)),
                PushKind::SUnsubscribe => {
                    let Some(channel) = info.data.first().and_then(|v| redis::from_redis_value_ref::<String>(v).ok()) else { continue };
                    if let Some(sub) = self.subs.get_mut(&*a) {
                        sub.channels.remove(&channel);
                    }
                    // Not asked for: the slot moved away from that master.
                    if self.want.contains(&channel) {
                        self.ctx.stats.slot_moves.fetch_add(1, Ordering::Relaxed);
                        moved.push(channel);
                    }
                }
                PushKind::Disconnection => {
                    lost.insert((*a).clone());
                }
                _ => {}
            }
        }
        if !messages.is_empty() {
            super::link::on_messages(self.ctx, self.state, &self.conn, messages).await;
        }
        let overflowed: Vec<Addr> = self.subs.iter().filter(|(_, s)| s.overflow.load(Ordering::Relaxed)).map(|(a, _)| a.clone()).collect();
        for a in &overflowed {
            tracing::warn!(master = %format!("{}:{}", a.0, a.1), "shard subscriber's queue was full: rebuilding it (messages meanwhile lost)");
        }
        let mut again = Vec::new();
        for a in lost.iter().chain(&overflowed) {
            if let Some(sub) = self.subs.remove(a) {
                let reason = if overflowed.contains(a) { Reason::Full } else { Reason::Reconnect };
                self.count(reason, sub.channels.len());
                again.extend(sub.channels);
            }
        }
        self.count_connections();
        if !moved.is_empty() || !again.is_empty() {
            tracing::info!(moved = moved.len(), lost = again.len(), "device channels subscribed again on their masters");
            self.refresh().await?;
            self.place(moved, Some(Reason::Sunsubscribe)).await?;
            self.place(again, None).await?;
        }
        Ok(())
    }
}

/// Whether `answer` confirms `channels`: the redis crate answers a subscription with its
/// first confirmation (it consumes the others itself, one per channel, so later replies stay
/// in step); every confirmation given must be of `kind` and of a channel asked for. Anything
/// else (an unsolicited `sunsubscribe` taken for the reply) is a desync.
fn confirms(answer: &Value, kind: &PushKind, channels: &[String]) -> bool {
    let items: &[Value] = match answer {
        Value::Array(items) => items,
        single @ Value::Push { .. } => std::slice::from_ref(single),
        _ => return false,
    };
    !items.is_empty()
        && items.iter().all(|item| {
            let Value::Push { kind: k, data } = item else { return false };
            k == kind && data.first().and_then(|v| redis::from_redis_value_ref::<String>(v).ok()).is_some_and(|c| channels.contains(&c))
        })
}

/// A master's URL: the first seed's scheme and credentials, the node's address, RESP3 (push
/// messages on a multiplexed connection).
fn node_url(seed: &str, host: &str, port: u16) -> String {
    let (scheme, rest) = seed.split_once("://").unwrap_or(("redis", seed));
    let creds = rest.split('/').next().and_then(|authority| authority.rsplit_once('@')).map(|(c, _)| format!("{c}@")).unwrap_or_default();
    let host = if host.contains(':') { format!("[{host}]") } else { host.to_string() };
    format!("{scheme}://{creds}{host}:{port}/?protocol=resp3")
}

/// A master's client: the first seed's scheme and credentials, `--redis-ca-file`.
fn node_client(ctx: &Ctx, a: &Addr, what: &str) -> Result<redis::Client, Failed> {
    let Engine::Sharded(seeds) = &ctx.o.engine else { return Err("sharded pub/sub needs a Redis Cluster".into()) };
    let url = node_url(&seeds[0], &a.0, a.1);
    match &ctx.o.ca {
        Some(ca) => redis::Client::build_with_tls(url.as_str(), redis::TlsCertificates { client_tls: None, root_cert: Some(ca.clone()) }),
        None => redis::Client::open(url.as_str()),
    }
    .map_err(|e| format!("{what} {}:{}: {e}", a.0, a.1))
}

/// How long a master whose connection failed is not tried again (its messages count as
/// received by nobody meanwhile, so a watched device's wait in cluster/resend.rs).
const PUBLISH_PAUSE: Duration = Duration::from_millis(500);
/// Bounds the connection and each answer of a publishing connection.
const PUBLISH_DEADLINE: Duration = Duration::from_secs(5);

/// The command task's `SPUBLISH`er: **one pipeline per master per batch** (step 8 measured
/// one per slot, about one per message with devices spread over the slots, costing each
/// master 0.72–0.97× of one Redis's CPU for a third of the traffic, and the publishing
/// instance 4–6× its CPU on one Redis), on a connection of its own to each master
/// (`hubcast-<instance>-publish`), routed by a slot map of its own.
///
/// Not through the redis crate's cluster connection: a pipeline whose commands span several
/// slots is answered `MOVED` for the moved slot's commands only, and the crate then sends
/// the **whole** pipeline again to the named node (where the other slots answer `MOVED`
/// back: duplicates, then an error after its retries). Here a command answered `MOVED`
/// (`ASK`, `TRYAGAIN`, `CLUSTERDOWN` alike) or on a connection that failed counts as received
/// by nobody: cluster/resend.rs publishes it again, in order with its device's later
/// messages, once the map has been read again (after that batch); the receivers drop what
/// they already had (wire v2's sequence numbers). A device's messages are all in one slot,
/// so in one pipeline, in order; batches go one after the other.
#[derive(Default)]
pub(super) struct Publisher {
    /// Empty until the first batch.
    map: SlotMap,
    conns: HashMap<Addr, MultiplexedConnection>,
    /// Masters whose connection failed, and until when they are not tried.
    paused: HashMap<Addr, tokio::time::Instant>,
    /// A command was redirected or a connection failed: the map is read before the next batch.
    stale: bool,
}

impl Publisher {
    async fn connection(ctx: &Ctx, a: &Addr) -> Result<MultiplexedConnection, Failed> {
        let client = node_client(ctx, a, "publishing connection")?;
        let config = redis::AsyncConnectionConfig::new().set_connection_timeout(Some(PUBLISH_DEADLINE)).set_response_timeout(Some(PUBLISH_DEADLINE));
        let mut conn = within("connect (publishing)", client.get_multiplexed_async_connection_with_config(&config)).await?;
        let name = format!("hubcast-{}-publish", ctx.o.instance);
        within("CLIENT SETNAME", redis::cmd("CLIENT").arg("SETNAME").arg(name).query_async::<()>(&mut conn)).await?;
        Ok(conn)
    }

    /// `SPUBLISH`es `items`, one pipeline per master, the masters at once; answers how many
    /// subscribers got each (in `items`' order; 0 for one redirected, refused or not sent:
    /// resend.rs publishes those again, the rest of the batch stands). `Err`: the slot map
    /// could not be read.
    pub(super) async fn publish(&mut self, ctx: &Ctx, conn: &Conn, items: &[(&str, &[u8])], channel: impl Fn(&str) -> String) -> Result<Vec<i64>, Failed> {
        if self.map.is_empty() || self.stale {
            self.map = SlotMap::read(ctx, &mut conn.clone()).await?;
            self.stale = false;
            // A master gone from the map (failed over, removed) keeps no connection here.
            let masters = self.map.masters();
            self.conns.retain(|a, _| masters.contains(a));
        }
        let now = tokio::time::Instant::now();
        self.paused.retain(|_, until| *until > now);
        let mut counts = vec![0; items.len()];
        let mut per_master: BTreeMap<Addr, (redis::Pipeline, Vec<usize>)> = BTreeMap::new();
        for (i, (device, payload)) in items.iter().enumerate() {
            let c = channel(device);
            let Some(owner) = self.map.owner(slot(&c)) else {
                // No master serves the slot (the cluster is not ok): nobody got it.
                self.stale = true;
                continue;
            };
            if self.paused.contains_key(owner) {
                continue;
            }
            let entry = per_master.entry(owner.clone()).or_insert_with(|| (redis::pipe(), Vec::new()));
            entry.0.cmd("SPUBLISH").arg(&c).arg(*payload);
            entry.1.push(i);
        }
        ctx.stats.publish_pipelines.fetch_add(per_master.len() as u64, Ordering::Relaxed);
        let sent = per_master.into_iter().map(|(a, (pipe, at))| {
            let open = self.conns.get(&a).cloned();
            async move {
                let answer = async {
                    let mut conn = match open {
                        Some(conn) => conn,
                        None => Self::connection(ctx, &a).await?,
                    };
                    let values = within("SPUBLISH", conn.req_packed_commands(&pipe, 0, at.len())).await?;
                    Ok::<_, Failed>((conn, values))
                }
                .await;
                (a, at, answer)
            }
        });
        let mut refused = None;
        for (a, at, answer) in futures_util::future::join_all(sent).await {
            match answer {
                Ok((c, values)) => {
                    self.conns.insert(a, c);
                    if let Some(reason) = take_answers(&at, values, &mut counts, &mut self.stale) {
                        refused = Some(reason);
                    }
                }
                Err(reason) => {
                    tracing::warn!(master = %format!("{}:{}", a.0, a.1), %reason, "publishing to a master failed: its messages count as received by nobody (published again to watchers), the slot map is read again");
                    self.conns.remove(&a);
                    self.paused.insert(a, tokio::time::Instant::now() + PUBLISH_PAUSE);
                    self.stale = true;
                }
            }
        }
        if let Some(reason) = refused {
            tracing::warn!(%reason, "a master refused SPUBLISH: those messages count as received by nobody (published again to watchers)");
        }
        Ok(counts)
    }
}

/// One master's answers to its pipeline, in `at`'s order, into `counts`: the subscribers a
/// message reached, or 0 (left as it is) for one redirected (`MOVED`, `ASK`, `TRYAGAIN`,
/// `CLUSTERDOWN`, `MASTERDOWN`, `READONLY` from a master a failover demoted: the map is then
/// `stale`) or refused for another reason (the first such
/// reason is answered, for the log). Either way only that message counts as received by
/// nobody; the others' counts stand.
fn take_answers(at: &[usize], values: Vec<Value>, counts: &mut [i64], stale: &mut bool) -> Option<String> {
    use redis::ServerErrorKind::{Ask, ClusterDown, MasterDown, Moved, ReadOnly, TryAgain};
    let mut refused = None;
    for (&i, value) in at.iter().zip(values) {
        match value {
            Value::Int(got) => counts[i] = got,
            Value::ServerError(e) => match e.kind() {
                Some(Moved | Ask | TryAgain | ClusterDown | MasterDown | ReadOnly) => *stale = true,
                _ => {
                    refused.get_or_insert_with(|| format!("SPUBLISH: {e:?}"));
                }
            },
            other => {
                refused.get_or_insert_with(|| format!("SPUBLISH answered {other:?}"));
            }
        }
    }
    refused
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::cluster_routing::{Route, SlotAddr};

    /// A refused or redirected command counts as received by nobody, alone: the other
    /// messages of its master's pipeline keep their counts (a refusal once lost the batch).
    #[test]
    fn a_refused_or_redirected_spublish_costs_only_its_own_message() {
        let reply = |raw: &[u8]| redis::parse_redis_value(raw).expect("a RESP reply");
        let (mut counts, mut stale) = (vec![0i64; 5], false);
        let values = vec![reply(b":2\r\n"), reply(b"-MOVED 3999 127.0.0.1:7001\r\n"), reply(b"-OOM command not allowed\r\n"), reply(b":1\r\n")];
        let refused = take_answers(&[0, 1, 3, 4], values, &mut counts, &mut stale);
        assert_eq!(counts, vec![2, 0, 0, 0, 1], "each message its own count; 2 was not in this pipeline");
        assert!(stale, "a redirect has the map read again");
        assert!(refused.is_some_and(|r| r.contains("OOM")), "the refusal is told for the log");
        // A master demoted to replica by a failover answers READONLY: the map is stale too.
        let (mut counts, mut stale) = (vec![0i64; 1], false);
        assert_eq!(take_answers(&[0], vec![reply(b"-READONLY You can't write against a read only replica.\r\n")], &mut counts, &mut stale), None);
        assert!(stale);
    }

    /// Our slot is the redis crate's (which routes `SPUBLISH`), hash tags included.
    #[test]
    fn the_slot_of_a_channel_is_the_redis_crates() {
        for i in 0..10_000 {
            let key = match i % 4 {
                0 => format!("hubcast:device:dev-{i}"),
                1 => format!("{{t}}:ops:{i}"),
                2 => format!("a{{}}b{i}"),
                _ => format!("x{{{i}}}y{{z}}"),
            };
            assert_eq!(Route::new(slot(&key), SlotAddr::Master), Route::with_key(&key, SlotAddr::Master), "{key}");
        }
    }

    #[test]
    fn a_node_is_reached_with_the_first_seeds_scheme_and_credentials_over_resp3() {
        assert_eq!(node_url("redis://:pw@10.0.0.5:7000", "10.0.0.6", 7001), "redis://:pw@10.0.0.6:7001/?protocol=resp3");
        assert_eq!(node_url("rediss://u:p@h:1/0", "::1", 7002), "rediss://u:p@[::1]:7002/?protocol=resp3");
        assert_eq!(node_url("redis://h:1", "n", 2), "redis://n:2/?protocol=resp3");
    }

    #[test]
    fn only_the_confirmations_asked_for_confirm() {
        let push = |kind: PushKind, c: &str| Value::Push { kind, data: vec![Value::BulkString(c.as_bytes().to_vec()), Value::Int(1)] };
        let asked = vec!["a".to_string(), "b".to_string()];
        assert!(confirms(&push(PushKind::SSubscribe, "a"), &PushKind::SSubscribe, &asked));
        assert!(confirms(&Value::Array(vec![push(PushKind::SSubscribe, "b"), push(PushKind::SSubscribe, "a")]), &PushKind::SSubscribe, &asked));
        // An unsolicited sunsubscribe taken for a reply: the subscriber is rebuilt.
        assert!(!confirms(&push(PushKind::SUnsubscribe, "a"), &PushKind::SSubscribe, &asked));
        assert!(!confirms(&Value::Array(vec![push(PushKind::SUnsubscribe, "x"), push(PushKind::SSubscribe, "a")]), &PushKind::SSubscribe, &asked));
        assert!(!confirms(&push(PushKind::SSubscribe, "c"), &PushKind::SSubscribe, &asked));
        assert!(!confirms(&Value::Array(vec![]), &PushKind::SSubscribe, &asked));
        assert!(!confirms(&Value::Okay, &PushKind::SSubscribe, &asked));
    }
}
