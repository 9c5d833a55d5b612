//! Ingest from a local Event Hubs-like AMQP endpoint: every message source, plain Event Hub
//! input, faulty messages, SASL PLAIN and CBS, the IoT Hub redirect, and the status page.

mod amqp_support;

use std::time::Duration;

use amqp_support::{FakeAuth, FakeHub, NewEvent, Server};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn telemetry_from_iot_hub_annotations_becomes_last_values() {
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    let server = Server::reading(&hub, &[]);
    hub.publish("0", NewEvent::telemetry("pump-1", json!({"pressure": 4.2, "running": true})));
    hub.publish("1", NewEvent::telemetry("pump-2", json!({"pressure": 1.5})));
    let (_, body) = server.wait_for("/lastValue/pump-1/pressure", WAIT, |s, _| s == 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"], json!({"pressure": 4.2}));
    server.wait_for("/lastValue/pump-2/pressure", WAIT, |s, _| s == 200);
    let (status, v) = server.get_json("/connectionState/pump-1");
    assert_eq!((status, &v["data"]), (200, &json!(true)), "telemetry means connected");
    let stats = hub.stats();
    assert_eq!(stats.partition_links.len(), 2, "one receiver per partition: {stats:?}");
    assert!(stats.partition_links.iter().all(|(a, _)| a.contains("/ConsumerGroups/$Default/Partitions/")));
}

#[test]
fn twin_change_events_replace_then_merge_the_twin() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &[]);
    let full = json!({"deviceId": "d1", "version": 3, "properties": {"reported": {"fw": "1.0", "mode": "eco"}, "desired": {}}});
    hub.publish("0", NewEvent::event("d1", "twinChangeEvents", "replaceTwin", full));
    let patch = json!({"version": 4, "properties": {"reported": {"fw": "1.1", "mode": null}}});
    hub.publish("0", NewEvent::event("d1", "twinChangeEvents", "updateTwin", patch));
    let (_, body) = server.wait_for("/deviceTwin/d1", WAIT, |s, b| s == 200 && b.contains("1.1"));
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"]["version"], json!(4));
    assert_eq!(v["data"]["properties"]["reported"], json!({"fw": "1.1"}), "updateTwin is merged, null deletes");
}

#[test]
fn connection_state_events_set_the_state_and_stale_ones_are_dropped() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &[]);
    let seq = |n: u32| json!({"sequenceNumber": format!("{n:064X}")});
    hub.publish("0", NewEvent::event("d2", "deviceConnectionStateEvents", "deviceConnected", seq(5)));
    server.wait_for("/connectionState/d2", WAIT, |s, b| s == 200 && b.contains("true"));
    hub.publish("0", NewEvent::event("d2", "deviceConnectionStateEvents", "deviceDisconnected", seq(7)));
    server.wait_for("/connectionState/d2", WAIT, |s, b| s == 200 && b.contains("false"));
    // A late "connected" with an older sequence number changes nothing; a marker after it
    // proves it was processed.
    hub.publish("0", NewEvent::event("d2", "deviceConnectionStateEvents", "deviceConnected", seq(6)));
    hub.publish("0", NewEvent::event("marker", "twinChangeEvents", "replaceTwin", json!({"version": 1})));
    server.wait_for("/deviceTwin/marker", WAIT, |s, _| s == 200);
    let (_, v) = server.get_json("/connectionState/d2");
    assert_eq!(v["data"], json!(false));
}

#[test]
fn lifecycle_delete_removes_the_cached_device() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &[]);
    hub.publish("0", NewEvent::telemetry("gone", json!({"t": 1})));
    hub.publish("0", NewEvent::event("gone", "twinChangeEvents", "replaceTwin", json!({"version": 1})));
    server.wait_for("/deviceTwin/gone", WAIT, |s, _| s == 200);
    server.wait_for("/lastValue/gone", WAIT, |s, _| s == 200);
    hub.publish("0", NewEvent::event("gone", "deviceLifecycleEvents", "deleteDeviceIdentity", json!({"deviceId": "gone"})));
    server.wait_for("/lastValue/gone", WAIT, |s, _| s == 404);
    assert_eq!(server.get("/deviceTwin/gone").0, 404);
    assert_eq!(server.get("/connectionState/gone").0, 404);
}

#[test]
fn plain_event_hub_messages_name_the_device_in_properties_or_the_body() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &["--custom-device-id-key", "dev"]);
    hub.publish(
        "0",
        NewEvent::plain(br#"{"level": 3}"#).prop("iothub-connection-device-id", "tank-1").prop("iothub-message-schema", "Telemetry"),
    );
    hub.publish("0", NewEvent::plain(br#"{"dev": "tank-2", "level": 9}"#));
    server.wait_for("/lastValue/tank-1/level", WAIT, |s, _| s == 200);
    server.wait_for("/lastValue/tank-2/level", WAIT, |s, _| s == 200);
    let (_, all) = server.get_json("/lastValue/tank-2");
    assert!(all["data"].get("dev").is_none(), "the device id key is not telemetry: {all}");
}

#[test]
fn timestamps_follow_the_reference_order() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &[]);
    let enqueued = amqp_support::now_millis() - 60_000;
    // 1. the body's customTimestampKey
    hub.publish("0", NewEvent::telemetry("ts", json!({"a": 1, "_ts": "2024-01-01T00:00:01.000Z"})).enqueued_at(enqueued));
    // 2. iothub-creation-time-utc
    hub.publish(
        "0",
        NewEvent::telemetry("ts", json!({"b": 1})).prop("iothub-creation-time-utc", "2024-01-01T00:00:02.000Z").enqueued_at(enqueued),
    );
    // 3. iothub-app-iothub-creation-time-utc
    hub.publish(
        "0",
        NewEvent::telemetry("ts", json!({"c": 1}))
            .prop("iothub-app-iothub-creation-time-utc", "2024-01-01T00:00:03.000Z")
            .enqueued_at(enqueued),
    );
    // 4. the hub's enqueued time
    hub.publish("0", NewEvent::telemetry("ts", json!({"d": 1})).enqueued_at(1_704_067_204_000));
    server.wait_for("/lastValue/ts/d", WAIT, |s, _| s == 200);
    let time = |key: &str| server.get_json(&format!("/lastValue/ts/{key}")).1["timestamp"].as_str().unwrap().to_string();
    assert_eq!(time("a"), "2024-01-01T00:00:01.000Z");
    assert_eq!(time("b"), "2024-01-01T00:00:02.000Z");
    assert_eq!(time("c"), "2024-01-01T00:00:03.000Z");
    assert_eq!(time("d"), "2024-01-01T00:00:04.000Z");
}

#[test]
fn faulty_messages_are_counted_logged_once_per_kind_and_skipped() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let server = Server::reading(&hub, &["--max-message-bytes", "200"]);
    for _ in 0..3 {
        hub.publish("0", NewEvent::plain(br#"{"t": 1}"#)); // no device id anywhere
        hub.publish("0", NewEvent::telemetry("bad", json!(null)).raw_body(b"\xff not json")); // not JSON
        hub.publish("0", NewEvent::telemetry("bad", json!([1, 2]))); // not an object
        hub.publish("0", NewEvent::telemetry("bad", json!({"big": "x".repeat(300)}))); // oversized
        hub.publish("0", NewEvent::telemetry("bad", json!({})).source("digitalTwinChangeEvents"));
    }
    hub.publish("0", NewEvent::telemetry("good", json!({"ok": true})));
    server.wait_for("/lastValue/good/ok", WAIT, |s, _| s == 200);
    assert_eq!(server.get("/lastValue/bad").0, 404, "nothing of the faulty messages is stored");
    let log = server.stderr_lines();
    for fault in ["no_device_id", "not_json", "not_object", "oversized", "unsupported_source"] {
        let warnings = log.iter().filter(|l| l.contains(" WARN ") && l.contains(&format!("fault=\"{fault}\""))).count()
            + log.iter().filter(|l| l.contains(" WARN ") && l.contains(&format!("fault={fault}"))).count();
        assert_eq!(warnings, 1, "one warning for {fault}:\n{}", log.join("\n"));
        let counted = log.iter().filter(|l| l.contains(&format!("fault={fault}")) || l.contains(&format!("fault=\"{fault}\""))).count();
        assert_eq!(counted, 3, "every {fault} is counted (and logged at verbose)");
    }
    assert_eq!(server.get("/status").0, 200, "still connected");
    let (status, metrics) = server.get("/metrics");
    assert_eq!(status, 200);
    for fault in ["no_device_id", "not_json", "not_object", "oversized", "unsupported_source"] {
        assert!(metrics.contains(&format!("hubcast_ingest_faults_total{{kind=\"{fault}\"}} 3")), "{fault}:\n{metrics}");
    }
    assert!(metrics.contains("# TYPE hubcast_ingest_faults_total counter"), "{metrics}");
    assert!(metrics.contains("hubcast_amqp_connected 1"), "{metrics}");
    assert!(metrics.contains("hubcast_amqp_messages_received_total 16"), "{metrics}");
    if std::env::var_os("SHOW_LOG").is_some() {
        eprintln!("{}", log.join("\n"));
    }
}

#[test]
fn cbs_authorization_puts_a_token_and_renews_it_before_expiry() {
    let hub = FakeHub::start(&["0"], FakeAuth::Cbs);
    let server = Server::reading(&hub, &["--event-hub-auth", "cbs", "--event-hub-token-ttl", "2"]);
    hub.publish("0", NewEvent::telemetry("c1", json!({"n": 1})));
    server.wait_for("/lastValue/c1/n", WAIT, |s, _| s == 200);
    // Renewed twice: each renewal comes before the previous token expires (the fake drops a
    // connection whose token expired, which `expired` and `connections` would show).
    let stats = hub.wait_for_stats(WAIT, |s| s.put_tokens >= 3);
    assert_eq!(stats.expired, 0, "no token expired: {stats:?}");
    assert_eq!(stats.connections, 1, "one connection throughout: {stats:?}");
    hub.publish("0", NewEvent::telemetry("c1", json!({"n": 2})));
    server.wait_for("/lastValue/c1/n", WAIT, |s, b| s == 200 && b.contains(r#""n":2"#));
}

#[test]
fn sasl_plain_with_a_wrong_key_leaves_status_503_with_the_reason() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    let cs = hub.connection_string().replace(amqp_support::KEY, "d3Jvbmc=");
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs]);
    let (_, body) = server.wait_for("/status", WAIT, |s, b| s == 503 && b.contains("not connected"));
    assert!(body.contains("SharedAccessKey"), "the reason says what to check: {body}");
    // It tries again (and fails again): still 503 after a second attempt.
    hub.wait_for_stats(WAIT, |s| s.connections >= 2);
    assert_eq!(server.get("/status").0, 503);
}

#[test]
fn iot_hub_connection_string_follows_the_redirect_to_the_built_in_endpoint() {
    let events = FakeHub::start(&["0", "1"], FakeAuth::Cbs);
    let iot_hub = FakeHub::start_iot_hub(&events);
    let cs = iot_hub.iot_hub_connection_string();
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs, "--event-hub-auth", "cbs"]);
    server.wait_connected();
    events.publish("1", NewEvent::telemetry("via-redirect", json!({"x": 1})));
    server.wait_for("/lastValue/via-redirect/x", WAIT, |s, _| s == 200);
    assert_eq!(iot_hub.stats().redirects, 1);
    assert!(events.stats().put_tokens >= 1);
}

#[test]
fn status_is_503_with_the_reason_while_the_hub_is_unreachable_and_200_once_connected() {
    let hub = FakeHub::start(&["0"], FakeAuth::Plain);
    hub.set_refusing(true);
    let cs = hub.connection_string();
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs]);
    let (_, body) = server.wait_for("/status", WAIT, |s, b| s == 503 && b.contains("not connected"));
    assert!(body.contains("event hub"), "{body}");
    hub.set_refusing(false);
    server.wait_connected();
    hub.drop_connections();
    server.wait_for("/status", WAIT, |s, _| s == 503);
    server.wait_connected();
}

#[test]
fn a_connection_string_without_entity_path_is_a_configuration_error() {
    let server = Server::start(&[
        "--iot-hub-event-hub-connection-string",
        "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=v",
    ]);
    let (status, body) = server.get("/status");
    assert_eq!(status, 500);
    assert!(body.contains("EntityPath") && body.contains("iotHubEventHubConnectionString"), "{body}");
}

#[test]
fn amqps_with_tls_first_and_cbs_reads_the_hub() {
    let hub = FakeHub::start_tls(&["0"], FakeAuth::Cbs);
    let cs = hub.tls_connection_string();
    let ca = amqp_support::test_ca_file();
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs, "--event-hub-ca-file", &ca]);
    server.wait_connected();
    hub.publish("0", NewEvent::telemetry("tls-1", json!({"secure": true})));
    server.wait_for("/lastValue/tls-1/secure", WAIT, |s, _| s == 200);
    assert!(hub.stats().put_tokens >= 1, "auth auto is CBS over TLS");
}

#[test]
fn amqps_refuses_a_certificate_no_trusted_root_issued() {
    let hub = FakeHub::start_tls(&["0"], FakeAuth::Cbs);
    let cs = hub.tls_connection_string();
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs]);
    let (_, body) = server.wait_for("/status", WAIT, |s, b| s == 503 && b.contains("TLS"));
    assert!(body.contains("UnknownIssuer") || body.contains("certificate"), "{body}");
    assert_eq!(hub.stats().put_tokens, 0);
}

/// A connection closed (FIN) right after attach, while the lag measurement's `$management` call
/// waits for its answer, shows on `/status` and in the metrics within a second or two: the
/// measurement no longer holds the loop that watches the partitions (it did for the call's 15 s).
#[test]
fn a_connection_lost_during_a_lag_measurement_shows_at_once() {
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    hub.drop_at_lag_read();
    let cs = hub.connection_string();
    let server = Server::start(&["--iot-hub-event-hub-connection-string", &cs, "--event-hub-start-position", "earliest"]);
    let deadline = std::time::Instant::now() + WAIT;
    let dropped = loop {
        if let Some(&at) = hub.stats().lag_read_drops.first() {
            break at;
        }
        assert!(std::time::Instant::now() < deadline, "no lag measurement after attach\n{}", server.log_tail(40));
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(hub.stats().partition_links.len() >= 2, "both partitions were attached first");
    // 3 s leave room for a loaded machine; the measurement call alone would take 15 s.
    server.wait_for("/status", Duration::from_secs(3), |s, _| s == 503);
    let (_, metrics) = server.get("/metrics");
    assert!(metrics.contains("hubcast_amqp_connected 0\n"), "{metrics}");
    assert!(metrics.contains("hubcast_amqp_connects_total 1\n"), "it had connected: {metrics}");
    assert!(dropped.elapsed() < Duration::from_secs(5), "noticed {:?} after the drop", dropped.elapsed());
}

#[test]
fn partition_lag_is_measured_and_reaches_zero_once_caught_up() {
    let hub = FakeHub::start(&["0", "1"], FakeAuth::Plain);
    // Measured every 100 ms instead of every 5 s (hidden flag).
    let server = Server::reading(&hub, &["--amqp-lag-interval-ms", "100"]);
    for n in 0..3 {
        hub.publish("0", NewEvent::telemetry("lagging", json!({"n": n})));
    }
    server.wait_for("/lastValue/lagging/n", WAIT, |s, b| s == 200 && b.contains("\"n\":2"));
    // The first measurement is taken at connect; wait for one taken after the messages: last
    // enqueued (2) minus last received (2) on partition 0, and an empty partition 1, must both
    // read 0. A measurement reads both partitions in turn, then stores the result: once five more
    // reads reached the fake, a whole measurement began after now and its result is stored.
    let reads = hub.stats().management_reads;
    hub.wait_for_stats(WAIT, |s| s.management_reads >= reads + 5);
    let (status, metrics) = server.get("/metrics");
    assert_eq!(status, 200);
    assert!(metrics.contains("# TYPE hubcast_amqp_partition_lag gauge"), "{metrics}");
    assert!(metrics.contains("hubcast_amqp_partition_lag{partition=\"0\"} 0\n"), "{metrics}");
    assert!(metrics.contains("hubcast_amqp_partition_lag{partition=\"1\"} 0\n"), "{metrics}");
}
