//! Reading a received message where it lies, in its encoded bytes (AMQP 1.0 §3.2 message
//! format, §1.6 types), instead of decoding it whole.
//!
//! fe2o3 would decode every section into owned values: each annotation and property name and
//! text a `String` in a hashed map, the body copied into a `Vec` of its own. hubcast reads a
//! dozen fields of two maps and the body, so [`scan`] walks the sections once, skips every
//! value by its encoded size, and keeps where each field it uses lies (names compared as
//! bytes) and the body's `Data` sections; a kept field is decoded when it is read
//! ([`Scalar`]: text borrowed, numbers and times without an allocation). A kept field that
//! does not decode (a string that is not UTF-8) reads as absent.
//!
//! The scanner reads what IoT Hub and Event Hubs send (sections named by numeric
//! descriptors, the body in `Data` sections). Anything else (an `AmqpValue` or
//! `AmqpSequence` body, a section named by symbol, bytes that do not parse) returns `None`,
//! and the caller decodes the message whole with fe2o3 as before ([`super::map::Received`]).

use fe2o3_amqp::types::primitives::Value;

use super::map::{slot, Fields};
use super::reader::Reader;

/// Section descriptors (§3.2): the ones read, the ones skipped; any other is left to fe2o3.
const HEADER: u64 = 0x70;
const DELIVERY_ANNOTATIONS: u64 = 0x71;
const MESSAGE_ANNOTATIONS: u64 = 0x72;
const PROPERTIES: u64 = 0x73;
const APPLICATION_PROPERTIES: u64 = 0x74;
const DATA: u64 = 0x75;
const FOOTER: u64 = 0x78;

/// The `Data` sections of a body, in order (almost always exactly one).
#[derive(Default)]
pub struct DataSections<'a> {
    first: Option<&'a [u8]>,
    rest: Vec<&'a [u8]>,
}

impl<'a> DataSections<'a> {
    fn push(&mut self, section: &'a [u8]) {
        if self.first.is_none() {
            self.first = Some(section);
        } else {
            self.rest.push(section);
        }
    }

    /// The body: the sections joined (one copy).
    pub fn to_vec(&self) -> Vec<u8> {
        let len = self.first.map_or(0, <[u8]>::len) + self.rest.iter().map(|s| s.len()).sum::<usize>();
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(self.first.unwrap_or_default());
        for s in &self.rest {
            out.extend_from_slice(s);
        }
        out
    }
}

/// The fields hubcast reads and the body, borrowed from `bytes` (one encoded message); `None`
/// for anything the scanner does not read (then the message is decoded whole).
pub(super) fn scan(bytes: &[u8]) -> Option<(Fields<'_>, DataSections<'_>)> {
    // A field is held as a 32-bit span into the message: one of 4 GiB or more (possible only
    // with a `--max-message-bytes` that large) is decoded whole instead, never read short.
    u32::try_from(bytes.len()).ok()?;
    let mut r = Reader::new(bytes);
    let mut fields = Fields::scanned(bytes);
    let mut body = DataSections::default();
    while r.pos < r.buf.len() {
        if r.u8()? != 0x00 {
            return None;
        }
        let descriptor = match r.u8()? {
            0x53 => u64::from(r.u8()?),
            0x80 => u64::from_be_bytes(r.take(8)?.try_into().ok()?),
            _ => return None,
        };
        match descriptor {
            HEADER | DELIVERY_ANNOTATIONS | PROPERTIES | FOOTER => {
                r.skip(0)?;
            }
            MESSAGE_ANNOTATIONS => r.map(|name, value| {
                if let Some(i) = slot(name) {
                    fields.set_scanned(true, i, value);
                }
            })?,
            APPLICATION_PROPERTIES => r.map(|name, value| {
                if let Some(i) = slot(name) {
                    fields.set_scanned(false, i, value);
                }
            })?,
            DATA => body.push(match r.u8()? {
                0xa0 => {
                    let n = usize::from(r.u8()?);
                    r.take(n)?
                }
                0xb0 => {
                    let n = r.u32()? as usize;
                    r.take(n)?
                }
                _ => return None,
            }),
            _ => return None,
        }
    }
    Some((fields, body))
}

/// A kept value, decoded from its encoding: text borrowed, the usual numbers and times
/// read directly, anything else through fe2o3's decoder (without allocating for numbers).
pub(super) enum Scalar<'a> {
    Str(&'a str),
    Sym(&'a str),
    Long(i64),
    /// Milliseconds since the epoch.
    Timestamp(i64),
    Other(Value),
}

impl<'a> Scalar<'a> {
    /// `None` if `encoded` (one value, constructor included) does not decode.
    pub(super) fn decode(encoded: &'a [u8]) -> Option<Self> {
        let text = |start: usize| std::str::from_utf8(encoded.get(start..)?).ok();
        let int = || Some(i64::from_be_bytes(encoded.get(1..9)?.try_into().ok()?));
        Some(match *encoded.first()? {
            0xa1 => Scalar::Str(text(2)?),
            0xb1 => Scalar::Str(text(5)?),
            0xa3 => Scalar::Sym(text(2)?),
            0xb3 => Scalar::Sym(text(5)?),
            0x55 => Scalar::Long(i64::from(*encoded.get(1)? as i8)),
            0x81 => Scalar::Long(int()?),
            0x83 => Scalar::Timestamp(int()?),
            _ => Scalar::Other(serde_amqp::from_slice::<Value>(encoded).ok()?),
        })
    }
}

