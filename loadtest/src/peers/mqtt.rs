//! MQTT 3.1.1 at QoS 0 (binary, over the broker's WebSocket listener with the `mqtt`
//! subprotocol): the packets a subscriber and a publisher send (`CONNECT`, `SUBSCRIBE`,
//! `PUBLISH`, `PINGREQ`), and a parser of what the broker sends (`CONNACK`, `SUBACK`,
//! `PUBLISH`, `PINGRESP`) over a byte stream whose WebSocket frames need not end where a
//! packet ends.

use std::io;

use super::Event;

const CONNECT: u8 = 0x10;
const CONNACK: u8 = 2;
const PUBLISH: u8 = 3;
const SUBSCRIBE: u8 = 0x82;
const SUBACK: u8 = 9;
const PINGRESP: u8 = 13;

/// The variable-length "remaining length" of a fixed header.
fn push_len(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let b = (n % 128) as u8;
        n /= 128;
        out.push(if n > 0 { b | 0x80 } else { b });
        if n == 0 {
            return;
        }
    }
}

fn push_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

/// `CONNECT`: clean session, no keep-alive (the broker sends nothing unasked, and a client
/// busy reading is not cut off); its `CONNACK` is the [`Event::Ack`].
pub fn hello(out: &mut Vec<u8>, client_id: &str) {
    let mut body = Vec::with_capacity(16 + client_id.len());
    push_str(&mut body, b"MQTT");
    body.extend_from_slice(&[4, 0x02, 0, 0]);
    push_str(&mut body, client_id.as_bytes());
    out.push(CONNECT);
    push_len(out, body.len());
    out.extend_from_slice(&body);
}

/// One `SUBSCRIBE` with every topic at QoS 0; its `SUBACK` is the [`Event::Ack`].
pub fn subscribe<'a>(out: &mut Vec<u8>, topics: impl Iterator<Item = &'a str>) {
    let mut body = vec![0, 1];
    for t in topics {
        push_str(&mut body, t.as_bytes());
        body.push(0);
    }
    out.push(SUBSCRIBE);
    push_len(out, body.len());
    out.extend_from_slice(&body);
}

/// `PUBLISH` at QoS 0 (no packet id, nothing answered).
pub fn publish(out: &mut Vec<u8>, topic: &str, payload: &[u8]) {
    out.push(PUBLISH << 4);
    push_len(out, 2 + topic.len() + payload.len());
    push_str(out, topic.as_bytes());
    out.extend_from_slice(payload);
}

/// `PINGREQ`: the broker answers `PINGRESP` once it has handled the packets sent before it.
pub fn ping(out: &mut Vec<u8>) {
    out.extend_from_slice(&[0xC0, 0]);
}

/// The topic of a device's telemetry (as `loadtest/mqtt_idle.py` names it).
pub fn topic(device: &str) -> String {
    format!("devices/{device}/telemetry")
}

/// Hands every complete packet at the start of `buf` to `f`; returns how many bytes they took.
pub fn parse(buf: &[u8], mut f: impl FnMut(Event<'_>)) -> io::Result<usize> {
    let mut at = 0;
    loop {
        let Some((head, len)) = fixed_header(&buf[at..])? else { break };
        let end = at + head + len;
        if buf.len() < end {
            break;
        }
        let kind = buf[at] >> 4;
        let body = &buf[at + head..end];
        match kind {
            PUBLISH => {
                let qos = (buf[at] >> 1) & 3;
                let topic_len = body.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]]) as usize).ok_or_else(|| bad("PUBLISH"))?;
                let start = 2 + topic_len + if qos > 0 { 2 } else { 0 };
                f(Event::Message(body.get(start..).ok_or_else(|| bad("PUBLISH"))?));
            }
            CONNACK => match body.get(1) {
                Some(0) => f(Event::Ack),
                rc => f(Event::Error(format!("MQTT: CONNACK refused ({rc:?})"))),
            },
            SUBACK if body.get(2..).is_some_and(|codes| codes.contains(&0x80)) => f(Event::Error("MQTT: a subscription was refused".into())),
            SUBACK | PINGRESP => f(Event::Ack),
            _ => {}
        }
        at = end;
    }
    Ok(at)
}

/// (header length, remaining length) of the packet at the start of `bytes`, if complete enough.
fn fixed_header(bytes: &[u8]) -> io::Result<Option<(usize, usize)>> {
    let mut len = 0usize;
    for i in 1..5 {
        let Some(&b) = bytes.get(i) else { return Ok(None) };
        len |= usize::from(b & 0x7F) << (7 * (i - 1));
        if b & 0x80 == 0 {
            return Ok(Some((i + 1, len)));
        }
    }
    Err(bad("remaining length over 4 bytes"))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("MQTT: malformed {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_lengths_take_one_to_four_bytes() {
        for (n, want) in [(0usize, vec![0u8]), (127, vec![0x7F]), (128, vec![0x80, 1]), (16_383, vec![0xFF, 0x7F]), (2_097_152, vec![0x80, 0x80, 0x80, 1])] {
            let mut out = Vec::new();
            push_len(&mut out, n);
            assert_eq!(out, want, "{n}");
            let mut packet = vec![0x30];
            packet.extend_from_slice(&out);
            assert_eq!(fixed_header(&packet).unwrap(), Some((1 + want.len(), n)));
        }
    }

    #[test]
    fn packets_are_read_whole_and_a_split_one_waits() {
        let mut all = vec![0x20, 2, 0, 0]; // CONNACK accepted
        publish(&mut all, "a/b", b"hello");
        all.extend_from_slice(&[0x90, 3, 0, 1, 0]); // SUBACK granted QoS 0
        all.extend_from_slice(&[0xD0, 0]); // PINGRESP
        let whole = all.len();
        publish(&mut all, "a/b", b"cut");
        all.truncate(all.len() - 1);
        let mut seen = Vec::new();
        let used = parse(&all, |e| {
            seen.push(match e {
                Event::Message(p) => String::from_utf8_lossy(p).into_owned(),
                Event::Ack => "ack".into(),
                Event::Ping => "ping".into(),
                Event::Error(e) => e,
            })
        })
        .unwrap();
        assert_eq!(seen, ["ack", "hello", "ack", "ack"]);
        assert_eq!(used, whole);
        let mut refused = Vec::new();
        parse(&[0x90, 3, 0, 1, 0x80, 0x20, 2, 0, 5], |e| refused.push(matches!(e, Event::Error(_)))).unwrap();
        assert_eq!(refused, [true, true]);
    }
}
