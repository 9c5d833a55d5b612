//! Live sockets against hostile or careless clients (issue 9): Socket.IO before CONNECT,
//! byte-bounded socket queues, capped polling handshakes, the WebSocket handshake key and close
//! codes, conflation order, DISCONNECT on session delete, and a busy socket on an epoll core.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::rawws::*;
use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(5);

fn subscribed(server: &Server, device: &str, kinds: &[&str]) -> String {
    let session = server.new_session();
    for kind in kinds {
        let request = json!({"type": kind, "deviceId": device});
        server.grant(&session, request.clone());
        let (status, body) = server.subscribe(&session, request);
        assert_eq!(status, 204, "{body}");
    }
    session
}

// ---- A2: a Socket.IO WebSocket accepts only the handshake before CONNECT -------------------------

#[test]
fn a_socketio_websocket_without_a_session_is_closed_by_a_big_ping_and_echoes_nothing() {
    let server = Server::start(&[]);
    let (mut stream, status) = raw_upgrade(&server, "/socket.io/?EIO=4&transport=websocket", Some(KEY));
    assert_eq!(status, 101);
    let open = text_until(&mut stream, |t| t.starts_with('0'));
    assert!(open.contains("\"sid\""), "{open}");
    let ping = big_client_ping(65_000);
    for _ in 0..50 {
        if stream.write_all(&ping).is_err() {
            break;
        }
    }
    // Nothing is echoed: the next frame is the close.
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let (opcode, payload) = read_frame(&mut stream).expect("a close frame");
    assert_eq!(opcode, 0x8, "expected a close, got {:?}", String::from_utf8_lossy(&payload[..payload.len().min(40)]));
    assert_eq!(u16::from_be_bytes([payload[0], payload[1]]), 1008);
    server.assert_alive();
}

#[test]
fn a_connected_socketio_client_that_floods_pings_and_never_reads_is_closed_with_memory_bounded() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "dev-1", &["telemetry"]);
    let mut stream = socketio_connected(&server, &session);
    // Sentinel: this socket really is connected and gets data.
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 1}}));
    text_until(&mut stream, |t| t.starts_with("42"));
    let rss_before = server.rss_kib();
    let ping = big_client_ping(65_000);
    let sent = flood(&mut stream, &ping, 200 << 20);
    assert!(sent < 200 << 20, "the server kept reading a flood of client pings ({sent} bytes)");
    server.wait_for_metric("hubcast_sockets{transport=\"socketio_websocket\"}", WAIT, Want::Eq(0.0)); // the flooding socket is closed
    let grown = server.rss_kib().saturating_sub(rss_before);
    assert!(grown < 32 * 1024, "memory grew by {grown} KiB while {sent} bytes were flooded");
    server.assert_alive();
}

// ---- per-socket queues are bounded in bytes --------------------------------------------------

#[test]
fn a_socket_that_stops_reading_is_closed_by_the_byte_limit_before_the_message_limit() {
    let server = Server::start(&["--socket-queue-hard-bytes", "1048576", "--socket-queue-soft-bytes", "65536"]);
    let session = subscribed(&server, "dev-1", &["d2cMessages"]);
    let mut stalled = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"hello": 1}}));
    assert!(stalled.next_json(WAIT).is_some(), "the socket gets data before it stalls");
    // From here on the client never reads again.
    let pad = "p".repeat(60_000);
    let mut batches = 0;
    while server.metric("hubcast_slow_consumers_closed_total") == Some(0.0) {
        batches += 1;
        assert!(batches <= 200, "not closed after {} MB of d2c messages", batches * 600 / 1000);
        let batch: Vec<Value> = (0..10).map(|i| json!({"deviceId": "dev-1", "body": {"i": i, "pad": pad}})).collect();
        server.ingest(Value::Array(batch));
    }
    // Well below the 8192-message limit: the bytes decided (10 messages of 60 KB per batch).
    assert!(batches * 10 < 8192, "{batches} batches");
    server.wait_for_metric("hubcast_sockets{transport=\"websocket\"}", WAIT, Want::Eq(0.0)); // the slow socket is gone
    server.assert_alive();
}

// ---- review 5.7: a conflated frame keeps its place ------------------------------------------------

#[test]
fn conflated_telemetry_still_arrives_before_the_later_connection_state() {
    let server = Server::start(&["--socket-queue-soft-limit", "1"]);
    let session = subscribed(&server, "dev-1", &["telemetry", "connectionState"]);
    let mut live = server.live(&session);
    // One batch reaches the socket's queue in one go: from the second frame on it is behind.
    server.ingest(json!([
        {"deviceId": "dev-1", "body": {"n": 1}},
        {"deviceId": "dev-1", "body": {"n": 2}},
        {"deviceId": "dev-1", "body": {"n": 3}},
        {"deviceId": "dev-1", "source": "deviceConnectionStateEvents",
         "properties": {"opType": "deviceDisconnected"}, "body": {"sequenceNumber": "000000000000000001D5"}},
    ]));
    let mut frames = Vec::new();
    while !frames.iter().any(|f: &Value| f["connectionState"] == json!(false)) {
        frames.push(live.next_json(WAIT).unwrap_or_else(|| panic!("the offline state arrives; got {frames:?}")));
    }
    frames.extend(live.collect(Duration::from_millis(300)));
    let at = |pred: &dyn Fn(&Value) -> bool| frames.iter().position(pred);
    let newest = at(&|f| f["telemetry"]["n"] == json!(3)).unwrap_or_else(|| panic!("n=3 in {frames:?}"));
    let offline = at(&|f| f["connectionState"] == json!(false)).unwrap();
    assert!(newest < offline, "telemetry sent before the device went offline arrives first: {frames:?}");
    assert!(at(&|f| f["telemetry"]["n"] == json!(2)).is_none(), "n=2 was conflated: {frames:?}");
}

// ---- conflation keeps every key's newest value ----------------------------------------------------

#[test]
fn conflation_keeps_the_newest_value_of_every_key_when_a_device_alternates_key_sets() {
    let server = Server::start(&["--socket-queue-soft-limit", "1"]);
    let session = subscribed(&server, "dev-1", &["telemetry", "connectionState"]);
    let mut live = server.live(&session);
    // One batch reaches the socket's queue in one go: from the second frame on it is behind.
    server.ingest(json!([
        {"deviceId": "dev-1", "body": {"a": 1}},
        {"deviceId": "dev-1", "body": {"b": 1}},
        {"deviceId": "dev-1", "body": {"a": 2}},
        {"deviceId": "dev-1", "body": {"b": 2}},
        {"deviceId": "dev-1", "body": {"a": 3}},
        {"deviceId": "dev-1", "source": "deviceConnectionStateEvents",
         "properties": {"opType": "deviceDisconnected"}, "body": {"sequenceNumber": "000000000000000001D5"}},
    ]));
    let mut frames = Vec::new();
    while !frames.iter().any(|f: &Value| f["connectionState"] == json!(false)) {
        frames.push(live.next_json(WAIT).unwrap_or_else(|| panic!("the offline state arrives; got {frames:?}")));
    }
    let telemetry: Vec<&Value> = frames.iter().filter(|f| f.get("telemetry").is_some()).collect();
    assert!(telemetry.len() < 5, "the socket was behind, so telemetry was conflated: {frames:?}");
    // What a client holds after applying every frame in order, as ux4iot's hooks do.
    let mut state = serde_json::Map::new();
    for f in &telemetry {
        for (k, v) in f["telemetry"].as_object().unwrap() {
            state.insert(k.clone(), v.clone());
        }
    }
    assert_eq!(Value::Object(state), json!({"a": 3, "b": 2}), "every key's newest value arrives: {frames:?}");
    assert!(server.metric("hubcast_conflated_total").unwrap_or(0.0) > 0.0);
}

// ---- A3: polling handshakes are capped ------------------------------------------------------

#[test]
fn pipelined_polling_handshakes_without_a_session_are_capped_and_expire() {
    const N: usize = 20_000;
    let server = Server::start(&["--max-connections", "200", "--max-sessions", "100", "--ping-timeout", "1000"]);
    // Opened first: the flood may spend the budget of the core that would take a new one.
    let mut scraper = server.connect();
    let mut polling_sockets = || -> f64 {
        let request = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{}: {}\r\n\r\n", ADMIN.0, ADMIN.1);
        let RawOutcome::Response(r) = raw_exchange(&mut scraper, request.as_bytes()) else { panic!("no metrics") };
        let series = "hubcast_sockets{transport=\"socketio_polling\"} ";
        r.body.lines().find_map(|l| l.strip_prefix(series)?.parse().ok()).expect("the polling gauge")
    };
    assert_eq!(polling_sockets(), 0.0);
    let stream = server.connect();
    let mut reader = stream.try_clone().unwrap();
    reader.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let counter = std::thread::spawn(move || {
        // Count answers: one status line per response.
        let mut buf = vec![0u8; 64 * 1024];
        let (mut seen, mut tail) = (0usize, Vec::new());
        while seen < N {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    tail.extend_from_slice(&buf[..n]);
                    seen += tail.windows(9).filter(|w| w == b"HTTP/1.1 ").count();
                    let keep = tail.len().saturating_sub(8);
                    tail.drain(..keep);
                }
            }
        }
        seen
    });
    let request = raw_get("/socket.io/?EIO=4&transport=polling");
    let mut writer = stream;
    writer.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    let all: Vec<u8> = request.iter().copied().cycle().take(request.len() * N).collect();
    writer.write_all(&all).unwrap();
    let answered = counter.join().unwrap();
    assert_eq!(answered, N, "every handshake is answered (most with 503)");
    let open = polling_sockets();
    // Without a CONNECT, at most a quarter of a core's share of the budget (200 / 2 / 4).
    assert!(open <= 25.0, "{open} polling sessions from one connection with --max-connections 200");
    // None of them polls: each is closed soon after its handshake.
    let deadline = Instant::now() + Duration::from_secs(10);
    while polling_sockets() > 0.0 {
        assert!(Instant::now() < deadline, "abandoned handshakes are closed");
        std::thread::sleep(Duration::from_millis(100));
    }
    // And the budget is free again: a real client connects over polling.
    let session = subscribed(&server, "dev-1", &["telemetry"]);
    let client = server.socketio(&[&session], "polling");
    client.wait_for("connect", WAIT).expect("a polling client connects afterwards");
}

// ---- item 12: the WebSocket handshake key and close codes ------------------------------------------

#[test]
fn an_empty_or_malformed_websocket_key_gets_400_and_no_upgrade() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let path = format!("/ws?sessionId={session}");
    for key in ["", "abc", "dGhlIHNhbXBsZSBub25jZQ", "dGhlIHNhbXBsZSBub25jZQ=!", "dGhlIHNhbXBsZSBub25jZXh4eA==", "!!!!!!!!!!!!!!!!!!!!!!=="] {
        let (_, status) = raw_upgrade(&server, &path, Some(key));
        assert_eq!(status, 400, "key {key:?}");
    }
    let (_, status) = raw_upgrade(&server, &path, Some(KEY));
    assert_eq!(status, 101, "a valid key upgrades");
}

#[test]
fn invalid_close_codes_are_answered_with_1002_and_valid_ones_with_1000() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let path = format!("/ws?sessionId={session}");
    for code in [0u16, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000] {
        let (mut stream, status) = raw_upgrade(&server, &path, Some(KEY));
        assert_eq!(status, 101);
        stream.write_all(&client_frame(0x8, &code.to_be_bytes())).unwrap();
        assert_eq!(close_code(&mut stream), Some(1002), "close code {code}");
    }
    for code in [1000u16, 1001, 3000, 4999] {
        let (mut stream, _) = raw_upgrade(&server, &path, Some(KEY));
        stream.write_all(&client_frame(0x8, &code.to_be_bytes())).unwrap();
        assert_eq!(close_code(&mut stream), Some(1000), "close code {code}");
    }
}

// ---- item 14: DISCONNECT before closing ------------------------------------------------------

#[test]
fn deleting_a_session_disconnects_socketio_clients_with_io_server_disconnect() {
    let server = Server::start(&[]);
    for transports in ["websocket", "polling"] {
        let session = subscribed(&server, "dev-1", &["telemetry"]);
        let client = server.socketio(&[&session], transports);
        client.wait_for("connect", WAIT).expect("connect");
        let (status, _, _) = server.call("DELETE", &format!("/sessions/{session}"), &[ADMIN], None);
        assert_eq!(status, 204);
        let e = client.wait_for("disconnect", WAIT).expect("disconnect");
        assert_eq!(e["reason"], "io server disconnect", "{transports}: {e}");
    }
}

// ---- item 11: a busy socket on an epoll core yields ----------------------------------------------

#[test]
fn an_epoll_core_keeps_answering_while_sockets_stream_big_frames() {
    let server = Server::start(&["--io-driver", "epoll", "--cores", "1"]);
    let session = server.new_session();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let streamers: Vec<_> = (0..4)
        .map(|i| {
            let (mut stream, status) = raw_upgrade(&server, &format!("/ws?sessionId={session}"), Some(KEY));
            assert_eq!(status, 101, "socket {i}");
            let (stop, written) = (stop.clone(), written.clone());
            std::thread::spawn(move || {
                let frame = client_frame(0x1, "y".repeat(65_000).as_bytes());
                let mut sent = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && stream.write_all(&frame).is_ok() {
                    sent += 1;
                    written.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                sent
            })
        })
        .collect();
    // Once the streams have written far more than the sockets' kernel buffers hold (200 frames,
    // 13 MB), the core is reading them: then ask the same (only) core for something else.
    let deadline = Instant::now() + WAIT;
    while written.load(std::sync::atomic::Ordering::Relaxed) < 200 {
        assert!(Instant::now() < deadline, "the sockets did not stream");
        std::thread::sleep(Duration::from_millis(5));
    }
    let started = Instant::now();
    for _ in 0..20 {
        server.assert_alive();
    }
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let frames: u64 = streamers.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(frames > 4, "the sockets were streaming ({frames} frames)");
    eprintln!("20 GET /version answered in {took:?} while {frames} frames of 65 KB streamed");
}

/// Streams `frames` text frames of 60 KB on a fresh `/ws` socket, then a ping, and waits for its
/// pong: by then the server has read every byte. Returns the socket read pauses counted.
fn read_pauses_after_streaming(server: &Server, frames: usize) -> f64 {
    let session = server.new_session();
    let (mut stream, status) = raw_upgrade(server, &format!("/ws?sessionId={session}"), Some(KEY));
    assert_eq!(status, 101);
    let frame = client_frame(0x1, "z".repeat(60_000).as_bytes());
    let writer = {
        let mut stream = stream.try_clone().unwrap();
        std::thread::spawn(move || {
            for _ in 0..frames {
                stream.write_all(&frame).unwrap();
            }
            stream.write_all(&client_frame(0x9, b"all sent")).unwrap();
        })
    };
    stream.set_read_timeout(Some(WAIT)).unwrap();
    loop {
        let (opcode, payload) = read_frame(&mut stream).expect("the pong after every frame was read");
        if opcode == 0xA && payload == b"all sent" {
            break;
        }
    }
    writer.join().unwrap();
    server.metric("hubcast_socket_read_pauses_total").expect("the read pause counter")
}

#[test]
fn only_an_epoll_core_pauses_a_socket_that_streams_and_io_uring_never_throttles_it() {
    // 8 MiB: an epoll core reads what is already there without waiting, so it pauses the
    // socket now and then to serve the others (the counter works)...
    let epoll = Server::start(&["--io-driver", "epoll", "--cores", "1"]);
    let paused = read_pauses_after_streaming(&epoll, 140);
    assert!(paused >= 1.0, "an epoll core never paused a streaming socket ({paused})");
    // ...while every io_uring read waits for its completion, so the others run anyway: no
    // pause (before: a 1 ms pause every 64 KiB, about 128 here).
    let uring = Server::start(&["--io-driver", "uring", "--cores", "1"]);
    uring.wait_for_stdout(WAIT, |l| l.contains("io_uring")).expect("this machine runs io_uring");
    let paused = read_pauses_after_streaming(&uring, 140);
    assert_eq!(paused, 0.0, "io_uring reads were paused");
}

// ---- A5: bounded cross-core inboxes ----------------------------------------------------------

#[test]
fn a_session_core_behind_its_inbox_bound_keeps_the_backlog_bounded_and_nothing_deadlocks() {
    const SESSIONS: usize = 24;
    const DEVICES: usize = 16;
    // A tiny inbox (64 items): the devices' cores fall behind at once under a fan-out burst.
    let server = Server::start(&["--cores", "2", "--mesh-inbox-messages", "64", "--mesh-inbox-bytes", "65536"]);
    let devices: Vec<String> = (0..DEVICES).map(|i| format!("burst-{i}")).collect();
    let agent = new_agent();
    let sessions: Vec<String> = (0..SESSIONS)
        .map(|_| {
            let session = server.new_session_on(&agent);
            for device in &devices {
                for kind in ["telemetry", "connectionState"] {
                    let request = json!({"type": kind, "deviceId": device});
                    server.grant_on(&agent, &session, request.clone());
                    assert_eq!(server.subscribe_on(&agent, &session, request).0, 204);
                }
            }
            session
        })
        .collect();
    let mut watcher = server.live(&sessions[0]);
    // Every round: one message per device, fanned out to every session (two kinds each).
    let fan_out = DEVICES * SESSIONS * 2;
    let threads: Vec<_> = (0..6)
        .map(|t| {
            let base = server.base.clone();
            let devices = devices.clone();
            std::thread::spawn(move || {
                let agent = new_agent();
                for round in 0..25 {
                    let batch: Vec<Value> = devices
                        .iter()
                        .map(|d| json!({"deviceId": d, "body": {"t": t, "round": round, "pad": "p".repeat(200)}}))
                        .collect();
                    let (status, body) = match agent
                        .post(&format!("{base}/ingest"))
                        .set("Shared-Access-Key", ADMIN_KEY)
                        .timeout(Duration::from_secs(30))
                        .send_json(Value::Array(batch))
                    {
                        Ok(r) => (r.status(), r.into_string().unwrap()),
                        Err(e) => panic!("POST /ingest during the burst: {e}"),
                    };
                    assert_eq!(status, 200, "{body}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("every POST /ingest of the burst is answered");
    }
    // Sentinel on the same path: after the burst, a fresh value still reaches a socket.
    server.ingest(json!({"deviceId": "burst-0", "body": {"sentinel": true}}));
    loop {
        let frame = watcher.next_json(Duration::from_secs(10)).expect("the sentinel arrives after the burst");
        if frame["telemetry"]["sentinel"] == json!(true) {
            break;
        }
    }
    let peak: f64 = (0..2).map(|c| server.metric(&format!("hubcast_mesh_backlog_peak_messages{{core=\"{c}\"}}")).unwrap()).sum();
    assert!(peak > 0.0, "the burst went past the inbox bound, so backlogs were used");
    // Producers wait while a backlog holds more than 64 items: a request checks for room
    // before its messages are applied, so each of the 6 requests in flight may add one
    // round's fan-out past that bound, and no more (unbounded, the 25 rounds of 6 threads
    // would queue 150 fan-outs).
    let bound = 2 * 64 + 6 * fan_out;
    assert!(peak <= bound as f64, "backlog peak {peak} items, bound {bound}");
    eprintln!("backlog peak {peak} items; conflated {:?}", server.metric("hubcast_mesh_conflated_total"));
}
