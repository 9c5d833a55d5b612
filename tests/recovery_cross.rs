//! Issue 24, `kill -9` of the client's instance with `--redis-url` (docs/design/recovery.md
//! steps 10–11): the device rings another instance keeps, the offset's device part, and the
//! rebuild of a history on another instance after the client's instance died.
//! Real binaries on one `redis-server`, the npm socket.io-client behind a cutting proxy.

mod common;

use std::time::Duration;

use common::lb::Cutter;
use common::recovery::*;
use common::sio::{socketio_at, SioClient};
use common::*;
use serde_json::{json, Value};

/// A session granted and subscribed to each device's d2c messages.
fn d2c_session_of(server: &Server, devices: &[&str]) -> String {
    let session = server.new_session();
    for device in devices {
        server.grant(&session, kind("d2cMessages", device));
        let (status, body) = server.subscribe(&session, kind("d2cMessages", device));
        assert_eq!(status, 204, "{body}");
    }
    session
}

/// The next `data` event: its message's device, `n` and offset.
fn next(client: &SioClient) -> (String, u64, String) {
    let e = client.wait_for("data", WAIT).expect("a data event");
    let n = e["data"]["message"]["n"].as_u64().unwrap_or_else(|| panic!("a d2c message: {e}"));
    let device = e["data"]["deviceId"].as_str().unwrap_or_else(|| panic!("{e}")).to_string();
    let offset = e["offset"].as_str().unwrap_or_else(|| panic!("a string offset: {e}")).to_string();
    (device, n, offset)
}

/// FNV-1a of a device id in base 36: how a device part names a device (push/cut.rs).
fn device_hash(id: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in id.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    let mut n = h as u64;
    let mut digits = Vec::new();
    loop {
        digits.push(std::char::from_digit((n % 36) as u32, 36).unwrap());
        n /= 36;
        if n == 0 {
            break;
        }
    }
    digits.iter().rev().collect()
}

/// The device part of an offset: `device hash → key hash` (empty: no key).
fn part_of(offset: &str) -> Vec<(String, String)> {
    let items: Vec<&str> = offset.split('.').collect();
    assert!(items.len() >= 3 && items[0] == "h1", "{offset}");
    items[3..]
        .iter()
        .map(|i| {
            let (d, k) = i.split_once('-').unwrap_or_else(|| panic!("a device item: {offset}"));
            (d.to_string(), k.to_string())
        })
        .collect()
}

/// Design step 10: with `--redis-url`, each offset names, per device with a frame in the
/// stream, the key of its last one; the instance that takes the device in keeps it in a ring
/// while another instance watches it (counted in bytes), and keeps nothing of a device nobody
/// elsewhere watches.
#[test]
fn offsets_name_each_devices_last_message_and_the_ingesting_instance_keeps_a_ring() {
    let redis = common::redis::Redis::start();
    let (a, b) = (instance(&redis, "a"), instance(&redis, "b"));
    let session = d2c_session_of(&a, &["dev-1", "dev-2"]);
    let client = socketio_at(&format!("http://127.0.0.1:{}", a.port), &[&session], "websocket", false, &[PRINT]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(2.0));
    let ring = "hubcast_recovery_ring_bytes{instance=\"b\"}";
    assert_eq!(b.metric(ring), Some(0.0));
    // A device nobody watches: nothing kept (the positive message on the same socket first).
    b.ingest(json!([message("dev-1", 1), message("nobody", 1)]));
    let (_, n, first) = next(&client);
    assert_eq!(n, 1);
    let held = b.wait_for_metric(ring, WAIT, Want::AtLeast(1.0));
    b.ingest(message("nobody", 2));
    b.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(3.0));
    assert_eq!(b.metric(ring), Some(held), "a device nobody elsewhere watches has no ring");
    let part = part_of(&first);
    assert_eq!(part.len(), 1, "{first}");
    assert_eq!(part[0].0, device_hash("dev-1"), "{first}");
    assert!(!part[0].1.is_empty(), "a keyed message: {first}");
    b.ingest(message("dev-2", 2));
    let (device, _, second) = next(&client);
    assert_eq!(device, "dev-2");
    let part2 = part_of(&second);
    assert_eq!(part2.len(), 2, "both devices named: {second}");
    assert_eq!(part2[0], part[0], "dev-1's cut unchanged: {second}");
    assert_eq!(part2[1].0, device_hash("dev-2"));
    b.ingest(message("dev-1", 3));
    let (_, _, third) = next(&client);
    let part3 = part_of(&third);
    assert_ne!(part3[0].1, part[0].1, "dev-1's cut moved: {third}");
    assert_eq!(part3[1], part2[1]);
    assert!(b.metric(ring).unwrap() > held);
}

/// Recovery off (`--recovery-window 0`) costs nothing here either: no offsets, no rings.
#[test]
fn with_recovery_off_no_ring_is_kept_and_no_offset_written() {
    let redis = common::redis::Redis::start();
    let off = ["--recovery-window", "0"];
    let (a, b) = (instance_with(&redis, "a", &off), instance_with(&redis, "b", &off));
    let session = d2c_session(&a, "dev-1");
    let client = socketio_at(&format!("http://127.0.0.1:{}", a.port), &[&session], "websocket", false, &[PRINT]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], false);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(message("dev-1", 1));
    let e = client.wait_for("data", WAIT).expect("a data event");
    assert_eq!(e["offset"], Value::Null, "{e}");
    assert_eq!(b.metric("hubcast_recovery_ring_bytes{instance=\"b\"}"), Some(0.0));
}

// ---- step 11: the client's instance killed, the client rebuilt on the survivor --------------

/// A lease TTL of 2 s: a killed instance leaves the others' view of live instances soon.
const FAST_LEASE: [&str; 2] = ["--lease-ttl", "2"];

/// Two instances; the client (reconnecting fast) behind a cutter to A, its session reading
/// dev-1's d2c messages; its first message, `first`, ingested on `first_on`, received.
fn client_on_a(first_on: &str) -> (common::redis::Redis, Server, Server, Cutter, SioClient) {
    let redis = common::redis::Redis::start();
    let (a, b) = (instance_with(&redis, "a", &FAST_LEASE), instance_with(&redis, "b", &FAST_LEASE));
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    let first = if first_on == "a" { &a } else { &b };
    first.ingest(message("dev-1", 0));
    let (_, n, offset) = next(&client);
    assert_eq!(n, 0);
    assert_eq!(part_of(&offset).len(), 1, "the offset names dev-1: {offset}");
    (redis, a, b, cutter, client)
}

/// Kills A (SIGKILL) and waits until B no longer counts it among the live instances.
fn kill_a(a: &mut Server, b: &Server) {
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    b.wait_for_metric("hubcast_redis_instances{instance=\"b\"}", Duration::from_secs(20), Want::Eq(1.0));
}

/// Issue 24's "`kill -9` of the client's instance with `--redis-url`" (design step 11): the
/// client is cut off A while B ingests 20 messages (A takes them into the client's history),
/// A is killed, B ingests 10 more; the client lands on B, which rebuilds its history from
/// B's ring of dev-1 after the client's last frame: `recovered` true, all 30 once, in order,
/// then live data.
#[test]
fn a_client_whose_instance_was_killed_recovers_on_another_from_its_device_rings() {
    let (_redis, mut a, b, cutter, client) = client_on_a("b");
    cut(&cutter, &a, &client, WS_GAUGE);
    b.ingest(json!((1..=20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(21.0));
    kill_a(&mut a, &b);
    b.ingest(json!((21..=30).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}\n{}", b.stderr_lines().join("\n"));
    b.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..31).map(|_| next(&client).1).collect();
    let mut want: Vec<u64> = (1..=30).collect();
    want.push(999);
    assert_eq!(got, want, "what B took in before and after the kill, once, in order, then live");
    assert_eq!(b.metric("hubcast_recovery_succeeded_total{transport=\"socketio_websocket\"}"), Some(1.0));
    assert_eq!(b.metric("hubcast_recovery_replayed_frames_total"), Some(30.0), "all 30 rebuilt on B");
    // The rebuilt stream goes on: the next offset still names dev-1.
    b.ingest(message("dev-1", 1000));
    let (_, n, offset) = next(&client);
    assert_eq!(n, 1000, "nothing twice");
    assert_eq!(part_of(&offset).len(), 1, "{offset}");
}

/// The client's last frame came from A itself (ingested there, never published: B did not
/// watch the device): B cannot know what A took in after it, so the rebuild is refused,
/// `recovered` false counted `history_lost`, and live data flows at once.
#[test]
fn a_cut_the_survivor_never_held_is_not_rebuilt_and_live_data_flows() {
    let (_redis, mut a, b, cutter, client) = client_on_a("a");
    cut(&cutter, &a, &client, WS_GAUGE);
    kill_a(&mut a, &b);
    b.ingest(message("dev-1", 5));
    b.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(1.0));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(b.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    b.ingest(message("dev-1", 999));
    assert_eq!(next(&client).1, 999, "live data at once, nothing replayed");
}
