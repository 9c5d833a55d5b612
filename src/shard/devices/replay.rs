//! A rebuild's frames (docs/design/recovery.md step 11): device messages kept in a ring
//! (`cluster/ring.rs`) turned into what one session would have been sent, by that session's
//! subscriptions here now. Pure: nothing is applied again, no last value, twin or throttle
//! state moves.
//!
//! Why only telemetry sources: a twin change or a connection event is decided against the
//! device's state when it came (a stale twin version, an older connection sequence number
//! is dropped), which a re-run cannot know; a ring holding one after the client's cut, for a
//! session subscribed to that kind, fails the rebuild (`history_lost`) rather than guess. With
//! throttling on, what was sent depended on timing a re-run does not have: refused as well.

use std::sync::Arc;

use super::*;

/// Why a rebuild's frames could not be made.
pub type Refused = &'static str;

impl DeviceTable {
    /// The frames `session` would have been sent for `msgs` (messages of `device`, oldest
    /// first), each with its message's key.
    pub fn replay_frames(&self, session: SessionId, device: &Arc<str>, msgs: &[IngestMessage]) -> Result<Vec<Delivery>, Refused> {
        let mut out = Vec::new();
        if msgs.is_empty() {
            return Ok(out);
        }
        let Some(access) = self.devices.get(&**device).and_then(|d| d.access.get(session)) else {
            return Ok(out); // not subscribed here (any more)
        };
        if access.subs_empty() {
            return Ok(out);
        }
        if self.timing.throttle.is_some() && access.subscribed_telemetry() {
            return Err("throttled telemetry");
        }
        for msg in msgs {
            if msg.source != SourceKind::Telemetry {
                if access.subscribed_twin() || access.subscribed_connection_state() {
                    return Err("a twin or connection event");
                }
                continue;
            }
            let mut parsed = crate::ingest::ParsedTelemetry::default();
            let ok = crate::ingest::parse_telemetry_into(&msg.body, &self.settings, &mut parsed).is_ok();
            let property = |name: &str| msg.properties.iter().find(|(k, _)| &**k == name).map(|(_, v)| &**v);
            let header_time = property("iothub-creation-time-utc")
                .and_then(parse_iso)
                .or_else(|| property("iothub-app-iothub-creation-time-utc").and_then(parse_iso))
                .or(msg.enqueued_at)
                .or_else(|| property("iothub-enqueuedtime").and_then(parse_iso));
            // Without a time of its own: when the instance that took it in did (its key's).
            let at = parsed.timestamp.or(header_time).unwrap_or(if msg.key.ms > 0 { msg.key.ms } else { now_millis() });
            let timestamp = iso(at);
            let envelope = EnvelopeBuilder::new(device, &timestamp);
            let mut send = |kind: FrameKind, frame: Arc<str>| {
                out.push(Delivery { session, device: device.clone(), kind, frame, arrived: None, key: msg.key });
            };
            if ok && access.subscribed_telemetry() {
                let subscribed = access.sub_telemetry();
                let values = parsed.values.iter().filter(|(k, _)| subscribed.all || subscribed.contains_key(k));
                if values.clone().next().is_some() {
                    send(FrameKind::Telemetry, envelope.telemetry(values.map(|(k, v)| (&**k, *v))));
                }
            }
            if ok && access.subscribed_connection_state() {
                let connected = match parsed.connection_state {
                    Some(state) => Some(state),
                    None if self.settings.custom_connection_state_key.is_empty() && self.settings.connection_state_on_telemetry => Some(true),
                    None => None,
                };
                if let Some(c) = connected {
                    send(FrameKind::ConnectionState, envelope.connection_state(c));
                }
            }
            if access.subscribed_messages() {
                send(FrameKind::Message, envelope.message(&crate::ingest::message_json(&msg.body)));
            }
        }
        Ok(out)
    }
}
