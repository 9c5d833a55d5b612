//! `GET /metrics`: Prometheus text, summed over every core.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
        .parse()
        .unwrap()
}

#[test]
fn metrics_need_the_admin_key_unless_open() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("GET", "/metrics", &[], None);
    assert_error(status, &body, 401, "Unauthorized");
    let open = Server::start(&["--metrics-open"]);
    let (status, body, headers) = open.call("GET", "/metrics", &[], None);
    assert_eq!(status, 200);
    assert!(headers.get("content-type").unwrap().starts_with("text/plain"));
    assert!(body.contains("# TYPE hubcast_messages_in_total counter"));
}

#[test]
fn metrics_count_what_happened_on_every_core() {
    let server = Server::start(&[]);
    let session = server.new_session();
    for i in 0..4 {
        let device = format!("m-{i}");
        server.grant(&session, json!({"type": "telemetry", "deviceId": device}));
        let (status, _) = server.subscribe(&session, json!({"type": "telemetry", "deviceId": device}));
        assert_eq!(status, 204);
    }
    let mut live = server.live(&session);
    let batch: Vec<_> = (0..4).map(|i| json!({"deviceId": format!("m-{i}"), "body": {"v": i}})).collect();
    server.ingest(json!(batch));
    server.ingest(json!({"deviceId": "m-0", "source": "twinChangeEvents", "properties": {"opType": "replaceTwin"}, "body": {"version": 1}}));
    for _ in 0..4 {
        live.next_json(Duration::from_secs(3)).expect("frame");
    }
    let (status, text, _) = server.call("GET", "/metrics", &[ADMIN], None);
    assert_eq!(status, 200);
    assert_eq!(value(&text, "hubcast_messages_in_total{source=\"Telemetry\"}"), 4.0);
    assert_eq!(value(&text, "hubcast_messages_in_total{source=\"twinChangeEvents\"}"), 1.0);
    assert_eq!(value(&text, "hubcast_messages_out_total{transport=\"websocket\"}"), 4.0);
    assert_eq!(value(&text, "hubcast_sockets{transport=\"websocket\"}"), 1.0);
    assert_eq!(value(&text, "hubcast_sessions"), 1.0);
    assert_eq!(value(&text, "hubcast_devices"), 4.0);
    assert_eq!(value(&text, "hubcast_grants"), 4.0);
    assert_eq!(value(&text, "hubcast_subscriptions"), 4.0);
    assert_eq!(value(&text, "hubcast_request_duration_seconds_count{route=\"ingest\"}"), 2.0);
    assert_eq!(value(&text, "hubcast_request_duration_seconds_count{route=\"grants\"}"), 4.0);
    for core in 0..2 {
        value(&text, &format!("hubcast_core_queue_depth{{core=\"{core}\",queue=\"inbox\"}}"));
    }
    drop(live);
}

/// Frames per write: every frame a WebSocket writer sends is counted with the write that
/// carried it, so `frames_written / writes` is the coalescing the writers achieve.
#[test]
fn socket_writes_and_frames_written_are_counted() {
    const N: usize = 200;
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, json!({"type": "telemetry", "deviceId": "w-1"}));
    let (status, _) = server.subscribe(&session, json!({"type": "telemetry", "deviceId": "w-1"}));
    assert_eq!(status, 204);
    let mut live = server.live(&session);
    // Below the soft queue limit (256): nothing is conflated, all N arrive.
    let batch: Vec<_> = (0..N).map(|i| json!({"deviceId": "w-1", "body": {"v": i}})).collect();
    server.ingest(json!(batch));
    for i in 0..N {
        let frame = live.next_json(Duration::from_secs(5)).unwrap_or_else(|| panic!("frame {i} of {N}"));
        assert_eq!(frame["telemetry"]["v"], i);
    }
    let frames_series = "hubcast_socket_frames_written_total{transport=\"websocket\"}";
    let frames = server.wait_for_metric(frames_series, Duration::from_secs(5), Want::AtLeast(N as f64));
    let writes = server.metric("hubcast_socket_writes_total{transport=\"websocket\"}").unwrap();
    assert!(writes >= 1.0 && writes <= frames, "{writes} writes for {frames} frames");
    assert_eq!(server.metric("hubcast_socket_writes_total{transport=\"socketio_websocket\"}"), Some(0.0));
    drop(live);
}
