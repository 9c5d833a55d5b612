//! AMQP message → [`IngestMessage`]: the device id, the kind of message and the few
//! properties the owning core needs, read from the annotations and application properties.
//!
//! The body is not parsed here (the owning core does that, once). The one exception is a
//! plain Event Hub message that names its device nowhere but in the body, under
//! `customDeviceIdKey`: then the body is looked into to find the core that owns the device.
//!
//! Where IoT Hub puts each field (reference `iothub-wire.md` §1.1): the device id, the
//! message source and the enqueued time are message annotations; `opType`, `deviceId` and
//! the device's own properties are application properties; the body is one or more `Data`
//! sections. Senders other than IoT Hub (a plain Event Hub, a broker queue) may put the same
//! names in the application properties, and the body in an `AmqpValue`; both are accepted.

use fe2o3_amqp::types::messaging::annotations::AnnotationKey;
use fe2o3_amqp::types::messaging::{Body, Message};
use fe2o3_amqp::types::primitives::{SimpleValue, Value};

use crate::config::MAX_DEVICE_ID_LEN;
use crate::ingest::faults::Fault;
use crate::ingest::{device_id_in_body, IngestMessage, Properties, SourceKind};
use crate::timefmt::{iso, parse_iso, Millis};

pub const DEVICE_ID: &str = "iothub-connection-device-id";
pub const MODULE_ID: &str = "iothub-connection-module-id";
pub const MESSAGE_SOURCE: &str = "iothub-message-source";
pub const MESSAGE_SCHEMA: &str = "iothub-message-schema";
pub const IOTHUB_ENQUEUED_TIME: &str = "iothub-enqueuedtime";
pub const CREATION_TIME: &str = "iothub-creation-time-utc";
pub const APP_CREATION_TIME: &str = "iothub-app-iothub-creation-time-utc";
pub const SEQUENCE_NUMBER: &str = "x-opt-sequence-number";
pub const OFFSET: &str = "x-opt-offset";
pub const ENQUEUED_TIME: &str = "x-opt-enqueued-time";

/// Application properties (or annotations) handed to the owning core; everything else the
/// device set is not used by any rule and stays behind.
const KEPT_PROPERTIES: [&str; 4] = ["opType", CREATION_TIME, APP_CREATION_TIME, MODULE_ID];

/// The deployment parameters that shape the mapping.
#[derive(Debug, Clone)]
pub struct MapSettings {
    pub custom_device_id_key: String,
    pub max_message_bytes: usize,
}

/// Where a message sits in its partition: what the stream is resumed after.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Position {
    pub sequence: Option<i64>,
    pub offset: Option<String>,
    pub enqueued: Option<Millis>,
}

/// A message that cannot be used, with a short description for the log.
#[derive(Debug)]
pub struct Rejected {
    pub fault: Fault,
    pub device: Option<String>,
    pub detail: String,
}

fn annotation<'a, B>(message: &'a Message<B>, key: &str) -> Option<&'a Value> {
    message.message_annotations.as_ref()?.get(&key as &dyn AnnotationKey)
}

fn property<'a, B>(message: &'a Message<B>, key: &str) -> Option<&'a SimpleValue> {
    message.application_properties.as_ref()?.get(key)
}

fn value_text(v: &Value) -> Option<String> {
    Some(match v {
        Value::String(s) => s.clone(),
        Value::Symbol(s) => s.0.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Byte(n) => n.to_string(),
        Value::Short(n) => n.to_string(),
        Value::Int(n) => n.to_string(),
        Value::Long(n) => n.to_string(),
        Value::Ubyte(n) => n.to_string(),
        Value::Ushort(n) => n.to_string(),
        Value::Uint(n) => n.to_string(),
        Value::Ulong(n) => n.to_string(),
        Value::Float(n) => n.0.to_string(),
        Value::Double(n) => n.0.to_string(),
        Value::Timestamp(t) => iso(t.milliseconds()),
        Value::Char(c) => c.to_string(),
        Value::Uuid(u) => format!("{u:?}"),
        _ => return None,
    })
}

fn simple_text(v: &SimpleValue) -> Option<String> {
    value_text(&Value::from(v.clone()))
}

fn value_i64(v: &Value) -> Option<i64> {
    match v {
        Value::Long(n) => Some(*n),
        Value::Int(n) => Some(i64::from(*n)),
        Value::Uint(n) => Some(i64::from(*n)),
        Value::Ulong(n) => i64::try_from(*n).ok(),
        Value::Timestamp(t) => Some(t.milliseconds()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// A time annotation: an AMQP timestamp, milliseconds as a number, or an ISO 8601 string.
fn value_millis(v: &Value) -> Option<Millis> {
    match v {
        Value::String(s) => parse_iso(s).or_else(|| s.parse().ok()),
        v => value_i64(v),
    }
}

/// The message's place in its partition (Event Hubs annotations; none from a plain queue).
pub fn position_of<B>(message: &Message<B>) -> Position {
    Position {
        sequence: annotation(message, SEQUENCE_NUMBER).and_then(value_i64),
        offset: annotation(message, OFFSET).and_then(value_text),
        enqueued: annotation(message, ENQUEUED_TIME).and_then(value_millis),
    }
}

/// A string field, looked up in the annotations first, then in the application properties.
fn text_field<B>(message: &Message<B>, key: &str) -> Option<String> {
    annotation(message, key)
        .and_then(value_text)
        .or_else(|| property(message, key).and_then(simple_text))
        .filter(|s| !s.is_empty())
}

/// What kind of message this is: `iothub-message-source`, else the `iothub-message-schema`
/// property (IoT Hub's non-telemetry events and ux4iot's plain Event Hub convention), else
/// telemetry. `Err` names a source hubcast does not use.
fn source_of<B>(message: &Message<B>) -> Result<SourceKind, String> {
    if let Some(source) = text_field(message, MESSAGE_SOURCE) {
        return SourceKind::parse(&source).ok_or(source);
    }
    Ok(match text_field(message, MESSAGE_SCHEMA).as_deref() {
        Some("twinChangeNotification") => SourceKind::TwinChange,
        Some("deviceConnectionStateNotification") => SourceKind::ConnectionState,
        Some("deviceLifecycleNotification") => SourceKind::Lifecycle,
        _ => SourceKind::Telemetry,
    })
}

/// The body bytes: the `Data` sections joined; an `AmqpValue` string or binary as its bytes;
/// any other `AmqpValue` or `AmqpSequence` as its JSON rendering.
pub fn body_bytes(body: &Body<Value>) -> Vec<u8> {
    match body {
        Body::Data(batch) => {
            let mut out = Vec::with_capacity(batch.iter().map(|d| d.0.len()).sum());
            for data in batch.iter() {
                out.extend_from_slice(&data.0);
            }
            out
        }
        Body::Value(v) => match &v.0 {
            Value::String(s) => s.clone().into_bytes(),
            Value::Binary(b) => b.to_vec(),
            other => to_json(other).to_string().into_bytes(),
        },
        Body::Sequence(batch) => {
            let all: Vec<serde_json::Value> =
                batch.iter().map(|seq| serde_json::Value::Array(seq.0.iter().map(to_json).collect())).collect();
            serde_json::Value::Array(all).to_string().into_bytes()
        }
        Body::Empty => Vec::new(),
    }
}

/// An AMQP value as JSON (for `AmqpValue` bodies of senders that do not use `Data`).
pub fn to_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::Null => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Byte(n) => J::from(*n),
        Value::Short(n) => J::from(*n),
        Value::Int(n) => J::from(*n),
        Value::Long(n) => J::from(*n),
        Value::Ubyte(n) => J::from(*n),
        Value::Ushort(n) => J::from(*n),
        Value::Uint(n) => J::from(*n),
        Value::Ulong(n) => J::from(*n),
        Value::Float(n) => J::from(f64::from(n.0)),
        Value::Double(n) => J::from(n.0),
        Value::Timestamp(t) => J::String(iso(t.milliseconds())),
        Value::Binary(b) => {
            use base64::Engine as _;
            J::String(base64::engine::general_purpose::STANDARD.encode(b))
        }
        Value::List(items) => J::Array(items.iter().map(to_json).collect()),
        Value::Array(items) => J::Array(items.iter().map(to_json).collect()),
        Value::Map(map) => J::Object(
            map.iter()
                .map(|(k, v)| (value_text(k).unwrap_or_else(|| format!("{k:?}")), to_json(v)))
                .collect(),
        ),
        Value::Described(d) => to_json(&d.value),
        other => value_text(other).map(J::String).unwrap_or(J::Null),
    }
}

/// Maps one received message; `Err` says why it cannot be used (count it, skip it).
pub fn to_ingest(message: &Message<Body<Value>>, settings: &MapSettings) -> Result<IngestMessage, Rejected> {
    let named_device = text_field(message, DEVICE_ID).or_else(|| property(message, "deviceId").and_then(simple_text));
    let reject = |fault, device: Option<&str>, detail: String| Rejected { fault, device: device.map(str::to_owned), detail };

    let source = source_of(message)
        .map_err(|s| reject(Fault::UnsupportedSource, named_device.as_deref(), format!("iothub-message-source {s}")))?;

    let body = body_bytes(&message.body);
    if body.len() > settings.max_message_bytes {
        return Err(reject(
            Fault::Oversized,
            named_device.as_deref(),
            format!("{} bytes, maxMessageBytes is {}", body.len(), settings.max_message_bytes),
        ));
    }

    let device_id = match named_device {
        Some(d) => d,
        None => device_id_in_body(&body, &settings.custom_device_id_key).filter(|d| !d.is_empty()).ok_or_else(|| {
            reject(Fault::NoDeviceId, None, format!("{} body bytes, no `{}` key", body.len(), settings.custom_device_id_key))
        })?,
    };
    if device_id.len() > MAX_DEVICE_ID_LEN {
        let shown: String = device_id.chars().take(40).collect();
        return Err(reject(Fault::DeviceIdTooLong, None, format!("device id {shown}… ({} bytes)", device_id.len())));
    }

    let mut properties = Properties::new();
    for key in KEPT_PROPERTIES {
        if let Some(v) = text_field(message, key) {
            properties.push((key.into(), v.into()));
        }
    }
    // ux4iot reads the hub's enqueued time before the broker's (reference §8); a plain Event
    // Hub message has only the latter, which still beats the arrival time after a replay.
    let enqueued_at = annotation(message, IOTHUB_ENQUEUED_TIME)
        .or_else(|| annotation(message, ENQUEUED_TIME))
        .and_then(value_millis);

    Ok(IngestMessage { device_id: device_id.into(), source, properties, body, enqueued_at })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp::types::messaging::annotations::OwnedKey;
    use fe2o3_amqp::types::messaging::{AmqpValue, ApplicationProperties, Batch, Data, MessageAnnotations};
    use fe2o3_amqp::types::primitives::{Binary, OrderedMap, Symbol, Timestamp};

    fn settings() -> MapSettings {
        MapSettings { custom_device_id_key: "deviceId".into(), max_message_bytes: 1024 }
    }

    struct Msg {
        annotations: Vec<(&'static str, Value)>,
        properties: Vec<(&'static str, SimpleValue)>,
        body: Body<Value>,
    }

    impl Msg {
        fn new(body: &[u8]) -> Self {
            Self {
                annotations: vec![],
                properties: vec![],
                body: Body::Data(Batch::new(vec![Data(Binary::from(body.to_vec()))])),
            }
        }
        fn ann(mut self, k: &'static str, v: Value) -> Self {
            self.annotations.push((k, v));
            self
        }
        fn prop(mut self, k: &'static str, v: &str) -> Self {
            self.properties.push((k, SimpleValue::String(v.into())));
            self
        }
        fn build(self) -> Message<Body<Value>> {
            let mut annotations = OrderedMap::new();
            for (k, v) in self.annotations {
                annotations.insert(OwnedKey::Symbol(Symbol::from(k)), v);
            }
            let mut props = OrderedMap::new();
            for (k, v) in self.properties {
                props.insert(k.to_string(), v);
            }
            Message {
                header: None,
                delivery_annotations: None,
                message_annotations: Some(MessageAnnotations(annotations)),
                properties: None,
                application_properties: Some(ApplicationProperties(props)),
                body: self.body,
                footer: None,
            }
        }
    }

    fn s(v: &str) -> Value {
        Value::String(v.into())
    }

    #[test]
    fn iot_hub_telemetry_is_routed_by_the_device_id_annotation() {
        let m = Msg::new(br#"{"t":1}"#)
            .ann(DEVICE_ID, s("pump-1"))
            .ann(MESSAGE_SOURCE, s("Telemetry"))
            .ann(IOTHUB_ENQUEUED_TIME, Value::Timestamp(Timestamp::from_milliseconds(1_700_000_000_000)))
            .ann(SEQUENCE_NUMBER, Value::Long(42))
            .ann(OFFSET, s("4200"))
            .prop("iothub-creation-time-utc", "2024-01-02T03:04:05Z")
            .prop("color", "red")
            .build();
        let out = to_ingest(&m, &settings()).unwrap();
        assert_eq!(&*out.device_id, "pump-1");
        assert_eq!(out.source, SourceKind::Telemetry);
        assert_eq!(out.body, br#"{"t":1}"#);
        assert_eq!(out.enqueued_at, Some(1_700_000_000_000));
        assert_eq!(out.properties.len(), 1, "only the properties a rule uses are kept");
        assert_eq!(&*out.properties[0].0, CREATION_TIME);
        let p = position_of(&m);
        assert_eq!((p.sequence, p.offset.as_deref()), (Some(42), Some("4200")));
    }

    #[test]
    fn every_iot_hub_source_kind_is_classified() {
        for (source, op, kind) in [
            ("twinChangeEvents", "updateTwin", SourceKind::TwinChange),
            ("twinChangeEvents", "replaceTwin", SourceKind::TwinChange),
            ("deviceConnectionStateEvents", "deviceConnected", SourceKind::ConnectionState),
            ("deviceConnectionStateEvents", "deviceDisconnected", SourceKind::ConnectionState),
            ("deviceLifecycleEvents", "deleteDeviceIdentity", SourceKind::Lifecycle),
        ] {
            let m = Msg::new(b"{}").ann(DEVICE_ID, s("d")).ann(MESSAGE_SOURCE, s(source)).prop("opType", op).build();
            let out = to_ingest(&m, &settings()).unwrap();
            assert_eq!(out.source, kind, "{source}");
            assert_eq!(out.properties.iter().find(|(k, _)| &**k == "opType").map(|(_, v)| &**v), Some(op));
        }
    }

    #[test]
    fn schema_property_classifies_when_the_source_annotation_is_missing() {
        let m = Msg::new(b"{}").prop(DEVICE_ID, "d").prop(MESSAGE_SCHEMA, "twinChangeNotification").build();
        assert_eq!(to_ingest(&m, &settings()).unwrap().source, SourceKind::TwinChange);
        let m = Msg::new(b"{}").prop(DEVICE_ID, "d").prop(MESSAGE_SCHEMA, "Telemetry").build();
        assert_eq!(to_ingest(&m, &settings()).unwrap().source, SourceKind::Telemetry);
    }

    #[test]
    fn plain_event_hub_device_id_comes_from_properties_then_the_body() {
        let m = Msg::new(b"{}").prop(DEVICE_ID, "from-prop").build();
        assert_eq!(&*to_ingest(&m, &settings()).unwrap().device_id, "from-prop");
        let m = Msg::new(br#"{"deviceId":"from-body","t":2}"#).build();
        assert_eq!(&*to_ingest(&m, &settings()).unwrap().device_id, "from-body");
        let custom = MapSettings { custom_device_id_key: "dev".into(), ..settings() };
        let m = Msg::new(br#"{"dev":"custom","t":2}"#).build();
        assert_eq!(&*to_ingest(&m, &custom).unwrap().device_id, "custom");
    }

    #[test]
    fn unusable_messages_are_rejected_with_their_fault() {
        let fault = |m: Message<Body<Value>>| to_ingest(&m, &settings()).unwrap_err().fault;
        assert_eq!(fault(Msg::new(br#"{"t":1}"#).build()), Fault::NoDeviceId);
        assert_eq!(fault(Msg::new(b"not json").build()), Fault::NoDeviceId);
        assert_eq!(fault(Msg::new(&[b' '; 2000]).ann(DEVICE_ID, s("d")).build()), Fault::Oversized);
        assert_eq!(fault(Msg::new(b"{}").ann(DEVICE_ID, s(&"x".repeat(200))).build()), Fault::DeviceIdTooLong);
        assert_eq!(
            fault(Msg::new(b"[]").ann(DEVICE_ID, s("d")).ann(MESSAGE_SOURCE, s("digitalTwinChangeEvents")).build()),
            Fault::UnsupportedSource
        );
    }

    #[test]
    fn a_non_json_body_is_passed_through_unchanged() {
        let m = Msg::new(b"\x00\x01binary").ann(DEVICE_ID, s("d")).build();
        assert_eq!(to_ingest(&m, &settings()).unwrap().body, b"\x00\x01binary");
    }

    #[test]
    fn amqp_value_bodies_become_json() {
        let mut map = OrderedMap::new();
        map.insert(s("deviceId"), s("v"));
        map.insert(Value::Symbol(Symbol::from("t")), Value::Double(21.5.into()));
        let mut m = Msg::new(b"").build();
        m.body = Body::Value(AmqpValue(Value::Map(map)));
        let out = to_ingest(&m, &settings()).unwrap();
        assert_eq!(&*out.device_id, "v");
        let json: serde_json::Value = serde_json::from_slice(&out.body).unwrap();
        assert_eq!(json, serde_json::json!({"deviceId": "v", "t": 21.5}));
        m.body = Body::Value(AmqpValue(s(r#"{"deviceId":"w"}"#)));
        assert_eq!(&*to_ingest(&m, &settings()).unwrap().device_id, "w");
    }
}
