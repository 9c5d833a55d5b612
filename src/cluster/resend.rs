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
//! firehose, 1,797 given up). A watcher that died or left without its `-` arriving yet
//! costs its devices' messages up to 2 s of delay (or until the bound, then none).
//!
//! Not covered: a watcher that subscribes again between two `SPUBLISH`es of one device in
//! one pipeline gets the later and misses the earlier (published again, it is older than
//! what the watcher applied, so dropped). Redis runs the commands it reads in one go without
//! serving another client in between, so this needs a pipeline split across two reads.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hashbrown::HashMap;
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
    /// watchers that are there (a watcher that died is counted until its presence expires)
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

/// Instances other than this one that watch `device`, as the `watch` channel said.
fn watchers(state: &State, device: &str) -> i64 {
    state.borrow().remote.get(device).map_or(0, |w| w.len() as i64)
}

/// `SPUBLISH`es a batch of device messages, each counted against its device's watchers: a
/// message short of them, and every later one of its device, waits in `resend`; so does a
/// message of a device already waiting (order).
pub(super) async fn publish(ctx: &Ctx, state: &State, conn: &Conn, items: Vec<(Box<str>, Vec<u8>)>, resend: &mut Resend) -> Result<(), Failed> {
    let now = Instant::now();
    let mut direct = Vec::with_capacity(items.len());
    for (device, payload) in items {
        if resend.waits(&device) {
            let overflow = resend.push(ctx, &device, payload, now, false);
            direct.extend(overflow.into_iter().map(|p| (device.clone(), p)));
        } else {
            direct.push((device, payload));
        }
    }
    if direct.is_empty() {
        return Ok(());
    }
    let counts = {
        let refs: Vec<(&str, &[u8])> = direct.iter().map(|(d, p)| (&**d, p.as_slice())).collect();
        match resend.publisher.publish(ctx, conn, &refs, |d| ctx.key("device", d)).await {
            Ok(counts) => counts,
            Err(reason) => {
                ctx.stats.dropped.fetch_add(direct.len() as u64, Ordering::Relaxed);
                return Err(reason);
            }
        }
    };
    ctx.stats.published.fetch_add(direct.len() as u64, Ordering::Relaxed);
    for ((device, payload), got) in direct.into_iter().zip(counts) {
        if resend.waits(&device) || got < watchers(state, &device) {
            // Published: past the bounds its retries are given up, nothing else to send.
            let _ = resend.push(ctx, &device, payload, now, true);
        }
    }
    Ok(())
}

/// Publishes every waiting message again, each device's in order: those that reached their
/// device's watchers now stop waiting, up to the first that did not; those waiting longer
/// than [`FOR`] are given up.
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
    let (order, counts) = {
        let mut order: Vec<(Box<str>, usize)> = Vec::with_capacity(resend.devices.len());
        let mut refs: Vec<(&str, &[u8])> = Vec::new();
        for (device, q) in &resend.devices {
            order.push((device.clone(), q.items.len()));
            refs.extend(q.items.iter().map(|w| (&**device, w.payload.as_slice())));
        }
        let counts = resend.publisher.publish(ctx, conn, &refs, |d| ctx.key("device", d)).await?;
        ctx.stats.republished.fetch_add(refs.len() as u64, Ordering::Relaxed);
        (order, counts)
    };
    for q in resend.devices.values_mut() {
        for w in q.items.iter_mut() {
            w.sent = true;
        }
    }
    let mut at = 0;
    for (device, n) in order {
        let want = watchers(state, &device);
        let reached = counts[at..at + n].iter().take_while(|got| **got >= want).count();
        at += n;
        if let Some(q) = resend.devices.get_mut(&device) {
            for _ in 0..reached {
                if let Some(w) = q.items.pop_front() {
                    q.bytes -= w.payload.len();
                    resend.bytes -= w.payload.len();
                }
            }
            if q.items.is_empty() {
                resend.devices.remove(&device);
            }
        }
    }
    resend.due = (!resend.devices.is_empty()).then(|| Instant::now() + EVERY);
    Ok(())
}
