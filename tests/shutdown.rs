//! Graceful shutdown (SIGTERM/SIGINT) and one hubcast per port, on the real binary with real
//! clients: a plain WebSocket, the real socket.io-client over WebSocket and over long-polling,
//! a raw Engine.IO long poll, and a REST request held in flight by the IoT Hub test double.

mod common;
mod hub_double;

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use hub_double::{Answer, Gate, HubDouble};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

fn live_session(server: &Server, device: &str) -> String {
    let session = server.new_session();
    server.grant(&session, telemetry(device, None));
    let (status, body) = server.subscribe(&session, telemetry(device, None));
    assert_eq!(status, 204, "{body}");
    session
}

/// A server whose `GET /deviceTwin/dev-h` stays in flight until the returned gate opens.
fn server_with_held_request(extra: &[&str]) -> (Server, HubDouble, Arc<Gate>, std::thread::JoinHandle<(u16, String)>) {
    let hub = HubDouble::start();
    let twin = hub.add_device("dev-h", true);
    let gate = Arc::new(Gate::default());
    hub.script(Answer::AfterGate(gate.clone(), Box::new(Answer::ok(twin))));
    let mut args: Vec<String> = hub.args();
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args);
    let url = server.url("/deviceTwin/dev-h");
    let in_flight = std::thread::spawn(move || {
        let (status, body, _) = try_send(&new_agent_with_timeout(Duration::from_secs(60)), &url, "GET", &[ADMIN], None)
            .unwrap_or_else(|e| (0, e, Headers::default()));
        (status, body)
    });
    assert!(hub.wait_for_requests(1, WAIT), "the twin read reached the hub double");
    (server, hub, gate, in_flight)
}

fn new_agent_with_timeout(timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(timeout).build()
}

/// Sends one request on a raw keep-alive connection and reads the answer.
fn exchange(stream: &mut TcpStream, request: &[u8]) -> RawResponse {
    match raw_exchange(stream, request) {
        RawOutcome::Response(r) => r,
        other => panic!("no answer: {other:?}"),
    }
}

fn polling(path: &str) -> String {
    format!("/socket.io/?EIO=4&transport=polling{path}")
}

#[test]
fn sigterm_says_goodbye_to_every_client_answers_what_is_in_flight_and_exits_0() {
    let (mut server, _hub, gate, in_flight) = server_with_held_request(&["--shutdown-timeout", "60"]);
    let device = "dev-1";
    let (ws_session, sio_ws_session, sio_poll_session, raw_session) =
        (live_session(&server, device), live_session(&server, device), live_session(&server, device), live_session(&server, device));

    let mut ws = server.live(&ws_session);
    let sio_ws = server.socketio_reconnecting(&[&sio_ws_session], "websocket");
    let sio_poll = server.socketio_reconnecting(&[&sio_poll_session], "polling");
    sio_ws.wait_for("connect", WAIT).expect("socket.io over WebSocket connects");
    sio_poll.wait_for("connect", WAIT).expect("socket.io over polling connects");

    // A raw Engine.IO polling session on a kept-alive connection: open, CONNECT, its ack.
    let mut raw = server.connect();
    let open = exchange(&mut raw, &raw_get(&polling(&format!("&sessionId={raw_session}"))));
    let sid = parse_json(&open.body[1..])["sid"].as_str().expect("sid").to_string();
    let post = format!(
        "POST {} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n40",
        polling(&format!("&sid={sid}"))
    );
    assert_eq!(exchange(&mut raw, post.as_bytes()).body, "ok");
    let poll_request = raw_get(&polling(&format!("&sid={sid}")));
    assert!(exchange(&mut raw, &poll_request).body.starts_with("40"), "CONNECT acknowledged");

    // Every client is live: one message reaches each of them.
    server.ingest(json!({"deviceId": device, "body": {"t": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("data on the WebSocket")["telemetry"], json!({"t": 1}));
    assert_eq!(sio_ws.wait_for("data", WAIT).expect("data over socket.io WebSocket")["data"]["telemetry"], json!({"t": 1}));
    assert_eq!(sio_poll.wait_for("data", WAIT).expect("data over socket.io polling")["data"]["telemetry"], json!({"t": 1}));
    assert!(exchange(&mut raw, &poll_request).body.contains(r#"42["data""#), "data on the raw long poll");

    // A kept-alive connection for /status, and a long poll left pending.
    let mut status_conn = server.connect();
    assert_eq!(exchange(&mut status_conn, &raw_get("/status")).status, 200);
    let (mut handshake_conn, mut upgrade_conn) = (server.connect(), server.connect());
    for conn in [&mut handshake_conn, &mut upgrade_conn] {
        assert_eq!(exchange(conn, &raw_get("/version")).status, 200);
    }
    raw.write_all(&poll_request).unwrap();

    server.signal(libc::SIGTERM);
    server.wait_for_stderr(WAIT, |l| l.contains("shutdown started") && l.contains("SIGTERM")).expect("shutdown logged");

    // Plain WebSocket: close 1001 (Going Away).
    while ws.next_json(WAIT).is_some() {}
    assert_eq!(ws.closed.as_ref().map(|c| c.0), Some(1001), "close frame: {:?}", ws.closed);
    // socket.io-client: its transport closed (not a Socket.IO DISCONNECT, which would read
    // "io server disconnect"), so it reconnects by itself. A polling client opens a new
    // connection for every poll: one caught between two polls finds the listener closed and
    // reads "transport error" instead; it reconnects all the same. (The raw long poll below
    // shows the answer a pending poll gets.)
    for (client, transport, reasons) in
        [(&sio_ws, "websocket", &["transport close"][..]), (&sio_poll, "polling", &["transport close", "transport error"][..])]
    {
        let gone = client.wait_for("disconnect", WAIT).expect("disconnect");
        assert!(reasons.iter().any(|r| gone["reason"] == *r), "socket.io-client over {transport}: {gone}");
        client.wait_for("reconnect_attempt", WAIT).expect("socket.io-client tries to reconnect on its own");
    }
    // The pending long poll is answered with the Engine.IO close packet.
    let answer = match read_response(&mut raw) {
        RawOutcome::Response(r) => r,
        other => panic!("the long poll got no answer: {other:?}"),
    };
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body.split('\u{1e}').next_back(), Some("1"), "long poll answer {:?}", answer.body);

    // While the twin read is in flight: /status says so on a kept-alive connection, and the
    // listeners are closed.
    let status = exchange(&mut status_conn, &raw_get("/status"));
    assert_eq!(status.status, 503);
    assert!(error_message(&status.body).contains("shutting down"), "{}", status.body);
    assert!(status.head.to_ascii_lowercase().contains("connection: close"), "{}", status.head);
    // New live connections are sent elsewhere.
    let handshake = exchange(&mut handshake_conn, &raw_get(&polling(&format!("&sessionId={raw_session}"))));
    assert_eq!(handshake.status, 503, "Engine.IO handshake while shutting down: {}", handshake.body);
    let upgrade = format!(
        "GET /ws?sessionId={ws_session} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    assert_eq!(exchange(&mut upgrade_conn, upgrade.as_bytes()).status, 503, "WebSocket upgrade while shutting down");
    for core in 0..2 {
        server
            .wait_for_stderr(WAIT, |l| l.contains("stopped accepting connections") && l.contains(&format!("core={core}")))
            .expect("each core closed its listener");
    }
    assert!(TcpStream::connect(("127.0.0.1", server.port)).is_err(), "new connections are refused");
    assert!(server.is_running(), "the in-flight request holds the shutdown");

    gate.open();
    let (status, body) = in_flight.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(parse_json(&body)["data"]["deviceId"], "dev-h");
    let exit = server.wait_exit(WAIT).expect("exits once the in-flight request is answered");
    assert_eq!(exit.code(), Some(0));
    let log = server.stderr_lines().join("\n");
    for step in ["goodbye sent to every socket", "in-flight requests answered", "state flushed", "shutdown complete"] {
        assert!(log.contains(step), "`{step}` logged:\n{log}");
    }
}

#[test]
fn sigint_shuts_down_gracefully_too() {
    let mut server = Server::start(&[]);
    server.assert_alive();
    server.signal(libc::SIGINT);
    let exit = server.wait_exit(WAIT).expect("exits");
    assert_eq!(exit.code(), Some(0));
    let log = server.stderr_lines().join("\n");
    assert!(log.contains("shutdown started") && log.contains("SIGINT") && log.contains("shutdown complete"), "{log}");
}

#[test]
fn a_second_signal_exits_at_once() {
    let (mut server, _hub, _gate, _in_flight) = server_with_held_request(&["--shutdown-timeout", "600"]);
    server.signal(libc::SIGTERM);
    server.wait_for_stderr(WAIT, |l| l.contains("shutdown started")).expect("shutdown logged");
    assert!(server.is_running(), "the in-flight request holds the shutdown");
    server.signal(libc::SIGINT);
    let exit = server.wait_exit(WAIT).expect("the second signal ends the process at once");
    assert_eq!(exit.code(), Some(128 + libc::SIGINT));
    assert!(server.stderr_lines().iter().any(|l| l.contains("second signal")));
}

#[test]
fn a_shutdown_past_its_timeout_exits_anyway_with_status_1() {
    let (mut server, _hub, _gate, _in_flight) = server_with_held_request(&["--shutdown-timeout", "1"]);
    server.signal(libc::SIGTERM);
    let exit = server.wait_exit(WAIT).expect("exits once --shutdown-timeout has passed");
    assert_eq!(exit.code(), Some(1));
    let log = server.stderr_lines().join("\n");
    assert!(log.contains("did not finish within --shutdown-timeout (1 s)"), "{log}");
}

#[test]
fn a_second_hubcast_on_the_same_port_refuses_to_start_and_the_first_keeps_every_request() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("dev-1", None));

    let port = server.port.to_string();
    let (started, stdout, stderr) = run_expecting_exit(&full_args(&["--port", &port], true), &[]);
    assert!(!started, "the second instance must fail");
    assert!(!stdout.contains("listening on"), "the second instance never listened: {stdout}");
    assert!(stderr.contains(&format!("port {port} on 127.0.0.1 is already in use")), "{stderr}");

    // Every request, each on a fresh connection, reaches the one process that knows the session.
    for _ in 0..40 {
        let (status, body) = server.subscribe_on(&new_agent(), &session, telemetry("dev-1", None));
        assert_eq!(status, 204, "{body}");
    }
    server.assert_alive();
}

/// Receive buffer of the client that stops reading (small, so little data fills it).
const SMALL_RCVBUF: usize = 64 * 1024;

/// The most the server's send buffer can hold here.
fn send_buffer_max() -> usize {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem").unwrap_or_default();
    text.split_whitespace().nth(2).and_then(|v| v.parse().ok()).unwrap_or(4 << 20)
}

/// A WebSocket to `/ws?sessionId=…` whose socket has a small receive buffer.
fn small_buffer_ws(server: &Server, session: &str) -> common::ws::Live {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(SMALL_RCVBUF).unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", server.port).parse().unwrap();
    socket.connect(&addr.into()).unwrap();
    let stream: TcpStream = socket.into();
    let url = format!("ws://127.0.0.1:{}/ws?sessionId={session}", server.port);
    let (ws, _) = tungstenite::client(url.as_str(), stream).expect("websocket handshake");
    common::ws::Live { ws, closed: None }
}

#[test]
fn a_client_that_stops_reading_does_not_hold_the_shutdown() {
    let mut server = Server::start(&["--shutdown-timeout", "4"]);
    let session = live_session(&server, "flood");
    let mut ws = small_buffer_ws(&server, &session);
    server.ingest(json!({"deviceId": "flood", "body": {"n": 0}}));
    assert!(ws.next_json(WAIT).is_some(), "the socket is live");
    // The client reads nothing more: twice what the kernel buffers hold leaves the server's
    // writer stuck in a write (later telemetry is conflated, so the queue stays bounded).
    let blob = "x".repeat(20_000);
    let batch: Vec<_> = (0..40).map(|n| json!({"deviceId": "flood", "body": {"n": n, "blob": blob}})).collect();
    let batch = json!(batch);
    let mut sent = 0;
    while sent < 2 * (send_buffer_max() + 4 * SMALL_RCVBUF) {
        server.ingest(batch.clone());
        sent += 40 * blob.len();
    }

    server.signal(libc::SIGTERM);
    let exit = server.wait_exit(WAIT).expect("exits");
    assert_eq!(exit.code(), Some(0), "{}", server.stderr_lines().join("\n"));
    assert!(
        server.stderr_lines().iter().any(|l| l.contains("closed without waiting")),
        "the stuck socket was cut after half the shutdown timeout"
    );
    drop(ws);
}
