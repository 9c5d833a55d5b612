//! The devices a core owns: last values, twin, connection state, and per-session access.
//!
//! The table and its operations are here; the data path is split by concern: [`ingest`]
//! (a message applied to its device), [`fanout`] (who gets what, throttling, the
//! connection-state TTL), [`twin`] (whole twins with an IoT Hub), `durable` (what changed,
//! for the store).
//!
//! Telemetry values are kept as their JSON text, so answering a read or building a push frame
//! is concatenation, never re-serialisation. With an IoT Hub, a twin kept here is always whole;
//! changes that find none wait for a hub read ([`PendingTwin`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use serde_json::Value;
use smallvec::SmallVec;

use crate::ids::SessionId;
use crate::ingest::faults::{Fault, FAULTS};
use crate::ingest::{IngestMessage, IngestSettings, JsonText, SourceKind};
use crate::model::{Grant, Rejection};
use crate::push::envelope::EnvelopeBuilder;
use crate::push::{Delivery, FrameKind};
use crate::shard::access::{Access, AccessMap};
use crate::shard::{ConnectionView, Denial, DeviceOp, Local, Read, TelemetryView, TwinCacheTtl, TwinView, Viewer};
use crate::timefmt::{iso, now_millis, parse_iso, Millis};

// Durable-state hooks (what changed, restore at start): kept apart from the data path.
mod durable;
pub use durable::{Dirty, SnapshotWalk};
pub(crate) use durable::shrink_after;
mod fanout;
mod id;
mod replay;
pub use replay::{quiet, Decided, Kept, Lead};
mod ingest;
mod telemetry;
mod twin;
pub use telemetry::{same_bytes, Telemetry};
pub use id::{DeviceId, Lookup};
pub use twin::merge_patch;


/// What one device message changed, to be pushed to the device's subscribers.
#[derive(Default)]
pub struct Publication {
    pub device: Arc<str>,
    pub at: Millis,
    pub telemetry: SmallVec<[(Box<str>, JsonText); 8]>,
    pub connection: Option<bool>,
    pub twin: Option<String>,
    /// The whole body, for `d2cMessages` subscribers (JSON text).
    pub message: Option<String>,
    /// When the message it comes from reached hubcast (see [`Delivery::arrived`]).
    pub arrived: Option<crate::metrics::Arrival>,
    /// The key of the message it comes from (design step 10: a stream's device part names it).
    pub key: crate::ingest::MsgKey,
}

/// How live pushes are timed on this core.
#[derive(Debug, Clone, Copy)]
pub struct PushTiming {
    /// `throttlingInterval`; `None` = off.
    pub throttle: Option<Duration>,
    /// `connectionStateCacheTTL`; `None` = forever.
    pub connection_ttl: Option<Duration>,
}

pub struct Twin {
    pub doc: Value,
    pub at: Millis,
}

/// Twin changes that arrived while no whole twin was known (IoT Hub configured), waiting for
/// the hub read of the whole twin they are merged into.
///
/// Bounded: at most [`PENDING_TWIN_CHANGES`] changes and [`PENDING_TWIN_BYTES`] of them per
/// device. Beyond, the changes held are dropped and the twin is read again once the read in
/// flight is back (a hub read made after a change includes it), so nothing is lost but time.
#[derive(Default)]
pub struct PendingTwin {
    /// (`updateTwin` change, time), in arrival order (a `replaceTwin` is whole: never held).
    changes: Vec<(Value, Millis)>,
    bytes: usize,
    /// Changes were dropped: the read in flight may predate them.
    overflowed: bool,
}

/// Most twin changes held per device while its whole twin is read from the hub.
pub const PENDING_TWIN_CHANGES: usize = 64;
/// Most bytes of twin changes (JSON text) held per device while its whole twin is read.
pub const PENDING_TWIN_BYTES: usize = 256 * 1024;

pub struct ConnectionState {
    pub connected: bool,
    pub at: Millis,
    /// `sequenceNumber` of the last connection event, to drop stale (reordered) ones.
    pub sequence: Option<Box<str>>,
}

#[derive(Default)]
pub struct Device {
    /// Last values, rewritten in place by each message ([`Telemetry`]).
    pub telemetry: Telemetry,
    pub twin: Option<Twin>,
    pub connection: Option<ConnectionState>,
    pub access: AccessMap,
    /// When the device was last heard from (for the connection-state TTL).
    last_seen: Option<Instant>,
    /// An off-line check is scheduled for this device.
    offline_check_armed: bool,
    /// When `twin` was last set from an IoT Hub read; twin change events merge into it since.
    pub hub_twin_read: Option<Instant>,
    /// IoT Hub configured: twin changes waiting for the whole twin, being read from the hub.
    pub twin_pending: Option<Box<PendingTwin>>,
    /// Scale-out: a session with a socket on this instance subscribes to this device.
    watched_here: bool,
    /// Scale-out: where the values came from last ([`FROM_HERE`], [`FROM_ELSEWHERE`], or an
    /// event stream partition: `FROM_PARTITION + ` its index in the core's partition table).
    /// Two bytes, beside the flags: the entry does not grow.
    from: u16,
    /// Scale-out: the values may be older than another instance's (the partition they came
    /// from is read elsewhere now, a replica no longer watched here, values loaded from the
    /// store, or learnt from others before a Redis outage). A read then asks the others for
    /// newer data ([`Local::current`]). Inverted (`false` = current) so a new entry is current.
    stale: bool,
    /// The unit of work ([`Dirty::unit`]) in which the device was last handed to the store
    /// as it was ingested ([`DeviceTable::ingest_recording`]).
    recorded_in: u32,
    /// The partition keys applied (design step 9): a message read again after a takeover is
    /// recognised by its key, not applied or pushed twice. Stored with the last values.
    pub mark: crate::ingest::ReadMark,
}

/// [`Device::from`]: this instance's own source without partitions (`POST /ingest`, the
/// simulated fleet), or nothing yet. Such values stay current.
pub const FROM_HERE: u16 = 0;
/// [`Device::from`]: another instance's message (a replica): current while watched here.
pub const FROM_ELSEWHERE: u16 = 1;
/// [`Device::from`]: the first event stream partition's index in the partition table.
const FROM_PARTITION: u16 = 2;

/// Where the messages about to be ingested come from ([`DeviceTable::ingest_from`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source<'a> {
    /// This instance's own source without partitions (`POST /ingest`, the simulated fleet).
    Here,
    /// An event stream partition, and whether this instance reads it now (holds its lease;
    /// a batch of a partition just lost may still be in the core's queue).
    Partition(&'a str, bool),
    /// Another instance's messages (scale-out replicas).
    Elsewhere,
}

fn subscribed_any(device: &Device) -> bool {
    device.wants(|a| !a.subs_empty())
}

impl Device {
    /// Whether any session's subscriptions satisfy `test`.
    fn wants(&self, test: impl Fn(&Access) -> bool) -> bool {
        self.access.values().any(test)
    }

    /// A device read back at start counts as heard from `now` (when it has a connection
    /// state); returns whether it needs an off-line check (connected, none noted yet).
    pub fn heard_at_start(&mut self, now: Instant) -> bool {
        let Some(c) = &self.connection else { return false };
        self.last_seen.get_or_insert(now);
        if c.connected && !self.offline_check_armed {
            self.offline_check_armed = true;
            return true;
        }
        false
    }

    fn has_data(&self) -> bool {
        !self.telemetry.is_empty() || self.twin.is_some() || self.connection.is_some()
    }

    /// Whether any session holds a twin grant or subscription here (someone may be pushed it).
    fn twin_watched(&self) -> bool {
        self.access.values().any(|a| a.granted_twin() || a.subscribed_twin())
    }
}

pub struct DeviceTable {
    devices: HashMap<DeviceId, Device>,
    settings: IngestSettings,
    timing: PushTiming,
    /// Trailing throttle flushes: (due, device, session). Entries are checked, not trusted.
    throttle_due: BinaryHeap<Reverse<(Instant, Box<str>, SessionId)>>,
    /// Off-line checks: (due, device), re-armed lazily from `last_seen`.
    offline_due: BinaryHeap<Reverse<(Instant, Box<str>)>>,
    /// `Some(deviceTwinCacheTTL)` with an IoT Hub service connection. Then a twin kept here is
    /// always whole (a hub read, a `replaceTwin`, a desired-property answer, with later changes
    /// merged), and a change that finds none waits for a hub read ([`PendingTwin`]).
    hub_twins: Option<TwinCacheTtl>,
    /// Devices whose whole twin the core must read from the hub ([`Self::take_twin_fetches`]).
    twin_fetches: Vec<Box<str>>,
    /// What changed since the core last handed it to its store (off without a store).
    pub dirty: Dirty,
    /// Scale-out: devices whose `watched_here` changed, for the relay (`None`: one instance).
    watch_changes: Option<Vec<(Box<str>, bool)>>,
    /// Event stream partitions this core ingested from, by index ([`Device::from`]):
    /// bounded by the stream's partitions (at most `u16::MAX - FROM_PARTITION`; beyond,
    /// values count as [`FROM_HERE`]).
    partitions: Vec<Arc<str>>,
    /// Where the messages being ingested come from: `(from, stale)` ([`Self::ingest_from`]).
    source: (u16, bool),
    /// Where the values of a message are put together before they are stored
    /// ([`JsonText::share`]); empty between messages, its capacity kept.
    scratch: String,
    /// The wall-clock time last read for a batch, and the batch's `now` ([`Self::wall_clock`]).
    wall_clock: Option<(Instant, Millis)>,
    /// Messages read again from their partition, recognised and not applied (design step 9).
    rereads: u64,
    /// What the last twin change or connection event applied was decided to send
    /// ([`Self::decided`], kept in device rings: design step 11).
    event: replay::Event,
}

impl DeviceTable {
    pub fn new(settings: IngestSettings, timing: PushTiming) -> Self {
        Self {
            devices: HashMap::new(),
            settings,
            timing,
            throttle_due: BinaryHeap::new(),
            offline_due: BinaryHeap::new(),
            hub_twins: None,
            twin_fetches: Vec::new(),
            dirty: Dirty::default(),
            watch_changes: None,
            partitions: Vec::new(),
            source: (FROM_HERE, false),
            scratch: String::new(),
            wall_clock: None,
            rereads: 0,
            event: replay::Event::Nothing,
        }
    }

    /// Where the messages ingested next come from (until told otherwise): stamped on each
    /// device they update ([`Device::from`], [`Device::stale`]).
    pub fn ingest_from(&mut self, source: Source<'_>) {
        self.source = match source {
            Source::Here => (FROM_HERE, false),
            Source::Elsewhere => (FROM_ELSEWHERE, false),
            Source::Partition(name, read_here) => match self.partitions.iter().position(|p| **p == *name) {
                Some(i) => (FROM_PARTITION + i as u16, !read_here),
                None if self.partitions.len() < usize::from(u16::MAX - FROM_PARTITION) => {
                    self.partitions.push(name.into());
                    (FROM_PARTITION + self.partitions.len() as u16 - 1, !read_here)
                }
                None => (FROM_HERE, !read_here),
            },
        };
    }

    /// Notes on `device` that its values were just written by the current source. A
    /// replica is current while this instance watches the device (it then gets every message).
    fn stamp(source: (u16, bool), device: &mut Device) {
        device.from = source.0;
        device.stale = if source.0 == FROM_ELSEWHERE { !device.watched_here } else { source.1 };
    }

    /// The link to the other instances was lost: what they published meanwhile never came,
    /// so values learnt from them may be old. Every device last updated by another instance
    /// is no longer current (its values are kept: nobody else may hold newer); its reads ask
    /// the others for newer data, and its next message makes it current again. Returns how
    /// many devices were marked.
    pub fn replicas_not_current(&mut self) -> usize {
        self.mark_stale(|d| d.from == FROM_ELSEWHERE)
    }

    /// The partitions this instance reads changed: the values of every device last updated
    /// from a partition no longer read here are no longer current (the new reader has newer).
    /// One pass over the core's devices when a partition was left; returns how many were marked.
    pub fn partitions_read(&mut self, read_here: impl Fn(&str) -> bool) -> usize {
        let left: Vec<u16> = (0..self.partitions.len()).filter(|&i| !read_here(&self.partitions[i])).map(|i| FROM_PARTITION + i as u16).collect();
        if left.is_empty() {
            return 0;
        }
        self.mark_stale(|d| left.contains(&d.from))
    }

    /// Scale-out starts: every value held now was loaded from the durable store, written
    /// before this instance (re)joined; the others may hold newer. Returns how many devices.
    pub fn loaded_not_current(&mut self) -> usize {
        self.mark_stale(|_| true)
    }

    fn mark_stale(&mut self, which: impl Fn(&Device) -> bool) -> usize {
        let mut marked = 0;
        for d in self.devices.values_mut() {
            if !d.stale && d.has_data() && which(d) {
                d.stale = true;
                marked += 1;
            }
        }
        marked
    }

    /// Scale-out: track which devices a session with a socket on this instance subscribes
    /// to ([`Self::take_watch_changes`]).
    pub fn track_watches(&mut self) {
        self.watch_changes.get_or_insert_with(Vec::new);
    }

    /// Devices that became watched here (`true`) or stopped being watched (`false`) since
    /// the last call: an instance receives another instance's messages of a device only
    /// while it watches it.
    pub fn take_watch_changes(&mut self) -> Vec<(Box<str>, bool)> {
        self.watch_changes.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Devices watched here now (after a reconnect to Redis, to subscribe again).
    pub fn watched_here(&self) -> Vec<Box<str>> {
        self.devices.iter().filter(|(_, d)| d.watched_here).map(|(k, _)| Box::from(k)).collect()
    }

    /// Re-computes whether `device` is watched here, noting a change.
    fn note_watch(&mut self, device: &str) {
        let Some(changes) = self.watch_changes.as_mut() else { return };
        let Some(d) = self.devices.get_mut(device) else { return };
        let now = d.access.values().any(|a| a.here() && !a.subs_empty());
        if now != d.watched_here {
            d.watched_here = now;
            // A replica no longer watched gets no more messages from the device's reader.
            if !now && d.from == FROM_ELSEWHERE {
                d.stale = true;
            }
            changes.push((device.into(), now));
        }
    }

    /// With an IoT Hub service connection: twins are pushed whole (see [`PendingTwin`]), and
    /// `ttl` says how long a hub read may be served from here.
    pub fn with_hub_twins(mut self, ttl: TwinCacheTtl) -> Self {
        self.hub_twins = Some(ttl);
        self
    }

    /// The devices whose whole twin must now be read from the hub; answer each with
    /// [`Self::hub_twin_fetched`].
    pub fn take_twin_fetches(&mut self) -> Vec<Box<str>> {
        std::mem::take(&mut self.twin_fetches)
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Every device of this core, in no order (for the console's listing, `shard::listing`).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Device)> {
        self.devices.iter().map(|(id, d)| (id.as_str(), d))
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// When the newest data held for `device` was produced (scale-out: the freshest of
    /// several instances' answers wins); `None` without data.
    pub fn newest(&self, device: &str) -> Option<Millis> {
        let d = self.devices.get(device)?;
        let telemetry = d.telemetry.newest();
        [telemetry, d.twin.as_ref().map(|t| t.at), d.connection.as_ref().map(|c| c.at)].into_iter().flatten().max()
    }

    /// Grants and subscriptions held on this core's devices (counted at scrape time).
    pub fn access_counts(&self) -> (u64, u64) {
        let mut grants = 0u64;
        let mut subs = 0u64;
        for d in self.devices.values() {
            for a in d.access.values() {
                let (g, s) = a.counts();
                grants += g;
                subs += s;
            }
        }
        (grants, subs)
    }

    pub fn get(&self, device: &str) -> Option<&Device> {
        self.devices.get(device)
    }

    fn access(&self, device: &str, session: SessionId) -> Option<&Access> {
        self.devices.get(device)?.access.get(session)
    }

    fn access_mut(&mut self, device: &str, session: SessionId) -> &mut Access {
        self.devices
            .entry_ref(device)
            .or_default()
            .access
            .entry(session)
    }

    /// Drops a device entry that holds neither data nor access.
    fn prune(&mut self, device: &str) {
        self.dirty.device(device);
        if let Some(d) = self.devices.get_mut(device) {
            // Versioned empty entries stay (see `Access::v`); the session's end removes them.
            d.access.retain(|a| !a.is_empty() || a.v() > 0);
            // Without a twin cache, a hub twin is kept only as the base of pushes.
            if self.hub_twins == Some(TwinCacheTtl::Off) && !d.twin_watched() {
                d.twin = None;
                d.hub_twin_read = None;
            }
            if !d.has_data() && d.access.is_empty() {
                if d.watched_here {
                    if let Some(changes) = self.watch_changes.as_mut() {
                        changes.push((device.into(), false));
                    }
                }
                self.devices.remove(device);
            }
        }
    }

    /// Runs one operation; an operation with a reply answers it (a caller that has gone
    /// away is no concern of the shard).
    pub fn apply(&mut self, op: DeviceOp) {
        self.dirty.op(&op);
        let watch = match (&op, self.watch_changes.is_some()) {
            (
                DeviceOp::Revoke { device, .. }
                | DeviceOp::Subscribe { device, .. }
                | DeviceOp::Unsubscribe { device, .. }
                | DeviceOp::ForgetSession { device, .. }
                | DeviceOp::SetAccess { device, .. }
                | DeviceOp::Presence { device, .. },
                true,
            ) => Some(device.clone()),
            _ => None,
        };
        self.apply_op(op);
        if let Some(device) = watch {
            self.note_watch(&device);
        }
    }

    fn apply_op(&mut self, op: DeviceOp) {
        match op {
            DeviceOp::Grant { device, session, grant, done } => {
                self.access_mut(&device, session).add_grant(&grant);
                let _ = done.send(());
            }
            DeviceOp::Revoke { device, session, grant, done } => {
                if let Some(a) = self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(session)) {
                    a.revoke(&grant);
                }
                self.prune(&device);
                let _ = done.send(());
            }
            DeviceOp::Subscribe { device, session, sub, permitted } => {
                let ok = match self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(session)) {
                    Some(a) => a.subscribe(&sub),
                    None => false,
                };
                let _ = permitted.send(ok);
            }
            DeviceOp::Unsubscribe { device, session, sub, permitted } => {
                let ok = match self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(session)) {
                    Some(a) => a.unsubscribe(&sub),
                    None => false,
                };
                let _ = permitted.send(ok);
            }
            DeviceOp::CheckGrant { device, session, grant, permitted } => {
                let _ = permitted.send(self.access(&device, session).is_some_and(|a| a.holds(&grant)));
            }
            DeviceOp::ForgetSession { device, session } => {
                if let Some(d) = self.devices.get_mut(&*device) {
                    d.access.remove(session);
                }
                self.prune(&device);
            }
            DeviceOp::SetAccess { device, session, access, v, done } => {
                let newer = v == 0 || self.access(&device, session).is_none_or(|a| v > a.v());
                match access {
                    _ if !newer => {}
                    Some((grants, subs)) => {
                        let a = self.access_mut(&device, session);
                        a.set(grants, subs);
                        a.set_v(v);
                    }
                    // Kept, empty, at its version: a late older change is then not applied.
                    None if v > 0 => {
                        let a = self.access_mut(&device, session);
                        a.set(crate::shard::Grants::default(), crate::shard::Subscriptions::default());
                        a.set_v(v);
                    }
                    None => {
                        if let Some(d) = self.devices.get_mut(&*device) {
                            d.access.remove(session);
                        }
                    }
                }
                self.prune(&device);
                if let Some(done) = done {
                    let _ = done.send(());
                }
            }
            DeviceOp::ReadAccess { device, session, reply } => {
                let access = self.access(&device, session).filter(|a| !a.is_empty()).map(|a| (a.grants(), a.subs()));
                let _ = reply.send(access);
            }
            DeviceOp::Presence { device, session, here } => {
                if let Some(a) = self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(session)) {
                    a.set_here(here);
                }
            }
            DeviceOp::ReadTelemetry { device, key, viewer, reply } => {
                let _ = reply.send(self.read_telemetry(&device, key.as_deref(), viewer).map(|view| self.local(&device, view)));
            }
            DeviceOp::DeleteTelemetry { device, viewer, reply } => {
                let _ = reply.send(self.delete_telemetry(&device, viewer));
            }
            DeviceOp::ReadTwin { device, viewer, reply } => {
                let _ = reply.send(self.read_twin(&device, viewer).map(|view| self.local(&device, view)));
            }
            DeviceOp::ReadConnectionState { device, viewer, reply } => {
                let _ = reply.send(self.read_connection_state(&device, viewer).map(|view| self.local(&device, view)));
            }
            DeviceOp::ReadHubTwin { device, viewer, ttl, reply } => {
                let _ = reply.send(self.read_hub_twin(&device, viewer, ttl));
            }
            DeviceOp::StoreHubTwin { device, doc, reply } => {
                let _ = reply.send(self.store_hub_twin(&device, doc));
            }
        }
    }

    /// A read's answer with how new the device's data is and whether it is current here.
    fn local<T>(&self, device: &str, view: T) -> Local<T> {
        let current = self.devices.get(device).is_none_or(|d| !d.stale);
        Local { view, newest: self.newest(device).unwrap_or(Millis::MIN), current }
    }

    /// Whether `viewer` may read what `granted` says of its access here.
    fn permits(&self, device: &str, viewer: Viewer, granted: impl Fn(&Access) -> bool) -> Read<()> {
        match viewer {
            Viewer::Admin => Ok(()),
            Viewer::Session(s) if self.access(device, s).is_some_and(granted) => Ok(()),
            Viewer::Session(_) => Err(Denial::Forbidden),
        }
    }

    fn delete_telemetry(&mut self, device: &str, viewer: Viewer) -> Read<()> {
        self.permits(device, viewer, |a| a.grant_telemetry().all)?;
        match self.devices.get_mut(device) {
            Some(d) if !d.telemetry.is_empty() => {
                d.telemetry.clear();
                self.prune(device);
                Ok(())
            }
            _ => Err(Denial::NotFound),
        }
    }

    fn read_twin(&self, device: &str, viewer: Viewer) -> Read<TwinView> {
        self.permits(device, viewer, |a| a.granted_twin())?;
        let t = self.devices.get(device).and_then(|d| d.twin.as_ref()).ok_or(Denial::NotFound)?;
        Ok(TwinView { doc: t.doc.clone(), at: t.at })
    }

    fn read_connection_state(&self, device: &str, viewer: Viewer) -> Read<ConnectionView> {
        self.permits(device, viewer, |a| a.granted_connection_state())?;
        let c = self.devices.get(device).and_then(|d| d.connection.as_ref()).ok_or(Denial::NotFound)?;
        Ok(ConnectionView { connected: c.connected, at: c.at })
    }

    /// `GET /lastValue`: a session sees the keys its grants cover; with only per-key grants an
    /// all-keys read returns just those keys (403 without any telemetry grant).
    fn read_telemetry(&self, device: &str, key: Option<&str>, viewer: Viewer) -> Read<TelemetryView> {
        let d = self.devices.get(device);
        let grants = match viewer {
            Viewer::Admin => None,
            Viewer::Session(s) => {
                let g = d.and_then(|d| d.access.get(s)).map(|a| a.grant_telemetry());
                match (g, key) {
                    (Some(g), Some(k)) if g.contains_key(k) => Some(g),
                    (Some(g), None) if !g.is_empty() => Some(g),
                    _ => return Err(Denial::Forbidden),
                }
            }
        };
        let d = d.ok_or(Denial::NotFound)?;
        match key {
            Some(k) => {
                let (text, at) = d.telemetry.get(k).ok_or(Denial::NotFound)?;
                Ok(TelemetryView::One { key: k.into(), json: JsonText::new(text), at })
            }
            None => {
                let kept = || d.telemetry.iter().filter(|(k, _, _)| grants.is_none_or(|g| g.contains_key(k)));
                if kept().next().is_none() {
                    return Err(Denial::NotFound);
                }
                // The values read in one buffer ([`JsonText::share`]).
                let mut scratch = String::new();
                let texts = JsonText::share(kept().map(|(_, v, _)| v), &mut scratch);
                let values = kept().zip(texts).map(|((k, _, at), json)| (Box::from(k), json, at)).collect();
                Ok(TelemetryView::All(values))
            }
        }
    }

    pub fn holds_grant(&self, device: &str, session: SessionId, grant: &Grant) -> bool {
        self.access(device, session).is_some_and(|a| a.holds(grant))
    }

}

#[cfg(test)]
mod tests {
    use super::ingest::sequence_order;
    use super::*;

    /// Applies one operation and returns its typed answer.
    fn answer<T>(table: &mut DeviceTable, make: impl FnOnce(crate::shard::Reply<T>) -> DeviceOp) -> T {
        let (op, mut rx) = crate::shard::ask(make);
        table.apply(op);
        rx.try_recv().expect("answered").expect("answered at once")
    }
    use serde_json::json;

    /// The default deployment's ingest settings.
    fn settings() -> IngestSettings {
        IngestSettings {
            custom_timestamp_key: "_ts".into(),
            custom_device_id_key: "deviceId".into(),
            custom_connection_state_key: String::new(),
            connection_state_on_telemetry: true,
        }
    }

    #[test]
    fn held_twin_changes_never_exceed_the_byte_bound_not_even_one_big_change() {
        let mut pending = PendingTwin::default();
        pending.hold(json!({"small": 1}), 1);
        assert_eq!(pending.changes.len(), 1);
        pending.hold(json!({"big": "x".repeat(PENDING_TWIN_BYTES)}), 2);
        assert!(pending.overflowed, "the twin is read again");
        assert!(pending.changes.is_empty() && pending.bytes == 0, "{} bytes held", pending.bytes);
        for i in 0..PENDING_TWIN_CHANGES * 3 {
            pending.hold(json!({ "k": "y".repeat(10_000), "i": i }), 3);
            assert!(pending.bytes <= PENDING_TWIN_BYTES && pending.changes.len() <= PENDING_TWIN_CHANGES);
        }
    }

    #[test]
    fn merge_patch_merges_deep_and_deletes_null() {
        let mut twin = json!({"version": 1, "properties": {"reported": {"a": 1, "b": {"c": 2}}}});
        merge_patch(&mut twin, json!({"version": 2, "properties": {"reported": {"b": {"d": 3}, "a": null}}}));
        assert_eq!(twin, json!({"version": 2, "properties": {"reported": {"b": {"c": 2, "d": 3}}}}));
    }

    #[test]
    fn hub_twin_cache_keeps_a_newer_cached_version_and_honours_the_ttl() {
        let settings = settings();
        let mut table = DeviceTable::new(settings, PushTiming { throttle: None, connection_ttl: None });
        let read = |t: &mut DeviceTable, ttl| answer(t, |reply| DeviceOp::ReadHubTwin { device: "d".into(), viewer: Viewer::Admin, ttl, reply });
        assert_eq!(read(&mut table, TwinCacheTtl::Forever), Ok(None));
        answer(&mut table, |reply| DeviceOp::StoreHubTwin { device: "d".into(), doc: json!({"version": 5, "a": 1}), reply });
        assert_eq!(read(&mut table, TwinCacheTtl::Off), Ok(None));
        let Ok(Some(cached)) = read(&mut table, TwinCacheTtl::Forever) else { panic!("cached") };
        assert_eq!(cached.doc["a"], json!(1));
        // An older hub read does not replace a newer cached twin.
        let served = answer(&mut table, |reply| DeviceOp::StoreHubTwin { device: "d".into(), doc: json!({"version": 4, "a": 0}), reply });
        assert_eq!(served.doc["a"], json!(1), "{served:?}");
        let short = TwinCacheTtl::For(std::time::Duration::from_millis(1));
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(read(&mut table, short), Ok(None));
    }

    /// More changes than a device may hold while its whole twin is read: they are dropped and
    /// the twin read again (that read includes them); the changes after it are merged.
    #[test]
    fn twin_changes_held_beyond_the_bound_make_the_twin_read_again() {
        use crate::ids::SessionId;
        use crate::model::{DataKind, GrantKind, Subscription};
        let settings = settings();
        let mut table = DeviceTable::new(settings, PushTiming { throttle: None, connection_ttl: None })
            .with_hub_twins(TwinCacheTtl::Off);
        let session = SessionId(7);
        let grant = Grant { kind: GrantKind::Data(DataKind::DeviceTwin), key: None };
        answer(&mut table, |done| DeviceOp::Grant { device: "d".into(), session, grant, done });
        let sub = Subscription { kind: DataKind::DeviceTwin, key: None };
        assert!(answer(&mut table, |permitted| DeviceOp::Subscribe { device: "d".into(), session, sub, permitted }));
        let now = Instant::now();
        let change = |version: usize| IngestMessage {
            device_id: "d".into(),
            source: SourceKind::TwinChange,
            properties: smallvec::smallvec![("opType".into(), "updateTwin".into())],
            body: format!(r#"{{"version":{version},"properties":{{"reported":{{"n":{version}}}}}}}"#).into_bytes(),
            enqueued_at: None,
            arrived: None,
            key: Default::default(),
        };
        let mut out = Vec::new();
        for version in 10..10 + PENDING_TWIN_CHANGES + 2 {
            table.ingest_and_publish(change(version), now, &mut out);
        }
        assert!(out.is_empty(), "nothing is pushed before the whole twin is known");
        assert_eq!(table.take_twin_fetches(), vec![Box::<str>::from("d")], "one read per device");
        let hub_twin = |version: u64| json!({"deviceId": "d", "version": version, "properties": {"desired": {"x": 1}, "reported": {}}});
        assert!(table.hub_twin_fetched("d", Ok(hub_twin(9)), now, &mut out), "changes were dropped: read again");
        assert!(out.is_empty());
        // The second read holds the dropped changes (up to 73); the two kept after them merge.
        assert!(!table.hub_twin_fetched("d", Ok(hub_twin(73)), now, &mut out));
        assert_eq!(out.len(), 1);
        let frame: Value = serde_json::from_str(&out[0].frame).unwrap();
        let twin = &frame["deviceTwin"];
        assert_eq!(twin["version"], json!(75), "{twin}");
        assert_eq!(twin["properties"]["reported"]["n"], json!(75));
        assert_eq!(twin["properties"]["desired"]["x"], json!(1));
        assert_eq!(twin["deviceId"], json!("d"));
    }

    fn table() -> DeviceTable {
        let settings = settings();
        DeviceTable::new(settings, PushTiming { throttle: None, connection_ttl: None })
    }

    fn telemetry(device: &str, n: i64, ts: i64) -> IngestMessage {
        IngestMessage {
            device_id: device.into(),
            source: SourceKind::Telemetry,
            properties: Default::default(),
            body: format!(r#"{{"n":{n},"_ts":{ts}}}"#).into_bytes(),
            enqueued_at: None,
            arrived: None,
            key: Default::default(),
        }
    }

    /// (current, newest) of `device`'s telemetry read here.
    fn read(table: &mut DeviceTable, device: &str) -> (bool, Millis) {
        let local = answer(table, |reply| DeviceOp::ReadTelemetry { device: device.into(), key: None, viewer: Viewer::Admin, reply }).expect("held");
        (local.current, local.newest)
    }

    /// Item 5 of issue 23: values from a partition this instance no longer reads are not
    /// current (a batch of it still queued, too); other partitions', `POST /ingest`'s and
    /// values ingested again from a partition read here are.
    #[test]
    fn values_of_a_partition_read_elsewhere_are_not_current() {
        let mut t = table();
        let now = Instant::now();
        let mut out = Vec::new();
        t.ingest_from(Source::Partition("0", true));
        t.ingest_and_publish(telemetry("p0", 12, 1_000), now, &mut out);
        t.ingest_from(Source::Partition("1", true));
        t.ingest_and_publish(telemetry("p1", 1, 1_000), now, &mut out);
        t.ingest_from(Source::Here);
        t.ingest_and_publish(telemetry("posted", 1, 1_000), now, &mut out);
        assert_eq!(read(&mut t, "p0"), (true, 1_000));
        assert_eq!(t.partitions_read(|p| p == "0" || p == "1"), 0, "nothing left");
        assert_eq!(t.partitions_read(|p| p == "1"), 1, "partition 0 left: one device");
        assert_eq!(read(&mut t, "p0"), (false, 1_000));
        assert!(read(&mut t, "p1").0 && read(&mut t, "posted").0);
        // A batch of partition 0 applied after it left stays not current.
        t.ingest_from(Source::Partition("0", false));
        t.ingest_and_publish(telemetry("p0", 13, 2_000), now, &mut out);
        assert_eq!(read(&mut t, "p0"), (false, 2_000));
        // Read here again: the next message makes it current.
        t.ingest_from(Source::Partition("0", true));
        t.ingest_and_publish(telemetry("p0", 14, 3_000), now, &mut out);
        assert_eq!(read(&mut t, "p0"), (true, 3_000));
        // Values loaded from the store when scale-out starts, and one instance as it was.
        assert_eq!(t.loaded_not_current(), 3);
        assert!(!read(&mut t, "posted").0);
    }

    /// Design step 9: a partition message read again (its key applied already, as a replica
    /// or from the partition) is neither applied nor pushed: the values do not go back to it
    /// and the subscriber gets nothing; arrival keys (`POST /ingest`) are never re-reads.
    #[test]
    fn a_message_read_again_from_its_partition_is_not_applied_or_pushed_twice() {
        use crate::ingest::MsgKey;
        use crate::model::{DataKind, GrantKind, Subscription};
        let mut t = table();
        let now = Instant::now();
        let session = SessionId(3);
        let grant = Grant { kind: GrantKind::Data(DataKind::Telemetry), key: None };
        answer(&mut t, |done| DeviceOp::Grant { device: "d".into(), session, grant, done });
        let sub = Subscription { kind: DataKind::Telemetry, key: None };
        assert!(answer(&mut t, |permitted| DeviceOp::Subscribe { device: "d".into(), session, sub, permitted }));
        let keyed = |n: i64, key: MsgKey| IngestMessage { key, ..telemetry("d", n, 1_000 + n) };
        let mut out = Vec::new();
        t.ingest_from(Source::Elsewhere);
        for n in 1..=3 {
            assert!(t.ingest_recording(&keyed(n, MsgKey::partition(0, 5_000, n)), now, &mut out, None));
        }
        assert_eq!((out.len(), t.rereads()), (3, 0));
        // The taker reads 2 and 3 again from the checkpoint, then 4 is new.
        t.ingest_from(Source::Partition("0", true));
        for n in 2..=3 {
            assert!(!t.ingest_recording(&keyed(n, MsgKey::partition(0, 5_000, n)), now, &mut out, None), "{n} read again");
        }
        assert_eq!((out.len(), t.rereads()), (3, 2), "nothing pushed, both counted");
        assert_eq!(read(&mut t, "d").1, 1_003, "the values did not go back");
        assert!(t.ingest_recording(&keyed(4, MsgKey::partition(0, 5_001, 4)), now, &mut out, None));
        assert_eq!(out.len(), 4);
        // Arrival keys and none: applied every time.
        t.ingest_from(Source::Here);
        let posted = keyed(5, MsgKey::arrival(5_000));
        assert!(t.ingest_recording(&posted, now, &mut out, None) && t.ingest_recording(&posted, now, &mut out, None));
        assert!(t.ingest_recording(&keyed(6, MsgKey::NONE), now, &mut out, None));
        assert_eq!((out.len(), t.rereads()), (7, 2));
        // A twin change and a connection event read again: dropped alike.
        let twin = IngestMessage {
            source: SourceKind::TwinChange,
            body: br#"{"version":2,"properties":{"reported":{"x":1}}}"#.to_vec(),
            key: MsgKey::partition(0, 5_001, 5),
            ..telemetry("d", 0, 0)
        };
        t.ingest_from(Source::Partition("0", true));
        t.ingest_recording(&twin, now, &mut out, None);
        assert!(!t.ingest_recording(&twin, now, &mut out, None));
        assert_eq!(t.rereads(), 3);
    }

    /// A replica is current while a socket here subscribes to the device (this instance
    /// then gets every message of it), not once nobody here does, nor after a Redis outage.
    #[test]
    fn a_replica_is_current_only_while_watched_here() {
        use crate::model::{DataKind, GrantKind, Subscription};
        let mut t = table();
        t.track_watches();
        let now = Instant::now();
        let mut out = Vec::new();
        let session = SessionId(3);
        let grant = Grant { kind: GrantKind::Data(DataKind::Telemetry), key: None };
        answer(&mut t, |done| DeviceOp::Grant { device: "r".into(), session, grant, done });
        let sub = Subscription { kind: DataKind::Telemetry, key: None };
        assert!(answer(&mut t, |permitted| DeviceOp::Subscribe { device: "r".into(), session, sub, permitted }));
        t.apply(DeviceOp::Presence { device: "r".into(), session, here: true });
        t.ingest_from(Source::Elsewhere);
        t.ingest_and_publish(telemetry("r", 1, 10), now, &mut out);
        t.ingest_and_publish(telemetry("unwatched", 1, 10), now, &mut out);
        assert!(read(&mut t, "r").0, "watched here: every message comes");
        assert!(!read(&mut t, "unwatched").0, "a replica nobody here watches");
        t.apply(DeviceOp::Presence { device: "r".into(), session, here: false });
        assert!(!read(&mut t, "r").0, "no longer watched: no more messages come");
        t.apply(DeviceOp::Presence { device: "r".into(), session, here: true });
        t.ingest_and_publish(telemetry("r", 2, 20), now, &mut out);
        assert!(read(&mut t, "r").0);
        assert_eq!(t.replicas_not_current(), 1, "after a Redis outage");
        assert_eq!(read(&mut t, "r"), (false, 20), "kept: nobody else may hold newer");
    }

    /// With a store, a device is recorded as it is ingested the first time in a unit; a
    /// second message in the same unit marks it, so the unit's last record is its state at
    /// the commit; the next unit records it at once again.
    #[test]
    fn a_device_ingested_twice_in_a_unit_is_stored_as_it_is_at_the_commit() {
        use crate::shard::change::Change;
        let settings = settings();
        let mut table = DeviceTable::new(settings, PushTiming { throttle: None, connection_ttl: None });
        table.dirty.on = true;
        let msg = |v: u32| IngestMessage {
            device_id: "d".into(),
            source: SourceKind::Telemetry,
            properties: Default::default(),
            body: format!(r#"{{"t":{v}}}"#).into_bytes(),
            enqueued_at: None,
            arrived: None,
            key: Default::default(),
        };
        let records = std::cell::RefCell::new(Vec::new());
        let mut put = |c: Change<'_>| {
            if let Change::Device { id, device } = c {
                let t = device.and_then(|d| d.telemetry.get("t")).map(|(v, _)| v.to_string());
                records.borrow_mut().push((id.to_string(), t));
            }
        };
        let (now, mut out) = (Instant::now(), Vec::new());
        table.ingest_recording(&msg(1), now, &mut out, Some(&mut put));
        table.ingest_recording(&msg(22), now, &mut out, Some(&mut put));
        table.drain_dirty(&mut put);
        let d = |t: &str| ("d".to_string(), Some(t.to_string()));
        assert_eq!(records.take(), [d("1"), d("22")], "the last record of the unit is the state at its commit");
        table.ingest_recording(&msg(3), now, &mut out, Some(&mut put));
        table.drain_dirty(&mut put);
        assert_eq!(records.take(), [d("3")], "recorded once, as ingested");
        // Without a sink (or without a store) the device is marked and drained as before.
        table.ingest_and_publish(msg(4), now, &mut out);
        table.drain_dirty(&mut put);
        assert_eq!(records.take(), [d("4")]);
    }

    #[test]
    fn sequence_numbers_compare_as_fixed_width_hex() {
        assert!(sequence_order("000000000000000001D4", "000000000000000001D5").is_lt());
        assert!(sequence_order("1D5", "0000000001D4").is_gt());
    }
}
