//! HTTP/1.1 pipelining over raw sockets (RFC 9112 §9.3.2): requests written back to back on
//! one connection are answered strictly in order; `POST /ingest` batches overlap (begun while
//! earlier ones are applied) and a read pipelined after an ingest sees its messages; an error
//! answer in the middle keeps the order; at the per-connection bound the connection stops
//! reading (`hubcast_http_pipeline_pauses_total`).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use serde_json::{json, Value};

use common::{Server, Want, ADMIN_KEY, TIMEOUT};

/// One answer read off a pipelined connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// Reads answers one after another, keeping bytes read past one answer for the next.
struct Answers {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Answers {
    fn new(stream: TcpStream) -> Self {
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        Self { stream, buf: Vec::new() }
    }

    fn fill(&mut self) {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk).expect("the server answers in time");
        assert!(n > 0, "the server closed the connection; read so far: {}", String::from_utf8_lossy(&self.buf));
        self.buf.extend_from_slice(&chunk[..n]);
    }

    fn next(&mut self) -> Answer {
        let head_end = loop {
            if let Some(p) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            self.fill();
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).to_string();
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim().eq_ignore_ascii_case("content-length")))
            .map(|(_, v)| v.trim().parse().unwrap())
            .unwrap_or(0);
        while self.buf.len() < head_end + len {
            self.fill();
        }
        let body = String::from_utf8_lossy(&self.buf[head_end..head_end + len]).to_string();
        self.buf.drain(..head_end + len);
        Answer { status, head, body }
    }
}

fn request(method: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nShared-Access-Key: {ADMIN_KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// `POST /ingest` of `n` messages for devices `pipe-{tag}-0..n`, each with `seq: tag`.
fn ingest(tag: usize, n: usize) -> Vec<u8> {
    let batch: Vec<Value> = (0..n).map(|i| json!({"deviceId": format!("pipe-{tag}-{i}"), "body": {"seq": tag}})).collect();
    request("POST", "/ingest", &Value::Array(batch).to_string())
}

/// The `seq` a `GET /lastValue/:device` answer carries.
fn seq_of(body: &str) -> Option<u64> {
    serde_json::from_str::<Value>(body).ok()?["data"]["seq"]["value"].as_u64()
}

fn accepted(answer: &Answer) -> u64 {
    assert_eq!(answer.status, 200, "{answer:?}");
    serde_json::from_str::<Value>(&answer.body).unwrap()["accepted"].as_u64().unwrap()
}

#[test]
fn pipelined_ingest_batches_are_answered_in_order_with_their_counts() {
    let server = Server::start(&[]);
    let mut bytes = Vec::new();
    // Batch sizes 1..=40, so an answer out of place shows as a wrong count.
    for tag in 1..=40 {
        bytes.extend(ingest(tag, tag));
    }
    let mut stream = server.connect();
    stream.write_all(&bytes).unwrap();
    let mut answers = Answers::new(stream);
    for tag in 1..=40 {
        let answer = answers.next();
        assert_eq!(accepted(&answer), tag as u64, "answer {tag} out of order: {answer:?}");
        assert!(!answer.head.to_ascii_lowercase().contains("connection: close"), "{answer:?}");
    }
    // Every message was applied: the last value of the last device of each batch is there.
    for tag in [1, 17, 40] {
        let (status, v) = server.call_json("GET", &format!("/lastValue/pipe-{tag}-{}", tag - 1), &[common::ADMIN], None);
        assert_eq!(status, 200, "{v}");
        assert_eq!(seq_of(&v.to_string()), Some(tag as u64), "{v}");
    }
}

#[test]
fn a_read_pipelined_after_an_ingest_sees_its_messages() {
    let server = Server::start(&[]);
    let mut stream = server.connect();
    // Each round: several batches (devices on both cores), then a read of each batch's last
    // device, all in one write; the reads must see the values of the batches before them.
    let mut bytes = Vec::new();
    let rounds = 10;
    for round in 0..rounds {
        for k in 0..4 {
            bytes.extend(ingest(round * 4 + k, 8));
        }
        for k in 0..4 {
            bytes.extend(request("GET", &format!("/lastValue/pipe-{}-7", round * 4 + k), ""));
        }
    }
    stream.write_all(&bytes).unwrap();
    let mut answers = Answers::new(stream);
    for round in 0..rounds {
        for _ in 0..4 {
            assert_eq!(accepted(&answers.next()), 8);
        }
        for k in 0..4 {
            let answer = answers.next();
            assert_eq!(answer.status, 200, "round {round}, read {k}: {answer:?}");
            assert_eq!(seq_of(&answer.body), Some((round * 4 + k) as u64), "round {round}, read {k} misses its ingest: {answer:?}");
        }
    }
}

#[test]
fn a_session_read_pipelined_after_an_ingest_sees_its_messages_on_four_cores() {
    // Four cores: the read goes through the session's core before the device's, so it can
    // only see the batch if it starts after the batch is applied.
    let server = Server::start(&["--cores", "4"]);
    let session = server.new_session();
    let rounds = 16;
    for tag in 0..rounds {
        server.grant(&session, common::telemetry(&format!("pipe-{tag}-0"), None));
    }
    let mut bytes = Vec::new();
    for tag in 0..rounds {
        bytes.extend(ingest(tag, 1));
        bytes.extend(
            format!("GET /lastValue/pipe-{tag}-0 HTTP/1.1\r\nHost: 127.0.0.1\r\nsessionId: {session}\r\n\r\n").into_bytes(),
        );
    }
    let mut stream = server.connect();
    stream.write_all(&bytes).unwrap();
    let mut answers = Answers::new(stream);
    for tag in 0..rounds {
        assert_eq!(accepted(&answers.next()), 1);
        let answer = answers.next();
        assert_eq!(answer.status, 200, "read {tag}: {answer:?}");
        assert_eq!(seq_of(&answer.body), Some(tag as u64), "read {tag} misses its ingest: {answer:?}");
    }
}

#[test]
fn an_error_answer_in_the_middle_keeps_the_order() {
    let server = Server::start(&[]);
    let mut bytes = Vec::new();
    bytes.extend(ingest(101, 1));
    bytes.extend(request("POST", "/ingest", "[{\"deviceId\": \"x\"}]")); // no body: 400
    bytes.extend(ingest(102, 2));
    bytes.extend(request("POST", "/ingest", "not json")); // 400
    bytes.extend(request("GET", "/nowhere", "")); // 404
    bytes.extend(ingest(103, 3));
    let mut stream = server.connect();
    stream.write_all(&bytes).unwrap();
    let mut answers = Answers::new(stream);
    assert_eq!(accepted(&answers.next()), 1);
    let bad = answers.next();
    assert_eq!(bad.status, 400, "{bad:?}");
    assert!(bad.body.contains("body"), "the error names the problem: {bad:?}");
    assert_eq!(accepted(&answers.next()), 2);
    let bad = answers.next();
    assert_eq!(bad.status, 400, "{bad:?}");
    assert!(bad.body.contains("errorMessage"), "{bad:?}");
    assert_eq!(answers.next().status, 404);
    assert_eq!(accepted(&answers.next()), 3);
    // The connection is still usable.
    answers.stream.write_all(&ingest(104, 4)).unwrap();
    assert_eq!(accepted(&answers.next()), 4);
}

#[test]
fn a_connection_stops_reading_at_its_pipelining_bound() {
    // One core: each batch is applied as it is read, so only the bound stops the reader
    // before the first answer is written.
    let server = Server::start(&["--cores", "1"]);
    assert_eq!(server.metric("hubcast_http_pipeline_pauses_total"), Some(0.0));
    let mut bytes = Vec::new();
    for tag in 1..=64 {
        bytes.extend(ingest(200 + tag, 1));
    }
    let mut stream = server.connect();
    stream.write_all(&bytes).unwrap();
    let mut answers = Answers::new(stream);
    for _ in 1..=64 {
        assert_eq!(accepted(&answers.next()), 1);
    }
    // The connection paused reading at its bound.
    server.wait_for_metric("hubcast_http_pipeline_pauses_total", TIMEOUT, Want::AtLeast(1.0));
}

#[test]
fn a_close_request_in_a_pipeline_ends_it_after_its_answer() {
    let server = Server::start(&[]);
    let mut bytes = Vec::new();
    bytes.extend(ingest(301, 1));
    let mut close = ingest(302, 2);
    let at = close.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    close.splice(at..at, b"\r\nConnection: close".iter().copied());
    bytes.extend(close);
    bytes.extend(ingest(303, 3)); // after the close: never read
    let mut stream = server.connect();
    stream.write_all(&bytes).unwrap();
    let mut answers = Answers::new(stream);
    assert_eq!(accepted(&answers.next()), 1);
    let last = answers.next();
    assert_eq!(accepted(&last), 2);
    assert!(last.head.to_ascii_lowercase().contains("connection: close"), "{last:?}");
    let mut rest = Vec::new();
    let _ = answers.stream.read_to_end(&mut rest);
    assert!(rest.is_empty(), "nothing is answered after the close: {}", String::from_utf8_lossy(&rest));
    assert_eq!(server.call_json("GET", "/lastValue/pipe-302-1", &[common::ADMIN], None).0, 200);
    let (status, v) = server.call_json("GET", "/lastValue/pipe-303-0", &[common::ADMIN], None);
    assert_ne!(status, 200, "the request after the close was applied: {v}");
}
