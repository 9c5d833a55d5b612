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

use std::borrow::Cow;

use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::{AmqpValue, ApplicationProperties, Body, Message, MessageAnnotations};
use fe2o3_amqp::types::primitives::{SimpleValue, Value};

use super::encoded::{DataSections, Scalar};
use crate::config::MAX_DEVICE_ID_LEN;
use crate::ingest::faults::Fault;
use crate::ingest::{device_id_in_body, IngestMessage, MsgKey, Properties, SourceKind};
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
const KEPT_PROPERTIES: [(&str, usize); 4] =
    [("opType", OP_TYPE), (CREATION_TIME, CREATED), (APP_CREATION_TIME, APP_CREATED), (MODULE_ID, MODULE)];

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

/// The names [`Fields`] collects, by slot.
const DEVICE: usize = 0;
const MODULE: usize = 1;
const SOURCE: usize = 2;
const SCHEMA: usize = 3;
const HUB_ENQUEUED: usize = 4;
const CREATED: usize = 5;
const APP_CREATED: usize = 6;
const OP_TYPE: usize = 7;
const SEQUENCE: usize = 8;
const OFFSET_SLOT: usize = 9;
const ENQUEUED: usize = 10;
const DEVICE_ID_PROPERTY: usize = 11;
const SLOTS: usize = 12;

/// Every name [`Fields`] collects, with its slot.
const NAMES: [(&str, usize); SLOTS] = [
    (DEVICE_ID, DEVICE),
    (MODULE_ID, MODULE),
    (MESSAGE_SOURCE, SOURCE),
    (MESSAGE_SCHEMA, SCHEMA),
    (IOTHUB_ENQUEUED_TIME, HUB_ENQUEUED),
    (CREATION_TIME, CREATED),
    (APP_CREATION_TIME, APP_CREATED),
    ("opType", OP_TYPE),
    (SEQUENCE_NUMBER, SEQUENCE),
    (OFFSET, OFFSET_SLOT),
    (ENQUEUED_TIME, ENQUEUED),
    ("deviceId", DEVICE_ID_PROPERTY),
];

/// The slot of a name, compared as bytes (an encoded name needs no UTF-8 check to be
/// looked up: only the names collected are text hubcast knows).
pub(super) fn slot(name: &[u8]) -> Option<usize> {
    NAMES.iter().find(|(n, _)| n.as_bytes() == name).map(|(_, i)| *i)
}

/// One annotation or application property hubcast reads, borrowed from the message: as
/// fe2o3 decoded it, or still encoded (read when asked for, text without a copy).
#[derive(Clone, Copy, Debug)]
pub(super) enum Field<'a> {
    Value(&'a Value),
    Simple(&'a SimpleValue),
    Encoded(&'a [u8]),
}

impl<'a> Field<'a> {
    fn text(&self) -> Option<Cow<'a, str>> {
        match *self {
            Field::Value(v) => value_text(v),
            Field::Simple(SimpleValue::String(s)) => Some(Cow::Borrowed(s)),
            Field::Simple(SimpleValue::Symbol(s)) => Some(Cow::Borrowed(&s.0)),
            // Not text: rendered the way an annotation of the same type is.
            Field::Simple(other) => value_text(&Value::from(other.clone())).map(|t| Cow::Owned(t.into_owned())),
            Field::Encoded(e) => match Scalar::decode(e)? {
                Scalar::Str(s) | Scalar::Sym(s) => Some(Cow::Borrowed(s)),
                Scalar::Long(n) => Some(Cow::Owned(n.to_string())),
                Scalar::Timestamp(t) => Some(Cow::Owned(iso(t))),
                Scalar::Other(v) => value_text(&v).map(|t| Cow::Owned(t.into_owned())),
            },
        }
    }

    fn i64(&self) -> Option<i64> {
        match *self {
            Field::Value(v) => value_i64(v),
            Field::Simple(v) => value_i64(&Value::from(v.clone())),
            Field::Encoded(e) => match Scalar::decode(e)? {
                Scalar::Str(s) => s.parse().ok(),
                Scalar::Sym(_) => None,
                Scalar::Long(n) | Scalar::Timestamp(n) => Some(n),
                Scalar::Other(v) => value_i64(&v),
            },
        }
    }

    /// A time: an AMQP timestamp, milliseconds as a number, or an ISO 8601 string.
    fn millis(&self) -> Option<Millis> {
        match *self {
            Field::Value(v) => value_millis(v),
            Field::Simple(v) => value_millis(&Value::from(v.clone())),
            Field::Encoded(e) => match Scalar::decode(e)? {
                Scalar::Str(s) => parse_iso(s).or_else(|| s.parse().ok()),
                Scalar::Sym(_) => None,
                Scalar::Long(n) | Scalar::Timestamp(n) => Some(n),
                Scalar::Other(v) => value_millis(&v),
            },
        }
    }
}

/// Where a scanned field lies in its message: offset and length (a value is never empty: a
/// length of 0 is "absent"). Eight bytes where an `Option<Field>` takes 24.
#[derive(Clone, Copy, Default)]
pub(super) struct Span {
    at: u32,
    len: u32,
}

/// The annotations and application properties hubcast reads, borrowed from the message and
/// found in one pass over each map: they hold a handful of entries, so comparing each name
/// once costs less than a hashed lookup per name, and nothing is copied until it is kept.
///
/// A scanned message keeps where each field lies ([`Span`]s into its bytes), a decoded one a
/// reference to fe2o3's value: 208 or 192 bytes, where two arrays of `Option<Field>` took
/// 576, moved three times per message from the scanner to the partition task (issue 25
/// item 4: ~490 instructions of `memcpy` per AMQP message).
pub(super) enum Fields<'a> {
    Scanned { bytes: &'a [u8], annotations: [Span; SLOTS], properties: [Span; SLOTS] },
    Decoded { annotations: [Option<&'a Value>; SLOTS], properties: [Option<&'a SimpleValue>; SLOTS] },
}

impl<'a> Fields<'a> {
    /// No field yet of a message scanned in `bytes` ([`Self::set_scanned`] fills them).
    pub(super) fn scanned(bytes: &'a [u8]) -> Self {
        Fields::Scanned { bytes, annotations: [Span::default(); SLOTS], properties: [Span::default(); SLOTS] }
    }

    /// Notes that `value` (a sub-slice of the scanned bytes) is the annotation (or, not
    /// `annotation`, the application property) of `slot`.
    pub(super) fn set_scanned(&mut self, annotation: bool, slot: usize, value: &'a [u8]) {
        if let Fields::Scanned { bytes, annotations, properties } = self {
            let at = (value.as_ptr() as usize).wrapping_sub(bytes.as_ptr() as usize);
            debug_assert!(at + value.len() <= bytes.len(), "a field outside its message");
            let (Ok(at), Ok(len)) = (u32::try_from(at), u32::try_from(value.len())) else { return };
            let span = Span { at, len };
            if annotation {
                annotations[slot] = span;
            } else {
                properties[slot] = span;
            }
        }
    }

    fn of(annotations: Option<&'a MessageAnnotations>, properties: Option<&'a ApplicationProperties>) -> Self {
        let mut a = [None; SLOTS];
        let mut p = [None; SLOTS];
        for (key, value) in annotations.into_iter().flat_map(|a| a.0.iter()) {
            if let Some(i) = match key {
                OwnedKey::Symbol(name) => slot(name.0.as_bytes()),
                OwnedKey::Ulong(_) => None,
            } {
                a[i] = Some(value);
            }
        }
        for (key, value) in properties.into_iter().flat_map(|p| p.0.iter()) {
            if let Some(i) = slot(key.as_bytes()) {
                p[i] = Some(value);
            }
        }
        Fields::Decoded { annotations: a, properties: p }
    }

    fn spanned(bytes: &'a [u8], span: Span) -> Option<Field<'a>> {
        (span.len != 0).then(|| Field::Encoded(&bytes[span.at as usize..span.at as usize + span.len as usize]))
    }

    fn property(&self, slot: usize) -> Option<Field<'a>> {
        match self {
            Fields::Scanned { bytes, properties, .. } => Self::spanned(bytes, properties[slot]),
            Fields::Decoded { properties, .. } => properties[slot].map(Field::Simple),
        }
    }

    fn annotation(&self, slot: usize) -> Option<Field<'a>> {
        match self {
            Fields::Scanned { bytes, annotations, .. } => Self::spanned(bytes, annotations[slot]),
            Fields::Decoded { annotations, .. } => annotations[slot].map(Field::Value),
        }
    }

    /// A string field: the annotation if it has a text form, else the application property;
    /// `None` when that is empty. Borrowed unless it had to be rendered (a number, a time).
    fn text(&self, slot: usize) -> Option<Cow<'a, str>> {
        self.annotation(slot)
            .and_then(|f| f.text())
            .or_else(|| self.property(slot).and_then(|f| f.text()))
            .filter(|s| !s.is_empty())
    }

    fn sequence(&self) -> Option<i64> {
        self.annotation(SEQUENCE).and_then(|f| f.i64())
    }

    fn position(&self) -> Position {
        Position {
            sequence: self.sequence(),
            offset: self.annotation(OFFSET_SLOT).and_then(|f| f.text()).map(Cow::into_owned),
            enqueued: self.annotation(ENQUEUED).and_then(|f| f.millis()),
        }
    }
}

fn value_text(v: &Value) -> Option<Cow<'_, str>> {
    Some(match v {
        Value::String(s) => Cow::Borrowed(s),
        Value::Symbol(s) => Cow::Borrowed(&s.0),
        Value::Bool(b) => b.to_string().into(),
        Value::Byte(n) => n.to_string().into(),
        Value::Short(n) => n.to_string().into(),
        Value::Int(n) => n.to_string().into(),
        Value::Long(n) => n.to_string().into(),
        Value::Ubyte(n) => n.to_string().into(),
        Value::Ushort(n) => n.to_string().into(),
        Value::Uint(n) => n.to_string().into(),
        Value::Ulong(n) => n.to_string().into(),
        Value::Float(n) => n.0.to_string().into(),
        Value::Double(n) => n.0.to_string().into(),
        Value::Timestamp(t) => iso(t.milliseconds()).into(),
        Value::Char(c) => c.to_string().into(),
        Value::Uuid(u) => format!("{u:?}").into(),
        _ => return None,
    })
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

/// A received message, read from its encoded bytes (taken from the wire by [`super::tap`]):
/// scanned in place when it is what IoT Hub and Event Hubs send ([`super::encoded`]), else
/// decoded whole by fe2o3's types as the receiver would have.
pub struct Received<'a>(Read<'a>);

// The scanned variant is the usual one, read once per message: boxing it would allocate.
#[allow(clippy::large_enum_variant)]
enum Read<'a> {
    Scanned(Fields<'a>, DataSections<'a>),
    Decoded(Box<Message<Body<Value>>>),
    /// As fe2o3's receiver decoded it (a delivery the tap passed through).
    Received(&'a mut Message<Body<Value>>),
}

impl<'a> Received<'a> {
    /// Reads one message; `Err` when it is not an AMQP message at all (fe2o3 cannot decode it).
    pub fn read(encoded: &'a bytes::Bytes) -> Result<Self, String> {
        if let Some((fields, body)) = super::encoded::scan(encoded) {
            return Ok(Received(Read::Scanned(fields, body)));
        }
        use fe2o3_amqp::types::messaging::message::__private::Deserializable;
        match serde_amqp::from_slice::<Deserializable<Message<Body<Value>>>>(encoded) {
            Ok(Deserializable(message)) => Ok(Received(Read::Decoded(Box::new(message)))),
            Err(e) => Err(format!("cannot decode a message: {e}")),
        }
    }

    /// A message fe2o3's receiver decoded whole (its body is taken by [`Self::to_ingest`];
    /// the annotations stay for [`position_of`]).
    pub fn decoded(message: &'a mut Message<Body<Value>>) -> Self {
        Received(Read::Received(message))
    }

    fn with_fields<T>(&self, f: impl FnOnce(&Fields) -> T) -> T {
        match &self.0 {
            Read::Scanned(fields, _) => f(fields),
            Read::Decoded(m) => f(&Fields::of(m.message_annotations.as_ref(), None)),
            Read::Received(m) => f(&Fields::of(m.message_annotations.as_ref(), None)),
        }
    }

    /// The message's place in its partition (Event Hubs annotations; none from a plain queue).
    pub fn position(&self) -> Position {
        self.with_fields(|f| f.position())
    }

    /// Only the sequence number of [`Self::position`] (what the redelivery check needs).
    pub fn sequence(&self) -> Option<i64> {
        self.with_fields(|f| f.sequence())
    }

    /// Whether the message carries an `x-opt-offset` (a position without a sequence number).
    pub fn has_offset(&self) -> bool {
        self.with_fields(|f| f.annotation(OFFSET_SLOT).is_some())
    }

    /// Whether the message was read in place (not decoded whole).
    #[cfg(test)]
    fn scanned(&self) -> bool {
        matches!(self.0, Read::Scanned(..))
    }

    /// The message for the owning core; `Err` says why it cannot be used (count it, skip it).
    pub fn to_ingest(self, settings: &MapSettings) -> Result<IngestMessage, Rejected> {
        let sequence = self.sequence();
        self.to_ingest_sequenced(settings, sequence)
    }

    /// [`Self::to_ingest`] of a message whose [`Self::sequence`] was read already (the
    /// receiver reads it first, for the redelivery check): not decoded a second time.
    pub fn to_ingest_sequenced(self, settings: &MapSettings, sequence: Option<i64>) -> Result<IngestMessage, Rejected> {
        match self.0 {
            Read::Scanned(fields, body) => ingest_of(&fields, body.to_vec(), settings, sequence),
            Read::Decoded(mut message) => to_ingest(&mut message, settings),
            Read::Received(message) => to_ingest(message, settings),
        }
    }
}

/// The message's place in its partition (Event Hubs annotations; none from a plain queue).
pub fn position_of<B>(message: &Message<B>) -> Position {
    Fields::of(message.message_annotations.as_ref(), None).position()
}

/// What kind of message this is: `iothub-message-source`, else the `iothub-message-schema`
/// property (IoT Hub's non-telemetry events and ux4iot's plain Event Hub convention), else
/// telemetry. `Err` names a source hubcast does not use.
fn source_of(fields: &Fields) -> Result<SourceKind, String> {
    if let Some(source) = fields.text(SOURCE) {
        return SourceKind::parse(&source).ok_or_else(|| source.into_owned());
    }
    Ok(match fields.text(SCHEMA).as_deref() {
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

/// [`body_bytes`], moving the bytes out when the body is one `Data` section (IoT Hub's
/// telemetry) or a binary `AmqpValue` instead of copying them.
pub fn into_body_bytes(body: Body<Value>) -> Vec<u8> {
    match body {
        Body::Data(batch) if batch.len() == 1 => batch.into_iter().next().map(|d| d.0.into_vec()).unwrap_or_default(),
        Body::Value(AmqpValue(Value::String(s))) => s.into_bytes(),
        Body::Value(AmqpValue(Value::Binary(b))) => b.into_vec(),
        other => body_bytes(&other),
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
                .map(|(k, v)| (value_text(k).map_or_else(|| format!("{k:?}"), Cow::into_owned), to_json(v)))
                .collect(),
        ),
        Value::Described(d) => to_json(&d.value),
        other => value_text(other).map(|t| J::String(t.into_owned())).unwrap_or(J::Null),
    }
}

/// Maps one received message; `Err` says why it cannot be used (count it, skip it).
///
/// The body moves into the [`IngestMessage`] (the message is left with an empty body, its
/// annotations still there for [`position_of`]); the only copies are the device id and the
/// kept properties, which the owning core keeps.
pub fn to_ingest(message: &mut Message<Body<Value>>, settings: &MapSettings) -> Result<IngestMessage, Rejected> {
    let body = into_body_bytes(std::mem::replace(&mut message.body, Body::Empty));
    let fields = Fields::of(message.message_annotations.as_ref(), message.application_properties.as_ref());
    let sequence = fields.sequence();
    ingest_of(&fields, body, settings, sequence)
}

/// [`to_ingest`] once the fields are found and the body is bytes; `sequence` is
/// `fields.sequence()`, read once per message by the caller.
fn ingest_of(fields: &Fields, body: Vec<u8>, settings: &MapSettings, sequence: Option<i64>) -> Result<IngestMessage, Rejected> {
    let named_device = fields.text(DEVICE).or_else(|| fields.property(DEVICE_ID_PROPERTY).and_then(|f| f.text()));
    let reject = |fault, device: Option<&str>, detail: String| Rejected { fault, device: device.map(str::to_owned), detail };

    let source = source_of(fields)
        .map_err(|s| reject(Fault::UnsupportedSource, named_device.as_deref(), format!("iothub-message-source {s}")))?;

    if body.len() > settings.max_message_bytes {
        return Err(reject(
            Fault::Oversized,
            named_device.as_deref(),
            format!("{} bytes, maxMessageBytes is {}", body.len(), settings.max_message_bytes),
        ));
    }

    let device_id: Box<str> = match named_device {
        Some(d) => d.into(),
        None => device_id_in_body(&body, &settings.custom_device_id_key)
            .filter(|d| !d.is_empty())
            .ok_or_else(|| {
                reject(Fault::NoDeviceId, None, format!("{} body bytes, no `{}` key", body.len(), settings.custom_device_id_key))
            })?
            .into(),
    };
    if device_id.len() > MAX_DEVICE_ID_LEN {
        let shown: String = device_id.chars().take(40).collect();
        return Err(reject(Fault::DeviceIdTooLong, None, format!("device id {shown}… ({} bytes)", device_id.len())));
    }

    let mut properties = Properties::new();
    for (key, slot) in KEPT_PROPERTIES {
        if let Some(v) = fields.text(slot) {
            properties.push((key.into(), v.into()));
        }
    }
    // ux4iot reads the hub's enqueued time before the broker's (reference §8); a plain Event
    // Hub message has only the latter, which still beats the arrival time after a replay.
    // The broker's enqueued time is decoded once, for both.
    let enqueued = fields.annotation(ENQUEUED).and_then(|f| f.millis());
    let enqueued_at = match fields.annotation(HUB_ENQUEUED) {
        Some(hub) => hub.millis(),
        None => enqueued,
    };

    // Its stable key (design step 9): the partition gives both again on a re-read (its
    // partition is set by the receiver: `MsgKey::in_numbered`). Without both (a plain
    // queue) the message is keyed at arrival and never taken for a re-read.
    let key = match (enqueued, sequence) {
        (Some(ms), Some(seq)) => MsgKey::partition(0, ms, seq),
        _ => MsgKey::arrival(crate::timefmt::now_millis()),
    };
    let arrived = Some(crate::metrics::Arrival::now());
    Ok(IngestMessage { device_id, source, properties, body, enqueued_at, arrived, key })
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
        let out = to_ingest(&mut m.clone(), &settings()).unwrap();
        assert_eq!(&*out.device_id, "pump-1");
        assert_eq!(out.source, SourceKind::Telemetry);
        assert_eq!(out.body, br#"{"t":1}"#);
        assert_eq!(out.enqueued_at, Some(1_700_000_000_000));
        assert_eq!(out.properties.len(), 1, "only the properties a rule uses are kept");
        assert_eq!(&*out.properties[0].0, CREATION_TIME);
        let p = position_of(&m);
        assert_eq!((p.sequence, p.offset.as_deref()), (Some(42), Some("4200")));
        assert_eq!(Received::read(&encode(&m)).unwrap().sequence(), Some(42));
    }

    /// Design step 9: the key is the partition's `(x-opt-enqueued-time, sequence number)`, the
    /// same on every read, scanned in place or decoded whole; without both it is an arrival key.
    #[test]
    fn a_partition_message_is_keyed_by_its_enqueued_time_and_sequence_number() {
        let m = Msg::new(br#"{"t":1}"#)
            .ann(DEVICE_ID, s("pump-1"))
            .ann(ENQUEUED_TIME, Value::Timestamp(Timestamp::from_milliseconds(1_700_000_000_123)))
            .ann(SEQUENCE_NUMBER, Value::Long(42))
            .build();
        let want = MsgKey::partition(0, 1_700_000_000_123, 42);
        assert_eq!(to_ingest(&mut m.clone(), &settings()).unwrap().key, want);
        let encoded = encode(&m);
        let scanned = Received::read(&encoded).unwrap();
        assert!(scanned.scanned());
        assert_eq!(scanned.to_ingest(&settings()).unwrap().key, want, "read again, in place");
        let unsequenced = Msg::new(br#"{"t":1}"#)
            .ann(DEVICE_ID, s("pump-1"))
            .ann(ENQUEUED_TIME, Value::Timestamp(Timestamp::from_milliseconds(1_700_000_000_123)))
            .build();
        let key = to_ingest(&mut unsequenced.clone(), &settings()).unwrap().key;
        assert!(!key.from_partition() && !key.is_none(), "{key:?}");
    }

    #[test]
    fn several_data_sections_are_joined_and_one_is_moved() {
        let mut m = Msg::new(b"").ann(DEVICE_ID, s("d")).build();
        m.body = Body::Data(Batch::new(vec![Data(Binary::from(b"{\"a\":".to_vec())), Data(Binary::from(b"1}".to_vec()))]));
        assert_eq!(to_ingest(&mut m, &settings()).unwrap().body, br#"{"a":1}"#);
        let mut m = Msg::new(br#"{"b":2}"#).ann(DEVICE_ID, s("d")).build();
        assert_eq!(to_ingest(&mut m, &settings()).unwrap().body, br#"{"b":2}"#);
    }

    #[test]
    fn an_empty_annotation_does_not_fall_back_to_the_property() {
        // As before the one-pass lookup: the annotation is chosen, then found empty.
        let mut m = Msg::new(br#"{"deviceId":"from-body"}"#).ann(DEVICE_ID, s("")).prop(DEVICE_ID, "from-prop").build();
        assert_eq!(&*to_ingest(&mut m, &settings()).unwrap().device_id, "from-body");
        let mut m = Msg::new(b"{}").ann(DEVICE_ID, Value::Long(7)).build();
        assert_eq!(&*to_ingest(&mut m, &settings()).unwrap().device_id, "7", "a number is rendered as text");
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
            let out = to_ingest(&mut m.clone(), &settings()).unwrap();
            assert_eq!(out.source, kind, "{source}");
            assert_eq!(out.properties.iter().find(|(k, _)| &**k == "opType").map(|(_, v)| &**v), Some(op));
        }
    }

    #[test]
    fn schema_property_classifies_when_the_source_annotation_is_missing() {
        let m = Msg::new(b"{}").prop(DEVICE_ID, "d").prop(MESSAGE_SCHEMA, "twinChangeNotification").build();
        assert_eq!(to_ingest(&mut m.clone(), &settings()).unwrap().source, SourceKind::TwinChange);
        let m = Msg::new(b"{}").prop(DEVICE_ID, "d").prop(MESSAGE_SCHEMA, "Telemetry").build();
        assert_eq!(to_ingest(&mut m.clone(), &settings()).unwrap().source, SourceKind::Telemetry);
    }

    #[test]
    fn plain_event_hub_device_id_comes_from_properties_then_the_body() {
        let m = Msg::new(b"{}").prop(DEVICE_ID, "from-prop").build();
        assert_eq!(&*to_ingest(&mut m.clone(), &settings()).unwrap().device_id, "from-prop");
        let m = Msg::new(br#"{"deviceId":"from-body","t":2}"#).build();
        assert_eq!(&*to_ingest(&mut m.clone(), &settings()).unwrap().device_id, "from-body");
        let custom = MapSettings { custom_device_id_key: "dev".into(), ..settings() };
        let m = Msg::new(br#"{"dev":"custom","t":2}"#).build();
        assert_eq!(&*to_ingest(&mut m.clone(), &custom).unwrap().device_id, "custom");
    }

    #[test]
    fn unusable_messages_are_rejected_with_their_fault() {
        let fault = |mut m: Message<Body<Value>>| to_ingest(&mut m, &settings()).unwrap_err().fault;
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
        assert_eq!(to_ingest(&mut m.clone(), &settings()).unwrap().body, b"\x00\x01binary");
    }

    #[test]
    fn amqp_value_bodies_become_json() {
        let mut map = OrderedMap::new();
        map.insert(s("deviceId"), s("v"));
        map.insert(Value::Symbol(Symbol::from("t")), Value::Double(21.5.into()));
        let mut m = Msg::new(b"").build();
        m.body = Body::Value(AmqpValue(Value::Map(map)));
        let out = to_ingest(&mut m.clone(), &settings()).unwrap();
        assert_eq!(&*out.device_id, "v");
        let json: serde_json::Value = serde_json::from_slice(&out.body).unwrap();
        assert_eq!(json, serde_json::json!({"deviceId": "v", "t": 21.5}));
        m.body = Body::Value(AmqpValue(s(r#"{"deviceId":"w"}"#)));
        assert_eq!(&*to_ingest(&mut m.clone(), &settings()).unwrap().device_id, "w");
    }

    fn encode(m: &Message<Body<Value>>) -> bytes::Bytes {
        use fe2o3_amqp::types::messaging::message::__private::Serializable;
        serde_amqp::to_vec(&Serializable(m.clone())).unwrap().into()
    }

    /// What the owning core would get, compared field by field (or the fault).
    fn outcome(r: Result<IngestMessage, Rejected>) -> String {
        match r {
            // A partition's key is the message's own; an arrival key differs on every read.
            Ok(m) => format!("{} {:?} {:?} {:?} {:?} {:?}", m.device_id, m.source, m.properties, m.body, m.enqueued_at, m.key.from_partition().then_some(m.key)),
            Err(r) => format!("{:?} {:?} {}", r.fault, r.device, r.detail),
        }
    }

    /// The message read from its encoding the way the consumer reads it, against fe2o3's
    /// whole decoding of the same message: the same result and position.
    fn read_as_decoded(m: Message<Body<Value>>, scanned: bool) {
        let encoded = encode(&m);
        let received = Received::read(&encoded).unwrap();
        assert_eq!(received.scanned(), scanned, "{m:?}");
        assert_eq!(received.position(), position_of(&m));
        assert_eq!(received.sequence(), position_of(&m).sequence);
        assert_eq!(outcome(received.to_ingest(&settings())), outcome(to_ingest(&mut m.clone(), &settings())), "{m:?}");
    }

    #[test]
    fn encoded_messages_are_read_in_place_as_fe2o3_would_decode_them() {
        let ts = Value::Timestamp(Timestamp::from_milliseconds(1_700_000_000_000));
        let messages = [
            Msg::new(br#"{"t":1}"#)
                .ann(DEVICE_ID, s("pump-1"))
                .ann(MESSAGE_SOURCE, s("Telemetry"))
                .ann(IOTHUB_ENQUEUED_TIME, ts.clone())
                .ann(SEQUENCE_NUMBER, Value::Long(42))
                .ann(OFFSET, s("4200"))
                .ann(ENQUEUED_TIME, ts.clone())
                .prop("iothub-creation-time-utc", "2024-01-02T03:04:05Z")
                .prop("color", "red")
                .build(),
            Msg::new(b"{}").ann(DEVICE_ID, s("d")).ann(MESSAGE_SOURCE, s("twinChangeEvents")).prop("opType", "updateTwin").build(),
            Msg::new(b"{}").prop(DEVICE_ID, "d").prop(MESSAGE_SCHEMA, "twinChangeNotification").build(),
            Msg::new(br#"{"deviceId":"from-body","t":2}"#).ann(SEQUENCE_NUMBER, Value::Int(-3)).build(),
            Msg::new(br#"{"deviceId":"from-body"}"#).ann(DEVICE_ID, s("")).prop(DEVICE_ID, "from-prop").build(),
            Msg::new(b"{}").ann(DEVICE_ID, Value::Long(7)).ann(SEQUENCE_NUMBER, s("12")).ann(ENQUEUED_TIME, s("2024-01-02T03:04:05Z")).build(),
            Msg::new(b"{}").ann(DEVICE_ID, Value::Symbol(Symbol::from("sym"))).ann(SEQUENCE_NUMBER, Value::Ulong(9)).build(),
            Msg::new(b"{}").ann(DEVICE_ID, Value::Uuid([7; 16].into())).ann(IOTHUB_ENQUEUED_TIME, Value::Long(1_700_000_000_001)).build(),
            Msg::new(br#"{"t":1}"#).build(),
            Msg::new(&[b' '; 2000]).ann(DEVICE_ID, s("d")).build(),
            Msg::new(b"{}").ann(DEVICE_ID, s(&"x".repeat(300))).build(),
            Msg::new(b"[]").ann(DEVICE_ID, s("d")).ann(MESSAGE_SOURCE, s("digitalTwinChangeEvents")).build(),
            Msg::new(b"\x00\x01binary").ann(DEVICE_ID, s("d")).ann(OFFSET, Value::Long(100)).build(),
        ];
        for m in messages {
            read_as_decoded(m, true);
        }
        // Several Data sections are joined.
        let mut m = Msg::new(b"").ann(DEVICE_ID, s("d")).build();
        m.body = Body::Data(Batch::new(vec![Data(Binary::from(b"{\"a\":".to_vec())), Data(Binary::from(b"1}".to_vec()))]));
        read_as_decoded(m, true);
    }

    #[test]
    fn sections_and_values_the_scanner_does_not_use_are_skipped() {
        use fe2o3_amqp::types::messaging::{Footer, Header, Properties as AmqpProperties};
        let mut nested = OrderedMap::new();
        nested.insert(s("k"), Value::List(vec![Value::Int(1), Value::Described(Box::new(serde_amqp::described::Described {
            descriptor: serde_amqp::descriptor::Descriptor::Code(0x99),
            value: Value::Array(vec![Value::Long(1), Value::Long(2)].into()),
        }))]));
        let mut m = Msg::new(b"{}")
            .ann("x-opt-partition-key", Value::Map(nested))
            .ann(DEVICE_ID, s("d"))
            .ann("x-double", Value::Double(1.5.into()))
            .ann(SEQUENCE_NUMBER, Value::Long(1 << 40))
            .prop("big", &"y".repeat(400))
            .build();
        m.message_annotations.as_mut().unwrap().0.insert(OwnedKey::Ulong(5), s("numbered key"));
        m.header = Some(Header { durable: true, ..Default::default() });
        m.properties = Some(AmqpProperties { subject: Some("s".into()), ..Default::default() });
        let mut footer = OrderedMap::new();
        footer.insert(OwnedKey::Symbol(Symbol::from("f")), Value::Bool(true));
        m.footer = Some(Footer(footer));
        read_as_decoded(m, true);
    }

    #[test]
    fn other_bodies_are_decoded_whole_and_garbage_is_refused() {
        let mut map = OrderedMap::new();
        map.insert(s("deviceId"), s("v"));
        let mut m = Msg::new(b"").ann(SEQUENCE_NUMBER, Value::Long(3)).build();
        m.body = Body::Value(AmqpValue(Value::Map(map)));
        read_as_decoded(m.clone(), false);
        m.body = Body::Value(AmqpValue(s(r#"{"deviceId":"w"}"#)));
        read_as_decoded(m, false);

        assert!(Received::read(&bytes::Bytes::from_static(b"not amqp")).is_err());
        // Truncated: the scanner gives up, fe2o3 refuses it.
        let whole = encode(&Msg::new(b"{}").ann(DEVICE_ID, s("d")).build());
        assert!(Received::read(&whole.slice(..whole.len() - 1)).is_err());
        // Described values nested without end: refused, not a stack overflow.
        let mut deep = vec![0x00, 0x53, 0x72, 0xd1, 0, 0, 0, 107, 0, 0, 0, 2, 0xa3, 1, b'k'];
        deep.extend(std::iter::repeat_n(0x00, 100));
        assert!(Received::read(&bytes::Bytes::from(deep)).is_err());
    }
}
