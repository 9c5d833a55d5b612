//! Live push to the real `socket.io-client` (npm), over WebSocket and over HTTP long-polling,
//! the way ux4iot's React hooks connect.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(5);

fn session_with(server: &Server, device: &str, kinds: &[&str]) -> String {
    let session = server.new_session();
    for kind in kinds {
        server.grant(&session, json!({"type": kind, "deviceId": device}));
        let (status, body) = server.subscribe(&session, json!({"type": kind, "deviceId": device}));
        assert_eq!(status, 204, "{body}");
    }
    session
}

fn data_after_connect(server: &Server, transports: &str) {
    let session = session_with(server, "dev-1", &["telemetry", "connectionState", "deviceTwin", "d2cMessages"]);
    let client = server.socketio(&[&session], transports);
    let connected = client.wait_for("connect", WAIT).expect("connect");
    assert_eq!(connected["transport"], transports.split(',').next().unwrap());
    server.ingest(json!([
        {"deviceId": "dev-1", "body": {"temperature": 20.5, "on": false}},
        {"deviceId": "dev-1", "source": "twinChangeEvents", "properties": {"opType": "replaceTwin"},
         "body": {"version": 3, "properties": {"reported": {"fw": "2"}}}}
    ]));
    let mut seen: Vec<Value> = Vec::new();
    while seen.len() < 4 {
        let e = client.wait_for("data", WAIT).unwrap_or_else(|| panic!("4 data events, got {seen:?}"));
        seen.push(e["data"].clone());
    }
    let find = |key: &str| seen.iter().find(|d| d.get(key).is_some()).unwrap_or_else(|| panic!("{key} in {seen:?}"));
    assert_eq!(find("telemetry")["telemetry"], json!({"temperature": 20.5, "on": false}));
    assert_eq!(find("connectionState")["connectionState"], json!(true));
    assert_eq!(find("deviceTwin")["deviceTwin"]["properties"]["reported"]["fw"], "2");
    assert_eq!(find("message")["message"], json!({"temperature": 20.5, "on": false}));
    for d in &seen {
        assert_eq!(d["deviceId"], "dev-1");
        assert!(parse_utc_millis(d["timestamp"].as_str().unwrap()).is_some());
    }
}

#[test]
fn socketio_over_websocket_gets_every_kind() {
    let server = Server::start(&[]);
    data_after_connect(&server, "websocket");
}

#[test]
fn socketio_over_polling_gets_every_kind() {
    let server = Server::start(&[]);
    data_after_connect(&server, "polling");
}

#[test]
fn socketio_polling_upgrades_to_websocket_and_keeps_delivering() {
    let server = Server::start(&[]);
    let session = session_with(&server, "dev-1", &["telemetry"]);
    let client = server.socketio(&[&session], "polling,websocket");
    // The upgrade may complete before or after the Socket.IO connect; both must happen.
    let first_two: Vec<Value> = (0..2).map(|_| client.next(WAIT).expect("connect and upgrade")).collect();
    assert!(first_two.iter().any(|e| e["event"] == "connect"), "{first_two:?}");
    let upgrade = first_two.iter().find(|e| e["event"] == "upgrade").expect("an upgrade");
    assert_eq!(upgrade["transport"], "websocket");
    for n in 0..5 {
        server.ingest(json!({"deviceId": "dev-1", "body": {"n": n}}));
        let e = client.wait_for("data", WAIT).expect("data after the upgrade");
        assert_eq!(e["data"]["telemetry"], json!({"n": n}));
    }
}

#[test]
fn unknown_session_gets_a_connect_error() {
    let server = Server::start(&[]);
    for transports in ["websocket", "polling"] {
        let client = server.socketio(&["AAAAAAAAAAAAAAAAAAAAAA"], transports);
        let e = client.wait_for("connect_error", WAIT).expect("connect_error");
        assert!(e["message"].as_str().unwrap().contains("session"), "{e}");
    }
}

#[test]
fn deleting_the_session_disconnects_the_client() {
    let server = Server::start(&[]);
    let session = session_with(&server, "dev-1", &["telemetry"]);
    let client = server.socketio(&[&session], "websocket");
    client.wait_for("connect", WAIT).expect("connect");
    let (status, _, _) = server.call("DELETE", &format!("/sessions/{session}"), &[ADMIN], None);
    assert_eq!(status, 204);
    assert!(client.wait_for("disconnect", WAIT).is_some());
}

#[test]
fn pings_keep_an_idle_socket_open() {
    let server = Server::start(&["--ping-interval", "300", "--ping-timeout", "300"]);
    let session = session_with(&server, "dev-1", &["telemetry"]);
    for transports in ["websocket", "polling"] {
        let client = server.socketio(&[&session], transports);
        client.wait_for("connect", WAIT).expect("connect");
        let events = client.collect(Duration::from_millis(2000));
        assert!(events.iter().all(|e| e["event"] != "disconnect"), "{transports}: {events:?}");
        server.ingest(json!({"deviceId": "dev-1", "body": {"alive": true}}));
        assert!(client.wait_for("data", WAIT).is_some(), "{transports}: still delivering");
    }
}
