//! Issue 24 item 5 across instances (docs/design/recovery.md step 11): after a `kill -9` of
//! the client's instance, the history rebuilt on another instance from its device rings is
//! what the socket would have received had it stayed: twin changes and connection events
//! included, as the live path decided them. Real binaries on one `redis-server`, the npm
//! socket.io-client behind a cutting proxy, a never-cut client beside it to compare with.

mod common;

use common::lb::Cutter;
use common::recovery::*;
use common::sio::{socketio_at, SioClient};
use common::*;
use serde_json::{json, Value};

/// A lease TTL of 2 s: a killed instance leaves the others' view of live instances soon;
/// `deviceTwin` grants need an IoT Hub service connection (never contacted here: the twin
/// comes whole in a `replaceTwin` first).
const ARGS: [&str; 4] = ["--lease-ttl", "2", "--iot-hub-service-connection-string", "HostName=127.0.0.1;SharedAccessKeyName=service;SharedAccessKey=a2V5"];

/// A session granted and subscribed to each of `kinds` of `device`.
fn session_of(server: &Server, device: &str, kinds: &[&str]) -> String {
    let session = server.new_session();
    for k in kinds {
        server.grant(&session, kind(k, device));
        let (status, body) = server.subscribe(&session, kind(k, device));
        assert_eq!(status, 204, "{body}");
    }
    session
}

/// The `data` envelopes up to and including the d2c message `last`.
fn frames_until(client: &SioClient, last: u64) -> Vec<Value> {
    let mut frames = Vec::new();
    loop {
        let e = client.wait_for("data", WAIT).unwrap_or_else(|| panic!("frames up to message {last}: {frames:#?}"));
        let done = e["data"]["message"]["n"] == last;
        frames.push(e["data"].clone());
        if done {
            return frames;
        }
    }
}

/// A d2c message with a time of its own (so every frame of it has one timestamp wherever it
/// is made).
fn timed(device: &str, n: u64) -> Value {
    json!({"deviceId": device, "enqueuedTime": format!("2026-11-28T06:00:{:02}.000Z", n % 60), "body": {"n": n}})
}

fn twin_change(device: &str, version: u64, fw: &str) -> Value {
    let op = if version == 1 { "replaceTwin" } else { "updateTwin" };
    json!({
        "deviceId": device, "source": "twinChangeEvents", "properties": {"opType": op},
        "enqueuedTime": format!("2026-11-28T06:01:{:02}.000Z", version),
        "body": {"version": version, "properties": {"reported": {"fw": fw}}}
    })
}

fn connection_event(device: &str, op: &str, sequence: u64) -> Value {
    json!({
        "deviceId": device, "source": "deviceConnectionStateEvents", "properties": {"opType": op},
        "enqueuedTime": format!("2026-11-28T06:02:{:02}.000Z", sequence),
        "body": {"sequenceNumber": format!("{sequence:048x}")}
    })
}

fn kinds_of(frames: &[Value]) -> Vec<String> {
    frames
        .iter()
        .map(|f| {
            ["message", "deviceTwin", "connectionState", "telemetry"]
                .into_iter()
                .find(|k| f.get(*k).is_some())
                .map(|k| match k {
                    "message" => format!("message {}", f["message"]["n"]),
                    "deviceTwin" => format!("twin {}", f["deviceTwin"]["properties"]["reported"]["fw"].as_str().unwrap_or("?")),
                    "connectionState" => format!("connection {}", f["connectionState"]),
                    k => k.to_string(),
                })
                .unwrap_or_else(|| panic!("an envelope of one kind: {f}"))
        })
        .collect()
}

/// Twin changes and connection events in a rebuild (design step 11, d): a session reading
/// dev-1's d2c messages, twin and connection state is cut off A while B takes in messages,
/// twin changes (one stale: dropped live, so not replayed either) and connection events (one
/// with an older sequence number: dropped too); A is killed, B takes in more; the client
/// lands on B: `recovered` true, and every frame once, in the order a never-cut client of the
/// same subscriptions on B received them, then live. Before, the rebuild refused any session
/// subscribed to twins or connection states with such an event after its cut.
#[test]
fn twin_changes_and_connection_events_are_rebuilt_as_a_client_that_stayed_received_them() {
    let redis = common::redis::Redis::start();
    let (mut a, b) = (instance_with(&redis, "a", &ARGS), instance_with(&redis, "b", &ARGS));
    let kinds = ["d2cMessages", "deviceTwin", "connectionState"];
    let session = session_of(&a, "dev-1", &kinds);
    let staying = session_of(&b, "dev-1", &kinds);
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    let stay = socketio_at(&format!("http://127.0.0.1:{}", b.port), &[&staying], "websocket", false, &[PRINT]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    stay.wait_for("connect", WAIT).expect("connect");
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(json!([twin_change("dev-1", 1, "1.0"), timed("dev-1", 0)]));
    assert_eq!(kinds_of(&frames_until(&client, 0)), ["twin 1.0", "connection true", "message 0"]);
    assert_eq!(kinds_of(&frames_until(&stay, 0)), ["twin 1.0", "connection true", "message 0"]);

    cut(&cutter, &a, &client, WS_GAUGE);
    b.ingest(json!([
        timed("dev-1", 1),
        twin_change("dev-1", 2, "2.0"),
        timed("dev-1", 2),
        connection_event("dev-1", "deviceDisconnected", 5),
        connection_event("dev-1", "deviceConnected", 4),
        twin_change("dev-1", 2, "stale"),
        twin_change("dev-1", 3, "3.0"),
    ]));
    a.wait_for_metric("hubcast_messages_in_total{source=\"twinChangeEvents\"}", WAIT, Want::AtLeast(4.0));
    a.wait_for_metric("hubcast_messages_in_total{source=\"deviceConnectionStateEvents\"}", WAIT, Want::AtLeast(2.0));
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    b.ingest(json!([connection_event("dev-1", "deviceDisconnected", 6), twin_change("dev-1", 4, "4.0"), timed("dev-1", 3)]));
    let stayed = frames_until(&stay, 3);
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}\n{}", b.stderr_lines().join("\n"));
    b.ingest(timed("dev-1", 99));
    let replayed = frames_until(&client, 99);
    let live = frames_until(&stay, 99);
    assert_eq!(
        kinds_of(&stayed),
        [
            "connection true", "message 1", "twin 2.0", "connection true", "message 2", "connection false",
            "twin 3.0", "connection false", "twin 4.0", "connection true", "message 3",
        ],
        "what a client that stayed received (a stale twin version and connection event dropped)"
    );
    assert_eq!(replayed[..stayed.len()], stayed[..], "the replay is what the client that stayed received, once, in order");
    assert_eq!(replayed[stayed.len()..], live[..], "then live");
    assert_eq!(b.metric("hubcast_recovery_replayed_frames_total"), Some(stayed.len() as f64));
}

// ---- a rebuilt history kept in the landing instance's data dir (design step 11, h) ----------

/// The next `data` event's d2c message `n`.
fn next_message(client: &SioClient) -> u64 {
    let e = client.wait_for("data", WAIT).expect("a data event");
    e["data"]["message"]["n"].as_u64().unwrap_or_else(|| panic!("a d2c message: {e}"))
}

/// A history rebuilt on B is written whole to B's data dir (`--recovery-durable`, the
/// default with one), as a stream made new is: after the rebuild and 5 live messages, a
/// `kill -9` and restart of B on the same data dir, then a SIGTERM and restart, each with
/// messages taken in before the client is let back: `recovered` true each time, every message
/// once, in order. Before, the rebuilt stream had no base in the store: its appends were read
/// back after a gap, and the client failed after B's `kill -9` (a SIGTERM alone wrote it whole
/// at the stop, as every stream).
#[test]
fn a_rebuilt_history_survives_a_restart_of_the_instance_it_was_rebuilt_on() {
    let redis = common::redis::Redis::start();
    let dir = TempDir::new();
    let url = redis.url();
    let start_b = |port: &str| {
        let args = ["--redis-url", &url, "--instance-id", "b", "--redis-prefix", "t", "--lease-ttl", "2", "--data-dir", dir.path(), "--port", port];
        let server = Server::start(&args);
        server.wait_for_metric("hubcast_redis_connected{instance=\"b\"}", WAIT, Want::Eq(1.0));
        server
    };
    let mut a = instance_with(&redis, "a", &ARGS[..2]);
    let mut b = start_b("0");
    let port = b.port.to_string();
    let session = session_of(&a, "dev-1", &["d2cMessages"]);
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(message("dev-1", 0));
    assert_eq!(next_message(&client), 0);
    cut(&cutter, &a, &client, WS_GAUGE);
    b.ingest(json!((1..=10).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(11.0));
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    b.ingest(json!((11..=15).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}\n{}", b.stderr_lines().join("\n"));
    let got: Vec<u64> = (0..15).map(|_| next_message(&client)).collect();
    assert_eq!(got, (1..=15).collect::<Vec<_>>());

    // kill -9 and restart at once: what was appended to the rebuilt history (5 live) is read
    // back over its base; 5 taken in before the client is let back.
    b.ingest(json!((16..=20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    assert_eq!((0..5).map(|_| next_message(&client)).collect::<Vec<_>>(), (16..=20).collect::<Vec<_>>());
    b.wait_for_metric("hubcast_recovery_appended_frames_total", WAIT, Want::AtLeast(5.0));
    b.signal(libc::SIGKILL);
    b.wait_exit(WAIT).expect("killed");
    client.wait_for("disconnect", WAIT).expect("the client sees B go");
    cutter.hold();
    b = start_b(&port);
    b.ingest(json!((21..=25).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "after a kill -9: {back}\n{}", b.stderr_lines().join("\n"));
    let got: Vec<u64> = (0..5).map(|_| next_message(&client)).collect();
    assert_eq!(got, (21..=25).collect::<Vec<_>>());
    // Then SIGTERM and restart on the same data dir; 5 taken in before the client is let back.
    b.signal(libc::SIGTERM);
    client.wait_for("disconnect", WAIT).expect("the goodbye");
    b.wait_exit(WAIT).expect("exits after SIGTERM");
    cutter.hold();
    b = start_b(&port);
    b.ingest(json!((26..=30).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "after a SIGTERM: {back}\n{}", b.stderr_lines().join("\n"));
    let got: Vec<u64> = (0..5).map(|_| next_message(&client)).collect();
    assert_eq!(got, (26..=30).collect::<Vec<_>>());

    b.ingest(message("dev-1", 999));
    assert_eq!(next_message(&client), 999, "nothing twice, then live");
}

// ---- throttled telemetry in a rebuild (design step 11, d) ----------------------------------

/// A session granted and subscribed to all of dev-1's telemetry.
fn telemetry_session(server: &Server) -> String {
    let session = server.new_session();
    server.grant(&session, telemetry("dev-1", None));
    let (status, body) = server.subscribe(&session, telemetry("dev-1", None));
    assert_eq!(status, 204, "{body}");
    session
}

/// Telemetry envelopes until one whose `n` is `last`.
fn telemetry_until(client: &SioClient, last: u64) -> Vec<Value> {
    let mut frames = Vec::new();
    loop {
        let e = client.wait_for("data", WAIT).unwrap_or_else(|| panic!("telemetry up to n={last}: {frames:?}"));
        let done = e["data"]["telemetry"]["n"] == last;
        frames.push(e["data"].clone());
        if done {
            return frames;
        }
    }
}

/// Telemetry of dev-1 with a time of its own and keys that come and go (the trailing merge
/// keeps the newest of each).
fn reading(n: u64) -> Value {
    json!({"deviceId": "dev-1", "enqueuedTime": format!("2026-11-28T06:00:{:02}.000Z", n % 60), "body": {"n": n, format!("k{}", n % 3): n}})
}

/// Throttled telemetry in a rebuild (design step 11, d): with `--throttling-interval 300` on
/// both, a session reading dev-1's telemetry is cut off A while B takes in 20 readings at
/// once (one request: one batch, one clock reading, so none sits at a window's edge), A is
/// killed, the client lands on B: `recovered` true, and the replay is exactly what a
/// never-cut client of the same subscription on B received (sent at once and the trailing
/// merge, as its throttle made them, run again over B's ring), then the same live frame.
/// Before, a session subscribed to throttled telemetry was refused.
#[test]
fn throttled_telemetry_is_rebuilt_as_a_client_that_stayed_received_it() {
    let redis = common::redis::Redis::start();
    let args = ["--lease-ttl", "2", "--throttling-interval", "300"];
    let (mut a, b) = (instance_with(&redis, "a", &args), instance_with(&redis, "b", &args));
    let (session, staying) = (telemetry_session(&a), telemetry_session(&b));
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    let stay = socketio_at(&format!("http://127.0.0.1:{}", b.port), &[&staying], "websocket", false, &[PRINT]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    stay.wait_for("connect", WAIT).expect("connect");
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(reading(0));
    assert_eq!(telemetry_until(&client, 0).len(), 1);
    assert_eq!(telemetry_until(&stay, 0).len(), 1);
    cut(&cutter, &a, &client, WS_GAUGE);
    b.ingest(json!((1..=20).map(reading).collect::<Vec<_>>()));
    let stayed = telemetry_until(&stay, 20);
    assert!(stayed.len() < 20, "throttled: {stayed:?}");
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(21.0));
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}\n{}", b.stderr_lines().join("\n"));
    let replayed = telemetry_until(&client, 20);
    assert_eq!(replayed, stayed, "the replay is what the client that stayed received");
    b.ingest(reading(99));
    assert_eq!(telemetry_until(&client, 99), telemetry_until(&stay, 99), "then the same live frame");
}

// ---- the rebuild's metrics (docs/OPERATIONS.md) ---------------------------------------------

/// With a third live instance C taking dev-1 in: B, where the client lands, counts one
/// rebuild `rebuilt`, asks of the others' rings `sent` and `answered`, and its own ring read
/// `not_held` (B never had dev-1); C counts its read `held` and its answer `sent`.
#[test]
fn a_rebuild_from_another_live_instances_rings_is_counted_on_both() {
    let redis = common::redis::Redis::start();
    let lease = &ARGS[..2];
    let (mut a, b, c) = (instance_with(&redis, "a", lease), instance_with(&redis, "b", lease), instance_with(&redis, "c", lease));
    let session = session_of(&a, "dev-1", &["d2cMessages"]);
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    c.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"c\"}", WAIT, Want::Eq(1.0));
    c.ingest(message("dev-1", 0));
    assert_eq!(next_message(&client), 0);
    cut(&cutter, &a, &client, WS_GAUGE);
    c.ingest(json!((1..=5).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(6.0));
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}\n{}", b.stderr_lines().join("\n"));
    assert_eq!((0..5).map(|_| next_message(&client)).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    let m = |s: &Server, name: &str| s.metric(name).unwrap_or_else(|| panic!("{name} not exported"));
    assert_eq!(m(&b, "hubcast_recovery_rebuilds_total{outcome=\"rebuilt\"}"), 1.0);
    assert_eq!(m(&b, "hubcast_recovery_rebuilds_total{outcome=\"refused\"}"), 0.0);
    assert!(m(&b, "hubcast_recovery_ring_asks_total{outcome=\"sent\"}") >= 1.0);
    assert!(m(&b, "hubcast_recovery_ring_asks_total{outcome=\"answered\"}") >= 1.0);
    assert_eq!(m(&b, "hubcast_recovery_ring_asks_total{outcome=\"timed_out\"}"), 0.0);
    assert_eq!(m(&b, "hubcast_recovery_ring_reads_total{result=\"not_held\"}"), 1.0, "B never had dev-1");
    assert_eq!(m(&c, "hubcast_recovery_ring_reads_total{result=\"held\"}"), 1.0);
    assert_eq!(m(&c, "hubcast_recovery_ring_answers_total{outcome=\"sent\"}"), 1.0);
}

/// The client's last frame was taken in on A itself: B's ring read of dev-1 is `not_held`
/// where nobody else holds it, and the rebuild is counted `refused`.
#[test]
fn a_refused_rebuild_is_counted() {
    let redis = common::redis::Redis::start();
    let (mut a, b) = (instance_with(&redis, "a", &ARGS[..2]), instance_with(&redis, "b", &ARGS[..2]));
    let session = session_of(&a, "dev-1", &["d2cMessages"]);
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    a.ingest(message("dev-1", 0));
    assert_eq!(next_message(&client), 0);
    cut(&cutter, &a, &client, WS_GAUGE);
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(b.metric("hubcast_recovery_rebuilds_total{outcome=\"refused\"}"), Some(1.0));
    assert_eq!(b.metric("hubcast_recovery_rebuilds_total{outcome=\"rebuilt\"}"), Some(0.0));
    assert_eq!(b.metric("hubcast_recovery_ring_reads_total{result=\"not_held\"}"), Some(1.0));
}
