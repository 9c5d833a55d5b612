//! Issue 24, `kill -9` of the client's instance with `--redis-url` (docs/design/recovery.md
//! steps 10–11): the device rings another instance keeps, the offset's device part, and the
//! rebuild of a history on another instance after the client's instance died.
//! Real binaries on one `redis-server`, the npm socket.io-client behind a cutting proxy.

mod common;

use std::time::Duration;

use common::sio::{socketio_at, SioClient};
use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);
/// What the client prints: `recovered`, pid presence, each event's offset.
const PRINT: (&str, &str) = ("SIO_PRINT_OFFSETS", "1");

fn instance(redis: &common::redis::Redis, id: &str, extra: &[&str]) -> Server {
    let url = redis.url();
    let mut args = vec!["--redis-url", &url, "--instance-id", id, "--redis-prefix", "t"];
    args.extend_from_slice(extra);
    let server = Server::start(&args);
    server.wait_for_metric(&format!("hubcast_redis_connected{{instance=\"{id}\"}}"), WAIT, Want::Eq(1.0));
    server
}

/// A session granted and subscribed to each device's d2c messages.
fn d2c_session(server: &Server, devices: &[&str]) -> String {
    let session = server.new_session();
    for device in devices {
        server.grant(&session, kind("d2cMessages", device));
        let (status, body) = server.subscribe(&session, kind("d2cMessages", device));
        assert_eq!(status, 204, "{body}");
    }
    session
}

fn message(device: &str, n: u64) -> Value {
    json!({"deviceId": device, "body": {"n": n}})
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
    let (a, b) = (instance(&redis, "a", &[]), instance(&redis, "b", &[]));
    let session = d2c_session(&a, &["dev-1", "dev-2"]);
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
    let (a, b) = (instance(&redis, "a", &off), instance(&redis, "b", &off));
    let session = d2c_session(&a, &["dev-1"]);
    let client = socketio_at(&format!("http://127.0.0.1:{}", a.port), &[&session], "websocket", false, &[PRINT]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], false);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(message("dev-1", 1));
    let e = client.wait_for("data", WAIT).expect("a data event");
    assert_eq!(e["offset"], Value::Null, "{e}");
    assert_eq!(b.metric("hubcast_recovery_ring_bytes{instance=\"b\"}"), Some(0.0));
}
