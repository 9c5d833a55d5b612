//! The seed corpora of `fuzz/corpus/`, written from the encoders and the tests' examples
//! (`cargo test --lib fuzzing::tests::write_seeds -- --ignored`). Each file is named by what
//! it holds; files the fuzzers add (crashes kept as regressions) are left alone.

use std::path::Path;

use super::{amqp_frame, FRAME_MARK};

fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
}

pub fn write(root: &Path) {
    json(&root.join("json"));
    http(&root.join("http"));
    engine_io(&root.join("engine_io"));
    amqp(&root.join("amqp"));
    store(&root.join("store"));
}

fn json(dir: &Path) {
    let bodies: [(&str, &str); 12] = [
        ("telemetry", r#"{"temperature":21.5,"humidity":40,"deviceId":"sensor-1"}"#),
        ("nested", r#"{"a":{"b":[1,2,{"c":null}]},"t":true,"f":false}"#),
        ("escapes", r#"{"k\u00e9y":"line\nbreak \"quoted\" \ud83d\ude00","k":"dev"}"#),
        ("numbers", r#"{"big":18446744073709551616,"exp":1e309,"neg":-0.5e-3,"int":-0}"#),
        ("batch", r#"[{"id":1,"v":2},{"id":2,"v":[3]},"text",4]"#),
        ("timestamp", r#"{"timestamp":"2024-05-01T12:00:00.000Z","ts":1714564800000,"on":true}"#),
        ("not-object", r#"[1,2,3]"#),
        ("string", r#""just a string""#),
        ("lone-surrogate-key", r#"{"\ud800":1}"#),
        ("trailing", r#"{"a":1} x"#),
        ("bad-number", r#"{"a":01}"#),
        ("whitespace", " \n\t{ \"a\" : [ ] , \"b\" : { } }\r\n"),
    ];
    for (name, body) in bodies {
        put(dir, name, body.as_bytes());
    }
    put(dir, "deep", format!("{{\"d\":{}1{}}}", "[".repeat(200), "]".repeat(200)).as_bytes());
}

fn http(dir: &Path) {
    // Two bytes of parameters (the split seed, the body limit), then the request.
    let requests: [(&str, &str); 10] = [
        ("get", "GET /devices/d%201?x=1 HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nx-a: 2\r\n\r\n"),
        ("post-length", "POST /session HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"sessionId\"}"),
        ("chunked", "POST /ingest HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
        ("chunked-ext-trailer", "POST /ingest HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nExpires: never\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n"),
        ("chunked-upper-hex", "PUT /grants HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nA\r\n0123456789\r\n00\r\n\r\n"),
        ("empty-lines", "\r\n\nGET /status HTTP/1.0\r\n\r\n"),
        ("upgrade", "GET /socket.io/?EIO=4&transport=websocket HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"),
        ("te-and-cl", "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        ("gzip-chunked", "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"),
        ("chunk-body-only", "4\r\nabcd\r\n0\r\n\r\n"),
    ];
    for (i, (name, request)) in requests.into_iter().enumerate() {
        put(dir, name, &[&[i as u8 * 7, i as u8][..], request.as_bytes()].concat());
    }
}

/// A client's masked WebSocket frame.
fn ws(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
    let mask = [0x12, 0x34, 0x56, 0x78];
    let mut f = vec![opcode | if fin { 0x80 } else { 0 }];
    match payload.len() {
        n @ 0..=125 => f.push(0x80 | n as u8),
        n => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
    f
}

fn engine_io(dir: &Path) {
    // One byte of split seed, then the bytes.
    let handshake = [ws(1, true, b"2probe"), ws(1, true, b"5"), ws(1, true, b"40{\"sessionId\":\"abc\"}")].concat();
    let seeds: [(&str, Vec<u8>); 8] = [
        ("connect", ws(1, true, b"40")),
        ("upgrade", handshake),
        ("pong-event", [ws(1, true, b"3"), ws(1, true, b"42[\"message\",{\"a\":1}]"), ws(9, true, b"ping")].concat()),
        ("fragmented", [ws(1, false, b"40{\"sess"), ws(9, true, b""), ws(0, true, b"ionId\":\"x\"}")].concat()),
        ("close", [ws(1, true, b"41"), ws(8, true, &[0x03, 0xe8, b'b', b'y', b'e'])].concat()),
        ("binary-long", ws(2, true, &[7u8; 300])),
        ("polling-body", b"40\x1e3\x1e41\x1e6".to_vec()),
        ("unmasked", vec![0x81, 0x02, b'4', b'0']),
    ];
    for (i, (name, bytes)) in seeds.into_iter().enumerate() {
        put(dir, name, &[&[i as u8 * 5][..], &bytes].concat());
    }
}

fn amqp(dir: &Path) {
    use fe2o3_amqp::types::definitions::Handle;
    use fe2o3_amqp::types::performatives::{Detach, Flow, Transfer};
    use fe2o3_amqp::types::primitives::Binary;
    let transfer = |id: Option<u32>, settled: bool, more: bool| Transfer {
        handle: Handle(5),
        delivery_id: id,
        delivery_tag: id.map(|i| Binary::from(i.to_be_bytes().to_vec())),
        message_format: id.map(|_| 0),
        settled: Some(settled),
        more,
        rcv_settle_mode: None,
        state: None,
        resume: false,
        aborted: false,
        batchable: false,
    };
    // An AMQP message of one data section.
    let message = |n: u8, len: usize| {
        let mut m = vec![0x00, 0x53, 0x75, 0xb0];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(n, len));
        m
    };
    let big = message(1, 70);
    let mut echo = Flow {
        next_incoming_id: Some(1),
        incoming_window: 5000,
        next_outgoing_id: 1,
        outgoing_window: 5000,
        handle: Some(Handle(5)),
        delivery_count: Some(10),
        link_credit: Some(0),
        available: Some(7),
        drain: false,
        echo: true,
        properties: None,
    };
    let session_flow = {
        echo.echo = false;
        echo.handle = None;
        amqp_frame(3, &echo, &[])
    };
    echo.echo = true;
    echo.handle = Some(Handle(5));
    let seeds: [(&str, Vec<u8>); 7] = [
        ("transfers", [amqp_frame(3, &transfer(Some(0), false, false), &message(0, 10)), amqp_frame(3, &transfer(Some(1), true, false), &message(2, 5))].concat()),
        (
            "multi-frame",
            [amqp_frame(3, &transfer(Some(0), false, true), &big[..30]), vec![0, 0, 0, 8, 2, 0, 0, 3], amqp_frame(3, &transfer(None, false, false), &big[30..])].concat(),
        ),
        ("flow-echo", [amqp_frame(3, &echo, &[]), session_flow].concat()),
        ("detach", [amqp_frame(3, &transfer(Some(0), true, false), &message(1, 3)), amqp_frame(3, &Detach { handle: Handle(5), closed: true, error: None }, &[])].concat()),
        ("past-credit", (0..5).flat_map(|i| amqp_frame(3, &transfer(Some(i), true, false), &message(i as u8, 3))).collect()),
        ("other-channel", amqp_frame(0, &transfer(Some(0), true, false), &message(9, 3))),
        ("broken-transfer", vec![0, 0, 0, 12, 2, 0, 0, 3, 0x00, 0x53, 0x14, 0x45]),
    ];
    for (i, (name, bytes)) in seeds.into_iter().enumerate() {
        // The split seed and the message bound (×16 bytes), then the peer's frames.
        put(dir, name, &[&[i as u8 * 9 + 1, 4][..], &bytes].concat());
    }
}

fn store(dir: &Path) {
    use crate::ids::SessionId;
    use crate::shard::access::Access;
    use crate::shard::devices::{ConnectionState, Device, Twin};
    use crate::store::format::{encode, Change, TAG_END};
    let device = |values: &[(&str, &str, i64)], twin: Option<&str>, connected: Option<bool>| {
        let mut d = Device::default();
        d.telemetry = values.iter().copied().collect();
        d.twin = twin.map(|t| Twin { doc: serde_json::from_str(t).unwrap(), at: 5 });
        d.connection = connected.map(|c| ConnectionState { connected: c, at: 6, sequence: Some("01".into()) });
        d
    };
    let a = device(&[("temp", "21.5", 1), ("hum", "40", 1)], Some(r#"{"desired":{"x":1}}"#), Some(true));
    let b = device(&[("k", "\"v\"", 2)], None, Some(false));
    let c = device(&[], None, None);
    let mut grants = crate::shard::Grants { device_twin: true, ..Default::default() };
    grants.telemetry.keys.push("temp".into());
    let grant = Access::new(grants, crate::shard::Subscriptions { connection_state: true, ..Default::default() });
    let set: crate::shard::sessions::DeviceSet = ["a", "b"].into_iter().collect();
    let records = |changes: &[Change<'_>]| {
        let mut out = Vec::new();
        for ch in changes {
            let ch = match ch {
                Change::Device { id, device } => Change::Device { id, device: *device },
                Change::Access { device, session, access } => Change::Access { device, session: *session, access: *access },
                Change::Session { id, devices } => Change::Session { id: *id, devices: *devices },
                Change::Applied { key, seq } => Change::Applied { key, seq: *seq },
                Change::Stream { id, recovery } => Change::Stream { id: *id, recovery: *recovery },
                Change::StreamAppend(batch) => Change::StreamAppend(batch),
                Change::StreamPids { id, pids } => Change::StreamPids { id: *id, pids },
                Change::Posted { to, n } => Change::Posted { to: *to, n: *n },
                Change::Received { n } => Change::Received { n: *n },
            };
            encode(&mut out, ch);
        }
        out
    };
    let frames = |payloads: &[Vec<u8>]| {
        let mut out = vec![0u8];
        for (i, p) in payloads.iter().enumerate() {
            if i > 0 {
                out.extend_from_slice(FRAME_MARK);
            }
            out.extend_from_slice(p);
        }
        out
    };
    let devices = records(&[Change::Device { id: "a", device: Some(&a) }, Change::Device { id: "b", device: Some(&b) }, Change::Device { id: "c", device: Some(&c) }]);
    let access = records(&[
        Change::Access { device: "a", session: SessionId(1), access: Some(&grant) },
        Change::Session { id: SessionId(1), devices: Some(&set) },
        Change::Applied { key: "0", seq: 42 },
    ]);
    let gone = records(&[
        Change::Device { id: "b", device: None },
        Change::Access { device: "a", session: SessionId(1), access: None },
        Change::Session { id: SessionId(1), devices: None },
    ]);
    let changed = records(&[Change::Device { id: "a", device: Some(&b) }]);
    put(dir, "devices", &frames(std::slice::from_ref(&devices)));
    put(dir, "access-session-applied", &frames(std::slice::from_ref(&access)));
    put(dir, "log", &frames(&[devices.clone(), access.clone(), changed, gone]));
    put(dir, "end-mark", &frames(&[devices.clone(), vec![TAG_END]]));
    // Devices with read marks (tag 14, design step 9): one marked, then written again without
    // a mark, another marked, and one gone after its marked record.
    {
        let mut marked = device(&[("temp", "1", 3)], None, Some(true));
        marked.mark.take(crate::ingest::MsgKey::partition(2, 1_700_000_000_000, 7));
        let mut other = device(&[], Some(r#"{"r":2}"#), None);
        other.mark.take(crate::ingest::MsgKey::partition(0, -1, 0));
        let first = records(&[Change::Device { id: "m", device: Some(&marked) }, Change::Device { id: "o", device: Some(&other) }]);
        let later = records(&[Change::Device { id: "m", device: Some(&b) }, Change::Device { id: "o", device: None }, Change::Device { id: "n", device: Some(&marked) }]);
        put(dir, "device-read-marks", &frames(&[first, later]));
    }
    // A recovery stream's base, its write-ahead (appends, pids) and the crash rule's counts.
    {
        use crate::push::stream::{AppendBatch, StoredPid, StoredRecovery};
        let pids = [StoredPid { pid: "p".into(), sid: "s".into(), away_ms: i64::MIN, epoch: 9, start_seq: 0 }];
        let base = StoredRecovery { epoch: 9, next_seq: 1, first_seq: 1, pids: pids.to_vec(), ..Default::default() };
        let mut batch = AppendBatch::default();
        let frame: std::sync::Arc<str> = "{\"n\":1}".into();
        for seq in 1..4 {
            batch.add(SessionId(1), 9, seq, &frame);
        }
        let stream = records(&[Change::Stream { id: SessionId(1), recovery: Some(&base) }, Change::StreamAppend(&batch), Change::Posted { to: 0, n: 3 }, Change::Received { n: 3 }]);
        let later = records(&[Change::StreamPids { id: SessionId(1), pids: &pids }, Change::StreamAppend(&batch)]);
        put(dir, "stream-write-ahead", &frames(&[stream, later]));
    }
    // A file as written (odd first byte: the bytes after the header as they are).
    let mut raw = vec![1u8];
    let at = raw.len();
    raw.extend_from_slice(&[0; 8]);
    raw.extend_from_slice(&devices);
    let payload = raw[at + 8..].to_vec();
    raw[at..at + 4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    raw[at + 4..at + 8].copy_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    put(dir, "raw-file", &raw);
    let mut torn = raw.clone();
    torn.truncate(torn.len() - 3);
    put(dir, "raw-torn", &torn);
}
