//! A core and its durable store: restore at start, one commit per unit of work, the AMQP
//! position marks, snapshots, and the flush a shutdown calls.
//!
//! **When is a change durable?** Each unit of work (an ingest batch, a batch of device
//! operations, a session operation, a timer tick that changed something) is committed before
//! the core moves on: a `POST /ingest` or REST answer is sent after the commit, so whatever
//! was answered survives `kill -9`; it reaches the disk within `--fsync-interval`.
//!
//! **Exactly-once effect for a source partition.** A marked batch ([`Mark`]) carries the
//! partition's highest sequence number; the core applies the messages above its own mark,
//! raises the mark, and commits the state and the mark together. At start the partition
//! resumes at the lowest mark over the cores, and every core skips what it applied already.
//!
//! **Snapshots without a long pause.** When the store asks for a snapshot, the commit that
//! noticed it marks the snapshot point ([`StateStore::begin_snapshot`]: later commits go to a
//! new log) and wakes this core's snapshot task, which writes `--snapshot-slice-devices`
//! devices per turn and yields between turns, so messages, requests and deliveries are served
//! while a large shard is written. A device changed after its slice was written is written
//! again by its commit, in the log after the snapshot point; records are whole states, so
//! replaying that log over the snapshot gives the latest state, each change once. Sessions
//! and source positions are written in the last slice, so the snapshot's marks cover every
//! state in it. The longest slice is in the "store snapshot encoded" log line (`longest_slice_us`);
//! `hubcast_store_snapshot_slow_slices_total` counts slices over 10 ms.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::ingest::IngestMessage;
use crate::app::ingress::{Mark, NO_SEQUENCE};
use crate::app::Core;
use crate::shard::devices::SnapshotWalk;
use crate::store::{Change, Loaded, StateStore};

/// A core's snapshot being written a slice at a time ([`Core::write_snapshots`]).
#[derive(Default)]
pub struct SnapshotRun {
    /// A snapshot point was taken; the walk starts at the task's next turn.
    begun: Cell<Option<Instant>>,
    walk: RefCell<Option<SnapshotWalk>>,
    slices: Cell<u64>,
    longest: Cell<Duration>,
    /// Commits made while the snapshot was written (they land in the log after its point).
    commits: Cell<u64>,
    /// The first turn: noting which devices to write.
    walk_took: Cell<Duration>,
    waker: Cell<Option<Waker>>,
}

impl SnapshotRun {
    fn running(&self) -> bool {
        self.begun.get().is_some()
    }
}

/// The snapshot task's rest between slices. Not a plain yield: monoio takes in wake-ups
/// from other threads (the mesh, the AMQP thread) only when its ready queue is empty and it
/// parks, so a task that re-queues itself would hold off every cross-core message until the
/// snapshot is done (measured: no commit at all during a 0.8 s snapshot). A timer empties the
/// queue; the driver's granularity is 1 ms.
const SLICE_REST: Duration = Duration::from_millis(1);

impl Core {
    /// Gives the core its store and the state read back for it (before it serves anything).
    pub fn attach_store(self: &Rc<Self>, store: Box<dyn StateStore + Send>, mut loaded: Loaded) {
        let now = Instant::now();
        {
            let mut devices = self.devices.borrow_mut();
            devices.restore(&mut loaded, now);
            devices.dirty.on = true;
        }
        {
            let mut sessions = self.sessions.borrow_mut();
            sessions.restore(loaded.sessions.drain(), now);
            sessions.dirty.on = true;
        }
        *self.applied.borrow_mut() = loaded.applied.drain().collect();
        *self.store.borrow_mut() = Some(store);
        self.recovery.durable.set(self.recovery.window.is_some() && self.settings.config.recovery_durable);
        let received = loaded.received_reset.then_some(loaded.received);
        self.restore_recovery(std::mem::take(&mut loaded.streams), &loaded.posted, loaded.received, received);
        monoio::spawn(self.clone().write_snapshots());
        tracing::debug!(core = self.index, ms = now.elapsed().as_millis() as u64, "stored state restored");
    }

    /// Commits what changed since the last commit (and a source mark) as one unit.
    pub fn persist(&self, applied: Option<(&str, i64)>) {
        let mut store = self.store.borrow_mut();
        let Some(store) = store.as_mut() else { return };
        let mut put = |c: Change<'_>| store.put(c);
        self.devices.borrow_mut().drain_dirty(&mut put);
        self.sessions.borrow_mut().drain_dirty(&mut put);
        if let Some((key, seq)) = applied {
            put(Change::Applied { key, seq });
        }
        store.commit();
        let run = &self.snapshot;
        if run.running() {
            run.commits.set(run.commits.get() + 1);
        } else if store.snapshot_due() {
            // The snapshot point: what is committed from here on goes to a new log.
            store.begin_snapshot();
            run.begun.set(Some(Instant::now()));
            if let Some(waker) = run.waker.take() {
                waker.wake();
            }
        }
    }

    /// This core's snapshot task: sleeps until a snapshot point is taken ([`Core::persist`]),
    /// then writes the shard a slice per turn (see the module docs).
    async fn write_snapshots(self: Rc<Self>) {
        loop {
            poll_fn(|cx| {
                if self.snapshot.running() {
                    return Poll::Ready(());
                }
                self.snapshot.waker.set(Some(cx.waker().clone()));
                Poll::Pending
            })
            .await;
            while !self.snapshot_slice() {
                monoio::time::sleep(SLICE_REST).await;
            }
        }
    }

    /// Writes the next slice of the snapshot being built; returns whether it is done (or
    /// abandoned: the store was closed meanwhile).
    fn snapshot_slice(&self) -> bool {
        let started = Instant::now();
        let run = &self.snapshot;
        let mut store = self.store.borrow_mut();
        let mut walk = run.walk.borrow_mut();
        let Some(store) = store.as_mut() else {
            *walk = None;
            run.begun.set(None);
            return true;
        };
        let done = match walk.as_mut() {
            // The first turn only notes which devices to write.
            None => {
                let w = self.devices.borrow().snapshot_walk();
                store.snapshot_devices(w.remaining());
                *walk = Some(w);
                run.walk_took.set(started.elapsed());
                false
            }
            Some(w) => {
                let mut put = |c: Change<'_>| store.put_snapshot(c);
                let max = self.settings.config.snapshot_slice_devices as usize;
                let done = self.devices.borrow().snapshot_slice(w, max, &mut put);
                if done {
                    self.sessions.borrow().for_each_state(&mut put);
                    self.recovery_snapshot(&mut put);
                    for (key, seq) in self.applied.borrow().iter() {
                        put(Change::Applied { key, seq: *seq });
                    }
                    store.end_snapshot();
                }
                done
            }
        };
        let took = started.elapsed();
        run.slices.set(run.slices.get() + 1);
        run.longest.set(run.longest.get().max(took));
        crate::store::log::STATS.snapshot_slice(took);
        if done {
            let begun = run.begun.take().map_or(Duration::ZERO, |b| b.elapsed());
            tracing::debug!(
                core = self.index,
                ms = begun.as_millis() as u64,
                slices = run.slices.take(),
                longest_slice_us = run.longest.take().as_micros() as u64,
                walk_us = run.walk_took.take().as_micros() as u64,
                commits_during = run.commits.take(),
                "store snapshot encoded"
            );
            *walk = None;
        }
        done
    }

    /// Applies a batch of one source partition exactly once (see the module docs).
    pub fn ingest_marked(self: &Rc<Self>, batch: Vec<IngestMessage>, mark: Mark, partition: Option<&str>) {
        let done = self.applied.borrow().get(&*mark.key).copied();
        let batch: Vec<IngestMessage> = match done {
            Some(done) => batch.into_iter().zip(&mark.seqs).filter(|(_, &seq)| seq == NO_SEQUENCE || seq > done).map(|(m, _)| m).collect(),
            None => batch,
        };
        let upto = done.map_or(mark.upto, |d| d.max(mark.upto));
        let deliveries = self.apply_ingest(batch, partition);
        self.recovery_posting(&deliveries);
        if done != Some(upto) {
            self.applied.borrow_mut().insert(mark.key.as_ref().into(), upto);
            self.persist(Some((&mark.key, upto)));
        } else {
            self.persist(None);
        }
        self.dispatch(deliveries);
    }

    /// Commits and syncs this core's store to disk (for a graceful shutdown). Without a
    /// store: nothing to do.
    pub fn flush_store(&self) -> std::io::Result<()> {
        self.persist(None);
        match self.store.borrow_mut().as_mut() {
            Some(store) => {
                store.flush()?;
                tracing::info!(core = self.index, "durable state synced to disk");
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// [`Core::flush_store`], then closes the store: later changes stay in memory only.
    pub fn close_store(&self) -> std::io::Result<()> {
        self.persist(None);
        let mut store = self.store.borrow_mut();
        let r = match store.as_mut() {
            Some(s) => s.close(),
            None => Ok(()),
        };
        *store = None;
        self.devices.borrow_mut().dirty.on = false;
        self.sessions.borrow_mut().dirty.on = false;
        r
    }
}
