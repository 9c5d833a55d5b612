//! RFC 6455 framing over our own buffers (tungstenite's header codec; monoio-tungstenite's
//! stream type cannot be split into a reader and a writer task).

use std::io::Cursor;

use tungstenite::protocol::frame::coding::{Control, Data, OpCode};
use tungstenite::protocol::frame::FrameHeader;

/// Largest message a client may send us (clients only send small protocol packets).
pub const MAX_INCOMING_MESSAGE: usize = 64 * 1024;

/// One complete incoming message or control frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming {
    Text(String),
    Binary,
    Ping(Vec<u8>),
    Pong,
    Close,
}

/// A protocol violation: the close code and reason to answer with.
#[derive(Debug, PartialEq, Eq)]
pub struct Violation(pub u16, pub &'static str);

/// Reassembles client frames into messages.
#[derive(Default)]
pub struct FrameReader {
    fragments: Vec<u8>,
    fragment_text: bool,
    in_fragmented: bool,
}

impl FrameReader {
    /// Parses as many frames from `buf` as are complete; returns the bytes consumed.
    pub fn parse(&mut self, buf: &mut [u8], out: &mut Vec<Incoming>) -> Result<usize, Violation> {
        let mut pos = 0;
        loop {
            let mut cursor = Cursor::new(&buf[pos..]);
            let (header, len) = match FrameHeader::parse(&mut cursor) {
                Ok(Some(h)) => h,
                Ok(None) => return Ok(pos),
                Err(_) => return Err(Violation(1002, "malformed frame")),
            };
            let header_len = cursor.position() as usize;
            if len as usize > MAX_INCOMING_MESSAGE {
                return Err(Violation(1009, "message too big"));
            }
            let len = len as usize;
            if buf.len() - pos < header_len + len {
                return Ok(pos);
            }
            if header.rsv1 || header.rsv2 || header.rsv3 {
                return Err(Violation(1002, "reserved bits set"));
            }
            let Some(mask) = header.mask else {
                return Err(Violation(1002, "client frames must be masked"));
            };
            let payload = &mut buf[pos + header_len..pos + header_len + len];
            for (i, b) in payload.iter_mut().enumerate() {
                *b ^= mask[i & 3];
            }
            pos += header_len + len;
            match header.opcode {
                OpCode::Control(c) => {
                    if !header.is_final || len > 125 {
                        return Err(Violation(1002, "bad control frame"));
                    }
                    out.push(match c {
                        Control::Ping => Incoming::Ping(payload.to_vec()),
                        Control::Pong => Incoming::Pong,
                        Control::Close => {
                            check_close_payload(payload)?;
                            Incoming::Close
                        }
                        Control::Reserved(_) => return Err(Violation(1002, "reserved opcode")),
                    });
                }
                OpCode::Data(d) => {
                    match d {
                        Data::Continue if !self.in_fragmented => {
                            return Err(Violation(1002, "continuation without a message"))
                        }
                        Data::Continue => {}
                        Data::Text | Data::Binary if self.in_fragmented => {
                            return Err(Violation(1002, "new message inside a fragmented one"))
                        }
                        Data::Text => self.fragment_text = true,
                        Data::Binary => self.fragment_text = false,
                        Data::Reserved(_) => return Err(Violation(1002, "reserved opcode")),
                    }
                    if self.fragments.len() + len > MAX_INCOMING_MESSAGE {
                        return Err(Violation(1009, "message too big"));
                    }
                    self.fragments.extend_from_slice(payload);
                    self.in_fragmented = !header.is_final;
                    if header.is_final {
                        let data = std::mem::take(&mut self.fragments);
                        if self.fragment_text {
                            let text = String::from_utf8(data).map_err(|_| Violation(1007, "text is not UTF-8"))?;
                            out.push(Incoming::Text(text));
                        } else {
                            out.push(Incoming::Binary);
                        }
                    }
                }
            }
        }
    }
}

/// Whether a close code may be sent by a peer (RFC 6455 §7.4 and the IANA registry): 1000–1003,
/// 1007–1014 and the application ranges 3000–4999. 1005, 1006 and 1015 are never sent.
pub fn valid_close_code(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

/// A close frame's body is empty, or a valid code followed by a UTF-8 reason.
fn check_close_payload(payload: &[u8]) -> Result<(), Violation> {
    match payload {
        [] => Ok(()),
        [_] => Err(Violation(1002, "close frame with a one-byte body")),
        [hi, lo, reason @ ..] => {
            if !valid_close_code(u16::from_be_bytes([*hi, *lo])) {
                return Err(Violation(1002, "invalid close code"));
            }
            std::str::from_utf8(reason).map(|_| ()).map_err(|_| Violation(1007, "close reason is not UTF-8"))
        }
    }
}

/// Appends the header of one final, unmasked server frame (RFC 6455 §5.2): FIN and the
/// opcode, then the payload length in 7 bits, or 126 and 16 bits, or 127 and 64 bits.
/// Written by hand because this runs once per frame on the fan-out path (tungstenite's
/// `FrameHeader::format` goes through `io::Write`, ~3 % of a saturated core's samples).
fn put_header(out: &mut Vec<u8>, opcode: OpCode, len: usize) {
    let first = 0x80 | u8::from(opcode);
    match len {
        0..=125 => out.extend_from_slice(&[first, len as u8]),
        126..=0xFFFF => {
            let l = (len as u16).to_be_bytes();
            out.extend_from_slice(&[first, 126, l[0], l[1]]);
        }
        _ => {
            out.extend_from_slice(&[first, 127]);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
}

/// Appends one unmasked server frame.
pub fn write_frame(out: &mut Vec<u8>, opcode: OpCode, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    put_header(out, opcode, len);
    for p in parts {
        out.extend_from_slice(p);
    }
}

pub fn write_text(out: &mut Vec<u8>, parts: &[&[u8]]) {
    write_frame(out, OpCode::Data(Data::Text), parts);
}

/// Appends one text frame holding the JSON array `[e1,e2,…]` of `elements` (each already
/// JSON, written as the concatenation of its parts); `payload_len` is its length (the
/// elements, one separator or bracket each, and the closing bracket). Returns 1, the frames
/// written.
pub fn write_text_array<const N: usize>(out: &mut Vec<u8>, elements: &[[&[u8]; N]], payload_len: usize) -> u64 {
    debug_assert_eq!(payload_len, elements.iter().map(|e| e.iter().map(|p| p.len()).sum::<usize>() + 1).sum::<usize>() + 1);
    put_header(out, OpCode::Data(Data::Text), payload_len);
    out.reserve(payload_len);
    for (i, e) in elements.iter().enumerate() {
        out.push(if i == 0 { b'[' } else { b',' });
        for part in e {
            out.extend_from_slice(part);
        }
    }
    out.push(b']');
    1
}

pub fn write_close(out: &mut Vec<u8>, code: u16, reason: &str) {
    let reason = &reason.as_bytes()[..reason.len().min(120)];
    write_frame(out, OpCode::Control(Control::Close), &[&code.to_be_bytes(), reason]);
}

pub fn write_ping(out: &mut Vec<u8>) {
    write_frame(out, OpCode::Control(Control::Ping), &[]);
}

pub fn write_pong(out: &mut Vec<u8>, payload: &[u8]) {
    write_frame(out, OpCode::Control(Control::Pong), &[payload]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_frame_headers_are_those_tungstenite_writes() {
        for opcode in [OpCode::Data(Data::Text), OpCode::Data(Data::Binary), OpCode::Control(Control::Close), OpCode::Control(Control::Ping), OpCode::Control(Control::Pong)] {
            for len in [0usize, 1, 125, 126, 127, 1000, 65535, 65536, 1 << 20] {
                let mut ours = Vec::new();
                put_header(&mut ours, opcode, len);
                let mut theirs = Vec::new();
                FrameHeader { is_final: true, rsv1: false, rsv2: false, rsv3: false, opcode, mask: None }.format(len as u64, &mut theirs).unwrap();
                assert_eq!(ours, theirs, "{opcode:?} {len}");
            }
        }
    }

    fn masked(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
        let mask = [1, 2, 3, 4];
        let mut v = vec![opcode | if fin { 0x80 } else { 0 }, 0x80 | payload.len() as u8];
        v.extend_from_slice(&mask);
        v.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
        v
    }

    #[test]
    fn fragmented_text_is_reassembled_and_partial_frames_wait() {
        let mut buf = masked(0x1, false, b"he");
        buf.extend(masked(0x0, true, b"llo"));
        let mut reader = FrameReader::default();
        let mut out = Vec::new();
        let whole = buf.len();
        assert_eq!(reader.parse(&mut buf[..whole - 1].to_vec(), &mut out).unwrap(), 8);
        let mut out = Vec::new();
        let mut reader = FrameReader::default();
        assert_eq!(reader.parse(&mut buf, &mut out).unwrap(), whole);
        assert_eq!(out, vec![Incoming::Text("hello".into())]);
    }

    #[test]
    fn close_codes_are_checked() {
        for code in [0u16, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000, 65535] {
            let mut frame = masked(0x8, true, &code.to_be_bytes());
            assert_eq!(FrameReader::default().parse(&mut frame, &mut Vec::new()).unwrap_err().0, 1002, "{code}");
        }
        for code in [1000u16, 1001, 1003, 1007, 1011, 1014, 3000, 4999] {
            let mut frame = masked(0x8, true, &code.to_be_bytes());
            let mut out = Vec::new();
            FrameReader::default().parse(&mut frame, &mut out).unwrap();
            assert_eq!(out, vec![Incoming::Close], "{code}");
        }
        let mut one_byte = masked(0x8, true, &[3]);
        assert_eq!(FrameReader::default().parse(&mut one_byte, &mut Vec::new()).unwrap_err().0, 1002);
        let mut bad_reason = masked(0x8, true, &[3, 232, 0xff]);
        assert_eq!(FrameReader::default().parse(&mut bad_reason, &mut Vec::new()).unwrap_err().0, 1007);
    }

    /// A random frame stream: whole messages, fragments, control frames, garbage.
    fn random_stream(rng: &mut fastrand::Rng) -> Vec<u8> {
        let mut buf = Vec::new();
        for _ in 0..rng.usize(1..8) {
            let len = if rng.u8(..10) == 0 { rng.usize(126..3000) } else { rng.usize(0..126) };
            let payload: Vec<u8> = (0..len).map(|_| if rng.bool() { rng.u8(b'a'..=b'z') } else { rng.u8(..) }).collect();
            let opcode = [0x0, 0x1, 0x2, 0x8, 0x9, 0xa, 0x3, 0xb][rng.usize(..8)];
            let mask = [rng.u8(..), rng.u8(..), rng.u8(..), rng.u8(..)];
            let mut first = opcode | if rng.u8(..4) == 0 { 0 } else { 0x80 };
            if rng.u8(..20) == 0 {
                first |= 0x40; // rsv1
            }
            buf.push(first);
            let masked_bit = if rng.u8(..20) == 0 { 0 } else { 0x80 };
            if len < 126 {
                buf.push(masked_bit | len as u8);
            } else {
                buf.push(masked_bit | 126);
                buf.extend_from_slice(&(len as u16).to_be_bytes());
            }
            if masked_bit != 0 {
                buf.extend_from_slice(&mask);
            }
            buf.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
            if rng.u8(..30) == 0 {
                let junk = rng.usize(1..20);
                buf.extend((0..junk).map(|_| rng.u8(..)));
            }
        }
        buf
    }

    /// Feeds `input` in pieces split at `cuts`, the way reads deliver it; returns the messages
    /// and the first violation.
    fn parse_in_pieces(input: &[u8], cuts: &[usize]) -> (Vec<Incoming>, Option<Violation>) {
        let mut reader = FrameReader::default();
        let mut pending = Vec::new();
        let mut out = Vec::new();
        let mut from = 0;
        for &to in cuts.iter().chain(std::iter::once(&input.len())) {
            pending.extend_from_slice(&input[from..to]);
            from = to;
            match reader.parse(&mut pending, &mut out) {
                Ok(used) => {
                    pending.drain(..used);
                }
                Err(v) => return (out, Some(v)),
            }
        }
        (out, None)
    }

    /// Property test (fixed seed, bounded): arbitrary bytes never panic the decoder, and the
    /// same bytes split anywhere give the same messages and the same verdict.
    #[test]
    fn random_streams_split_anywhere_decode_the_same() {
        let mut rng = fastrand::Rng::with_seed(0x6455);
        for _ in 0..3000 {
            let input = random_stream(&mut rng);
            let whole = parse_in_pieces(&input, &[]);
            let mut cuts: Vec<usize> = (0..rng.usize(1..6)).map(|_| rng.usize(0..=input.len())).collect();
            cuts.sort_unstable();
            assert_eq!(parse_in_pieces(&input, &cuts), whole, "input {input:?} cut at {cuts:?}");
            let bytewise: Vec<usize> = (1..input.len()).collect();
            assert_eq!(parse_in_pieces(&input, &bytewise), whole, "input {input:?} byte by byte");
        }
        for _ in 0..20_000 {
            let noise: Vec<u8> = (0..rng.usize(0..64)).map(|_| rng.u8(..)).collect();
            let _ = parse_in_pieces(&noise, &[noise.len() / 2]);
        }
    }

    #[test]
    fn unmasked_and_invalid_utf8_frames_are_violations() {
        let mut reader = FrameReader::default();
        assert_eq!(reader.parse(&mut [0x81, 0x01, b'a'], &mut Vec::new()).unwrap_err().0, 1002);
        assert_eq!(reader.parse(&mut masked(0x1, true, &[0xff]), &mut Vec::new()).unwrap_err().0, 1007);
    }
}
