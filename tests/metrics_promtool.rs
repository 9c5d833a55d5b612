//! `GET /metrics` checked by Prometheus's own linter: `promtool check metrics` (Debian's
//! `prometheus` package, installed by scripts/operator-tools.sh) on a live scrape of a hubcast
//! that has seen every kind of traffic (REST, HTTP ingest with a fault, AMQP with two
//! partitions, a live socket), so every family, the external ones included, is rendered.

mod amqp_support;
mod common;
mod tools;

use std::collections::HashSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use amqp_support::{FakeAuth, FakeHub, NewEvent};
use common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(15);

fn scrape(server: &Server) -> String {
    let (status, body, _) = server.call("GET", "/metrics", &[ADMIN], None);
    assert_eq!(status, 200, "{body}");
    body
}

/// Scrapes until `pred` holds (metrics are read from the cores and sources as they are).
fn scrape_until(server: &Server, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let body = scrape(server);
        if pred(&body) {
            return body;
        }
        assert!(Instant::now() < deadline, "no {what} in /metrics:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn promtool_accepts_a_live_scrape_and_every_family_has_help_and_type() {
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    let cs = hub.connection_string();
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs]);
    let deadline = Instant::now() + WAIT;
    while server.call("GET", "/status", &[], None).0 != 200 {
        assert!(Instant::now() < deadline, "the AMQP source did not attach");
        std::thread::sleep(Duration::from_millis(20));
    }

    // A live socket subscribed to a device, fed once over AMQP and once over HTTP.
    let session = server.new_session();
    server.grant(&session, telemetry("metrics-dev", None));
    assert_eq!(server.subscribe(&session, with_session(&session, telemetry("metrics-dev", None))).0, 204);
    let mut live = server.live(&session);
    hub.publish("0", NewEvent::telemetry("metrics-dev", json!({"t": 1})));
    live.next_json(WAIT).expect("AMQP message delivered");
    server.ingest(json!([{"deviceId": "metrics-dev", "body": {"t": 2}}, {"deviceId": "metrics-dev", "body": [1]}]));
    live.next_json(WAIT).expect("HTTP ingest message delivered");
    server.call("GET", "/lastValue/metrics-dev", &[ADMIN], None);

    let body = scrape_until(&server, "partition lag and both deliveries", |m| {
        m.contains("hubcast_amqp_partition_lag{") && m.contains(&format!("{DELIVERY_COUNT} 2"))
    });
    assert!(body.contains("hubcast_request_duration_seconds_bucket{route=\"lastValue\",le=\"+Inf\"}"), "{body}");
    assert!(body.contains("hubcast_ingest_faults_total{kind=\"not_object\"} 1"), "{body}");
    promtool_accepts(&body);
}

/// The delivery histogram's count for plain WebSockets.
const DELIVERY_COUNT: &str = "hubcast_delivery_duration_seconds_count{transport=\"websocket\"}";

/// Every message ingested over HTTP and received on a subscribed WebSocket is observed once in
/// `hubcast_delivery_duration_seconds` (AMQP arrivals are covered by the test above), and
/// the buckets are cumulative up to that count.
#[test]
fn the_delivery_histogram_counts_every_frame_written_to_a_socket() {
    const SENT: usize = 25;
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("latency-dev", None));
    assert_eq!(server.subscribe(&session, with_session(&session, telemetry("latency-dev", None))).0, 204);
    let mut live = server.live(&session);
    assert!(!scrape(&server).contains(DELIVERY_COUNT), "no deliveries observed before any message");
    // One batch and single messages: both are stamped on arrival.
    server.ingest(json!((0..5).map(|i| json!({"deviceId": "latency-dev", "body": {"n": i}})).collect::<Vec<_>>()));
    for i in 5..SENT {
        server.ingest(json!({"deviceId": "latency-dev", "body": {"n": i}}));
    }
    for i in 0..SENT {
        let frame = live.next_json(WAIT).unwrap_or_else(|| panic!("message {i} delivered"));
        assert_eq!(frame["telemetry"]["n"], json!(i), "{frame}");
    }

    let expected = format!("{DELIVERY_COUNT} {SENT}\n");
    let body = scrape_until(&server, "the delivery count", |m| m.contains(&expected));
    let inf = format!("hubcast_delivery_duration_seconds_bucket{{transport=\"websocket\",le=\"+Inf\"}} {SENT}\n");
    assert!(body.contains(&inf), "{body}");
    let buckets: Vec<u64> = body
        .lines()
        .filter(|l| l.starts_with("hubcast_delivery_duration_seconds_bucket{transport=\"websocket\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]) && buckets.len() > 2, "cumulative buckets: {body}");
    assert!(body.contains("hubcast_delivery_duration_seconds_sum{transport=\"websocket\"} "), "{body}");
    assert!(!body.contains("hubcast_delivery_duration_seconds_count{transport=\"socketio"), "only the transport used: {body}");
    promtool_accepts(&body);
}

/// Socket.IO frames count under their own transport label: over a WebSocket when the write
/// succeeded, over long-polling when a poll's answer carried them.
#[test]
fn socket_io_deliveries_count_under_their_transport() {
    const SENT: usize = 6;
    let server = Server::start(&[]);
    let mut clients = Vec::new();
    for (transport, device) in [("websocket", "sio-ws-dev"), ("polling", "sio-poll-dev")] {
        let session = server.new_session();
        server.grant(&session, telemetry(device, None));
        assert_eq!(server.subscribe(&session, with_session(&session, telemetry(device, None))).0, 204);
        let client = server.socketio(&[&session], transport);
        client.wait_for("connect", WAIT).unwrap_or_else(|| panic!("{transport}: connect"));
        clients.push((client, device));
    }
    for i in 0..SENT {
        server.ingest(json!([{"deviceId": "sio-ws-dev", "body": {"n": i}}, {"deviceId": "sio-poll-dev", "body": {"n": i}}]));
    }
    for (client, device) in &clients {
        for i in 0..SENT {
            let e = client.wait_for("data", WAIT).unwrap_or_else(|| panic!("{device}: message {i}"));
            assert_eq!(e["data"]["deviceId"], *device, "{e}");
        }
    }
    let counts = [
        format!("hubcast_delivery_duration_seconds_count{{transport=\"socketio_websocket\"}} {SENT}\n"),
        format!("hubcast_delivery_duration_seconds_count{{transport=\"socketio_polling\"}} {SENT}\n"),
    ];
    let body = scrape_until(&server, "both Socket.IO delivery counts", |m| counts.iter().all(|c| m.contains(c)));
    assert!(!body.contains(DELIVERY_COUNT), "no plain WebSocket here: {body}");
    promtool_accepts(&body);
}

/// `promtool check metrics` finds nothing to say, and every sample has HELP and TYPE.
fn promtool_accepts(body: &str) {
    let mut promtool = Command::new(tools::on_path("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    promtool.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && report.trim().is_empty(), "promtool check metrics:\n{report}\nscrape:\n{body}");

    // promtool lints what is there; also check that no sample lacks its HELP and TYPE.
    let mut helped = HashSet::new();
    let mut typed = HashSet::new();
    for line in body.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("#"), Some("HELP"), Some(name)) => assert!(helped.insert(name.to_string()), "two HELP for {name}"),
            (Some("#"), Some("TYPE"), Some(name)) => assert!(typed.insert(name.to_string()), "two TYPE for {name}"),
            (Some(sample), Some(_), _) if !sample.starts_with('#') => {
                let name = sample.split('{').next().unwrap();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
                    .unwrap_or(name);
                assert!(helped.contains(family) && typed.contains(family), "{name} has no HELP/TYPE before it");
            }
            _ => {}
        }
    }
}
