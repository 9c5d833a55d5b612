//! The seams between a core and what runs beside it: [`Relay`], the link to the other
//! instances of a deployment (Redis scale-out, `src/cluster`), and [`CorePlugin`], something
//! started on every core's own thread (the cluster, the simulated fleet). The application
//! knows only these two traits; without `--redis-url` nothing implements [`Relay`] and no
//! core pays for it.

use std::rc::Rc;
use std::sync::Arc;

use crate::ids::SessionId;
use crate::ingest::IngestMessage;
use crate::shard::devices::{Decided, Kept};
use crate::app::Core;

/// A core's link to the other instances, installed by a [`CorePlugin`] at start.
pub trait Relay {
    /// A device message from a source of this instance, about to be applied on this, its
    /// device's, core: the relay sends it on if another instance watches the device.
    fn offer(&self, msg: &IngestMessage);
    /// A device message applied on this, its device's, core (`here`: from a source of this
    /// instance; else published here by another): kept in the device's ring while another
    /// instance may need it rebuilt here (design step 10, `cluster/ring.rs`), with what was
    /// decided for it (`decided`, called only when it is kept: a twin change's is the whole
    /// twin's text) and `now`, the batch's clock (the one its throttling saw).
    fn ring(&self, _msg: &IngestMessage, _here: bool, _now: std::time::Instant, _decided: &dyn Fn() -> Decided) {}
    /// Design step 11, on a device's core: the messages of `device` its ring holds after the
    /// client's cut (`cut`: the key hash of its last frame of the device; `None`: it had none),
    /// oldest first; or why they cannot be given.
    fn ring_after(&self, _device: &str, _cut: Option<u32>) -> Result<Vec<Kept>, RingMiss> {
        Err(RingMiss::Lost("no rings".into()))
    }
    /// Design step 11 with throttling, on a device's core: the messages of `device` its ring
    /// holds from the latest quiet point (`quiet` or more after the one before) through the
    /// client's cut, and whether they start at one (`cluster::ring::Rings::lead`).
    fn ring_lead(&self, _device: &str, _cut: u32, _quiet: std::time::Duration) -> Option<(Vec<Kept>, bool)> {
        None
    }
    /// Design step 11 with other live instances, on a device's core of the instance
    /// rebuilding `session` (its core `reply_core`): after this core's watch changes are with
    /// the link (so every instance publishes the devices here before it reads its rings), ask
    /// every other instance for what its rings hold of `devices` after their cuts. Their
    /// answers come back to this core (`Core::rings_remote`). False when it cannot be sent.
    fn rings_ask(&self, _session: SessionId, _reply_core: usize, _devices: &[(Arc<str>, Option<u32>)]) -> bool {
        false
    }
    /// Design step 11: for each other instance, how long ago (ms) it last renewed its
    /// presence (`None`: its presence went); `None` when it cannot be asked.
    fn peers_staleness(&self) -> Option<futures_channel::oneshot::Receiver<Staleness>> {
        None
    }
    /// How often every instance renews its presence.
    fn heartbeat(&self) -> std::time::Duration {
        std::time::Duration::from_secs(2)
    }
    /// The end of a burst of [`Relay::offer`]s: hand what was offered over.
    fn flush(&self);
    /// Devices this instance started (`true`) or stopped watching: a session with a socket
    /// here subscribes to them (`DeviceTable::take_watch_changes`).
    fn watch(&self, changes: Vec<(Box<str>, bool)>);
    /// Whether this instance reads event stream partition `partition` now (holds its
    /// lease): values ingested from a partition read elsewhere are not current.
    fn reads_partition(&self, partition: &str) -> bool;
    /// SIGTERM (design step 6, adoption): hand `session`'s recovery history (`blob`: the
    /// store's `Change::Stream` record) to another live instance (`to`, or one chosen by the
    /// session id), its pids valid for `left` more; `devices` are the session's. False when it is not sent (no live peer, past a
    /// bound): the history stays here.
    fn adopt(&self, _session: SessionId, _devices: Vec<Box<str>>, _blob: Vec<u8>, _left: std::time::Duration, _to: Option<&str>) -> bool {
        false
    }
    /// A client came back here with a pid of `session` this instance does not know (design
    /// step 6b): ask the instance `P:stream:<session>` names to hand the history over. The
    /// answer comes as an adoption, or as a verdict of nothing ([`Core::adoption_verdict`]).
    fn take(&self, _session: SessionId) {}
    /// Asked for `session`'s history by instance `to`, this instance gives none.
    fn give_none(&self, _session: SessionId, _to: &str) {}
    /// The verdict on a history handed over ([`Relay::adopt`]): `kept` when nothing was
    /// delivered to it here after it was written (`Core::adoption_marked`).
    fn adopt_verdict(&self, _session: SessionId, _kept: bool, _tail: Option<Vec<u8>>) {}
    /// On the adopting instance: this core's watch changes for an adopted `session` are with
    /// the link (one of `cores` such reports; 0: the history was not taken).
    fn adopt_watching(&self, _session: SessionId, _cores: usize) {}
}

/// For each other instance, how long ago (ms) it last renewed its presence (`None`: its
/// presence went), or why the probe failed ([`Relay::peers_staleness`]).
pub type Staleness = Result<Vec<(Box<str>, Option<i64>)>, String>;

/// Why a ring cannot give what followed a client's cut of a device (design step 11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingMiss {
    /// The cut is not among the messages held: fine from an instance that is not where the
    /// device is taken in (a replica that began later, or never had it) when another holder
    /// has it; `origin` when this ring holds messages taken in on this instance (its cut
    /// should be here: the rebuild is refused).
    NotHeld { origin: bool },
    /// Anything else (`ring::Lost`): the rebuild is refused.
    Lost(String),
}

/// Something that runs beside every core, started on the core's own thread before it serves.
pub trait CorePlugin: Send + Sync {
    fn start(self: Arc<Self>, core: &Rc<Core>);
}
