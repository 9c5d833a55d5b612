//! From the event stream to a live WebSocket client: what a subscriber sees of AMQP input,
//! including every message exactly once across a reconnect in the middle of the stream, and
//! how messages are handed to the cores (`--event-hub-linger-ms`): a busy stream in few large
//! batches, a lone message without waiting for company.

mod amqp_support;
mod common;

use std::time::{Duration, Instant};

use amqp_support::{FakeAuth, FakeHub, NewEvent};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

fn gateway(hub: &FakeHub, extra: &[&str]) -> common::Server {
    let cs = hub.connection_string();
    let mut args = vec!["--iot-hub-event-hub-connection-string", cs.as_str()];
    args.extend_from_slice(extra);
    let server = common::Server::start(&args);
    wait_status(&server, 200);
    server
}

fn wait_status(server: &common::Server, want: u16) {
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, body, _) = server.call("GET", "/status", &[], None);
        if status == want {
            return;
        }
        assert!(Instant::now() < deadline, "GET /status still {status} {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn subscribed(server: &common::Server, device: &str, kinds: &[Value]) -> String {
    let session = server.new_session();
    for kind in kinds {
        let mut request = kind.clone();
        request["deviceId"] = json!(device);
        server.grant(&session, request.clone());
        let (status, body) = server.subscribe(&session, request);
        assert_eq!(status, 204, "{body}");
    }
    session
}

#[test]
fn d2c_subscribers_get_json_bodies_as_sent_and_other_bodies_as_base64() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = gateway(&hub, &[]);
    let session = subscribed(&server, "d2c", &[json!({"type": "d2cMessages"})]);
    let mut live = server.live(&session);
    hub.publish("0", NewEvent::telemetry("d2c", json!({"t": 1})));
    hub.publish("0", NewEvent::telemetry("d2c", json!([1, 2])));
    hub.publish("0", NewEvent::telemetry("d2c", json!(null)).raw_body(b"\x00\xffbinary"));
    let mut messages = Vec::new();
    while messages.len() < 3 {
        let frame = live.next_json(WAIT).expect("a d2c frame");
        messages.push(frame["message"].clone());
    }
    assert_eq!(messages, vec![json!({"t": 1}), json!([1, 2]), json!({"base64": "AP9iaW5hcnk="})]);
}

#[test]
fn a_live_client_sees_every_message_once_across_a_reconnect() {
    every_message_once_across_a_reconnect(&["--event-hub-prefetch", "16"]);
}

#[test]
fn a_live_client_sees_every_message_once_across_a_reconnect_while_partitions_linger() {
    // A linger far longer than the run: every batch but the first is held until the credit
    // bound (half of 16) ends it, and the connection drops while messages are held.
    every_message_once_across_a_reconnect(&["--event-hub-prefetch", "16", "--event-hub-linger-ms", "1000"]);
}

fn every_message_once_across_a_reconnect(args: &[&str]) {
    const N: i64 = 300;
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    let server = gateway(&hub, args);
    let session = subscribed(&server, "counter", &[json!({"type": "telemetry", "telemetryKey": "n"})]);
    let mut live = server.live(&session);
    hub.drop_after(N as usize / 2);
    for i in 0..N {
        hub.publish("0", NewEvent::telemetry("counter", json!({ "n": i })));
    }
    let mut seen = Vec::new();
    let deadline = Instant::now() + WAIT;
    while (seen.len() as i64) < N && Instant::now() < deadline {
        if let Some(frame) = live.next_json(Duration::from_millis(500)) {
            seen.push(frame["telemetry"]["n"].as_i64().expect("a counter"));
        }
    }
    // Nothing more arrives: no late duplicate.
    assert!(live.next_json(Duration::from_millis(300)).is_none(), "a frame after all {N}");
    assert_eq!(seen, (0..N).collect::<Vec<_>>(), "every message exactly once, in order");
    assert!(hub.stats().connections >= 2, "the connection was dropped mid-stream: {:?}", hub.stats());
}

/// Waits for `n` telemetry frames carrying the counter `n`; returns the counters in arrival order.
fn counters(live: &mut common::ws::Live, n: usize) -> Vec<i64> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + WAIT;
    while seen.len() < n && Instant::now() < deadline {
        if let Some(frame) = live.next_json(Duration::from_millis(500)) {
            seen.push(frame["telemetry"]["n"].as_i64().expect("a counter"));
        }
    }
    seen
}

#[test]
fn a_busy_stream_is_handed_to_the_cores_in_few_large_batches() {
    const N: i64 = 300;
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    // A linger long enough that the pacing below keeps the stream busy on any machine.
    let server = gateway(&hub, &["--event-hub-linger-ms", "200"]);
    let session = subscribed(&server, "busy", &[json!({"type": "telemetry", "telemetryKey": "n"})]);
    let mut live = server.live(&session);
    let before = server.metric("hubcast_amqp_handoffs_total").expect("the hand-off counter");
    // One message about every millisecond: without a linger the consumer, idle between
    // messages, hands over each one alone (N hand-offs).
    for i in 0..N {
        hub.publish("0", NewEvent::telemetry("busy", json!({ "n": i })));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(counters(&mut live, N as usize), (0..N).collect::<Vec<_>>(), "every message once, in order");
    let handoffs = server.metric("hubcast_amqp_handoffs_total").expect("the hand-off counter") - before;
    assert!(handoffs >= 1.0 && handoffs < (N / 10) as f64, "{N} messages in {handoffs} hand-offs");
    assert_eq!(server.metric("hubcast_amqp_messages_received_total"), Some(N as f64));
}

#[test]
fn a_lone_message_is_handed_over_without_waiting_for_more() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    // The longest linger: a lone message must still arrive (nothing else ever comes).
    let server = gateway(&hub, &["--event-hub-linger-ms", "1000"]);
    let session = subscribed(&server, "lone", &[json!({"type": "telemetry", "telemetryKey": "n"})]);
    let mut live = server.live(&session);
    // On a quiet stream, then right after a hand-off (a linger that ends with no company).
    for i in 0..2 {
        hub.publish("0", NewEvent::telemetry("lone", json!({ "n": i })));
        assert_eq!(counters(&mut live, 1), vec![i], "message {i} arrives");
    }
    assert_eq!(server.metric("hubcast_amqp_handoffs_total"), Some(2.0), "one hand-off per lone message");
}
