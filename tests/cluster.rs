//! Several instances on one Redis (issue 12) or a Redis Cluster (issue 23): real hubcast
//! processes, a real redis-server (or three, clustered), standard clients spread over the
//! instances. The scale-out tests run on both engines (`both_engines!`: `name::single`,
//! `name::cluster`); the URL, password and TLS tests of one Redis have cluster twins (TLS on
//! a cluster of nodes speaking TLS themselves: socat in front of the nodes cannot work, the
//! cluster announces their own addresses).

mod common;

use std::time::Duration;

use common::redis::{Engine, Redis};
use common::{assert_error, Server, Want, ADMIN};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

both_engines!(
    a_session_opened_on_one_instance_is_served_by_another_and_live_data_crosses_once,
    a_device_no_other_instance_watches_never_crosses_redis,
    a_grant_revoked_on_one_instance_stops_delivery_on_another_at_once,
    deleting_a_session_on_one_instance_closes_its_socket_on_another,
    redis_down_is_a_503_with_the_reason_and_each_instance_recovers_by_itself,
    reads_answer_the_same_on_an_instance_that_neither_ingests_nor_watches_the_device,
    behind_a_plain_load_balancer_a_socketio_client_survives_kill_9_of_its_instance_and_keeps_its_session,
    a_grant_given_on_one_instance_holds_at_once_on_another,
    a_replica_no_longer_watched_is_not_answered_once_newer_data_exists_elsewhere,
    values_loaded_from_the_store_are_not_answered_once_newer_data_exists_elsewhere,
    a_thousand_subscriptions_in_one_request_cost_two_redis_round_trips,
    a_watch_whose_announcement_was_lost_is_learnt_from_the_watching_set,
    live_data_between_instances_resumes_by_itself_after_redis_restarts,
    changes_published_while_an_instance_was_away_are_in_force_there_once_it_is_back,
    a_delete_published_while_an_instance_was_away_closes_its_socket_once_it_is_back,
    a_change_never_published_is_in_force_once_a_later_change_shows_its_version_skipped,
    a_session_restored_from_the_store_takes_the_changes_made_while_its_instance_was_down,
    publications_queued_behind_a_busy_redis_go_in_one_pipeline_in_order,
);

fn instance(engine: &Engine, id: &str) -> Server {
    let mut args: Vec<String> = engine.flags();
    args.extend(["--instance-id", id, "--redis-prefix", "t"].map(String::from));
    let server = Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // The instance connects to Redis.
    server.wait_for_metric(&format!("hubcast_redis_connected{{instance=\"{id}\"}}"), WAIT, Want::Eq(1.0));
    server
}

fn metric(server: &Server, name: &str, id: &str) -> f64 {
    server.metric(&format!("{name}{{instance=\"{id}\"}}")).unwrap_or(0.0)
}

/// Waits until instance `id` knows that another instance watches `n` devices.
fn wait_watched_elsewhere(server: &Server, id: &str, n: f64) {
    let series = format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{id}\"}}");
    server.wait_for_metric(&series, WAIT, Want::Eq(n)); // the instance learns what the others watch
}

/// A session opened on `server`, granted and subscribed to `device`'s telemetry.
fn session_watching(server: &Server, device: &str) -> String {
    server.telemetry_session(&[device])
}

/// Instances A and B, a session opened on A watching `device`'s telemetry and its plain
/// WebSocket on B, once A knows that B watches the device.
fn watched_on_b(redis: &Engine, device: &str) -> (Server, Server, String, common::ws::Live) {
    let a = instance(redis, "a");
    let b = instance(redis, "b");
    let session = session_watching(&a, device);
    let ws = b.live(&session);
    wait_watched_elsewhere(&a, "a", 1.0);
    (a, b, session, ws)
}

/// A session opened on A granted and subscribed to the valve's telemetry and connection
/// state, its plain WebSocket on B, once A knows that B watches the valve.
fn valve_watched_on_b(a: &Server, b: &Server) -> (String, common::ws::Live) {
    let session = a.new_session();
    for kind in ["telemetry", "connectionState"] {
        let request = json!({"type": kind, "deviceId": "valve"});
        a.grant(&session, request.clone());
        assert_eq!(a.subscribe(&session, request).0, 204);
    }
    let ws = b.live(&session);
    wait_watched_elsewhere(a, "a", 1.0);
    (session, ws)
}

fn telemetry_values(frames: &[Value], key: &str) -> Vec<i64> {
    frames.iter().filter_map(|f| f["telemetry"][key].as_i64()).collect()
}

fn a_session_opened_on_one_instance_is_served_by_another_and_live_data_crosses_once(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    // Opened on A, granted on B, subscribed on A: every call may land anywhere.
    let session = a.new_session();
    let request = json!({"type": "telemetry", "deviceId": "pump-1"});
    b.grant(&session, request.clone());
    let (status, body) = a.subscribe(&session, request.clone());
    assert_eq!(status, 204, "the grant given on B holds on A: {body}");
    // Sockets on B (plain WebSocket and the real socket.io-client); data ingested on A.
    let mut ws = b.live(&session);
    let sio = b.socketio(&[&session], "websocket");
    assert!(sio.wait_for("connect", WAIT).is_some(), "socket.io-client connects on B with a session opened on A");
    wait_watched_elsewhere(&a, "a", 1.0);
    for n in 0..20 {
        a.ingest(json!({"deviceId": "pump-1", "body": {"n": n}}));
    }
    let mut frames = Vec::new();
    while telemetry_values(&frames, "n").last() != Some(&19) {
        frames.push(ws.next_json(WAIT).unwrap_or_else(|| panic!("every message reaches B's WebSocket; got {frames:?}")));
    }
    assert_eq!(telemetry_values(&frames, "n"), (0..20).collect::<Vec<_>>(), "once each, in order");
    let mut data = Vec::new();
    while telemetry_values(&data, "n").last() != Some(&19) {
        let e = sio.wait_for("data", WAIT).unwrap_or_else(|| panic!("every message reaches B's Socket.IO client; got {data:?}"));
        data.push(e["data"].clone());
    }
    assert_eq!(telemetry_values(&data, "n"), (0..20).collect::<Vec<_>>(), "once each, in order");
    // Once per message for the one interested instance, not once per socket.
    assert_eq!(metric(&a, "hubcast_redis_published_total", "a"), 20.0);
    assert_eq!(metric(&b, "hubcast_redis_received_total", "b"), 20.0);
    // B keeps the last values it received, so reads answer there too.
    let (status, body, _) = b.call("GET", "/lastValue/pump-1/n", &[("sessionId", &session)], None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(common::parse_json(&body)["data"]["n"], json!(19));
}

fn a_device_no_other_instance_watches_never_crosses_redis(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let session = a.new_session();
    for device in ["watched", "local-only"] {
        let request = json!({"type": "telemetry", "deviceId": device});
        a.grant(&session, request.clone());
        assert_eq!(a.subscribe(&session, request).0, 204);
    }
    // A socket on A watches both devices; one on B watches only "watched" (another session).
    let mut local = a.live(&session);
    let other = b.new_session();
    let request = json!({"type": "telemetry", "deviceId": "watched"});
    b.grant(&other, request.clone());
    assert_eq!(b.subscribe(&other, request).0, 204);
    let mut remote = b.live(&other);
    wait_watched_elsewhere(&a, "a", 1.0);
    a.ingest(json!([
        {"deviceId": "local-only", "body": {"x": 1}},
        {"deviceId": "watched", "body": {"x": 2}},
    ]));
    // Both arrive on A's own socket; only the watched device reaches B.
    let mut seen = Vec::new();
    while seen.len() < 2 {
        seen.push(local.next_json(WAIT).unwrap_or_else(|| panic!("both messages reach A's socket; got {seen:?}")));
    }
    let frame = remote.next_json(WAIT).expect("the watched device's message reaches B");
    assert_eq!((frame["deviceId"].as_str(), frame["telemetry"]["x"].as_i64()), (Some("watched"), Some(2)));
    // Counted once the PUBLISH is answered, which may be after B got the message; the
    // unwatched device comes first in the batch, so it would be counted by then.
    let published = a.wait_for_metric("hubcast_redis_published_total{instance=\"a\"}", WAIT, Want::AtLeast(1.0));
    assert_eq!(published, 1.0, "the unwatched device was not published");
}

fn a_grant_revoked_on_one_instance_stops_delivery_on_another_at_once(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let (session, mut ws) = valve_watched_on_b(&a, &b);
    a.ingest(json!({"deviceId": "valve", "body": {"open": 1}}));
    let first = ws.next_json(WAIT).expect("before the revoke, telemetry arrives on B");
    assert_eq!(first["telemetry"], json!({"open": 1}));
    // Revoked on A: B must not deliver the next telemetry, and still delivers what is granted.
    a.revoke(&session, json!({"type": "telemetry", "deviceId": "valve"}));
    assert_valve_telemetry_revoked(&a, &mut ws);
}

/// A ingests the valve's telemetry, then its connection state: the state (still granted)
/// arrives on `ws` and, coming after the telemetry on the device's one channel, proves the
/// telemetry (revoked) was not delivered.
fn assert_valve_telemetry_revoked(a: &Server, ws: &mut common::ws::Live) {
    a.ingest(json!([
        {"deviceId": "valve", "body": {"open": 2}},
        {"deviceId": "valve", "source": "deviceConnectionStateEvents",
         "properties": {"opType": "deviceDisconnected"}, "body": {"sequenceNumber": "000000000000000001D5"}},
    ]));
    let mut after = Vec::new();
    while !after.iter().any(|f: &Value| f["connectionState"] == json!(false)) {
        after.push(ws.next_json(WAIT).unwrap_or_else(|| panic!("the connection state, still granted, arrives on B; got {after:?}")));
    }
    assert!(after.iter().all(|f| f.get("telemetry").is_none()), "no telemetry after the revoke: {after:?}");
}

fn deleting_a_session_on_one_instance_closes_its_socket_on_another(redis: Engine) {
    let (a, b, session, mut ws) = watched_on_b(&redis, "d");
    a.ingest(json!({"deviceId": "d", "body": {"v": 1}}));
    assert!(ws.next_json(WAIT).is_some(), "the socket on B is live");
    let (status, body, _) = a.call("DELETE", &format!("/sessions/{session}"), &[ADMIN], None);
    assert_eq!(status, 204, "{body}");
    assert_eq!(ws.wait_closed(WAIT), Some(1000), "B closes the deleted session's socket");
    // Gone everywhere: B answers like A.
    let (status, body) = b.subscribe(&session, json!({"type": "telemetry", "deviceId": "d"}));
    assert_error(status, &body, 404, "No such sessionId");
}

fn redis_down_is_a_503_with_the_reason_and_each_instance_recovers_by_itself(mut redis: Engine) {
    let a = instance(&redis, "a");
    let session = a.new_session();
    assert_eq!(a.call("GET", "/status", &[], None).0, 200);
    redis.down();
    let series = "hubcast_redis_connected{instance=\"a\"}";
    a.wait_for_metric(series, WAIT, Want::Eq(0.0)); // the lost link is seen
    let (status, body, _) = a.call("GET", "/status", &[], None);
    assert_error(status, &body, 503, "redis");
    let (status, body) = a.try_grant(&session, json!({"type": "telemetry", "deviceId": "d"}));
    assert_error(status, &body, 503, "Redis unavailable");
    redis.up();
    a.wait_for_metric(series, WAIT, Want::Eq(1.0)); // the link comes back by itself
    assert_eq!(a.call("GET", "/status", &[], None).0, 200);
    // A new session works end to end again.
    let fresh = a.new_session();
    a.grant(&fresh, json!({"type": "telemetry", "deviceId": "d"}));
    a.assert_alive();
}

#[test]
fn an_invalid_redis_url_stops_start_up_naming_the_flag() {
    let args = common::full_args(&["--redis-url", "localhost:6379"], true);
    let (ok, _, stderr) = common::run_expecting_exit(&args, &[]);
    assert!(!ok);
    assert!(stderr.contains("--redis-url") && stderr.contains("redis://"), "{stderr}");
}

/// The cluster twin: bad seeds, or both flags (on the command line or from the environment),
/// stop start-up naming what is wrong.
#[test]
fn bad_redis_cluster_nodes_or_both_redis_flags_stop_start_up_naming_them() {
    for (seeds, needle) in [
        ("localhost:7000", "redis://"),
        ("redis://127.0.0.1:7000,,redis://127.0.0.1:7001", "empty"),
        ("redis://127.0.0.1:7000,rediss://127.0.0.1:7001", "mix"),
    ] {
        let args = common::full_args(&["--redis-cluster-nodes", seeds], true);
        let (ok, _, stderr) = common::run_expecting_exit(&args, &[]);
        assert!(!ok && stderr.contains("--redis-cluster-nodes") && stderr.contains(needle), "{seeds}: {stderr}");
    }
    let both = ["--redis-url", "redis://127.0.0.1:6379", "--redis-cluster-nodes", "redis://127.0.0.1:7000"];
    let (ok, _, stderr) = common::run_expecting_exit(&common::full_args(&both, true), &[]);
    assert!(!ok && stderr.contains("--redis-url") && stderr.contains("--redis-cluster-nodes"), "{stderr}");
    let args = common::full_args(&["--redis-url", "redis://127.0.0.1:6379"], true);
    let (ok, _, stderr) = common::run_expecting_exit(&args, &[("REDIS_CLUSTER_NODES", "redis://127.0.0.1:7000")]);
    assert!(!ok && stderr.contains("--redis-url") && stderr.contains("--redis-cluster-nodes"), "from the environment: {stderr}");
}

fn reads_answer_the_same_on_an_instance_that_neither_ingests_nor_watches_the_device(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    a.ingest(json!([
        {"deviceId": "far", "body": {"a": 1, "b": 2}},
        {"deviceId": "far", "source": "twinChangeEvents", "properties": {"opType": "replaceTwin"},
         "body": {"properties": {"reported": {"fw": "1.0"}}}},
    ]));
    // Admin reads on B: answered from A's state.
    let (status, body, _) = b.call("GET", "/lastValue/far", &[ADMIN], None);
    assert_eq!(status, 200, "{body}");
    let v = common::parse_json(&body);
    assert_eq!((v["data"]["a"]["value"].clone(), v["data"]["b"]["value"].clone()), (json!(1), json!(2)), "{body}");
    let (status, body, _) = b.call("GET", "/deviceTwin/far", &[ADMIN], None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(common::parse_json(&body)["data"]["properties"]["reported"]["fw"], json!("1.0"));
    let (status, body, _) = b.call("GET", "/connectionState/far", &[ADMIN], None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(common::parse_json(&body)["data"], json!(true));
    // A session granted only key `a` (on B) sees only `a`, and nothing of an ungranted device.
    let session = b.new_session();
    b.grant(&session, json!({"type": "telemetry", "deviceId": "far", "telemetryKey": "a"}));
    let (status, body, _) = b.call("GET", "/lastValue/far", &[("sessionId", &session)], None);
    assert_eq!(status, 200, "{body}");
    let data = common::parse_json(&body)["data"].clone();
    assert_eq!(data.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()), Some(vec!["a".to_string()]), "{body}");
    let (status, body, _) = b.call("GET", "/lastValue/far/b", &[("sessionId", &session)], None);
    assert_eq!(status, 403, "{body}");
    // Typed across: B renders what A holds as A renders it, byte for byte (values as the
    // device wrote them, `2.50` and `1e2`; keys in A's order; only the granted keys).
    let raw = br#"{"deviceId":"exact","body":{"z":2.50,"n":1e2,"s":"caf\u00e9","hidden":[1, 2]}}"#;
    let (status, body, _) = a.call_raw("POST", "/ingest", &[ADMIN, ("content-type", "application/json")], raw);
    assert_eq!(status, 200, "{body}");
    for key in ["z", "n", "s"] {
        b.grant(&session, json!({"type": "telemetry", "deviceId": "exact", "telemetryKey": key}));
    }
    for path in ["/lastValue/exact", "/lastValue/exact/z"] {
        let (status, on_b, _) = b.call("GET", path, &[("sessionId", &session)], None);
        assert_eq!(status, 200, "{on_b}");
        let (_, on_a, _) = a.call("GET", path, &[("sessionId", &session)], None);
        assert_eq!(on_b, on_a, "{path}: B answers from A what A answers");
        assert!(on_b.contains("2.50") && !on_b.contains("hidden"), "{on_b}");
    }
    // A device no instance holds answers as on one node.
    let (status, body, _) = b.call("GET", "/lastValue/nowhere", &[ADMIN], None);
    let (one_status, one_body, _) = a.call("GET", "/lastValue/nowhere", &[ADMIN], None);
    assert_eq!((status, common::error_message(&body)), (one_status, common::error_message(&one_body)));
    assert_eq!(status, 404);
}

#[test]
fn a_password_protected_redis_is_reached_with_the_password_in_the_url_and_refused_without() {
    let redis = Redis::start_with(&["--requirepass", "s3cret"]);
    let url = format!("redis://:s3cret@127.0.0.1:{}", redis.port);
    let a = Server::start(&["--redis-url", &url, "--instance-id", "a"]);
    a.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0));
    let session = a.new_session();
    a.grant(&session, json!({"type": "telemetry", "deviceId": "d"}));
    // The session is in Redis, readable with the password only.
    let keys = redis.command("AUTH s3cret\r\nKEYS hubcast:session:*").unwrap_or_default();
    assert!(keys.contains(&session), "the session is stored under the default prefix: {keys}");
    let wrong = Server::start(&["--redis-url", &redis.url(), "--instance-id", "w"]);
    // The link connects in the background: wait for its refused attempt, then its reason.
    let refused = wrong.wait_for_stderr(WAIT, |l| l.contains("Redis unreachable")).expect("the connect without the password fails");
    assert!(refused.contains("NOAUTH"), "refused for want of the password: {refused}");
    let (status, body, _) = wrong.call("GET", "/status", &[], None);
    assert_error(status, &body, 503, "redis");
    assert_eq!(wrong.metric("hubcast_redis_connected{instance=\"w\"}"), Some(0.0));
}

/// The cluster twin: the password in the seeds' URLs reaches every node, the discovered ones
/// too; seeds with different passwords stop start-up; without it the link is refused.
#[test]
fn a_password_protected_cluster_is_reached_with_the_password_in_the_first_seed_and_refused_without() {
    let cluster = common::redis::RedisCluster::start_with(3, 0, Some("s3cret"));
    let seeds = format!("redis://:s3cret@127.0.0.1:{}", cluster.port(0));
    let a = Server::start(&["--redis-cluster-nodes", &seeds, "--instance-id", "a"]);
    a.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0));
    // Sessions land on every master: each is reached with the password.
    let sessions: Vec<String> = (0..12).map(|_| a.new_session()).collect();
    for session in &sessions {
        a.grant(session, json!({"type": "telemetry", "deviceId": "d"}));
    }
    let keys = cluster.keys("hubcast:session:*");
    assert!(sessions.iter().all(|s| keys.iter().any(|k| k.contains(s.as_str()))), "every session stored: {keys:?}");
    let masters_used = cluster.masters().iter().filter(|m| cluster.command_on(**m, "DBSIZE").is_some_and(|r| r != ":0\r\n")).count();
    assert!(masters_used >= 2, "sessions spread over the masters");
    let mixed = format!("{seeds},redis://:other@127.0.0.1:{}", cluster.port(1));
    let (ok, _, stderr) = common::run_expecting_exit(&common::full_args(&["--redis-cluster-nodes", &mixed], true), &[]);
    assert!(!ok && stderr.contains("--redis-cluster-nodes") && stderr.contains("password"), "{stderr}");
    let plain = format!("redis://127.0.0.1:{}", cluster.port(0));
    let wrong = Server::start(&["--redis-cluster-nodes", &plain, "--instance-id", "w"]);
    let refused = wrong.wait_for_stderr(WAIT, |l| l.contains("Redis unreachable")).expect("the connect without the password fails");
    assert!(refused.contains("NOAUTH") || refused.contains("Authentication"), "refused for want of the password: {refused}");
    let (status, body, _) = wrong.call("GET", "/status", &[], None);
    assert_error(status, &body, 503, "redis");
}

#[test]
fn rediss_with_a_private_ca_connects_and_a_missing_ca_file_stops_start_up() {
    let tls = common::redis::TlsFiles::new();
    let (ca_pem, cert, key) = (tls.ca(), tls.cert(), tls.key());
    // TLS in front of a plain redis-server: socat terminates it (nodes speaking TLS
    // themselves: the cluster test below).
    let redis = Redis::start();
    let tls_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // Killed on drop, also when an assertion fails (it would hold the test's output open).
    struct Socat(std::process::Child);
    impl Drop for Socat {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _socat = Socat(
        std::process::Command::new("socat")
            .arg(format!("OPENSSL-LISTEN:{tls_port},bind=127.0.0.1,reuseaddr,fork,cert={cert},key={key},verify=0"))
            .arg(format!("TCP:127.0.0.1:{}", redis.port))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("socat is installed (scripts/services.sh installs it)"),
    );
    let deadline = std::time::Instant::now() + WAIT;
    while std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "socat listens");
        std::thread::sleep(Duration::from_millis(10));
    }
    let url = format!("rediss://localhost:{tls_port}");
    let a = Server::start(&["--redis-url", &url, "--redis-ca-file", &ca_pem, "--instance-id", "a"]);
    a.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0)); // TLS to Redis with the private CA
    let session = a.new_session();
    a.grant(&session, json!({"type": "telemetry", "deviceId": "d"}));
    // Without the CA the server's certificate is not trusted: the link fails, 503 naming Redis.
    let untrusting = Server::start(&["--redis-url", &url, "--instance-id", "u"]);
    // The link connects in the background: wait for its failed attempt, then its reason.
    let refused = untrusting.wait_for_stderr(WAIT, |l| l.contains("Redis unreachable")).expect("the TLS connect without the CA fails");
    assert!(refused.contains("invalid peer certificate: UnknownIssuer"), "refused for the untrusted certificate: {refused}");
    let (status, body, _) = untrusting.call("GET", "/status", &[], None);
    assert_error(status, &body, 503, "redis");
    let args = common::full_args(&["--redis-url", &url, "--redis-ca-file", "/nonexistent/ca.pem"], true);
    let (ok, _, stderr) = common::run_expecting_exit(&args, &[]);
    assert!(!ok && stderr.contains("--redis-ca-file"), "{stderr}");
}

/// `rediss://` seeds and `--redis-ca-file` on a cluster whose nodes speak TLS only (no plain
/// port, `--tls-cluster yes`): the seeds, the nodes the redis crate discovers, the shard
/// subscribers and the publishing connections all reach the nodes over TLS, trusting the
/// private CA, and live data crosses between instances by sharded pub/sub. Without the CA the
/// link fails on the certificate.
#[test]
fn rediss_cluster_nodes_with_a_private_ca_carry_sessions_and_live_data_over_tls() {
    let redis = Engine::Cluster(common::redis::RedisCluster::start_tls(3));
    let Engine::Cluster(cluster) = &redis else { unreachable!() };
    assert!(redis.flags().iter().any(|f| f.starts_with("rediss://")), "{:?}", redis.flags());
    for node in 0..cluster.len() {
        let port = cluster.command_on(node, "CONFIG GET port").unwrap_or_default();
        assert!(port.ends_with("$1\r\n0\r\n"), "node {node} has no plain port: {port:?}");
    }
    let (a, b, session, mut ws) = watched_on_b(&redis, "pump");
    // Sharded pub/sub over TLS: B subscribes on the pump's master, A publishes to it.
    a.ingest(json!({"deviceId": "pump", "body": {"n": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("A's message reaches B's socket over the TLS cluster")["telemetry"], json!({"n": 1}));
    assert_eq!(metric(&a, "hubcast_redis_published_total", "a"), 1.0);
    // The session lives in the cluster (its key on its own node), readable from B.
    let (status, body, _) = b.call("GET", "/lastValue/pump/n", &[("sessionId", &session)], None);
    assert_eq!(status, 200, "{body}");
    // Every node is reached by name over TLS: B's shard subscriber on the pump's master, A's
    // publishing connection to it (the nodes have no plain port).
    let master = cluster.owner_of(cluster.slot_of("t:device:pump"));
    let clients = cluster.command_on(master, "CLIENT LIST").unwrap_or_default();
    for name in ["hubcast-b-shard", "hubcast-a-publish"] {
        assert!(clients.contains(&format!("name={name}")), "{name} on the pump's master: {clients}");
    }
    assert_eq!(metric(&b, "hubcast_redis_cluster_masters", "b"), 3.0);
    // Without the CA the nodes' certificate is not trusted: the link fails, naming it.
    let untrusting = Server::start(&["--redis-cluster-nodes", &cluster.seeds(), "--instance-id", "u"]);
    let refused = untrusting.wait_for_stderr(WAIT, |l| l.contains("Redis unreachable")).expect("the TLS connect without the CA fails");
    assert!(refused.contains("invalid peer certificate"), "refused for the untrusted certificate: {refused}");
}

fn behind_a_plain_load_balancer_a_socketio_client_survives_kill_9_of_its_instance_and_keeps_its_session(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let lb = common::lb::Balancer::start(&[a.port, b.port]);
    // Every REST call through the balancer: round-robin, no stickiness.
    let agent = common::new_agent();
    let call = |method: &str, path: &str, headers: &[(&str, &str)], body: Option<Value>| {
        let mut req = agent.request(method, &format!("{}{path}", lb.base()));
        for (k, v) in headers {
            req = req.set(k, v);
        }
        let res = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match res {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => panic!("{method} {path} through the balancer: {e}"),
        }
    };
    let (status, body) = call("POST", "/session", &[], None);
    assert_eq!(status, 200, "{body}");
    let session = common::parse_json(&body)["sessionId"].as_str().unwrap().to_string();
    let request = json!({"sessionId": session, "type": "telemetry", "deviceId": "pump"});
    assert_eq!(call("PUT", "/grants", &[ADMIN], Some(request.clone())).0, 204);
    assert_eq!(call("PUT", "/subscription", &[], Some(request.clone())).0, 204);
    let client = common::sio::socketio_at(&lb.base(), &[&session], "websocket", true, &[]);
    assert!(client.wait_for("connect", WAIT).is_some(), "connects through the balancer");
    // Which instance holds the socket? Kill that one; data comes from the other.
    let sockets = |s: &Server| s.metric("hubcast_sockets{transport=\"socketio_websocket\"}").unwrap_or(0.0);
    let (mut holder, survivor, survivor_id) = if sockets(&a) > 0.0 { (a, b, "b") } else { (b, a, "a") };
    wait_watched_elsewhere(&survivor, survivor_id, 1.0);
    survivor.ingest(json!({"deviceId": "pump", "body": {"n": 1}}));
    let first = client.wait_for("data", WAIT).expect("data before the failover");
    assert_eq!(first["data"]["telemetry"], json!({"n": 1}));
    holder.signal(libc::SIGKILL);
    holder.wait_exit(WAIT);
    assert!(client.wait_for("disconnect", WAIT).is_some(), "the client sees its instance go");
    assert!(client.wait_for("connect", WAIT).is_some(), "and reconnects through the balancer to the other one");
    // Same session, loaded from Redis on the survivor, which ingests the device itself.
    survivor.ingest(json!({"deviceId": "pump", "body": {"n": 2}}));
    let next = client.wait_for("data", WAIT).expect("data after the failover, with the old session");
    assert_eq!(next["data"]["telemetry"], json!({"n": 2}));
    assert_eq!(survivor.metric("hubcast_sockets{transport=\"socketio_websocket\"}"), Some(1.0), "{survivor_id} holds it now");
}

fn live_data_between_instances_resumes_by_itself_after_redis_restarts(mut redis: Engine) {
    let (a, b, _, mut ws) = watched_on_b(&redis, "tank");
    a.ingest(json!({"deviceId": "tank", "body": {"level": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("before the restart")["telemetry"], json!({"level": 1}));
    // Redis restarts empty (no persistence): both instances see it go and come back, B
    // announces again what it watches, and A publishes to it again; nothing crashes.
    redis.down();
    for (s, id) in [(&a, "a"), (&b, "b")] {
        let series = format!("hubcast_redis_connected{{instance=\"{id}\"}}");
        s.wait_for_metric(&series, WAIT, Want::Eq(0.0)); // each sees Redis go
    }
    wait_watched_elsewhere(&a, "a", 1.0);
    redis.up();
    for (s, id) in [(&a, "a"), (&b, "b")] {
        let series = format!("hubcast_redis_connected{{instance=\"{id}\"}}");
        s.wait_for_metric(&series, WAIT, Want::Eq(1.0)); // and reconnects by itself
    }
    // B announces its watch again (on a cluster once its shard subscriber is back, after it
    // says it is connected).
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let watching = redis.command(&format!("SMEMBERS {}", redis.control_key("t", "watching:b"))).unwrap_or_default();
        if watching.contains("tank") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "B announced its watch again: {watching}\nB: {:?}", b.stderr_lines());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Live data resumes by itself: A ingests until B's socket has it. A learns B's watch on
    // the watch channel or, were that announcement lost (on a cluster: published while the
    // restarted nodes' bus links came back), from B's watching set within a few heartbeats.
    let deadline = std::time::Instant::now() + RESYNC_WAIT;
    let mut level = 2;
    let first = loop {
        a.ingest(json!({"deviceId": "tank", "body": {"level": level}}));
        if let Some(frame) = ws.next_json(Duration::from_millis(250)) {
            break frame;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "live data resumes after the restart, on the same socket (A knows of {} watched devices, corrected {})\nA: {:?}\nB: {:?}",
            metric(&a, "hubcast_redis_watched_elsewhere_devices", "a"),
            metric(&a, "hubcast_redis_watch_resyncs_total", "a"),
            a.stderr_lines(),
            b.stderr_lines()
        );
        level += 1;
    };
    assert!(first["telemetry"]["level"].as_i64().is_some_and(|l| l >= 2), "{first}");
    eprintln!("after the restart: level {level} first, {} watches corrected", metric(&a, "hubcast_redis_watch_resyncs_total", "a"));
    // B checked its session against Redis after reconnecting: gone with Redis's data, with
    // no tombstone, so kept (cluster/resync.rs), and its socket still served.
    b.wait_for_metric("hubcast_redis_sessions_checked_total{instance=\"b\"}", WAIT, Want::AtLeast(1.0));
    assert_eq!(metric(&b, "hubcast_redis_sessions_reloaded_total", "b"), 0.0, "nothing dropped nor read again");
    a.ingest(json!({"deviceId": "tank", "body": {"level": 0}}));
    let mut frame = ws.next_json(WAIT).expect("the socket on B is still served after the check");
    while frame["telemetry"]["level"] != json!(0) {
        frame = ws.next_json(WAIT).expect("the socket on B is still served after the check");
    }
    assert!(a.metric("hubcast_redis_reconnects_total{instance=\"a\"}").unwrap_or(0.0) >= 1.0);
    a.assert_alive();
    b.assert_alive();
}

/// How long a watch whose announcement was lost takes at most to be learnt from the
/// `watching` sets: two checks in a row find the sizes differ (a heartbeat apart, 2 s with the
/// default `--lease-ttl`), then the set is read; with room for a loaded machine.
const RESYNC_WAIT: Duration = Duration::from_secs(20);

/// The `watch` channel's safety net (issue 23, "Known gaps"): a watch whose announcement never
/// arrived (on a cluster a classic `PUBLISH` made while the bus links come back after a
/// restart is lost) is learnt from the instance's `watching` set within a few heartbeats, and
/// a watch dropped without a word is forgotten likewise; each correction is counted and
/// nothing else is. The lost announcement is made deterministic: instance `ghost` is written
/// straight into Redis (its presence and its set, as an instance writes them, without the
/// publication); B announces its own watch the normal way.
fn a_watch_whose_announcement_was_lost_is_learnt_from_the_watching_set(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let session = session_watching(&b, "pump");
    let mut ws = b.live(&session);
    wait_watched_elsewhere(&a, "a", 1.0);
    let presence = match &redis {
        Engine::Single(_) => "SET t:instance:ghost 1 PX 600000".to_string(),
        Engine::Cluster(_) => format!("ZADD {} 99999999999999 ghost", redis.control_key("t", "instances")),
    };
    assert!(redis.command(&presence).is_some_and(|r| !r.starts_with('-')), "ghost's presence written");
    let set = redis.control_key("t", "watching:ghost");
    assert_eq!(redis.command(&format!("SADD {set} tank")).as_deref(), Some(":1\r\n"));
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(3.0)); // A sees ghost
    a.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"a\"}", RESYNC_WAIT, Want::Eq(2.0)); // and learns its watch
    assert_eq!(metric(&a, "hubcast_redis_watch_resyncs_total", "a"), 1.0, "one watch corrected");
    // A publishes tank's messages now (pump's too, which B watches).
    let published = metric(&a, "hubcast_redis_published_total", "a");
    a.ingest(json!({"deviceId": "tank", "body": {"level": 1}}));
    a.wait_for_metric("hubcast_redis_published_total{instance=\"a\"}", WAIT, Want::Eq(published + 1.0));
    // ghost drops its watch without a word: A stops publishing tank.
    assert_eq!(redis.command(&format!("SREM {set} tank")).as_deref(), Some(":1\r\n"));
    a.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"a\"}", RESYNC_WAIT, Want::Eq(1.0));
    assert_eq!(metric(&a, "hubcast_redis_watch_resyncs_total", "a"), 2.0, "one more corrected");
    a.ingest(json!({"deviceId": "tank", "body": {"level": 2}}));
    a.ingest(json!({"deviceId": "pump", "body": {"n": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("pump's message reaches B")["telemetry"], json!({"n": 1}));
    assert_eq!(metric(&a, "hubcast_redis_published_total", "a"), published + 2.0, "tank's second message was not published");
    // B's watch, announced the normal way, never needed a correction on A (B corrects its own
    // view of ghost too, on its own heartbeats: not counted here).
    assert_eq!(metric(&a, "hubcast_redis_watch_resyncs_total", "a"), 2.0);
}

/// Read-your-writes across instances: B answers a grant once it is in Redis; A decides a
/// subscription on Redis's copy, and reads the session again before refusing a read, so a
/// change published but not yet applied on A neither refuses nor (written back) erases it.
fn a_grant_given_on_one_instance_holds_at_once_on_another(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    a.ingest(json!({"deviceId": "meter", "body": {"kwh": 3}}));
    for round in 0..30 {
        let session = a.new_session();
        // A holds a copy first (a call there), so it does not simply load the new state.
        let (status, _) = a.subscribe(&session, json!({"type": "telemetry", "deviceId": "meter"}));
        assert_eq!(status, 403, "round {round}: not granted yet");
        b.grant(&session, json!({"type": "telemetry", "deviceId": "meter"}));
        let (status, body) = a.subscribe(&session, json!({"type": "telemetry", "deviceId": "meter"}));
        assert_eq!(status, 204, "round {round}: the grant given on B holds on A at once: {body}");
        let (status, body, _) = a.call("GET", "/lastValue/meter/kwh", &[("sessionId", &session)], None);
        assert_eq!(status, 200, "round {round}: {body}");
        assert!(
            redis.command(&format!("HGETALL {}", redis.session_key("t", &session))).is_some_and(|r| r.contains("a:meter")),
            "round {round}: the grant is still in Redis"
        );
        b.revoke(&session, json!({"type": "telemetry", "deviceId": "meter"}));
        let (status, _, _) = b.call("GET", "/lastValue/meter/kwh", &[("sessionId", &session)], None);
        assert_eq!(status, 403, "round {round}: revoked on B");
    }
}

/// Slots move while instances serve (`redis-cli --cluster reshard`, keys with them: `ASK`
/// during the move, `MOVED` after): every master's slots, the control slot `{t}` among them,
/// go to another, while A ingests 20 msg/s for a socket on B; what arrives meanwhile comes
/// once each and in order, the moves are counted and followed, sessions stay readable and
/// changeable, live data keeps crossing, no reconnect is needed.
#[test]
fn a_cluster_resharded_under_the_instances_keeps_sessions_and_live_data() {
    let redis = Engine::cluster();
    let Engine::Cluster(cluster) = &redis else { unreachable!() };
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let sessions: Vec<String> = (0..6).map(|_| a.new_session()).collect();
    for s in &sessions {
        let request = json!({"type": "telemetry", "deviceId": "pump"});
        a.grant(s, request.clone());
        assert_eq!(a.subscribe(s, request).0, 204);
    }
    let mut ws = b.live(&sessions[0]);
    wait_watched_elsewhere(&a, "a", 1.0);
    a.ingest(json!({"deviceId": "pump", "body": {"n": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("before the reshard")["telemetry"], json!({"n": 1}));
    // Every slot of each master in turn moves to the next one, while A ingests 20 msg/s.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let sent = std::thread::scope(|scope| {
        let ingesting = scope.spawn(|| {
            let mut n = 100;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a.ingest(json!({"deviceId": "pump", "body": {"n": n}}));
                n += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            n - 100
        });
        // B's client reads meanwhile, as a real one does (it answers the server's pings): on a
        // loaded machine the reshard outlasts pingInterval + pingTimeout (45 s), after which
        // the server rightly closes a socket that never answered, and B stops watching.
        let reading = scope.spawn(|| {
            let mut mid: Vec<i64> = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(frame) = ws.next_json(Duration::from_millis(200)) {
                    mid.extend(frame["telemetry"]["n"].as_i64());
                }
            }
            mid
        });
        for (from, to) in [(0, 1), (1, 2), (2, 0)] {
            cluster.reshard(from, to, 16384);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (ingesting.join().expect("the ingesting thread"), reading.join().expect("the reading thread"))
    });
    let (sent, mut mid) = sent;
    // What was sent mid-stream: every message arrived, once, in order (one published while
    // its slot moved is published again until B has it: design step 7).
    while let Some(frame) = ws.next_json(Duration::from_millis(1000)) {
        mid.extend(frame["telemetry"]["n"].as_i64());
    }
    assert_eq!(ws.closed, None, "B's socket stayed open through the reshard");
    eprintln!(
        "reshard mid-stream: {} of {sent} messages arrived; A published {} again, gave {} up; B dropped {} received twice",
        mid.len(),
        metric(&a, "hubcast_redis_republished_total", "a"),
        metric(&a, "hubcast_redis_republish_given_up_total", "a"),
        metric(&b, "hubcast_redis_duplicates_dropped_total", "b")
    );
    assert!(sent > 0, "messages were sent during the reshard");
    assert_eq!(mid, (100..100 + sent).collect::<Vec<i64>>(), "every message sent during the reshard, once each, in order");
    // Every key went round all three masters and is on node 0 now.
    let everywhere = cluster.keys("*").len();
    assert_eq!(cluster.command_on(0, "DBSIZE"), Some(format!(":{everywhere}\r\n")));
    for (i, s) in sessions.iter().enumerate() {
        // Changed on B (which never held the session): loaded and written where it lives now.
        let request = json!({"type": "telemetry", "deviceId": format!("other-{i}")});
        b.grant(s, request.clone());
        assert_eq!(b.subscribe(s, request).0, 204, "session {i} changeable after its slot moved");
        let stored = redis.command(&format!("HGETALL {}", redis.session_key("t", s))).unwrap_or_default();
        assert!(stored.contains(&format!("a:other-{i}")) && stored.contains("a:pump"), "session {i} in Redis: {stored}");
    }
    a.ingest(json!({"deviceId": "pump", "body": {"n": 2}}));
    let after = ws.next_json(WAIT).unwrap_or_else(|| {
        let names = ["published_total", "received_total", "dropped_total", "reconnects_total", "instances", "watched_elsewhere_devices"];
        let seen: Vec<(String, f64)> =
            [(&a, "a"), (&b, "b")].iter().flat_map(|(s, id)| names.map(|n| (format!("{id} {n}"), metric(s, &format!("hubcast_redis_{n}"), id)))).collect();
        panic!("after the reshard, on the same socket: nothing; {seen:?}\nA: {:?}\nB: {:?}", a.stderr_lines(), b.stderr_lines())
    });
    assert_eq!(after["telemetry"], json!({"n": 2}));
    // The device's channel moved three times: each time its old master unsubscribed B unasked
    // (sharded pub/sub), which B counted and followed.
    assert!(metric(&b, "hubcast_redis_slot_moves_total", "b") >= 1.0, "slot moves counted on B");
    let resubscribed = b.metric("hubcast_redis_resubscribes_total{instance=\"b\",reason=\"sunsubscribe\"}").unwrap_or(0.0);
    assert!(resubscribed >= 1.0, "and followed: {resubscribed}");
    for (s, id) in [(&a, "a"), (&b, "b")] {
        assert_eq!(metric(s, "hubcast_redis_reconnects_total", id), 0.0, "{id} never lost its link");
    }
}

/// Lossless slot moves (design step 7): B is frozen (SIGSTOP) while the slot of a device it
/// watches moves, so its old master unsubscribes it and it cannot subscribe on the new one
/// until it runs again; what A ingests meanwhile reaches nobody (`SPUBLISH` answers 0, one
/// instance watches), so A publishes it again until B has it: B's socket gets every message
/// once, in order, on the same socket. Fails without step 7 (those messages are lost).
#[test]
fn messages_published_while_their_slot_moves_reach_the_watcher_once_and_in_order() {
    let redis = Engine::cluster();
    let Engine::Cluster(cluster) = &redis else { unreachable!() };
    let (a, b, _, mut ws) = watched_on_b(&redis, "pump");
    a.ingest(json!({"deviceId": "pump", "body": {"n": 0}}));
    assert_eq!(ws.next_json(WAIT).expect("before the move")["telemetry"], json!({"n": 0}));
    let slot = cluster.slot_of("t:device:pump");
    let to = (cluster.owner_of(slot) + 1) % 3;
    b.signal(libc::SIGSTOP);
    cluster.move_slot(slot, to);
    for n in 1..=5 {
        a.ingest(json!({"deviceId": "pump", "body": {"n": n}}));
    }
    // Short of B: published again (while B is frozen, every 50 ms).
    let republishing = a.wait_for_metric("hubcast_redis_republished_total{instance=\"a\"}", WAIT, Want::AtLeast(1.0));
    b.signal(libc::SIGCONT);
    let mut got: Vec<i64> = Vec::new();
    while got.last() != Some(&5) {
        let frame = ws.next_json(WAIT).unwrap_or_else(|| panic!("every message reaches B after the move; got {got:?}\nA: {:?}\nB: {:?}", a.stderr_lines(), b.stderr_lines()));
        got.extend(frame["telemetry"]["n"].as_i64());
    }
    assert_eq!(got, vec![1, 2, 3, 4, 5], "once each, in order");
    a.ingest(json!({"deviceId": "pump", "body": {"n": 6}}));
    assert_eq!(ws.next_json(WAIT).expect("and the next")["telemetry"], json!({"n": 6}), "nothing twice");
    eprintln!(
        "slot moved under a frozen watcher: A published {} again ({republishing} before B ran again), B dropped {} received twice",
        metric(&a, "hubcast_redis_republished_total", "a"),
        metric(&b, "hubcast_redis_duplicates_dropped_total", "b")
    );
    assert_eq!(metric(&a, "hubcast_redis_republish_given_up_total", "a"), 0.0);
    assert!(metric(&b, "hubcast_redis_slot_moves_total", "b") >= 1.0, "B saw the move");
    assert_eq!(ws.closed, None);
}

/// One pipeline per master per batch (cluster/shards.rs `Publisher`): after a slot moves, A's
/// next pipeline to the slot's old master carries that slot's messages among those of other
/// slots the master still serves; the moved slot's commands alone answer `MOVED`. Every
/// message of every device still reaches the watcher once, in order, on the same socket and
/// with no reconnect: the redirected ones are published again (not the whole pipeline, as
/// the redis crate's cluster connection would, bouncing the rest between the two masters).
#[test]
fn a_slot_moved_under_a_pipeline_grouped_per_master_delivers_every_message_once_in_order() {
    let redis = Engine::cluster();
    let Engine::Cluster(cluster) = &redis else { unreachable!() };
    // One core: the messages of one `POST /ingest` are published as one batch.
    let mut args: Vec<String> = redis.flags();
    args.extend(["--instance-id", "a", "--redis-prefix", "t", "--cores", "1"].map(String::from));
    let a = Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    a.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0));
    let b = instance(&redis, "b");
    // Devices of several slots, all on one master.
    let master = cluster.owner_of(cluster.slot_of("t:device:g-0"));
    let devices: Vec<String> = (0..200).map(|i| format!("g-{i}")).filter(|d| cluster.owner_of(cluster.slot_of(&format!("t:device:{d}"))) == master).take(6).collect();
    assert_eq!(devices.len(), 6, "six devices on master {master}");
    let session = a.telemetry_session(&devices);
    let mut ws = b.live(&session);
    wait_watched_elsewhere(&a, "a", devices.len() as f64);
    let round = |n: i64| a.ingest(Value::Array(devices.iter().map(|d| json!({"deviceId": d, "body": {"n": n}})).collect()));
    let mut got: std::collections::BTreeMap<String, Vec<i64>> = std::collections::BTreeMap::new();
    let take = |ws: &mut common::ws::Live, last: i64, got: &mut std::collections::BTreeMap<String, Vec<i64>>| {
        while devices.iter().any(|d| got.get(d).and_then(|v| v.last()) != Some(&last)) {
            let frame = ws.next_json(WAIT).unwrap_or_else(|| panic!("every device's message {last} reaches B; got {got:?}\nA: {:?}\nB: {:?}", a.stderr_lines(), b.stderr_lines()));
            got.entry(frame["deviceId"].as_str().unwrap_or_default().to_string()).or_default().extend(frame["telemetry"]["n"].as_i64());
        }
    };
    round(0);
    take(&mut ws, 0, &mut got);
    // A learnt the slot map with its first batch; the first device's slot moves now.
    let slot = cluster.slot_of(&format!("t:device:{}", devices[0]));
    cluster.move_slot(slot, (master + 1) % 3);
    for n in 1..=5 {
        round(n);
    }
    take(&mut ws, 5, &mut got);
    for d in &devices {
        assert_eq!(got[d], vec![0, 1, 2, 3, 4, 5], "{d}: once each, in order");
    }
    round(6);
    take(&mut ws, 6, &mut got);
    assert!(devices.iter().all(|d| got[d].len() == 7), "nothing twice: {got:?}");
    // The moved slot's messages were answered `MOVED` and published again to its new master.
    assert!(metric(&a, "hubcast_redis_republished_total", "a") >= 1.0, "A published the redirected messages again");
    assert_eq!(metric(&a, "hubcast_redis_republish_given_up_total", "a"), 0.0);
    for (s, id) in [(&a, "a"), (&b, "b")] {
        assert_eq!(metric(s, "hubcast_redis_reconnects_total", id), 0.0, "{id} never lost its link");
    }
    assert_eq!(ws.closed, None);
}

/// Wire v2 (design step 7): a device message received again (the same origin's sequence
/// number, or an older one: published again after a slot move) is applied once. Crafted with
/// hubcast's own encoder from a made-up instance; the rule is the receiver's, whatever the
/// engine.
#[test]
fn a_device_message_received_twice_is_applied_once() {
    use hubcast::cluster::wire::encode_message;
    use hubcast::ingest::{IngestMessage, Properties, SourceKind};
    let engine = Engine::single();
    let Engine::Single(redis) = &engine else { unreachable!() };
    let b = instance(&engine, "b");
    let session = session_watching(&b, "twice");
    let mut ws = b.live(&session);
    // Announced once subscribed.
    let deadline = std::time::Instant::now() + WAIT;
    while !redis.command("SMEMBERS t:watching:b").unwrap_or_default().contains("twice") {
        assert!(std::time::Instant::now() < deadline, "B watches the device");
        std::thread::sleep(Duration::from_millis(20));
    }
    let message = |n: i64| IngestMessage {
        device_id: "twice".into(),
        source: SourceKind::Telemetry,
        properties: Properties::new(),
        body: json!({"n": n}).to_string().into_bytes(),
        enqueued_at: None,
        arrived: None,
        key: Default::default(),
    };
    for (seq, n) in [(7, 1), (7, 1), (8, 2), (7, 1), (9, 3)] {
        publish_bytes(redis, "t:device:twice", &encode_message("z", seq, &message(n)));
    }
    let got: Vec<i64> = (0..3).filter_map(|_| ws.next_json(WAIT).expect("a message")["telemetry"]["n"].as_i64()).collect();
    assert_eq!(got, vec![1, 2, 3], "each once, in order");
    assert_eq!(metric(&b, "hubcast_redis_duplicates_dropped_total", "b"), 2.0);
    assert_eq!(metric(&b, "hubcast_redis_received_total", "b"), 3.0);
}

/// Sharded pub/sub (issue 23.1): an instance receiving devices whose channels are spread over
/// every master holds exactly one subscriber connection per master (`CLIENT LIST`, named
/// `hubcast-<instance>-shard`), and each device's messages reach it.
#[test]
fn one_shard_subscriber_per_master_carries_every_device() {
    let redis = Engine::cluster();
    let Engine::Cluster(cluster) = &redis else { unreachable!() };
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let devices: Vec<String> = (0..30).map(|i| format!("spread-{i}")).collect();
    let session = b.telemetry_session(&devices);
    let mut ws = b.live(&session);
    wait_watched_elsewhere(&a, "a", devices.len() as f64);
    for (i, d) in devices.iter().enumerate() {
        a.ingest(json!({"deviceId": d, "body": {"n": i}}));
    }
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < devices.len() {
        let frame = ws.next_json(WAIT).unwrap_or_else(|| panic!("every device's message reaches B; got {seen:?}"));
        seen.insert(frame["deviceId"].as_str().unwrap_or_default().to_string());
    }
    for m in cluster.masters() {
        let clients = cluster.command_on(m, "CLIENT LIST").unwrap_or_default();
        let shard = clients.lines().filter(|l| l.contains("name=hubcast-b-shard ")).count();
        assert_eq!(shard, 1, "one subscriber of B on master {m}: {clients}");
        assert!(!clients.contains("name=hubcast-a-shard "), "A watches nothing: no subscriber of A on master {m}");
    }
    assert_eq!(metric(&b, "hubcast_redis_cluster_masters", "b"), 3.0);
    assert_eq!(metric(&b, "hubcast_redis_pubsub_connections", "b"), 4.0, "3 shard subscribers and the control one");
}

/// A master fails over to its replica (3 masters with a replica each; the one serving the
/// device's channel killed): the instances follow the new master (commands through the
/// cluster connection, the shard subscriber by its lost connection and a fresh slot map) and
/// live data crosses again on the same socket. A message published to the dead master before
/// the failover is lost, as in an outage.
#[test]
fn a_master_failing_over_to_its_replica_keeps_live_data_crossing() {
    let mut redis = Engine::Cluster(common::redis::RedisCluster::start(3, 1));
    let (a, b, _, mut ws) = watched_on_b(&redis, "pump");
    a.ingest(json!({"deviceId": "pump", "body": {"n": 0}}));
    assert_eq!(ws.next_json(WAIT).expect("before the failover")["telemetry"], json!({"n": 0}));
    let Engine::Cluster(cluster) = &mut redis else { unreachable!() };
    // A key of the channel's slot (its whole name as the hash tag) finds the channel's master.
    assert_eq!(cluster.command("SET {t:device:pump} 1").as_deref(), Some("+OK\r\n"));
    let masters = cluster.masters();
    let serving = *masters.iter().find(|m| cluster.command_on(**m, "EXISTS {t:device:pump}").as_deref() == Some(":1\r\n")).expect("a master serves the channel");
    cluster.kill(serving);
    let deadline = std::time::Instant::now() + WAIT;
    while cluster.masters().len() < 3 {
        assert!(std::time::Instant::now() < deadline, "a replica took over: masters {:?}", cluster.masters());
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.wait_ok();
    // Ingested until one arrives (what is published before B follows may be lost).
    let mut n = 1;
    let frame = loop {
        a.ingest(json!({"deviceId": "pump", "body": {"n": n}}));
        if let Some(frame) = ws.next_json(Duration::from_millis(500)) {
            break frame;
        }
        assert!(n < 40, "live data crosses again within 20 s of the failover");
        n += 1;
    };
    assert!(frame["telemetry"]["n"].as_i64().is_some_and(|got| got >= 1), "{frame}");
    let followed: f64 = ["reconnect", "sunsubscribe", "moved"]
        .iter()
        .map(|r| b.metric(&format!("hubcast_redis_resubscribes_total{{instance=\"b\",reason=\"{r}\"}}")).unwrap_or(0.0))
        .sum::<f64>()
        + metric(&b, "hubcast_redis_reconnects_total", "b");
    assert!(followed >= 1.0, "B followed the channel to the new master");
}

/// The Redis Cluster harness itself (tests/common/redis.rs): a key is found wherever it
/// lives (`MOVED` followed), a reshard moves slots with their keys, a killed node restarts
/// as itself and the cluster is whole again.
#[test]
fn the_cluster_harness_routes_reshards_and_restarts() {
    let mut cluster = common::redis::RedisCluster::start(3, 0);
    assert_eq!(cluster.masters().len(), 3);
    for i in 0..30 {
        assert_eq!(cluster.command(&format!("SET k{i} {i}")).as_deref(), Some("+OK\r\n"));
    }
    let on = |c: &common::redis::RedisCluster, node: usize| c.command_on(node, "DBSIZE").unwrap_or_default();
    let before: Vec<String> = (0..3).map(|n| on(&cluster, n)).collect();
    assert!(before.iter().all(|n| n != ":0\r\n" && n != ":30\r\n"), "keys spread over the masters: {before:?}");
    cluster.reshard(0, 1, 16384 / 3);
    assert_eq!(on(&cluster, 0), ":0\r\n", "every slot of node 0 and its keys moved");
    for i in 0..30 {
        assert!(cluster.command(&format!("GET k{i}")).is_some_and(|r| r.ends_with(&format!("\r\n{i}\r\n"))), "k{i} found after the reshard");
    }
    assert_eq!(cluster.keys("k*").len(), 30);
    let masters = cluster.masters();
    assert_eq!(masters, vec![0, 1, 2], "node 0, without slots, is still a master");
    cluster.kill(2);
    cluster.restart(2);
    cluster.wait_ok();
    assert_eq!(cluster.masters(), masters, "node 2 came back as the master of its slots");
    assert_eq!(on(&cluster, 2), ":0\r\n", "empty (nothing persisted)");
}

/// Polls `server`'s `GET /lastValue/<device>/n` until it answers `n`; fails with the last answer.
fn wait_last_n(server: &Server, device: &str, n: i64, on: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (status, body, _) = server.call("GET", &format!("/lastValue/{device}/n"), &[ADMIN], None);
        if status == 200 && common::parse_json(&body)["data"]["n"].as_i64() == Some(n) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{on} answers the current n = {n} of {device}; it answers {status} {body}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Issue 23 item 5: a copy learnt from another instance while a socket here watched the
/// device is not current once nobody here watches it (no more messages come): reads ask the
/// device's reader again instead of answering the old copy for good.
fn a_replica_no_longer_watched_is_not_answered_once_newer_data_exists_elsewhere(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let session = session_watching(&b, "w");
    let mut ws = b.live(&session);
    wait_watched_elsewhere(&a, "a", 1.0);
    a.ingest(json!({"deviceId": "w", "body": {"n": 1}}));
    let frame = ws.next_json(WAIT).expect("n = 1 reaches the socket on B");
    assert_eq!(frame["telemetry"]["n"], json!(1));
    wait_last_n(&b, "w", 1, "B (watching)");
    // Counted once Redis answered the PUBLISH, which may be after B got it.
    a.wait_for_metric("hubcast_redis_published_total{instance=\"a\"}", WAIT, Want::Eq(1.0));
    drop(ws);
    wait_watched_elsewhere(&a, "a", 0.0);
    a.ingest(json!({"deviceId": "w", "body": {"n": 2}}));
    wait_last_n(&b, "w", 2, "B (no longer watching, holding n = 1)");
    assert_eq!(metric(&a, "hubcast_redis_published_total", "a"), 1.0, "n = 2 was not published: nobody watches");
}

/// Issue 23 item 5: values an instance loads from its durable store at start were written
/// before it (re)joined; another instance may hold newer, and then answers.
fn values_loaded_from_the_store_are_not_answered_once_newer_data_exists_elsewhere(redis: Engine) {
    let dir = common::TempDir::new();
    let mut args = redis.flags();
    args.extend(["--instance-id", "a", "--redis-prefix", "t", "--data-dir", dir.0.to_str().unwrap()].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut a = Server::start(&args);
    a.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0));
    let b = instance(&redis, "b");
    a.ingest(json!([{"deviceId": "kept", "body": {"n": 1}}, {"deviceId": "only-a", "body": {"n": 7}}]));
    a.signal(libc::SIGTERM);
    assert!(a.wait_exit(WAIT).is_some_and(|s| s.success()), "A stops gracefully");
    b.ingest(json!({"deviceId": "kept", "body": {"n": 2}}));
    let a = Server::start(&args);
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(2.0));
    wait_last_n(&a, "kept", 2, "A (restarted with n = 1 in its store)");
    // What nobody else holds newer of is answered from the store, as one node would.
    wait_last_n(&a, "only-a", 7, "A");
}

/// The node holding `key` (a cluster: the master where it exists; one Redis: 0).
fn node_of(redis: &Engine, key: &str) -> Option<usize> {
    match redis {
        Engine::Single(_) => Some(0),
        Engine::Cluster(c) => c.masters().into_iter().find(|m| c.command_on(*m, &format!("EXISTS {key}")).as_deref() == Some(":1\r\n")),
    }
}

/// Calls per command (`INFO commandstats`) on node `node` of `redis`, e.g. `hmget` → 3.
fn command_calls(redis: &Engine, node: usize) -> std::collections::HashMap<String, u64> {
    let info = match redis {
        Engine::Single(r) => r.command("INFO commandstats"),
        Engine::Cluster(c) => c.command_on(node, "INFO commandstats"),
    }
    .unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Issue 23 item 3b: a request's session changes go to Redis as one change. `PUT
/// /subscriptions` of 1,000 devices costs two round trips, counted by the test's own
/// redis-server (`INFO commandstats`): one `HMGET` of the session's version and accesses, one
/// `EVAL` that checks the version, writes every field and publishes one change (before: a
/// `WATCH`, `EXISTS`/`HGET`, `MULTI`…`EXEC` and a wait for the echo per device, 1,000 in a
/// row). With a second instance holding the session, the same; it applies the one change.
fn a_thousand_subscriptions_in_one_request_cost_two_redis_round_trips(redis: Engine) {
    const DEVICES: usize = 1000;
    let a = instance(&redis, "a");
    let mut b = None;
    for instances in [1, 2] {
        if instances == 2 {
            b = Some(instance(&redis, "b"));
        }
        // On a cluster: a session on another master than the control slot's, whose
        // heartbeat scripts would be counted too; its node's commands are counted.
        let control = node_of(&redis, &redis.control_key("t", "instances"));
        let (session, node) = loop {
            let session = a.new_session();
            let node = node_of(&redis, &redis.session_key("t", &session)).expect("the session is stored");
            if !redis.is_cluster() || Some(node) != control {
                break (session, node);
            }
        };
        let devices: Vec<String> = (0..DEVICES).map(|i| format!("bulk-{instances}-{i}")).collect();
        for device in &devices {
            a.grant(&session, json!({"type": "telemetry", "deviceId": device}));
        }
        if let Some(b) = &b {
            // B holds a copy of the session (loaded by a change made there).
            assert_eq!(b.subscribe(&session, json!({"type": "telemetry", "deviceId": devices[0]})).0, 204);
        }
        let body: Vec<Value> = devices.iter().map(|d| json!({"sessionId": session, "type": "telemetry", "deviceId": d})).collect();
        let watched = ["hmget", "eval", "evalsha", "watch", "multi", "exec", "hget", "hset", "hdel", "publish"];
        let publishes = || command_calls(&redis, control.unwrap_or(0)).get("publish").copied().unwrap_or(0);
        let (before, published_before) = (command_calls(&redis, node), publishes());
        let started = std::time::Instant::now();
        let (status, answer, _) = a.call("PUT", "/subscriptions", &[], Some(Value::Array(body)));
        let took = started.elapsed();
        let (after, published_after) = (command_calls(&redis, node), publishes());
        let delta: Vec<(&str, u64)> = watched
            .iter()
            .map(|c| (*c, after.get(*c).unwrap_or(&0) - before.get(*c).unwrap_or(&0)))
            .filter(|(_, n)| *n > 0)
            .collect();
        eprintln!("PUT /subscriptions of {DEVICES} devices, {instances} instance(s): {} ms, Redis commands {delta:?}", took.as_millis());
        assert_eq!(status, 200, "{answer}");
        assert_eq!(common::parse_json(&answer).as_array().map(Vec::len), Some(DEVICES), "every subscription applied");
        // What the client sent: one HMGET, one EVAL (Redis also counts the commands the
        // script runs: an HGET of the version, an HSET per device, one PUBLISH).
        let sent: Vec<(&str, u64)> = delta.iter().copied().filter(|(c, _)| ["hmget", "eval", "evalsha", "watch", "multi", "exec"].contains(c)).collect();
        assert_eq!(sent, vec![("hmget", 1), ("eval", 1)], "{instances} instance(s): two round trips for {DEVICES} devices: {delta:?}");
        // One publication (a cluster: from the control node, after the script).
        assert_eq!(published_after - published_before, 1, "one publication: {delta:?}");
        // In force at once on A: a device message reaches the session's socket there.
        let mut ws = a.live(&session);
        a.ingest(json!({"deviceId": devices[DEVICES - 1], "body": {"n": 1}}));
        let frame = ws.next_json(WAIT).expect("the last device's message reaches the socket");
        assert_eq!(frame["deviceId"].as_str(), Some(devices[DEVICES - 1].as_str()));
    }
}

/// `PUBLISH <channel> <payload>` with a binary payload (RESP, one reply read).
fn publish_bytes(redis: &Redis, channel: &str, payload: &[u8]) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", redis.port)).expect("redis-server answers");
    let mut cmd = format!("*3\r\n$7\r\nPUBLISH\r\n${}\r\n{channel}\r\n${}\r\n", channel.len(), payload.len()).into_bytes();
    cmd.extend_from_slice(payload);
    cmd.extend_from_slice(b"\r\n");
    s.write_all(&cmd).unwrap();
    let mut reply = [0u8; 64];
    let n = s.read(&mut reply).unwrap();
    assert!(reply[..n].starts_with(b":"), "PUBLISH answered {:?}", String::from_utf8_lossy(&reply[..n]));
}

/// Issue 23 item 3b: every instance applies a shared access change only if its version is
/// newer than what it holds. A revoke (the session's version 2) is in force on B; a late copy
/// of the grant it replaced (version 1, as a slow publication would bring it) must not bring
/// the grant back there. Crafted with hubcast's own encoder, from a made-up instance.
#[test]
fn a_late_older_access_change_does_not_undo_a_newer_one() {
    use hubcast::cluster::wire::{encode_op, SharedOp};
    use hubcast::model::{DataKind, Grant, GrantKind};
    // One Redis: the version rule is the instances', whatever the engine.
    let engine = Engine::single();
    let Engine::Single(redis) = &engine else { unreachable!() };
    let a = instance(&engine, "a");
    let b = instance(&engine, "b");
    let core = |d: &str| hubcast::runtime::routing::core_of_device(d, 2);
    // `marker` is a device of the same core on B as `late`: that core's queue is FIFO.
    let late = "late-dev";
    let marker = (0..).map(|i| format!("marker-{i}")).find(|d| core(d) == core(late)).unwrap();
    a.ingest(json!({"deviceId": late, "body": {"k": 1}}));
    // A socket on B watches `marker`, so its messages cross Redis to that core of B.
    let watcher = a.new_session();
    let request = json!({"type": "telemetry", "deviceId": marker});
    a.grant(&watcher, request.clone());
    assert_eq!(a.subscribe(&watcher, request).0, 204);
    let mut ws = b.live(&watcher);
    wait_watched_elsewhere(&a, "a", 1.0);
    let session = a.new_session();
    let read = |device: &str| b.call("GET", &format!("/lastValue/{device}/k"), &[("sessionId", &session)], None).0;
    a.grant(&session, json!({"type": "telemetry", "deviceId": late})); // version 1
    assert_eq!(read(late), 200, "B loads the session and reads with the grant");
    a.revoke(&session, json!({"type": "telemetry", "deviceId": late})); // version 2
    let deadline = std::time::Instant::now() + WAIT;
    while read(late) != 403 {
        assert!(std::time::Instant::now() < deadline, "the revoke is in force on B");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The grant at version 1 again, late, then a message of `marker`: Redis hands B both in
    // that order, into the same core's queue, so once the message reaches the socket the
    // late change has been handled.
    let mut granted = hubcast::shard::access::Access::default();
    granted.add_grant(&Grant { kind: GrantKind::Data(DataKind::Telemetry), key: None });
    let id = hubcast::ids::SessionId::parse(&session).expect("a session id");
    let stale = SharedOp::Accesses { session: id, v: 1, changes: vec![(late.into(), Some((granted.grants(), granted.subs())))] };
    publish_bytes(redis, "t:ops", &encode_op("z", &stale));
    a.ingest(json!({"deviceId": marker, "body": {"k": 2}}));
    let frame = ws.next_json(WAIT).expect("the marker's message reaches B's socket");
    assert_eq!(frame["deviceId"].as_str(), Some(marker.as_str()));
    assert_eq!(read(late), 403, "the late grant at version 1 did not undo the revoke at version 2 on B");
}

/// Runs `change` (on A) while B's pub/sub connections are certainly gone and cannot come
/// back: B is frozen (SIGSTOP), every pub/sub connection on the Redis side is killed (`CLIENT
/// KILL TYPE pubsub`, A's too), A reconnects by itself and makes the change (published on
/// `ops`: B is subscribed nowhere, so it misses it), then B runs again, finds its subscriber
/// closed and connects again. Returns once B is connected again.
fn while_b_is_away(redis: &Engine, a: &Server, b: &Server, change: impl FnOnce()) {
    let reconnects = |s: &Server, id: &str| metric(s, "hubcast_redis_reconnects_total", id);
    let (a_before, b_before) = (reconnects(a, "a"), reconnects(b, "b"));
    b.signal(libc::SIGSTOP);
    let killed = redis.command_everywhere("CLIENT KILL TYPE pubsub");
    assert!(killed.iter().any(|r| r.as_deref().is_some_and(|r| r.starts_with(':') && r.trim() != ":0")), "pub/sub connections killed: {killed:?}");
    a.wait_for_metric("hubcast_redis_reconnects_total{instance=\"a\"}", WAIT, Want::AtLeast(a_before + 1.0)); // A saw its subscriber go
    a.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0)); // and is back
    change();
    b.signal(libc::SIGCONT);
    b.wait_for_metric("hubcast_redis_reconnects_total{instance=\"b\"}", WAIT, Want::AtLeast(b_before + 1.0)); // B saw its subscriber closed
    b.wait_for_metric("hubcast_redis_connected{instance=\"b\"}", WAIT, Want::Eq(1.0)); // and connected again
}

/// A revoke and a new subscription published while B's subscriber was away (Redis pub/sub
/// keeps nothing for it) are in force on B once it is back: B checks every session it holds
/// against Redis's version and reads the changed one again (cluster/resync.rs). The socket on
/// B stops receiving the revoked telemetry and starts receiving the new device.
fn changes_published_while_an_instance_was_away_are_in_force_there_once_it_is_back(redis: Engine) {
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let (session, mut ws) = valve_watched_on_b(&a, &b);
    a.ingest(json!({"deviceId": "valve", "body": {"open": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("before, telemetry arrives on B")["telemetry"], json!({"open": 1}));
    while_b_is_away(&redis, &a, &b, || {
        a.revoke(&session, json!({"type": "telemetry", "deviceId": "valve"}));
        let request = json!({"type": "telemetry", "deviceId": "pump"});
        a.grant(&session, request.clone());
        assert_eq!(a.subscribe(&session, request).0, 204);
    });
    // B found the session changed in Redis and read it again; it now watches the pump too.
    b.wait_for_metric("hubcast_redis_sessions_reloaded_total{instance=\"b\"}", WAIT, Want::AtLeast(1.0));
    wait_watched_elsewhere(&a, "a", 2.0);
    a.ingest(json!([
        {"deviceId": "valve", "body": {"open": 2}},
        {"deviceId": "valve", "source": "deviceConnectionStateEvents",
         "properties": {"opType": "deviceDisconnected"}, "body": {"sequenceNumber": "000000000000000001D5"}},
        {"deviceId": "pump", "body": {"n": 1}},
    ]));
    // The valve's connection state (still granted) comes after its telemetry on one channel:
    // once it is here, a telemetry frame delivered in spite of the revoke would be too.
    let mut after = Vec::new();
    while !(after.iter().any(|f: &Value| f["connectionState"] == json!(false)) && after.iter().any(|f: &Value| f["deviceId"] == "pump")) {
        after.push(ws.next_json(WAIT).unwrap_or_else(|| panic!("the valve's connection state and the pump's telemetry arrive on B; got {after:?}\nB: {:?}", b.stderr_lines())));
    }
    assert!(after.iter().all(|f| f["deviceId"] != "valve" || f.get("telemetry").is_none()), "no valve telemetry after the revoke: {after:?}");
    let pump = after.iter().find(|f| f["deviceId"] == "pump").unwrap();
    assert_eq!(pump["telemetry"], json!({"n": 1}), "the pump, subscribed while B was away");
    // B's one session, read again once.
    assert_eq!(metric(&b, "hubcast_redis_sessions_reloaded_total", "b"), 1.0);
    assert!(metric(&b, "hubcast_redis_sessions_checked_total", "b") >= 1.0);
}

/// A delete published while B's subscriber was away closes the session's socket on B once it
/// is back (the session's tombstone says it was deleted, not lost with Redis's data).
fn a_delete_published_while_an_instance_was_away_closes_its_socket_once_it_is_back(redis: Engine) {
    let (a, b, session, mut ws) = watched_on_b(&redis, "d");
    a.ingest(json!({"deviceId": "d", "body": {"v": 1}}));
    assert!(ws.next_json(WAIT).is_some(), "the socket on B is live");
    while_b_is_away(&redis, &a, &b, || {
        let (status, body, _) = a.call("DELETE", &format!("/sessions/{session}"), &[ADMIN], None);
        assert_eq!(status, 204, "{body}");
    });
    assert_eq!(ws.wait_closed(WAIT), Some(1000), "B closes the deleted session's socket once back");
    assert_eq!(metric(&b, "hubcast_redis_sessions_reloaded_total", "b"), 1.0);
}

/// A change written in Redis whose publication never came (on a cluster a change is written
/// on its session's node and published after, from the control node: that can fail) shows
/// as a version skipped when the session's next change arrives; a heartbeat later the
/// instance reads the session again (cluster/resync.rs), so the missing revoke is in force.
fn a_change_never_published_is_in_force_once_a_later_change_shows_its_version_skipped(redis: Engine) {
    use hubcast::cluster::wire::{decode_access, encode_access};
    use hubcast::model::{DataKind, Grant, GrantKind};
    let a = instance(&redis, "a");
    let b = instance(&redis, "b");
    let (session, mut ws) = valve_watched_on_b(&a, &b);
    a.ingest(json!({"deviceId": "valve", "body": {"open": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("before, telemetry arrives on B")["telemetry"], json!({"open": 1}));
    // The revoke of the valve's telemetry as a change writes it (the whole access after it,
    // at the session's next version), and no publication.
    let key = redis.session_key("t", &session);
    let reply = redis.command_bytes(&key, &[b"HGET", key.as_bytes(), b"a:valve"]).expect("Redis answers");
    let stored = common::redis::bulk_bytes(&reply).expect("the valve's access is in Redis");
    let Some((device, id, Some((grants, subs)))) = decode_access(&stored) else { panic!("an access: {stored:?}") };
    let mut access = hubcast::shard::access::Access::new(grants, subs);
    access.revoke(&Grant { kind: GrantKind::Data(DataKind::Telemetry), key: None });
    let revoked = encode_access(&device, id, Some(&(access.grants(), access.subs())));
    redis.command_bytes(&key, &[b"HSET", key.as_bytes(), b"a:valve", &revoked]).expect("HSET");
    redis.command_bytes(&key, &[b"HINCRBY", key.as_bytes(), b"v", b"1"]).expect("HINCRBY");
    // The session's next change, published: B finds a version skipped before it.
    a.grant(&session, json!({"type": "telemetry", "deviceId": "pump"}));
    b.wait_for_metric("hubcast_redis_sessions_reloaded_total{instance=\"b\"}", WAIT, Want::AtLeast(1.0)); // B read the session again
    assert_valve_telemetry_revoked(&a, &mut ws);
    assert_eq!(metric(&b, "hubcast_redis_reconnects_total", "b"), 0.0, "found without a reconnect");
}

/// A session restored from an instance's durable store at start may have changed in Redis
/// while the instance was down: the link learns at once which sessions the cores hold and
/// checks them (cluster/resync.rs: a session it never saw loaded), so a revoke made meanwhile
/// is in force on the session's sockets there, which find the copy and load nothing.
fn a_session_restored_from_the_store_takes_the_changes_made_while_its_instance_was_down(redis: Engine) {
    let a = instance(&redis, "a");
    let dir = common::TempDir::new();
    let mut args = redis.flags();
    args.extend(["--instance-id", "b", "--redis-prefix", "t", "--data-dir", dir.path()].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut b = Server::start(&args);
    b.wait_for_metric("hubcast_redis_connected{instance=\"b\"}", WAIT, Want::Eq(1.0));
    let (session, mut ws) = valve_watched_on_b(&a, &b);
    a.ingest(json!({"deviceId": "valve", "body": {"open": 1}}));
    assert_eq!(ws.next_json(WAIT).expect("before, telemetry arrives on B")["telemetry"], json!({"open": 1}));
    drop(ws);
    b.signal(libc::SIGTERM);
    assert!(b.wait_exit(WAIT).is_some_and(|s| s.success()), "B stops gracefully");
    wait_watched_elsewhere(&a, "a", 0.0);
    // Revoked while B is down; B restarts with the session in its store.
    a.revoke(&session, json!({"type": "telemetry", "deviceId": "valve"}));
    let b = Server::start(&args);
    b.wait_for_metric("hubcast_redis_sessions_reloaded_total{instance=\"b\"}", WAIT, Want::AtLeast(1.0)); // B read the restored session again
    let mut ws = b.live(&session);
    wait_watched_elsewhere(&a, "a", 1.0);
    assert_valve_telemetry_revoked(&a, &mut ws);
}

/// Publications queued together go together (cluster/queue.rs `coalesce`, issue 23 step 8's
/// measurement): Redis holds writes (`CLIENT PAUSE … WRITE`: `PUBLISH`/`SPUBLISH` wait) while
/// A's first publication is in flight; ten more `POST /ingest`, each its own batch (answered
/// once applied, so queued), wait behind it. Once Redis runs again they go in one pipeline
/// (one per master: the device's), not one each, and B's socket gets them all once, in
/// order. Fails without the coalescing: 10 more pipelines.
fn publications_queued_behind_a_busy_redis_go_in_one_pipeline_in_order(redis: Engine) {
    let (a, b, _, mut ws) = watched_on_b(&redis, "pump");
    a.ingest(json!({"deviceId": "pump", "body": {"n": 0}}));
    assert_eq!(ws.next_json(WAIT).expect("before the pause")["telemetry"], json!({"n": 0}));
    let before = metric(&a, "hubcast_redis_publish_pipelines_total", "a");
    assert!(before >= 1.0, "the first message went in a pipeline");
    for answer in redis.command_everywhere("CLIENT PAUSE 8000 WRITE") {
        assert_eq!(answer.as_deref().map(str::trim), Some("+OK"));
    }
    for n in 1..=10 {
        a.ingest(json!({"deviceId": "pump", "body": {"n": n}}));
    }
    for answer in redis.command_everywhere("CLIENT UNPAUSE") {
        assert_eq!(answer.as_deref().map(str::trim), Some("+OK"));
    }
    let mut got: Vec<i64> = Vec::new();
    while got.last() != Some(&10) {
        let frame = ws.next_json(WAIT).unwrap_or_else(|| panic!("every message reaches B; got {got:?}\nA: {:?}\nB: {:?}", a.stderr_lines(), b.stderr_lines()));
        got.extend(frame["telemetry"]["n"].as_i64());
    }
    assert_eq!(got, (1..=10).collect::<Vec<_>>(), "once each, in order");
    assert_eq!(metric(&a, "hubcast_redis_published_total", "a"), 11.0);
    let pipelines = metric(&a, "hubcast_redis_publish_pipelines_total", "a") - before;
    // The one in flight during the pause and the one of those queued behind it (a third if
    // another command, a heartbeat's, came between them in the queue).
    assert!(pipelines <= 3.0, "10 publications queued behind a busy Redis went in {pipelines} pipelines");
    eprintln!("10 publications queued behind a paused Redis went in {pipelines} pipelines");
    assert_eq!(ws.closed, None);
}
