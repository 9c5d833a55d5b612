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

use std::rc::Rc;
use std::time::Instant;

use crate::ingest::IngestMessage;
use crate::app::ingress::{Mark, NO_SEQUENCE};
use crate::app::Core;
use crate::store::{Change, Loaded, StateStore};

impl Core {
    /// Gives the core its store and the state read back for it (before it serves anything).
    pub fn attach_store(&self, store: Box<dyn StateStore + Send>, mut loaded: Loaded) {
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
        if store.snapshot_due() {
            self.snapshot(store.as_mut());
        }
    }

    /// Writes the whole shard as a snapshot (encoded here, written by a helper thread).
    fn snapshot(&self, store: &mut dyn StateStore) {
        let started = Instant::now();
        store.begin_snapshot();
        let mut put = |c: Change<'_>| store.put_snapshot(c);
        self.devices.borrow().for_each_state(&mut put);
        self.sessions.borrow().for_each_state(&mut put);
        for (key, seq) in self.applied.borrow().iter() {
            put(Change::Applied { key, seq: *seq });
        }
        store.end_snapshot();
        tracing::debug!(core = self.index, ms = started.elapsed().as_millis() as u64, "store snapshot encoded");
    }

    /// Applies a batch of one source partition exactly once (see the module docs).
    pub fn ingest_marked(self: &Rc<Self>, batch: Vec<IngestMessage>, mark: Mark) {
        let done = self.applied.borrow().get(&*mark.key).copied();
        let batch: Vec<IngestMessage> = match done {
            Some(done) => batch.into_iter().zip(&mark.seqs).filter(|(_, &seq)| seq == NO_SEQUENCE || seq > done).map(|(m, _)| m).collect(),
            None => batch,
        };
        let upto = done.map_or(mark.upto, |d| d.max(mark.upto));
        let deliveries = self.apply_ingest(batch);
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
