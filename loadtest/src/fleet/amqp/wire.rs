//! AMQP 1.0 framing for the harness's endpoint (AMQP 1.0 §2.3, §5.3): frames cut from the
//! byte stream, performatives decoded and encoded with fe2o3-amqp-types and serde_amqp,
//! and the one hot frame, a pre-settled transfer of a telemetry message, written by hand.
//!
//! Why by hand: fe2o3's `Sender::send` builds a `Message` of owned `Value`s, serializes it,
//! and hands the transfer through the link, session and connection tasks, one socket write
//! per message; that made the harness, not hubcast, the limit of every AMQP measurement
//! (docs/BENCHMARKS.md). Here a transfer is ~250 bytes appended to the connection's output
//! buffer with a handful of stores, and one write carries hundreds of them. The bytes are
//! those fe2o3 writes for [`super::telemetry`] (checked by the tests below).

use std::io::Write;

use bytes::{Buf, BytesMut};
use fe2o3_amqp::types::definitions::Handle;
use fe2o3_amqp::types::performatives::{Performative, Transfer};
use serde::Serialize;
use serde_amqp::de::Deserializer;
use serde_amqp::read::IoReader;
use serde_amqp::ser::Serializer;

use super::super::write_body;

/// Frame types (§2.3.1, §5.3.1).
pub const FRAME_AMQP: u8 = 0;
pub const FRAME_SASL: u8 = 1;
/// Protocol headers (§2.2, §5.3.1).
pub const HEADER_AMQP: [u8; 8] = *b"AMQP\x00\x01\x00\x00";
pub const HEADER_SASL: [u8; 8] = *b"AMQP\x03\x01\x00\x00";

/// Appends a frame: the header, `body` (a performative or SASL frame body), then `payload`.
pub fn put_frame<T: Serialize>(out: &mut Vec<u8>, kind: u8, channel: u16, body: &T, payload: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, 2, kind]);
    out.extend_from_slice(&channel.to_be_bytes());
    // Serializing fe2o3's own types into a Vec cannot fail.
    body.serialize(&mut Serializer::from(&mut *out)).expect("an AMQP performative serializes");
    out.extend_from_slice(payload);
    let size = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

/// Appends an empty frame (a heartbeat, §2.4.5).
pub fn put_empty_frame(out: &mut Vec<u8>) {
    out.extend_from_slice(&[0, 0, 0, 8, 2, FRAME_AMQP, 0, 0]);
}

/// A frame cut from the input: its type, channel and body (performative and payload).
pub struct Frame {
    pub kind: u8,
    pub channel: u16,
    pub body: BytesMut,
}

/// Cuts the next whole frame off `buf`; `None` until one has fully arrived.
pub fn take_frame(buf: &mut BytesMut, max_frame_size: usize) -> Result<Option<Frame>, String> {
    if buf.len() < 8 {
        return Ok(None);
    }
    let size = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let doff = buf[4] as usize * 4;
    if size < 8 || doff < 8 || doff > size || size > max_frame_size {
        return Err(format!("bad frame header (size {size}, data offset {doff})"));
    }
    if buf.len() < size {
        return Ok(None);
    }
    let mut body = buf.split_to(size);
    let (kind, channel) = (body[5], u16::from_be_bytes([body[6], body[7]]));
    body.advance(doff);
    Ok(Some(Frame { kind, channel, body }))
}

/// Decodes the performative at the start of `body`, leaving the payload (of a transfer) in it.
pub fn performative(body: &mut BytesMut) -> Result<Performative, serde_amqp::Error> {
    let mut de = Deserializer::new(IoReader::new(body.reader()));
    serde::Deserialize::deserialize(&mut de)
}

/// The annotations of a telemetry message, in [`super::telemetry`]'s order.
const SEQUENCE: &[u8] = b"x-opt-sequence-number";
const OFFSET: &[u8] = b"x-opt-offset";
const ENQUEUED: &[u8] = b"x-opt-enqueued-time";
const IOTHUB_ENQUEUED: &[u8] = b"iothub-enqueuedtime";
const DEVICE: &[u8] = b"iothub-connection-device-id";
const SOURCE: &[u8] = b"iothub-message-source";

fn put_symbol(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&[0xa3, s.len() as u8]); // sym8
    out.extend_from_slice(s);
}

/// A `str8` (< 256 bytes) or `str32` string, as serde_amqp picks.
fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    if s.len() < 256 {
        out.extend_from_slice(&[0xa1, s.len() as u8]);
    } else {
        out.push(0xb1);
        out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    }
    out.extend_from_slice(s);
}

/// Replaces the bytes from `at` to the end with a `vbin8`/`vbin32` of them: written in place
/// after a 2-byte `vbin8` header reserved at `at`, moved only in the (unused) long case.
fn close_binary(out: &mut Vec<u8>, at: usize) {
    let n = out.len() - at - 2;
    if n < 256 {
        out[at] = 0xa0;
        out[at + 1] = n as u8;
    } else {
        let body = out.split_off(at + 2);
        out.truncate(at);
        out.push(0xb0);
        out.extend_from_slice(&(n as u32).to_be_bytes());
        out.extend_from_slice(&body);
    }
}

/// Appends one pre-settled transfer frame carrying telemetry message `seq` of `device` as IoT
/// Hub puts it on its endpoint: the bytes fe2o3 writes for
/// `Transfer { handle, delivery_id, delivery_tag: delivery_id as 4 bytes, message_format: 0,
/// settled: true }` followed by [`super::telemetry`]'s message (message annotations, then
/// one `Data` section whose body is [`write_body`]'s JSON).
#[allow(clippy::too_many_arguments)]
pub fn put_telemetry_transfer(
    out: &mut Vec<u8>,
    channel: u16,
    handle: u32,
    delivery_id: u32,
    device: &str,
    seq: i64,
    now_ms: i64,
    sent_at_micros: u64,
) {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, 2, FRAME_AMQP]);
    out.extend_from_slice(&channel.to_be_bytes());
    // transfer (0x14): list8 of 5 fields
    out.extend_from_slice(&[0x00, 0x53, 0x14, 0xc0, 0, 5]);
    let list_at = out.len() - 2;
    put_uint(out, handle);
    put_uint(out, delivery_id);
    out.extend_from_slice(&[0xa0, 4]); // delivery-tag: vbin8 of 4 bytes
    out.extend_from_slice(&delivery_id.to_be_bytes());
    out.extend_from_slice(&[0x43, 0x41]); // message-format: uint0; settled: true
    out[list_at] = (out.len() - list_at - 1) as u8;
    // message-annotations (0x72): a map
    out.extend_from_slice(&[0x00, 0x53, 0x72, 0xc1, 0, 12]);
    let map_at = out.len() - 2;
    put_symbol(out, SEQUENCE);
    match i8::try_from(seq) {
        Ok(small) => out.extend_from_slice(&[0x55, small as u8]), // smalllong
        Err(_) => {
            out.push(0x81); // long
            out.extend_from_slice(&seq.to_be_bytes());
        }
    }
    put_symbol(out, OFFSET);
    out.extend_from_slice(&[0xa1, 0]);
    let offset_at = out.len();
    let _ = write!(out, "{}", seq * 100);
    out[offset_at - 1] = (out.len() - offset_at) as u8;
    put_symbol(out, ENQUEUED);
    out.push(0x83); // timestamp
    out.extend_from_slice(&now_ms.to_be_bytes());
    put_symbol(out, IOTHUB_ENQUEUED);
    out.push(0x83);
    out.extend_from_slice(&now_ms.to_be_bytes());
    put_symbol(out, DEVICE);
    put_string(out, device.as_bytes());
    put_symbol(out, SOURCE);
    put_string(out, b"Telemetry");
    close_map(out, map_at);
    // data (0x75): the JSON body
    out.extend_from_slice(&[0x00, 0x53, 0x75, 0, 0]);
    let body_at = out.len() - 2;
    write_body(out, sent_at_micros, seq as u64);
    close_binary(out, body_at);
    let size = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

/// A `uint` as serde_amqp writes it: `uint0`, `smalluint` or 4 bytes.
/// The performative of a pre-settled, single-frame transfer with delivery `id` on `handle` (its
/// tag is the id's bytes): what the endpoint sends for a reply, and what the hand-written
/// telemetry transfer must equal byte for byte.
pub fn settled_transfer(handle: u32, id: u32) -> Transfer {
    Transfer {
        handle: Handle(handle),
        delivery_id: Some(id),
        delivery_tag: Some(serde_bytes::ByteBuf::from(id.to_be_bytes().to_vec())),
        message_format: Some(0),
        settled: Some(true),
        more: false,
        rcv_settle_mode: None,
        state: None,
        resume: false,
        aborted: false,
        batchable: false,
    }
}

fn put_uint(out: &mut Vec<u8>, v: u32) {
    match v {
        0 => out.push(0x43),
        1..=255 => out.extend_from_slice(&[0x52, v as u8]),
        _ => {
            out.push(0x70);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

/// Sets the size of the `map8` whose size byte is at `at` (count already written), or widens
/// it to a `map32` when its content reached 255 bytes (a device id of ~70 characters).
fn close_map(out: &mut Vec<u8>, at: usize) {
    let size = out.len() - at - 1;
    if size < 256 {
        out[at] = size as u8;
    } else {
        let count = out[at + 1] as u32;
        let content = out.split_off(at + 2);
        out.truncate(at - 1);
        out.push(0xd1);
        out.extend_from_slice(&((content.len() + 4) as u32).to_be_bytes());
        out.extend_from_slice(&count.to_be_bytes());
        out.extend_from_slice(&content);
    }
}

#[cfg(test)]
mod tests {
    use fe2o3_amqp::types::messaging::message::__private::{Deserializable, Serializable};
    use fe2o3_amqp::types::messaging::{Body, Message};
    use fe2o3_amqp::types::primitives::Value;

    use super::*;
    use crate::fleet::amqp::telemetry_at;

    /// The frame fe2o3's sender writes for a pre-settled [`super::super::telemetry`].
    fn fe2o3_frame(channel: u16, handle: u32, id: u32, device: &str, seq: i64, now_ms: i64, body: &[u8]) -> Vec<u8> {
        let transfer = settled_transfer(handle, id);
        let message = serde_amqp::to_vec(&Serializable(telemetry_at(device, seq, now_ms, body))).unwrap();
        let mut out = Vec::new();
        put_frame(&mut out, FRAME_AMQP, channel, &transfer, &message);
        out
    }

    fn body_of(sent_at: u64, seq: i64) -> Vec<u8> {
        let mut body = Vec::new();
        write_body(&mut body, sent_at, seq as u64);
        body
    }

    #[test]
    fn a_hand_written_transfer_is_the_bytes_fe2o3_writes() {
        let now_ms = 1_764_200_000_123;
        let sent_at = 1_764_200_000_123_456;
        for (channel, handle, id, device, seq) in [
            (0, 0, 0, "dev-000001", 0),
            (1, 3, 255, "dev-009999", 41),
            (7, 256, 70_000, "d", 123_456_789_012),
            (0, 1, u32::MAX, "a-device-id-long-enough-to-push-the-annotations-map-past-255-bytes-xxxxxx", 5),
        ] {
            let mut mine = Vec::new();
            put_telemetry_transfer(&mut mine, channel, handle, id, device, seq, now_ms, sent_at);
            let theirs = fe2o3_frame(channel, handle, id, device, seq, now_ms, &body_of(sent_at, seq));
            assert_eq!(mine, theirs, "device {device} seq {seq}");
        }
    }

    #[test]
    fn a_hand_written_transfer_decodes_in_fe2o3_as_telemetry() {
        let (now_ms, sent_at) = (1_764_200_000_123, 1_764_200_000_123_456);
        let mut out = Vec::new();
        put_telemetry_transfer(&mut out, 2, 5, 9, "dev-000042", 42, now_ms, sent_at);
        put_telemetry_transfer(&mut out, 2, 5, 10, "dev-000043", 43, now_ms, sent_at);
        let mut input = BytesMut::from(&out[..]);
        for (id, device, seq) in [(9, "dev-000042", 42), (10, "dev-000043", 43)] {
            let mut frame = take_frame(&mut input, 65_536).unwrap().unwrap();
            assert_eq!((frame.kind, frame.channel), (FRAME_AMQP, 2));
            let Performative::Transfer(t) = performative(&mut frame.body).unwrap() else { panic!("not a transfer") };
            assert_eq!((t.handle.0, t.delivery_id, t.settled, t.more), (5, Some(id), Some(true), false));
            let Deserializable(message) = serde_amqp::from_slice::<Deserializable<Message<Body<Value>>>>(&frame.body).unwrap();
            let expected = telemetry_at(device, seq, now_ms, &body_of(sent_at, seq));
            assert_eq!(message.message_annotations, expected.message_annotations);
            match message.body {
                Body::Data(batch) => assert_eq!(batch.iter().map(|d| d.0.to_vec()).collect::<Vec<_>>(), vec![expected.body.0.to_vec()]),
                other => panic!("body {other:?}"),
            }
        }
        assert!(take_frame(&mut input, 65_536).unwrap().is_none());
    }
}
