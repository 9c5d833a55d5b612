//! Durable state: the seam between a core's shard and a storage engine.
//!
//! The shard knows nothing of engines. It marks what changed (devices, access entries,
//! sessions); after each unit of work the core hands the new states to its [`StateStore`]
//! as [`Change`]s and commits them, together with the source position that produced them,
//! as one atomic unit. Every core has its own store: no lock is shared between cores on the
//! message path. The one engine is [`log::LogStore`], per-core append logs with snapshots
//! in `--data-dir`. Redis (`--redis-url`, `src/cluster`) does not implement this trait: it
//! shares sessions between instances as an engine of the session directory
//! (`app::directory::Directory`), beside the store, and keeps its session keys in the
//! encoding of [`format`].
//!
//! At start [`open`] takes the data dir (one owner: an `flock` on `LOCK`), reads every
//! core's snapshot and log, and re-shards by the routing hash when `--cores` changed.

pub mod format;
pub mod log;

use std::io;
use std::path::Path;
use std::time::Duration;

use hashbrown::HashMap;

use crate::ingest::JsonText;
use crate::shard::devices::Device;

pub use format::{DeviceData, Record};
pub use crate::shard::change::{Change, Loaded};
pub use crate::config::DataDir;

/// A core's durable state engine. Called only from the core's own thread.
pub trait StateStore {
    /// Adds a change to the unit being built.
    fn put(&mut self, change: Change<'_>);
    /// Makes every change put since the last commit durable as one unit: after any crash
    /// either all of them are found again or none. With the log engine the unit is written
    /// to the OS before this returns (it survives a crash of the process) and reaches the
    /// disk within the fsync interval.
    fn commit(&mut self);
    /// Whether the core should write a full snapshot now ([`StateStore::begin_snapshot`]).
    fn snapshot_due(&self) -> bool;
    /// Starts a snapshot: changes committed from now on are kept apart from the older ones.
    fn begin_snapshot(&mut self);
    /// Adds one piece of the whole state to the snapshot being built.
    fn put_snapshot(&mut self, change: Change<'_>);
    /// How many devices the snapshot being built holds (a hint for the reader's table size).
    fn snapshot_devices(&mut self, _devices: usize) {}
    /// The snapshot holds the whole state: write it out (off the core) and drop what it replaces.
    /// A snapshot may be built over many turns of the core (src/app/durable.rs), its
    /// pieces read at different times: every change committed after
    /// [`StateStore::begin_snapshot`] is in the log after it, and replaying those whole-state
    /// records over the snapshot gives the latest state. So the engine makes that log durable
    /// before the snapshot replaces anything.
    fn end_snapshot(&mut self);
    /// Drops the snapshot being built (shutdown while one is built): nothing is replaced.
    fn abort_snapshot(&mut self);
    /// Writes out everything committed and waits until it is on disk (fsync). For shutdown.
    fn flush(&mut self) -> io::Result<()>;
    /// [`StateStore::flush`], then release the files; later commits are dropped.
    fn close(&mut self) -> io::Result<()>;
}

impl Loaded {
    /// Applies one record read back from disk (the newest record of a key wins).
    pub fn apply(&mut self, record: Record) {
        match record {
            Record::Device(id, Some(d)) => {
                let mut device = device_from_owned(d);
                if device.heard_at_start(*self.heard.get_or_insert_with(std::time::Instant::now)) {
                    self.connected.push(id.clone());
                }
                self.devices.insert(id.into(), device);
            }
            Record::Device(id, None) => {
                self.devices.remove(&*id);
            }
            Record::Access(device, session, Some(a)) => {
                self.access.insert((device, session), a);
            }
            Record::Access(device, session, None) => {
                self.access.remove(&(device, session));
            }
            Record::Session(id, Some(devices)) => {
                self.sessions.insert(id, devices);
            }
            Record::Session(id, None) => {
                self.sessions.remove(&id);
            }
            Record::Applied(key, seq) => {
                let mark = self.applied.entry(key).or_insert(seq);
                *mark = (*mark).max(seq);
            }
            Record::Stream(id, Some(r)) => {
                self.stream_held.insert(id, crate::push::stream::stored_bytes(&r));
                self.streams.insert(id, r);
            }
            Record::Stream(id, None) => {
                self.streams.remove(&id);
                self.stream_held.remove(&id);
            }
            Record::StreamAppend(at, sessions) => {
                for (id, epoch, first, frames) in sessions {
                    // Appends of another epoch than the stream held (an older incarnation,
                    // or one whose base record is gone) have nothing to continue.
                    let Some(r) = self.streams.get_mut(&id).filter(|r| r.epoch == epoch) else { continue };
                    let held = self.stream_held.entry(id).or_default();
                    crate::push::stream::apply_append(r, first, at, &frames, self.stream_cap, held);
                }
            }
            Record::StreamPids(id, pids) => {
                if let Some(r) = self.streams.get_mut(&id) {
                    r.pids = pids;
                }
            }
            Record::Posted(to, n) => {
                let mark = self.posted.entry(to).or_insert(n);
                *mark = (*mark).max(n);
            }
            Record::Received(n) => self.received = self.received.max(n),
            // Read by the start's check of the logs' order (src/store/log.rs), no state.
            Record::End | Record::LogStart(..) => {}
        }
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.access.is_empty() && self.sessions.is_empty() && self.applied.is_empty() && self.streams.is_empty() && self.posted.is_empty() && self.received == 0
    }
}

/// A device's stored data, keys in order (tests compare what was read back).
pub fn data_of_device(d: &Device) -> DeviceData {
    let mut telemetry: Vec<_> = d.telemetry.iter().map(|(k, v, at)| (Box::<str>::from(k), JsonText::new(v), at)).collect();
    telemetry.sort_by(|a, b| a.0.cmp(&b.0));
    DeviceData {
        telemetry,
        twin: d.twin.as_ref().map(|t| (t.doc.to_string(), t.at)),
        connection: d.connection.as_ref().map(|c| (c.connected, c.at, c.sequence.clone())),
        mark: d.mark.key(),
    }
}

/// A device rebuilt from its stored data (keys and texts copied into its [`Telemetry`](crate::shard::devices::Telemetry)).
pub fn device_from_owned(d: DeviceData) -> crate::shard::devices::Device {
    use crate::shard::devices::{ConnectionState, Device, Twin};
    let mut device = Device::default();
    device.telemetry = d.telemetry.iter().map(|(k, json, at)| (k, json, *at)).collect();
    if let Some((doc, at)) = d.twin {
        if let Ok(doc) = serde_json::from_str(&doc) {
            device.twin = Some(Twin { doc, at });
        }
    }
    if let Some((connected, at, sequence)) = d.connection {
        device.connection = Some(ConnectionState { connected, at, sequence });
    }
    device.mark = crate::ingest::ReadMark::from_key(d.mark);
    device
}


/// The stores of every core, and what they held.
pub struct Opened {
    pub stores: Vec<Box<dyn StateStore + Send>>,
    pub loaded: Vec<Loaded>,
}

impl Opened {
    /// Where each source partition resumes: the lowest mark over the cores (a core that is
    /// further on skips what it has applied already). A partition some core has no mark for
    /// is left out: it starts at the start position, and the cores that hold a mark skip.
    pub fn resume_positions(&self) -> HashMap<Box<str>, i64> {
        resume_positions(&self.loaded)
    }
}

pub fn resume_positions(loaded: &[Loaded]) -> HashMap<Box<str>, i64> {
    let mut out: HashMap<Box<str>, i64> = HashMap::new();
    let Some(first) = loaded.first() else { return out };
    'keys: for (key, &seq) in &first.applied {
        let mut min = seq;
        for l in &loaded[1..] {
            match l.applied.get(key) {
                Some(&s) => min = min.min(s),
                None => continue 'keys,
            }
        }
        out.insert(key.clone(), min);
    }
    out
}

/// How the store writes (`--fsync-interval`, `--snapshot-log-bytes`).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Between syncs of the logs to disk (zero: every commit).
    pub fsync_interval: Duration,
    /// A core writes a snapshot once its log has grown past this and past twice its last
    /// snapshot ([`log::SNAPSHOT_MIN_LOG`] by default).
    pub snapshot_log_bytes: u64,
    /// `--store-start-damaged`: start on damaged store files (kept aside, the loss logged and
    /// counted) instead of refusing to.
    pub start_damaged: bool,
    /// Charged bytes of a recovery stream kept while its appends are read back
    /// (`--recovery-session-bytes`; 0: no bound).
    pub stream_bytes: usize,
}

impl Options {
    pub fn new(fsync_interval: Duration) -> Self {
        Self { fsync_interval, snapshot_log_bytes: log::SNAPSHOT_MIN_LOG, start_damaged: false, stream_bytes: 0 }
    }
}

/// Opens `dir` for `cores` cores: takes the lock, loads, re-shards if needed.
pub fn open(dir: &Path, cores: usize, options: Options) -> Result<Opened, String> {
    log::open(dir, cores, options)
}

pub use log::DirLock;

/// Takes `dir`'s lock (creating it if needed) without loading anything: start-up takes it
/// before the port, so that a port still held after a `kill -9` of the previous owner of this
/// data dir can be waited for (src/owner.rs).
pub fn lock(dir: &Path) -> Result<DirLock, String> {
    log::lock_dir(dir)
}

/// [`open`] with the lock already taken by [`lock`].
pub fn open_locked(dir: &Path, lock: DirLock, cores: usize, options: Options) -> Result<Opened, String> {
    log::open_locked(dir, lock, cores, options)
}
