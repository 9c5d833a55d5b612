//! Issue 24, `kill -9` of the client's instance with `--redis-url` (docs/design/recovery.md
//! steps 10–11): the device rings another instance keeps, the offset's device part, and the
//! rebuild of a history on another instance after the client's instance died.
//! Real binaries on one `redis-server`, the npm socket.io-client behind a cutting proxy.

mod common;

use std::time::Duration;

use common::lb::Cutter;
use common::recovery::next_of as next;
use common::recovery::*;
use common::sio::{socketio_at, SioClient};
use common::*;
use serde_json::{json, Value};

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
/// `devices`' d2c messages; a first message of each (`n` 0), ingested on `first_on`, received.
fn client_on_a_of(first_on: &str, devices: &[&str]) -> (common::redis::Redis, Server, Server, Cutter, SioClient) {
    let redis = common::redis::Redis::start();
    let (a, b) = (instance_with(&redis, "a", &FAST_LEASE), instance_with(&redis, "b", &FAST_LEASE));
    let session = d2c_session_of(&a, devices);
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    let watched = format!("{}", devices.len());
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(watched.parse().unwrap()));
    let first = if first_on == "a" { &a } else { &b };
    first.ingest(json!(devices.iter().map(|d| message(d, 0)).collect::<Vec<_>>()));
    let mut offset = String::new();
    for _ in devices {
        let (_, n, o) = next(&client);
        assert_eq!(n, 0);
        offset = o;
    }
    assert_eq!(part_of(&offset).len(), devices.len(), "the offset names every device: {offset}");
    (redis, a, b, cutter, client)
}

fn client_on_a(first_on: &str) -> (common::redis::Redis, Server, Server, Cutter, SioClient) {
    client_on_a_of(first_on, &["dev-1"])
}

/// Kills A (SIGKILL). B still counts it alive until its presence expires (`--lease-ttl`);
/// the client comes back before that, as it would (the rebuild probes A's presence).
fn kill_a(a: &mut Server, b: &Server) {
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    let _ = b;
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

/// Two devices (dev-1 on core 0, dev-2 on core 1 of 2: whichever the session's core, one ask
/// crosses the mesh), their messages interleaved in
/// B's batches before and after the kill: every one once, each device's in order, and all
/// in the order B took them in (merged by key).
#[test]
fn a_rebuild_of_two_devices_merges_them_in_the_order_they_were_taken_in() {
    let (_redis, mut a, b, cutter, client) = client_on_a_of("b", &["dev-1", "dev-2"]);
    let devices = ["dev-1", "dev-2"];
    let batch = |from: u64, to: u64| json!((from..=to).map(|n| message(devices[(n % 2) as usize], n)).collect::<Vec<_>>());
    cut(&cutter, &a, &client, WS_GAUGE);
    b.ingest(batch(1, 20));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(22.0));
    kill_a(&mut a, &b);
    b.ingest(batch(21, 30));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    b.ingest(message("dev-1", 999));
    let got: Vec<(String, u64)> = (0..31).map(|_| next(&client)).map(|(d, n, _)| (d, n)).collect();
    let mut want: Vec<(String, u64)> = (1..=30).map(|n| (devices[(n % 2) as usize].to_string(), n)).collect();
    want.push(("dev-1".into(), 999));
    assert_eq!(got, want);
}

/// B keeps ingesting while the client lands on it (a thread posting batches of 20, paced,
/// two devices on the two cores, so that at least one ask crosses the mesh): what a device
/// core applied before it answered the rebuild is in its ring, what came after was held and
/// follows. Every acknowledged message once, each device's in order, no hole.
#[test]
fn a_rebuild_while_the_survivor_keeps_ingesting_gives_every_message_once_in_order() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let devices = ["dev-1", "dev-2"];
    let (_redis, mut a, b, cutter, client) = client_on_a_of("b", &devices);
    cut(&cutter, &a, &client, WS_GAUGE);
    kill_a(&mut a, &b);
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let firehose = {
        let (acked, stop, url) = (acked.clone(), stop.clone(), b.url("/ingest"));
        std::thread::spawn(move || {
            let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(2)).build();
            let mut n = 1;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<Value> = (n..n + 20).map(|i| message(devices[(i % 2) as usize], i)).collect();
                let r = agent.post(&url).set(ADMIN.0, ADMIN.1).send_json(json!(batch)).expect("ingested");
                assert_eq!(r.status(), 200);
                acked.store(n + 19, Ordering::SeqCst);
                n += 20;
                // Paced (not a wait): about 1,000 messages a second, so the seconds the
                // rebuild waits for A's presence to show it dead stay within the session
                // bound (a history past it is refused, honestly, and this test is not about it).
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    b.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(100.0));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}");
    // Live messages after the recovery, then the firehose stops.
    let first_live = acked.load(Ordering::SeqCst) + 100;
    let mut got = Vec::new();
    while got.iter().filter(|(_, n, _)| *n >= first_live).count() < 2 {
        got.push(next(&client));
    }
    stop.store(true, Ordering::Relaxed);
    firehose.join().unwrap();
    let last = acked.load(Ordering::SeqCst);
    while got.len() < last as usize {
        got.push(next(&client));
    }
    let mut seen: Vec<u64> = got.iter().map(|(_, n, _)| *n).collect();
    seen.sort_unstable();
    assert_eq!(seen, (1..=last).collect::<Vec<_>>(), "every message once, no hole");
    for device in devices {
        let mine: Vec<u64> = got.iter().filter(|(d, _, _)| d == device).map(|(_, n, _)| *n).collect();
        assert!(mine.windows(2).all(|w| w[0] < w[1]), "{device}'s in order: {mine:?}");
    }
}

/// Three instances A, B, C; the client on A reads dev-1 (taken in on C) and dev-2 (taken in on
/// B); a first message of each received.
fn three_with_client_on_a() -> (common::redis::Redis, Server, Server, Server, Cutter, SioClient) {
    three_with_client_on_a_and(&[])
}

/// [`three_with_client_on_a`], C started with `c_extra` too.
fn three_with_client_on_a_and(c_extra: &[&str]) -> (common::redis::Redis, Server, Server, Server, Cutter, SioClient) {
    let redis = common::redis::Redis::start();
    let a = instance_with(&redis, "a", &FAST_LEASE);
    let b = instance_with(&redis, "b", &[FAST_LEASE[0], FAST_LEASE[1], "--log-level", "debug"]);
    let c = instance_with(&redis, "c", &[&FAST_LEASE[..], c_extra].concat());
    let (cutter, client) = client_on_a_of_three(&a, &b, &c);
    (redis, a, b, c, cutter, client)
}

/// Issue 24's last case with a third instance alive (design step 11, asking the others'
/// rings): the client is cut off A while C takes in dev-1 and B dev-2, A is killed, both take
/// in more; the client lands on B, which asks C for what its ring of dev-1 holds after the
/// client's cut and rebuilds from C's answer and its own ring: `recovered` true, every
/// missed message once, each device's in order, then live data from C.
#[test]
fn with_a_third_live_instance_the_client_recovers_from_every_instances_rings() {
    let (_redis, mut a, b, c, cutter, client) = three_with_client_on_a();
    a_third_live_instance_answers_and_the_client_recovers(&mut a, &b, &c, &cutter, &client);
}

/// C keeps taking dev-1 in while the client lands on B (a thread posting batches of 20 to C,
/// paced): what C applied before it read its ring is in its answer, what came after reaches
/// B behind the answer and was held (or is live) and follows. Every acknowledged message
/// once, in order, no hole: exactly once across instances.
#[test]
fn a_rebuild_while_a_third_instance_keeps_ingesting_gives_every_message_once_in_order() {
    let (_redis, mut a, b, c, cutter, client) = three_with_client_on_a();
    a_third_instance_ingesting_through_the_rebuild_gives_every_message_once(&mut a, &b, &c, &cutter, &client);
}

/// C answers, but its ring of dev-1 (taken in there) lost the client's cut to its core bound
/// (`--recovery-core-bytes 4096` on C: the largest ring is emptied): B cannot know what C
/// took in between, so the rebuild is refused: `recovered` false, `history_lost`, live data
/// at once, nothing replayed.
#[test]
fn a_third_instance_whose_ring_lost_the_cut_refuses_the_rebuild_and_live_data_flows() {
    let (_redis, mut a, b, c, cutter, client) = three_with_client_on_a_and(&["--recovery-core-bytes", "4096"]);
    cut(&cutter, &a, &client, WS_GAUGE);
    c.ingest(json!((1..=60).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(62.0));
    kill_a(&mut a, &b);
    c.ingest(message("dev-1", 61));
    c.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(62.0));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(b.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    let log = b.stderr_lines();
    assert!(log.iter().any(|l| l.contains("another instance is alive") && l.contains("instance=c")), "C was asked");
    assert!(log.iter().any(|l| l.contains("history not rebuilt") && l.contains("dev-1: its cut is not held where it is taken in")), "{}", log.join("\n"));
    c.ingest(message("dev-1", 999));
    let (device, n, _) = next(&client);
    assert_eq!((device.as_str(), n), ("dev-1", 999), "live data at once, nothing replayed");
}

/// C, where dev-1 is taken in, is frozen (SIGSTOP) before the client lands on B: it renews its
/// presence no more, so B counts it dead and does not ask it, and nobody else holds the
/// client's cut of dev-1: `recovered` false, `history_lost`, and live data at once (B's
/// dev-2). Never a replay with a hole. (C's own live data after its SIGCONT is not checked:
/// it depends on C having seen B's `+watch`, which nothing here waits for; it failed once in
/// a parallel run.)
#[test]
fn a_third_instance_that_cannot_answer_refuses_the_rebuild_and_live_data_flows() {
    let (_redis, mut a, b, c, cutter, client) = three_with_client_on_a();
    cut(&cutter, &a, &client, WS_GAUGE);
    c.ingest(json!((1..=5).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    b.ingest(json!((6..=10).map(|n| message("dev-2", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(12.0));
    c.signal(libc::SIGSTOP);
    kill_a(&mut a, &b);
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    c.signal(libc::SIGCONT);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(b.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    assert!(b.stderr_lines().iter().any(|l| l.contains("history not rebuilt") && l.contains("dev-1")), "refused for dev-1:\n{}", b.stderr_lines().join("\n"));
    b.ingest(message("dev-2", 999));
    let (device, n, _) = next(&client);
    assert_eq!((device.as_str(), n), ("dev-2", 999), "live data at once, nothing replayed");
}
