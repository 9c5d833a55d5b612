//! Durable-state hooks of the device table: which devices and access entries changed since
//! the core last committed, their states as [`Change`]s, and restoring them at start.
//!
//! The table only marks keys; the core reads their current state when it commits, so a device
//! that changed many times in one burst is written once. Engine-agnostic: the shard never
//! sees which store runs.

use std::time::{Duration, Instant};

use std::cmp::Reverse;

use hashbrown::HashSet;

use super::{Device, DeviceTable};
use crate::ids::SessionId;
use crate::shard::access::Access;
use crate::shard::DeviceOp;
use crate::shard::change::{Change, Loaded};

/// Keys changed since the last commit. Marks nothing while `on` is false (memory only).
pub struct Dirty {
    pub on: bool,
    devices: HashSet<Box<str>>,
    access: HashSet<(Box<str>, SessionId)>,
    /// The unit of work being built: raised by each [`DeviceTable::drain_dirty`]. A device
    /// handed to the store as it was ingested notes the unit ([`Device::recorded_in`]), so a
    /// second change in the same unit is marked instead. Starts at 1 (a new device says 0);
    /// after a wrap a device may take a later unit for its own and be marked: still written.
    pub unit: u32,
}

impl Default for Dirty {
    fn default() -> Self {
        Self { on: false, devices: HashSet::new(), access: HashSet::new(), unit: 1 }
    }
}

impl Dirty {
    /// The device's data (last values, twin, connection state) changed.
    #[inline]
    pub fn device(&mut self, id: &str) {
        if self.on && !self.devices.contains(id) {
            self.devices.insert(id.into());
        }
    }

    /// A session's grants or subscriptions on the device changed.
    pub fn access(&mut self, device: &str, session: SessionId) {
        if self.on {
            self.access.insert((device.into(), session));
        }
    }

    /// Marks what `op` may change.
    pub fn op(&mut self, op: &DeviceOp) {
        match op {
            DeviceOp::Grant { device, session, .. }
            | DeviceOp::Revoke { device, session, .. }
            | DeviceOp::Subscribe { device, session, .. }
            | DeviceOp::Unsubscribe { device, session, .. }
            | DeviceOp::ForgetSession { device, session }
            | DeviceOp::SetAccess { device, session, .. } => self.access(device, *session),
            DeviceOp::DeleteTelemetry { device, .. } | DeviceOp::StoreHubTwin { device, .. } => self.device(device),
            _ => {}
        }
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.access.is_empty()
    }
}

/// Gives back the room of a drained set once it is four times what the last unit used (and
/// more than a few hundred entries): a burst (100,000 grants set up at once) would otherwise
/// keep its table for good, about 0.4 KiB per session of the idle benchmark (issue 25 item 3).
/// A steady load keeps its room: nothing is allocated again unit after unit.
pub(crate) fn shrink_after<T: std::hash::Hash + Eq>(set: &mut HashSet<T>, drained: usize) {
    if set.capacity() > 4 * drained.max(256) {
        set.shrink_to(drained.max(256));
    }
}

/// The devices a snapshot still has to write ([`DeviceTable::snapshot_walk`]).
pub struct SnapshotWalk {
    /// Every id, back to back; `ends[i]` is where the i-th ends.
    ids: Vec<u8>,
    ends: Vec<usize>,
    next: usize,
}

impl SnapshotWalk {
    /// Devices not written yet.
    pub fn remaining(&self) -> usize {
        self.ends.len() - self.next
    }
}

fn data_of(d: &Device) -> Option<&Device> {
    d.has_data().then_some(d)
}

impl DeviceTable {
    /// Hands the current state of every key changed since the last call to `put`.
    pub fn drain_dirty(&mut self, put: &mut dyn FnMut(Change<'_>)) {
        self.dirty.unit = self.dirty.unit.wrapping_add(1).max(1);
        let mut devices = std::mem::take(&mut self.dirty.devices);
        for id in &devices {
            put(Change::Device { id, device: self.devices.get(&**id).and_then(data_of) });
        }
        let drained = devices.len();
        devices.clear();
        shrink_after(&mut devices, drained);
        self.dirty.devices = devices;
        let mut access = std::mem::take(&mut self.dirty.access);
        for (device, session) in &access {
            let a = self.devices.get(&**device).and_then(|d| d.access.get(*session)).filter(|a| !a.is_empty());
            put(Change::Access { device, session: *session, access: a });
        }
        let drained = access.len();
        access.clear();
        shrink_after(&mut access, drained);
        self.dirty.access = access;
    }

    /// Hands the whole state of the table to `put` (for a snapshot).
    pub fn for_each_state(&self, put: &mut dyn FnMut(Change<'_>)) {
        for (id, d) in &self.devices {
            if d.has_data() {
                put(Change::Device { id, device: Some(d) });
            }
            for (session, a) in d.access.iter() {
                if !a.is_empty() {
                    put(Change::Access { device: id, session, access: Some(a) });
                }
            }
        }
    }

    /// Starts a snapshot taken a slice at a time ([`Self::snapshot_slice`]): notes the id of
    /// every device now (one copy of the ids in one buffer, no per-device allocation).
    pub fn snapshot_walk(&self) -> SnapshotWalk {
        let mut walk = SnapshotWalk { ids: Vec::new(), ends: Vec::with_capacity(self.devices.len()), next: 0 };
        walk.ids.reserve(self.devices.keys().map(|k| k.len()).sum());
        for id in self.devices.keys() {
            walk.ids.extend_from_slice(id.as_bytes());
            walk.ends.push(walk.ids.len());
        }
        walk
    }

    /// Hands the state of the walk's next `max` devices (as they are now) to `put`, like
    /// [`Self::for_each_state`]; a device gone since the walk began is skipped, one added since
    /// is not in the walk (its records are in the log after the snapshot point). Returns
    /// whether the walk is done.
    pub fn snapshot_slice(&self, walk: &mut SnapshotWalk, max: usize, put: &mut dyn FnMut(Change<'_>)) -> bool {
        let end = (walk.next + max).min(walk.ends.len());
        for i in walk.next..end {
            let start = if i == 0 { 0 } else { walk.ends[i - 1] };
            // The bytes were copied from `&str` keys: valid UTF-8.
            let Ok(id) = std::str::from_utf8(&walk.ids[start..walk.ends[i]]) else { continue };
            let Some((id, d)) = self.devices.get_key_value(id) else { continue };
            if d.has_data() {
                put(Change::Device { id, device: Some(d) });
            }
            for (session, a) in d.access.iter() {
                if !a.is_empty() {
                    put(Change::Access { device: id, session, access: Some(a) });
                }
            }
        }
        walk.next = end;
        end == walk.ends.len()
    }

    /// Restores devices and access entries read back at start. A device with a connection
    /// state counts as heard from when it was read back (`loaded.heard`): the loader marked it
    /// and listed the connected ones, whose off-line checks are armed here at once.
    pub fn restore(&mut self, loaded: &mut Loaded, now: Instant) {
        if self.devices.is_empty() {
            // At start: adopt the loader's map whole (no second map, no rehash).
            self.devices = std::mem::take(&mut loaded.devices);
        } else {
            self.devices.extend(loaded.devices.drain());
        }
        let connected = std::mem::take(&mut loaded.connected);
        if let Some(ttl) = self.timing.connection_ttl {
            let due = loaded.heard.unwrap_or(now) + ttl;
            if self.offline_due.is_empty() {
                // One heapify instead of a push per device. Dues a nanosecond apart, ascending:
                // the list is a heap already and no comparison reaches the ids (a tie would
                // compare them, reading a million strings scattered in memory).
                let entries: Vec<_> =
                    connected.into_iter().enumerate().map(|(i, id)| Reverse((due + Duration::from_nanos(i as u64), id))).collect();
                self.offline_due = entries.into();
            } else {
                self.offline_due.extend(connected.into_iter().map(|id| Reverse((due, id))));
            }
        }
        for ((device, session), (grants, subs)) in loaded.access.drain() {
            let access = Access::new(grants, subs);
            self.devices.entry_ref(&*device).or_default().access.insert(session, access);
        }
    }
}
