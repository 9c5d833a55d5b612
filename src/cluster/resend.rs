//! Lossless slot moves on a Redis Cluster, the publishing side (docs/design/redis-cluster.md
//! §2 "Reshard and failover", step 7).
//!
//! When a slot moves, its old master unsubscribes every shard subscriber of the slot's
//! channels (an unsolicited `sunsubscribe`) and each subscribing instance subscribes again on
//! the new master (cluster/shards.rs); a message `SPUBLISH`ed in between reaches nobody.
//! `SPUBLISH` answers how many subscribers got the message, and the link knows how many other
//! instances watch the device (`Shared::remote`, from the `watch` channel): fewer means a
//! watcher is between two masters. Then that message and every later one of its device wait
//! here, in order, and are published again every [`EVERY`] until as many got them as watch
//! the device (those already received are dropped by the receivers: wire v2's sequence
//! number, `link::on_messages`), for at most [`FOR`]; then they are given up, counted.
//!
//! Bounds (the policy): per device [`DEVICE_MESSAGES`] messages or [`DEVICE_BYTES`], in all
//! [`TOTAL_BYTES`]; past them the device's retries are given up (counted): what of it waited
//! unpublished behind the short one is published once at once, in order, then the new one,
//! so the watchers that are there lose nothing (before, a message past the bound was never
//! published at all: a watcher killed, counted until its presence expired, cost every other
//! watcher of its devices all but 64 messages of each; found by tests/recovery_cluster.rs's
//! firehose, 1,797 given up).
//!
//! A watcher that died (`kill -9`) holds nobody up: Redis drops its subscribers at once but
//! its presence stands until `--lease-ttl` passes, so every message of its devices falls
//! short of it. Before, each such message waited for the next retry (up to [`EVERY`] late
//! to the watchers that are there, for the whole TTL). Now a new message of a waiting device
//! goes at once behind fresh copies of its device's waiting ones (bounded:
//! [`AT_ONCE_MESSAGES`], [`AT_ONCE_BYTES`]), and while anything waits who is dead is asked
//! ([`Probe`], a task of its own: presence not renewed for a heartbeat and a second): a
//! dead instance no longer counts, so its devices' messages stop waiting for it within
//! about a heartbeat and a second (3 s by default) of its death; while one is known dead
//! it is asked every second, waiting or not, and one seen renewing again counts again.
//!
//! Not covered: a watcher that subscribes again between two `SPUBLISH`es of one device in
//! one pipeline gets the later and misses the earlier (published again, it is older than
//! what the watcher applied, so dropped). Redis runs the commands it reads in one go without
//! serving another client in between, so this needs a pipeline split across two reads.

use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hashbrown::{HashMap, HashSet};
use tokio::time::Instant;

use super::conn::Conn;
use super::link::{Ctx, Failed, State};
use super::shards;

/// How often waiting messages are published again.
pub(super) const EVERY: Duration = Duration::from_millis(50);
/// How long a message is published again before it is given up.
pub(super) const FOR: Duration = Duration::from_secs(2);
/// Messages of one device waiting at most, and their bytes.
const DEVICE_MESSAGES: usize = 64;
const DEVICE_BYTES: usize = 256 << 10;
/// Bytes waiting at most, all devices.
const TOTAL_BYTES: usize = 16 << 20;
/// A new message of a device that waits goes at once, behind fresh copies of its device's
/// waiting messages, while the device's queue (the new message in it) holds at most this
/// many messages and bytes: what one new message costs in copies is bounded by them. Past
/// them it waits for the next retry (at most [`EVERY`]), as every message did before
/// (a device sending faster than 8 a second while a watcher of it is dead or moving).
const AT_ONCE_MESSAGES: usize = 16;
const AT_ONCE_BYTES: usize = 64 << 10;
/// How often, at most, who is dead is asked while messages wait ([`Probe`]); how often while
/// nothing waits but some instance is known dead (so one seen renewing again counts again
/// within about a second, whether messages wait or not); how long an answer is waited for
/// (by the probe's own task: the command task never waits for it); and the longest pause
/// after failed or late answers (the pause doubles from [`PROBE_EVERY`] with each in a row).
const PROBE_EVERY: Duration = Duration::from_millis(250);
const RECHECK_EVERY: Duration = Duration::from_secs(1);
const PROBE_DEADLINE: Duration = Duration::from_secs(1);
const PROBE_BACKOFF_MAX: Duration = Duration::from_secs(4);

struct Waiting {
    payload: Vec<u8>,
    since: Instant,
    /// Published at least once (else it waits behind an earlier message of its device,
    /// never yet sent to anybody).
    sent: bool,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Waiting>,
    bytes: usize,
}

/// Messages short of their watchers, per device in publication order; kept by the command
/// task for the life of one connection.
#[derive(Default)]
pub(super) struct Resend {
    devices: HashMap<Box<str>, Queue>,
    bytes: usize,
    /// When to publish again (`None`: nothing waits).
    pub due: Option<Instant>,
    /// One pipeline per master per batch (cluster/shards.rs).
    publisher: shards::Publisher,
}

impl Resend {
    fn waits(&self, device: &str) -> bool {
        self.devices.contains_key(device)
    }

    /// Keeps `payload` waiting behind its device's earlier messages. Past the bounds the
    /// device's retries are given up (counted): what of it was never published is answered,
    /// in order, with `payload` if it was not either, to be published once now, so the
    /// watchers that are there (a watcher that died is counted until it is known dead)
    /// lose nothing to a bound meant for one between two masters.
    fn push(&mut self, ctx: &Ctx, device: &str, payload: Vec<u8>, since: Instant, sent: bool) -> Vec<Vec<u8>> {
        let n = payload.len();
        let full = self.bytes + n > TOTAL_BYTES
            || self.devices.get(device).is_some_and(|q| q.items.len() >= DEVICE_MESSAGES || q.bytes + n > DEVICE_BYTES);
        if full {
            let queue = self.devices.remove(device).unwrap_or_default();
            self.bytes -= queue.bytes;
            if self.devices.is_empty() {
                self.due = None;
            }
            // Given up: what was published and still waited for its watchers (this one too if
            // it was); what never was is published now, not given up.
            let given_up = queue.items.iter().filter(|w| w.sent).count() + usize::from(sent);
            ctx.stats.republish_given_up.fetch_add(given_up as u64, Ordering::Relaxed);
            let mut now: Vec<Vec<u8>> = queue.items.into_iter().filter(|w| !w.sent).map(|w| w.payload).collect();
            if !sent {
                now.push(payload);
            }
            return now;
        }
        let queue = self.devices.entry_ref(device).or_default();
        queue.items.push_back(Waiting { payload, since, sent });
        queue.bytes += n;
        self.bytes += n;
        self.due.get_or_insert_with(|| Instant::now() + EVERY);
        Vec::new()
    }

    /// The connection went: what waits is given up.
    pub fn abandon(&mut self, ctx: &Ctx) {
        let n: usize = self.devices.values().map(|q| q.items.len()).sum();
        ctx.stats.republish_given_up.fetch_add(n as u64, Ordering::Relaxed);
        self.devices.clear();
        self.bytes = 0;
        self.due = None;
    }
}

/// Instances other than this one that watch `device`, as the `watch` channel said, less
/// those known dead ([`Probe`]).
fn watchers(state: &State, device: &str) -> i64 {
    let s = state.borrow();
    s.remote.get(device).map_or(0, |w| w.iter().filter(|i| !s.dead.contains(*i)).count() as i64)
}

/// A message of a batch as it goes out: its own publication, or the whole queue of a device
/// that waits (the batch's new messages of it included), in the batch's order.
enum Out {
    Direct(Box<str>, Vec<u8>),
    Waiting(Box<str>),
}

/// `SPUBLISH`es a batch of device messages, each counted against its device's watchers: a
/// message short of them, and every later one of its device, waits in `resend`; so does a
/// message of a device already waiting (order). Such a message does not wait for the next
/// retry while its device's queue is small ([`AT_ONCE_MESSAGES`], [`AT_ONCE_BYTES`]): it goes
/// at once behind fresh copies of its device's waiting messages, in the same pipeline as the
/// rest of the batch and in its order, so the watchers that are there get it at once (a
/// watcher that died is not waited for) and one between two masters still gets the
/// device's messages in order.
pub(super) async fn publish(ctx: &Ctx, state: &State, conn: &Conn, items: Vec<(Box<str>, Vec<u8>)>, resend: &mut Resend) -> Result<(), Failed> {
    let now = Instant::now();
    let mut out: Vec<Out> = Vec::with_capacity(items.len());
    let mut queued: HashSet<Box<str>> = HashSet::new();
    for (device, payload) in items {
        if resend.waits(&device) {
            let overflow = resend.push(ctx, &device, payload, now, false);
            if !overflow.is_empty() {
                out.extend(overflow.into_iter().map(|p| Out::Direct(device.clone(), p)));
            } else if queued.insert(device.clone()) {
                out.push(Out::Waiting(device));
            }
        } else {
            out.push(Out::Direct(device, payload));
        }
    }
    // A device past the bounds of at once waits for the next retry; one whose queue was
    // given up further on in the batch has its messages among the direct ones.
    out.retain(|o| match o {
        Out::Direct(..) => true,
        Out::Waiting(d) => resend.devices.get(d).is_some_and(|q| q.items.len() <= AT_ONCE_MESSAGES && q.bytes <= AT_ONCE_BYTES),
    });
    if out.is_empty() {
        return Ok(());
    }
    let (counts, sizes) = {
        let mut refs: Vec<(&str, &[u8])> = Vec::with_capacity(out.len());
        let mut sizes: Vec<usize> = Vec::with_capacity(out.len());
        let (mut first, mut again, mut direct) = (0u64, 0u64, 0u64);
        for o in &out {
            match o {
                Out::Direct(d, p) => {
                    refs.push((&**d, p.as_slice()));
                    sizes.push(1);
                    first += 1;
                    direct += 1;
                }
                Out::Waiting(d) => {
                    let q = resend.devices.get(d).map(|q| &q.items);
                    let q = q.into_iter().flatten();
                    let before = refs.len();
                    for w in q {
                        refs.push((&**d, w.payload.as_slice()));
                        if w.sent {
                            again += 1;
                        } else {
                            first += 1;
                        }
                    }
                    sizes.push(refs.len() - before);
                }
            }
        }
        match resend.publisher.publish(ctx, conn, &refs, |d| ctx.key("device", d)).await {
            Ok(counts) => {
                ctx.stats.published.fetch_add(first, Ordering::Relaxed);
                ctx.stats.republished.fetch_add(again, Ordering::Relaxed);
                (counts, sizes)
            }
            Err(reason) => {
                // Each counted once: the direct ones dropped here; what waits (its new
                // messages too) is given up by the caller (`Resend::abandon`).
                ctx.stats.dropped.fetch_add(direct, Ordering::Relaxed);
                return Err(reason);
            }
        }
    };
    let mut at = 0;
    for (o, n) in out.into_iter().zip(sizes) {
        let got = &counts[at..at + n];
        at += n;
        match o {
            Out::Direct(device, payload) => {
                if resend.waits(&device) || got[0] < watchers(state, &device) {
                    // Published: past the bounds its retries are given up, nothing else to send.
                    let _ = resend.push(ctx, &device, payload, now, true);
                }
            }
            Out::Waiting(device) => reached(state, resend, &device, got),
        }
    }
    Ok(())
}

/// `device`'s waiting messages were all published, their counts `got` in order: each is
/// sent; those that reached the device's watchers stop waiting, up to the first that did not.
fn reached(state: &State, resend: &mut Resend, device: &str, got: &[i64]) {
    let want = watchers(state, device);
    let reached = got.iter().take_while(|got| **got >= want).count();
    let Some(q) = resend.devices.get_mut(device) else { return };
    for w in q.items.iter_mut() {
        w.sent = true;
    }
    for _ in 0..reached {
        if let Some(w) = q.items.pop_front() {
            q.bytes -= w.payload.len();
            resend.bytes -= w.payload.len();
        }
    }
    if q.items.is_empty() {
        resend.devices.remove(device);
        if resend.devices.is_empty() {
            resend.due = None;
        }
    }
}

/// Publishes every waiting message again, each device's in order: those that reached their
/// device's watchers now stop waiting, up to the first that did not; those waiting longer
/// than [`FOR`] are given up. While something waits, who is dead is asked now and then
/// ([`Probe`]): a dead watcher stops counting.
pub(super) async fn again(ctx: &Ctx, state: &State, conn: &Conn, resend: &mut Resend) -> Result<(), Failed> {
    let now = Instant::now();
    let mut given_up = 0u64;
    let mut freed = 0usize;
    resend.devices.retain(|_, q| {
        while q.items.front().is_some_and(|w| now.duration_since(w.since) >= FOR) {
            if let Some(w) = q.items.pop_front() {
                q.bytes -= w.payload.len();
                freed += w.payload.len();
                given_up += 1;
            }
        }
        !q.items.is_empty()
    });
    resend.bytes -= freed;
    if given_up > 0 {
        ctx.stats.republish_given_up.fetch_add(given_up, Ordering::Relaxed);
        tracing::warn!(messages = given_up, "device messages given up: still fewer instances received them than watch their device after 2 s of publishing again");
    }
    if resend.devices.is_empty() {
        resend.due = None;
        return Ok(());
    }
    send(ctx, state, conn, resend).await?;
    resend.due = (!resend.devices.is_empty()).then(|| Instant::now() + EVERY);
    Ok(())
}

/// Publishes every waiting message, each device's in order, one pipeline per master.
async fn send(ctx: &Ctx, state: &State, conn: &Conn, resend: &mut Resend) -> Result<(), Failed> {
    let (order, counts) = {
        let mut order: Vec<(Box<str>, usize)> = Vec::with_capacity(resend.devices.len());
        let mut refs: Vec<(&str, &[u8])> = Vec::new();
        let (mut first, mut again) = (0u64, 0u64);
        for (device, q) in &resend.devices {
            order.push((device.clone(), q.items.len()));
            for w in &q.items {
                refs.push((&**device, w.payload.as_slice()));
                if w.sent {
                    again += 1;
                } else {
                    first += 1;
                }
            }
        }
        let counts = resend.publisher.publish(ctx, conn, &refs, |d| ctx.key("device", d)).await?;
        ctx.stats.published.fetch_add(first, Ordering::Relaxed);
        ctx.stats.republished.fetch_add(again, Ordering::Relaxed);
        (order, counts)
    };
    let mut at = 0;
    for (device, n) in order {
        reached(state, resend, &device, &counts[at..at + n]);
        at += n;
    }
    Ok(())
}

/// Who is dead, asked of Redis by a task of its own (one query in flight at most; the
/// command task starts it and applies its answer when it comes, never waiting for it, so a
/// slow or failing-over master holding the instances key holds no publication): every
/// [`PROBE_EVERY`] while messages wait, every [`RECHECK_EVERY`] while nothing waits but some
/// instance is known dead, never otherwise. Another instance whose presence was not renewed
/// for a heartbeat and a second (or is gone) is dead, by the rule and Redis's clock the
/// rebuild's probe uses (docs/design/recovery.md step 11 c); a live instance renews it every
/// heartbeat. A dead instance no longer counts as a watcher here, so its devices' messages
/// stop waiting for it within about a heartbeat and a second of its death instead of until
/// its presence expires (`--lease-ttl`). One seen renewing again (a frozen one, SIGSTOP, or
/// a late heartbeat) counts again from the answer that sees it, within about a second,
/// whether messages wait or not: before, only a probe made while messages waited could see
/// it, and a message that missed it later (a slot move) looked delivered and was lost to it.
/// A failed or late answer (past [`PROBE_DEADLINE`]) keeps what was known, and the next
/// query waits twice as long as the last (up to [`PROBE_BACKOFF_MAX`]).
/// How long ago each other instance renewed its presence (`link::staleness`).
type Staleness = Vec<(Box<str>, Option<i64>)>;

#[derive(Default)]
pub(super) struct Probe {
    /// The query in flight: its answer, `None` if it failed or was late.
    asked: Option<tokio::task::JoinHandle<Option<Staleness>>>,
    /// When the last query was started.
    at: Option<Instant>,
    /// Failed or late answers in a row.
    failures: u32,
}

impl Drop for Probe {
    fn drop(&mut self) {
        if let Some(asked) = &self.asked {
            asked.abort();
        }
    }
}

/// `hubcast_redis_dead_probe_pending` while a query's task lives.
struct Pending(Arc<super::Stats>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.dead_probe_pending.store(0, Ordering::Relaxed);
    }
}

impl Probe {
    /// When to ask next (`None`: not now; one in flight, or nothing to ask for).
    pub fn due(&self, state: &State, resend: &Resend) -> Option<Instant> {
        if self.asked.is_some() {
            return None;
        }
        let every = if resend.due.is_some() {
            PROBE_EVERY
        } else if !state.borrow().dead.is_empty() {
            RECHECK_EVERY
        } else {
            return None;
        };
        let backoff = PROBE_EVERY.saturating_mul(1 << self.failures.min(4)).min(PROBE_BACKOFF_MAX);
        Some(self.at.map_or_else(Instant::now, |at| at + every.max(backoff)))
    }

    /// Starts a query.
    pub fn ask(&mut self, ctx: &Rc<Ctx>, conn: &Conn) {
        self.at = Some(Instant::now());
        let (ctx, mut conn) = (ctx.clone(), conn.clone());
        ctx.stats.dead_probes.fetch_add(1, Ordering::Relaxed);
        self.asked = Some(tokio::task::spawn_local(async move {
            // 1 until the query ends, answered or not, or is aborted with its connection.
            ctx.stats.dead_probe_pending.store(1, Ordering::Relaxed);
            let _pending = Pending(ctx.stats.clone());
            match tokio::time::timeout(PROBE_DEADLINE, super::link::staleness(&ctx, &mut conn)).await {
                Ok(Ok(stale)) => Some(stale),
                Ok(Err(reason)) => {
                    tracing::debug!(%reason, "who is dead could not be asked: the watchers known stay as they were");
                    None
                }
                Err(_) => {
                    tracing::debug!("who is dead was not answered in time: the watchers known stay as they were");
                    None
                }
            }
        }));
    }

    /// The answer of the query in flight, when it comes (never while none is).
    pub async fn answer(&mut self) -> Option<Staleness> {
        let Some(asked) = self.asked.as_mut() else { return std::future::pending().await };
        let answer = asked.await.ok().flatten();
        self.asked = None;
        answer
    }

    /// Applies an answer: those seen dead stop counting as watchers, those seen renewing
    /// count again.
    pub fn apply(&mut self, ctx: &Ctx, state: &State, answer: Option<Staleness>) {
        let Some(stale) = answer else {
            self.failures = self.failures.saturating_add(1);
            return;
        };
        self.failures = 0;
        let dead_after = (ctx.o.heartbeat() + Duration::from_secs(1)).as_millis() as i64;
        let alive: HashSet<&str> = stale.iter().filter(|(_, ms)| ms.is_some_and(|ms| ms <= dead_after)).map(|(id, _)| &**id).collect();
        let mut s = state.borrow_mut();
        let dead: HashSet<Arc<str>> = s.instances.iter().filter(|i| !alive.contains(&***i)).cloned().collect();
        for i in dead.difference(&s.dead) {
            tracing::info!(instance = %i, "another instance has not renewed its presence for a heartbeat and a second: no longer waited for as a watcher of its devices' messages");
        }
        for i in s.dead.difference(&dead) {
            tracing::info!(instance = %i, "another instance known dead renews its presence again: waited for as a watcher of its devices' messages again");
        }
        s.dead = dead;
        ctx.stats.dead_watchers.store(s.dead.len() as u64, Ordering::Relaxed);
    }
}
