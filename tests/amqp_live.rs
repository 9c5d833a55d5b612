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

/// Polls `GET path` (admin key) until its JSON body satisfies `done`; the body.
fn wait_for_ok(server: &common::Server, path: &str, done: impl Fn(&Value) -> bool) -> (u16, String) {
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, body, _) = server.call("GET", path, &[common::ADMIN], None);
        if status == 200 && serde_json::from_str::<Value>(&body).is_ok_and(|v| done(&v)) {
            return (status, body);
        }
        assert!(Instant::now() < deadline, "GET {path} still {status} {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every message of a busy two-partition stream arrives intact (device id, source, enqueued
/// time, body) at a WebSocket subscriber and in lastValue / the twin; returns the counters of
/// messages read off the wire and decoded by fe2o3 (`--event-hub-read-raw`).
fn messages_arrive_intact(read_raw: &str) -> (f64, f64) {
    const N: i64 = 200;
    const T0: i64 = 1_704_067_200_000; // 2024-01-01T00:00:00Z
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    let server = gateway(&hub, &["--event-hub-read-raw", read_raw]);
    let session = subscribed(&server, "w-0", &[json!({"type": "d2cMessages"})]);
    let mut live = server.live(&session);
    let body = |i: i64| json!({ "n": i, "text": "x".repeat(i as usize) });
    for i in 0..N {
        let event = NewEvent::telemetry(&format!("w-{}", i % 4), body(i)).enqueued_at(T0 + i);
        hub.publish(&(i % 2).to_string(), event);
    }
    let twin = json!({"deviceId": "w-1", "version": 2, "properties": {"reported": {"fw": "2.0"}, "desired": {}}});
    hub.publish("1", NewEvent::event("w-1", "twinChangeEvents", "replaceTwin", twin));
    // Larger than the connection's 64 KiB frames: a multi-frame transfer (joined by the tap).
    let big = "y".repeat(100_000);
    hub.publish("0", NewEvent::telemetry("w-big", json!({ "big": big })));

    let mut seen = Vec::new();
    while seen.len() < (N / 4) as usize {
        let frame = live.next_json(WAIT).expect("a d2c frame");
        assert_eq!(frame["deviceId"], json!("w-0"), "{frame}");
        seen.push(frame["message"].clone());
    }
    assert_eq!(seen, (0..N).filter(|i| i % 4 == 0).map(body).collect::<Vec<_>>(), "every message once, in order, intact");
    for d in 0..4 {
        let last = N - 4 + d;
        let (_, text) = wait_for_ok(&server, &format!("/lastValue/w-{d}/n"), |v| v["data"]["n"] == json!(last));
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["timestamp"], json!(format!("2024-01-01T00:00:00.{last:03}Z")), "the hub's enqueued time: {v}");
    }
    wait_for_ok(&server, "/deviceTwin/w-1", |v| v["data"]["properties"]["reported"]["fw"] == json!("2.0"));
    wait_for_ok(&server, "/lastValue/w-big/big", |v| v["data"]["big"].as_str().map(str::len) == Some(100_000));
    let received = server.metric("hubcast_amqp_messages_received_total").unwrap();
    assert_eq!(received, (N + 2) as f64);
    let raw = server.metric("hubcast_amqp_raw_reads_total").expect("the raw read counter");
    let decoded = server.metric("hubcast_amqp_decoded_reads_total").expect("the decoded read counter");
    assert_eq!(raw + decoded, received);
    (raw, decoded)
}

#[test]
fn messages_read_off_the_wire_arrive_intact() {
    // Every message read from its bytes, the multi-frame one too: fe2o3 sees none of them.
    assert_eq!(messages_arrive_intact("true"), ((200 + 2) as f64, 0.0));
}

#[test]
fn messages_decoded_by_fe2o3_arrive_intact() {
    assert_eq!(messages_arrive_intact("false"), (0.0, (200 + 2) as f64));
}

/// A partition link the hub detaches with an error: hubcast logs the hub's reason (fe2o3's
/// error, also when the tap serves the link), reconnects and reads on.
#[test]
fn a_partition_link_detached_with_an_error_logs_the_reason_and_reconnects() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = gateway(&hub, &[]);
    hub.publish("0", NewEvent::telemetry("stolen-1", json!({"n": 1})));
    wait_for_ok(&server, "/lastValue/stolen-1/n", |v| v["data"]["n"] == json!(1));
    hub.detach_partition_links(1, "receiver epoch 7 took the partition");
    let line = server
        .wait_for_stderr(WAIT, |l| l.contains("receiver epoch 7 took the partition"))
        .unwrap_or_else(|| panic!("no log line names the hub's reason: {:?}", server.stderr_lines()));
    assert!(line.contains("WARN") && line.contains("partition 0"), "{line}");
    hub.publish("0", NewEvent::telemetry("stolen-1", json!({"n": 2})));
    wait_for_ok(&server, "/lastValue/stolen-1/n", |v| v["data"]["n"] == json!(2));
}

/// The queue between the event stream and a core is bounded in bytes
/// (`--event-hub-queue-bytes`), not only in batches: while the core is blocked, messages of
/// 16 KiB stop crossing once 256 KiB of them wait (the partition stops granting credit and
/// the broker waits), where 64 batches would hold all 120; once the core is back every
/// message reaches the subscriber once and in order. Fails without the byte bound: all 120
/// cross while the core is blocked.
#[test]
fn a_blocked_core_holds_the_stream_back_at_its_queue_bytes_and_loses_nothing() {
    const STALL_MS: u64 = 6000;
    const N: i64 = 120;
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let bound = ["--cores", "1", "--event-hub-queue-bytes", "262144", "--event-hub-prefetch", "8", "--event-hub-linger-ms", "0"];
    let server = gateway(&hub, &bound);
    // d2c messages: never conflated on a slow socket (telemetry would be, by design).
    let session = subscribed(&server, "big", &[json!({"type": "d2cMessages"})]);
    let mut live = server.live(&session);
    // A message crosses while the core keeps up.
    hub.publish("0", NewEvent::telemetry("big", json!({"n": 0})));
    let first = live.next_json(WAIT).expect("the first message reaches the socket");
    assert_eq!(first["message"]["n"], 0);

    let url = server.url("");
    let stall = std::thread::spawn(move || {
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_millis(STALL_MS) + WAIT).build();
        let answer = agent.post(&format!("{url}/_debug/stall?core=0&ms={STALL_MS}")).set(common::ADMIN.0, common::ADMIN.1).call();
        answer.map(|r| r.status()).map_err(|e| e.to_string())
    });
    assert!(server.wait_for_stderr(WAIT, |l| l.contains("debug: blocking a core")).is_some(), "the core is blocked");
    let blocked = Instant::now();
    let before = hub.stats().deliveries;
    let pad = "x".repeat(16 << 10);
    for n in 1..=N {
        hub.publish("0", NewEvent::telemetry("big", json!({"n": n, "pad": pad})));
    }
    // Read until all crossed (the failure) or shortly before the core is back.
    let deadline = blocked + Duration::from_millis(STALL_MS - 2000);
    let crossed = loop {
        let crossed = hub.stats().deliveries - before;
        if crossed >= N as usize || Instant::now() >= deadline {
            break crossed;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Still blocked when read: the stall is answered only once the core is back (one core),
    // and its answer has not come (an event; before, the wall time since the stall's log
    // line was read, which a loaded machine can read late).
    assert!(!stall.is_finished(), "the core was no longer blocked when the crossings were read ({:?})", blocked.elapsed());
    // 256 KiB hold 15 messages of 16 KiB; the partition holds its credit (8) and one batch.
    assert!((8..=40).contains(&crossed), "{crossed} of {N} messages crossed while the core was blocked");

    // The core is back: everything arrives, once, in order.
    assert_eq!(stall.join().unwrap(), Ok(204));
    let mut seen = Vec::new();
    while seen.last() != Some(&N) {
        let frame = live.next_json(WAIT).unwrap_or_else(|| panic!("every message arrives after the stall; got {seen:?}"));
        seen.push(frame["message"]["n"].as_i64().expect("n"));
    }
    assert_eq!(seen, (1..=N).collect::<Vec<_>>(), "once each, in order");
    let held = server.wait_for_metric("hubcast_core_queue_bytes{core=\"0\",queue=\"ingress\"}", WAIT, common::Want::Eq(0.0));
    assert_eq!(held, 0.0, "nothing held once applied");
}
