//! Ingest: the one message type every source feeds (simulator, `POST /ingest`, AMQP), and the
//! parsing of device bodies on the owning core.
//!
//! A source only finds the device id and routes the raw body to `core_of_device`; the body
//! is parsed there, with simd-json, by the core that owns the device's state.

pub mod faults;
pub mod simulate;

use std::borrow::Cow;

use simd_json::prelude::*;
use simd_json::BorrowedValue;
use smallvec::SmallVec;

use crate::timefmt::{parse_iso, Millis};

/// `iothub-message-source` of a device message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Telemetry,
    TwinChange,
    ConnectionState,
    Lifecycle,
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

/// What a telemetry body contributes: top-level keys as JSON text, its own timestamp and
/// connection state if it carries them.
pub struct ParsedTelemetry {
    pub values: SmallVec<[(Box<str>, Box<str>); 8]>,
    pub timestamp: Option<Millis>,
    pub connection_state: Option<bool>,
}

/// Parses a telemetry body; `None` unless it is a JSON object.
///
/// The timestamp key is metadata and is not kept as telemetry; the device-id key is dropped
/// too when it names this device (plain Event Hub input). The custom connection-state key
/// stays in the telemetry (ux4iot 3.6.1).
pub fn parse_telemetry(body: &mut [u8], settings: &IngestSettings) -> Option<ParsedTelemetry> {
    parse_telemetry_checked(body, settings).ok()
}

/// [`parse_telemetry`], saying why a body is not telemetry ([`faults::Fault::NotJson`] or
/// [`faults::Fault::NotObject`]). Parses in place: `body` is garbage afterwards.
pub fn parse_telemetry_checked(body: &mut [u8], settings: &IngestSettings) -> Result<ParsedTelemetry, faults::Fault> {
    let value = simd_json::to_borrowed_value(body).map_err(|_| faults::Fault::NotJson)?;
    let BorrowedValue::Object(obj) = value else { return Err(faults::Fault::NotObject) };
    let mut parsed = ParsedTelemetry { values: SmallVec::new(), timestamp: None, connection_state: None };
    for (key, v) in obj.iter() {
        let key: &str = key;
        if key == settings.custom_timestamp_key {
            parsed.timestamp = match v {
                BorrowedValue::String(s) => parse_iso(s),
                v => v.as_i64(),
            };
            continue;
        }
        if key == settings.custom_device_id_key && v.is_str() {
            continue;
        }
        if !settings.custom_connection_state_key.is_empty() && key == settings.custom_connection_state_key {
            parsed.connection_state = v.as_bool();
        }
        parsed.values.push((key.into(), v.encode().into()));
    }
    Ok(parsed)
}

/// The `data` a `d2cMessages` subscriber receives for a device message body, as JSON text:
/// a JSON body as it is (any JSON value, not only objects); any other body (not UTF-8, not
/// JSON, empty) as `{"base64": "<the body, standard base64 with padding>"}`.
///
/// This validates the whole body, so call it before [`parse_telemetry`] rewrites it.
pub fn d2c_data(body: &[u8]) -> Cow<'_, str> {
    if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok() {
        if let Ok(text) = std::str::from_utf8(body) {
            return Cow::Borrowed(text.trim());
        }
    }
    use base64::Engine as _;
    Cow::Owned(format!("{{\"base64\":\"{}\"}}", base64::engine::general_purpose::STANDARD.encode(body)))
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
    fn non_objects_are_not_telemetry() {
        assert!(parse_telemetry(&mut b"[1,2]".to_vec(), &settings()).is_none());
        assert!(parse_telemetry(&mut b"not json".to_vec(), &settings()).is_none());
        assert_eq!(parse_telemetry_checked(&mut b"[1,2]".to_vec(), &settings()).err(), Some(faults::Fault::NotObject));
        assert_eq!(parse_telemetry_checked(&mut b"{oops".to_vec(), &settings()).err(), Some(faults::Fault::NotJson));
    }

    #[test]
    fn d2c_data_passes_json_through_and_wraps_anything_else_in_base64() {
        assert_eq!(d2c_data(br#"{"t": 1}"#), r#"{"t": 1}"#);
        assert_eq!(d2c_data(b"[1,2]\n"), "[1,2]");
        assert_eq!(d2c_data(b"hello"), r#"{"base64":"aGVsbG8="}"#);
        assert_eq!(d2c_data(&[0xff, 0x00]), r#"{"base64":"/wA="}"#);
        assert_eq!(d2c_data(b""), r#"{"base64":""}"#);
    }
}
