//! Where the stream starts (latest, earliest, an enqueued time) and how it resumes after the
//! connection drops: every message delivered to the cores exactly once.

mod amqp_support;

use std::time::Duration;

use amqp_support::{FakeAuth, FakeHub, NewEvent, Server};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn latest_reads_only_what_is_enqueued_after_connecting() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    hub.publish("0", NewEvent::telemetry("l", json!({"before": 1})));
    let server = Server::reading(&hub, &[]);
    hub.publish("0", NewEvent::telemetry("l", json!({"after": 1})));
    server.wait_for("/lastValue/l/after", WAIT, |s, _| s == 200);
    assert_eq!(server.get("/lastValue/l/before").0, 404);
}

#[test]
fn earliest_reads_everything_retained() {
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    hub.publish("0", NewEvent::telemetry("e", json!({"a": 1})));
    hub.publish("1", NewEvent::telemetry("e", json!({"b": 1})));
    let server = Server::reading(&hub, &["--event-hub-start-position", "earliest"]);
    server.wait_for("/lastValue/e/a", WAIT, |s, _| s == 200);
    server.wait_for("/lastValue/e/b", WAIT, |s, _| s == 200);
    assert!(hub.stats().partition_links.iter().all(|(_, f)| f == "amqp.annotation.x-opt-offset > '-1'"));
}

#[test]
fn an_enqueued_time_start_skips_older_messages() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    hub.publish("0", NewEvent::telemetry("t", json!({"old": 1})).enqueued_at(1_704_067_200_000)); // 2024-01-01
    hub.publish("0", NewEvent::telemetry("t", json!({"new": 1})).enqueued_at(1_717_200_000_000)); // 2024-06-01
    let server = Server::reading(&hub, &["--event-hub-start-position", "2024-03-01T00:00:00Z"]);
    server.wait_for("/lastValue/t/new", WAIT, |s, _| s == 200);
    assert_eq!(server.get("/lastValue/t/old").0, 404);
}

#[test]
fn an_invalid_start_position_stops_start_up_naming_the_option() {
    let out = std::process::Command::new(amqp_support::BIN)
        .args(["--port", "0", "--event-hub-start-position", "yesterday"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--event-hub-start-position") && err.contains("yesterday"), "{err}");
}

#[test]
fn a_reconnect_mid_stream_delivers_every_message_exactly_once() {
    const PER_PARTITION: i64 = 300;
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    // Small credit, so that the drop happens with messages in flight.
    let server = Server::reading(&hub, &["--event-hub-prefetch", "16"]);

    // Each message is one telemetry key of one of four devices: every key must arrive.
    let publish = |from: i64, to: i64| {
        for i in from..to {
            for p in ["0", "1"] {
                let device = format!("dev-{p}-{}", i % 2);
                hub.publish(p, NewEvent::telemetry(&device, json!({ format!("k{i}"): i })));
            }
        }
    };
    hub.drop_after(170);
    publish(0, 200);
    // The connection drops mid-stream; while it is down, more messages arrive, also on a
    // partition whose receiver had not got anything yet after the drop.
    server.wait_for("/status", WAIT, |s, _| s == 503);
    hub.set_refusing(true);
    publish(200, PER_PARTITION);
    // It tried to reconnect and was refused: still not connected.
    let refused = hub.stats().refused;
    hub.wait_for_stats(WAIT, |s| s.refused > refused);
    let (status, body) = server.get("/status");
    assert_eq!(status, 503, "not connected while the hub refuses: {body}");
    hub.set_refusing(false);
    server.wait_connected();

    for p in ["0", "1"] {
        for d in 0..2 {
            let device = format!("dev-{p}-{d}");
            let path = format!("/lastValue/{device}");
            let (_, body) = server.wait_for(&path, WAIT, |s, b| {
                s == 200 && serde_json::from_str::<serde_json::Value>(b).unwrap()["data"].as_object().unwrap().len() as i64 == PER_PARTITION / 2
            });
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            for i in (d..PER_PARTITION).step_by(2) {
                assert_eq!(v["data"][format!("k{i}")]["value"], json!(i), "{device} k{i}");
            }
        }
    }

    // Exactly once: the batches handed to the cores cover each partition's sequence numbers
    // 0..PER_PARTITION, in order, without a gap or an overlap.
    let batches = server.handed_over();
    for p in ["0", "1"] {
        let mut next = 0;
        let mut total = 0;
        for &(count, first, last) in batches.get(p).unwrap_or_else(|| panic!("no batch for {p}")) {
            assert_eq!(first, next, "partition {p}: batch starts at {first}, expected {next}: {batches:?}");
            assert_eq!(count, last - first + 1, "partition {p}: every message of the batch handed over");
            next = last + 1;
            total += count;
        }
        assert_eq!((next, total), (PER_PARTITION, PER_PARTITION), "partition {p}");
    }
    let stats = hub.stats();
    if std::env::var_os("SHOW_LOG").is_some() {
        eprintln!("{stats:?}\n{batches:?}\n{}", server.stderr_lines().iter().filter(|l| !l.contains("handed")).cloned().collect::<Vec<_>>().join("\n"));
    }
    assert!(stats.connections >= 2, "it reconnected: {stats:?}");
    let resumed: Vec<_> = stats.partition_links.iter().skip(2).map(|(_, f)| f.clone()).collect();
    assert!(
        resumed.iter().all(|f| f.starts_with("amqp.annotation.x-opt-sequence-number > ")),
        "resumed after the last sequence number: {resumed:?}"
    );
}

#[test]
fn messages_the_broker_sends_again_after_a_reconnect_are_skipped() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &["--event-hub-start-position", "earliest"]);
    for i in 0..10 {
        hub.publish("0", NewEvent::telemetry("r", json!({ "n": i })));
    }
    server.wait_for("/lastValue/r/n", WAIT, |s, b| s == 200 && b.contains(r#""n":9"#));
    hub.replay_everything(true);
    hub.drop_connections();
    server.wait_for_log("already delivered", WAIT);
    hub.publish("0", NewEvent::telemetry("r", json!({ "n": 10 })));
    server.wait_for("/lastValue/r/n", WAIT, |s, b| s == 200 && b.contains(r#""n":10"#));
    let batches = server.handed_over();
    let handed: Vec<i64> = batches["0"].iter().filter(|(n, _, _)| *n > 0).flat_map(|&(_, a, b)| a..=b).collect();
    assert_eq!(handed, (0..=10).collect::<Vec<_>>(), "each message handed over once: {batches:?}");
}

#[test]
fn the_broker_sends_no_more_than_the_link_credit_while_hubcast_takes_nothing() {
    const PREFETCH: usize = 16;
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &["--event-hub-prefetch", "16"]);
    server.freeze(true);
    for i in 0..200 {
        hub.publish("0", NewEvent::telemetry("slow", json!({ format!("k{i}"): i })));
    }
    // The event: the fake's sender waits for credit, after what the credit let through.
    let stats = hub.wait_for_stats(WAIT, |s| s.sends_waiting > 0);
    let sent = stats.deliveries;
    server.freeze(false);
    assert!(sent > 0 && sent <= PREFETCH, "{sent} messages sent to a gateway that accepted none (credit {PREFETCH}): {stats:?}");
    server.wait_for("/lastValue/slow", WAIT, |s, b| {
        s == 200 && serde_json::from_str::<serde_json::Value>(b).unwrap()["data"].as_object().unwrap().len() == 200
    });
}
