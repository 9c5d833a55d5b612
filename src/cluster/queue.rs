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

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Command, Stats};

/// Commands waiting for the Redis thread.
pub(super) const COMMANDS: usize = 1024;

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
            Command::RingsAnswer { to, payload } => (to.len() + payload.len()) as u64,
            Command::Load { .. } | Command::Leave(_) | Command::Take { .. } | Command::AdoptWatching { .. } | Command::AdoptVerdict { .. } | Command::Settle(_) | Command::Staleness(_) => 0,
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

    fn futures_executor_block_on(f: impl std::future::Future<Output = ()>) {
        tokio::runtime::Builder::new_current_thread().build().expect("a runtime").block_on(f)
    }
}
