//! The command queue to the Redis thread (cluster/link.rs), bounded in count ([`COMMANDS`])
//! **and in bytes** (`--redis-command-bytes`): a count alone let 1,024 publications of up to
//! 4 MiB each (a core's outbox) wait, 4 GiB, while Redis was slow.
//!
//! What a command weighs ([`Command::bytes`]): its strings and payloads (device ids, message
//! payloads, session ids, partition names) plus a fixed size per item and per command; charged
//! when it is queued, released when the Redis thread takes it (`hubcast_redis_command_bytes`).
//!
//! Back-pressure policy (never waits: a core's thread must not block on Redis): a command
//! past either bound is refused at once, as when the queue is full, and counted in
//! `hubcast_redis_commands_refused_total`:
//! - a publication of device messages is dropped (`hubcast_redis_dropped_total`; the
//!   receivers see a gap, as in an outage);
//! - a session change, load, save or read answers 503 ("too many changes waiting for
//!   Redis"), nothing written;
//! - watch changes stay pending on their core (latest per device) and go with a later flush;
//! - a keep-alive of sessions is skipped (the next one, a third of the grace period later,
//!   renews them);
//! - a recovery history to hand over at a SIGTERM is not handed over (counted as
//!   `over_bound`, cluster/adopt.rs), an ask for a history held elsewhere or its "none" is
//!   not sent (the client's CONNECT waits its time and goes on without it); an adoption's verdict or watch report, small and never
//!   to be lost, waits for room in count instead ([`Sender::send`]).
//!
//! A command heavier than the whole bound is taken when nothing else waits (so one large
//! request body still goes through: the request limits bound it).
//!
//! **Publications go together** ([`Receiver::coalesce`]; issue 23, step 8's measurement): a
//! `Publish` taken brings every `Publish` queued right behind it, and waits up to
//! [`COALESCE_WINDOW`] for more, so Redis reads fewer, larger pipelines (one per master per
//! gathering on a cluster) and writes each subscriber fewer, larger pushes. Bounds (the
//! policy): it stops at [`COALESCE_MESSAGES`] messages or [`COALESCE_BYTES`] (at most one
//! command past either: a command taken is not put back), at the window's end, or at the
//! first command of another kind, which is then served right after the publications (the
//! queue's order is kept). What is gathered is released from the queue's bytes as it is
//! taken; it is bounded by these constants instead while it waits here. It waits only while
//! fewer than [`COALESCE_WAIT_BELOW`] messages are gathered: a pipeline that large already
//! amortizes Redis's read and write (the 500-message posts of the measurement gained
//! nothing from the wait and lost ~2 ms of p50 to it), so it goes at once with what was
//! queued. Cost: a lone publication waits the window (1 ms, tokio's timer grain).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{Command, Stats};

/// Commands waiting for the Redis thread.
pub(super) const COMMANDS: usize = 1024;

/// How long a publication waits for others to go with it, at most (module doc).
pub(super) const COALESCE_WINDOW: Duration = Duration::from_millis(1);
/// Gathered messages from which no wait is made for more (module doc).
pub(super) const COALESCE_WAIT_BELOW: usize = 64;
/// Messages and bytes (as [`Command::bytes`] weighs them) gathered into one publication.
pub(super) const COALESCE_MESSAGES: usize = 4096;
pub(super) const COALESCE_BYTES: u64 = 4 << 20;

/// A device's messages to publish, in order (what `Command::Publish` holds).
pub(super) type Items = Vec<(Box<str>, Vec<u8>)>;

/// A fixed weight per command and per item in it (the enum, a vector slot, a small struct).
const PER_COMMAND: u64 = std::mem::size_of::<Command>() as u64;
const PER_ITEM: u64 = 64;

impl Command {
    /// What the command holds, in bytes (an estimate that is the same on both ends).
    pub(super) fn bytes(&self) -> u64 {
        let strings: u64 = match self {
            Command::Publish(items) => items.iter().map(|(d, p)| (d.len() + p.len()) as u64 + PER_ITEM).sum(),
            Command::Change { changes, .. } => changes.iter().map(|(d, _)| d.len() as u64 + PER_ITEM).sum(),
            Command::Save { op, .. } => match op {
                super::SharedOp::Access { device, .. } => device.len() as u64 + PER_ITEM,
                super::SharedOp::Accesses { changes, .. } => changes.iter().map(|(d, _)| d.len() as u64 + PER_ITEM).sum(),
                _ => 0,
            },
            Command::Watch(changes) => changes.iter().map(|(d, _)| d.len() as u64 + PER_ITEM).sum(),
            Command::Refresh(ids) => ids.len() as u64 * PER_ITEM,
            Command::Stream(plan) => plan.key.len() as u64 + plan.ids.iter().map(|p| p.len() as u64 + PER_ITEM).sum::<u64>(),
            Command::Read { device, .. } => device.len() as u64,
            Command::Adopt { devices, blob, .. } => blob.len() as u64 + devices.iter().map(|d| d.len() as u64 + PER_ITEM).sum::<u64>(),
            Command::GiveNone { to, .. } => to.len() as u64,
            Command::RingsAsk(payload) => payload.len() as u64,
            Command::AdoptVerdict { tail: Some(tail), .. } => tail.len() as u64,
            Command::RingsAnswer { to, payload } => (to.len() + payload.len()) as u64,
            Command::Load { .. } | Command::Leave(_) | Command::Take { .. } | Command::AdoptWatching { .. } | Command::AdoptVerdict { tail: None, .. } | Command::Settle(_) | Command::Staleness(_) => 0,
        };
        PER_COMMAND + strings
    }
}

/// The cores' end (cloned to each).
#[derive(Clone)]
pub(crate) struct Sender {
    tx: async_channel::Sender<Command>,
    stats: Arc<Stats>,
    bound: u64,
}

/// The Redis thread's end: releases what it takes.
pub(crate) struct Receiver {
    rx: async_channel::Receiver<Command>,
    stats: Arc<Stats>,
}

pub(super) fn bounded(stats: Arc<Stats>, bound: u64) -> (Sender, Receiver) {
    let (tx, rx) = async_channel::bounded(COMMANDS);
    (Sender { tx, stats: stats.clone(), bound }, Receiver { rx, stats })
}

impl Sender {
    /// Queues `command`, or hands it back when the queue is full in count or in bytes (the
    /// caller applies the policy above).
    pub(crate) fn try_send(&self, command: Command) -> Result<(), Command> {
        let n = command.bytes();
        let before = self.stats.command_bytes.fetch_add(n, Ordering::Relaxed);
        let refused = if before > 0 && before + n > self.bound {
            Err(command)
        } else {
            self.tx.try_send(command).map_err(|e| e.into_inner())
        };
        if refused.is_err() {
            self.stats.command_bytes.fetch_sub(n, Ordering::Relaxed);
            self.stats.commands_refused.fetch_add(1, Ordering::Relaxed);
        }
        refused
    }

    /// Queues `command`, waiting for room in count; charged to the bytes but never refused
    /// by them: for the few small commands that must not be lost (an adoption's verdict and
    /// watch report, cluster/adopt.rs). `Err` only when the Redis thread is gone.
    pub(crate) async fn send(&self, command: Command) -> Result<(), Command> {
        let n = command.bytes();
        self.stats.command_bytes.fetch_add(n, Ordering::Relaxed);
        self.tx.send(command).await.map_err(|e| {
            self.stats.command_bytes.fetch_sub(n, Ordering::Relaxed);
            e.into_inner()
        })
    }
}

impl Receiver {
    pub(crate) async fn recv(&self) -> Result<Command, async_channel::RecvError> {
        let command = self.rx.recv().await?;
        self.stats.command_bytes.fetch_sub(command.bytes(), Ordering::Relaxed);
        Ok(command)
    }

    /// Gathers the publications queued behind `items` and those arriving within `window`,
    /// within the bounds (module doc). Answers them and what stopped the gathering: a command
    /// of another kind (to serve next) or the queue's end.
    pub(crate) async fn coalesce(&self, mut items: Items, window: Duration) -> (Items, Option<Result<Command, async_channel::RecvError>>) {
        let deadline = tokio::time::Instant::now() + window;
        let mut bytes = Command::Publish(Vec::new()).bytes() + items.iter().map(|(d, p)| (d.len() + p.len()) as u64 + PER_ITEM).sum::<u64>();
        while items.len() < COALESCE_MESSAGES && bytes < COALESCE_BYTES {
            let next = match self.rx.try_recv() {
                Ok(command) => command,
                Err(async_channel::TryRecvError::Closed) => return (items, Some(Err(async_channel::RecvError))),
                Err(async_channel::TryRecvError::Empty) if items.len() >= COALESCE_WAIT_BELOW => break,
                Err(async_channel::TryRecvError::Empty) => match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                    Ok(Ok(command)) => command,
                    Ok(Err(closed)) => return (items, Some(Err(closed))),
                    Err(_) => break,
                },
            };
            let n = next.bytes();
            self.stats.command_bytes.fetch_sub(n, Ordering::Relaxed);
            match next {
                Command::Publish(more) => {
                    bytes += n;
                    items.extend(more);
                }
                other => return (items, Some(Ok(other))),
            }
        }
        (items, None)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.rx.is_closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(bytes: usize) -> Command {
        Command::Publish(vec![("d".into(), vec![0; bytes])])
    }

    /// Past the bytes the queue refuses though it has room in count; what is taken is
    /// released, and a command heavier than the bound goes when nothing else waits.
    #[test]
    fn the_queue_refuses_past_its_bytes_and_releases_what_is_taken() {
        let stats = Arc::new(Stats::default());
        let (tx, rx) = bounded(stats.clone(), 100_000);
        assert!(tx.try_send(publish(60_000)).is_ok());
        assert!(tx.try_send(publish(60_000)).is_err(), "past the bytes");
        assert_eq!(stats.commands_refused.load(Ordering::Relaxed), 1);
        assert!(tx.try_send(publish(10_000)).is_ok(), "what fits still goes");
        let waiting = stats.command_bytes.load(Ordering::Relaxed);
        assert_eq!(waiting, publish(60_000).bytes() + publish(10_000).bytes());
        futures_executor_block_on(async {
            rx.recv().await.expect("a command");
            rx.recv().await.expect("a command");
        });
        assert_eq!(stats.command_bytes.load(Ordering::Relaxed), 0);
        assert!(tx.try_send(publish(500_000)).is_ok(), "alone, heavier than the bound");
        assert!(tx.try_send(publish(1)).is_err());
    }

    /// Publications queued back to back go as one, in order, up to the bounds; a command of
    /// another kind ends the gathering and comes next; a lone one waits the window only.
    #[test]
    fn publications_queued_together_are_taken_as_one_in_order_within_the_bounds() {
        let stats = Arc::new(Stats::default());
        let (tx, rx) = bounded(stats.clone(), 64 << 20);
        let one = |d: &str| Command::Publish(vec![(d.into(), vec![1; 10])]);
        for d in ["a", "b", "c"] {
            assert!(tx.try_send(one(d)).is_ok());
        }
        assert!(tx.try_send(Command::Refresh(Vec::new())).is_ok());
        assert!(tx.try_send(one("d")).is_ok());
        futures_executor_block_on(async {
            let Ok(Command::Publish(first)) = rx.recv().await else { panic!("a publication") };
            let (items, next) = rx.coalesce(first, COALESCE_WINDOW).await;
            let devices: Vec<&str> = items.iter().map(|(d, _)| &**d).collect();
            assert_eq!(devices, ["a", "b", "c"]);
            assert!(matches!(next, Some(Ok(Command::Refresh(_)))), "the refresh comes next, after them");
            let Ok(Command::Publish(last)) = rx.recv().await else { panic!("a publication") };
            let started = tokio::time::Instant::now();
            let (items, next) = rx.coalesce(last, COALESCE_WINDOW).await;
            assert_eq!(items.len(), 1);
            assert!(next.is_none());
            assert!(started.elapsed() < Duration::from_millis(500), "a lone publication waits the window only");
        });
        assert_eq!(stats.command_bytes.load(Ordering::Relaxed), 0, "what was gathered is released");
        // Bounds: at most one command past the count, the rest stays queued.
        let hundred = || Command::Publish((0..100).map(|_| ("e".into(), vec![1; 10])).collect());
        for _ in 0..50 {
            assert!(tx.try_send(hundred()).is_ok());
        }
        futures_executor_block_on(async {
            let Ok(Command::Publish(first)) = rx.recv().await else { panic!("a publication") };
            let (items, next) = rx.coalesce(first, COALESCE_WINDOW).await;
            assert_eq!(items.len(), 4100, "stops at the first command reaching {COALESCE_MESSAGES}");
            assert!(next.is_none());
            let Ok(Command::Publish(rest)) = rx.recv().await else { panic!("the rest waits") };
            assert_eq!(rest.len(), 100);
        });
        // A gathering already large goes at once with what was queued: no wait for more.
        let (tx, rx) = bounded(stats.clone(), 64 << 20);
        assert!(tx.try_send(hundred()).is_ok());
        futures_executor_block_on(async {
            let Ok(Command::Publish(first)) = rx.recv().await else { panic!("a publication") };
            let started = tokio::time::Instant::now();
            let (items, next) = rx.coalesce(first, Duration::from_secs(5)).await;
            assert_eq!((items.len(), next.is_none()), (100, true));
            assert!(started.elapsed() < Duration::from_secs(2), "{} messages waited {:?}", items.len(), started.elapsed());
        });
    }

    fn futures_executor_block_on(f: impl std::future::Future<Output = ()>) {
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a runtime").block_on(f)
    }
}
