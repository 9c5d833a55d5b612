//! A rebuild's frames (docs/design/recovery.md step 11): device messages kept in a ring
//! (`cluster/ring.rs`) turned into what one session would have been sent, by that session's
//! subscriptions here now. Pure: nothing is applied again, no last value, twin or throttle
//! state moves.
//!
//! **Telemetry** is made again from the message alone (its frames depend on nothing of the
//! device's state). **A twin change or a connection event** is decided against the device's
//! state when it came (a stale twin version or an older connection sequence number is
//! dropped, a change is merged into the twin held), which a re-run cannot know: so the ring
//! keeps, with each such message, what the live path decided for it on the instance that
//! kept it ([`Decided`], from [`DeviceTable::decided`] right after the message was applied):
//! the whole twin after the change and its time, the connection state and its time, or that
//! nothing was sent. The frames are the ones [`DeviceTable::publish`] makes of that decision
//! for the session's access. The one decision that gives no frame then and a keyless one
//! later (a change held for a hub read of the whole twin, [`Decided::Held`]) fails a rebuild
//! for a session subscribed to twins (`history_lost`) rather than guess.
//!
//! With throttling on, what was sent depended on timing a re-run does not have: refused.

use std::sync::Arc;

use super::*;

/// Why a rebuild's frames could not be made.
pub type Refused = &'static str;

/// What the live path decided for a message that is not telemetry, where it was applied
/// (design step 11): kept with the message in a device ring, so a rebuild sends what the
/// session was sent, not a guess.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// Telemetry: its frames are made again from the message alone.
    FromMessage,
    /// A twin change applied: the whole twin after it (as twin subscribers were sent it) and
    /// its time.
    Twin { at: Millis, doc: Arc<str> },
    /// A connection event applied.
    Connection { at: Millis, connected: bool },
    /// Nothing sent to anyone: a stale twin version or connection sequence number, a body
    /// that is not an object, an unknown event, a lifecycle event.
    Nothing,
    /// A twin change held for a hub read of the whole twin (its frame, if any, came later
    /// without a key): a rebuild for a twin subscriber is refused.
    Held,
}

impl Decided {
    /// Bytes it holds beyond its size (charged to the ring with its message).
    pub fn charge(&self) -> usize {
        match self {
            Decided::Twin { doc, .. } => doc.len(),
            _ => 0,
        }
    }
}

/// A message kept in a device ring, what was decided for it, and when it was applied there.
#[derive(Debug, Clone)]
pub struct Kept {
    pub msg: IngestMessage,
    pub decided: Decided,
    pub at: Instant,
}

/// What [`DeviceTable::ingest`] decided for the last twin change or connection event it
/// applied (read at once by [`DeviceTable::decided`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) enum Event {
    #[default]
    Nothing,
    Twin { at: Millis },
    Connection { at: Millis, connected: bool },
    Held,
}

impl DeviceTable {
    /// What was decided for `msg`, the message this table applied last (design step 11,
    /// kept in its device's ring). Builds the twin's text only for a twin change applied.
    pub fn decided(&self, msg: &IngestMessage) -> Decided {
        match msg.source {
            SourceKind::Telemetry => Decided::FromMessage,
            SourceKind::Lifecycle => Decided::Nothing,
            SourceKind::TwinChange | SourceKind::ConnectionState => match self.event {
                Event::Nothing => Decided::Nothing,
                Event::Held => Decided::Held,
                Event::Connection { at, connected } => Decided::Connection { at, connected },
                Event::Twin { at } => match self.devices.get(&*msg.device_id).and_then(|d| d.twin.as_ref()) {
                    Some(twin) => Decided::Twin { at, doc: twin.doc.to_string().into() },
                    None => Decided::Nothing,
                },
            },
        }
    }

    /// The frames `session` would have been sent for `kept` (messages of `device`, oldest
    /// first, with what was decided for each), each with its message's key.
    pub fn replay_frames(&self, session: SessionId, device: &Arc<str>, kept: &[Kept]) -> Result<Vec<Delivery>, Refused> {
        let mut out = Vec::new();
        if kept.is_empty() {
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
        for Kept { msg, decided, .. } in kept {
            let mut send = |kind: FrameKind, frame: Arc<str>| {
                out.push(Delivery { session, device: device.clone(), kind, frame, arrived: None, key: msg.key });
            };
            match decided {
                Decided::Twin { at, doc } => {
                    if access.subscribed_twin() {
                        send(FrameKind::DeviceTwin, EnvelopeBuilder::new(device, &iso(*at)).device_twin(doc));
                    }
                    continue;
                }
                Decided::Connection { at, connected } => {
                    if access.subscribed_connection_state() {
                        send(FrameKind::ConnectionState, EnvelopeBuilder::new(device, &iso(*at)).connection_state(*connected));
                    }
                    continue;
                }
                Decided::Nothing => continue,
                Decided::Held if access.subscribed_twin() => return Err("a twin change held for a hub read"),
                Decided::Held => continue,
                Decided::FromMessage if msg.source != SourceKind::Telemetry => {
                    if access.subscribed_twin() || access.subscribed_connection_state() {
                        return Err("a twin or connection event kept without its decision");
                    }
                    continue;
                }
                Decided::FromMessage => {}
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
