//! A device message applied to its device: last values, twin, connection state (with the
//! ordering rules: stale twin versions and connection sequence numbers are dropped), and what
//! it changed as a [`Publication`].

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::*;
use super::twin::twin_version;
use crate::ingest::ParsedTelemetry;

impl DeviceTable {
    /// Applies one device message and pushes what it changed to the device's subscribers.
    pub fn ingest_and_publish(&mut self, msg: IngestMessage, now: Instant, out: &mut Vec<Delivery>) {
        self.ingest_recording(&msg, now, out, None);
    }

    /// [`Self::ingest_and_publish`]; with `record` (a durable store is on), a device whose
    /// telemetry the message changed is handed to `record` at once, while its entry is in
    /// cache, the first time in this unit of work (until the next [`Self::drain_dirty`]);
    /// later changes in the unit are marked and drained as before, so the store's last record
    /// of a device is always its state at the commit. This saves the dirty set's hashing and
    /// allocation and the second look-up at the commit per device (issue 25 item 4).
    ///
    /// Returns `false` for a message read again from its partition (its key was applied
    /// already, design step 9: [`crate::ingest::ReadMark`]): counted, nothing applied or pushed.
    pub fn ingest_recording(
        &mut self,
        msg: &IngestMessage,
        now: Instant,
        out: &mut Vec<Delivery>,
        record: Option<&mut dyn FnMut(crate::shard::change::Change<'_>)>,
    ) -> bool {
        let rereads = self.rereads;
        if let Some(mut publication) = self.ingest(msg, now, record) {
            publication.arrived = msg.arrived;
            publication.key = msg.key;
            let device = publication.device.clone();
            self.publish(&device, publication, now, out);
        }
        self.rereads == rereads
    }

    /// Messages recognised as read again from their partition and not applied twice.
    pub fn rereads(&self) -> u64 {
        self.rereads
    }

    /// Whether `key` was applied to `device` already; counted when so (design step 9).
    #[inline]
    fn reread(rereads: &mut u64, device: &mut Device, key: crate::ingest::MsgKey) -> bool {
        let again = device.mark.take(key);
        *rereads += again as u64;
        again
    }

    /// Applies one device message to the owning shard; returns what subscribers should get
    /// (`None` when the device has no subscriber or nothing changed). `record`: see
    /// [`Self::ingest_recording`].
    pub fn ingest(
        &mut self,
        msg: &IngestMessage,
        now: Instant,
        record: Option<&mut dyn FnMut(crate::shard::change::Change<'_>)>,
    ) -> Option<Publication> {
        // Borrowed, not moved out: a message is a few hundred bytes.
        let IngestMessage { device_id, source, properties, body, enqueued_at, key, .. } = msg;
        let (device_id, body, source, enqueued_at, key): (&str, &[u8], _, _, _) = (device_id, body, *source, *enqueued_at, *key);
        if source != SourceKind::Telemetry || record.is_none() {
            self.dirty.device(device_id);
        }
        let property = |name: &str| properties.iter().find(|(k, _)| &**k == name).map(|(_, v)| &**v);
        // Timestamp resolution (reference §8); the body's own key is looked at while parsing.
        let header_time = property("iothub-creation-time-utc")
            .and_then(parse_iso)
            .or_else(|| property("iothub-app-iothub-creation-time-utc").and_then(parse_iso))
            .or(enqueued_at)
            .or_else(|| property("iothub-enqueuedtime").and_then(parse_iso));
        match source {
            SourceKind::Telemetry => {
                let mut parsed = ParsedTelemetry::default();
                match crate::ingest::parse_telemetry_into(body, &self.settings, &mut parsed) {
                    Ok(()) => {}
                    Err(fault) => {
                        FAULTS.record(fault, Some(device_id), "telemetry body");
                        if let Some(device) = self.devices.get_mut(device_id) {
                            if Self::reread(&mut self.rereads, device, key) {
                                return None;
                            }
                        }
                        self.dirty.device(device_id);
                        // The whole body goes to d2cMessages subscribers, whatever it holds.
                        let wants_message = self.devices.get(device_id).is_some_and(|d| d.wants(|a| a.subscribed_messages()));
                        let at = header_time.unwrap_or_else(now_millis);
                        return wants_message.then(|| Publication {
                            device: Arc::from(device_id),
                            at,
                            message: Some(crate::ingest::message_json(body)),
                            ..Default::default()
                        });
                    }
                }
                let at = match parsed.timestamp.or(header_time) {
                    Some(at) => at,
                    None => self.wall_clock(now),
                };
                let connection_ttl = self.timing.connection_ttl;
                let source = self.source;
                // One look-up of the device per message; its id is compared in the bucket.
                let device = self.devices.entry_ref(&Lookup::new(device_id)).or_default();
                if Self::reread(&mut self.rereads, device, key) {
                    return None;
                }
                Self::stamp(source, device);
                let subscribed = subscribed_any(device);
                // Built only for subscribers (most messages have none): a `Publication` is
                // ~400 bytes to fill, move and drop.
                let mut publication = subscribed.then(|| {
                    let message = device.wants(|a| a.subscribed_messages()).then(|| crate::ingest::message_json(body));
                    Publication { at, message, device: Arc::from(device_id), ..Default::default() }
                });
                // Kept as they were sent, over the old values (no allocation once the device
                // has its keys: [`Telemetry`]).
                for (i, (key, text)) in parsed.values.iter().enumerate() {
                    device.telemetry.set(i, key, text, at);
                }
                if let Some(publication) = publication.as_mut() {
                    // What subscribers get: the message's values in one allocation.
                    let texts = JsonText::share(parsed.values.iter().map(|(_, v)| *v), &mut self.scratch);
                    for ((key, _), json) in parsed.values.iter().zip(texts) {
                        publication.telemetry.push((Box::from(&**key), json));
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
                    if let Some(publication) = publication.as_mut() {
                        publication.connection = Some(connected);
                    }
                }
                device.last_seen = Some(now);
                Self::arm_offline_check(&mut self.offline_due, connection_ttl, device_id, device, now);
                if let Some(record) = record {
                    if device.recorded_in != self.dirty.unit {
                        device.recorded_in = self.dirty.unit;
                        record(crate::shard::change::Change::Device { id: device_id, device: Some(device) });
                    } else {
                        self.dirty.device(device_id);
                    }
                }
                return publication;
            }
            SourceKind::TwinChange => {
                self.event = replay::Event::Nothing;
                let doc = match serde_json::from_slice::<Value>(body) {
                    Ok(doc @ Value::Object(_)) => doc,
                    Ok(_) => {
                        FAULTS.record(Fault::NotObject, Some(device_id), "twin change body");
                        return None;
                    }
                    Err(_) => {
                        FAULTS.record(Fault::NotJson, Some(device_id), "twin change body");
                        return None;
                    }
                };
                let at = header_time.unwrap_or_else(now_millis);
                let replace = property("opType") == Some("replaceTwin");
                let hub = self.hub_twins.is_some();
                let source = self.source;
                let device = self.devices.entry_ref(device_id).or_default();
                if Self::reread(&mut self.rereads, device, key) {
                    return None;
                }
                // Twin versions only grow: an event not newer than the cached twin arrived late.
                if let (Some(new), Some(cached)) = (twin_version(&doc), device.twin.as_ref().and_then(|t| twin_version(&t.doc))) {
                    if new <= cached {
                        tracing::debug!(device = device_id, new, cached, "stale twin change dropped");
                        return None;
                    }
                }
                // With a hub, a change alone is never taken for the twin: it waits for the
                // whole twin to be read (behind the changes already waiting, to keep order).
                if hub && !replace && (device.twin.is_none() || device.twin_pending.is_some()) {
                    // Held (or, with nobody here to push to, dropped until a read): a twin
                    // subscriber elsewhere gets its frame later, from a read, without a key.
                    self.event = replay::Event::Held;
                    if device.twin_pending.is_none() && !device.wants(|a| a.subscribed_twin()) {
                        // Nobody to push to; a later read asks the hub anyway.
                        self.prune(device_id); // the entry made above, if it holds nothing
                        return None;
                    }
                    let pending = device.twin_pending.get_or_insert_with(|| {
                        self.twin_fetches.push(device_id.into());
                        Box::default()
                    });
                    pending.hold(doc, at);
                    return None;
                }
                if replace {
                    // A whole twin: the changes waiting for one are older and included.
                    device.twin_pending = None;
                }
                Self::stamp(source, device);
                match (replace, device.twin.as_mut()) {
                    (true, _) | (_, None) => device.twin = Some(Twin { doc, at }),
                    (_, Some(twin)) => {
                        merge_patch(&mut twin.doc, doc);
                        twin.at = at;
                    }
                }
                self.event = replay::Event::Twin { at };
                if device.wants(|a| a.subscribed_twin()) {
                    let twin = device.twin.as_ref().map(|t| t.doc.to_string());
                    return Some(Publication { device: Arc::from(device_id), at, twin, ..Default::default() });
                }
            }
            SourceKind::ConnectionState => {
                self.event = replay::Event::Nothing;
                if !self.settings.custom_connection_state_key.is_empty() {
                    return None; // the body key is the only source of truth then (reference §9)
                }
                let connected = match property("opType") {
                    Some("deviceConnected") => true,
                    Some("deviceDisconnected") => false,
                    other => {
                        tracing::debug!(device = device_id, op = ?other, "unknown connection event");
                        return None;
                    }
                };
                let sequence: Option<Box<str>> = serde_json::from_slice::<Value>(body)
                    .ok()
                    .and_then(|v| v.get("sequenceNumber").and_then(Value::as_str).map(Into::into));
                let at = header_time.unwrap_or_else(now_millis);
                let source = self.source;
                let device = self.devices.entry_ref(device_id).or_default();
                if Self::reread(&mut self.rereads, device, key) {
                    return None;
                }
                if let (Some(new), Some(old)) =
                    (sequence.as_deref(), device.connection.as_ref().and_then(|c| c.sequence.as_deref()))
                {
                    if sequence_order(new, old).is_le() {
                        tracing::debug!(device = device_id, new, old, "stale connection event dropped");
                        return None;
                    }
                }
                device.connection = Some(ConnectionState { connected, at, sequence });
                Self::stamp(source, device);
                self.event = replay::Event::Connection { at, connected };
                device.last_seen = Some(now);
                let connection_ttl = self.timing.connection_ttl;
                Self::arm_offline_check(&mut self.offline_due, connection_ttl, device_id, device, now);
                if device.wants(|a| a.subscribed_connection_state()) {
                    return Some(Publication { device: Arc::from(device_id), at, connection: Some(connected), ..Default::default() });
                }
            }
            SourceKind::Lifecycle => {
                if property("opType") == Some("deleteDeviceIdentity") {
                    if let Some(d) = self.devices.get_mut(device_id) {
                        d.telemetry.clear();
                        d.twin = None;
                        d.hub_twin_read = None;
                        d.twin_pending = None;
                        d.connection = None;
                    }
                    self.prune(device_id);
                }
            }
        }
        None
    }

    /// The wall-clock time of messages applied at `now`, read once per `now`: the messages of
    /// a batch share one `now`, and so one time when they carry none of their own.
    fn wall_clock(&mut self, now: Instant) -> Millis {
        match self.wall_clock {
            Some((at, millis)) if at == now => millis,
            _ => {
                let millis = now_millis();
                self.wall_clock = Some((now, millis));
                millis
            }
        }
    }

    pub(super) fn arm_offline_check(
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
}

/// IoT Hub sequence numbers are hex strings (usually fixed-width): compare them as numbers.
pub(super) fn sequence_order(a: &str, b: &str) -> std::cmp::Ordering {
    let (a, b) = (a.trim_start_matches('0'), b.trim_start_matches('0'));
    a.len().cmp(&b.len()).then_with(|| a.to_ascii_uppercase().cmp(&b.to_ascii_uppercase()))
}
