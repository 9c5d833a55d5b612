//! Durable-state hooks of the device table: which devices and access entries changed since
//! the core last committed, their states as [`Change`]s, and restoring them at start.
//!
//! The table only marks keys; the core reads their current state when it commits, so a device
//! that changed many times in one burst is written once. Engine-agnostic: the shard never
//! sees which store runs.

use std::time::Instant;

use hashbrown::HashSet;

use super::{Device, DeviceTable};
use crate::ids::SessionId;
use crate::shard::access::Access;
use crate::shard::DeviceOp;
use crate::shard::change::{Change, Loaded};

/// Keys changed since the last commit. Marks nothing while `on` is false (memory only).
#[derive(Default)]
pub struct Dirty {
    pub on: bool,
    devices: HashSet<Box<str>>,
    access: HashSet<(Box<str>, SessionId)>,
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

fn data_of(d: &Device) -> Option<&Device> {
    d.has_data().then_some(d)
}

impl DeviceTable {
    /// Hands the current state of every key changed since the last call to `put`.
    pub fn drain_dirty(&mut self, put: &mut dyn FnMut(Change<'_>)) {
        let mut devices = std::mem::take(&mut self.dirty.devices);
        for id in &devices {
            put(Change::Device { id, device: self.devices.get(&**id).and_then(data_of) });
        }
        devices.clear();
        self.dirty.devices = devices;
        let mut access = std::mem::take(&mut self.dirty.access);
        for (device, session) in &access {
            let a = self.devices.get(&**device).and_then(|d| d.access.get(session)).filter(|a| !a.is_empty());
            put(Change::Access { device, session: *session, access: a });
        }
        access.clear();
        self.dirty.access = access;
    }

    /// Hands the whole state of the table to `put` (for a snapshot).
    pub fn for_each_state(&self, put: &mut dyn FnMut(Change<'_>)) {
        for (id, d) in &self.devices {
            if d.has_data() {
                put(Change::Device { id, device: Some(d) });
            }
            for (session, a) in &d.access {
                if !a.is_empty() {
                    put(Change::Access { device: id, session: *session, access: Some(a) });
                }
            }
        }
    }

    /// Restores devices and access entries read back at start. A connected device counts as
    /// heard from now (its connection-state TTL starts again).
    pub fn restore(&mut self, loaded: &mut Loaded, now: Instant) {
        if self.devices.is_empty() {
            // At start: adopt the loader's map whole (no second map, no rehash).
            self.devices = std::mem::take(&mut loaded.devices);
        } else {
            self.devices.extend(loaded.devices.drain());
        }
        let ttl = self.timing.connection_ttl;
        for (id, device) in self.devices.iter_mut() {
            if device.connection.is_some() && device.last_seen.is_none() {
                device.last_seen = Some(now);
                Self::arm_offline_check(&mut self.offline_due, ttl, id, device, now);
            }
        }
        for ((device, session), (grants, subs)) in loaded.access.drain() {
            let access = Access { grants, subs, throttle: None, here: false };
            self.devices.entry(device).or_default().access.insert(session, access);
        }
    }
}
