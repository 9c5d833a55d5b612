//! AMQP positions kept with the state: after `kill -9` in the middle of a stream and a
//! restart, consumption resumes right after the last applied event (the batches handed to
//! the cores start there, from the `verbose` log). The state equals that of a fresh instance
//! that read every event once from `earliest`, and a live client gets each event once.

mod amqp_support;
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use amqp_support::{FakeAuth, FakeHub, NewEvent, Server, ADMIN};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(20);
const PARTITIONS: [&str; 2] = ["0", "1"];

fn start(hub: &FakeHub, dir: &str, extra: &[&str]) -> Server {
    let server = start_unconnected(hub, dir, extra);
    server.wait_connected();
    server
}

/// Started, not yet connected to the hub (it may refuse).
fn start_unconnected(hub: &FakeHub, dir: &str, extra: &[&str]) -> Server {
    let cs = hub.connection_string();
    let mut args = vec!["--iot-hub-event-hub-connection-string", cs.as_str(), "--data-dir", dir];
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// Event `i` of partition `p`: telemetry key `k<i>` of one of three devices, and now and
/// then a twin update (version `i`) or a connection event (sequence number `i`).
fn publish(hub: &FakeHub, from: i64, to: i64) {
    for i in from..to {
        for p in PARTITIONS {
            let device = format!("dev-{p}-{}", i % 3);
            let event = match i % 10 {
                3 => NewEvent::event(&device, "twinChangeEvents", "updateTwin",
                    json!({"version": i, "properties": {"reported": {format!("r{i}"): i}}})),
                7 => NewEvent::event(&device, "deviceConnectionStateEvents",
                    if i % 20 == 7 { "deviceDisconnected" } else { "deviceConnected" },
                    json!({"sequenceNumber": format!("{i:020X}")})),
                _ => NewEvent::telemetry(&device, json!({ format!("k{i}"): i })),
            };
            hub.publish(p, event);
        }
    }
}

fn telemetry_keys(i_to: i64, d: i64) -> usize {
    (0..i_to).filter(|i| i % 3 == d && i % 10 != 3 && i % 10 != 7).count()
}

/// Everything hubcast serves about the test devices.
fn state(server: &Server) -> Vec<(String, u16, Value)> {
    let mut out = Vec::new();
    for p in PARTITIONS {
        for d in 0..3 {
            for what in ["lastValue", "deviceTwin", "connectionState"] {
                let path = format!("/{what}/dev-{p}-{d}");
                let (status, body) = server.get_json(&path);
                out.push((path, status, body));
            }
        }
    }
    out
}

fn wait_all_applied(server: &Server, total: i64) {
    for p in PARTITIONS {
        for d in 0..3 {
            let want = telemetry_keys(total, d);
            server.wait_for(&format!("/lastValue/dev-{p}-{d}"), WAIT, |s, b| {
                s == 200 && serde_json::from_str::<Value>(b).unwrap()["data"].as_object().unwrap().len() == want
            });
        }
    }
}

fn call(server: &Server, method: &str, path: &str, headers: &[(&str, &str)], body: Value) -> (u16, String) {
    let mut req = ureq::request(method, &format!("{}{path}", server.base)).timeout(Duration::from_secs(10));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    match req.send_json(body) {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

fn metric(server: &Server, series: &str) -> i64 {
    let (_, text) = server.get("/metrics");
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0)
}

#[test]
fn kill_9_mid_stream_then_restart_applies_every_event_once() {
    let hub = FakeHub::start(&PARTITIONS, FakeAuth::Plain);
    let dir = common::TempDir::new();
    publish(&hub, 0, 300);
    // Small credit and single-message batches: the kill lands in the middle of the stream.
    let first = start(&hub, dir.path(), &["--event-hub-start-position", "earliest", "--event-hub-prefetch", "1"]);
    // A session watching one device, made before the crash.
    let (_, body) = call(&first, "POST", "/session", &[], json!({}));
    let session = serde_json::from_str::<Value>(&body).unwrap()["sessionId"].as_str().unwrap().to_string();
    let grant = json!({"sessionId": session, "deviceId": "dev-0-1", "type": "telemetry"});
    assert_eq!(call(&first, "PUT", "/grants", &[ADMIN], grant.clone()).0, 204);
    assert_eq!(call(&first, "PUT", "/subscription", &[], grant).0, 204);
    let deadline = Instant::now() + WAIT;
    while metric(&first, "hubcast_amqp_messages_received_total") < 50 {
        assert!(Instant::now() < deadline, "the stream does not flow");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(first); // kill -9 in the middle of the stream

    // More events arrive while hubcast is down; the restart says `latest`, which must not
    // apply: the stored positions win. The hub refuses at first, so that the live client is
    // connected before anything is read again.
    publish(&hub, 300, 400);
    hub.set_refusing(true);
    let second = start_unconnected(&hub, dir.path(), &["--event-hub-start-position", "latest", "--log-level", "verbose"]);
    let resumed = second.wait_for_log("resuming at the stored position", WAIT);
    assert!(resumed.contains("after_sequence_number"), "{resumed}");
    // Each partition logs its own line: wait for both (the event), then read them.
    let read_stored = || -> HashMap<String, i64> {
        second
            .stderr_lines()
            .iter()
            .filter(|l| l.contains("resuming at the stored position"))
            .filter_map(|l| {
                let value = |key: &str| l.split(&format!("{key}=")).nth(1)?.split_whitespace().next().map(|v| v.trim_matches('"').to_string());
                Some((value("partition")?, value("after_sequence_number")?.parse().ok()?))
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + WAIT;
    let mut stored = read_stored();
    while stored.len() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(25));
        stored = read_stored();
    }
    assert_eq!(stored.len(), 2, "both partitions resume from the store: {stored:?}");
    // The kill landed mid-stream: on each partition some events, not all 300, were committed.
    for p in PARTITIONS {
        assert!((0..299).contains(&stored[p]), "partition {p}: committed up to {} of 0..299 at the kill", stored[p]);
    }
    // The live client, back with its old session: every event it gets comes once, and none
    // that was committed before the crash comes again.
    let mut live = common::ws::connect(&second.base, &format!("/ws?sessionId={session}"));
    hub.set_refusing(false);
    second.wait_connected();
    publish(&hub, 400, 460);
    wait_all_applied(&second, 460);
    // Resumed exactly after the stored position: the batches handed to the cores start at
    // stored + 1 and cover every later event once, in order (no gap, no overlap).
    let batches = second.handed_over();
    for p in PARTITIONS {
        let mut next = stored[p] + 1;
        for &(count, first, last) in batches.get(p).unwrap_or_else(|| panic!("no batch for partition {p}")) {
            assert_eq!(first, next, "partition {p}: a batch starts at {first}, expected {next}: {:?}", batches[p]);
            assert_eq!(count, last - first + 1, "partition {p}: every message of the batch handed over");
            next = last + 1;
        }
        assert_eq!(next, 460, "partition {p}: handed over up to the last event");
    }
    let mut seen: HashMap<i64, usize> = HashMap::new();
    let take = |seen: &mut HashMap<i64, usize>, frame: Value| {
        for key in frame["telemetry"].as_object().into_iter().flat_map(|o| o.keys()) {
            *seen.entry(key.trim_start_matches('k').parse().unwrap()).or_default() += 1;
        }
    };
    let deadline = Instant::now() + WAIT;
    let wanted: Vec<i64> = (400..460).filter(|i| i % 3 == 1 && i % 10 != 3 && i % 10 != 7).collect();
    while !wanted.iter().all(|i| seen.contains_key(i)) {
        assert!(Instant::now() < deadline, "live client got {seen:?}");
        if let Some(frame) = live.next_json(Duration::from_millis(200)) {
            take(&mut seen, frame);
        }
    }
    // Drain what is still on its way, then check nothing came twice.
    while let Some(frame) = live.next_json(Duration::from_millis(300)) {
        take(&mut seen, frame);
    }
    let twice: Vec<_> = seen.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    let again: Vec<_> = seen.keys().filter(|&&i| i <= stored["0"]).collect();
    assert!(again.is_empty(), "committed before the kill (up to {}), delivered again: {again:?}", stored["0"]);

    // A fresh instance reading everything once from `earliest` ends in the same state.
    let fresh_dir = common::TempDir::new();
    let fresh = start(&hub, fresh_dir.path(), &["--event-hub-start-position", "earliest"]);
    wait_all_applied(&fresh, 460);
    let (restarted, once) = (state(&second), state(&fresh));
    for (a, b) in restarted.iter().zip(&once) {
        assert_eq!(a, b, "restarted vs read once from earliest");
    }
    eprintln!("stored positions at restart: {stored:?} (of 300 events per partition); live client got {} events", seen.len());
}

#[test]
fn latest_is_pinned_in_the_store_so_a_restart_before_any_event_loses_nothing() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let dir = common::TempDir::new();
    hub.publish("0", NewEvent::telemetry("pin", json!({"before": 1})));
    let first = start(&hub, dir.path(), &[]);
    // The pin is committed on every core before the partition is read.
    let deadline = Instant::now() + WAIT;
    while metric(&first, "hubcast_store_commits_total") < 2 {
        assert!(Instant::now() < deadline, "the pinned position is committed");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(first); // kill -9 before any event arrived
    hub.publish("0", NewEvent::telemetry("pin", json!({"while_down": 1})));
    let second = start(&hub, dir.path(), &[]);
    second.wait_for("/lastValue/pin/while_down", WAIT, |s, _| s == 200);
    assert_eq!(second.get("/lastValue/pin/before").0, 404, "what preceded the first start stays unread");
}

#[test]
fn a_message_without_a_sequence_number_is_applied_after_positions_are_stored() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let dir = common::TempDir::new();
    let server = start(&hub, dir.path(), &["--event-hub-start-position", "earliest"]);
    hub.publish("0", NewEvent::telemetry("nos", json!({"with_seq": 1})));
    // Sentinel: the partition is read and its position stored with the state.
    server.wait_for("/lastValue/nos/with_seq", WAIT, |s, _| s == 200);
    hub.publish("0", NewEvent::telemetry("nos", json!({"without_seq": 2})).without_sequence_number());
    hub.publish("0", NewEvent::telemetry("nos", json!({"after": 3})));
    server.wait_for("/lastValue/nos/after", WAIT, |s, _| s == 200);
    let (status, body) = server.get_json("/lastValue/nos/without_seq");
    assert_eq!(status, 200, "a message the hub sent without x-opt-sequence-number is applied: {body}");
    assert_eq!(body["data"]["without_seq"], json!(2));
    assert_eq!(metric(&server, "hubcast_amqp_messages_unsequenced_total"), 1, "counted as unordered");
}
