//! Adoption's failure paths (issue 24, docs/design/recovery.md step 6): a SIGTERM hands an
//! away client's recovery history to another instance, and when that cannot be done
//! losslessly the client must get `recovered` false with live data at once, never a replay
//! with a hole or a duplicate. Real binaries on one `redis-server`, the real
//! `socket.io-client` behind a [`Cutter`](common::lb::Cutter) that cuts it off and later
//! brings it to another instance.
//!
//! The stopping instance's own outcomes are counted after its listener closed, so no scrape
//! sees them: they are read from the line it logs as it leaves Redis (`Cluster::leave`). The
//! adopter's are read from its `/metrics`. Where the handshake must be slow (the adopter has
//! not answered yet), the adopter is stopped with SIGSTOP and resumed with SIGCONT: a real
//! process that does not read its socket, as a stalled instance would.

mod common;

use common::lb::Cutter;
use common::recovery::*;
use common::sio::SioClient;
use common::*;
use serde_json::json;

/// `hubcast_redis_adoptions_total` of `server` (instance `id`) for `outcome`.
fn adoptions(server: &Server, id: &str, outcome: &str) -> Option<f64> {
    server.metric(&format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"{outcome}\"}}"))
}

/// The outcomes the stopping instance logged as it left Redis (`sent=1 kept=0 …`).
fn stop_outcomes(stopped: &Server) -> String {
    let lines = stopped.stderr_lines();
    lines
        .iter()
        .find(|l| l.contains("recovery histories of this instance by outcome"))
        .unwrap_or_else(|| panic!("no outcome line:\n{}", lines.join("\n")))
        .clone()
}

/// Asserts each `name=value` is in the stopping instance's outcome line.
fn assert_stop_outcomes(stopped: &Server, want: &[&str]) {
    let line = stop_outcomes(stopped);
    for w in want {
        assert!(line.contains(w), "{w} in {line}");
    }
}

/// Three instances on one Redis (flags for A, then for B and C), the client on A behind the
/// cutter, past one message and cut off; the instance that is not the adopter ingests 0..10,
/// which reach A's history (its session still watches the device).
struct Away {
    redis: common::redis::Redis,
    a: Server,
    adopter: Server,
    adopter_id: &'static str,
    other: Server,
    other_id: &'static str,
    cutter: Cutter,
    client: SioClient,
}

fn away(flags_a: &[&str], flags_bc: &[&str]) -> Away {
    away_over("websocket", flags_a, flags_bc)
}

/// [`away`] with the client on `transports` (`"websocket"` or `"polling"`).
fn away_over(transports: &str, flags_a: &[&str], flags_bc: &[&str]) -> Away {
    let redis = common::redis::Redis::start();
    let a = instance_with(&redis, "a", flags_a);
    let (b, c) = (instance_with(&redis, "b", flags_bc), instance_with(&redis, "c", flags_bc));
    let w = away_from_a(&a, b, c, transports);
    Away { redis, a, adopter: w.adopter, adopter_id: w.adopter_id, other: w.other, other_id: w.other_id, cutter: w.cutter, client: w.client }
}

/// A client on an instance that never held its history failed once: `unknown_pid`, or
/// `history_lost` when its offset names device cuts that instance's rings cannot serve
/// (design step 11 tries those first).
fn failed_elsewhere(server: &Server) {
    let failed = |reason: &str| server.metric(&format!("hubcast_recovery_failed_total{{reason=\"{reason}\"}}")).unwrap_or(0.0);
    assert_eq!(failed("unknown_pid") + failed("history_lost"), 1.0);
    assert_eq!(server.metric("hubcast_recovery_replayed_frames_total"), Some(0.0));
}

/// The client, brought to `to`: its `connect` event, once it has been checked not to be
/// recovered, with live data at once: the next event is the live message `from` ingests,
/// nothing of what it missed (no replay with a hole), and nothing twice. `from` (instance
/// `from_id`) is another instance than `to`: it publishes once it knows `to` watches the device.
fn not_recovered_and_live(cutter: &Cutter, client: &SioClient, to: &Server, from: &Server, from_id: &str) -> serde_json::Value {
    cutter.retarget(to.port);
    let back = come_back(cutter, client);
    assert_ne!(back["recovered"], true, "{back}");
    if to.port != from.port {
        from.wait_for_metric(&format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{from_id}\"}}"), WAIT, Want::Eq(1.0));
    }
    from.ingest(message("dev-1", 999));
    assert_eq!(next_n(client).0, 999, "live data at once, nothing of the past");
    from.ingest(message("dev-1", 1001));
    assert_eq!(next_n(client).0, 1001, "nothing twice");
    back
}

/// A's SIGTERM with the adopter stopped (SIGSTOP): A hands the history over, `msg` from the
/// other instance is in Redis (`MONITOR`) before the adopter goes on (SIGCONT) and
/// subscribes, so A's copy takes it and the adopter does not; A exits having logged `line`.
fn grows_during_the_hand_over(w: &mut Away, msg: serde_json::Value, line: &str) {
    let monitor = Monitor::start(w.redis.port);
    handed_to_a_stopped_adopter(&w.a, &w.adopter, &monitor, &format!("t:adopt:{}", w.adopter_id));
    let publish = "\"PUBLISH\" \"t:device:dev-1\"";
    let published = monitor.count(publish);
    w.other.ingest(msg);
    // In Redis before the adopter's `watching`, so A's pub/sub gets it before the answer.
    monitor.wait_past(publish, published);
    w.adopter.signal(libc::SIGCONT);
    let exit = w.a.wait_exit(WAIT).expect("A exits");
    assert!(exit.success(), "{exit:?}");
    let lines = w.a.stderr_lines();
    assert!(lines.iter().any(|l| l.contains(line)), "{}\nRedis:\n{}", lines.join("\n"), monitor.lines("t:").join("\n"));
}

/// A's history grew after it was written (a message from the other instance reached A after
/// the hand-over, before the adopter had subscribed): the adopter lacks it, so A's verdict
/// carries what A took in since, with each frame's key (`tail_sent`), and the adopter
/// stitches in what it lacks (`stitched`, design step 6): the client recovers every message
/// once, in order (before, the history was voided: `recovered` false). Made certain, not
/// raced for: the adopter is stopped before A's SIGTERM, the message is published (Redis
/// `MONITOR`) after A handed the history over, and only then does the adopter go on and
/// subscribe.
#[test]
fn a_history_that_grew_after_the_hand_over_is_stitched_and_the_client_recovers_every_message() {
    let mut w = away(&HANDOFF_PAUSED, &HANDOFF_PAUSED);
    grows_during_the_hand_over(&mut w, message("dev-1", 10), "deliveries reached the history after it was handed over");
    assert_stop_outcomes(&w.a, &["sent=1", "kept=0", "voided=0", "tail_sent=1"]);
    let id = w.adopter_id;
    w.adopter.wait_for_metric(&format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"stitched\"}}"), WAIT, Want::Eq(1.0));
    assert_eq!(adoptions(&w.adopter, id, "received"), Some(1.0));
    assert_eq!(adoptions(&w.adopter, id, "lost"), Some(0.0));
    w.cutter.retarget(w.adopter.port);
    let back = come_back(&w.cutter, &w.client);
    assert_eq!(back["recovered"], true, "{back}");
    w.other.ingest(message("dev-1", 1002));
    let got: Vec<u64> = (0..12).map(|_| next_n(&w.client).0).collect();
    let mut want: Vec<u64> = (0..=10).collect();
    want.push(1002);
    assert_eq!(got, want, "every message once, in order, the stitched one last, then live");
    assert_eq!(w.adopter.metric("hubcast_recovery_replayed_frames_total"), Some(11.0));
}

/// What A took in after the hand-over is no longer whole in A's history (one message larger
/// than `--recovery-session-bytes` trimmed it away): nothing can be stitched, so A's verdict
/// is `voided` and the adopter gives the history a new epoch: the client gets `recovered`
/// false and live data at once, never a replay with a hole. Made certain as above.
#[test]
fn a_history_whose_growth_after_the_hand_over_was_trimmed_is_voided_and_the_client_is_not_recovered() {
    let mut w = away(&[&HANDOFF_PAUSED[..], &["--recovery-session-bytes", "4096"]].concat(), &HANDOFF_PAUSED);
    let big = json!({"deviceId": "dev-1", "body": {"n": 10, "pad": "x".repeat(6000)}});
    grows_during_the_hand_over(&mut w, big, "a delivery reached the history after it was handed over and cannot be stitched");
    assert_stop_outcomes(&w.a, &["sent=1", "kept=0", "voided=1", "tail_sent=0"]);
    let id = w.adopter_id;
    w.adopter.wait_for_metric(&format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"lost\"}}"), WAIT, Want::Eq(1.0));
    assert_eq!(adoptions(&w.adopter, id, "received"), Some(1.0));
    assert_eq!(adoptions(&w.adopter, id, "confirmed"), Some(0.0));
    assert_eq!(adoptions(&w.adopter, id, "stitched"), Some(0.0));
    let back = not_recovered_and_live(&w.cutter, &w.client, &w.adopter, &w.other, w.other_id);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(w.adopter.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    assert_eq!(w.adopter.metric("hubcast_recovery_replayed_frames_total"), Some(0.0));
}

/// A verdict wait longer than the whole stop (`--recovery-handoff-wait 30`,
/// `--shutdown-timeout 5`) with an adopter that never answers still leaves the partition
/// leases their 3 s: A gives up on the verdict, then hands its leases over and leaves Redis
/// (before, the wait took the whole deadline and the leases were left to expire: a lease TTL
/// of stalled partitions).
#[test]
fn a_verdict_wait_longer_than_the_stop_still_leaves_time_to_hand_the_leases_over() {
    let flags = ["--recovery-handoff", "true", "--recovery-handoff-wait", "30", "--shutdown-timeout", "5"];
    let mut w = away(&flags, &["--recovery-handoff", "true"]);
    w.adopter.signal(libc::SIGSTOP);
    sigterm(&mut w.a);
    w.adopter.signal(libc::SIGCONT);
    let lines = w.a.stderr_lines().join("\n");
    assert!(lines.contains("handed over without a verdict in time"), "{lines}");
    assert!(!lines.contains("could not hand the partition leases over in time"), "{lines}");
}

/// No answer from the adopter while A stops (it is stopped): A waits its 4 s for the verdict
/// and leaves; the adopter, resumed, takes the history in and voids it when no verdict comes
/// within its 5 s (`--recovery-handoff-wait`'s default and a second more). The client is back on the adopter meanwhile (as a fast reconnect would
/// be): its CONNECT waits, is not recovered (`unknown_pid`: the adopted pids are held aside),
/// and live data flows; the void under its connected socket keeps that socket's own offsets
/// good, so its next blip recovers every message once.
#[test]
fn no_verdict_in_time_voids_the_history_and_a_client_already_back_still_recovers_its_next_blip() {
    let mut w = away(&["--recovery-handoff", "true"], &["--recovery-handoff", "true"]);
    w.adopter.signal(libc::SIGSTOP);
    sigterm(&mut w.a);
    let lines = w.a.stderr_lines();
    assert!(lines.iter().any(|l| l.contains("handed over without a verdict in time")), "{}", lines.join("\n"));
    assert_stop_outcomes(&w.a, &["sent=1", "kept=0", "voided=0"]);
    w.adopter.signal(libc::SIGCONT);
    let id = w.adopter_id;
    w.adopter.wait_for_metric(&format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"received\"}}"), WAIT, Want::Eq(1.0));
    let back = not_recovered_and_live(&w.cutter, &w.client, &w.adopter, &w.other, w.other_id);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(w.adopter.metric("hubcast_recovery_failed_total{reason=\"unknown_pid\"}"), Some(1.0));
    w.adopter.wait_for_metric(&format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"lost\"}}"), WAIT, Want::Eq(1.0));
    assert_eq!(adoptions(&w.adopter, id, "confirmed"), Some(0.0));
    w.other.ingest(message("dev-1", 1002));
    assert_eq!(next_n(&w.client).0, 1002, "live data after the void");
    // A blip on the adopter: what it received after the void is its own, and complete.
    cut(&w.cutter, &w.adopter, &w.client, WS_GAUGE);
    w.other.ingest(json!((20..30).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    w.adopter.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(13.0));
    let back = come_back(&w.cutter, &w.client);
    assert_eq!(back["recovered"], true, "{back}");
    w.other.ingest(message("dev-1", 1003));
    let got: Vec<u64> = (0..11).map(|_| next_n(&w.client).0).collect();
    let mut want: Vec<u64> = (20..30).collect();
    want.push(1003);
    assert_eq!(got, want, "the blip after the void: once, in order, then live");
}

/// The adopter refuses (recovery is off there, a configuration being rolled out): it answers
/// at once, A counts `refused_by_peer` and leaves without waiting; the client, on the
/// adopter, is not recovered and gets live data.
#[test]
fn a_refused_history_is_not_recovered_and_live_data_flows() {
    let mut w = away(&["--recovery-handoff", "true"], &["--recovery-window", "0"]);
    sigterm(&mut w.a);
    assert_stop_outcomes(&w.a, &["sent=1", "kept=0", "voided=0", "refused_by_peer=1"]);
    assert!(!w.a.stderr_lines().iter().any(|l| l.contains("without a verdict in time")), "a refusal is an answer");
    let id = w.adopter_id;
    assert_eq!(adoptions(&w.adopter, id, "received"), Some(1.0));
    assert_eq!(adoptions(&w.adopter, id, "refused"), Some(1.0));
    assert_eq!(adoptions(&w.adopter, id, "lost"), Some(0.0));
    // Nobody watches the device once A is gone: the other instance stops publishing it, and
    // starts again once the client's socket on the adopter watches it.
    w.other.wait_for_metric(&format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{}\"}}", w.other_id), WAIT, Want::Eq(0.0));
    let back = not_recovered_and_live(&w.cutter, &w.client, &w.adopter, &w.other, w.other_id);
    assert_eq!(back["pid"], false, "recovery is off there: no pid, so `recovered` is not true: {back}");
    assert_eq!(w.adopter.metric("hubcast_recovery_failed_total{reason=\"off\"}"), Some(1.0));
}

/// A stopping instance alone on Redis has nobody to hand the history to (`no_peer`): kept
/// (with a data dir it is written there). The client lands on an instance started after A
/// left: not recovered, live data at once.
#[test]
fn with_no_live_peer_the_history_is_not_handed_over_and_the_client_elsewhere_is_not_recovered() {
    let redis = common::redis::Redis::start();
    let mut a = instance_with(&redis, "a", &["--recovery-handoff", "true"]);
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, &a, &session, "websocket", 1000);
    cut(&cutter, &a, &client, WS_GAUGE);
    a.ingest(json!((0..10).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::AtLeast(1.0));
    sigterm(&mut a);
    assert_stop_outcomes(&a, &["sent=0", "no_peer=1"]);
    let b = instance_with(&redis, "b", &["--recovery-handoff", "true"]);
    let back = not_recovered_and_live(&cutter, &client, &b, &b, "b");
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(adoptions(&b, "b", "received"), Some(0.0));
    failed_elsewhere(&b);
}

/// A history over twice `--recovery-session-bytes` + 64 KiB is not sent (`too_large`): Redis
/// would carry it to the adopter's subscriber connection whole. Reached as an operator
/// reaches it: a restart on the same data dir with a smaller `--recovery-session-bytes` reads
/// back the history the earlier run kept (it is trimmed to the new bound at its next
/// delivery, and none comes before the stop). The client, on the other instance, is not
/// recovered and gets live data.
#[test]
fn a_history_too_large_to_hand_over_stays_and_the_client_elsewhere_is_not_recovered() {
    let redis = common::redis::Redis::start();
    let dir = TempDir::new();
    let url = redis.url();
    let on_dir = |extra: &[&str]| {
        let mut args = vec!["--redis-url", &url, "--instance-id", "a", "--redis-prefix", "t", "--data-dir", dir.path()];
        args.extend_from_slice(extra);
        let server = Server::start(&args);
        server.wait_for_metric("hubcast_redis_connected{instance=\"a\"}", WAIT, Want::Eq(1.0));
        server
    };
    // The first run keeps its histories in its data dir at a stop (the default with one).
    let mut a = on_dir(&[]);
    let b = instance_with(&redis, "b", &["--recovery-handoff", "true"]);
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, &a, &session, "websocket", 1000);
    cut(&cutter, &a, &client, WS_GAUGE);
    let pad = "x".repeat(1000);
    a.ingest(json!((0..300).map(|n| json!({"deviceId": "dev-1", "body": {"n": n, "pad": pad}})).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::AtLeast(300_000.0));
    sigterm(&mut a);
    let mut a = on_dir(&["--recovery-session-bytes", "65536", "--recovery-handoff", "true"]);
    let held = a.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::AtLeast(300_000.0));
    assert!(held as usize > 2 * 65536 + (64 << 10), "{held}");
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(2.0));
    sigterm(&mut a);
    assert_stop_outcomes(&a, &["sent=0", "too_large=1"]);
    let back = not_recovered_and_live(&cutter, &client, &b, &b, "b");
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(adoptions(&b, "b", "received"), Some(0.0));
    failed_elsewhere(&b);
}

/// Design step 6b over long polling: the client, forced to `transports: ['polling']`, lands
/// on the third instance X (not the adopter); X's CONNECT (a POST) waits while X takes the
/// history from the adopter, so the client recovers every missed message once, in order,
/// then live data ingested on X. Before, a polling CONNECT did not ask (`unknown_pid`).
#[test]
fn a_polling_client_landing_on_a_third_instance_takes_its_history_from_the_adopter() {
    let mut w = away_over("polling", &["--recovery-handoff", "true"], &["--recovery-handoff", "true"]);
    sigterm(&mut w.a);
    assert_stop_outcomes(&w.a, &["sent=1", "kept=1"]);
    let id = w.adopter_id;
    assert_eq!(adoptions(&w.adopter, id, "confirmed"), Some(1.0));
    w.other.ingest(json!((10..20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    w.adopter.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(10.0));
    w.cutter.retarget(w.other.port);
    let back = come_back(&w.cutter, &w.client);
    assert_eq!(back["recovered"], true, "{back}\n{}", w.other.stderr_lines().join("\n"));
    assert_eq!(back["transport"], "polling", "{back}");
    w.other.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..21).map(|_| next_n(&w.client).0).collect();
    let mut want: Vec<u64> = (0..20).collect();
    want.push(999);
    assert_eq!(got, want, "taken from the adopter over polling: once, in order, then live");
    assert_eq!(w.other.metric("hubcast_recovery_succeeded_total{transport=\"socketio_polling\"}"), Some(1.0));
    assert_eq!(adoptions(&w.other, w.other_id, "confirmed"), Some(1.0));
    assert_eq!(adoptions(&w.adopter, id, "kept"), Some(1.0));
    w.adopter.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::Eq(0.0));
    w.other.ingest(message("dev-1", 1001));
    assert_eq!(next_n(&w.client).0, 1001, "nothing twice");
    // Each history adopted was charged to --redis-inbound-bytes until installed, then let go.
    for (server, id) in [(&w.adopter, id), (&w.other, w.other_id)] {
        server.wait_for_metric(&format!("hubcast_redis_inbound_bytes{{instance=\"{id}\"}}"), WAIT, Want::Eq(0.0));
    }
}

/// Design step 11 over long polling (the same path as 6b's: `socketio::fetch_history`): the
/// client's instance A is killed while the client is cut off; the other instance B, asked by
/// the polling CONNECT, finds no holder and rebuilds the history from its ring of the device:
/// `recovered` true, what B took in before and after the kill once, in order, then live.
#[test]
fn a_polling_client_whose_instance_was_killed_recovers_on_another_from_its_device_rings() {
    let redis = common::redis::Redis::start();
    let lease = ["--lease-ttl", "2"];
    let (mut a, b) = (instance_with(&redis, "a", &lease), instance_with(&redis, "b", &lease));
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = common::sio::socketio_at(&cutter.base(), &[&session], "polling", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    // The cut must be in B's ring: the first message is ingested there.
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(message("dev-1", 0));
    assert_eq!(next_n(&client).0, 0);
    cutter.cut();
    client.wait_for("disconnect", WAIT).expect("the client sees the cut");
    b.ingest(json!((1..=20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(21.0));
    a.signal(libc::SIGKILL);
    a.wait_exit(WAIT).expect("killed");
    b.wait_for_metric("hubcast_redis_instances{instance=\"b\"}", std::time::Duration::from_secs(20), Want::Eq(1.0));
    b.ingest(json!((21..=30).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], true, "{back}\n{}", b.stderr_lines().join("\n"));
    b.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..31).map(|_| next_n(&client).0).collect();
    let mut want: Vec<u64> = (1..=30).collect();
    want.push(999);
    assert_eq!(got, want, "rebuilt over polling: once, in order, then live");
    assert_eq!(b.metric("hubcast_recovery_succeeded_total{transport=\"socketio_polling\"}"), Some(1.0));
}

/// A history is charged to the adopter's `--redis-inbound-bytes` from the moment it is read
/// until its core has installed it: one that would pass the bound is refused (A hears it at
/// once), the subscriber is not dropped for it, and the charge goes back to 0. The client,
/// on the adopter, is not recovered and gets live data. (The histories of the other tests,
/// under the default 64 MiB, are adopted.)
#[test]
fn a_history_over_the_adopters_redis_inbound_bytes_is_refused_and_the_subscriber_stays() {
    let mut w = away(&["--recovery-handoff", "true"], &["--recovery-handoff", "true", "--redis-inbound-bytes", "65536"]);
    let pad = "x".repeat(1000);
    w.other.ingest(json!((10..110).map(|n| json!({"deviceId": "dev-1", "body": {"n": n, "pad": pad}})).collect::<Vec<_>>()));
    w.a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(111.0));
    assert!(w.a.metric("hubcast_recovery_history_bytes").unwrap() > 100_000.0);
    sigterm(&mut w.a);
    assert_stop_outcomes(&w.a, &["sent=1", "kept=0", "refused_by_peer=1"]);
    let id = w.adopter_id;
    assert_eq!(adoptions(&w.adopter, id, "received"), Some(1.0));
    assert_eq!(adoptions(&w.adopter, id, "refused"), Some(1.0));
    assert!(w.adopter.stderr_lines().iter().any(|l| l.contains("over --redis-inbound-bytes")));
    assert_eq!(w.adopter.metric(&format!("hubcast_redis_overruns_total{{instance=\"{id}\"}}")), Some(0.0));
    assert_eq!(w.adopter.metric(&format!("hubcast_redis_inbound_bytes{{instance=\"{id}\"}}")), Some(0.0));
    w.other.wait_for_metric(&format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{}\"}}", w.other_id), WAIT, Want::Eq(0.0));
    let back = not_recovered_and_live(&w.cutter, &w.client, &w.adopter, &w.other, w.other_id);
    assert_eq!(back["recovered"], false, "{back}");
    failed_elsewhere(&w.adopter);
}
