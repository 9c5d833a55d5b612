//! The NATS client protocol (text, over the server's WebSocket listener): what a subscriber and
//! a publisher send (`CONNECT`, `SUB`, `PUB`, `PING`, `PONG`), and a parser of what the server
//! sends (`INFO`, `MSG`, `PING`, `PONG`, `+OK`, `-ERR`) over a byte stream whose WebSocket
//! frames need not end where a protocol message ends.

use std::io::{self, Write};

use super::Event;

/// Sent first: no `+OK` per command (`verbose: false`), no echo of our own publications, and a
/// `PING` whose `PONG` says the server took the `CONNECT`.
pub fn hello(out: &mut Vec<u8>, name: &str) {
    let _ = write!(
        out,
        "CONNECT {{\"verbose\":false,\"pedantic\":false,\"echo\":false,\"protocol\":1,\"name\":\"{name}\",\"lang\":\"rust\",\"version\":\"0.1\"}}\r\nPING\r\n"
    );
}

/// One `SUB` per subject (sid 1, 2, …), then a `PING`: its `PONG` comes once every `SUB` is in.
pub fn subscribe<'a>(out: &mut Vec<u8>, subjects: impl Iterator<Item = &'a str>) {
    for (i, s) in subjects.enumerate() {
        let _ = write!(out, "SUB {s} {}\r\n", i + 1);
    }
    ping(out);
}

pub fn publish(out: &mut Vec<u8>, subject: &str, payload: &[u8]) {
    let _ = write!(out, "PUB {subject} {}\r\n", payload.len());
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
}

/// A `PING`: the server answers `PONG` once it has handled everything sent before it.
pub fn ping(out: &mut Vec<u8>) {
    out.extend_from_slice(b"PING\r\n");
}

pub fn pong(out: &mut Vec<u8>) {
    out.extend_from_slice(b"PONG\r\n");
}

/// The subject of a device's telemetry.
pub fn subject(device: &str) -> String {
    format!("devices.{device}.telemetry")
}

/// Hands every complete protocol message at the start of `buf` to `f`; returns how many bytes
/// they took (the rest waits for more bytes).
pub fn parse(buf: &[u8], mut f: impl FnMut(Event<'_>)) -> io::Result<usize> {
    let mut at = 0;
    while let Some(eol) = memchr::memmem::find(&buf[at..], b"\r\n") {
        let line = &buf[at..at + eol];
        let body = at + eol + 2;
        if let Some(rest) = line.strip_prefix(b"MSG ") {
            // MSG <subject> <sid> [reply-to] <#bytes>
            let size = rest
                .rsplit(|b| *b == b' ')
                .next()
                .and_then(|n| std::str::from_utf8(n).ok()?.parse::<usize>().ok())
                .ok_or_else(|| bad(line))?;
            if buf.len() < body + size + 2 {
                break;
            }
            f(Event::Message(&buf[body..body + size]));
            at = body + size + 2;
            continue;
        }
        match line {
            b"PING" => f(Event::Ping),
            b"PONG" => f(Event::Ack),
            b"+OK" => {}
            _ if line.starts_with(b"INFO ") => {}
            _ if line.starts_with(b"-ERR") => f(Event::Error(String::from_utf8_lossy(line).into_owned())),
            _ => return Err(bad(line)),
        }
        at = body;
    }
    Ok(at)
}

fn bad(line: &[u8]) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("NATS: unexpected {:?}", String::from_utf8_lossy(line)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(buf: &[u8]) -> (Vec<String>, usize) {
        let mut seen = Vec::new();
        let used = parse(buf, |e| {
            seen.push(match e {
                Event::Message(p) => format!("msg {}", String::from_utf8_lossy(p)),
                Event::Ack => "ack".into(),
                Event::Ping => "ping".into(),
                Event::Error(e) => format!("err {e}"),
            })
        })
        .unwrap();
        (seen, used)
    }

    #[test]
    fn messages_pings_and_pongs_are_read_and_a_split_message_waits() {
        let all = b"INFO {\"x\":1}\r\nPONG\r\nMSG a.b 1 5\r\nhello\r\nPING\r\nMSG a.b 2 reply 3\r\nabc\r\nMSG a 1 4\r\nab";
        let (seen, used) = events(all);
        assert_eq!(seen, ["ack", "msg hello", "ping", "msg abc"]);
        assert_eq!(&all[used..], b"MSG a 1 4\r\nab");
        // A payload containing CR LF is taken by its length, not its lines.
        let (seen, used) = events(b"MSG a 1 4\r\na\r\nb\r\n");
        assert_eq!((seen, used), (vec!["msg a\r\nb".to_string()], 17));
    }

    #[test]
    fn what_a_client_sends_is_the_text_protocol() {
        let mut out = Vec::new();
        subscribe(&mut out, ["x.1", "x.2"].into_iter());
        publish(&mut out, "x.1", b"{}");
        assert_eq!(out, b"SUB x.1 1\r\nSUB x.2 2\r\nPING\r\nPUB x.1 2\r\n{}\r\n");
        assert!(events(b"-ERR 'Unknown Protocol Operation'\r\n").0[0].starts_with("err -ERR"));
    }
}
