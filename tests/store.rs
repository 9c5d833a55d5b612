//! Durable state (`--data-dir`): what a restart keeps, when it is durable, one owner per
//! data dir, re-sharding when `--cores` changes, and damaged store files. Every restart here
//! is a `kill -9` (the harness kills with SIGKILL): nothing is flushed on the way out.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);
/// deviceTwin grants need an IoT Hub service connection (never contacted by these tests).
const HUB: [&str; 2] = ["--iot-hub-service-connection-string", "HostName=127.0.0.1;SharedAccessKeyName=service;SharedAccessKey=a2V5"];

fn start_in(dir: &TempDir, extra: &[&str]) -> Server {
    let mut args = vec!["--data-dir", dir.path()];
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn admin_get(server: &Server, path: &str) -> (u16, Value) {
    server.call_json("GET", path, &[ADMIN], None)
}

#[test]
fn a_restart_keeps_last_values_twin_connection_state_and_sessions() {
    let dir = TempDir::new();
    let server = start_in(&dir, &[]);
    server.ingest(json!([
        {"deviceId": "pump", "body": {"pressure": 4.2, "_ts": "2026-01-02T03:04:05.678Z"}},
        {"deviceId": "pump", "body": {"running": true}},
        {"deviceId": "pump", "source": "twinChangeEvents", "properties": {"opType": "replaceTwin"},
         "body": {"version": 7, "properties": {"reported": {"fw": "2.1"}}}},
        {"deviceId": "pump", "source": "deviceConnectionStateEvents", "properties": {"opType": "deviceDisconnected"},
         "body": {"sequenceNumber": "000000000000000001D5"}}
    ]));
    let session = server.new_session();
    server.grant(&session, json!({"type": "telemetry", "deviceId": "pump", "telemetryKey": "pressure"}));
    let (status, body) = server.subscribe(&session, json!({"type": "telemetry", "deviceId": "pump", "telemetryKey": "pressure"}));
    assert_eq!(status, 204, "{body}");
    let before = [
        admin_get(&server, "/lastValue/pump"),
        admin_get(&server, "/deviceTwin/pump"),
        admin_get(&server, "/connectionState/pump"),
    ];
    assert!(before.iter().all(|(s, _)| *s == 200), "{before:?}");
    drop(server); // kill -9

    let server = start_in(&dir, &[]);
    let after = [
        admin_get(&server, "/lastValue/pump"),
        admin_get(&server, "/deviceTwin/pump"),
        admin_get(&server, "/connectionState/pump"),
    ];
    assert_eq!(after, before, "every value with its timestamp is back");
    assert_eq!(after[0].1["data"]["pressure"]["timestamp"], "2026-01-02T03:04:05.678Z");
    assert_eq!(after[2].1["data"], json!(false));
    // The session and its grant: a per-key read answers, a key without a grant does not.
    let (status, body) = server.call_json("GET", "/lastValue/pump/pressure", &[("sessionId", &session)], None);
    assert_eq!((status, &body["data"]), (200, &json!({"pressure": 4.2})), "{body}");
    let (status, _) = server.call_json("GET", "/lastValue/pump/running", &[("sessionId", &session)], None);
    assert_eq!(status, 403);
    // Its subscription: unsubscribing needs the grant and answers 204 (the grant is there).
    let (status, body) = server.unsubscribe(&session, json!({"type": "telemetry", "deviceId": "pump", "telemetryKey": "pressure"}));
    assert_eq!(status, 204, "{body}");
}

#[test]
fn ordering_rules_hold_across_a_restart() {
    let dir = TempDir::new();
    let server = start_in(&dir, &[]);
    server.ingest(json!([
        {"deviceId": "d", "source": "twinChangeEvents", "properties": {"opType": "replaceTwin"},
         "body": {"version": 5, "properties": {"reported": {"v": "five"}}}},
        {"deviceId": "d", "source": "deviceConnectionStateEvents", "properties": {"opType": "deviceConnected"},
         "body": {"sequenceNumber": "000000000000000001D5"}}
    ]));
    drop(server);
    let server = start_in(&dir, &[]);
    // Older than what was stored before the restart: both dropped.
    server.ingest(json!([
        {"deviceId": "d", "source": "twinChangeEvents", "properties": {"opType": "replaceTwin"},
         "body": {"version": 4, "properties": {"reported": {"v": "four"}}}},
        {"deviceId": "d", "source": "deviceConnectionStateEvents", "properties": {"opType": "deviceDisconnected"},
         "body": {"sequenceNumber": "000000000000000001D4"}}
    ]));
    let (_, twin) = admin_get(&server, "/deviceTwin/d");
    assert_eq!(twin["data"]["properties"]["reported"]["v"], "five", "{twin}");
    let (_, state) = admin_get(&server, "/connectionState/d");
    assert_eq!(state["data"], json!(true), "{state}");
}

#[test]
fn a_socketio_client_reconnects_after_a_restart_with_its_old_session_and_gets_data() {
    let dir = TempDir::new();
    let mut args = vec!["--data-dir", dir.path()];
    args.extend_from_slice(&HUB);
    let server = Server::start(&args);
    let port = server.port.to_string();
    let session = server.new_session();
    server.grant(&session, json!({"type": "telemetry", "deviceId": "dev"}));
    assert_eq!(server.subscribe(&session, json!({"type": "telemetry", "deviceId": "dev"})).0, 204);
    let client = server.socketio_reconnecting(&[&session], "websocket");
    client.wait_for("connect", WAIT).expect("connect");
    server.ingest(json!([{"deviceId": "dev", "body": {"n": 1}}]));
    assert_eq!(client.wait_for("data", WAIT).expect("data before the restart")["data"]["telemetry"], json!({"n": 1}));
    drop(server); // kill -9
    client.wait_for("disconnect", WAIT).expect("the client sees the server go");

    args.extend_from_slice(&["--port", &port]);
    let server = Server::start(&args);
    let reconnected = client.wait_for("connect", Duration::from_secs(20)).expect("socket.io reconnects by itself");
    assert_eq!(reconnected["event"], "connect");
    server.ingest(json!([{"deviceId": "dev", "body": {"n": 2}}]));
    assert_eq!(client.wait_for("data", WAIT).expect("data after the restart")["data"]["telemetry"], json!({"n": 2}));
}

/// Waits until `GET /metrics` has `series` at or above `at_least`; returns its value.
fn wait_metric(server: &Server, series: &str, at_least: impl Fn() -> u64) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, text, _) = server.call("GET", "/metrics", &[ADMIN], None);
        let value = text
            .lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse::<u64>().ok()));
        if let Some(v) = value {
            if v >= at_least() {
                return v;
            }
        }
        assert!(Instant::now() < deadline, "{series} stays below {} in\n{text}", at_least());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn metric(server: &Server, series: &str) -> u64 {
    wait_metric(server, series, || 0)
}

#[test]
fn post_ingest_is_committed_when_answered_and_synced_within_the_interval() {
    let dir = TempDir::new();
    let server = start_in(&dir, &["--fsync-interval", "200"]);
    let commits_before = metric(&server, "hubcast_store_commits_total");
    server.ingest(json!([{"deviceId": "x", "body": {"t": 1}}]));
    // Committed (written to the OS) before the answer: the counter already counts it.
    let commits = metric(&server, "hubcast_store_commits_total");
    assert!(commits > commits_before, "{commits} > {commits_before}");
    // Synced by the sync thread within the interval.
    wait_metric(&server, "hubcast_store_synced_commits", || commits);
    drop(server); // kill -9 right away
    let server = start_in(&dir, &[]);
    assert_eq!(admin_get(&server, "/lastValue/x/t").0, 200);
}

#[test]
fn memory_only_keeps_nothing() {
    let server = Server::start(&["--data-dir", "none"]);
    server.ingest(json!([{"deviceId": "x", "body": {"t": 1}}]));
    assert_eq!(server.call("GET", "/lastValue/x/t", &[ADMIN], None).0, 200, "served from memory");
    let (_, text, _) = server.call("GET", "/metrics", &[ADMIN], None);
    assert!(!text.contains("hubcast_store_commits_total"), "no store metrics without a store");
    assert!(server.stderr_lines().iter().any(|l| l.contains("memory only")));
    drop(server); // kill -9
    // "none" is no directory name: nothing was written in the working directory, and a
    // restart knows nothing of the device.
    assert!(!std::path::Path::new("none").exists(), "a store was made in ./none");
    let server = Server::start(&["--data-dir", "none"]);
    assert_eq!(server.call("GET", "/lastValue/x/t", &[ADMIN], None).0, 404, "nothing kept across a restart");
}

#[test]
fn a_second_instance_on_the_same_data_dir_refuses_to_start() {
    let dir = TempDir::new();
    let _first = start_in(&dir, &[]);
    let args = full_args(&["--data-dir", dir.path()], true);
    let (ok, _, stderr) = run_expecting_exit(&args, &[]);
    assert!(!ok, "the second instance must not start");
    assert!(stderr.contains("is in use by another hubcast") && stderr.contains(dir.path()), "{stderr}");
}

#[test]
fn changing_the_core_count_keeps_the_state() {
    let dir = TempDir::new();
    let server = start_in(&dir, &["--cores", "2"]);
    let devices: Vec<Value> = (0..40).map(|i| json!({"deviceId": format!("d{i}"), "body": {"i": i}})).collect();
    server.ingest(Value::Array(devices));
    drop(server);
    for cores in ["3", "1"] {
        let server = start_in(&dir, &["--cores", cores]);
        for i in 0..40 {
            let (status, body) = admin_get(&server, &format!("/lastValue/d{i}/i"));
            assert_eq!((status, &body["data"]["i"]), (200, &json!(i)), "{cores} cores: d{i}: {body}");
        }
        server.ingest(json!([{"deviceId": format!("after-{cores}"), "body": {"x": 1}}]));
        drop(server);
    }
    let server = start_in(&dir, &["--cores", "2"]);
    assert_eq!(admin_get(&server, "/lastValue/after-3/x").0, 200);
    assert_eq!(admin_get(&server, "/lastValue/after-1/x").0, 200);
}

/// The newest non-empty log file of a one-core data dir.
fn newest_log(dir: &TempDir) -> std::path::PathBuf {
    let mut logs: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "log") && std::fs::metadata(p).unwrap().len() > 16)
        .collect();
    logs.sort();
    logs.pop().expect("a log with commits")
}

/// Two commits (a, then b) on one core, then the process is killed.
fn two_commits(dir: &TempDir) {
    let server = start_in(dir, &["--cores", "1"]);
    server.ingest(json!([{"deviceId": "a", "body": {"v": 1}}]));
    server.ingest(json!([{"deviceId": "b", "body": {"v": 2}}]));
}

#[test]
fn a_truncated_log_tail_loses_only_the_cut_commit() {
    let dir = TempDir::new();
    two_commits(&dir);
    let log = newest_log(&dir);
    let len = std::fs::metadata(&log).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(len - 5).unwrap();
    let server = start_in(&dir, &["--cores", "1"]);
    server.wait_for_stderr(WAIT, |l| l.contains("WARN") && l.contains("cut-off commit") && l.contains("truncated frame")).expect("logged");
    assert_eq!(admin_get(&server, "/lastValue/a/v").0, 200, "the first commit is kept");
    assert_eq!(admin_get(&server, "/lastValue/b/v").0, 404, "the cut commit is gone");
    server.ingest(json!([{"deviceId": "c", "body": {"v": 3}}]));
    drop(server);
    let server = start_in(&dir, &["--cores", "1"]);
    assert_eq!(admin_get(&server, "/lastValue/c/v").0, 200, "writing goes on after a damaged file");
}

#[test]
fn a_corrupted_last_commit_is_a_cut_off_end_and_the_valid_part_loaded() {
    let dir = TempDir::new();
    two_commits(&dir);
    let log = newest_log(&dir);
    let mut bytes = std::fs::read(&log).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40; // inside the last commit's payload
    std::fs::write(&log, bytes).unwrap();
    let server = start_in(&dir, &["--cores", "1"]);
    // Nothing valid follows the bad frame: a crash's doing (the size grew before the data
    // reached the disk), loaded as a cut-off end (damage in the middle: tests/store_damage.rs).
    server.wait_for_stderr(WAIT, |l| l.contains("cut-off commit") && l.contains("checksum mismatch")).expect("logged");
    assert_eq!(admin_get(&server, "/lastValue/a/v").0, 200);
    assert_eq!(admin_get(&server, "/lastValue/b/v").0, 404);
}

#[test]
fn a_store_of_another_format_version_is_refused_by_name() {
    let dir = TempDir::new();
    two_commits(&dir);
    let log = newest_log(&dir);
    let mut bytes = std::fs::read(&log).unwrap();
    bytes[8..12].copy_from_slice(&9u32.to_le_bytes());
    std::fs::write(&log, bytes).unwrap();
    let args = full_args(&["--data-dir", dir.path(), "--cores", "1"], true);
    let (ok, _, stderr) = run_expecting_exit(&args, &[]);
    assert!(!ok);
    assert!(stderr.contains("store format version 9") && stderr.contains(".log"), "{stderr}");
}

#[test]
fn sigterm_syncs_the_durable_state_before_exiting() {
    let dir = TempDir::new();
    // A sync interval longer than the test: only the shutdown's flush syncs.
    let mut server = start_in(&dir, &["--fsync-interval", "60000"]);
    server.ingest(json!([{"deviceId": "bye", "body": {"v": 1}}]));
    assert_eq!(metric(&server, "hubcast_store_synced_commits"), 0, "nothing synced yet");
    server.signal(libc::SIGTERM);
    let status = server.wait_exit(WAIT).expect("exits");
    assert!(status.success(), "{status:?}");
    let synced = server.stderr_lines().iter().filter(|l| l.contains("durable state synced to disk")).count();
    assert_eq!(synced, 2, "each core syncs its store");
    drop(server);
    let server = start_in(&dir, &[]);
    assert_eq!(admin_get(&server, "/lastValue/bye/v").0, 200);
}

/// A relative `--data-dir` (the default is `./hubcast-data`) with a snapshot in it: the
/// snapshot's path must not be joined to the directory twice. Re-sharding writes snapshots.
#[test]
fn a_relative_data_dir_with_a_snapshot_restarts() {
    let cwd = TempDir::new();
    std::fs::create_dir_all(&cwd.0).unwrap();
    let start = |cores: &str| Server::start_wrapped(&["env", "-C", cwd.path()], &["--data-dir", "state", "--cores", cores]);
    let server = start("2");
    server.ingest(json!([{"deviceId": "rel", "body": {"v": 7}}]));
    drop(server);
    // 2 → 1 core: the state is re-sharded into a snapshot; the next start reads it.
    drop(start("1"));
    let snapshots = std::fs::read_dir(cwd.0.join("state")).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".snap")).count();
    assert!(snapshots >= 1, "re-sharding wrote a snapshot");
    let server = start("1");
    let (status, body) = admin_get(&server, "/lastValue/rel/v");
    assert_eq!((status, &body["data"]["v"]), (200, &json!(7)), "{body}");
    std::fs::remove_dir_all(&cwd.0).ok();
}
