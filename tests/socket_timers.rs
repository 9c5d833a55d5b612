//! Socket timers (src/transport/timers.rs): pings, ping answers and write stalls run on one
//! per-core deadline heap. A client that stops answering pings is closed with "ping timeout"
//! (plain WebSocket and Socket.IO); one that stops reading is closed once its write has been
//! stalled for the limit; a client that answers is pinged on schedule with at most one timer
//! wake-up between two pings.

mod common;

use std::io::Write;
use std::time::Duration;

use common::rawws::*;
use common::*;
use serde_json::{json, Value};

const SECOND: Duration = Duration::from_secs(1);

fn subscribed(server: &Server, device: &str, kind: &str) -> String {
    let session = server.new_session();
    let sub = json!({"deviceId": device, "type": kind, "telemetryKey": null});
    server.grant(&session, sub.clone());
    let (status, body) = server.subscribe(&session, sub);
    assert_eq!(status, 204, "{body}");
    session
}

/// Reads frames until a close frame within `timeout`; its code and reason. Pings are not
/// answered; every other frame goes to `seen`.
fn close_without_answering(stream: &mut std::net::TcpStream, timeout: Duration, seen: &mut Vec<(u8, Vec<u8>)>) -> Option<(u16, String)> {
    stream.set_read_timeout(Some(timeout)).unwrap();
    while let Some((opcode, payload)) = read_frame(stream) {
        if opcode == 0x8 {
            return Some((u16::from_be_bytes([payload[0], payload[1]]), String::from_utf8_lossy(&payload[2..]).into()));
        }
        seen.push((opcode, payload));
    }
    None
}

#[test]
fn a_plain_websocket_that_stops_answering_pings_is_closed_with_ping_timeout() {
    let server = Server::start(&["--ping-interval", "200", "--ping-timeout", "300"]);
    let session = subscribed(&server, "dev-1", "telemetry");
    let (mut stream, status) = raw_upgrade(&server, &format!("/ws?sessionId={session}"), Some(KEY));
    assert_eq!(status, 101);
    server.ingest(json!({"deviceId": "dev-1", "body": {"t": 1}}));
    let data = text_until(&mut stream, |t| t.contains("\"t\":1"));
    assert!(data.contains("dev-1"), "the socket gets data first: {data}");
    let mut seen = Vec::new();
    let closed = close_without_answering(&mut stream, 10 * SECOND, &mut seen);
    assert_eq!(closed, Some((1001, "ping timeout".to_string())));
    assert!(seen.iter().any(|(op, _)| *op == 0x9), "a ping came before the close: {seen:?}");
}

#[test]
fn a_socketio_websocket_that_stops_answering_pings_is_closed_with_ping_timeout() {
    let server = Server::start(&["--ping-interval", "200", "--ping-timeout", "300"]);
    let session = subscribed(&server, "dev-1", "telemetry");
    let mut stream = socketio_connected(&server, &session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"t": 1}}));
    text_until(&mut stream, |t| t.starts_with("42[\"data\"") && t.contains("\"t\":1"));
    let mut seen = Vec::new();
    let closed = close_without_answering(&mut stream, 10 * SECOND, &mut seen);
    assert_eq!(closed, Some((1001, "ping timeout".to_string())));
    assert!(seen.iter().any(|(op, p)| *op == 0x1 && p == b"2"), "an Engine.IO ping came first: {seen:?}");
}

#[test]
fn a_socketio_client_that_answers_pings_is_pinged_again_after_each_answer() {
    let server = Server::start(&["--ping-interval", "200", "--ping-timeout", "20000"]);
    let session = subscribed(&server, "dev-1", "telemetry");
    let mut stream = socketio_connected(&server, &session);
    // Five pings, each answered: the next comes one interval after the answer, not at the
    // answer's deadline (20 s here, past the reads' 5 s wait).
    for _ in 0..5 {
        text_until(&mut stream, |t| t == "2");
        stream.write_all(&client_frame(0x1, b"3")).unwrap();
    }
    server.ingest(json!({"deviceId": "dev-1", "body": {"t": 1}}));
    text_until(&mut stream, |t| t.starts_with("42[\"data\"") && t.contains("\"t\":1"));
}

#[test]
fn a_websocket_that_stops_reading_is_closed_when_its_write_stalls() {
    // Queue limits far above what is sent: only the stalled write can close this socket.
    let server = Server::start(&[
        "--socket-queue-hard-bytes",
        "1073741824",
        "--socket-queue-soft-bytes",
        "1073741824",
        "--socket-queue-hard-limit",
        "100000",
        "--socket-queue-soft-limit",
        "100000",
    ]);
    let session = subscribed(&server, "dev-big", "d2cMessages");
    let (mut stream, status) = raw_upgrade(&server, &format!("/ws?sessionId={session}"), Some(KEY));
    assert_eq!(status, 101);
    let sockets = "hubcast_sockets{transport=\"websocket\"}";
    server.ingest(json!({"deviceId": "dev-big", "body": {"first": true}}));
    text_until(&mut stream, |t| t.contains("first"));
    assert_eq!(server.metric(sockets), Some(1.0));
    // Never read again: 24 MB of device messages fill the kernel's buffers and stall a write.
    let pad = "p".repeat(60_000);
    let agent = new_agent();
    for _ in 0..40 {
        let batch: Vec<Value> = (0..10).map(|i| json!({"deviceId": "dev-big", "body": {"i": i, "pad": pad}})).collect();
        server.ingest_on(&agent, Value::Array(batch));
    }
    // The write stall limit is 10 s; the socket is closed then (the gauge is the event).
    server.wait_for_metric(sockets, 30 * SECOND, Want::Eq(0.0)); // the stalled socket was closed
    assert_eq!(server.metric("hubcast_slow_consumers_closed_total"), Some(0.0), "closed by the stall, not the queue limits");
    drop(stream);
}
