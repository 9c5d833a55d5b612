//! The lease task of the Redis thread: heartbeat, live instances, partition leases and
//! checkpoints, on a connection of its own, never waiting on a core longer than a deadline.
//!
//! Why a task of its own: a lease lives `--lease-ttl` unrenewed. When the renewal shared a
//! loop with pub/sub and session changes, a stalled core (a full inbound queue, an answer
//! awaited) could hold the renewal past the TTL and hand the instance's partitions to a peer
//! while it was otherwise alive. Here each heartbeat renews first (one `EVAL` for every
//! lease), then asks every core for its applied marks and waits at most half a heartbeat: a
//! core that misses it keeps its last marks (the checkpoint stays put: safe, at most more
//! replay). A core silent for [`STALL_TTLS`] × `--lease-ttl` is *stalled*: the instance
//! gives every lease up cleanly and takes no share (announced as `P:stalled:<instance>` so
//! the others count it out of the division), logs it at `error`, and takes leases again once
//! the core answers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_channel::oneshot;
use hashbrown::{HashMap, HashSet};
use super::conn::Conn;
use tokio::time::Instant;

use super::link::{within, Ctx, Failed, State};
use super::Inbound;

/// Gives a lease up only if this instance holds it.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";
/// Renews every lease this instance still holds, in one call: 1 per key renewed, 0 per key
/// held by another instance (or expired).
const RENEW_ALL: &str = "local out = {} for i, k in ipairs(KEYS) do if redis.call('GET', k) == ARGV[1] then redis.call('PEXPIRE', k, ARGV[2]) out[i] = 1 else out[i] = 0 end end return out";
/// How long a graceful leave waits for the cores' last marks.
const LEAVE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// A core silent this many lease TTLs is stalled.
pub(super) const STALL_TTLS: u32 = 3;

/// What the command task hands the lease task.
pub(super) enum Ctl {
    /// The partitions of the event stream this instance reads (at every consumer connect).
    Stream(super::StreamPlan),
    /// Graceful shutdown: checkpoint, give every lease up, leave (answered when done).
    Leave(std::sync::mpsc::Sender<()>),
}

/// A core's applied marks: source partition → sequence number.
type Marks = Vec<(Box<str>, i64)>;

/// One core as the lease task last heard of it.
struct Probe {
    /// The question asked and not yet answered (at most one per core: a stalled core's
    /// queue is not filled with probes).
    pending: Option<oneshot::Receiver<Marks>>,
    /// Its last applied marks (source partition → sequence number).
    marks: Option<Marks>,
    answered: Instant,
    stalled: bool,
}

/// The lease side of the link; kept across reconnects.
pub(super) struct Leases {
    /// The event stream the consumer reads, once it has said.
    pub stream: Option<super::StreamPlan>,
    /// Partitions leased here → the checkpoint found when the lease was taken.
    pub leased: std::collections::BTreeMap<String, Option<i64>>,
    /// The last checkpoint written per partition.
    checkpointed: HashMap<String, i64>,
    /// Partitions whose lease this instance lost without giving it up (a renewal refused, or
    /// given up while Redis was unreachable): taken again first, so that after a Redis
    /// restart each instance goes back to the partitions its cores hold positions for.
    pub lost: HashSet<String>,
    /// When each held partition was taken (a counter): to balance, the most recently taken
    /// is given up first, so an instance keeps the partitions it read longest.
    taken_order: HashMap<String, u64>,
    next_take: u64,
    /// After a reconnect, until this instant only partitions in `lost` are taken: the other
    /// instances cut off by the same outage come back within it (their back-off is at most
    /// `MAX_BACKOFF`) and take back their own, instead of finding them taken by whoever
    /// reconnected first.
    pub settle_until: Option<Instant>,
    owned: tokio::sync::watch::Sender<super::Owned>,
    /// When the leases were last renewed: past the TTL without Redis they are given up.
    pub renewed_at: Instant,
    /// Shut down gracefully: no lease is taken and the instance key is not renewed again.
    left: bool,
    probes: Vec<Probe>,
}

impl Leases {
    pub fn new(cores: usize, owned: tokio::sync::watch::Sender<super::Owned>) -> Self {
        let now = Instant::now();
        Leases {
            stream: None,
            leased: Default::default(),
            checkpointed: HashMap::new(),
            lost: HashSet::new(),
            taken_order: HashMap::new(),
            next_take: 0,
            settle_until: None,
            owned,
            renewed_at: now,
            left: false,
            probes: (0..cores).map(|_| Probe { pending: None, marks: None, answered: now, stalled: false }).collect(),
        }
    }

    pub fn publish_owned(&self, stats: &super::Stats) {
        stats.leases.store(self.leased.len() as u64, Ordering::Relaxed);
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

    /// Redis unreachable past the leases' TTL: what was lost before is someone else's by
    /// now, only these are ours.
    pub fn give_up_unrenewed(&mut self, stats: &super::Stats) {
        self.lost = std::mem::take(&mut self.leased).into_keys().collect();
        self.publish_owned(stats);
    }
}

/// Runs until a Redis call fails (the link reconnects) or the link stops.
pub(super) async fn run(
    ctx: &Ctx,
    state: &State,
    lease: &mut Leases,
    mut conn: Conn,
    ctl: &mut tokio::sync::mpsc::Receiver<Ctl>,
) -> Failed {
    let mut beat = tokio::time::interval(ctx.o.heartbeat());
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let result = tokio::select! {
            _ = beat.tick() => heartbeat(ctx, state, lease, &mut conn).await,
            c = ctl.recv() => match c {
                Some(Ctl::Stream(plan)) => {
                    lease.stream = Some(plan);
                    let r = leases(ctx, state, lease, &mut conn).await;
                    // The consumer waits for this answer at every connect, changed or not.
                    lease.owned.send_replace(super::Owned { partitions: lease.leased.clone() });
                    r
                }
                Some(Ctl::Leave(done)) => {
                    let left = leave(ctx, state, lease, &mut conn).await;
                    let _ = done.send(());
                    left
                }
                None => Err("stopped".to_string()),
            },
        };
        if let Err(reason) = result {
            return reason;
        }
    }
}

fn stream_key(stream: &super::StreamPlan) -> String {
    format!("{:08x}", crc32fast::hash(stream.key.as_bytes()))
}

async fn heartbeat(ctx: &Ctx, state: &State, lease: &mut Leases, conn: &mut Conn) -> Result<(), Failed> {
    if lease.left {
        return Ok(());
    }
    // Renewal first: nothing below may delay it.
    renew(ctx, lease, conn).await?;
    let mut pipe = redis::pipe();
    ctx.presence(&mut pipe);
    within("SET instance", pipe.query_async::<()>(conn)).await?;
    let live = super::link::live_instances(ctx, conn).await?;
    let (gone, joined): (Vec<Arc<str>>, Vec<Arc<str>>) = {
        let s = state.borrow();
        (s.instances.iter().filter(|i| !live.contains(*i)).cloned().collect(), live.iter().filter(|i| !s.instances.contains(*i)).cloned().collect())
    };
    if !gone.is_empty() {
        // An instance that died without saying so: forget what it watched.
        let mut changes = Vec::new();
        state.borrow_mut().remote.retain(|device, watchers| {
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
        {
            let mut s = state.borrow_mut();
            s.dead.retain(|i| !gone.contains(i));
            ctx.stats.dead_watchers.store(s.dead.len() as u64, Ordering::Relaxed);
        }
        for g in &gone {
            tracing::info!(instance = %g, "instance gone from Redis");
            let _ = within("DEL watching", redis::cmd("DEL").arg(ctx.key("watching", g)).query_async::<()>(conn)).await;
        }
        // Handed over by a task of its own: a core's full queue never holds the heartbeat.
        // Rare (an instance died) and bounded by the devices it watched.
        let sends = super::link::remote_watch_batches(ctx, changes);
        tokio::task::spawn_local(async move {
            for (core, batch) in sends {
                let _ = core.send(Inbound::RemoteWatch(batch)).await;
            }
        });
    }
    for i in &joined {
        tracing::info!(instance = %i, "instance joined on Redis");
    }
    state.borrow_mut().instances = live;
    ctx.stats.instances.store(state.borrow().instances.len() as u64 + 1, Ordering::Relaxed);
    probe_cores(ctx, lease, ctx.o.heartbeat() / 2).await;
    leases(ctx, state, lease, conn).await?;
    super::link::check_watches(ctx, state, conn).await
}

/// Renews every lease held, in one call; a lease found taken by another instance is lost.
async fn renew(ctx: &Ctx, lease: &mut Leases, conn: &mut Conn) -> Result<(), Failed> {
    let Some(stream) = &lease.stream else {
        return Ok(());
    };
    if !lease.leased.is_empty() {
        let leases = ctx.key("lease", &stream_key(stream));
        let mut call = redis::cmd("EVAL");
        call.arg(RENEW_ALL).arg(lease.leased.len());
        for p in lease.leased.keys() {
            call.arg(format!("{leases}:{p}"));
        }
        call.arg(&*ctx.o.instance).arg(ctx.o.lease_ttl.as_millis() as u64);
        let renewed: Vec<i64> = within("renew leases", call.query_async(conn)).await?;
        let lost: Vec<String> = lease.leased.keys().zip(renewed).filter(|(_, ok)| *ok == 0).map(|(p, _)| p.clone()).collect();
        for p in lost {
            tracing::warn!(partition = %p, "partition lease lost (taken by another instance)");
            lease.leased.remove(&p);
            lease.lost.insert(p);
        }
    }
    lease.renewed_at = Instant::now();
    Ok(())
}

/// Asks every core for its applied marks and waits at most half a heartbeat for them; a
/// core that answers no longer is marked stalled past [`STALL_TTLS`] × `--lease-ttl`.
async fn probe_cores(ctx: &Ctx, lease: &mut Leases, wait: std::time::Duration) {
    for (i, probe) in lease.probes.iter_mut().enumerate() {
        if probe.pending.is_none() {
            let (reply, answer) = oneshot::channel();
            // Full queue: not asked this time; the core stays silent.
            if ctx.cores[i].try_send(Inbound::Applied(reply)).is_ok() {
                probe.pending = Some(answer);
            }
        }
    }
    let deadline = Instant::now() + wait;
    for (core, probe) in lease.probes.iter_mut().enumerate() {
        let Some(pending) = probe.pending.as_mut() else {
            continue;
        };
        match tokio::time::timeout_at(deadline, pending).await {
            Ok(Ok(marks)) => {
                let now = Instant::now();
                if probe.stalled {
                    probe.stalled = false;
                    let silent_ms = now.duration_since(probe.answered).as_millis() as u64;
                    tracing::warn!(core, silent_ms, "stalled core answers again: partition leases are taken again");
                }
                probe.marks = Some(marks);
                probe.answered = now;
                probe.pending = None;
            }
            Ok(Err(_)) => probe.pending = None,
            Err(_) => {}
        }
    }
    let limit = ctx.o.lease_ttl * STALL_TTLS;
    let now = Instant::now();
    for (core, probe) in lease.probes.iter_mut().enumerate() {
        let silent = now.duration_since(probe.answered);
        if !probe.stalled && silent > limit {
            probe.stalled = true;
            tracing::error!(
                core,
                silent_ms = silent.as_millis() as u64,
                partitions = lease.leased.len(),
                "core stalled: no answer for longer than 3 x --lease-ttl; every partition lease is given up until it answers"
            );
        }
    }
    let stalled = lease.probes.iter().filter(|p| p.stalled).count();
    ctx.stats.stalled.store(stalled as u64, Ordering::Relaxed);
}

/// The cores' applied marks: source partition → the lowest mark over every core (only
/// partitions every core has a mark for), each core's last answer.
fn applied_marks(lease: &Leases) -> HashMap<Box<str>, i64> {
    let mut low: HashMap<Box<str>, (i64, usize)> = HashMap::new();
    for probe in &lease.probes {
        let Some(marks) = &probe.marks else {
            return HashMap::new();
        };
        for (key, seq) in marks {
            let e = low.entry(key.clone()).or_insert((*seq, 0));
            e.0 = e.0.min(*seq);
            e.1 += 1;
        }
    }
    let n = lease.probes.len();
    low.into_iter().filter(|(_, (_, count))| *count == n).map(|(k, (seq, _))| (k, seq)).collect()
}

/// Partition leases, Event Hubs' processor style: checkpoint what is held, give up what is
/// over this instance's share (`ceil(partitions / live instances)`, stalled instances not
/// counted; none while a core here is stalled), and take free partitions (never held, or
/// whose lease expired) up to it. Renewal is [`renew`], first in every heartbeat.
async fn leases(ctx: &Ctx, state: &State, lease: &mut Leases, conn: &mut Conn) -> Result<(), Failed> {
    let Some(stream) = &lease.stream else {
        return Ok(());
    };
    let stream_key = stream_key(stream);
    let (leases, checkpoints) = (ctx.key("lease", &stream_key), ctx.key("checkpoint", &stream_key));
    let lease_key = |p: &str| format!("{leases}:{p}");
    let checkpoint_key = |p: &str| format!("{checkpoints}:{p}");
    let holders = ctx.key("holder", &stream_key);
    let holder_key = |p: &str| format!("{holders}:{p}");
    let handed = ctx.key("handed", &stream_key);
    let handed_key = |p: &str| format!("{handed}:{p}");
    let me = ctx.o.instance.clone();
    let ttl = ctx.o.lease_ttl.as_millis() as u64;
    let before = lease.leased.clone();
    // 1. Checkpoint what every core applied (or, without a store, what was handed over).
    let positions = (stream.positions)();
    let marks = if stream.marks { Some(applied_marks(lease)) } else { None };
    let mut pipe = redis::pipe();
    let mut written = Vec::new();
    let mut handed_any = false;
    for p in lease.leased.keys() {
        let seq = match &marks {
            Some(marks) => marks.get(format!("{}{p}", stream.key).as_str()).copied(),
            None => positions.get(p).copied(),
        };
        if let Some(seq) = seq.filter(|s| lease.checkpointed.get(p) != Some(s)) {
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
        lease.checkpointed.extend(written);
    }
    // 2. Balance: stalled instances (this one included) take no share.
    let stalled_here: Vec<usize> = lease.probes.iter().enumerate().filter(|(_, p)| p.stalled).map(|(i, _)| i).collect();
    // One round trip: this instance's own stall announced (or withdrawn), the others' read.
    let stalled = (!stalled_here.is_empty()).then(|| stalled_here.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(","));
    let others = super::link::instances_taking_a_share(ctx, state, stalled.as_deref(), conn).await?;
    let instances = others + usize::from(stalled_here.is_empty());
    let share = if stalled_here.is_empty() { stream.ids.len().div_ceil(instances.max(1)) } else { 0 };
    while lease.leased.len() > share {
        let newest = lease.leased.keys().max_by_key(|p| lease.taken_order.get(*p).copied().unwrap_or(0)).cloned();
        let Some(p) = newest else { break };
        lease.leased.remove(&p);
        lease.taken_order.remove(&p);
        let release = redis::cmd("EVAL").arg(RELEASE).arg(1).arg(lease_key(&p)).arg(&*me).to_owned();
        within("release lease", release.query_async::<i64>(conn)).await?;
        if stalled_here.is_empty() {
            tracing::info!(partition = %p, instances, share, "partition lease given up to balance the instances");
        } else {
            tracing::warn!(partition = %p, stalled_cores = ?stalled_here, "partition lease given up: a core here is stalled");
        }
    }
    if lease.leased.len() < share {
        // Start at a place of this instance's own, so instances do not race for one partition.
        let start = crc32fast::hash(me.as_bytes()) as usize % stream.ids.len().max(1);
        let mut order: Vec<String> = stream.ids.iter().cycle().skip(start).take(stream.ids.len()).cloned().collect();
        // Those lost first (stable: otherwise in this instance's own order); only those
        // while the instances settle after a Redis outage.
        order.sort_by_key(|p| !lease.lost.contains(p));
        if lease.settle_until.is_some_and(|t| Instant::now() < t) {
            order.retain(|p| lease.lost.contains(p));
        } else if lease.settle_until.take().is_some() {
            // Logged before any partition another instance read is taken (tests/cluster_amqp
            // checks nothing of the others' was taken before this line).
            tracing::info!("the instances settled after the Redis outage: any free partition may be taken again");
        }
        for p in order {
            if lease.leased.len() >= share {
                break;
            }
            if lease.leased.contains_key(&p) {
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
            let (checkpoint, holder, handed): (Option<i64>, Option<String>, Option<i64>) = within("GET checkpoint", pipe.query_async(conn)).await?;
            if holder.as_deref().is_some_and(|h| h != &*me) {
                ctx.stats.takeovers.fetch_add(1, Ordering::Relaxed);
                // Sequence numbers are contiguous per partition: the previous holder had
                // handed over this many events past the checkpoint it left.
                let replayed = handed.zip(checkpoint).map_or(0, |(h, c)| (h - c).max(0) as u64);
                ctx.stats.replayed.fetch_add(replayed, Ordering::Relaxed);
            }
            if let Some(seq) = checkpoint {
                lease.checkpointed.insert(p.clone(), seq);
            }
            tracing::info!(partition = %p, after_sequence_number = ?checkpoint, instances, share, "partition lease taken");
            lease.lost.remove(&p);
            lease.next_take += 1;
            lease.taken_order.insert(p.clone(), lease.next_take);
            lease.leased.insert(p, checkpoint);
        }
    }
    if lease.leased != before {
        lease.publish_owned(&ctx.stats);
    }
    Ok(())
}

/// Graceful shutdown: a last checkpoint (`leases` writes it), every lease given up,
/// watches withdrawn, the instance key deleted: the others rebalance at once.
async fn leave(ctx: &Ctx, state: &State, lease: &mut Leases, conn: &mut Conn) -> Result<(), Failed> {
    // The cores' marks as of now (the consumer has stopped): the last checkpoint must cover
    // everything they applied, or the next holder applies it again. Nothing to renew after.
    for probe in &mut lease.probes {
        probe.pending = None; // an answer already on its way may predate the last events
    }
    probe_cores(ctx, lease, LEAVE_WAIT).await;
    leases(ctx, state, lease, conn).await?;
    let me = ctx.o.instance.clone();
    let held: Vec<String> = std::mem::take(&mut lease.leased).into_keys().collect();
    let mut pipe = redis::pipe();
    if let Some(stream) = &lease.stream {
        let leases = ctx.key("lease", &stream_key(stream));
        for p in &held {
            pipe.cmd("EVAL").arg(RELEASE).arg(1).arg(format!("{leases}:{p}")).arg(&*me).ignore();
        }
    }
    for device in &state.borrow().local {
        pipe.cmd("PUBLISH").arg(ctx.channel("watch")).arg(format!("-{me}\t{device}")).ignore();
    }
    pipe.cmd("DEL").arg(ctx.key("watching", &me)).ignore();
    pipe.cmd("DEL").arg(ctx.key("stalled", &me)).ignore();
    ctx.absence(&mut pipe);
    lease.left = true;
    lease.stream = None;
    within("leave", pipe.query_async::<()>(conn)).await?;
    lease.publish_owned(&ctx.stats);
    tracing::info!(partitions = held.len(), "left Redis: partition leases given up, watches withdrawn");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ctx(cores: Vec<async_channel::Sender<Inbound>>, lease_ttl: Duration) -> Ctx {
        let o = super::super::link::Options {
            engine: super::super::Engine::Single("redis://127.0.0.1:1".into()),
            names: super::super::names::Names::new("t", false),
            ca: None,
            instance: "i".into(),
            session_ttl: Duration::from_secs(1),
            lease_ttl,
            inbound_bytes: 1 << 20,
            refresh: Duration::from_secs(1),
        };
        Ctx { o, cores, stats: Arc::default(), changes: Arc::new(tokio::sync::Semaphore::new(1)), running: Arc::new(tokio::sync::Semaphore::new(1)), changing: Default::default() }
    }

    /// A core that answers keeps its marks fresh; one that stays silent keeps its last ones,
    /// is declared stalled past 3 × the TTL (never before: the probe waits at most half a
    /// heartbeat, and asks a silent core once), and is no longer stalled once it answers.
    #[test]
    fn a_silent_core_is_waited_for_briefly_then_stalled_then_taken_back() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        runtime.block_on(async {
            let (tx0, rx0) = async_channel::bounded(8);
            let (tx1, rx1) = async_channel::bounded(8);
            // 300 ms TTL: stalled past 900 ms.
            let ctx = ctx(vec![tx0, tx1], Duration::from_millis(300));
            let (owned, _) = tokio::sync::watch::channel(super::super::Owned::default());
            let mut lease = Leases::new(2, owned);
            // A core's inbound task: answers one probe with mark `mark` for partition "p".
            let answer = |rx: async_channel::Receiver<Inbound>, mark: i64| async move {
                if let Ok(Inbound::Applied(reply)) = rx.recv().await {
                    let _ = reply.send(vec![("p".into(), mark)]);
                }
            };
            let wait = Duration::from_millis(20);
            tokio::join!(probe_cores(&ctx, &mut lease, wait), answer(rx0.clone(), 7), answer(rx1.clone(), 5));
            assert_eq!(applied_marks(&lease).get("p"), Some(&5), "the lowest mark over every core");
            // Core 1 falls silent: each probe waits for it at most its deadline.
            for _ in 0..2 {
                let t = Instant::now();
                tokio::join!(probe_cores(&ctx, &mut lease, wait), answer(rx0.clone(), 9));
                assert!(t.elapsed() < Duration::from_millis(200), "a probe waits at most its deadline: {:?}", t.elapsed());
                assert_eq!(ctx.stats.stalled.load(Ordering::Relaxed), 0, "not stalled within 3 x the TTL");
            }
            assert_eq!(applied_marks(&lease).get("p"), Some(&5), "core 1's last mark is kept");
            assert_eq!(rx1.len(), 1, "a silent core is asked once, not at every probe");
            tokio::time::sleep(Duration::from_millis(950)).await;
            tokio::join!(probe_cores(&ctx, &mut lease, wait), answer(rx0.clone(), 9));
            assert_eq!(ctx.stats.stalled.load(Ordering::Relaxed), 1, "silent past 3 x the TTL: stalled");
            // It answers (the question it was asked): no longer stalled, its mark is current.
            tokio::join!(probe_cores(&ctx, &mut lease, Duration::from_millis(200)), answer(rx0.clone(), 9), answer(rx1.clone(), 8));
            assert_eq!(ctx.stats.stalled.load(Ordering::Relaxed), 0);
            assert_eq!(applied_marks(&lease).get("p"), Some(&8));
        });
    }
}
