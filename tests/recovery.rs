//! Socket.IO connection state recovery (issue 24, docs/design/recovery.md): the real
//! `socket.io-client` from npm behind a proxy that cuts it off the network ([`Cutter`]), and
//! raw frames where the exact bytes matter. Every wait is on an event: a client event, a
//! metric, the proxy's counters.

mod common;

use std::io::Write;
use std::time::Duration;

use common::lb::Cutter;
use common::rawws::{client_frame, raw_upgrade, text_until, KEY};
use common::recovery::*;
use common::sio::{socketio_at, SioClient};
use common::*;
use serde_json::{json, Value};

#[test]
fn each_event_carries_a_string_offset_after_an_unchanged_envelope() {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let client = server.socketio_env(&[&session], "websocket", false, &[PRINT]);
    let connected = client.wait_for("connect", WAIT).expect("connect");
    assert_eq!(
        connected["pid"], true,
        "the CONNECT answer carries a pid: {connected}"
    );
    assert_eq!(connected["recovered"], false, "{connected}");
    server.ingest(json!((0..5)
        .map(|n| message("dev-1", n))
        .collect::<Vec<_>>()));
    let mut last: Option<(String, u64)> = None;
    for n in 0..5 {
        let (got, e) = next_n(&client);
        assert_eq!(got, n);
        // What ux4iot's onData(data) reads: the envelope, as without recovery.
        assert_eq!(e["data"]["deviceId"], "dev-1");
        assert!(e["data"]["timestamp"].is_string());
        assert_eq!(e["data"].as_object().unwrap().len(), 3, "{e}");
        assert_eq!(e["args"], 2, "the envelope and the offset: {e}");
        let (epoch, seq) = seq_of(e["offset"].as_str().expect("a string offset"));
        if let Some((e0, s0)) = &last {
            assert_eq!(&epoch, e0, "one stream per session");
            assert!(seq > *s0, "seqs strictly increase: {s0} then {seq}");
        }
        last = Some((epoch, seq));
    }
}

/// Reads the Socket.IO handshake of a raw WebSocket and sends `connect` (the CONNECT packet
/// after the Engine.IO `4`); returns the CONNECT answer's JSON.
fn raw_connect(server: &Server, session: &str, connect: &str) -> (std::net::TcpStream, Value) {
    let (mut stream, status) = raw_upgrade(
        server,
        &format!("/socket.io/?EIO=4&transport=websocket&sessionId={session}"),
        Some(KEY),
    );
    assert_eq!(status, 101);
    text_until(&mut stream, |t| t.starts_with('0'));
    stream
        .write_all(&client_frame(0x1, format!("4{connect}").as_bytes()))
        .unwrap();
    let answer = text_until(&mut stream, |t| t.starts_with("40") || t.starts_with("44"));
    let json = answer.strip_prefix("40").unwrap_or(&answer).to_string();
    (stream, parse_json(&json))
}

fn raw_data(stream: &mut std::net::TcpStream) -> Value {
    let text = text_until(stream, |t| t.starts_with("42"));
    parse_json(&text[2..])
}

#[test]
fn recovery_window_0_gives_todays_bytes_and_the_default_a_pid_and_offsets() {
    for (flags, on) in [(&["--recovery-window", "0"][..], false), (&[][..], true)] {
        let server = Server::start(flags);
        let session = d2c_session(&server, "dev-1");
        let (mut stream, answer) = raw_connect(&server, &session, "0");
        let keys: Vec<&String> = answer.as_object().expect("a JSON object").keys().collect();
        if on {
            assert_eq!(keys, ["pid", "sid"], "{answer}");
            assert_eq!(answer["pid"].as_str().unwrap().len(), 22);
        } else {
            assert_eq!(keys, ["sid"], "today's CONNECT answer: {answer}");
        }
        server.ingest(message("dev-1", 7));
        let event = raw_data(&mut stream);
        let args = event.as_array().expect("an array");
        assert_eq!(args[0], "data");
        assert_eq!(args[1]["message"]["n"], 7);
        if on {
            assert_eq!(args.len(), 3, "{event}");
            seq_of(args[2].as_str().expect("a string offset"));
        } else {
            assert_eq!(args.len(), 2, "today's event: {event}");
        }
    }
}

/// Issue 24's blip: 50 d2c messages ingested while the client is cut off arrive once, in
/// order, before a live one posted after the reconnect, and `socket.recovered` is true.
fn blip(transports: &str, gauge: &str) {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let cutter = Cutter::start(server.port);
    let client = connected_behind(&cutter, &server, &session, transports, 1000);
    if transports == "polling" {
        // A long poll cut by the proxy is not a closed socket for the server (no TCP of its
        // own): it sees the socket go when the recovered one displaces it.
        cutter.cut();
        let gone = client
            .wait_for("disconnect", WAIT)
            .expect("the client sees the cut");
        assert!(
            gone["reason"].as_str().unwrap().starts_with("transport "),
            "{gone}"
        );
    } else {
        cut(&cutter, &server, &client, gauge);
    }
    server.ingest(json!((0..50)
        .map(|n| message("dev-1", n))
        .collect::<Vec<_>>()));
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    server.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..51).map(|_| next_n(&client).0).collect();
    let mut want: Vec<u64> = (0..50).collect();
    want.push(999);
    assert_eq!(
        got, want,
        "every missed message once, in order, before the live one"
    );
    let label = if transports == "polling" {
        "socketio_polling"
    } else {
        "socketio_websocket"
    };
    assert_eq!(
        server.metric(&format!(
            "hubcast_recovery_succeeded_total{{transport=\"{label}\"}}"
        )),
        Some(1.0)
    );
    assert_eq!(
        server.metric("hubcast_recovery_replayed_frames_total"),
        Some(50.0)
    );
    // Nothing more came twice: the next event is the next live message.
    server.ingest(message("dev-1", 1001));
    assert_eq!(next_n(&client).0, 1001, "nothing twice");
}

#[test]
fn a_blip_over_websocket_replays_every_missed_message_once_in_order() {
    blip("websocket", WS_GAUGE);
}

#[test]
fn an_unknown_pid_is_not_recovered_and_live_data_flows() {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let (mut stream, answer) = raw_connect(
        &server,
        &session,
        r#"0{"pid":"not-a-pid-we-gave-out-xx","offset":"h1.1.1"}"#,
    );
    let pid = answer["pid"].as_str().expect("a new pid");
    assert_ne!(
        pid, "not-a-pid-we-gave-out-xx",
        "not the pid sent: socket.recovered is false"
    );
    assert_eq!(
        server.metric("hubcast_recovery_failed_total{reason=\"unknown_pid\"}"),
        Some(1.0)
    );
    assert_eq!(
        server.metric("hubcast_recovery_attempts_total{transport=\"socketio_websocket\"}"),
        Some(1.0)
    );
    server.ingest(message("dev-1", 5));
    assert_eq!(
        raw_data(&mut stream)[1]["message"]["n"],
        5,
        "live data flows at once"
    );
}

#[test]
fn a_session_deleted_while_away_is_not_recovered() {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let cutter = Cutter::start(server.port);
    let client = connected_behind(&cutter, &server, &session, "websocket", 1);
    cut(&cutter, &server, &client, WS_GAUGE);
    let (status, _, _) = server.call("DELETE", &format!("/sessions/{session}"), &[ADMIN], None);
    assert_eq!(status, 204);
    assert!(cutter.wait(WAIT, |c| c.refused() >= 1));
    cutter.release();
    // Reconnects refused by the proxy are connect_errors too ("websocket error"); then ours.
    let refused = loop {
        let e = client
            .wait_for("connect_error", WAIT)
            .expect("the reconnect is refused");
        if e["message"] != "websocket error" {
            break e;
        }
    };
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .contains("unknown or expired session"),
        "{refused}"
    );
    assert_eq!(
        server.metric("hubcast_recovery_failed_total{reason=\"unknown_pid\"}"),
        Some(1.0)
    );
}

#[test]
fn a_blip_over_polling_replays_every_missed_message_once_in_order() {
    blip("polling", "");
}

#[test]
fn away_longer_than_the_window_is_not_recovered_and_live_data_flows() {
    let server = Server::start(&["--recovery-window", "2"]);
    let session = d2c_session(&server, "dev-1");
    let cutter = Cutter::start(server.port);
    let client = connected_behind(&cutter, &server, &session, "websocket", 1000);
    cut(&cutter, &server, &client, WS_GAUGE);
    server.ingest(json!((0..5)
        .map(|n| message("dev-1", n))
        .collect::<Vec<_>>()));
    // The history goes a window after its last pid left (the core's clock): the event to wait on.
    server.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::Eq(0.0));
    assert!(
        server
            .metric("hubcast_recovery_trimmed_bytes_total{cause=\"window\"}")
            .unwrap()
            > 0.0
    );
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(
        server.metric("hubcast_recovery_failed_total{reason=\"window\"}"),
        Some(1.0)
    );
    server.ingest(message("dev-1", 999));
    assert_eq!(
        next_n(&client).0,
        999,
        "nothing replayed, live data at once"
    );
}

/// Past `--recovery-core-bytes` the core keeps the most recent deliveries (oldest first, one
/// horizon for every session, as Socket.IO's adapters and Centrifugo): sessions cut off early,
/// with small histories, lose what they missed and fail `bound`, while sessions cut off late,
/// with the largest histories, recover exactly what they missed (within the horizon); the
/// history stays within the bound. (Largest-first, before, cut the late ones instead.)
#[test]
fn past_the_core_bound_history_stays_under_it_and_only_the_trimmed_fail() {
    const GROUP: usize = 4;
    const BOUND: f64 = 16384.0;
    // The early group (dev-2) misses 3 messages; the late group (dev-1) takes in 40 live,
    // which passes the bound (4 sessions share each frame: about 4 × 160 charged bytes), then
    // misses 3, well within the horizon (about the last 20 messages).
    const LIVE: u64 = 40;
    const MISSED: u64 = 3;
    let server = Server::start(&["--cores", "1", "--recovery-core-bytes", "16384"]);
    let early_ids: Vec<String> = (0..GROUP).map(|_| d2c_session(&server, "dev-2")).collect();
    let late_ids: Vec<String> = (0..GROUP).map(|_| d2c_session(&server, "dev-1")).collect();
    let (early_cut, late_cut) = (Cutter::start(server.port), Cutter::start(server.port));
    let ids = |v: &[String]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (e, l) = (ids(&early_ids), ids(&late_ids));
    let early = socketio_at(&early_cut.base(), &e.iter().map(String::as_str).collect::<Vec<_>>(), "websocket", true, &[PRINT, FAST]);
    let late = socketio_at(&late_cut.base(), &l.iter().map(String::as_str).collect::<Vec<_>>(), "websocket", true, &[PRINT, FAST]);
    for (clients, device) in [(&early, "dev-2"), (&late, "dev-1")] {
        let mut connected = 0;
        while connected < GROUP {
            let e = clients.next(WAIT).expect("every client connects");
            connected += usize::from(e["event"] == "connect");
        }
        server.ingest(message(device, 1000));
        let mut first = 0;
        while first < GROUP {
            let e = clients.next(WAIT).expect("every client gets the first message");
            first += usize::from(e["event"] == "data");
        }
    }
    early_cut.cut();
    server.wait_for_metric(WS_GAUGE, WAIT, Want::Eq(GROUP as f64));
    server.ingest(json!((0..MISSED).map(|n| message("dev-2", n)).collect::<Vec<_>>()));
    for n in 0..LIVE {
        server.ingest(message("dev-1", n));
    }
    let mut live = [0u64; GROUP];
    while live.iter().any(|n| *n < LIVE) {
        let e = late.next(WAIT).expect("the late group gets its messages live");
        if e["event"] == "data" {
            live[e["index"].as_u64().unwrap() as usize] += 1;
        }
    }
    late_cut.cut();
    server.wait_for_metric(WS_GAUGE, WAIT, Want::Eq(0.0));
    server.ingest(json!((LIVE..LIVE + MISSED).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    let held = server.metric("hubcast_recovery_history_bytes").unwrap();
    assert!(held > 0.0 && held <= BOUND, "history held within the core bound: {held}");
    assert!(server.metric("hubcast_recovery_trimmed_bytes_total{cause=\"core_bound\"}").unwrap() > 0.0);
    // Per client: recovered or not, then what it receives until the live message.
    let mut outcome = Vec::new();
    for (cutter, clients) in [(&early_cut, &early), (&late_cut, &late)] {
        assert!(cutter.wait(WAIT, |c| c.refused() >= 1));
        cutter.release();
        let mut recovered: Vec<Option<bool>> = vec![None; GROUP];
        let mut got: Vec<Vec<u64>> = vec![Vec::new(); GROUP];
        while recovered.iter().any(Option::is_none) {
            let e = clients.next(WAIT).expect("every client reconnects");
            let i = e["index"].as_u64().unwrap() as usize;
            match e["event"].as_str() {
                Some("connect") => recovered[i] = Some(e["recovered"] == true),
                Some("data") => got[i].push(e["data"]["message"]["n"].as_u64().unwrap()),
                _ => {}
            }
        }
        outcome.push((recovered, got));
    }
    server.ingest(json!([message("dev-2", 999), message("dev-1", 999)]));
    for ((_, got), clients) in outcome.iter_mut().zip([&early, &late]) {
        while got.iter().any(|g| g.last() != Some(&999)) {
            let e = clients
                .next(WAIT)
                .unwrap_or_else(|| panic!("the live message reaches every client: {got:?}"));
            if e["event"] == "data" {
                got[e["index"].as_u64().unwrap() as usize].push(e["data"]["message"]["n"].as_u64().unwrap());
            }
        }
    }
    let (early_out, late_out) = (&outcome[0], &outcome[1]);
    assert_eq!(early_out.0, vec![Some(false); GROUP], "what the early group missed was the oldest: trimmed");
    for got in &early_out.1 {
        assert_eq!(got, &[999], "an early client got live data only");
    }
    assert_eq!(late_out.0, vec![Some(true); GROUP], "what the late group missed is within the horizon");
    let mut all: Vec<u64> = (LIVE..LIVE + MISSED).collect();
    all.push(999);
    for got in &late_out.1 {
        assert_eq!(got, &all, "a late client recovered everything, once, in order");
    }
    assert_eq!(server.metric("hubcast_recovery_failed_total{reason=\"bound\"}"), Some(GROUP as f64));
}

fn telemetry_session(server: &Server) -> String {
    let session = server.new_session();
    server.grant(&session, telemetry("dev-1", None));
    let (status, body) = server.subscribe(&session, telemetry("dev-1", None));
    assert_eq!(status, 204, "{body}");
    session
}

/// Telemetry frames (the envelopes) until one whose `n` is `last`.
fn telemetry_until(client: &SioClient, last: u64) -> Vec<Value> {
    let mut frames = Vec::new();
    loop {
        let e = client
            .wait_for("data", WAIT)
            .unwrap_or_else(|| panic!("telemetry up to n={last}: {frames:?}"));
        let done = e["data"]["telemetry"]["n"] == last;
        frames.push(e["data"].clone());
        if done {
            return frames;
        }
    }
}

#[test]
fn a_replay_under_throttling_equals_what_a_socket_that_stayed_received() {
    let server = Server::start(&["--cores", "1", "--throttling-interval", "300"]);
    let (cut_session, staying) = (telemetry_session(&server), telemetry_session(&server));
    let cutter = Cutter::start(server.port);
    let cut_client = socketio_at(
        &cutter.base(),
        &[&cut_session],
        "websocket",
        true,
        &[PRINT, FAST],
    );
    let stay = server.socketio_env(&[&staying], "websocket", false, &[PRINT]);
    cut_client.wait_for("connect", WAIT).expect("connect");
    stay.wait_for("connect", WAIT).expect("connect");
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 0}}));
    assert_eq!(telemetry_until(&cut_client, 0).len(), 1);
    assert_eq!(telemetry_until(&stay, 0).len(), 1);
    cutter.cut();
    cut_client
        .wait_for("disconnect", WAIT)
        .expect("the client sees the cut");
    server.wait_for_metric(WS_GAUGE, WAIT, Want::Eq(1.0));
    for n in 1..=20u64 {
        // Keys that come and go: the trailing merge keeps the newest of each.
        server.ingest(json!({"deviceId": "dev-1", "body": {"n": n, format!("k{}", n % 3): n}}));
    }
    let stayed = telemetry_until(&stay, 20);
    assert!(stayed.len() < 20, "throttled: {stayed:?}");
    let back = come_back(&cutter, &cut_client);
    assert_eq!(back["recovered"], true, "{back}");
    let replayed = telemetry_until(&cut_client, 20);
    assert_eq!(
        replayed, stayed,
        "the replay is what the socket that stayed received"
    );
}

// ---- plain WebSocket: offsets=1 and since= (design step 4) -----------------------------------

const PLAIN_GAUGE: &str = "hubcast_sockets{transport=\"websocket\"}";

fn plain(server: &Server, session: &str, query: &str) -> std::net::TcpStream {
    let (stream, status) = raw_upgrade(server, &format!("/ws?sessionId={session}{query}"), Some(KEY));
    assert_eq!(status, 101, "/ws?sessionId=…{query}");
    stream
}

/// The next text frame as JSON, and its text.
fn plain_next(stream: &mut std::net::TcpStream) -> (Value, String) {
    let text = text_until(stream, |_| true);
    (parse_json(&text), text)
}

#[test]
fn a_plain_websocket_resumes_after_since_with_every_missed_message_once_in_order() {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let mut ws = plain(&server, &session, "&offsets=1");
    server.ingest(message("dev-1", 1000));
    let (first, text) = plain_next(&mut ws);
    assert!(text.starts_with(r#"{"offset":"h1."#), "the offset is the first member: {text}");
    assert_eq!(first["message"]["n"], 1000);
    let offset = first["offset"].as_str().unwrap().to_string();
    drop(ws);
    server.wait_for_metric(PLAIN_GAUGE, WAIT, Want::Eq(0.0));
    server.ingest(json!((0..10).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    // The ingest is answered once the device's core took the messages; they reach the
    // session's history a moment later (another core): wait until all 11 are written there.
    server.wait_for_metric("hubcast_recovery_appended_frames_total", WAIT, Want::AtLeast(11.0));
    let mut ws = plain(&server, &session, &format!("&offsets=1&since={offset}"));
    assert_eq!(plain_next(&mut ws).0, json!({"recovered": true, "replayed": 10}));
    let mut last = seq_of(&offset).1;
    for n in 0..10 {
        let (frame, _) = plain_next(&mut ws);
        assert_eq!(frame["message"]["n"], n, "{frame}");
        let seq = seq_of(frame["offset"].as_str().unwrap()).1;
        assert!(seq > last, "offsets increase: {last} then {seq}");
        last = seq;
    }
    server.ingest(message("dev-1", 999));
    assert_eq!(plain_next(&mut ws).0["message"]["n"], 999, "then live data");
    assert_eq!(server.metric("hubcast_recovery_succeeded_total{transport=\"websocket\"}"), Some(1.0));
    assert_eq!(server.metric("hubcast_recovery_replayed_frames_total"), Some(10.0));
}

#[test]
fn since_an_unknown_history_says_recovered_false_first_and_live_data_flows() {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let mut ws = plain(&server, &session, "&offsets=1&since=h1.1.5");
    assert_eq!(plain_next(&mut ws).0, json!({"recovered": false, "reason": "history_lost"}));
    server.ingest(message("dev-1", 7));
    assert_eq!(plain_next(&mut ws).0["message"]["n"], 7);
    assert_eq!(server.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
}

#[test]
fn batched_frames_carry_each_envelopes_offset() {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let mut ws = plain(&server, &session, "&offsets=1&batch=1");
    server.ingest(json!((0..5).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    let mut seen = Vec::new();
    while seen.len() < 5 {
        let (frame, text) = plain_next(&mut ws);
        assert!(text.starts_with(r#"[{"offset":"h1."#), "{text}");
        for element in frame.as_array().expect("an array") {
            seen.push((element["message"]["n"].as_u64().unwrap(), seq_of(element["offset"].as_str().unwrap()).1));
        }
    }
    assert_eq!(seen.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
    assert!(seen.windows(2).all(|w| w[1].1 > w[0].1), "{seen:?}");
}

#[test]
fn offsets_and_since_are_refused_before_the_upgrade_when_they_cannot_hold() {
    let ask = |server: &Server, query: &str| -> (u16, String) {
        let mut stream = server.connect();
        let request = format!(
            "GET /ws?sessionId=x{query} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        match raw_exchange(&mut stream, request.as_bytes()) {
            RawOutcome::Response(r) => (r.status, r.body),
            other => panic!("no answer to {query}: {other:?}"),
        }
    };
    let server = Server::start(&[]);
    for (query, needle) in [
        ("&since=h1.1.1", "since needs offsets=1"),
        ("&offsets=1&since=nope", "since: not an offset hubcast gave"),
        ("&offsets=2", "offsets must be 1"),
    ] {
        let (status, body) = ask(&server, query);
        assert_error(status, &body, 400, needle);
    }
    let off = Server::start(&["--recovery-window", "0"]);
    let (status, body) = ask(&off, "&offsets=1");
    assert_error(status, &body, 400, "recovery is off");
}

// ---- several instances: a blip on one, messages taken in by another ---------------------------

#[test]
fn a_blip_on_one_instance_recovers_what_another_instance_took_in_meanwhile() {
    let redis = common::redis::Redis::start();
    let (a, b) = (instance(&redis, "a"), instance(&redis, "b"));
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, &a, &session, "websocket", 1000);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    cut(&cutter, &a, &client, WS_GAUGE);
    // Its client away, the session still watches its device: B's messages keep coming to A.
    b.ingest(json!((0..50).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(51.0));
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    b.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..51).map(|_| next_n(&client).0).collect();
    let mut want: Vec<u64> = (0..50).collect();
    want.push(999);
    assert_eq!(got, want, "what B took in while the client was away, once, in order, then live");
}

#[test]
fn an_away_session_stops_watching_its_devices_when_its_history_goes() {
    let redis = common::redis::Redis::start();
    let (a, b) = (instance_with(&redis, "a", &["--recovery-window", "2"]), instance(&redis, "b"));
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, &a, &session, "websocket", 1000);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    cut(&cutter, &a, &client, WS_GAUGE);
    a.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::Eq(0.0));
    // Zero Redis traffic for a device nobody watches: once nobody can recover, B stops publishing.
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(0.0));
}

#[test]
fn a_replay_longer_than_the_socket_queue_bound_is_not_a_slow_consumer() {
    let server = Server::start(&["--socket-queue-hard-limit", "64"]);
    let session = d2c_session(&server, "dev-1");
    let cutter = Cutter::start(server.port);
    let client = connected_behind(&cutter, &server, &session, "websocket", 1000);
    cut(&cutter, &server, &client, WS_GAUGE);
    for chunk in 0..6u64 {
        server.ingest(json!((chunk * 50..chunk * 50 + 50).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    }
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    let got: Vec<u64> = (0..300).map(|_| next_n(&client).0).collect();
    assert_eq!(got, (0..300).collect::<Vec<_>>(), "300 replayed past a 64-message queue bound, in order");
    assert_eq!(server.metric("hubcast_slow_consumers_closed_total"), Some(0.0));
}

#[test]
fn a_socket_upgraded_from_polling_keeps_its_pid_and_offsets_and_recovers() {
    let server = Server::start(&[]);
    let session = d2c_session(&server, "dev-1");
    let cutter = Cutter::start(server.port);
    let client = socketio_at(&cutter.base(), &[&session], "polling,websocket", true, &[PRINT, FAST]);
    let (mut connected, mut upgraded) = (false, false);
    while !(connected && upgraded) {
        let e = client.next(WAIT).expect("connect and upgrade");
        connected |= e["event"] == "connect";
        upgraded |= e["event"] == "upgrade";
    }
    server.wait_for_metric(WS_GAUGE, WAIT, Want::Eq(1.0));
    server.ingest(message("dev-1", 1000));
    let (n, e) = next_n(&client);
    assert_eq!(n, 1000);
    seq_of(e["offset"].as_str().expect("an offset after the upgrade"));
    cut(&cutter, &server, &client, WS_GAUGE);
    server.ingest(json!((0..10).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "the pid moved with the upgrade: {back}");
    let got: Vec<u64> = (0..10).map(|_| next_n(&client).0).collect();
    assert_eq!(got, (0..10).collect::<Vec<_>>());
}

/// `n` d2c messages `from..from + n` as one ingest.
fn ingest_range(server: &Server, from: u64, n: u64) {
    server.ingest(json!((from..from + n)
        .map(|i| message("dev-1", i))
        .collect::<Vec<_>>()));
}

/// A gateway keeping its state in `dir`, listening on `port` ("0": any).
fn durable(dir: &TempDir, port: &str) -> Server {
    Server::start(&["--data-dir", dir.path(), "--port", port])
}

/// Where the restart tests start: a gateway on a fresh data dir (its port, to restart on),
/// a session reading `dev-1`'s d2c messages, and its Socket.IO client behind a cutter (the
/// message before the cut numbered `first`, as in [`connected_behind`]), cut off.
fn cut_off_on_a_data_dir(first: u64) -> (TempDir, Server, String, Cutter, SioClient) {
    let dir = TempDir::new();
    let server = durable(&dir, "0");
    let port = server.port.to_string();
    let session = d2c_session(&server, "dev-1");
    let cutter = Cutter::start(server.port);
    let client = connected_behind(&cutter, &server, &session, "websocket", first);
    cut(&cutter, &server, &client, WS_GAUGE);
    (dir, server, port, cutter, client)
}

/// Issue 24, "a graceful SIGTERM deploy", design step 5: the session's stream and pids are in
/// the final commit and come back with the session on the same `--data-dir`. Twice: a client
/// cut off before the stop (what was ingested before the stop and after the restart, 40
/// messages), then a client connected when the stop says goodbye (its pid is away from then;
/// 10 ingested after the restart). The client reconnects by itself each time.
#[test]
fn a_sigterm_and_a_restart_on_the_same_data_dir_replay_what_the_client_missed() {
    let (dir, mut server, port, cutter, client) = cut_off_on_a_data_dir(1000);
    let start = |port: &str| durable(&dir, port);
    ingest_range(&server, 0, 20);
    sigterm(&mut server);
    server = start(&port);
    assert!(
        server
            .wait_for_stderr(WAIT, |l| l.contains("recovery streams read back"))
            .is_some(),
        "{}",
        server.stderr_lines().join("\n")
    );
    ingest_range(&server, 20, 20);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    server.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..41).map(|_| next_n(&client).0).collect();
    let mut want: Vec<u64> = (0..40).collect();
    want.push(999);
    assert_eq!(
        got, want,
        "every missed message once, in order, across the restart, then live"
    );
    assert_eq!(
        server.metric("hubcast_recovery_replayed_frames_total"),
        Some(40.0)
    );

    // Connected when the stop comes: the goodbye is a transport close to the client, which
    // keeps its pid and offset and tries again by itself.
    server.signal(libc::SIGTERM);
    let gone = client.wait_for("disconnect", WAIT).expect("the goodbye");
    assert!(
        gone["reason"].as_str().unwrap().starts_with("transport "),
        "{gone}"
    );
    let exit = server.wait_exit(WAIT).expect("exits after SIGTERM");
    assert!(exit.success(), "{exit:?}");
    cutter.hold();
    server = start(&port);
    ingest_range(&server, 40, 10);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    server.ingest(message("dev-1", 1001));
    let got: Vec<u64> = (0..11).map(|_| next_n(&client).0).collect();
    let mut want: Vec<u64> = (40..50).collect();
    want.push(1001);
    assert_eq!(got, want, "nothing twice, nothing lost");
    assert_eq!(
        server.metric("hubcast_recovery_succeeded_total{transport=\"socketio_websocket\"}"),
        Some(1.0)
    );
}

/// The time the process was down counts against the window: the pid's away time is wall
/// clock, so a client back after the window (the restarted instance's clock dropped the
/// history it read back) is not recovered, counted `window`, and gets live data at once.
#[test]
fn past_the_window_after_a_restart_the_client_is_not_recovered_and_live_data_flows() {
    let dir = TempDir::new();
    let start = |port: &str| {
        Server::start(&[
            "--data-dir",
            dir.path(),
            "--port",
            port,
            "--recovery-window",
            "4",
        ])
    };
    let mut server = start("0");
    let port = server.port.to_string();
    let session = d2c_session(&server, "dev-1");
    let cutter = Cutter::start(server.port);
    let client = connected_behind(&cutter, &server, &session, "websocket", 1000);
    cut(&cutter, &server, &client, WS_GAUGE);
    ingest_range(&server, 0, 5);
    sigterm(&mut server);
    server = start(&port);
    let read = server
        .wait_for_stderr(WAIT, |l| {
            l.contains("recovery streams read back") && l.contains("restored=1")
        })
        .is_some();
    assert!(
        read,
        "the stream came back: {}",
        server.stderr_lines().join("\n")
    );
    server.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::Eq(0.0));
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(
        server.metric("hubcast_recovery_failed_total{reason=\"window\"}"),
        Some(1.0)
    );
    server.ingest(message("dev-1", 7));
    assert_eq!(
        next_n(&client).0,
        7,
        "live data at once, nothing of the past"
    );
}

/// Step 5 with scale-out: a session whose stream came back from the store watches its devices
/// again at start (as an away session does), so what another instance on the same Redis takes
/// in while the client is still away reaches the restarted instance and is replayed.
#[test]
fn after_a_sigterm_and_restart_what_another_instance_took_in_is_recovered() {
    let redis = common::redis::Redis::start();
    let dir = TempDir::new();
    let url = redis.url();
    let start_a = |port: &str| {
        let args = ["--redis-url", &url, "--instance-id", "a", "--redis-prefix", "t", "--data-dir", dir.path(), "--port", port];
        let server = Server::start(&args);
        server.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0));
        server
    };
    let mut a = start_a("0");
    let port = a.port.to_string();
    let b = instance(&redis, "b");
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, &a, &session, "websocket", 1000);
    cut(&cutter, &a, &client, WS_GAUGE);
    b.ingest(json!((0..10).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::AtLeast(1.0));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(11.0));
    sigterm(&mut a);
    a = start_a(&port);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(json!((10..30).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(20.0));
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    b.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..31).map(|_| next_n(&client).0).collect();
    let mut want: Vec<u64> = (0..30).collect();
    want.push(999);
    assert_eq!(got, want, "B's messages before the stop and after the start, once, in order, then live");
}

// ---- kill -9, same data dir (design step 7) --------------------------------------------------

/// A crash: SIGKILL, nothing flushed.
fn kill_9(server: &mut Server) {
    server.signal(libc::SIGKILL);
    server.wait_exit(WAIT).expect("killed");
}

/// Issue 24, "`kill -9` then restart on the same `--data-dir`", design step 7: every frame of
/// the away client's history was written to the store before it could reach a socket, so
/// what was committed before the kill is replayed after the restart. The client is cut off,
/// 50 messages are ingested (their appends waited for on the metric), the gateway is killed,
/// restarted, 10 more are ingested: the client reconnects by itself with its pid and offset,
/// `recovered` is true and all 60 arrive once, in order, then live data.
#[test]
fn a_kill_9_and_a_restart_on_the_same_data_dir_replay_what_was_committed() {
    let (dir, mut server, port, cutter, client) = cut_off_on_a_data_dir(1000);
    let start = |port: &str| durable(&dir, port);
    ingest_range(&server, 0, 50);
    server.wait_for_metric("hubcast_recovery_appended_frames_total", WAIT, Want::AtLeast(51.0));
    kill_9(&mut server);
    server = start(&port);
    ingest_range(&server, 50, 10);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}\n{}", server.stderr_lines().join("\n"));
    server.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..61).map(|_| next_n(&client).0).collect();
    let mut want: Vec<u64> = (0..60).collect();
    want.push(999);
    assert_eq!(got, want, "what was committed before the kill and what came after, once, in order, then live");
    assert_eq!(server.metric("hubcast_recovery_replayed_frames_total"), Some(60.0));
    server.ingest(message("dev-1", 1001));
    assert_eq!(next_n(&client).0, 1001, "nothing twice");

    // Killed again at once, connected this time: its pid was written as connected, and counts
    // as away from the start that reads it back.
    kill_9(&mut server);
    let gone = client.wait_for("disconnect", WAIT).expect("the kill closes the socket");
    assert!(gone["reason"].as_str().unwrap().starts_with("transport "), "{gone}");
    cutter.hold();
    server = start(&port);
    ingest_range(&server, 60, 5);
    let back = come_back(&cutter, &client);
    let why: Vec<_> = ["window", "bound", "unknown_pid", "unknown_offset", "history_lost"]
        .iter()
        .map(|r| (r, server.metric(&format!("hubcast_recovery_failed_total{{reason=\"{r}\"}}"))))
        .collect();
    assert_eq!(back["recovered"], true, "{back} {why:?}\n{}", server.stderr_lines().join("\n"));
    let got: Vec<u64> = (0..5).map(|_| next_n(&client).0).collect();
    assert_eq!(got, (60..65).collect::<Vec<_>>());
}

/// The crash hole (design step 7e), made certain: a unit of work whose deliveries were
/// counted as posted in its commit and never reached the session's core, as a `kill -9`
/// between the two leaves it. Here the count is added to a core's log after a quiet kill (a
/// valid frame, as a crash leaves it). The start sees fewer deliveries taken in than posted:
/// the streams of that core get a new epoch, and the client is told `recovered` false
/// (`history_lost`), gets live data at once, and nothing twice.
#[test]
fn deliveries_posted_and_never_appended_before_a_crash_are_never_claimed_as_replayed() {
    use hubcast::store::format::{begin_log_frame, encode, end_log_frame, Change};
    let (dir, mut server, port, cutter, client) = cut_off_on_a_data_dir(1000);
    let start = |port: &str| durable(&dir, port);
    ingest_range(&server, 0, 5);
    server.wait_for_metric("hubcast_recovery_appended_frames_total", WAIT, Want::AtLeast(6.0));
    kill_9(&mut server);
    let mut logs: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "log") && p.file_name().unwrap().to_string_lossy().contains("-c0-"))
        .collect();
    logs.sort();
    let newest = logs.last().expect("core 0 has a log");
    // A frame of that log (its generation is the number in its name).
    let gen: u64 = newest.file_stem().unwrap().to_string_lossy().rsplit('-').next().unwrap().parse().unwrap();
    let mut frame = Vec::new();
    let at = begin_log_frame(&mut frame);
    for to in 0..2 {
        encode(&mut frame, Change::Posted { to, n: 1 << 40 });
    }
    end_log_frame(&mut frame, at, gen);
    std::fs::OpenOptions::new().append(true).open(newest).unwrap().write_all(&frame).unwrap();
    server = start(&port);
    assert!(
        server.wait_for_stderr(WAIT, |l| l.contains("may lack deliveries posted before a crash")).is_some(),
        "{}",
        server.stderr_lines().join("\n")
    );
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(server.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    server.ingest(message("dev-1", 7));
    assert_eq!(next_n(&client).0, 7, "live data at once, nothing of the past");
}

/// A `kill -9` in the middle of a firehose (a thread posting `POST /ingest` in a loop, the
/// client cut off): whatever the kill hit, the restart never claims a replay it cannot make.
/// Recovered: the replay holds every message acknowledged before the kill that followed the
/// client's offset, once, in order (an unacknowledged one may be there too, or not). Not
/// recovered: counted (`history_lost`), and only live messages follow. Never a duplicate.
#[test]
fn a_kill_9_mid_firehose_never_claims_a_replay_it_cannot_make() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let (dir, mut server, port, cutter, client) = cut_off_on_a_data_dir(1_000_000);
    let start = |port: &str| durable(&dir, port);
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let firehose = {
        let (acked, stop, url) = (acked.clone(), stop.clone(), server.url("/ingest"));
        std::thread::spawn(move || {
            let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(2)).build();
            let mut n = 1;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<Value> = (n..n + 20).map(|i| message("dev-1", i)).collect();
                match agent.post(&url).set(ADMIN.0, ADMIN.1).send_json(json!(batch)) {
                    Ok(r) if r.status() == 200 => {
                        acked.store(n + 19, Ordering::SeqCst);
                        n += 20;
                    }
                    _ => break,
                }
            }
        })
    };
    server.wait_for_metric("hubcast_recovery_appended_frames_total", WAIT, Want::AtLeast(500.0));
    kill_9(&mut server);
    stop.store(true, Ordering::Relaxed);
    firehose.join().unwrap();
    let acked = acked.load(Ordering::SeqCst);
    server = start(&port);
    let back = come_back(&cutter, &client);
    server.ingest(message("dev-1", 2_000_000));
    let mut got = Vec::new();
    loop {
        let n = next_n(&client).0;
        got.push(n);
        if n == 2_000_000 {
            break;
        }
    }
    let mut seen = std::collections::HashSet::new();
    assert!(got.iter().all(|n| seen.insert(*n)), "never twice: {got:?}");
    if back["recovered"] == true {
        let replayed = &got[..got.len() - 1];
        assert!(replayed.windows(2).all(|w| w[1] == w[0] + 1), "in order, no hole: {replayed:?}");
        assert_eq!(replayed.first(), Some(&1), "from the client's offset on");
        assert!(replayed.last().copied().unwrap_or(0) >= acked, "every acknowledged message: {} < {acked}", replayed.len());
        eprintln!("the kill hit a quiet moment: {} replayed (acknowledged {acked})", replayed.len());
    } else {
        assert_eq!(got, [2_000_000], "only live data");
        assert_eq!(server.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0), "{back}");
        eprintln!("the kill hit deliveries in flight: history_lost (acknowledged {acked})");
    }
}

// ---- SIGTERM, other instance: adoption (design step 6) --------------------------------------

/// Which of `servers` (by instance id) adopted the history: the one whose verdict came in.
fn adopter<'a>(servers: [(&'a Server, &'a str); 2]) -> usize {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        for (i, (server, id)) in servers.iter().enumerate() {
            let series = format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"confirmed\"}}");
            if server.metric(&series) == Some(1.0) {
                return i;
            }
        }
        assert!(std::time::Instant::now() < deadline, "no instance confirmed the adoption");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What [`handed_over`] leaves: Redis, the adopter and the other instance (with their ids),
/// the proxy (still aimed at the stopped A) and the client, cut off.
struct HandedOver {
    _redis: common::redis::Redis,
    adopter: Server,
    other: Server,
    adopter_id: &'static str,
    cutter: Cutter,
    client: SioClient,
    /// Redis's commands since before A stopped.
    monitor: Monitor,
}

/// Three instances on one Redis, the client on A behind the [`Cutter`], cut off; C ingests
/// 20 messages that reach A's history; A stops (SIGTERM), says goodbye and hands the history
/// over. Returns once the adopter (B or C: by the session id) has its verdict.
fn handed_over(extra: &[&str]) -> HandedOver {
    let redis = common::redis::Redis::start();
    // Each test server has a data dir of its own, where the default keeps the histories.
    let mut flags = vec!["--recovery-handoff", "true"];
    flags.extend_from_slice(extra);
    let mut a = instance_with(&redis, "a", &flags);
    let (b, c) = (instance_with(&redis, "b", &flags), instance_with(&redis, "c", &flags));
    let (cutter, client) = cut_off_a_with_a_history_from_c(&a, &c);
    let monitor = Monitor::start(redis.port);
    // The verdict is given before A leaves Redis (Cluster::leave waits for it).
    sigterm(&mut a);
    let lines = a.stderr_lines().join("\n");
    assert!(lines.contains("recovery histories handed to other instances") && lines.contains("handed=1"), "{lines}");
    let (adopter, other, adopter_id) = match adopter([(&b, "b"), (&c, "c")]) {
        0 => (b, c, "b"),
        _ => (c, b, "c"),
    };
    HandedOver { _redis: redis, adopter, other, adopter_id, cutter, client, monitor }
}

/// Issue 24, "a SIGTERM deploy where the client lands on another instance", design step 6:
/// A hands the away client's history to B (adoption), B watches its device at once, so what
/// C takes in while the client is still away lands in it; the client, back through the
/// proxy now aimed at B, recovers: every missed message once, in order (the 20 taken in
/// before A stopped and the 20 after), then live.
#[test]
fn a_sigterm_hands_the_history_to_another_instance_where_the_client_recovers() {
    let h = handed_over(&[]);
    let series = |outcome: &str| format!("hubcast_redis_adoptions_total{{instance=\"{}\",outcome=\"{outcome}\"}}", h.adopter_id);
    assert_eq!(h.adopter.metric(&series("received")), Some(1.0));
    // The other instance ingests while the client is away: the adopter watches the device.
    ingest_seen_by(&h.other, &h.adopter, json!((20..40).map(|n| message("dev-1", n)).collect::<Vec<_>>()), 20.0);
    h.cutter.retarget(h.adopter.port);
    let back = come_back(&h.cutter, &h.client);
    assert_eq!(back["recovered"], true, "{back}\n{}", h.adopter.stderr_lines().join("\n"));
    h.other.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..41).map(|_| next_n(&h.client).0).collect();
    let mut want: Vec<u64> = (0..40).collect();
    want.push(999);
    assert_eq!(got, want, "before and after A stopped, once, in order, then live");
    assert_eq!(h.adopter.metric("hubcast_recovery_replayed_frames_total"), Some(40.0));
    // A device nobody watches costs Redis nothing, through the hand-over and after: its
    // message (applied before the next is taken) is never published, the next one is.
    let published = h.monitor.count("t:device:dev-1");
    h.other.ingest(message("dev-9", 1));
    h.other.ingest(message("dev-1", 1001));
    assert_eq!(next_n(&h.client).0, 1001, "nothing twice");
    h.monitor.wait_past("t:device:dev-1", published);
    assert_eq!(h.monitor.count("dev-9"), 0, "no Redis command for an unwatched device");
}

/// The adopted pids keep their away time (wall clock, since the cut on A): a client back
/// after the window finds the adopter dropped the history, is not recovered (counted
/// `window`) and gets live data at once. The positive is shown by `handed_over` (a message
/// before the cut) and the adoption's verdict.
#[test]
fn an_adopted_history_past_the_window_is_not_recovered_and_live_data_flows() {
    let h = handed_over(&["--recovery-window", "4"]);
    // The adopter drops the history a window after the cut (an event, not a sleep).
    h.adopter.wait_for_metric("hubcast_recovery_trimmed_bytes_total{cause=\"window\"}", WAIT, Want::AtLeast(1.0));
    h.adopter.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::Eq(0.0));
    // With its history gone nobody watches the device any more; the client's socket on the
    // adopter watches it again, and the other instance publishes once it knows.
    let other_id = if h.adopter_id == "b" { "c" } else { "b" };
    let elsewhere = format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{other_id}\"}}");
    h.other.wait_for_metric(&elsewhere, WAIT, Want::Eq(0.0));
    h.cutter.retarget(h.adopter.port);
    let back = come_back(&h.cutter, &h.client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(h.adopter.metric("hubcast_recovery_failed_total{reason=\"window\"}"), Some(1.0));
    h.other.wait_for_metric(&elsewhere, WAIT, Want::Eq(1.0));
    h.other.ingest(message("dev-1", 7));
    assert_eq!(next_n(&h.client).0, 7, "live data at once, nothing of the past");
}

/// Design step 6b: the client lands on the third instance X, not the adopter: X finds the
/// adopter in `P:stream:<session>`, is handed the history (the same handshake as at the
/// SIGTERM, X adopting by name) before it answers the CONNECT, and the client recovers every
/// missed message once, in order, then live data ingested on X itself.
#[test]
fn a_client_landing_on_a_third_instance_takes_its_history_from_the_adopter() {
    let h = handed_over(&[]);
    ingest_seen_by(&h.other, &h.adopter, json!((20..40).map(|n| message("dev-1", n)).collect::<Vec<_>>()), 20.0);
    h.cutter.retarget(h.other.port);
    let back = come_back(&h.cutter, &h.client);
    assert_eq!(back["recovered"], true, "{back}\n{}\n{}", h.other.stderr_lines().join("\n"), h.adopter.stderr_lines().join("\n"));
    h.other.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..41).map(|_| next_n(&h.client).0).collect();
    let mut want: Vec<u64> = (0..40).collect();
    want.push(999);
    assert_eq!(got, want, "taken from the adopter: once, in order, then live");
    let other_id = if h.adopter_id == "b" { "c" } else { "b" };
    let series = |id: &str, outcome: &str| format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"{outcome}\"}}");
    assert_eq!(h.other.metric(&series(other_id, "confirmed")), Some(1.0));
    assert_eq!(h.adopter.metric(&series(h.adopter_id, "kept")), Some(1.0));
    // The adopter let it go: its copy and its watch of the device are gone.
    h.adopter.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::Eq(0.0));
    h.other.ingest(message("dev-1", 1001));
    assert_eq!(next_n(&h.client).0, 1001, "nothing twice");
}
