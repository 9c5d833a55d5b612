//! Damage at rest is never silently survived (issue 26, item 12): a damaged snapshot, a
//! damaged commit inside a log, a cut-off snapshot, a snapshot the manifest names gone, each
//! stop the start naming the file and the offset; with `--store-start-damaged` the start goes
//! on, keeps the damaged file aside, serves what is valid and says in /metrics what was dropped.
//! A log whose last commit a crash cut off still loads without a word of damage.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use serde_json::json;

const DEVICES: usize = 500;
const FLAG: &str = "--store-start-damaged";

fn files(dir: &TempDir, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == ext) && std::fs::metadata(p).unwrap().len() > 16)
        .collect();
    v.sort();
    v
}

fn kept_aside(dir: &TempDir, file: &std::path::Path) -> usize {
    let name = format!("{}.damaged-", file.file_name().unwrap().to_string_lossy());
    std::fs::read_dir(&dir.0).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&name)).count()
}

/// 500 devices, written by two cores and then re-sharded onto one: core 0 of the data dir
/// holds them all in one snapshot. Returns that snapshot.
fn snapshot_of_500(dir: &TempDir) -> PathBuf {
    let server = Server::start(&["--data-dir", dir.path(), "--cores", "2"]);
    let batch: Vec<_> = (0..DEVICES).map(|d| json!({"deviceId": format!("dev-{d}"), "body": {"n": d}})).collect();
    server.ingest(json!(batch));
    drop(server); // kill -9
    drop(Server::start(&["--data-dir", dir.path(), "--cores", "1"])); // re-shards into a snapshot
    let snaps = files(dir, "snap");
    assert_eq!(snaps.len(), 1, "{snaps:?}");
    snaps[0].clone()
}

/// How many of the 500 devices the server serves (each read back on GET /lastValue).
fn devices_served(server: &Server) -> usize {
    let agent = new_agent();
    (0..DEVICES)
        .filter(|d| {
            let (status, body, _) = server.call_on(&agent, "GET", &format!("/lastValue/dev-{d}/n"), &[ADMIN], None);
            status == 200 && parse_json(&body)["data"]["n"] == json!(d)
        })
        .count()
}

/// Starts on `dir` with one core expecting a refusal; returns stderr.
fn refused(dir: &TempDir) -> String {
    let (ok, stdout, stderr) = run_expecting_exit(&full_args(&["--data-dir", dir.path(), "--cores", "1"], true), &[]);
    assert!(!ok, "the start must stop: {stdout}\n{stderr}");
    assert!(!stdout.contains("listening on"), "{stdout}");
    assert!(stderr.contains(FLAG), "says what to do: {stderr}");
    stderr
}

fn start_damaged(dir: &TempDir) -> Server {
    Server::start(&["--data-dir", dir.path(), "--cores", "1", FLAG])
}

fn metric(server: &Server, series: &str) -> f64 {
    server.metric(series).unwrap_or_else(|| panic!("{series} in /metrics"))
}

#[test]
fn a_damaged_snapshot_stops_the_start_and_with_the_flag_costs_a_few_devices_not_the_core() {
    let dir = TempDir::new();
    let snap = snapshot_of_500(&dir);
    // The whole state is served before the damage.
    assert_eq!(devices_served(&Server::start(&["--data-dir", dir.path(), "--cores", "1"])), DEVICES);
    let mut bytes = std::fs::read(&snap).unwrap();
    let middle = bytes.len() / 2;
    for b in &mut bytes[middle..middle + 40] {
        *b ^= 0xA5;
    }
    std::fs::write(&snap, &bytes).unwrap();

    let stderr = refused(&dir);
    let name = snap.file_name().unwrap().to_string_lossy().into_owned();
    assert!(stderr.contains(&name) && stderr.contains("is damaged at byte") && stderr.contains("checksum mismatch"), "{stderr}");

    let server = start_damaged(&dir);
    let served = devices_served(&server);
    assert!((DEVICES - 60..DEVICES).contains(&served), "one damaged spot costs a few devices: {served} of {DEVICES} served");
    assert_eq!(metric(&server, "hubcast_store_damaged_files"), 1.0);
    assert!(metric(&server, "hubcast_store_dropped_bytes") >= 40.0);
    assert_eq!(metric(&server, "hubcast_store_dropped_devices"), (DEVICES - served) as f64, "the loss is counted");
    let log = server.stderr_lines().join("\n");
    assert!(log.contains("ERROR") && log.contains(&name) && log.contains("dropped_devices"), "{log}");
    assert!(!snap.exists() && kept_aside(&dir, &snap) == 1, "the damaged file is kept aside");
    drop(server);
    // What was valid was written anew: the next start needs no flag, the kept file is untouched.
    let server = Server::start(&["--data-dir", dir.path(), "--cores", "1"]);
    assert_eq!(devices_served(&server), served);
    assert_eq!(metric(&server, "hubcast_store_damaged_files"), 0.0);
    assert_eq!(kept_aside(&dir, &snap), 1);
}

#[test]
fn a_truncated_snapshot_stops_the_start_and_with_the_flag_serves_what_precedes_the_cut() {
    let dir = TempDir::new();
    let snap = snapshot_of_500(&dir);
    let len = std::fs::metadata(&snap).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&snap).unwrap().set_len(len / 2).unwrap();

    let stderr = refused(&dir);
    assert!(stderr.contains(&*snap.file_name().unwrap().to_string_lossy()) && stderr.contains("cut off"), "{stderr}");

    let server = start_damaged(&dir);
    let served = devices_served(&server);
    assert!(served > DEVICES / 3 && served < DEVICES, "what precedes the cut: {served}");
    assert_eq!(metric(&server, "hubcast_store_damaged_files"), 1.0);
    assert_eq!(metric(&server, "hubcast_store_dropped_devices"), (DEVICES - served) as f64);
    assert_eq!(kept_aside(&dir, &snap), 1);
}

#[test]
fn a_snapshot_the_manifest_names_missing_stops_the_start_and_with_the_flag_starts_empty() {
    let dir = TempDir::new();
    let snap = snapshot_of_500(&dir);
    let manifest = std::fs::read_to_string(dir.0.join("MANIFEST")).unwrap();
    assert!(manifest.contains("snap 0 "), "the manifest names the snapshot: {manifest}");
    std::fs::remove_file(&snap).unwrap();

    let stderr = refused(&dir);
    assert!(stderr.contains(&*snap.file_name().unwrap().to_string_lossy()) && stderr.contains("is missing"), "{stderr}");

    let server = start_damaged(&dir);
    assert_eq!(devices_served(&server), 0);
    assert_eq!(metric(&server, "hubcast_store_damaged_files"), 1.0);
    server.ingest(json!([{"deviceId": "after", "body": {"n": 1}}]));
    drop(server);
    let server = Server::start(&["--data-dir", dir.path(), "--cores", "1"]);
    assert_eq!(server.call_json("GET", "/lastValue/after/n", &[ADMIN], None).0, 200, "writing goes on; no flag needed again");
}

/// Three commits (a, b, c) on one core; then a byte of the first one's payload flipped.
#[test]
fn a_damaged_commit_inside_a_log_stops_the_start_and_with_the_flag_only_that_commit_is_lost() {
    let dir = TempDir::new();
    let server = Server::start(&["--data-dir", dir.path(), "--cores", "1"]);
    for id in ["a", "b", "c"] {
        server.ingest(json!([{"deviceId": id, "body": {"v": 1}}]));
    }
    drop(server); // kill -9
    let log = files(&dir, "log").pop().expect("a log with commits");
    let mut bytes = std::fs::read(&log).unwrap();
    let head = hubcast::store::format::LOG_FRAME_HEAD;
    let first = 16 + head + u32::from_le_bytes(bytes[16..20].try_into().unwrap()) as usize;
    assert!(first < bytes.len(), "more commits follow the first");
    bytes[16 + head + 3] ^= 0x40;
    std::fs::write(&log, &bytes).unwrap();

    let stderr = refused(&dir);
    assert!(stderr.contains(&*log.file_name().unwrap().to_string_lossy()) && stderr.contains("is damaged at byte 16 "), "{stderr}");

    let server = start_damaged(&dir);
    let last = |id: &str| server.call_json("GET", &format!("/lastValue/{id}/v"), &[ADMIN], None).0;
    assert_eq!((last("a"), last("b"), last("c")), (404, 200, 200), "only the damaged commit is lost");
    assert_eq!(metric(&server, "hubcast_store_damaged_files"), 1.0);
    assert_eq!(metric(&server, "hubcast_store_dropped_bytes"), first as f64 - 16.0);
    assert_eq!(kept_aside(&dir, &log), 1);
}

#[test]
fn a_log_whose_last_commit_a_crash_cut_off_loads_without_the_flag() {
    let dir = TempDir::new();
    let server = Server::start(&["--data-dir", dir.path(), "--cores", "1"]);
    server.ingest(json!([{"deviceId": "a", "body": {"v": 1}}]));
    server.ingest(json!([{"deviceId": "b", "body": {"v": 2}}]));
    drop(server);
    let log = files(&dir, "log").pop().unwrap();
    let len = std::fs::metadata(&log).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(len - 5).unwrap();
    let server = Server::start(&["--data-dir", dir.path(), "--cores", "1"]);
    server.wait_for_stderr(Duration::from_secs(10), |l| l.contains("WARN") && l.contains("cut-off commit")).expect("logged");
    assert_eq!(server.call_json("GET", "/lastValue/a/v", &[ADMIN], None).0, 200);
    assert_eq!(server.call_json("GET", "/lastValue/b/v", &[ADMIN], None).0, 404);
    assert_eq!(metric(&server, "hubcast_store_damaged_files"), 0.0);
    assert!(!server.stderr_lines().iter().any(|l| l.contains("ERROR")), "no damage reported");
    assert!(log.exists(), "nothing kept aside");
}
