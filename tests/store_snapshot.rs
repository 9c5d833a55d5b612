//! Store snapshots written a slice at a time (src/app/durable.rs): a core keeps serving
//! while it writes one, nothing committed during it is lost or applied twice, and a restart
//! reads the snapshot and the log after it back to exactly the state the stream made.
//! Small `--snapshot-log-bytes` and `--snapshot-slice-devices` make a test-sized shard take
//! many slices; the tests wait on the snapshot's log line and metrics, never on time.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(20);
const DEVICES: usize = 3000;
/// Devices a live client watches (a subset: every message of theirs must arrive once).
const WATCHED: usize = 5;

fn start_in(dir: &TempDir) -> Server {
    Server::start(&[
        "--data-dir",
        dir.path(),
        "--snapshot-log-bytes",
        "300000",
        "--snapshot-slice-devices",
        "20",
        "--log-level",
        "verbose",
    ])
}

/// One round of one streamer: each of its devices (`d % 2 == half`) gets `{"n": round}`.
fn round(half: usize, round: u64) -> Value {
    Value::Array((half..DEVICES).step_by(2).map(|d| json!({"deviceId": format!("dev-{d}"), "body": {"n": round}})).collect())
}

#[test]
fn a_snapshot_taken_while_messages_stream_loses_and_doubles_nothing() {
    let dir = TempDir::new();
    let server = start_in(&dir);
    // A live client on a few devices: each of their messages must reach it exactly once.
    let session = server.new_session();
    for d in 0..WATCHED {
        let sub = json!({"type": "telemetry", "deviceId": format!("dev-{d}"), "telemetryKey": "n"});
        server.grant(&session, sub.clone());
        let (status, body) = server.subscribe(&session, sub);
        assert_eq!(status, 204, "{body}");
    }
    let mut live = server.live(&session);
    server.ingest(json!({"deviceId": "dev-0", "body": {"n": 0}}));
    assert_eq!(live.next_json(WAIT).expect("the live client receives")["telemetry"], json!({"n": 0}));

    // The reader collects frames while the stream runs (so the socket never backs up).
    let streaming = Arc::new(AtomicBool::new(true));
    let reader = std::thread::spawn({
        let streaming = streaming.clone();
        move || {
            let mut frames: Vec<(String, u64)> = Vec::new();
            while let Some(f) = live.next_json(WAIT) {
                let device = f["deviceId"].as_str().unwrap().to_string();
                let n = f["telemetry"]["n"].as_u64().unwrap();
                let last = device == "dev-0" && n == u64::MAX >> 12;
                frames.push((device, n));
                if last && !streaming.load(Ordering::Acquire) {
                    break;
                }
            }
            frames
        }
    });

    // Two connections stream rounds (each over its half of the devices) until a snapshot was
    // written while commits went on.
    let stop = AtomicBool::new(false);
    let (rounds, encoded) = std::thread::scope(|scope| {
        let streamers: Vec<_> = (0..2)
            .map(|half| {
                let (server, stop) = (&server, &stop);
                scope.spawn(move || {
                    let agent = new_agent();
                    let mut n = 0u64;
                    // At least one round after the snapshot's line, so the log after it holds changes.
                    let mut after = 0;
                    while after < 2 {
                        n += 1;
                        server.ingest_on(&agent, round(half, n));
                        if stop.load(Ordering::Acquire) {
                            after += 1;
                        }
                    }
                    n
                })
            })
            .collect();
        let encoded = server.wait_for_stderr(Duration::from_secs(120), |l| {
            l.contains("store snapshot encoded") && log_number(l, "commits_during").is_some_and(|c| c > 0)
        });
        stop.store(true, Ordering::Release);
        let rounds: Vec<u64> = streamers.into_iter().map(|s| s.join().unwrap()).collect();
        (rounds, encoded.expect("a snapshot written while commits went on"))
    });
    println!("{encoded}");
    assert!(log_number(&encoded, "slices").unwrap() > 10, "written in many slices: {encoded}");
    streaming.store(false, Ordering::Release);
    let last = u64::MAX >> 12; // exactly representable in JSON numbers
    server.ingest(json!({"deviceId": "dev-0", "body": {"n": last}}));
    let frames = reader.join().unwrap();
    for d in 0..WATCHED {
        let device = format!("dev-{d}");
        let got: Vec<u64> = frames.iter().filter(|(dev, _)| *dev == device).map(|(_, n)| *n).filter(|n| *n != last).collect();
        let want: Vec<u64> = (1..=rounds[d % 2]).collect();
        assert_eq!(got, want, "{device}: every message delivered once, in order");
    }
    server.wait_for_metric("hubcast_store_snapshots_total", WAIT, Want::AtLeast(1.0)); // a snapshot file written
    let slices = server.metric("hubcast_store_snapshot_slices_total").unwrap();
    assert!(slices > 10.0, "slices {slices}");
    assert!(server.metric("hubcast_store_snapshot_slow_slices_total").is_some());
    assert!(log_number(&encoded, "longest_slice_us").is_some(), "the longest slice is logged: {encoded}");
    let snapshots = std::fs::read_dir(&dir.0).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".snap")).count();
    assert!(snapshots >= 1, "a snapshot is on disk");
    drop(server); // kill -9

    // The restart reads the snapshot and the log after it: exactly the state the stream made.
    let server = start_in(&dir);
    server.wait_for_stderr(WAIT, |l| l.contains("stored state loaded")).expect("loaded");
    // Every device, a page of the device list at a time: its value is its streamer's last round.
    let mut seen = 0;
    let mut after = String::new();
    loop {
        let (status, page) = server.call_json("GET", &format!("/devices?limit=200&after={after}"), &[ADMIN], None);
        assert_eq!(status, 200, "{page}");
        for dev in page["devices"].as_array().unwrap() {
            let id = dev["deviceId"].as_str().unwrap();
            let d: usize = id.strip_prefix("dev-").unwrap().parse().unwrap();
            let want = if d == 0 { last } else { rounds[d % 2] };
            assert_eq!(dev["telemetry"], json!({"n": want}), "{id}");
            seen += 1;
        }
        match page["next"].as_str() {
            Some(next) => after = next.to_string(),
            None => break,
        }
    }
    assert_eq!(seen, DEVICES, "no device more or less");
}

/// Start-up arms the connection-state TTL of every connected device read back (the loader lists
/// them; the core arms them at once): silent after a restart, it goes offline after the TTL,
/// and one that was disconnected stays as it was.
#[test]
fn a_connected_device_read_back_at_start_goes_offline_after_the_ttl() {
    let dir = TempDir::new();
    let server = Server::start(&["--data-dir", dir.path()]);
    server.ingest(json!([
        {"deviceId": "on", "source": "deviceConnectionStateEvents", "properties": {"opType": "deviceConnected"},
         "body": {"sequenceNumber": "01"}},
        {"deviceId": "off", "source": "deviceConnectionStateEvents", "properties": {"opType": "deviceDisconnected"},
         "body": {"sequenceNumber": "01"}}
    ]));
    let session = server.new_session();
    for device in ["on", "off"] {
        let sub = json!({"type": "connectionState", "deviceId": device});
        server.grant(&session, sub.clone());
        let (status, body) = server.subscribe(&session, sub);
        assert_eq!(status, 204, "{body}");
    }
    drop(server); // kill -9

    // The TTL is armed at start-up: the read and the live socket must come before it fires
    // (2 s: room for a busy machine; a late read fails, it cannot pass by accident).
    let server = Server::start(&["--data-dir", dir.path(), "--connection-state-cache-ttl-ms", "2000"]);
    let started = std::time::Instant::now();
    let mut live = server.live(&session);
    let (_, state) = server.call_json("GET", "/connectionState/on", &[ADMIN], None);
    assert_eq!(state["data"], json!(true), "read back connected ({:?} after the start)", started.elapsed());
    let offline = live.next_json(Duration::from_secs(10)).expect("offline after the TTL");
    assert_eq!((&offline["deviceId"], &offline["connectionState"]), (&json!("on"), &json!(false)), "{offline}");
    let (_, state) = server.call_json("GET", "/connectionState/on", &[ADMIN], None);
    assert_eq!(state["data"], json!(false));
    let (_, state) = server.call_json("GET", "/connectionState/off", &[ADMIN], None);
    assert_eq!(state["data"], json!(false), "a disconnected device is left as it was");
}
