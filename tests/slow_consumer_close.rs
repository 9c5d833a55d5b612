//! A slow consumer closed over its hard limit gets its close frame (1008 "slow consumer") after
//! what was already on its way, then the socket is closed (issue 26.3): a standard WebSocket
//! client that stops reading, then reads on, sees the close code and reason, not a bare EOF
//! (which browsers report as 1006). Plain WebSocket and Socket.IO over WebSocket share the path.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

use common::{Server, Want};

const WAIT: Duration = Duration::from_secs(10);

fn subscribed(server: &Server, device: &str) -> String {
    let session = server.new_session();
    let request = json!({"type": "d2cMessages", "deviceId": device});
    server.grant(&session, request.clone());
    let (status, body) = server.subscribe(&session, request);
    assert_eq!(status, 204, "{body}");
    session
}

fn slow_server() -> Server {
    Server::start(&["--socket-queue-hard-bytes", "1048576", "--socket-queue-soft-bytes", "65536"])
}

/// Opens a WebSocket with tungstenite at `path` (read timeout `WAIT`).
fn open(server: &Server, path: &str) -> WebSocket<TcpStream> {
    let addr = server.base.trim_start_matches("http://").to_string();
    let stream = TcpStream::connect(&addr).expect("connect");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let (ws, response) = tungstenite::client(format!("ws://{addr}{path}").as_str(), stream).expect("handshake");
    assert_eq!(response.status().as_u16(), 101);
    ws
}

fn next_text(ws: &mut WebSocket<TcpStream>) -> String {
    loop {
        match ws.read().expect("a frame") {
            Message::Text(t) => return t.to_string(),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Ingests big device messages (never conflated) until the server counts a slow consumer.
fn overflow(server: &Server, device: &str) {
    let pad = "p".repeat(60_000);
    let mut batches = 0;
    while server.metric("hubcast_slow_consumers_closed_total") == Some(0.0) {
        batches += 1;
        assert!(batches <= 200, "not closed after {} MB of d2c messages", batches * 600 / 1000);
        let batch: Vec<Value> = (0..10).map(|i| json!({"deviceId": device, "body": {"i": i, "pad": pad}})).collect();
        server.ingest(Value::Array(batch));
    }
}

/// Reads on after the overflow: every frame until the close frame (its code and reason), then
/// the end of the stream.
fn read_on_until_close(ws: &mut WebSocket<TcpStream>) -> (u16, String, usize) {
    let started = Instant::now();
    let mut frames = 0;
    let (code, reason) = loop {
        assert!(started.elapsed() < WAIT, "no close frame within {WAIT:?} ({frames} frames read)");
        match ws.read() {
            Ok(Message::Close(Some(frame))) => break (u16::from(frame.code), frame.reason.to_string()),
            Ok(Message::Close(None)) => panic!("a close frame without a code after {frames} frames"),
            Ok(_) => frames += 1,
            Err(e) => panic!("the stream ended without a close frame after {frames} frames: {e}"),
        }
    };
    // Then the socket is closed: the client's close answer is sent, and the stream ends.
    assert!(started.elapsed() < 2 * WAIT, "the server kept the socket open after its close frame");
    match ws.read() {
        // The read times out (the socket's read timeout) while the server keeps it open.
        Err(tungstenite::Error::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
            panic!("the server kept the socket open after its close frame")
        }
        // ConnectionClosed, AlreadyClosed, a reset: the stream ended.
        Err(_) => {}
        Ok(other) => panic!("a frame after the close frame: {other:?}"),
    }
    (code, reason, frames)
}

#[test]
fn a_websocket_closed_as_a_slow_consumer_gets_close_1008_after_what_was_on_its_way() {
    let server = slow_server();
    let session = subscribed(&server, "dev-1");
    let mut ws = open(&server, &format!("/ws?sessionId={session}"));
    server.ingest(json!({"deviceId": "dev-1", "body": {"hello": 1}}));
    let first: Value = serde_json::from_str(&next_text(&mut ws)).unwrap();
    assert_eq!(first["message"], json!({"hello": 1}), "{first}");
    // Stop reading until the server closes the socket for its queue, then read on.
    overflow(&server, "dev-1");
    let (code, reason, frames) = read_on_until_close(&mut ws);
    assert_eq!(code, 1008, "close reason {reason:?}");
    assert!(reason.starts_with("slow consumer"), "close reason {reason:?}");
    assert!(frames > 0, "what was already on its way arrives before the close frame");
    // The socket is closed.
    server.wait_for_metric("hubcast_sockets{transport=\"websocket\"}", WAIT, Want::Eq(0.0));
    server.assert_alive();
}

#[test]
fn a_socketio_websocket_closed_as_a_slow_consumer_gets_close_1008() {
    let server = slow_server();
    let session = subscribed(&server, "dev-1");
    let mut ws = open(&server, &format!("/socket.io/?EIO=4&transport=websocket&sessionId={session}"));
    assert!(next_text(&mut ws).starts_with('0'), "Engine.IO open packet");
    ws.send(Message::text("40")).unwrap();
    assert!(next_text(&mut ws).starts_with("40"), "Socket.IO CONNECT answered");
    server.ingest(json!({"deviceId": "dev-1", "body": {"hello": 1}}));
    let first = next_text(&mut ws);
    assert!(first.starts_with("42[\"data\"") && first.contains("hello"), "{first}");
    overflow(&server, "dev-1");
    let (code, reason, _) = read_on_until_close(&mut ws);
    assert_eq!(code, 1008, "close reason {reason:?}");
    assert!(reason.starts_with("slow consumer"), "close reason {reason:?}");
    // The socket is closed.
    server.wait_for_metric("hubcast_sockets{transport=\"socketio_websocket\"}", WAIT, Want::Eq(0.0));
    server.assert_alive();
}
