//! What the shard hands a durable store, and what it gets back at start: the vocabulary of
//! the seam to `src/store` (the engines), kept here so that the shard names only its own
//! types. The shard marks what changed; after each unit of work its core turns the marks into
//! [`Change`]s (`DeviceTable::drain_dirty`, `SessionTable::drain_dirty`) and the store
//! commits them. At start a store reads back one [`Loaded`] per core
//! (`DeviceTable::restore`, `SessionTable::restore`).

use hashbrown::HashMap;

use crate::ids::SessionId;
use crate::push::stream::{AppendBatch, StoredPid, StoredRecovery};
use crate::shard::access::{Access, Grants, Subscriptions};
use crate::shard::devices::{Device, DeviceId};

/// One change of durable state, borrowed from the shard that made it.
pub enum Change<'a> {
    /// A device's data (last values, twin, connection state); `None`: the device has none.
    Device { id: &'a str, device: Option<&'a Device> },
    /// One session's grants and subscriptions on one device; `None`: nothing left.
    Access { device: &'a str, session: SessionId, access: Option<&'a Access> },
    /// A session and the devices it has held grants on; `None`: the session is gone.
    Session { id: SessionId, devices: Option<&'a crate::shard::sessions::DeviceSet> },
    /// Every event of the source partition `key` up to sequence number `seq` is applied.
    Applied { key: &'a str, seq: i64 },
    /// A session's recovery stream and pids, written by a graceful shutdown and loaded back
    /// at the next start; `None`: gone (the start that loaded it writes this, so a later
    /// crash never brings back a stream that went on without being written).
    Stream { id: SessionId, recovery: Option<&'a StoredRecovery> },
    /// Frames a delivery batch appended to streams (docs/design/recovery.md step 7a).
    StreamAppend(&'a AppendBatch),
    /// A session's pids (a connected one with `away_ms` `i64::MIN`: away since the start
    /// that reads it back).
    StreamPids { id: SessionId, pids: &'a [StoredPid] },
    /// Deliveries this core has posted to core `to`, in all, committed before they leave.
    Posted { to: usize, n: u64 },
    /// Deliveries this core has taken in, in all, committed with their appends.
    Received { n: u64 },
}

/// One core's state as read back at start. Devices are rebuilt as the shard's own [`Device`]s
/// by the loader threads (one per core, in parallel), so the core adopts the whole map at once
/// instead of building a second one (start-up with 1,000,000 devices, issue 11).
#[derive(Default)]
pub struct Loaded {
    pub devices: HashMap<DeviceId, Device>,
    pub access: HashMap<(Box<str>, SessionId), (Grants, Subscriptions)>,
    pub sessions: HashMap<SessionId, Vec<Box<str>>>,
    /// Source partition → the highest sequence number this core has applied.
    pub applied: HashMap<Box<str>, i64>,
    /// Sessions' recovery streams a graceful shutdown wrote (docs/design/recovery.md step 5).
    pub streams: HashMap<SessionId, StoredRecovery>,
    /// Core → deliveries this core posted to it, in all (design step 7e).
    pub posted: HashMap<u32, u64>,
    /// Deliveries this core took in, in all.
    pub received: u64,
    /// The start changed `received` (the crash rule): it is to be committed again.
    pub received_reset: bool,
    /// Charged bytes kept per stream while appends are applied (`--recovery-session-bytes`;
    /// 0: no bound), and what each stream holds.
    pub stream_cap: usize,
    pub stream_held: HashMap<SessionId, usize>,
    /// When the devices were read back: a device with a connection state counts as heard from
    /// then (its connection-state TTL starts again).
    pub heard: Option<std::time::Instant>,
    /// Connected devices read back, for the core to arm their off-line checks (a device may be
    /// listed while a later record disconnected it: the checks are checked when due).
    pub connected: Vec<Box<str>>,
}
