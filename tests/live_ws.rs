//! Live push over plain WebSocket (`/ws?sessionId=…`), with --cores 2 so devices and sockets
//! sit on different cores.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(3);
/// deviceTwin grants need an IoT Hub service connection (never contacted by these tests).
const HUB: [&str; 2] = ["--iot-hub-service-connection-string", "HostName=127.0.0.1;SharedAccessKeyName=service;SharedAccessKey=a2V5"];

// Negative tests ("nothing is delivered when …") end with a sentinel: a message that must
// be delivered, sent after the one that must not, for the same device. A device's deliveries to
// a socket travel one FIFO path (the device's core to the socket's core), so when the first
// frame is the sentinel's, nothing was sent before it; and if delivery were broken the
// sentinel would not arrive and the test would fail instead of passing vacuously.

fn subscribed(server: &Server, device: &str, subs: &[Value]) -> String {
    let session = server.new_session();
    for sub in subs {
        let mut grant = sub.clone();
        grant["deviceId"] = json!(device);
        server.grant(&session, grant.clone());
        let (status, body) = server.subscribe(&session, grant);
        assert_eq!(status, 204, "{body}");
    }
    session
}

fn telemetry_sub(key: Option<&str>) -> Value {
    json!({"type": "telemetry", "telemetryKey": key})
}

fn only(kind: &str) -> Value {
    json!({"type": kind})
}

#[test]
fn telemetry_is_filtered_to_the_subscribed_keys() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(Some("temperature"))]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"temperature": 21.5, "humidity": 40}}));
    let frame = live.next_json(WAIT).expect("a telemetry frame");
    assert_eq!(frame["deviceId"], "dev-1");
    assert_eq!(frame["telemetry"], json!({"temperature": 21.5}));
    assert!(parse_utc_millis(frame["timestamp"].as_str().unwrap()).is_some());
    assert_eq!(frame.as_object().unwrap().len(), 3, "exactly one discriminator: {frame}");
}

#[test]
fn a_message_without_subscribed_keys_sends_nothing() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(Some("temperature"))]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"humidity": 40}}));
    server.ingest(json!({"deviceId": "dev-1", "body": {"temperature": 1}})); // the sentinel
    let first = live.next_json(WAIT).expect("the sentinel's telemetry");
    assert_eq!(first["telemetry"], json!({"temperature": 1}), "telemetry is never empty: {first}");
}

/// Sessions whose key filters select the same keys of a message share one envelope; each
/// still gets exactly its own selection (a key filter that selects every key of the message
/// gets the whole message's envelope).
#[test]
fn several_sessions_with_different_key_filters_each_get_their_own_keys() {
    let server = Server::start(&["--cores", "2"]);
    let device = "dev-keys";
    let sets: [&[&str]; 5] = [&["a"], &["b"], &["a"], &["a", "c"], &["a", "b", "c"]];
    let mut lives = Vec::new();
    for keys in sets {
        let subs: Vec<Value> = keys.iter().map(|k| telemetry_sub(Some(k))).collect();
        let session = subscribed(&server, device, &subs);
        lives.push(server.live(&session));
    }
    let wildcard = subscribed(&server, device, &[telemetry_sub(None)]);
    let mut all = server.live(&wildcard);
    server.ingest(json!({"deviceId": device, "body": {"a": 1, "b": "two", "c": [3]}}));
    let expected = [json!({"a": 1}), json!({"b": "two"}), json!({"a": 1}), json!({"a": 1, "c": [3]}), json!({"a": 1, "b": "two", "c": [3]})];
    for (live, want) in lives.iter_mut().zip(expected) {
        let frame = live.next_json(WAIT).expect("a telemetry frame");
        assert_eq!(frame["telemetry"], want, "{frame}");
    }
    assert_eq!(all.next_json(WAIT).expect("a telemetry frame")["telemetry"], json!({"a": 1, "b": "two", "c": [3]}));
    // A message with only some of the keys: a filter that selected everything of the first
    // message now selects part of this one.
    server.ingest(json!({"deviceId": device, "body": {"b": false, "c": null}}));
    let expected = [None, Some(json!({"b": false})), None, Some(json!({"c": null})), Some(json!({"b": false, "c": null}))];
    for (i, (live, want)) in lives.iter_mut().zip(expected).enumerate() {
        let Some(want) = want else { continue };
        let frame = live.next_json(WAIT).expect("a telemetry frame");
        assert_eq!(frame["telemetry"], want, "session {i}: {frame}");
    }
    // The sessions that wanted none of these keys got nothing: their next frame is the sentinel's.
    server.ingest(json!({"deviceId": device, "body": {"a": "sentinel"}}));
    for i in [0, 2] {
        let frame = lives[i].next_json(WAIT).expect("the sentinel");
        assert_eq!(frame["telemetry"], json!({"a": "sentinel"}), "session {i}: {frame}");
    }
}

#[test]
fn wildcard_subscription_gets_every_key() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None)]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"a": 1, "b": {"x": true}, "c": "s"}}));
    let frame = live.next_json(WAIT).expect("a telemetry frame");
    assert_eq!(frame["telemetry"], json!({"a": 1, "b": {"x": true}, "c": "s"}));
}

#[test]
fn one_message_per_device_per_kind_per_incoming_message() {
    let server = Server::start(&[]);
    let session = subscribed(
        &server,
        "dev-1",
        &[telemetry_sub(Some("a")), telemetry_sub(Some("b")), only("connectionState"), only("d2cMessages")],
    );
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"a": 1, "b": 2, "c": 3}}));
    let frames: Vec<Value> = (0..3).map(|_| live.next_json(WAIT).expect("three frames")).collect();
    // The sentinel (a connection event: one state frame) comes next.
    server.ingest(disconnected("dev-1", "01"));
    let sentinel = live.next_json(WAIT).expect("the sentinel's state");
    assert_eq!(sentinel["connectionState"], json!(false), "no fourth frame: {frames:?} then {sentinel}");
    let of = |key: &str| frames.iter().filter(|f| f.get(key).is_some()).collect::<Vec<_>>();
    assert_eq!(of("telemetry").len(), 1);
    assert_eq!(of("telemetry")[0]["telemetry"], json!({"a": 1, "b": 2}));
    assert_eq!(of("connectionState")[0]["connectionState"], json!(true));
    assert_eq!(of("message")[0]["message"], json!({"a": 1, "b": 2, "c": 3}), "d2c gets the whole body");
    for f in &frames {
        assert_eq!(f.as_object().unwrap().len(), 3, "one discriminator per frame: {f}");
    }
}

#[test]
fn other_devices_and_unsubscribed_kinds_are_not_delivered() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None)]);
    server.grant(&session, json!({"type": "connectionState", "deviceId": "dev-1"}));
    let mut live = server.live(&session);
    // The other device lives on dev-1's core, so its frames would share dev-1's path.
    let core = |d: &str| hubcast::runtime::routing::core_of_device(d, 2);
    let other = (2..).map(|i| format!("dev-{i}")).find(|d| core(d) == core("dev-1")).unwrap();
    server.ingest(json!([{"deviceId": other, "body": {"a": 1}}, {"deviceId": "dev-1", "body": {"a": 2}}]));
    let first = live.next_json(WAIT).expect("dev-1's telemetry");
    assert_eq!((&first["deviceId"], &first["telemetry"]), (&json!("dev-1"), &json!({"a": 2})), "{first}");
    // The sentinel: dev-1's next telemetry is the next frame (no connection state was pushed).
    server.ingest(json!({"deviceId": "dev-1", "body": {"a": 3}}));
    let next = live.next_json(WAIT).expect("the sentinel's telemetry");
    assert_eq!(next["telemetry"], json!({"a": 3}), "{next}");
}

#[test]
fn unknown_session_is_rejected_with_a_close_frame() {
    let server = Server::start(&[]);
    let mut live = server.ws("/ws?sessionId=AAAAAAAAAAAAAAAAAAAAAA");
    assert_eq!(live.wait_closed(WAIT), Some(1008));
    assert!(live.closed.as_ref().unwrap().1.contains("session"));
    let mut missing = server.ws("/ws");
    assert_eq!(missing.wait_closed(WAIT), Some(1008));
}

#[test]
fn deleting_the_session_closes_its_sockets_at_once() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None)]);
    let mut a = server.live(&session);
    let mut b = server.live(&session);
    let (status, _, _) = server.call("DELETE", &format!("/sessions/{session}"), &[ADMIN], None);
    assert_eq!(status, 204);
    assert!(a.wait_closed(WAIT).is_some());
    assert!(b.wait_closed(WAIT).is_some());
}

#[test]
fn every_socket_of_a_session_gets_the_data() {
    let server = Server::start(&[]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None)]);
    let mut sockets: Vec<_> = (0..4).map(|_| server.live(&session)).collect();
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 7}}));
    for live in &mut sockets {
        assert_eq!(live.next_json(WAIT).expect("frame")["telemetry"], json!({"n": 7}));
    }
}

#[test]
fn revoking_a_grant_stops_delivery_at_once() {
    let server = Server::start(&["--connection-state-on-telemetry", "false"]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None), only("connectionState")]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 1}}));
    assert_eq!(live.next_json(WAIT).expect("telemetry before the revoke")["telemetry"], json!({"n": 1}));
    server.revoke(&session, json!({"type": "telemetry", "deviceId": "dev-1", "telemetryKey": null}));
    // Telemetry, then a connection event (the sentinel: connectionState is still granted).
    server.ingest(json!([{"deviceId": "dev-1", "body": {"n": 2}}, disconnected("dev-1", "01")]));
    let first = live.next_json(WAIT).expect("the sentinel's connection state");
    assert_eq!(first["connectionState"], json!(false), "no telemetry after the revoke: {first}");
}

/// A `deviceDisconnected` event with the given sequence number.
fn disconnected(device: &str, sequence: &str) -> Value {
    json!({"deviceId": device, "source": "deviceConnectionStateEvents",
        "properties": {"opType": "deviceDisconnected"}, "body": {"sequenceNumber": sequence}})
}

#[test]
fn adding_a_grant_publishes_nothing() {
    let server = Server::start(&[]);
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 1}}));
    let session = server.new_session();
    let mut live = server.live(&session);
    server.grant(&session, json!({"type": "telemetry", "deviceId": "dev-1"}));
    server.grant(&session, json!({"type": "connectionState", "deviceId": "dev-1"}));
    // The sentinel: a subscription and a new message; its telemetry must be the first frame.
    let (status, body) = server.subscribe(&session, json!({"type": "telemetry", "deviceId": "dev-1"}));
    assert_eq!(status, 204, "{body}");
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 2}}));
    let first = live.next_json(WAIT).expect("the sentinel's telemetry");
    assert_eq!(first["telemetry"], json!({"n": 2}), "granting published nothing: {first}");
}

#[test]
fn silent_devices_go_offline_after_the_connection_ttl() {
    let server = Server::start(&["--connection-state-cache-ttl-ms", "300"]);
    let session = subscribed(&server, "dev-1", &[only("connectionState")]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 1}}));
    assert_eq!(live.next_json(WAIT).unwrap()["connectionState"], json!(true));
    let offline = live.next_json(WAIT).expect("offline after the TTL");
    assert_eq!(offline["connectionState"], json!(false));
    let (_, state) = server.call_json("GET", "/connectionState/dev-1", &[ADMIN], None);
    assert_eq!(state["data"], json!(false));
}

#[test]
fn devices_that_keep_talking_stay_online() {
    let server = Server::start(&["--connection-state-cache-ttl-ms", "1000", "--connection-state-on-telemetry", "false"]);
    let session = subscribed(&server, "dev-1", &[only("connectionState"), telemetry_sub(None)]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "source": "deviceConnectionStateEvents",
        "properties": {"opType": "deviceConnected"}, "body": {"sequenceNumber": "01"}}));
    assert_eq!(live.next_json(WAIT).unwrap()["connectionState"], json!(true));
    // A device that talks every 100 ms for 2.5 s, more than twice its 1 s TTL (10 times the
    // pause, so a busy machine's late wake-up does not take it offline): the pause between
    // messages is the behaviour under test, not synchronisation. Each message's own telemetry
    // frame is the sentinel: an offline state would arrive before it (same device, same path).
    for n in 0..25 {
        std::thread::sleep(Duration::from_millis(100));
        server.ingest(json!({"deviceId": "dev-1", "body": {"n": n}}));
        let frame = live.next_json(WAIT).expect("the message's telemetry");
        assert_eq!(frame["telemetry"], json!({"n": n}), "no offline while talking: {frame}");
    }
}

#[test]
fn zero_ttl_never_expires() {
    let server = Server::start(&["--connection-state-cache-ttl", "0"]);
    let session = subscribed(&server, "dev-1", &[only("connectionState"), telemetry_sub(None)]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 1}}));
    let frames = [live.next_json(WAIT).unwrap(), live.next_json(WAIT).unwrap()];
    assert!(frames.iter().any(|f| f["connectionState"] == json!(true)), "{frames:?}");
    // "Never" cannot be awaited. There is no periodic sweep (the core's clock wakes at the
    // earliest deadline, app/clock.rs): with the TTL off no deadline exists, while a 0 taken
    // as a TTL of 0 ms would make the device due at once. 800 ms let such a deadline fire
    // (the time passing is the check), then the sentinel.
    std::thread::sleep(Duration::from_millis(800));
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 2}}));
    let first = live.next_json(WAIT).expect("the sentinel's telemetry");
    assert_eq!(first["telemetry"], json!({"n": 2}), "still online: {first}");
}

#[test]
fn custom_connection_state_key_drives_the_state_and_stays_in_telemetry() {
    let server = Server::start(&["--custom-connection-state-key", "online"]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None), only("connectionState")]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "body": {"online": false, "t": 1}}));
    let frames = [live.next_json(WAIT).expect("a frame"), live.next_json(WAIT).expect("a second frame")];
    let state = frames.iter().find(|f| f.get("connectionState").is_some()).expect("a state");
    assert_eq!(state["connectionState"], json!(false));
    let tel = frames.iter().find(|f| f.get("telemetry").is_some()).expect("telemetry");
    assert_eq!(tel["telemetry"], json!({"online": false, "t": 1}));
    // Telemetry without the key publishes no state; connection events are ignored. The
    // sentinel is the last message's telemetry: no state may arrive before it.
    server.ingest(json!([{"deviceId": "dev-1", "body": {"t": 2}},
        {"deviceId": "dev-1", "source": "deviceConnectionStateEvents", "properties": {"opType": "deviceConnected"}, "body": {}},
        {"deviceId": "dev-1", "body": {"t": 3}}]));
    for t in [2, 3] {
        let frame = live.next_json(WAIT).expect("telemetry");
        assert_eq!(frame["telemetry"], json!({"t": t}), "no connection state: {frame}");
    }
}

#[test]
fn stale_connection_events_are_dropped() {
    let server = Server::start(&["--connection-state-on-telemetry", "false"]);
    let session = subscribed(&server, "dev-1", &[only("connectionState"), telemetry_sub(None)]);
    let mut live = server.live(&session);
    let event = |op: &str, seq: &str| json!({"deviceId": "dev-1", "source": "deviceConnectionStateEvents",
        "properties": {"opType": op}, "body": {"sequenceNumber": seq}});
    server.ingest(event("deviceDisconnected", "000000000000000001D5"));
    assert_eq!(live.next_json(WAIT).unwrap()["connectionState"], json!(false));
    server.ingest(event("deviceConnected", "000000000000000001D4"));
    server.ingest(json!({"deviceId": "dev-1", "body": {"sentinel": 1}}));
    let first = live.next_json(WAIT).expect("the sentinel's telemetry");
    assert_eq!(first["telemetry"], json!({"sentinel": 1}), "older event ignored: {first}");
    server.ingest(event("deviceConnected", "000000000000000001D6"));
    assert_eq!(live.next_json(WAIT).unwrap()["connectionState"], json!(true));
}

#[test]
fn twin_updates_are_merged_and_pushed_whole() {
    let server = Server::start(&HUB);
    let session = subscribed(&server, "dev-1", &[only("deviceTwin")]);
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-1", "source": "twinChangeEvents", "properties": {"opType": "replaceTwin"},
        "body": {"version": 1, "properties": {"reported": {"fw": "1.0", "mode": "eco"}, "desired": {"x": 1}}}}));
    assert_eq!(live.next_json(WAIT).unwrap()["deviceTwin"]["properties"]["reported"]["fw"], "1.0");
    server.ingest(json!({"deviceId": "dev-1", "source": "twinChangeEvents", "properties": {"opType": "updateTwin"},
        "body": {"version": 2, "properties": {"reported": {"fw": "1.1", "mode": null}}}}));
    let twin = &live.next_json(WAIT).unwrap()["deviceTwin"];
    assert_eq!(twin, &json!({"version": 2, "properties": {"reported": {"fw": "1.1"}, "desired": {"x": 1}}}));
}

#[test]
fn throttling_coalesces_keys_and_flushes_a_trailing_message() {
    let server = Server::start(&["--throttling-interval", "500"]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None), only("connectionState")]);
    let mut live = server.live(&session);
    // One batch: applied together on the device's core, so all three fall in one interval.
    let started = std::time::Instant::now();
    server.ingest(json!([
        {"deviceId": "dev-1", "body": {"a": 1}},
        {"deviceId": "dev-1", "body": {"a": 2, "b": 1}},
        {"deviceId": "dev-1", "body": {"a": 3}}
    ]));
    let mut telemetry = Vec::new();
    let mut states = 0;
    let mut trailing_after = None;
    while telemetry.len() < 2 {
        let frame = live.next_json(WAIT).expect("leading and trailing telemetry");
        if let Some(t) = frame.get("telemetry") {
            telemetry.push(t.clone());
            if telemetry.len() == 2 {
                trailing_after = Some(started.elapsed());
            }
        } else if frame.get("connectionState").is_some() {
            states += 1;
        }
    }
    assert_eq!(telemetry, vec![json!({"a": 1}), json!({"a": 3, "b": 1})], "leading, then merged trailing");
    assert!(trailing_after.unwrap() >= Duration::from_millis(450), "the trailing message waits for the interval");
    while states < 3 {
        let frame = live.next_json(WAIT).expect("a connection state per message: not throttled");
        assert!(frame.get("connectionState").is_some(), "only states are left: {frame}");
        states += 1;
    }
    // The sentinel: a disconnection is the next frame (no fourth state, no more telemetry).
    server.ingest(disconnected("dev-1", "01"));
    assert_eq!(live.next_json(WAIT).expect("the sentinel")["connectionState"], json!(false));
}

#[test]
fn a_stalled_client_does_not_delay_a_healthy_one() {
    let server = Server::start(&["--socket-queue-hard-limit", "64", "--socket-queue-soft-limit", "8"]);
    let stalled_session = subscribed(&server, "dev-1", &[telemetry_sub(None), only("connectionState")]);
    let healthy_session = subscribed(&server, "dev-1", &[telemetry_sub(None)]);
    let _stalled = server.live(&stalled_session); // never read
    let mut healthy = server.live(&healthy_session);
    let payload = "x".repeat(16 * 1024);
    for round in 0..40 {
        let batch: Vec<Value> = (0..10).map(|i| json!({"deviceId": "dev-1", "body": {"n": round * 10 + i, "pad": payload}})).collect();
        server.ingest(Value::Array(batch));
        // Bursts beyond the soft limit may be conflated; the newest value always arrives.
        loop {
            let frame = healthy.next_json(WAIT).expect("the healthy client keeps getting data");
            if frame["telemetry"]["n"] == json!(round * 10 + 9) {
                break;
            }
        }
    }
    assert!(healthy.closed.is_none(), "the healthy client stays connected");
}

#[test]
fn a_thousand_sockets_each_get_exactly_their_data() {
    const N: usize = 1000;
    const THREADS: usize = 10;
    // A thousand clients from one address: past the per-client rate limit on new sessions
    // and handshakes (tests/admission.rs), which this fan-out test turns off.
    let server = Server::start(&["--client-rate", "0"]);
    let agent = new_agent();
    let sessions: Vec<String> = (0..N)
        .map(|i| {
            let session = server.new_session_on(&agent);
            let device = format!("fleet-{i}");
            server.grant_on(&agent, &session, json!({"type": "telemetry", "deviceId": device}));
            let (status, _) = server.subscribe_on(&agent, &session, json!({"type": "telemetry", "deviceId": device}));
            assert_eq!(status, 204);
            session
        })
        .collect();
    let connected = std::sync::Arc::new(std::sync::Barrier::new(THREADS + 1));
    let ingested = std::sync::Arc::new(std::sync::Barrier::new(THREADS + 1));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let mine: Vec<(usize, String)> =
                sessions.iter().cloned().enumerate().filter(|(i, _)| i % THREADS == t).collect();
            let server_base = server.base.clone();
            let (connected, ingested) = (connected.clone(), ingested.clone());
            std::thread::spawn(move || {
                let mut sockets: Vec<(usize, common::ws::Live)> = mine
                    .iter()
                    .map(|(i, s)| (*i, common::ws::connect(&server_base, &format!("/ws?sessionId={s}"))))
                    .collect();
                connected.wait();
                ingested.wait();
                for (i, live) in &mut sockets {
                    let frame = live.next_json(Duration::from_secs(10)).expect("each socket gets its frame");
                    assert_eq!(frame["deviceId"], format!("fleet-{i}"));
                    assert_eq!(frame["telemetry"], json!({"value": *i}));
                }
                // A second round: the next frame must be the second one (no duplicate, no stray).
                ingested.wait();
                for (i, live) in &mut sockets {
                    let frame = live.next_json(Duration::from_secs(10)).expect("second frame");
                    assert_eq!(frame["telemetry"], json!({"value": *i + N}), "exactly one frame per message");
                }
            })
        })
        .collect();
    connected.wait();
    for round in 0..2 {
        let batch: Vec<Value> =
            (0..N).map(|i| json!({"deviceId": format!("fleet-{i}"), "body": {"value": i + round * N}})).collect();
        server.ingest_on(&agent, Value::Array(batch));
        ingested.wait();
    }
    for h in handles {
        h.join().expect("socket thread");
    }
}

#[test]
fn the_epoll_driver_serves_and_moves_sockets_between_cores() {
    let server = Server::start(&["--io-driver", "epoll"]);
    assert!(server.stdout_lines().iter().any(|l| l.contains("epoll")), "the driver is reported");
    let sessions: Vec<String> = (0..8).map(|_| subscribed(&server, "dev-1", &[telemetry_sub(None)])).collect();
    let mut sockets: Vec<_> = sessions.iter().map(|s| server.live(s)).collect();
    server.ingest(json!({"deviceId": "dev-1", "body": {"n": 1}}));
    for live in &mut sockets {
        assert_eq!(live.next_json(WAIT).expect("frame")["telemetry"], json!({"n": 1}));
    }
}

#[test]
fn an_open_socket_keeps_its_session_and_the_grace_period_starts_when_it_closes() {
    // One core: one expiry sweep sees both sessions.
    let server = Server::start(&["--session-grace-period-ms", "300", "--cores", "1", "--log-level", "debug"]);
    let session = subscribed(&server, "dev-1", &[telemetry_sub(None)]);
    let live = server.live(&session);
    // The sentinel: a session idle since after the other's last request expires first.
    let idle = server.new_session();
    wait_for_expiry(&server, &idle);
    let grant = json!({"type": "connectionState", "deviceId": "dev-1"});
    assert_eq!(server.try_grant(&session, grant.clone()).0, 204, "alive while its socket is open");
    live.close();
    wait_for_expiry(&server, &session);
    assert_eq!(server.try_grant(&session, grant).0, 404, "expired after the grace period");
}

/// Waits for the debug line `session expired session=<id>`.
fn wait_for_expiry(server: &Server, session: &str) {
    let expired = server.wait_for_stderr(WAIT, |l| l.contains("session expired") && l.contains(session));
    assert!(expired.is_some(), "session {session} did not expire");
}

#[test]
fn live_sockets_count_towards_the_connection_limit() {
    let server = Server::start(&["--max-connections", "2", "--cores", "1"]);
    let session = session_on_a_closed_connection(&server);
    // Each socket counts once its 101 has arrived (the upgrade frees its HTTP slot before).
    let _a = server.live(&session);
    let _b = server.live(&session);
    let mut third = server.connect();
    match raw_exchange(&mut third, b"GET /version HTTP/1.1\r\nhost: x\r\n\r\n") {
        RawOutcome::Response(r) => assert_eq!(r.status, 503),
        RawOutcome::Closed => {}
        RawOutcome::TimedOut => panic!("a connection over the limit must be refused at once"),
    }
}

#[test]
fn late_twin_changes_with_an_older_version_are_dropped() {
    let server = Server::start(&HUB);
    let session = subscribed(&server, "dev-1", &[only("deviceTwin")]);
    let mut live = server.live(&session);
    let change = |op: &str, version: u64, fw: &str| json!({"deviceId": "dev-1", "source": "twinChangeEvents",
        "properties": {"opType": op}, "body": {"version": version, "properties": {"reported": {"fw": fw}}}});
    server.ingest(change("replaceTwin", 5, "5.0"));
    assert_eq!(live.next_json(WAIT).unwrap()["deviceTwin"]["version"], json!(5));
    server.ingest(change("updateTwin", 4, "4.0"));
    // The sentinel: a newer change must be the next frame (an applied 4 would come first).
    server.ingest(change("updateTwin", 6, "6.0"));
    let twin = &live.next_json(WAIT).unwrap()["deviceTwin"];
    assert_eq!(twin["properties"]["reported"]["fw"], "6.0");
    assert_eq!(twin["version"], json!(6));
}

/// POST /session on a connection the server closes after answering (`Connection: close`);
/// returns once the server has closed it, so it no longer counts towards the limit.
fn session_on_a_closed_connection(server: &Server) -> String {
    let mut setup = server.connect();
    let answer = raw_exchange(&mut setup, b"POST /session HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n");
    let RawOutcome::Response(r) = answer else { panic!("POST /session: {answer:?}") };
    assert_eq!(r.status, 200, "{}{}", r.head, r.body);
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut setup, &mut rest).expect("the server closes the connection");
    parse_json(&r.body)["sessionId"].as_str().expect("a session id").to_string()
}
