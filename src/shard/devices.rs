//! The devices a core owns: last values, twin, connection state, and per-session access.
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
use crate::ingest::{IngestMessage, IngestSettings, SourceKind};
use crate::model::{Grant, Rejection};
use crate::push::envelope::EnvelopeBuilder;
use crate::push::{Delivery, FrameKind};
use crate::shard::access::Access;
use crate::shard::{DeviceOp, DeviceReply, TwinCacheTtl, Viewer};
use crate::timefmt::{iso, now_millis, parse_iso, Millis};

// Durable-state hooks (what changed, restore at start): kept apart from the data path.
#[path = "durable_devices.rs"]
mod durable;
pub use durable::Dirty;

pub struct LastValue {
    /// Shared with the publication that carried it to subscribers.
    pub json: Arc<str>,
    pub at: Millis,
}

/// What one device message changed, to be pushed to the device's subscribers.
#[derive(Default)]
pub struct Publication {
    pub device: Arc<str>,
    pub at: Millis,
    pub telemetry: SmallVec<[(Box<str>, Arc<str>); 8]>,
    pub connection: Option<bool>,
    pub twin: Option<String>,
    /// The whole body, for `d2cMessages` subscribers (JSON text).
    pub message: Option<String>,
    /// When the message it comes from reached hubcast (see [`Delivery::arrived`]).
    pub arrived: Option<crate::metrics::Arrival>,
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
    pub telemetry: HashMap<Box<str>, LastValue>,
    pub twin: Option<Twin>,
    pub connection: Option<ConnectionState>,
    pub access: HashMap<SessionId, Access>,
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
}

fn subscribed_any(device: &Device) -> bool {
    device.wants(|a| !a.subs.is_empty())
}

impl Device {
    /// Whether any session's subscriptions satisfy `test`.
    fn wants(&self, test: impl Fn(&Access) -> bool) -> bool {
        self.access.values().any(test)
    }

    fn has_data(&self) -> bool {
        !self.telemetry.is_empty() || self.twin.is_some() || self.connection.is_some()
    }

    /// Whether any session holds a twin grant or subscription here (someone may be pushed it).
    fn twin_watched(&self) -> bool {
        self.access.values().any(|a| a.grants.device_twin || a.subs.device_twin)
    }
}

pub struct DeviceTable {
    devices: HashMap<Box<str>, Device>,
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
}

/// Appends `s` as a JSON string literal.
fn push_json_str(out: &mut String, s: &str) {
    out.push_str(&serde_json::to_string(s).expect("strings always serialise"));
}

fn record(device: &str, data: &str, timestamp: &str) -> String {
    let mut out = String::with_capacity(device.len() + data.len() + timestamp.len() + 40);
    out.push_str("{\"deviceId\":");
    push_json_str(&mut out, device);
    out.push_str(",\"data\":");
    out.push_str(data);
    out.push_str(",\"timestamp\":");
    push_json_str(&mut out, timestamp);
    out.push('}');
    out
}

fn forbidden() -> Rejection {
    Rejection::new(403, "Forbidden to read last value of device: missing grant")
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
        }
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
        self.devices.iter().filter(|(_, d)| d.watched_here).map(|(k, _)| k.clone()).collect()
    }

    /// Re-computes whether `device` is watched here, noting a change.
    fn note_watch(&mut self, device: &str) {
        let Some(changes) = self.watch_changes.as_mut() else { return };
        let Some(d) = self.devices.get_mut(device) else { return };
        let now = d.access.values().any(|a| a.here && !a.subs.is_empty());
        if now != d.watched_here {
            d.watched_here = now;
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
        self.devices.iter().map(|(id, d)| (&**id, d))
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Grants and subscriptions held on this core's devices (counted at scrape time).
    /// When the newest data held for `device` was produced (scale-out: the freshest of
    /// several instances' answers wins); `None` without data.
    pub fn newest(&self, device: &str) -> Option<Millis> {
        let d = self.devices.get(device)?;
        let telemetry = d.telemetry.values().map(|v| v.at).max();
        [telemetry, d.twin.as_ref().map(|t| t.at), d.connection.as_ref().map(|c| c.at)].into_iter().flatten().max()
    }

    pub fn access_counts(&self) -> (u64, u64) {
        let mut grants = 0u64;
        let mut subs = 0u64;
        for d in self.devices.values() {
            for a in d.access.values() {
                let (g, s) = (&a.grants, &a.subs);
                grants += g.telemetry.all as u64 + g.telemetry.keys.len() as u64 + g.device_twin as u64
                    + g.connection_state as u64 + g.d2c_messages as u64 + g.desired_properties as u64
                    + g.direct_methods.all as u64 + g.direct_methods.keys.len() as u64;
                subs += s.telemetry.all as u64 + s.telemetry.keys.len() as u64 + s.device_twin as u64
                    + s.connection_state as u64 + s.d2c_messages as u64;
            }
        }
        (grants, subs)
    }

    pub fn get(&self, device: &str) -> Option<&Device> {
        self.devices.get(device)
    }

    fn access(&self, device: &str, session: SessionId) -> Option<&Access> {
        self.devices.get(device)?.access.get(&session)
    }

    fn access_mut(&mut self, device: &str, session: SessionId) -> &mut Access {
        self.devices
            .entry_ref(device)
            .or_default()
            .access
            .entry(session)
            .or_default()
    }

    /// Drops a device entry that holds neither data nor access.
    fn prune(&mut self, device: &str) {
        self.dirty.device(device);
        if let Some(d) = self.devices.get_mut(device) {
            d.access.retain(|_, a| !a.is_empty());
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

    pub fn apply(&mut self, op: DeviceOp) -> DeviceReply {
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
        let reply = self.apply_op(op);
        if let Some(device) = watch {
            self.note_watch(&device);
        }
        reply
    }

    fn apply_op(&mut self, op: DeviceOp) -> DeviceReply {
        match op {
            DeviceOp::Grant { device, session, grant } => {
                self.access_mut(&device, session).add_grant(&grant);
                DeviceReply::Done
            }
            DeviceOp::Revoke { device, session, grant } => {
                if let Some(a) = self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(&session)) {
                    a.revoke(&grant);
                }
                self.prune(&device);
                DeviceReply::Done
            }
            DeviceOp::Subscribe { device, session, sub } => {
                let permitted = match self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(&session)) {
                    Some(a) => a.subscribe(&sub),
                    None => false,
                };
                DeviceReply::Permitted(permitted)
            }
            DeviceOp::Unsubscribe { device, session, sub } => {
                let permitted = match self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(&session)) {
                    Some(a) => a.unsubscribe(&sub),
                    None => false,
                };
                DeviceReply::Permitted(permitted)
            }
            DeviceOp::CheckGrant { device, session, grant } => {
                DeviceReply::Permitted(self.access(&device, session).is_some_and(|a| a.holds(&grant)))
            }
            DeviceOp::ForgetSession { device, session } => {
                if let Some(d) = self.devices.get_mut(&*device) {
                    d.access.remove(&session);
                }
                self.prune(&device);
                DeviceReply::Done
            }
            DeviceOp::SetAccess { device, session, access } => {
                match access {
                    Some((grants, subs)) => {
                        let a = self.access_mut(&device, session);
                        a.grants = grants;
                        a.subs = subs;
                    }
                    None => {
                        if let Some(d) = self.devices.get_mut(&*device) {
                            d.access.remove(&session);
                        }
                    }
                }
                self.prune(&device);
                DeviceReply::Done
            }
            DeviceOp::ReadAccess { device, session } => DeviceReply::Access(
                self.access(&device, session).filter(|a| !a.is_empty()).map(|a| (a.grants.clone(), a.subs.clone())),
            ),
            DeviceOp::Presence { device, session, here } => {
                if let Some(a) = self.devices.get_mut(&*device).and_then(|d| d.access.get_mut(&session)) {
                    a.here = here;
                }
                DeviceReply::Done
            }
            DeviceOp::ReadTelemetry { device, key, viewer } => {
                DeviceReply::Body(self.read_telemetry(&device, key.as_deref(), viewer))
            }
            DeviceOp::DeleteTelemetry { device, viewer } => {
                if let Viewer::Session(s) = viewer {
                    if !self.access(&device, s).is_some_and(|a| a.grants.telemetry.all) {
                        return DeviceReply::Body(Err(forbidden()));
                    }
                }
                match self.devices.get_mut(&*device) {
                    Some(d) if !d.telemetry.is_empty() => {
                        d.telemetry = HashMap::new();
                        self.prune(&device);
                        DeviceReply::Body(Ok(String::new()))
                    }
                    _ => DeviceReply::Body(Err(Rejection::new(404, "No last telemetry found"))),
                }
            }
            DeviceOp::ReadTwin { device, viewer } => {
                if let Viewer::Session(s) = viewer {
                    if !self.access(&device, s).is_some_and(|a| a.grants.device_twin) {
                        return DeviceReply::Body(Err(Rejection::new(403, "Forbidden to read device twin: missing grant")));
                    }
                }
                DeviceReply::Body(match self.devices.get(&*device).and_then(|d| d.twin.as_ref()) {
                    Some(t) => Ok(record(&device, &t.doc.to_string(), &iso(t.at))),
                    None => Err(Rejection::new(404, "No last devicetwin found")),
                })
            }
            DeviceOp::ReadConnectionState { device, viewer } => {
                if let Viewer::Session(s) = viewer {
                    if !self.access(&device, s).is_some_and(|a| a.grants.connection_state) {
                        return DeviceReply::Body(Err(Rejection::new(
                            403,
                            "Forbidden to read connection state: missing grant",
                        )));
                    }
                }
                DeviceReply::Body(match self.devices.get(&*device).and_then(|d| d.connection.as_ref()) {
                    Some(c) => Ok(record(&device, if c.connected { "true" } else { "false" }, &iso(c.at))),
                    None => Err(Rejection::new(404, "No device found")),
                })
            }
            DeviceOp::ReadHubTwin { device, viewer, ttl } => self.read_hub_twin(&device, viewer, ttl),
            DeviceOp::StoreHubTwin { device, doc } => DeviceReply::Body(Ok(self.store_hub_twin(&device, doc))),
            DeviceOp::ReadConnectionStateOrMiss { device, viewer } => {
                match self.apply(DeviceOp::ReadConnectionState { device, viewer }) {
                    DeviceReply::Body(Err(r)) if r.status == 404 => DeviceReply::Miss,
                    other => other,
                }
            }
        }
    }

    /// `GET /lastValue`: a session sees the keys its grants cover; with only per-key grants an
    /// all-keys read returns just those keys (403 without any telemetry grant).
    fn read_telemetry(&self, device: &str, key: Option<&str>, viewer: Viewer) -> Result<String, Rejection> {
        let d = self.devices.get(device);
        let grants = match viewer {
            Viewer::Admin => None,
            Viewer::Session(s) => {
                let g = d.and_then(|d| d.access.get(&s)).map(|a| &a.grants.telemetry);
                match (g, key) {
                    (Some(g), Some(k)) if g.contains_key(k) => Some(g),
                    (Some(g), None) if !g.is_empty() => Some(g),
                    _ => return Err(forbidden()),
                }
            }
        };
        let not_found = || Rejection::new(404, "No last telemetry found");
        let d = d.ok_or_else(not_found)?;
        match key {
            Some(k) => {
                let v = d.telemetry.get(k).ok_or_else(not_found)?;
                let mut data = String::with_capacity(k.len() + v.json.len() + 4);
                data.push('{');
                push_json_str(&mut data, k);
                data.push(':');
                data.push_str(&v.json);
                data.push('}');
                Ok(record(device, &data, &iso(v.at)))
            }
            None => {
                let mut data = String::from("{");
                for (k, v) in d.telemetry.iter().filter(|(k, _)| grants.is_none_or(|g| g.contains_key(k))) {
                    if data.len() > 1 {
                        data.push(',');
                    }
                    push_json_str(&mut data, k);
                    data.push_str(":{\"value\":");
                    data.push_str(&v.json);
                    data.push_str(",\"timestamp\":\"");
                    data.push_str(&iso(v.at));
                    data.push_str("\"}");
                }
                if data.len() == 1 {
                    return Err(not_found());
                }
                data.push('}');
                Ok(record(device, &data, ""))
            }
        }
    }

    /// Applies one device message and pushes what it changed to the device's subscribers.
    pub fn ingest_and_publish(&mut self, msg: IngestMessage, now: Instant, out: &mut Vec<Delivery>) {
        let arrived = msg.arrived;
        if let Some(mut publication) = self.ingest(msg, now) {
            publication.arrived = arrived;
            let device = publication.device.clone();
            self.publish(&device, publication, now, out);
        }
    }

    /// Applies one device message to the owning shard; returns what subscribers should get
    /// (`None` when the device has no subscriber or nothing changed).
    pub fn ingest(&mut self, msg: IngestMessage, now: Instant) -> Option<Publication> {
        let IngestMessage { device_id, source, properties, body, enqueued_at, .. } = msg;
        self.dirty.device(&device_id);
        let property = |name: &str| properties.iter().find(|(k, _)| &**k == name).map(|(_, v)| &**v);
        // Timestamp resolution (reference §8); the body's own key is looked at while parsing.
        let header_time = property("iothub-creation-time-utc")
            .and_then(parse_iso)
            .or_else(|| property("iothub-app-iothub-creation-time-utc").and_then(parse_iso))
            .or(enqueued_at)
            .or_else(|| property("iothub-enqueuedtime").and_then(parse_iso));
        match source {
            SourceKind::Telemetry => {
                // The whole body goes to d2cMessages subscribers, whatever it holds.
                let wants_message = self.devices.get(&*device_id).is_some_and(|d| d.wants(|a| a.subs.d2c_messages));
                let message = wants_message.then(|| crate::ingest::message_json(&body));
                let parsed = match crate::ingest::parse_telemetry_checked(&body, &self.settings) {
                    Ok(parsed) => parsed,
                    Err(fault) => {
                        FAULTS.record(fault, Some(&device_id), "telemetry body");
                        let at = header_time.unwrap_or_else(now_millis);
                        let device = Arc::from(&*device_id);
                        return message.map(|message| Publication { device, at, message: Some(message), ..Default::default() });
                    }
                };
                let at = parsed.timestamp.or(header_time).unwrap_or_else(now_millis);
                let connection_ttl = self.timing.connection_ttl;
                let device = self.devices.entry_ref(&*device_id).or_default();
                let subscribed = subscribed_any(device);
                let mut publication = Publication { at, message, ..Default::default() };
                if subscribed {
                    publication.device = Arc::from(&*device_id);
                }
                for (key, json) in parsed.values {
                    if subscribed {
                        publication.telemetry.push((Box::from(&*key), json.clone()));
                    }
                    // Keys repeat message after message: allocate one only the first time.
                    match device.telemetry.get_mut(&*key) {
                        Some(last) => *last = LastValue { json, at },
                        None => {
                            device.telemetry.insert(Box::from(key), LastValue { json, at });
                        }
                    }
                }
                let connected = match parsed.connection_state {
                    Some(state) => Some(state),
                    None if self.settings.custom_connection_state_key.is_empty()
                        && self.settings.connection_state_on_telemetry =>
                    {
                        Some(true)
                    }
                    None => None,
                };
                if let Some(connected) = connected {
                    let sequence = device.connection.as_mut().and_then(|c| c.sequence.take());
                    device.connection = Some(ConnectionState { connected, at, sequence });
                    publication.connection = Some(connected);
                }
                device.last_seen = Some(now);
                Self::arm_offline_check(&mut self.offline_due, connection_ttl, &device_id, device, now);
                return subscribed.then_some(publication);
            }
            SourceKind::TwinChange => {
                let doc = match serde_json::from_slice::<Value>(&body) {
                    Ok(doc @ Value::Object(_)) => doc,
                    Ok(_) => {
                        FAULTS.record(Fault::NotObject, Some(&device_id), "twin change body");
                        return None;
                    }
                    Err(_) => {
                        FAULTS.record(Fault::NotJson, Some(&device_id), "twin change body");
                        return None;
                    }
                };
                let at = header_time.unwrap_or_else(now_millis);
                let replace = property("opType") == Some("replaceTwin");
                let hub = self.hub_twins.is_some();
                let device = self.devices.entry_ref(&*device_id).or_default();
                // Twin versions only grow: an event not newer than the cached twin arrived late.
                if let (Some(new), Some(cached)) = (twin_version(&doc), device.twin.as_ref().and_then(|t| twin_version(&t.doc))) {
                    if new <= cached {
                        tracing::debug!(device = &*device_id, new, cached, "stale twin change dropped");
                        return None;
                    }
                }
                // With a hub, a change alone is never taken for the twin: it waits for the
                // whole twin to be read (behind the changes already waiting, to keep order).
                if hub && !replace && (device.twin.is_none() || device.twin_pending.is_some()) {
                    if device.twin_pending.is_none() && !device.wants(|a| a.subs.device_twin) {
                        // Nobody to push to; a later read asks the hub anyway.
                        self.prune(&device_id); // the entry made above, if it holds nothing
                        return None;
                    }
                    let pending = device.twin_pending.get_or_insert_with(|| {
                        self.twin_fetches.push(device_id.clone());
                        Box::default()
                    });
                    pending.hold(doc, at);
                    return None;
                }
                if replace {
                    // A whole twin: the changes waiting for one are older and included.
                    device.twin_pending = None;
                }
                match (replace, device.twin.as_mut()) {
                    (true, _) | (_, None) => device.twin = Some(Twin { doc, at }),
                    (_, Some(twin)) => {
                        merge_patch(&mut twin.doc, doc);
                        twin.at = at;
                    }
                }
                if device.wants(|a| a.subs.device_twin) {
                    let twin = device.twin.as_ref().map(|t| t.doc.to_string());
                    return Some(Publication { device: Arc::from(&*device_id), at, twin, ..Default::default() });
                }
            }
            SourceKind::ConnectionState => {
                if !self.settings.custom_connection_state_key.is_empty() {
                    return None; // the body key is the only source of truth then (reference §9)
                }
                let connected = match property("opType") {
                    Some("deviceConnected") => true,
                    Some("deviceDisconnected") => false,
                    other => {
                        tracing::debug!(device = &*device_id, op = ?other, "unknown connection event");
                        return None;
                    }
                };
                let sequence: Option<Box<str>> = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v.get("sequenceNumber").and_then(Value::as_str).map(Into::into));
                let at = header_time.unwrap_or_else(now_millis);
                let device = self.devices.entry_ref(&*device_id).or_default();
                if let (Some(new), Some(old)) =
                    (sequence.as_deref(), device.connection.as_ref().and_then(|c| c.sequence.as_deref()))
                {
                    if sequence_order(new, old).is_le() {
                        tracing::debug!(device = &*device_id, new, old, "stale connection event dropped");
                        return None;
                    }
                }
                device.connection = Some(ConnectionState { connected, at, sequence });
                device.last_seen = Some(now);
                let connection_ttl = self.timing.connection_ttl;
                Self::arm_offline_check(&mut self.offline_due, connection_ttl, &device_id, device, now);
                if device.wants(|a| a.subs.connection_state) {
                    return Some(Publication { device: Arc::from(&*device_id), at, connection: Some(connected), ..Default::default() });
                }
            }
            SourceKind::Lifecycle => {
                if property("opType") == Some("deleteDeviceIdentity") {
                    if let Some(d) = self.devices.get_mut(&*device_id) {
                        d.telemetry = HashMap::new();
                        d.twin = None;
                        d.hub_twin_read = None;
                        d.twin_pending = None;
                        d.connection = None;
                    }
                    self.prune(&device_id);
                }
            }
        }
        None
    }

    fn arm_offline_check(
        due: &mut BinaryHeap<Reverse<(Instant, Box<str>)>>,
        ttl: Option<Duration>,
        device_id: &str,
        device: &mut Device,
        now: Instant,
    ) {
        if let (Some(ttl), Some(c)) = (ttl, &device.connection) {
            if c.connected && !device.offline_check_armed {
                device.offline_check_armed = true;
                due.push(Reverse((now + ttl, device_id.into())));
            }
        }
    }

    /// Pushes a publication to every session subscribed to what it carries.
    pub fn publish(&mut self, device_id: &Arc<str>, p: Publication, now: Instant, out: &mut Vec<Delivery>) {
        let throttle = self.timing.throttle;
        let Some(device) = self.devices.get_mut(&**device_id) else { return };
        let timestamp = iso(p.at);
        let envelope = EnvelopeBuilder::new(device_id, &timestamp);
        // Built on first use, shared by every session that gets the same content.
        let mut all_telemetry: Option<Arc<str>> = None;
        let mut connection: Option<Arc<str>> = None;
        let mut twin: Option<Arc<str>> = None;
        let mut message: Option<Arc<str>> = None;
        for (&session, access) in device.access.iter_mut() {
            let subs = &access.subs;
            if subs.is_empty() {
                continue;
            }
            let mut send = |kind: FrameKind, frame: Arc<str>| {
                out.push(Delivery { session, device: device_id.clone(), kind, frame, arrived: p.arrived });
            };
            if !p.telemetry.is_empty() && !subs.telemetry.is_empty() {
                match throttle {
                    Some(interval) => {
                        let throttled = access.throttle.get_or_insert_with(Default::default);
                        let free = !throttled.armed
                            && throttled.last_sent.is_none_or(|t| now.duration_since(t) >= interval);
                        if free {
                            let values = p.telemetry.iter().filter(|(k, _)| access.subs.telemetry.contains_key(k));
                            if values.clone().next().is_some() {
                                throttled.last_sent = Some(now);
                                send(FrameKind::Telemetry, envelope.telemetry(values.map(|(k, v)| (&**k, &**v))));
                            }
                        } else {
                            for (k, v) in p.telemetry.iter().filter(|(k, _)| access.subs.telemetry.contains_key(k)) {
                                match throttled.pending.iter_mut().find(|(pk, _)| pk == k) {
                                    Some(slot) => slot.1 = v.clone(),
                                    None => throttled.pending.push((k.clone(), v.clone())),
                                }
                                throttled.pending_at = throttled.pending_at.max(p.at);
                            }
                            if !throttled.armed && !throttled.pending.is_empty() {
                                throttled.armed = true;
                                let due = throttled.last_sent.map_or(now, |t| t + interval);
                                self.throttle_due.push(Reverse((due, (**device_id).into(), session)));
                            }
                        }
                    }
                    None if subs.telemetry.all => {
                        let frame = all_telemetry
                            .get_or_insert_with(|| envelope.telemetry(p.telemetry.iter().map(|(k, v)| (&**k, &**v))))
                            .clone();
                        send(FrameKind::Telemetry, frame);
                    }
                    None => {
                        let values = p.telemetry.iter().filter(|(k, _)| subs.telemetry.contains_key(k));
                        if values.clone().next().is_some() {
                            send(FrameKind::Telemetry, envelope.telemetry(values.map(|(k, v)| (&**k, &**v))));
                        }
                    }
                }
            }
            let subs = &access.subs;
            if let (Some(c), true) = (p.connection, subs.connection_state) {
                send(FrameKind::ConnectionState, connection.get_or_insert_with(|| envelope.connection_state(c)).clone());
            }
            if let (Some(t), true) = (&p.twin, subs.device_twin) {
                send(FrameKind::DeviceTwin, twin.get_or_insert_with(|| envelope.device_twin(t)).clone());
            }
            if let (Some(m), true) = (&p.message, subs.d2c_messages) {
                send(FrameKind::Message, message.get_or_insert_with(|| envelope.message(m)).clone());
            }
        }
    }

    /// The earliest pending timer (a trailing throttle flush or an off-line check): the core's
    /// clock sleeps until it. Entries may be stale; waking for one costs a heap pop.
    pub fn next_deadline(&self) -> Option<Instant> {
        let throttle = self.throttle_due.peek().map(|Reverse((t, _, _))| *t);
        let offline = self.timing.connection_ttl.and(self.offline_due.peek().map(|Reverse((t, _))| *t));
        throttle.into_iter().chain(offline).min()
    }

    /// Sends the telemetry held back by throttling whose interval has passed.
    pub fn flush_throttled(&mut self, now: Instant, out: &mut Vec<Delivery>) {
        while let Some(Reverse((due, _, _))) = self.throttle_due.peek() {
            if *due > now {
                break;
            }
            let Reverse((_, device_id, session)) = self.throttle_due.pop().expect("peeked");
            let Some(access) = self.devices.get_mut(&*device_id).and_then(|d| d.access.get_mut(&session)) else {
                continue;
            };
            let Some(throttled) = access.throttle.as_deref_mut() else { continue };
            throttled.armed = false;
            let pending = std::mem::take(&mut throttled.pending);
            // Subscriptions may have changed since the keys were held back.
            let values: SmallVec<[(Box<str>, Arc<str>); 4]> =
                pending.into_iter().filter(|(k, _)| access.subs.telemetry.contains_key(k)).collect();
            if values.is_empty() {
                continue;
            }
            throttled.last_sent = Some(now);
            let device: Arc<str> = Arc::from(&*device_id);
            let envelope = EnvelopeBuilder::new(&device, &iso(throttled.pending_at));
            let frame = envelope.telemetry(values.iter().map(|(k, v)| (&**k, &**v)));
            out.push(Delivery { session, device, kind: FrameKind::Telemetry, frame, arrived: None });
        }
    }

    /// Marks devices silent for the connection-state TTL as disconnected and tells subscribers.
    pub fn expire_connections(&mut self, now: Instant, out: &mut Vec<Delivery>) {
        let Some(ttl) = self.timing.connection_ttl else { return };
        while let Some(Reverse((due, _))) = self.offline_due.peek() {
            if *due > now {
                break;
            }
            let Reverse((_, device_id)) = self.offline_due.pop().expect("peeked");
            let Some(device) = self.devices.get_mut(&*device_id) else { continue };
            let silent_since = device.last_seen.unwrap_or(now);
            let connected = device.connection.as_ref().is_some_and(|c| c.connected);
            if !connected {
                device.offline_check_armed = false;
            } else if silent_since + ttl > now {
                self.offline_due.push(Reverse((silent_since + ttl, device_id)));
            } else {
                device.offline_check_armed = false;
                self.dirty.device(&device_id);
                let at = now_millis();
                if let Some(c) = device.connection.as_mut() {
                    c.connected = false;
                    c.at = at;
                }
                tracing::debug!(device = &*device_id, "silent for the connection TTL: disconnected");
                let device: Arc<str> = Arc::from(&*device_id);
                let publication = Publication { device: device.clone(), at, connection: Some(false), ..Default::default() };
                self.publish(&device, publication, now, out);
            }
        }
    }

    pub fn holds_grant(&self, device: &str, session: SessionId, grant: &Grant) -> bool {
        self.access(device, session).is_some_and(|a| a.holds(grant))
    }

    /// IoT Hub configured: serve the twin only when it rests on a hub read that `ttl` still
    /// counts as fresh. A twin known only from change events may be partial (an `updateTwin`
    /// carries just the change), so it is never served in place of a hub read.
    fn read_hub_twin(&self, device: &str, viewer: Viewer, ttl: TwinCacheTtl) -> DeviceReply {
        if let Viewer::Session(s) = viewer {
            if !self.access(device, s).is_some_and(|a| a.grants.device_twin) {
                return DeviceReply::Body(Err(Rejection::new(403, "Forbidden to read device twin: missing grant")));
            }
        }
        let Some(d) = self.devices.get(device) else { return DeviceReply::Miss };
        let (Some(twin), Some(read)) = (d.twin.as_ref(), d.hub_twin_read) else { return DeviceReply::Miss };
        let fresh = match ttl {
            TwinCacheTtl::Off => false,
            TwinCacheTtl::Forever => true,
            TwinCacheTtl::For(ttl) => read.elapsed() < ttl,
        };
        if fresh {
            DeviceReply::Body(Ok(record(device, &twin.doc.to_string(), &iso(twin.at))))
        } else {
            DeviceReply::Miss
        }
    }

    /// Caches a twin from the hub and returns the record to serve. When the cached twin (a
    /// previous hub read or `replaceTwin`, plus change events) has a higher `version`, the
    /// events were newer than this read: the cached document is kept, its read time renewed.
    /// Without a twin cache (`-1`) the twin is kept only while a session may be pushed it, as
    /// the base later changes merge into, and the record served is the hub's own answer.
    fn store_hub_twin(&mut self, device: &str, doc: Value) -> String {
        let now = now_millis();
        let d = self.devices.entry_ref(device).or_default();
        if self.hub_twins == Some(TwinCacheTtl::Off) {
            let served = record(device, &doc.to_string(), &iso(now));
            if d.twin_watched() {
                Self::keep_whole_twin(d, doc, now);
            }
            self.prune(device);
            return served;
        }
        Self::keep_whole_twin(d, doc, now);
        let twin = d.twin.as_ref().expect("kept above");
        record(device, &twin.doc.to_string(), &iso(twin.at))
    }

    /// Takes a whole twin read from the hub, unless the one kept is newer.
    fn keep_whole_twin(d: &mut Device, doc: Value, at: Millis) {
        let newer_kept = match d.twin.as_ref() {
            Some(cached) => twin_version(&cached.doc).zip(twin_version(&doc)).is_some_and(|(c, n)| c > n),
            None => false,
        };
        if !newer_kept {
            d.twin = Some(Twin { doc, at });
        }
        d.hub_twin_read = Some(Instant::now());
    }

    /// The hub's answer to a whole-twin read asked by [`Self::take_twin_fetches`]: the changes
    /// that waited are merged into it, in order (those the read already holds, by `version`,
    /// are skipped), and the result is pushed whole. If the read failed, the changes are dropped
    /// (counted as `twin_unavailable`, logged) and nothing is pushed: a change alone is not
    /// the twin; the next change asks the hub again. Returns true when the twin must be read
    /// again (changes were dropped while this read was on its way).
    pub fn hub_twin_fetched(
        &mut self,
        device_id: &str,
        read: Result<Value, Rejection>,
        now: Instant,
        out: &mut Vec<Delivery>,
    ) -> bool {
        self.dirty.device(device_id);
        let Some(device) = self.devices.get_mut(device_id) else { return false };
        let Some(mut pending) = device.twin_pending.take() else {
            return false; // a replaceTwin or a lifecycle event settled it meanwhile
        };
        if pending.overflowed {
            pending.overflowed = false;
            device.twin_pending = Some(pending);
            return true;
        }
        let Some(&(_, at)) = pending.changes.last() else { return false };
        let wanted = device.wants(|a| a.subs.device_twin);
        match read {
            Ok(doc) if doc.is_object() => Self::keep_whole_twin(device, doc, at),
            // A read answered meanwhile (GET /deviceTwin) left a whole twin to merge into.
            _ if device.twin.is_some() => {}
            failed => {
                let why = match failed {
                    Err(r) => format!("IoT Hub twin read failed: {} {}", r.status, r.message),
                    Ok(_) => "IoT Hub twin read answered no JSON object".to_string(),
                };
                for _ in &pending.changes {
                    FAULTS.record(Fault::TwinUnavailable, Some(device_id), &why);
                }
                self.prune(device_id);
                return false;
            }
        }
        let twin = device.twin.as_mut().expect("a whole twin is known here");
        for (change, _) in pending.changes {
            // Changes the read already holds are skipped by version.
            if twin_version(&change).zip(twin_version(&twin.doc)).is_none_or(|(new, kept)| new > kept) {
                merge_patch(&mut twin.doc, change);
            }
        }
        twin.at = at;
        if wanted {
            let whole = Some(twin.doc.to_string());
            let device_arc: Arc<str> = Arc::from(device_id);
            let publication = Publication { device: device_arc.clone(), at, twin: whole, ..Default::default() };
            self.publish(&device_arc, publication, now, out);
        }
        self.prune(device_id); // the sessions may have gone while the hub was read
        false
    }
}

impl PendingTwin {
    /// Holds one more change, within the bounds (see the type).
    fn hold(&mut self, change: Value, at: Millis) {
        let size = change.to_string().len();
        if self.changes.len() >= PENDING_TWIN_CHANGES || self.bytes + size > PENDING_TWIN_BYTES {
            self.changes.clear();
            self.bytes = 0;
            self.overflowed = true;
        }
        // A change bigger than the whole bound is not held either: the read again after the
        // one in flight brings it (the hub applied it before it was sent on).
        if size > PENDING_TWIN_BYTES {
            return;
        }
        self.bytes += size;
        self.changes.push((change, at));
    }
}

/// A twin document's `version` (the whole twin's; changes carry it too).
fn twin_version(doc: &Value) -> Option<i64> {
    doc.get("version").and_then(Value::as_i64)
}

/// IoT Hub sequence numbers are hex strings (usually fixed-width): compare them as numbers.
fn sequence_order(a: &str, b: &str) -> std::cmp::Ordering {
    let (a, b) = (a.trim_start_matches('0'), b.trim_start_matches('0'));
    a.len().cmp(&b.len()).then_with(|| a.to_ascii_uppercase().cmp(&b.to_ascii_uppercase()))
}

/// JSON merge patch (RFC 7396): objects merge recursively, `null` deletes, the rest replaces.
pub fn merge_patch(target: &mut Value, patch: Value) {
    match patch {
        Value::Object(patch) => {
            if !target.is_object() {
                *target = Value::Object(Default::default());
            }
            let map = target.as_object_mut().expect("made an object above");
            for (k, v) in patch {
                if v.is_null() {
                    map.remove(&k);
                } else {
                    merge_patch(map.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        let settings = IngestSettings {
            custom_timestamp_key: "_ts".into(),
            custom_device_id_key: "deviceId".into(),
            custom_connection_state_key: String::new(),
            connection_state_on_telemetry: true,
        };
        let mut table = DeviceTable::new(settings, PushTiming { throttle: None, connection_ttl: None });
        let read = |t: &mut DeviceTable, ttl| t.apply(DeviceOp::ReadHubTwin { device: "d".into(), viewer: Viewer::Admin, ttl });
        assert_eq!(read(&mut table, TwinCacheTtl::Forever), DeviceReply::Miss);
        table.apply(DeviceOp::StoreHubTwin { device: "d".into(), doc: json!({"version": 5, "a": 1}) });
        assert_eq!(read(&mut table, TwinCacheTtl::Off), DeviceReply::Miss);
        let DeviceReply::Body(Ok(body)) = read(&mut table, TwinCacheTtl::Forever) else { panic!("cached") };
        assert!(body.contains(r#""a":1"#), "{body}");
        // An older hub read does not replace a newer cached twin.
        let reply = table.apply(DeviceOp::StoreHubTwin { device: "d".into(), doc: json!({"version": 4, "a": 0}) });
        assert!(matches!(&reply, DeviceReply::Body(Ok(b)) if b.contains(r#""a":1"#)), "{reply:?}");
        let short = TwinCacheTtl::For(std::time::Duration::from_millis(1));
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(read(&mut table, short), DeviceReply::Miss);
    }

    /// More changes than a device may hold while its whole twin is read: they are dropped and
    /// the twin read again (that read includes them); the changes after it are merged.
    #[test]
    fn twin_changes_held_beyond_the_bound_make_the_twin_read_again() {
        use crate::ids::SessionId;
        use crate::model::{DataKind, GrantKind, Subscription};
        let settings = IngestSettings {
            custom_timestamp_key: "_ts".into(),
            custom_device_id_key: "deviceId".into(),
            custom_connection_state_key: String::new(),
            connection_state_on_telemetry: true,
        };
        let mut table = DeviceTable::new(settings, PushTiming { throttle: None, connection_ttl: None })
            .with_hub_twins(TwinCacheTtl::Off);
        let session = SessionId(7);
        let grant = Grant { kind: GrantKind::Data(DataKind::DeviceTwin), key: None };
        table.apply(DeviceOp::Grant { device: "d".into(), session, grant });
        let sub = Subscription { kind: DataKind::DeviceTwin, key: None };
        assert_eq!(table.apply(DeviceOp::Subscribe { device: "d".into(), session, sub }), DeviceReply::Permitted(true));
        let now = Instant::now();
        let change = |version: usize| IngestMessage {
            device_id: "d".into(),
            source: SourceKind::TwinChange,
            properties: smallvec::smallvec![("opType".into(), "updateTwin".into())],
            body: format!(r#"{{"version":{version},"properties":{{"reported":{{"n":{version}}}}}}}"#).into_bytes(),
            enqueued_at: None,
            arrived: None,
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

    #[test]
    fn sequence_numbers_compare_as_fixed_width_hex() {
        assert!(sequence_order("000000000000000001D4", "000000000000000001D5").is_lt());
        assert!(sequence_order("1D5", "0000000001D4").is_gt());
    }
}
