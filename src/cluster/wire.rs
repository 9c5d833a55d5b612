//! What crosses Redis: shared operations on the `ops` channel, device messages on the
//! `device:<id>` channels, and the access of a session on a device in its `session:<id>` hash.
//!
//! Binary and versioned (first byte), with every length checked on the way in: a payload
//! that does not decode is counted and skipped, never trusted. The access record is the
//! durable store's own encoding (`store::format`), so both engines keep grants alike.

use crate::ids::SessionId;
use crate::ingest::{IngestMessage, JsonText, MsgKey, Properties, SourceKind};
use crate::shard::access::Access;
use crate::shard::{ConnectionView, Grants, Subscriptions, TelemetryView, TwinView};
use crate::store::{format, Change, Record};

const VERSION: u8 = 1;
/// Device messages carry the origin's sequence number since version 2 (design step 7: a
/// message published again after a slot move is applied once); version 1 still decodes,
/// without one.
const MESSAGE_VERSION: u8 = 2;

/// A change every instance applies to its copy of a session.
#[derive(Debug, Clone, PartialEq)]
pub enum SharedOp {
    /// A new session (stored in Redis; the other instances load it when they first need it).
    Create(SessionId),
    Delete(SessionId),
    DeleteAll,
    /// The session's whole access on one device after a change (`None`: none left), as an
    /// instance before issue 23's step 4 publishes it (still applied, without a version).
    Access { session: SessionId, device: Box<str>, access: Option<(Grants, Subscriptions)> },
    /// One request's changes to a session: its whole access on each device it touched, as
    /// written at version `v` of the session (`P:session:<id>`'s `v` field). Applied on a
    /// device only if `v` is newer than what the device holds (a late or repeated op is a
    /// no-op), so no barrier orders it with the changing instance's own copy.
    Accesses { session: SessionId, v: u64, changes: Vec<(Box<str>, super::AccessOn)> },
}

const OP_DELETE: u8 = 1;
const OP_DELETE_ALL: u8 = 2;
const OP_ACCESS: u8 = 3;
const OP_ACCESSES: u8 = 4;

fn put_str(buf: &mut Vec<u8>, s: &[u8]) {
    buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
    buf.extend_from_slice(s);
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let out = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(out)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn i64(&mut self) -> Option<i64> {
        Some(i64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn u128(&mut self) -> Option<u128> {
        Some(u128::from_le_bytes(self.take(16)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes()?).ok()
    }
    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }
    fn rest(&mut self) -> &'a [u8] {
        let out = &self.bytes[self.at..];
        self.at = self.bytes.len();
        out
    }
}

/// The access record (the durable store's encoding).
pub fn encode_access(device: &str, session: SessionId, access: Option<&(Grants, Subscriptions)>) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    let whole = access.map(|(grants, subs)| Access::new(grants.clone(), subs.clone()));
    format::encode(&mut buf, Change::Access { device, session, access: whole.as_ref() });
    buf
}

pub fn decode_access(bytes: &[u8]) -> Option<(Box<str>, SessionId, super::AccessOn)> {
    let mut found = None;
    format::decode(bytes, &mut |record| {
        if let Record::Access(device, session, access) = record {
            found = Some((device, session, access));
        }
    })
    .ok()?;
    found
}

/// An operation as published on the `ops` channel, with the instance it comes from.
pub fn encode_op(origin: &str, op: &SharedOp) -> Vec<u8> {
    let mut buf = vec![VERSION];
    put_str(&mut buf, origin.as_bytes());
    match op {
        SharedOp::Create(_) => unreachable!("a new session is not published"),
        SharedOp::Delete(id) => {
            buf.push(OP_DELETE);
            buf.extend_from_slice(&id.0.to_le_bytes());
        }
        SharedOp::DeleteAll => buf.push(OP_DELETE_ALL),
        SharedOp::Access { session, device, access } => {
            buf.push(OP_ACCESS);
            buf.extend_from_slice(&encode_access(device, *session, access.as_ref()));
        }
        SharedOp::Accesses { session, v, changes } => {
            buf.push(OP_ACCESSES);
            buf.extend_from_slice(&session.0.to_le_bytes());
            buf.extend_from_slice(&v.to_le_bytes());
            buf.extend_from_slice(&(changes.len() as u32).to_le_bytes());
            for (device, access) in changes {
                put_str(&mut buf, &encode_access(device, *session, access.as_ref()));
            }
        }
    }
    buf
}

pub fn decode_op(bytes: &[u8]) -> Option<(&str, SharedOp)> {
    let mut r = Reader { bytes, at: 0 };
    if r.u8()? != VERSION {
        return None;
    }
    let origin = r.str()?;
    let op = match r.u8()? {
        OP_DELETE => SharedOp::Delete(SessionId(r.u128()?)),
        OP_DELETE_ALL => SharedOp::DeleteAll,
        OP_ACCESS => {
            let (device, session, access) = decode_access(r.rest())?;
            SharedOp::Access { session, device, access }
        }
        OP_ACCESSES => {
            let session = SessionId(r.u128()?);
            let v = r.i64()? as u64;
            let n = r.u32()? as usize;
            // Each change takes at least its 4-byte length: a count past what is left lies.
            if n > r.bytes.len().saturating_sub(r.at) / 4 {
                return None;
            }
            let mut changes = Vec::with_capacity(n);
            for _ in 0..n {
                let (device, of, access) = decode_access(r.bytes()?)?;
                if of != session {
                    return None;
                }
                changes.push((device, access));
            }
            if r.at != r.bytes.len() {
                return None;
            }
            SharedOp::Accesses { session, v, changes }
        }
        _ => return None,
    };
    Some((origin, op))
}

/// A read another instance may answer (defined with the session directory it is asked through).
pub use crate::app::directory::ReadKind;

/// `P:read`: "who holds `device` (newer than `newer_than`)? answer on my channel, quoting
/// `id`". `newer_than` goes last, only when given: an older instance ignores it (it answers
/// whatever it holds, and the freshest answer still wins).
pub fn encode_read(origin: &str, id: u64, device: &str, kind: &ReadKind, newer_than: Option<i64>) -> Vec<u8> {
    let mut buf = vec![VERSION];
    put_str(&mut buf, origin.as_bytes());
    buf.extend_from_slice(&id.to_le_bytes());
    put_str(&mut buf, device.as_bytes());
    match kind {
        ReadKind::Telemetry(None) => buf.push(1),
        ReadKind::Telemetry(Some(key)) => {
            buf.push(2);
            put_str(&mut buf, key.as_bytes());
        }
        ReadKind::Twin => buf.push(3),
        ReadKind::ConnectionState => buf.push(4),
    }
    if let Some(t) = newer_than {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    buf
}

/// A read as [`encode_read`] wrote it: origin, id, device, kind, `newer_than`.
pub type ReadAsked<'a> = (&'a str, u64, Box<str>, ReadKind, Option<i64>);

pub fn decode_read(bytes: &[u8]) -> Option<ReadAsked<'_>> {
    let mut r = Reader { bytes, at: 0 };
    if r.u8()? != VERSION {
        return None;
    }
    let origin = r.str()?;
    let id = r.i64()? as u64;
    let device = r.str()?.into();
    let kind = match r.u8()? {
        1 => ReadKind::Telemetry(None),
        2 => ReadKind::Telemetry(Some(r.str()?.into())),
        3 => ReadKind::Twin,
        4 => ReadKind::ConnectionState,
        _ => return None,
    };
    let newer_than = match r.remaining() {
        0 => None,
        _ => Some(r.i64()?),
    };
    Some((origin, id, device, kind, newer_than))
}

/// The answer to a read: what the holder holds (`None`: nothing) and how new its data is.
///
/// Found byte: 0 nothing, 2 a typed view ([`encode_view`]). 1 was a rendered JSON body
/// (hubcast before typed reads); decoded as "holds nothing usable", so a read asked during
/// a rolling upgrade does not wait for the deadline on an older instance.
pub fn encode_answer(id: u64, found: Option<(i64, &View)>) -> Vec<u8> {
    let mut buf = vec![VERSION];
    buf.extend_from_slice(&id.to_le_bytes());
    match found {
        Some((newest, view)) => {
            buf.push(2);
            buf.extend_from_slice(&newest.to_le_bytes());
            encode_view(&mut buf, view);
        }
        None => buf.push(0),
    }
    buf
}

pub fn decode_answer(bytes: &[u8]) -> Option<(u64, Option<(i64, View)>)> {
    let mut r = Reader { bytes, at: 0 };
    if r.u8()? != VERSION {
        return None;
    }
    let id = r.i64()? as u64;
    let found = match r.u8()? {
        0 | 1 => None,
        2 => {
            let newest = r.i64()?;
            Some((newest, read_view(&mut r)?))
        }
        _ => return None,
    };
    Some((id, found))
}

/// A read's answer, typed (defined with the session directory it is returned through).
pub use crate::app::directory::View;

const VIEW_ONE: u8 = 1;
const VIEW_ALL: u8 = 2;
const VIEW_TWIN: u8 = 3;
const VIEW_CONNECTION: u8 = 4;

/// Appends `view`: telemetry values as their JSON text bytes, as the device sent them (not
/// re-serialised); a twin as its JSON text (serialised once, here).
pub fn encode_view(buf: &mut Vec<u8>, view: &View) {
    match view {
        View::Telemetry(TelemetryView::One { key, json, at }) => {
            buf.push(VIEW_ONE);
            put_str(buf, key.as_bytes());
            put_str(buf, json.as_str().as_bytes());
            buf.extend_from_slice(&at.to_le_bytes());
        }
        View::Telemetry(TelemetryView::All(values)) => {
            buf.push(VIEW_ALL);
            buf.extend_from_slice(&(values.len() as u32).to_le_bytes());
            for (key, json, at) in values {
                put_str(buf, key.as_bytes());
                put_str(buf, json.as_str().as_bytes());
                buf.extend_from_slice(&at.to_le_bytes());
            }
        }
        View::Twin(twin) => {
            buf.push(VIEW_TWIN);
            put_str(buf, twin.doc.to_string().as_bytes());
            buf.extend_from_slice(&twin.at.to_le_bytes());
        }
        View::Connection(c) => {
            buf.push(VIEW_CONNECTION);
            buf.push(c.connected as u8);
            buf.extend_from_slice(&c.at.to_le_bytes());
        }
    }
}

/// A view as [`encode_view`] wrote it, the whole of `bytes`; `None` for anything else (cut,
/// trailing bytes, a value that is not one JSON text).
pub fn decode_view(bytes: &[u8]) -> Option<View> {
    let mut r = Reader { bytes, at: 0 };
    let view = read_view(&mut r)?;
    r.rest().is_empty().then_some(view)
}

/// One telemetry value's JSON text, checked (it is rendered into a record as it is).
fn json_text(r: &mut Reader<'_>) -> Option<JsonText> {
    let text = r.str()?;
    serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
    Some(JsonText::new(text))
}

fn read_view(r: &mut Reader<'_>) -> Option<View> {
    Some(match r.u8()? {
        VIEW_ONE => {
            let key = r.str()?.into();
            let json = json_text(r)?;
            View::Telemetry(TelemetryView::One { key, json, at: r.i64()? })
        }
        VIEW_ALL => {
            let n = r.u32()? as usize;
            // Each value takes at least 16 bytes: never reserve more than the payload holds.
            let mut values = Vec::with_capacity(n.min(r.remaining() / 16));
            for _ in 0..n {
                let key = r.str()?.into();
                let json = json_text(r)?;
                values.push((key, json, r.i64()?));
            }
            View::Telemetry(TelemetryView::All(values))
        }
        VIEW_TWIN => {
            let doc = serde_json::from_str(r.str()?).ok()?;
            View::Twin(TwinView { doc, at: r.i64()? })
        }
        VIEW_CONNECTION => {
            let connected = match r.u8()? {
                0 => false,
                1 => true,
                _ => return None,
            };
            View::Connection(ConnectionView { connected, at: r.i64()? })
        }
        _ => return None,
    })
}

fn source_code(s: SourceKind) -> u8 {
    s as u8
}

fn source_of(code: u8) -> Option<SourceKind> {
    Some(match code {
        0 => SourceKind::Telemetry,
        1 => SourceKind::TwinChange,
        2 => SourceKind::ConnectionState,
        3 => SourceKind::Lifecycle,
        _ => return None,
    })
}

/// The name of the property that carries a message's stable key ([`MsgKey`], design step 9)
/// in a version 2 frame: its last property, the value 32 hex digits (`ms` as the bits of an
/// i64, then `n`). An instance before step 9 reads it as one more property that no rule looks
/// up, so instances of both kinds keep exchanging messages (the older ones only do not
/// recognise re-reads); a device property cannot take its place (it is never the last one
/// of a frame written here, and one that does not parse stays a property).
pub const KEY_PROPERTY: &str = "\u{0}k";

/// The most properties a device message may carry across (its key not counted).
const MAX_PROPERTIES: usize = 1024;

/// A device message as published on its device's channel: `seq` grows with every message
/// the origin publishes of the device (receivers drop one not newer than the last applied).
pub fn encode_message(origin: &str, seq: u64, msg: &IngestMessage) -> Vec<u8> {
    let props: usize = msg.properties.iter().map(|(k, v)| k.len() + v.len() + 8).sum();
    let keyed = !msg.key.is_none();
    let mut buf = Vec::with_capacity(82 + origin.len() + msg.device_id.len() + props + msg.body.len());
    buf.push(MESSAGE_VERSION);
    put_str(&mut buf, origin.as_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    put_str(&mut buf, msg.device_id.as_bytes());
    buf.push(source_code(msg.source));
    buf.extend_from_slice(&msg.enqueued_at.unwrap_or(i64::MIN).to_le_bytes());
    buf.extend_from_slice(&((msg.properties.len() + keyed as usize) as u32).to_le_bytes());
    for (k, v) in &msg.properties {
        put_str(&mut buf, k.as_bytes());
        put_str(&mut buf, v.as_bytes());
    }
    if keyed {
        put_str(&mut buf, KEY_PROPERTY.as_bytes());
        buf.extend_from_slice(&32u32.to_le_bytes());
        put_hex(&mut buf, msg.key.ms as u64);
        put_hex(&mut buf, msg.key.n);
    }
    buf.extend_from_slice(&msg.body);
    buf
}

fn put_hex(buf: &mut Vec<u8>, v: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for i in (0..16).rev() {
        buf.push(DIGITS[(v >> (i * 4)) as usize & 15]);
    }
}

/// [`KEY_PROPERTY`]'s value; `None` unless exactly 32 lowercase hex digits.
fn key_of(text: &str) -> Option<MsgKey> {
    fn hex(b: &[u8]) -> Option<u64> {
        b.iter().try_fold(0u64, |acc, &c| {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                _ => return None,
            };
            Some(acc << 4 | u64::from(d))
        })
    }
    let b = text.as_bytes();
    if b.len() != 32 {
        return None;
    }
    Some(MsgKey { ms: hex(&b[..16])? as i64, n: hex(&b[16..])? })
}

/// The origin instance, its sequence number (`None`: version 1, from an instance before
/// step 7) and the message (with its key, when the frame carries one: [`KEY_PROPERTY`]);
/// `None` for a payload that does not decode.
pub fn decode_message(bytes: &[u8]) -> Option<(&str, Option<u64>, IngestMessage)> {
    let mut r = Reader { bytes, at: 0 };
    let version = r.u8()?;
    if version != VERSION && version != MESSAGE_VERSION {
        return None;
    }
    let origin = r.str()?;
    let seq = if version == MESSAGE_VERSION { Some(r.i64()? as u64) } else { None };
    let device_id: Box<str> = r.str()?.into();
    let source = source_of(r.u8()?)?;
    let enqueued_at = Some(r.i64()?).filter(|t| *t != i64::MIN);
    let n = r.u32()? as usize;
    let mut properties = Properties::new();
    let mut key = MsgKey::NONE;
    // At most 1,024 properties, and the key after them (one more entry since step 9).
    for i in 0..n.min(MAX_PROPERTIES + 1) {
        let (k, v) = (r.str()?, r.str()?);
        if i + 1 == n && k == KEY_PROPERTY {
            if let Some(found) = key_of(v) {
                key = found;
                continue;
            }
        }
        properties.push((k.into(), v.into()));
    }
    if properties.len() > MAX_PROPERTIES || n > MAX_PROPERTIES + 1 {
        return None;
    }
    let body = r.rest().to_vec();
    let arrived = Some(crate::metrics::Arrival::now());
    Some((origin, seq, IngestMessage { device_id, source, properties, body, enqueued_at, arrived, key }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DataKind, Grant, GrantKind, Subscription};

    #[test]
    fn messages_and_ops_round_trip_and_garbage_is_refused() {
        let mut props = Properties::new();
        props.push(("opType".into(), "updateTwin".into()));
        let msg = IngestMessage {
            device_id: "pump-1".into(),
            source: SourceKind::TwinChange,
            properties: props,
            body: br#"{"a":1}"#.to_vec(),
            enqueued_at: Some(42),
            arrived: None,
            key: Default::default(),
        };
        let bytes = encode_message("i1", u64::MAX - 1, &msg);
        let (origin, seq, back) = decode_message(&bytes).unwrap();
        assert_eq!((origin, seq), ("i1", Some(u64::MAX - 1)));
        // Version 1 (no sequence number) still decodes.
        let mut v1 = vec![VERSION];
        v1.extend_from_slice(&bytes[1..7]);
        v1.extend_from_slice(&bytes[15..]);
        let (origin, seq, old) = decode_message(&v1).unwrap();
        assert_eq!((origin, seq, &*old.device_id, old.body.as_slice()), ("i1", None, "pump-1", &br#"{"a":1}"#[..]));
        assert_eq!((&*back.device_id, back.source, back.body.as_slice(), back.enqueued_at), ("pump-1", SourceKind::TwinChange, &br#"{"a":1}"#[..], Some(42)));
        assert_eq!(back.properties.as_slice(), msg.properties.as_slice());
        for cut in 0..bytes.len() - msg.body.len() {
            assert!(decode_message(&bytes[..cut]).is_none(), "a payload cut at {cut} must not decode");
        }

        let mut access = Access::default();
        access.add_grant(&Grant { kind: GrantKind::Data(DataKind::Telemetry), key: Some("t".into()) });
        assert!(access.subscribe(&Subscription { kind: DataKind::Telemetry, key: Some("t".into()) }));
        let whole = Some((access.grants(), access.subs()));
        let op = SharedOp::Access { session: SessionId(7), device: "d".into(), access: whole.clone() };
        let bytes = encode_op("i2", &op);
        assert_eq!(decode_op(&bytes), Some(("i2", op)));
        // One request's changes: every device's whole access at the session's new version.
        let op = SharedOp::Accesses { session: SessionId(7), v: 12, changes: vec![("d".into(), whole), ("e".into(), None)] };
        let bytes = encode_op("i2", &op);
        assert_eq!(decode_op(&bytes), Some(("i2", op)));
        for cut in 0..bytes.len() {
            assert!(decode_op(&bytes[..cut]).is_none(), "an op cut at {cut} must not decode");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_op(&longer).is_none(), "a trailing byte is refused");
        let mut lying = bytes.clone();
        let count_at = 1 + 4 + 2 + 1 + 16 + 8;
        lying[count_at..count_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_op(&lying).is_none(), "a count past the payload is refused");
        let gone = SharedOp::Delete(SessionId(9));
        assert_eq!(decode_op(&encode_op("i2", &gone)), Some(("i2", gone)));
        assert_eq!(decode_op(b"\x02garbage"), None);

        let kind = ReadKind::Telemetry(Some("t".into()));
        let bytes = encode_read("i3", 5, "d", &kind, None);
        assert_eq!(decode_read(&bytes), Some(("i3", 5, "d".into(), kind.clone(), None)));
        let newer = encode_read("i3", 6, "d", &kind, Some(-7));
        assert_eq!(decode_read(&newer), Some(("i3", 6, "d".into(), kind, Some(-7))));
        for cut in bytes.len() + 1..newer.len() {
            assert!(decode_read(&newer[..cut]).is_none(), "a read cut at {cut} inside newer_than must not decode");
        }
        assert_eq!(decode_answer(&encode_answer(6, None)), Some((6, None)));
        assert!(decode_read(&bytes[..bytes.len() - 1]).is_none());
    }

    /// Design step 9: a message's key crosses as the frame's last property; an instance
    /// before step 9 (the decoder as it was, below) still reads the frame, body and
    /// properties intact, one ignored property more; a frame without a key reads as before.
    #[test]
    fn a_message_key_crosses_in_a_frame_older_instances_still_read() {
        let mut props = Properties::new();
        props.push(("opType".into(), "x".into()));
        let mut msg = IngestMessage {
            device_id: "pump-1".into(),
            source: SourceKind::Telemetry,
            properties: props,
            body: br#"{"a":1}"#.to_vec(),
            enqueued_at: Some(42),
            arrived: None,
            key: MsgKey::partition(7, 1_700_000_000_123, 987_654),
        };
        for key in [msg.key, MsgKey::arrival(-5), MsgKey { ms: i64::MAX, n: u64::MAX }] {
            msg.key = key;
            let bytes = encode_message("i1", 3, &msg);
            let (_, _, back) = decode_message(&bytes).unwrap();
            assert_eq!((back.key, back.properties.as_slice(), back.body.as_slice()), (key, msg.properties.as_slice(), msg.body.as_slice()));
            for cut in 0..bytes.len() - msg.body.len() {
                assert!(decode_message(&bytes[..cut]).is_none(), "a keyed payload cut at {cut} must not decode");
            }
            // The decoder before step 9: every property kept, the body the rest.
            let mut r = Reader { bytes: &bytes, at: 0 };
            assert_eq!(r.u8(), Some(MESSAGE_VERSION));
            let (_, _, _, _, _) = (r.str().unwrap(), r.i64().unwrap(), r.str().unwrap(), r.u8().unwrap(), r.i64().unwrap());
            let n = r.u32().unwrap();
            let old: Vec<(&str, &str)> = (0..n).map(|_| (r.str().unwrap(), r.str().unwrap())).collect();
            assert_eq!(old, vec![("opType", "x"), (KEY_PROPERTY, std::str::from_utf8(&bytes[bytes.len() - 7 - 32..bytes.len() - 7]).unwrap())]);
            assert_eq!(r.rest(), msg.body.as_slice());
        }
        // The most properties a message may carry still cross with the key beside them; one
        // more does not.
        msg.key = MsgKey::partition(7, 1_700_000_000_123, 987_654);
        msg.properties = (0..1024).map(|i| (format!("p{i}").into(), "v".into())).collect();
        let (_, _, back) = decode_message(&encode_message("i1", 3, &msg)).expect("1,024 properties and a key");
        assert_eq!((back.key, back.properties.len()), (msg.key, 1024));
        msg.properties.push(("p1024".into(), "v".into()));
        assert!(decode_message(&encode_message("i1", 3, &msg)).is_none(), "1,025 properties and a key");
        msg.key = MsgKey::NONE;
        assert!(decode_message(&encode_message("i1", 3, &msg)).is_none(), "1,025 properties");
        msg.properties = Properties::new();
        msg.properties.push(("opType".into(), "x".into()));
        // As an instance before step 9 writes it (no key): no key, the same properties.
        msg.key = MsgKey::NONE;
        let (_, _, back) = decode_message(&encode_message("i1", 3, &msg)).unwrap();
        assert_eq!((back.key, back.properties.len()), (MsgKey::NONE, 1));
        // A device property of that name that does not hold a key stays a property.
        msg.properties.push((KEY_PROPERTY.into(), "not a key".into()));
        let (_, _, back) = decode_message(&encode_message("i1", 3, &msg)).unwrap();
        assert_eq!((back.key, back.properties.as_slice()), (MsgKey::NONE, msg.properties.as_slice()));
    }

    fn views() -> Vec<View> {
        vec![
            View::Telemetry(TelemetryView::One { key: "t".into(), json: JsonText::new(r#"{"deep":[1,2.50,"x"]}"#), at: 1_700_000_000_123 }),
            View::Telemetry(TelemetryView::All(vec![
                ("a".into(), JsonText::new("1.0e3"), 5),
                ("b\u{e9}".into(), JsonText::new(r#""caf\u00e9""#), -1),
                ("c".into(), JsonText::new("null"), i64::MAX),
            ])),
            View::Telemetry(TelemetryView::All(Vec::new())),
            View::Twin(TwinView { doc: serde_json::json!({"version": 3, "properties": {"reported": {"n": 1}}}), at: 7 }),
            View::Connection(ConnectionView { connected: true, at: 8 }),
            View::Connection(ConnectionView { connected: false, at: 0 }),
        ]
    }

    /// Typed answers cross as they are: telemetry values keep their exact text (`2.50`,
    /// `1.0e3`, escapes), and an answer cut anywhere, or with a byte more, does not decode
    /// (and never panics).
    #[test]
    fn views_round_trip_byte_for_byte_and_cut_answers_are_refused() {
        for view in views() {
            let mut bytes = Vec::new();
            encode_view(&mut bytes, &view);
            assert_eq!(decode_view(&bytes).as_ref(), Some(&view));
            for cut in 0..bytes.len() {
                assert_eq!(decode_view(&bytes[..cut]), None, "{view:?} cut at {cut}");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(decode_view(&longer), None, "{view:?} with a trailing byte");

            let answer = encode_answer(42, Some((99, &view)));
            assert_eq!(decode_answer(&answer), Some((42, Some((99, view.clone())))));
            for cut in 0..answer.len() {
                assert!(decode_answer(&answer[..cut]).is_none(), "{view:?}: the answer cut at {cut} must not decode");
            }
        }
        if let View::Telemetry(TelemetryView::One { json, .. }) = &views()[0] {
            assert_eq!(json.as_str(), r#"{"deep":[1,2.50,"x"]}"#);
        }
    }

    /// A value that is not JSON, a count larger than the payload, unknown tags: refused
    /// without reserving what the count claims.
    #[test]
    fn views_that_lie_are_refused() {
        let mut bad = vec![VIEW_ONE];
        put_str(&mut bad, b"k");
        put_str(&mut bad, b"{not json");
        bad.extend_from_slice(&1i64.to_le_bytes());
        assert_eq!(decode_view(&bad), None);
        let mut huge = vec![VIEW_ALL];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_view(&huge), None);
        assert_eq!(decode_view(&[VIEW_CONNECTION, 2, 0, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(decode_view(&[9]), None);
        let mut twin = vec![VIEW_TWIN];
        put_str(&mut twin, b"[1,");
        twin.extend_from_slice(&0i64.to_le_bytes());
        assert_eq!(decode_view(&twin), None);
        // An older instance's rendered body: answered, holding nothing usable.
        let mut old = vec![VERSION];
        old.extend_from_slice(&3u64.to_le_bytes());
        old.push(1);
        old.extend_from_slice(&5i64.to_le_bytes());
        put_str(&mut old, b"{}");
        assert_eq!(decode_answer(&old), Some((3, None)));
    }

    /// Every byte string: the decoders answer or refuse, never panic (what a fuzzer would
    /// find first): each prefix of every answer with each byte flipped.
    #[test]
    fn no_input_makes_a_decoder_panic() {
        for view in views() {
            let answer = encode_answer(1, Some((2, &view)));
            for at in 0..answer.len() {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut b = answer.clone();
                    b[at] ^= flip;
                    let _ = decode_answer(&b);
                    let _ = decode_view(&b[9.min(b.len())..]);
                    let _ = decode_read(&b);
                    let _ = decode_op(&b);
                    let _ = decode_message(&b);
                }
            }
        }
    }
}
