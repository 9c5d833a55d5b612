//! Ingest: the one message type every source feeds (simulator, `POST /ingest`, AMQP), and the
//! parsing of device bodies on the owning core.
//!
//! A source only finds the device id and routes the raw body to `core_of_device`; the body
//! is parsed there, with simd-json, by the core that owns the device's state.

pub mod faults;
pub mod simulate;

use std::cell::RefCell;
use std::sync::Arc;

use simd_json::prelude::*;
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

pub type Properties = SmallVec<[(Box<str>, Box<str>); 4]>;

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
}

/// The deployment parameters that shape how bodies are read.
#[derive(Debug, Clone)]
pub struct IngestSettings {
    pub custom_timestamp_key: String,
    pub custom_device_id_key: String,
    pub custom_connection_state_key: String,
    pub connection_state_on_telemetry: bool,
}

/// What a telemetry body contributes: top-level keys (borrowed from the body) with their
/// values as JSON text, its own timestamp and connection state if it carries them.
pub struct ParsedTelemetry<'a> {
    pub values: SmallVec<[(&'a str, Arc<str>); 8]>,
    pub timestamp: Option<Millis>,
    pub connection_state: Option<bool>,
}

thread_local! {
    /// simd-json's scratch buffers, reused by every parse on this core.
    static PARSE_BUFFERS: RefCell<simd_json::Buffers> = RefCell::new(simd_json::Buffers::default());
}

/// Parses a telemetry body in place with simd-json (tape, no intermediate map); `None`
/// unless it is a JSON object.
///
/// The timestamp key is metadata and is not kept as telemetry; the device-id key is dropped
/// too when it is a string (plain Event Hub input). The custom connection-state key stays in
/// the telemetry (ux4iot 3.6.1).
pub fn parse_telemetry<'a>(body: &'a mut [u8], settings: &IngestSettings) -> Option<ParsedTelemetry<'a>> {
    parse_telemetry_checked(body, settings).ok()
}

/// [`parse_telemetry`], saying why a body is not telemetry ([`faults::Fault::NotJson`] or
/// [`faults::Fault::NotObject`]).
pub fn parse_telemetry_checked<'a>(
    body: &'a mut [u8],
    settings: &IngestSettings,
) -> Result<ParsedTelemetry<'a>, faults::Fault> {
    let tape = PARSE_BUFFERS
        .with(|b| simd_json::to_tape_with_buffers(body, &mut b.borrow_mut()))
        .map_err(|_| faults::Fault::NotJson)?;
    let obj = tape.as_value().as_object().ok_or(faults::Fault::NotObject)?;
    let mut parsed = ParsedTelemetry { values: SmallVec::new(), timestamp: None, connection_state: None };
    let mut scratch = Vec::with_capacity(64);
    for (key, v) in &obj {
        if key == settings.custom_timestamp_key {
            parsed.timestamp = match v.as_str() {
                Some(s) => parse_iso(s),
                None => v.as_i64(),
            };
            continue;
        }
        if key == settings.custom_device_id_key && v.is_str() {
            continue;
        }
        if !settings.custom_connection_state_key.is_empty() && key == settings.custom_connection_state_key {
            parsed.connection_state = v.as_bool();
        }
        scratch.clear();
        v.write(&mut scratch).map_err(|_| faults::Fault::NotJson)?;
        parsed.values.push((key, Arc::from(std::str::from_utf8(&scratch).map_err(|_| faults::Fault::NotJson)?)));
    }
    Ok(parsed)
}

/// The body as JSON text for `d2cMessages` subscribers: JSON bodies (of any type) as they
/// are; anything else as `{"base64": "<the bytes>"}`.
pub fn message_json(body: &[u8]) -> String {
    if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok() {
        if let Ok(text) = std::str::from_utf8(body) {
            return text.trim().to_string();
        }
    }
    use base64::Engine;
    format!("{{\"base64\":\"{}\"}}", base64::engine::general_purpose::STANDARD.encode(body))
}

/// The device id a body names under `customDeviceIdKey`, for sources without annotations.
pub fn device_id_in_body(body: &[u8], key: &str) -> Option<String> {
    let mut copy = body.to_vec();
    let value = simd_json::to_borrowed_value(&mut copy).ok()?;
    value.get(key)?.as_str().map(str::to_owned)
}

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
        let mut body = br#"{"t":21.5,"geo":{"lat":1,"lng":2},"_ts":"2024-01-02T03:04:05.000Z","deviceId":"d","online":false}"#.to_vec();
        let p = parse_telemetry(&mut body, &settings()).unwrap();
        let keys: Vec<_> = p.values.iter().map(|(k, _)| &**k).collect();
        assert_eq!(keys.len(), 3);
        assert!(keys.contains(&"t") && keys.contains(&"geo") && keys.contains(&"online"));
        let geo = &p.values.iter().find(|(k, _)| &**k == "geo").unwrap().1;
        assert_eq!(serde_json::from_str::<serde_json::Value>(geo).unwrap(), serde_json::json!({"lat":1,"lng":2}));
        assert_eq!(p.timestamp, parse_iso("2024-01-02T03:04:05.000Z"));
        assert_eq!(p.connection_state, Some(false));
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
        assert!(parse_telemetry(&mut b"[1,2]".to_vec(), &settings()).is_none());
        assert!(parse_telemetry(&mut b"not json".to_vec(), &settings()).is_none());
        assert_eq!(parse_telemetry_checked(&mut b"[1,2]".to_vec(), &settings()).err(), Some(faults::Fault::NotObject));
        assert_eq!(parse_telemetry_checked(&mut b"{oops".to_vec(), &settings()).err(), Some(faults::Fault::NotJson));
    }
}
