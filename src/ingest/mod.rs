//! Ingest: the one message type every source feeds (simulator, `POST /ingest`, AMQP), and the
//! parsing of device bodies on the owning core.
//!
//! A source only finds the device id and routes the raw body to `core_of_device`; the body
//! is parsed there, once, by the core that owns the device's state: one pass ([`json`]) splits
//! the top-level object into keys and raw value spans, and each value is kept as the JSON text
//! the device sent (no conversion, so no number is too big or too precise to keep).

pub mod faults;
pub mod json;
pub mod key;
pub mod text;

pub use key::{MsgKey, ReadMark};
pub use text::JsonText;

use std::borrow::Cow;

use smallvec::SmallVec;

use crate::timefmt::{parse_iso, Millis};

/// `iothub-message-source` of a device message.
/// (Discriminants index `metrics::SOURCES`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Telemetry = 0,
    TwinChange = 1,
    ConnectionState = 2,
    Lifecycle = 3,
}

impl SourceKind {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "Telemetry" | "telemetry" => Self::Telemetry,
            "twinChangeEvents" => Self::TwinChange,
            "deviceConnectionStateEvents" => Self::ConnectionState,
            "deviceLifecycleEvents" => Self::Lifecycle,
            _ => return None,
        })
    }
}

/// The kept properties of a message (`opType`, the creation times, the module id): usually
/// none or one. One inline: four made every message ~100 bytes larger (136 bytes for the
/// list alone, a message ~240), moved whole from parse to the core's batch several times
/// (issue 25 item 4); a message with more allocates the rest.
pub type Properties = SmallVec<[(Box<str>, Box<str>); 1]>;

/// One device message, as every source hands it to the core owning the device.
#[derive(Debug, Clone)]
pub struct IngestMessage {
    pub device_id: Box<str>,
    pub source: SourceKind,
    /// Application properties and the annotations that matter (`opType`, creation time…).
    pub properties: Properties,
    /// The raw body; parsed in place by the owning core.
    pub body: Vec<u8>,
    /// When the hub enqueued it, if known.
    pub enqueued_at: Option<Millis>,
    /// When hubcast received it (for the delivery latency histogram); `None` in tests.
    pub arrived: Option<crate::metrics::Arrival>,
    /// Its stable key ([`key`]): the same whenever its source gives it again.
    pub key: MsgKey,
}

#[cfg(test)]
impl IngestMessage {
    /// A telemetry message `{"n": n}` of `device` with the key `(1000, n)`: the device rings'
    /// and their asks' unit tests.
    pub(crate) fn ring_fixture(device: &str, n: u64) -> Self {
        IngestMessage {
            device_id: device.into(),
            source: SourceKind::Telemetry,
            properties: Default::default(),
            body: format!("{{\"n\":{n}}}").into_bytes(),
            enqueued_at: None,
            arrived: None,
            key: MsgKey { ms: 1_000, n },
        }
    }
}

impl IngestMessage {
    /// Bytes it is charged for against queue bounds (an estimate of what it holds: body, id,
    /// properties and the struct).
    pub fn charge(&self) -> usize {
        self.body.len() + self.device_id.len() + self.properties.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() + 128
    }
}

/// The deployment parameters that shape how bodies are read.
#[derive(Debug, Clone)]
pub struct IngestSettings {
    pub custom_timestamp_key: String,
    pub custom_device_id_key: String,
    pub custom_connection_state_key: String,
    pub connection_state_on_telemetry: bool,
}

/// What a telemetry body contributes: top-level keys (borrowed from the body unless they hold
/// escapes) with their values as the exact JSON text the device sent (borrowed from the body),
/// its own timestamp and connection state if it carries them.
#[derive(Default)]
pub struct ParsedTelemetry<'a> {
    pub values: SmallVec<[(Cow<'a, str>, &'a str); 8]>,
    pub timestamp: Option<Millis>,
    pub connection_state: Option<bool>,
}

/// Parses a telemetry body; `None` unless it is a JSON object.
///
/// The timestamp key is metadata and is not kept as telemetry; the device-id key is dropped
/// too when it is a string (plain Event Hub input). The custom connection-state key stays in
/// the telemetry (ux4iot 3.6.1).
pub fn parse_telemetry<'a>(body: &'a [u8], settings: &IngestSettings) -> Option<ParsedTelemetry<'a>> {
    parse_telemetry_checked(body, settings).ok()
}

/// [`parse_telemetry`], saying why a body is not telemetry ([`faults::Fault::NotJson`] or
/// [`faults::Fault::NotObject`]).
///
/// One pass over the body ([`json::object_members`]) validates it and splits the top-level
/// object into keys and raw value spans; values are kept as the text the device sent, never
/// converted. A number no machine type holds (`18446744073709551616`, `1e309`, 30 digits) is
/// therefore kept exactly, like any other.
pub fn parse_telemetry_checked<'a>(
    body: &'a [u8],
    settings: &IngestSettings,
) -> Result<ParsedTelemetry<'a>, faults::Fault> {
    let mut parsed = ParsedTelemetry::default();
    parse_telemetry_into(body, settings, &mut parsed)?;
    Ok(parsed)
}

/// [`parse_telemetry_checked`] into `parsed` (empty), so the caller's value is not moved.
pub fn parse_telemetry_into<'a>(
    body: &'a [u8],
    settings: &IngestSettings,
    parsed: &mut ParsedTelemetry<'a>,
) -> Result<(), faults::Fault> {
    json::for_each_member(body, |key, text| {
        if *key == *settings.custom_timestamp_key {
            parsed.timestamp = timestamp_of(text);
            return;
        }
        if *key == *settings.custom_device_id_key && text.starts_with('"') {
            return;
        }
        if !settings.custom_connection_state_key.is_empty() && *key == *settings.custom_connection_state_key {
            parsed.connection_state = match text {
                "true" => Some(true),
                "false" => Some(false),
                _ => None,
            };
        }
        parsed.values.push((key, text));
    })
    .map_err(fault_of)
}

fn fault_of(e: json::NotAnObject) -> faults::Fault {
    match e {
        json::NotAnObject::NotJson => faults::Fault::NotJson,
        json::NotAnObject::OtherType => faults::Fault::NotObject,
    }
}

pub use json::Members;

/// The members of a JSON object body: one pass that validates everything and converts no value.
pub fn top_level_members(body: &[u8]) -> Result<Members<'_>, faults::Fault> {
    json::object_members(body).map_err(fault_of)
}

/// Whether `body` is JSON text: UTF-8 (RFC 8259 §8.1) holding one JSON value.
pub fn is_json(body: &[u8]) -> bool {
    json::is_json(body)
}

/// The body's own timestamp: an ISO 8601 string or integer epoch milliseconds.
fn timestamp_of(text: &str) -> Option<Millis> {
    if text.starts_with('"') {
        serde_json::from_str::<Cow<str>>(text).ok().and_then(|s| parse_iso(&s))
    } else {
        text.parse::<i64>().ok()
    }
}

/// The body as JSON text for `d2cMessages` subscribers: JSON bodies (of any type) as they
/// are; anything else as `{"base64": "<the bytes>"}`.
pub fn message_json(body: &[u8]) -> String {
    if is_json(body) {
        if let Ok(text) = std::str::from_utf8(body) {
            return text.trim().to_string();
        }
    }
    use base64::Engine;
    format!("{{\"base64\":\"{}\"}}", base64::engine::general_purpose::STANDARD.encode(body))
}

/// The device id a body names under `customDeviceIdKey`, for sources without annotations
/// (the last such member, as for telemetry keys).
pub fn device_id_in_body(body: &[u8], key: &str) -> Option<String> {
    let members = top_level_members(body).ok()?;
    let (_, raw) = members.iter().rev().find(|(k, _)| k == key)?;
    serde_json::from_str::<String>(raw).ok()
}

#[doc(hidden)]
pub mod oracle;

#[cfg(test)]
mod property_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> IngestSettings {
        IngestSettings {
            custom_timestamp_key: "_ts".into(),
            custom_device_id_key: "deviceId".into(),
            custom_connection_state_key: "online".into(),
            connection_state_on_telemetry: true,
        }
    }

    #[test]
    fn telemetry_keys_keep_their_json_and_metadata_is_split_off() {
        let body = br#"{"t":21.5,"geo":{"lat":1,"lng":2},"_ts":"2024-01-02T03:04:05.000Z","deviceId":"d","online":false}"#.to_vec();
        let p = parse_telemetry(&body, &settings()).unwrap();
        let keys: Vec<_> = p.values.iter().map(|(k, _)| &**k).collect();
        assert_eq!(keys.len(), 3);
        assert!(keys.contains(&"t") && keys.contains(&"geo") && keys.contains(&"online"));
        let geo = &p.values.iter().find(|(k, _)| &**k == "geo").unwrap().1;
        assert_eq!(serde_json::from_str::<serde_json::Value>(geo).unwrap(), serde_json::json!({"lat":1,"lng":2}));
        assert_eq!(p.timestamp, parse_iso("2024-01-02T03:04:05.000Z"));
        assert_eq!(p.connection_state, Some(false));
    }

    #[test]
    fn numbers_beyond_machine_types_and_escaped_keys_are_kept_as_sent() {
        let body = br#"{"big":18446744073709551616, "inf":1e309,"long":123456789012345678901234567890,"f":1.50,"k\"q":1,"_ts":1700000000000}"#.to_vec();
        let p = parse_telemetry(&body, &settings()).unwrap();
        let values: Vec<(&str, &str)> = p.values.iter().map(|(k, v)| (&**k, &**v)).collect();
        assert_eq!(
            values,
            [("big", "18446744073709551616"), ("inf", "1e309"), ("long", "123456789012345678901234567890"), ("f", "1.50"), ("k\"q", "1")]
        );
        assert_eq!(p.timestamp, Some(1_700_000_000_000));
        assert_eq!(device_id_in_body(br#"{"deviceId":"a\u00e9","x":1e999}"#, "deviceId").as_deref(), Some("aé"));
    }

    #[test]
    fn message_bodies_pass_through_or_are_wrapped() {
        assert_eq!(message_json(b" [1,2] "), "[1,2]");
        assert_eq!(message_json(b"\xff\x00"), r#"{"base64":"/wA="}"#);
        assert_eq!(message_json(b"hello"), r#"{"base64":"aGVsbG8="}"#);
        assert_eq!(message_json(b""), r#"{"base64":""}"#);
    }

    #[test]
    fn non_objects_are_not_telemetry() {
        assert!(parse_telemetry(b"[1,2]", &settings()).is_none());
        assert!(parse_telemetry(b"not json", &settings()).is_none());
        assert_eq!(parse_telemetry_checked(b"[1,2]", &settings()).err(), Some(faults::Fault::NotObject));
        assert_eq!(parse_telemetry_checked(b"{oops", &settings()).err(), Some(faults::Fault::NotJson));
    }
}
