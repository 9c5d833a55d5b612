//! The door for sources that run outside the cores (the AMQP consumer on its tokio thread).
//!
//! Each core has a bounded queue of ingest batches. `Ingress::send` routes a batch to the
//! owning cores and waits while a core's queue is full, so a slow core pushes back on the
//! source (which then stops granting AMQP link credit) instead of memory growing without bound.
//! It is `Send + Clone` and works from any async runtime.
//!
//! **Bounds and back-pressure.** Per core, at most [`QUEUE_BATCHES`] batches *and*
//! `--event-hub-queue-bytes` of messages (each charged [`IngestMessage::charge`]) wait. The
//! source slows down, nothing is dropped or conflated: a sender waits for room in count (the
//! channel) and in bytes (a semaphore of bytes, fair: first come, first served), and a batch
//! keeps its bytes' permit until the core has applied it. A batch charged more than the whole
//! bound is charged the bound (it goes alone). Why bytes too: link credit counts messages
//! only until they are handed over, and a batch may hold up to a whole credit of messages of
//! up to `maxMessageBytes` each: in count alone a core's queue could hold 64 × 300 × 1 MiB.

use std::rc::Rc;

use futures_util::task::AtomicWaker;

use crate::ingest::IngestMessage;
use crate::runtime::routing::core_of_device;
use crate::app::Core;

/// Batches waiting per core before senders are made to wait.
pub const QUEUE_BATCHES: usize = 64;

/// One core's bound in bytes: a semaphore of bytes (see the module documentation).
struct Room {
    bytes: std::sync::Arc<tokio::sync::Semaphore>,
    bound: u32,
}

impl Room {
    /// Waits until `charge` bytes (at most the bound) fit, and holds them.
    async fn take(&self, charge: usize) -> tokio::sync::OwnedSemaphorePermit {
        let n = charge.min(self.bound as usize) as u32;
        self.bytes.clone().acquire_many_owned(n).await.expect("the ingress semaphore is never closed")
    }

    /// Bytes held by batches waiting or being applied.
    fn held(&self) -> u64 {
        u64::from(self.bound).saturating_sub(self.bytes.available_permits() as u64)
    }
}

#[derive(Clone)]
pub struct Ingress {
    queues: Vec<async_channel::Sender<IngressBatch>>,
    /// Per core: its bound in bytes.
    rooms: Vec<std::sync::Arc<Room>>,
    /// Per core: the ingress task resting after a long turn (see [`serve`]), woken by the
    /// next batch sent to it.
    kicks: Vec<std::sync::Arc<AtomicWaker>>,
    /// With a durable store: the source's key prefix and the positions stored for it.
    source: Option<std::sync::Arc<SourcePositions>>,
}

/// One core's part of a source batch.
pub struct IngressBatch {
    pub messages: Vec<IngestMessage>,
    /// With a durable store: where these messages come from (see [`Ingress::send_marked`]).
    pub mark: Option<Mark>,
    /// The event stream partition they come from (`None`: a source without partitions).
    /// With several instances, a device's values are current only while this instance
    /// reads their partition (`shard::devices::Source`).
    pub partition: Option<std::sync::Arc<str>>,
    /// Its bytes in the core's bound, given back when the batch is dropped (applied).
    room: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// "Partition `key` is applied up to `upto`", and the sequence number of each message.
pub struct Mark {
    pub key: std::sync::Arc<str>,
    pub upto: i64,
    /// Parallel to the messages; [`NO_SEQUENCE`] for a message that carried none.
    pub seqs: Vec<i64>,
}

/// The sequence number of a message that carried none (Event Hubs numbers from 0). Such a
/// message cannot be told apart from a redelivery, so it is always applied: at least once,
/// where numbered messages are applied exactly once.
pub const NO_SEQUENCE: i64 = -1;

/// The durable store's view of the event source: marks are stored under `prefix + partition`
/// (the prefix names the event stream and consumer group, so another stream starts afresh).
pub struct SourcePositions {
    pub prefix: String,
    /// Partition → where it resumes (the lowest mark over the cores).
    pub resume: std::collections::HashMap<String, i64>,
}

/// One core's end of the ingress.
#[derive(Clone)]
pub struct IngressQueue {
    rx: async_channel::Receiver<IngressBatch>,
    kick: std::sync::Arc<AtomicWaker>,
    room: std::sync::Arc<Room>,
}

impl IngressQueue {
    /// Batches waiting.
    pub fn len(&self) -> usize {
        self.rx.len()
    }

    /// Bytes of the batches waiting or being applied (bounded by `--event-hub-queue-bytes`).
    pub fn bytes(&self) -> u64 {
        self.room.held()
    }

    /// No batch waiting.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// A waiting batch, without waiting (shutdown drains the queue with it).
    pub fn try_recv(&self) -> Option<IngressBatch> {
        self.rx.try_recv().ok()
    }
}

impl Ingress {
    /// One queue per core, each bounded by [`QUEUE_BATCHES`] and `bytes` (at least 1).
    pub fn new(cores: usize, bytes: u32) -> (Self, Vec<IngressQueue>) {
        let (mut senders, mut queues, mut kicks, mut rooms) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let bound = bytes.max(1);
        for _ in 0..cores {
            let (tx, rx) = async_channel::bounded(QUEUE_BATCHES);
            let kick = std::sync::Arc::new(AtomicWaker::new());
            let room = std::sync::Arc::new(Room { bytes: std::sync::Arc::new(tokio::sync::Semaphore::new(bound as usize)), bound });
            senders.push(tx);
            kicks.push(kick.clone());
            rooms.push(room.clone());
            queues.push(IngressQueue { rx, kick, room });
        }
        (Self { queues: senders, rooms, kicks, source: None }, queues)
    }

    /// Queues `batch` for `core`, waiting while its queue is full in count or in bytes;
    /// wakes its ingress task if it rests.
    async fn put(&self, core: usize, mut batch: IngressBatch) -> bool {
        let charge = batch.messages.iter().map(IngestMessage::charge).sum::<usize>();
        batch.room = Some(self.rooms[core].take(charge).await);
        let ok = self.queues[core].send(batch).await.is_ok();
        self.kicks[core].wake();
        ok
    }

    /// Turns on position marks (a durable store runs).
    pub fn with_source(mut self, source: SourcePositions) -> Self {
        self.source = Some(std::sync::Arc::new(source));
        self
    }

    /// Whether position marks are on (a durable store runs): the cores then record what
    /// they applied of each partition.
    pub fn has_source(&self) -> bool {
        self.source.is_some()
    }

    /// Partition → the sequence number its stored state was applied up to (empty without a store).
    pub fn stored_positions(&self) -> std::collections::HashMap<String, i64> {
        self.source.as_ref().map(|s| s.resume.clone()).unwrap_or_default()
    }

    /// Hands a batch of partition `partition` to the owning cores with its position: every
    /// core (also one that gets no message of it) records "applied up to `upto`" in the same
    /// commit as the state the messages produced, and skips messages at or below its own mark
    /// (after a restart the partition resumes at the lowest mark over the cores). `seqs` is
    /// parallel to `batch`. Without a store this is [`Ingress::send`], with the partition.
    pub async fn send_marked(&self, batch: Vec<IngestMessage>, seqs: Vec<i64>, partition: &str, upto: Option<i64>) -> bool {
        let (Some(source), Some(upto)) = (self.source.as_ref(), upto) else {
            return batch.is_empty() || self.send_from(batch, Some(partition.into())).await;
        };
        let from: std::sync::Arc<str> = partition.into();
        let key: std::sync::Arc<str> = format!("{}{partition}", source.prefix).into();
        let per_core = self.split_marked(batch, seqs);
        let mut ok = true;
        for (core, (messages, seqs)) in per_core.into_iter().enumerate() {
            let mark = Some(Mark { key: key.clone(), upto, seqs });
            ok &= self.put(core, IngressBatch { messages, mark, partition: Some(from.clone()), room: None }).await;
        }
        ok
    }

    /// Each core's share of a marked batch, each allocated once at its size (one core: the
    /// batch as it is). Pushed one by one into empty `Vec`s, every share grew 4, 8, … 256
    /// messages, copying them at each step: ~190 instructions per AMQP message and a
    /// reallocation every 7 (callgrind, issue 25 item 4), as `Core::split_by_core` was.
    fn split_marked(&self, batch: Vec<IngestMessage>, seqs: Vec<i64>) -> Vec<(Vec<IngestMessage>, Vec<i64>)> {
        let cores = self.cores();
        if cores == 1 {
            return vec![(batch, seqs)];
        }
        let owners: Vec<u32> = batch.iter().map(|m| self.core_of(&m.device_id) as u32).collect();
        let mut counts = vec![0usize; cores];
        for &c in &owners {
            counts[c as usize] += 1;
        }
        let mut per_core: Vec<(Vec<IngestMessage>, Vec<i64>)> =
            counts.iter().map(|&n| (Vec::with_capacity(n), Vec::with_capacity(n))).collect();
        for ((msg, seq), c) in batch.into_iter().zip(seqs).zip(owners) {
            let part = &mut per_core[c as usize];
            part.0.push(msg);
            part.1.push(seq);
        }
        per_core
    }

    pub fn cores(&self) -> usize {
        self.queues.len()
    }

    /// The core that owns `device_id`.
    pub fn core_of(&self, device_id: &str) -> usize {
        core_of_device(device_id, self.cores())
    }

    /// Hands a batch to one core (every message must belong to it); waits while it is full.
    pub async fn send_to_core(&self, core: usize, batch: Vec<IngestMessage>) -> bool {
        self.put(core, IngressBatch { messages: batch, mark: None, partition: None, room: None }).await
    }

    /// Routes a batch to the owning cores; waits while any of them is full.
    pub async fn send(&self, batch: Vec<IngestMessage>) -> bool {
        self.send_from(batch, None).await
    }

    /// [`Ingress::send`] of messages of one event stream partition (`None`: none).
    async fn send_from(&self, batch: Vec<IngestMessage>, partition: Option<std::sync::Arc<str>>) -> bool {
        if self.cores() == 1 {
            return self.put(0, IngressBatch { messages: batch, mark: None, partition, room: None }).await;
        }
        let share = batch.len() / self.cores() + 8;
        let mut per_core: Vec<Vec<IngestMessage>> = (0..self.cores()).map(|_| Vec::with_capacity(share)).collect();
        for msg in batch {
            per_core[self.core_of(&msg.device_id)].push(msg);
        }
        let mut ok = true;
        for (core, messages) in per_core.into_iter().enumerate() {
            if !messages.is_empty() {
                ok &= self.put(core, IngressBatch { messages, mark: None, partition: partition.clone(), room: None }).await;
            }
        }
        ok
    }
}

/// Longest the core applies ingress batches without resting (see [`serve`]).
pub const INGRESS_TURN: std::time::Duration = std::time::Duration::from_millis(20);
/// Longest rest: a timer (the driver's granularity), in case no batch comes.
const INGRESS_REST: std::time::Duration = std::time::Duration::from_millis(1);

/// Drains this core's ingress queue.
///
/// **Fairness.** While the source keeps the queue non-empty (an AMQP consumer faster than the
/// core), `recv` never waits, and without more this task would run alone: the core's sockets
/// and every wake-up from another thread would wait until the queue ran dry (measured: HTTP
/// requests unanswered for over 10 s while the served AMQP links saturated a pinned core).
/// So after each batch it yields (monoio then runs the other ready tasks and reaps I/O
/// completions), and after [`INGRESS_TURN`] of back-to-back batches it rests: it waits to be
/// woken from another thread, by the next batch sent to it (or a 1 ms timer,
/// [`INGRESS_REST`]). Its ready queue empty, monoio parks and takes in every wake-up from
/// other threads (cross-core messages, replies), then the next batch's wake-up resumes it:
/// a rest costs a park and a cross-thread wake-up, once per turn, and a cross-thread wake-up
/// waits at most a turn (20 ms) while the core is saturated by ingress.
pub async fn serve(core: Rc<Core>, queue: IngressQueue) {
    // While this core's cross-core backlog is over its bound, batches stay in the queue;
    // once it is full `Ingress::send` waits, and so does the AMQP link's credit.
    drain(&queue, || core.mesh.wait_for_room(), |batch| apply(&core, batch)).await
}

/// [`serve`]'s loop and its fairness, apart from what a batch does.
async fn drain<W: std::future::Future<Output = ()>>(queue: &IngressQueue, mut room: impl FnMut() -> W, mut apply: impl FnMut(IngressBatch)) {
    let mut busy_since: Option<std::time::Instant> = None;
    while let Ok(batch) = queue.rx.recv().await {
        room().await;
        apply(batch);
        if queue.rx.is_empty() {
            // The next recv waits: the core parks.
            busy_since = None;
            continue;
        }
        let now = std::time::Instant::now();
        if now.duration_since(*busy_since.get_or_insert(now)) >= INGRESS_TURN {
            rest(&queue.kick).await;
            busy_since = None;
        } else {
            yield_now().await;
        }
    }
}

/// Waits for the first wake-up after this: `kick` (the next batch sent), or the timer.
async fn rest(kick: &AtomicWaker) {
    let mut timer = std::pin::pin!(monoio::time::sleep(INGRESS_REST));
    let mut waited = false;
    std::future::poll_fn(|cx| {
        if waited {
            return std::task::Poll::Ready(());
        }
        waited = true;
        kick.register(cx.waker());
        std::future::Future::poll(timer.as_mut(), cx)
    })
    .await
}

/// Returns to the runtime once, ready to run again at once.
async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await
}

/// Applies one batch from the ingress queue (with its position mark, if any).
pub fn apply(core: &Rc<Core>, batch: IngressBatch) {
    let partition = batch.partition.as_deref();
    match batch.mark {
        None => core.ingest_from(batch.messages, partition),
        Some(mark) => core.ingest_marked(batch.messages, mark, partition),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A core whose ingress queue a faster source keeps full still takes in a wake-up from
    /// another thread (what cross-core messages and replies are) while the flood goes on.
    #[test]
    fn a_flooded_core_still_takes_wake_ups_from_other_threads() {
        let (ingress, mut queues) = Ingress::new(1, 1 << 20);
        let queue = queues.pop().unwrap();
        let flooding = Arc::new(AtomicBool::new(true));
        let sent = Arc::new(AtomicUsize::new(0));
        // The source: empty batches as fast as the queue takes them, for at most 5 s.
        let source = {
            let (flooding, sent) = (flooding.clone(), sent.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
                rt.block_on(async {
                    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
                    let wait = std::time::Duration::from_millis(50);
                    while std::time::Instant::now() < end && flooding.load(Ordering::SeqCst) {
                        // Bounded: once the test is done nothing drains the queue.
                        if tokio::time::timeout(wait, ingress.send_to_core(0, Vec::new())).await.is_ok() {
                            sent.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    flooding.store(false, Ordering::SeqCst);
                });
            })
        };
        // Another thread wakes a task of the core once the flood is on (the queue filled).
        let (tx, rx) = futures_channel::oneshot::channel::<()>();
        let prober = {
            let sent = sent.clone();
            std::thread::spawn(move || {
                while sent.load(Ordering::SeqCst) < 4 * QUEUE_BATCHES {
                    std::thread::yield_now();
                }
                let _ = tx.send(());
            })
        };
        let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new().enable_timer().build().unwrap();
        let seen_while_flooding = rt.block_on(async {
            // The core is slower than the source (even unoptimized): 200 µs per batch.
            let apply = |_batch: IngressBatch| {
                let t = std::time::Instant::now();
                while t.elapsed() < std::time::Duration::from_micros(200) {
                    std::hint::spin_loop();
                }
            };
            let drainer = monoio::spawn(async move { drain(&queue, || async {}, apply).await });
            rx.await.unwrap();
            let during = flooding.load(Ordering::SeqCst);
            flooding.store(false, Ordering::SeqCst);
            drop(drainer);
            during
        });
        source.join().unwrap();
        prober.join().unwrap();
        assert!(seen_while_flooding, "the wake-up was taken in only once the flood stopped");
    }
}
