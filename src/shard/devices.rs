//! The devices a core owns: last values, twin, connection state, and per-session access.
//!
//! Telemetry values are kept as their JSON text, so answering a read or building a push frame
//! is concatenation, never re-serialisation.

use hashbrown::HashMap;
use serde_json::Value;

use crate::ids::SessionId;
use crate::ingest::faults::{Fault, FAULTS};
use crate::ingest::{IngestMessage, IngestSettings, SourceKind};
use crate::model::{Grant, Rejection};
use crate::shard::access::Access;
use crate::shard::{DeviceOp, DeviceReply, Viewer};
use crate::timefmt::{iso, now_millis, parse_iso, Millis};

pub struct LastValue {
    pub json: Box<str>,
    pub at: Millis,
}

pub struct Twin {
    pub doc: Value,
    pub at: Millis,
}

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
}

impl Device {
    fn has_data(&self) -> bool {
        !self.telemetry.is_empty() || self.twin.is_some() || self.connection.is_some()
    }
}

pub struct DeviceTable {
    devices: HashMap<Box<str>, Device>,
    settings: IngestSettings,
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
    pub fn new(settings: IngestSettings) -> Self {
        Self { devices: HashMap::new(), settings }
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
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
        if let Some(d) = self.devices.get_mut(device) {
            d.access.retain(|_, a| !a.is_empty());
            if !d.has_data() && d.access.is_empty() {
                self.devices.remove(device);
            }
        }
    }

    pub fn apply(&mut self, op: DeviceOp) -> DeviceReply {
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

    /// Applies one device message to the owning shard.
    pub fn ingest(&mut self, msg: IngestMessage) {
        let IngestMessage { device_id, source, properties, mut body, enqueued_at } = msg;
        let property = |name: &str| properties.iter().find(|(k, _)| &**k == name).map(|(_, v)| &**v);
        // Timestamp resolution (reference §8); the body's own key is looked at while parsing.
        let header_time = property("iothub-creation-time-utc")
            .and_then(parse_iso)
            .or_else(|| property("iothub-app-iothub-creation-time-utc").and_then(parse_iso))
            .or(enqueued_at)
            .or_else(|| property("iothub-enqueuedtime").and_then(parse_iso));
        match source {
            SourceKind::Telemetry => {
                let parsed = match crate::ingest::parse_telemetry_checked(&mut body, &self.settings) {
                    Ok(parsed) => parsed,
                    Err(fault) => {
                        FAULTS.record(fault, Some(&device_id), "telemetry body");
                        return;
                    }
                };
                let at = parsed.timestamp.or(header_time).unwrap_or_else(now_millis);
                let device = self.devices.entry_ref(&*device_id).or_default();
                for (key, json) in parsed.values {
                    device.telemetry.insert(key, LastValue { json, at });
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
                }
            }
            SourceKind::TwinChange => {
                let doc = match serde_json::from_slice::<Value>(&body) {
                    Ok(doc @ Value::Object(_)) => doc,
                    Ok(_) => return FAULTS.record(Fault::NotObject, Some(&device_id), "twin change body"),
                    Err(_) => return FAULTS.record(Fault::NotJson, Some(&device_id), "twin change body"),
                };
                let at = header_time.unwrap_or_else(now_millis);
                let device = self.devices.entry_ref(&*device_id).or_default();
                match (property("opType"), device.twin.as_mut()) {
                    (Some("replaceTwin"), _) | (_, None) => device.twin = Some(Twin { doc, at }),
                    (_, Some(twin)) => {
                        merge_patch(&mut twin.doc, doc);
                        twin.at = at;
                    }
                }
            }
            SourceKind::ConnectionState => {
                if !self.settings.custom_connection_state_key.is_empty() {
                    return; // the body key is the only source of truth then (reference §9)
                }
                let connected = match property("opType") {
                    Some("deviceConnected") => true,
                    Some("deviceDisconnected") => false,
                    other => {
                        tracing::debug!(device = &*device_id, op = ?other, "unknown connection event");
                        return;
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
                        return;
                    }
                }
                device.connection = Some(ConnectionState { connected, at, sequence });
            }
            SourceKind::Lifecycle => {
                if property("opType") == Some("deleteDeviceIdentity") {
                    if let Some(d) = self.devices.get_mut(&*device_id) {
                        d.telemetry = HashMap::new();
                        d.twin = None;
                        d.connection = None;
                    }
                    self.prune(&device_id);
                }
            }
        }
    }

    pub fn holds_grant(&self, device: &str, session: SessionId, grant: &Grant) -> bool {
        self.access(device, session).is_some_and(|a| a.holds(grant))
    }
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
    fn merge_patch_merges_deep_and_deletes_null() {
        let mut twin = json!({"version": 1, "properties": {"reported": {"a": 1, "b": {"c": 2}}}});
        merge_patch(&mut twin, json!({"version": 2, "properties": {"reported": {"b": {"d": 3}, "a": null}}}));
        assert_eq!(twin, json!({"version": 2, "properties": {"reported": {"b": {"c": 2, "d": 3}}}}));
    }

    #[test]
    fn sequence_numbers_compare_as_fixed_width_hex() {
        assert!(sequence_order("000000000000000001D4", "000000000000000001D5").is_lt());
        assert!(sequence_order("1D5", "0000000001D4").is_gt());
    }
}
