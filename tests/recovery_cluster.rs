//! Issue 23 × issue 24: a Socket.IO client recovers across instances on a Redis Cluster
//! (`--redis-cluster-nodes`: device channels over sharded pub/sub, presence in a sorted set;
//! docs/design/recovery.md, steps 6 and 11, "On a Redis Cluster"). Real binaries on a
//! throwaway 3-master cluster of their own (as tests/cluster.rs: nothing shared with other
//! tests, prefix `t`), the npm socket.io-client behind a cutting proxy.

mod common;

use common::lb::Cutter;
use common::recovery::next_of as next;
use common::recovery::*;
use common::redis::Engine;
use common::sio::{socketio_at, SioClient};
use common::*;
use serde_json::json;

/// A lease TTL of 2 s: a killed instance is known dead within about 2 s.
const FAST_LEASE: [&str; 2] = ["--lease-ttl", "2"];

/// Two instances on a fresh cluster (B logging at debug: why a rebuild was refused); the
/// client (reconnecting fast) behind a cutter to A, its session reading dev-1's d2c
/// messages; a first message (`n` 0), ingested on `first_on`, received.
fn two_with_client_on_a(first_on: &str) -> (Engine, Server, Server, Cutter, SioClient) {
    let engine = Engine::cluster();
    let a = engine.instance("a", &FAST_LEASE);
    let b = engine.instance("b", &[FAST_LEASE[0], FAST_LEASE[1], "--log-level", "debug"]);
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    let first = if first_on == "a" { &a } else { &b };
    first.ingest(message("dev-1", 0));
    let (_, n, offset) = next(&client);
    assert_eq!(n, 0);
    assert_eq!(devices_named(&offset), 1, "the offset names dev-1: {offset}");
    (engine, a, b, cutter, client)
}

/// Issue 24's "`kill -9` of the client's instance" on a Redis Cluster (design step 11): the
/// client is cut off A while B ingests 20 (A takes them into the client's history through
/// sharded pub/sub), A is killed, B ingests 10 more; the client lands on B, which tells A
/// dead from the `instances` sorted set's scores and rebuilds from its ring of dev-1:
/// `recovered` true, all 30 once, in order, then live data. (Before: the probe of who is
/// dead was refused on a cluster, and so was every rebuild.)
#[test]
fn on_a_cluster_a_client_whose_instance_was_killed_recovers_on_another_from_its_device_rings() {
    let (_engine, mut a, b, cutter, client) = two_with_client_on_a("b");
    cut(&cutter, &a, &client, WS_GAUGE);
    b.ingest(json!((1..=20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(21.0));
    kill(&mut a);
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
    b.ingest(message("dev-1", 1000));
    let (_, n, offset) = next(&client);
    assert_eq!(n, 1000, "nothing twice");
    assert_eq!(devices_named(&offset), 1, "the rebuilt stream goes on naming dev-1: {offset}");
}

/// The client's last frame came from A itself (ingested there, never published: B did not
/// watch dev-1 then), so B cannot know what A took in after it: the rebuild is refused for
/// that reason (B's log), not for the cluster, `recovered` false counted `history_lost`,
/// and live data flows at once on the same socket.
#[test]
fn on_a_cluster_a_cut_the_survivor_never_held_is_not_rebuilt_and_live_data_flows() {
    let (_engine, mut a, b, cutter, client) = two_with_client_on_a("a");
    cut(&cutter, &a, &client, WS_GAUGE);
    kill(&mut a);
    b.ingest(message("dev-1", 5));
    b.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(1.0));
    cutter.retarget(b.port);
    let back = come_back(&cutter, &client);
    assert_eq!(back["recovered"], false, "{back}");
    assert_eq!(b.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    let log = b.stderr_lines();
    assert!(
        log.iter().any(|l| l.contains("history not rebuilt") && l.contains("dev-1: ") && l.contains("cut")),
        "refused because dev-1's cut is held nowhere (A counted dead), not for the cluster:\n{}",
        log.join("\n")
    );
    b.ingest(message("dev-1", 999));
    assert_eq!(next(&client).1, 999, "live data at once, nothing replayed");
}

/// Three instances on a fresh cluster (B logging at debug); the client on A reads dev-1
/// (taken in on C) and dev-2 (taken in on B); a first message of each received.
fn three_with_client_on_a() -> (Engine, Server, Server, Server, Cutter, SioClient) {
    let engine = Engine::cluster();
    let a = engine.instance("a", &FAST_LEASE);
    let b = engine.instance("b", &[FAST_LEASE[0], FAST_LEASE[1], "--log-level", "debug"]);
    let c = engine.instance("c", &FAST_LEASE);
    let (cutter, client) = client_on_a_of_three(&a, &b, &c);
    (engine, a, b, c, cutter, client)
}

/// Step 11 with a third live instance, on a Redis Cluster (design step 11 h): the client is
/// cut off A while C takes in dev-1 and B dev-2, A is killed, both take in more; the client
/// lands on B, which asks C (alive) for its ring of dev-1; C answers on dev-1's own channel,
/// behind what it published of dev-1 before: `recovered` true, each device's messages once,
/// in order, then C's live message. (Before: refused on a cluster once another instance was
/// seen alive.)
#[test]
fn on_a_cluster_with_a_third_live_instance_the_client_recovers_from_every_instances_rings() {
    let (_engine, mut a, b, c, cutter, client) = three_with_client_on_a();
    a_third_live_instance_answers_and_the_client_recovers(&mut a, &b, &c, &cutter, &client);
}

/// C keeps taking dev-1 in while the client lands on B (a thread posting batches of 20 to C,
/// paced): what C applied before it read its ring is in its answer, what came after reaches
/// B on dev-1's channel behind the answer (held, or live) and follows. Every acknowledged
/// message once, in order, no hole: exactly once across instances over sharded pub/sub.
/// Also: while C still counts the killed A as a watcher of dev-1 (until A's presence
/// expires), every `SPUBLISH` is short of it and dev-1's messages wait for their retries
/// (cluster/resend.rs); past its bound of 64 they must still reach B (they were dropped
/// unpublished before, the answer with them).
#[test]
fn on_a_cluster_a_rebuild_while_a_third_instance_keeps_ingesting_gives_every_message_once_in_order() {
    let (_engine, mut a, b, c, cutter, client) = three_with_client_on_a();
    a_third_instance_ingesting_through_the_rebuild_gives_every_message_once(&mut a, &b, &c, &cutter, &client);
}

/// Issue 24's "a SIGTERM deploy where the client lands on another instance" on a Redis
/// Cluster (design step 6, "On a Redis Cluster"): three instances, the client on A cut off,
/// C takes in 20 that reach A's history through sharded pub/sub; A stops (SIGTERM) and
/// hands the history over; its marks, each on its device's own channel, settle the verdict
/// (`kept`); C takes in 20 more while the client is away; the client, back through the proxy
/// now aimed at the adopter, recovers: every message once, in order, then live. (Before:
/// not handed over on a cluster, counted `unsupported`, `recovered` false.)
#[test]
fn on_a_cluster_a_sigterm_hands_the_history_to_another_instance_where_the_client_recovers() {
    let h = handed_over_on_a_cluster();
    let (adopter, other, cutter, client) = (&h.adopter, &h.other, &h.cutter, &h.client);
    ingest_seen_by(other, adopter, json!((20..40).map(|n| message("dev-1", n)).collect::<Vec<_>>()), 20.0);
    cutter.retarget(adopter.port);
    let back = come_back(cutter, client);
    assert_eq!(back["recovered"], true, "{back}\n{}", adopter.stderr_lines().join("\n"));
    other.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..41).map(|_| next(client).1).collect();
    let mut want: Vec<u64> = (0..40).collect();
    want.push(999);
    assert_eq!(got, want, "before and after A stopped, once, in order, then live");
    assert_eq!(adopter.metric("hubcast_recovery_replayed_frames_total"), Some(40.0));
}

/// What [`handed_over_on_a_cluster`] leaves: the cluster, the adopter and the other instance,
/// the proxy (still aimed at the stopped A) and the client, cut off.
struct HandedOver {
    _engine: Engine,
    adopter: Server,
    other: Server,
    cutter: Cutter,
    client: SioClient,
}

/// Three instances on a fresh cluster, the client on A cut off with 20 of C's messages in
/// its history; A stops (SIGTERM) and hands it over: its log says `kept=1` (the marks on
/// the device's channel settled it) and the adopter (B or C, by the session id) confirmed.
fn handed_over_on_a_cluster() -> HandedOver {
    let engine = Engine::cluster();
    let flags = ["--recovery-handoff", "true"];
    let mut a = engine.instance("a", &flags);
    let (b, c) = (engine.instance("b", &flags), engine.instance("c", &flags));
    let (cutter, client) = cut_off_a_with_a_history_from_c(&a, &c);
    sigterm(&mut a);
    let lines = a.stderr_lines().join("\n");
    assert!(lines.contains("recovery histories of this instance by outcome") && lines.contains("kept=1") && lines.contains("unsupported=0"), "{lines}");
    let confirmed = |id: &str| format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"confirmed\"}}");
    let id = if b.metric(&confirmed("b")) == Some(1.0) { "b" } else { "c" };
    let (adopter, other) = if id == "b" { (b, c) } else { (c, b) };
    assert_eq!(adopter.metric(&confirmed(id)), Some(1.0), "the adopter confirmed before A left");
    HandedOver { _engine: engine, adopter, other, cutter, client }
}

/// Design step 6b on a Redis Cluster: the client lands on the instance that is not the
/// adopter; it finds the adopter in `P:stream:<session>`, asks it (`take`) and is handed
/// the history with the same handshake (marks on the device's channel) before it answers
/// the CONNECT: `recovered` true, all 40 once, in order, then live data taken in there.
#[test]
fn on_a_cluster_a_client_landing_on_a_third_instance_takes_its_history_from_the_adopter() {
    let h = handed_over_on_a_cluster();
    ingest_seen_by(&h.other, &h.adopter, json!((20..40).map(|n| message("dev-1", n)).collect::<Vec<_>>()), 20.0);
    h.cutter.retarget(h.other.port);
    let back = come_back(&h.cutter, &h.client);
    assert_eq!(back["recovered"], true, "{back}\n{}\n{}", h.other.stderr_lines().join("\n"), h.adopter.stderr_lines().join("\n"));
    h.other.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..41).map(|_| next(&h.client).1).collect();
    let mut want: Vec<u64> = (0..40).collect();
    want.push(999);
    assert_eq!(got, want, "taken from the adopter: once, in order, then live");
    assert_eq!(h.other.metric("hubcast_recovery_replayed_frames_total"), Some(40.0));
}

/// Design step 6's stitch on a Redis Cluster: A's history grew after it was handed over (a
/// message of the other instance reached A before the adopter had subscribed), so A's marks,
/// each behind that device's messages on its own channel, find the history grown: A's
/// verdict carries what it took in since (`tail_sent`) and the adopter stitches it in
/// (`stitched`): the client recovers every message once, in order. Made certain as on one
/// Redis (tests/recovery_adopt.rs): the adopter is stopped before A's SIGTERM, the message
/// is `SPUBLISH`ed (`MONITOR` on the device's master) after A handed the history over (on
/// the control master), and only then does the adopter go on and subscribe.
#[test]
fn on_a_cluster_a_history_that_grew_after_the_hand_over_is_stitched_and_the_client_recovers_every_message() {
    let (engine, mut a, b, c) = three_for_a_stopped_adopter();
    let AwayFromA { adopter, adopter_id, other, cutter, client, .. } = away_from_a(&a, b, c, "websocket");
    let control = monitor_of(&engine, "{t}");
    let device = monitor_of(&engine, "t:device:dev-1");
    handed_to_a_stopped_adopter(&a, &adopter, &control, &format!("{{t}}:adopt:{adopter_id}"));
    ingested_past(&device, &other, "dev-1", 10);
    let lines = stitched_after_a_exits(&mut a, &adopter, adopter_id);
    assert!(lines.contains("deliveries reached the history after it was handed over"), "{lines}");
    recovered_on_the_adopter(&adopter, &other, &cutter, &client);
    let got: Vec<u64> = (0..12).map(|_| next(&client).1).collect();
    let mut want: Vec<u64> = (0..=10).collect();
    want.push(1002);
    assert_eq!(got, want, "every message once, in order, the stitched one last, then live");
    assert_eq!(adopter.metric("hubcast_recovery_replayed_frames_total"), Some(11.0));
}

/// Design step 6 on a Redis Cluster: the verdict waits for a mark from every **distinct**
/// device of the session, so a mark that comes twice (a command the redis crate sends again
/// after a lost reply, a `watching` answered twice) cannot stand for another device's mark
/// still on its way behind messages the adopter lacks. The session reads dev-1 and dev-2;
/// the adopter is stopped before A's SIGTERM; once A has handed the history over, dev-1's
/// mark comes twice on dev-1's channel (crafted as A publishes it), then the other
/// instance's dev-2 message reaches A (not the stopped adopter). Counting marks, those two
/// decided the verdict at once (`kept`): the adopter kept a history without that message,
/// a hole. Counted per device, the verdict waits for dev-2's own mark, behind the message:
/// `tail_sent`, stitched, the client recovers every message once, in order.
#[test]
fn on_a_cluster_a_mark_that_comes_twice_does_not_decide_the_verdict_before_every_device_is_marked() {
    let (engine, mut a, b, c) = three_for_a_stopped_adopter();
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(3.0));
    let session = d2c_session_of(&a, &["dev-1", "dev-2"]);
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, &a, &session, "websocket", 1000);
    cut(&cutter, &a, &client, WS_GAUGE);
    let (adopter, adopter_id, other, other_id) = match adopter_of(&session, &["b", "c"]) {
        0 => (b, "b", c, "c"),
        _ => (c, "c", b, "b"),
    };
    other.wait_for_metric(&format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{other_id}\"}}"), WAIT, Want::Eq(2.0));
    other.ingest(json!((0..5).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(6.0));
    let control = monitor_of(&engine, "{t}");
    let dev2 = monitor_of(&engine, "t:device:dev-2");
    handed_to_a_stopped_adopter(&a, &adopter, &control, &format!("{{t}}:adopt:{adopter_id}"));
    // dev-1's mark, twice: `0x55`, to "a", the session, 2 marks expected (adopt.rs).
    let id = {
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(&session).expect("a session id");
        u128::from_le_bytes(bytes.try_into().expect("16 bytes"))
    };
    let mut mark = vec![0x55u8];
    mark.extend_from_slice(&1u32.to_le_bytes());
    mark.extend_from_slice(b"a");
    mark.extend_from_slice(&id.to_le_bytes());
    mark.extend_from_slice(&2u32.to_le_bytes());
    for _ in 0..2 {
        let got = engine.command_bytes("t:device:dev-1", &[b"SPUBLISH", b"t:device:dev-1", &mark]).expect("SPUBLISH");
        assert_eq!(got, b":1\r\n", "A's subscriber got dev-1's mark");
    }
    ingested_past(&dev2, &other, "dev-2", 10);
    // The verdict waited for dev-2's own mark, behind its message: `tail_sent=1`.
    stitched_after_a_exits(&mut a, &adopter, adopter_id);
    recovered_on_the_adopter(&adopter, &other, &cutter, &client);
    let got: Vec<(String, u64)> = (0..7).map(|_| next(&client)).map(|(d, n, _)| (d, n)).collect();
    let mut want: Vec<(String, u64)> = (0..5).map(|n| ("dev-1".to_string(), n)).collect();
    want.push(("dev-2".to_string(), 10));
    want.push(("dev-1".to_string(), 1002));
    assert_eq!(got, want, "every message once, in order, dev-2's stitched in, then live");
}

/// Three instances on a fresh cluster with the hand-over flags of the tests that keep the
/// adopter stopped through several steps ([`HANDOFF_PAUSED`]: a verdict wait that fits them
/// under load).
fn three_for_a_stopped_adopter() -> (Engine, Server, Server, Server) {
    let engine = Engine::cluster();
    let a = engine.instance("a", &HANDOFF_PAUSED);
    let (b, c) = (engine.instance("b", &HANDOFF_PAUSED), engine.instance("c", &HANDOFF_PAUSED));
    (engine, a, b, c)
}

/// A [`Monitor`] of the master serving `key`.
fn monitor_of(engine: &Engine, key: &str) -> Monitor {
    let Engine::Cluster(nodes) = engine else { unreachable!("a cluster") };
    Monitor::start(nodes.port(nodes.owner_of(nodes.slot_of(key))))
}

/// `other` takes in `device`'s message `n`, once `monitor` (on the device's master) has seen
/// it `SPUBLISH`ed.
fn ingested_past(monitor: &Monitor, other: &Server, device: &str, n: u64) {
    let publish = format!("\"SPUBLISH\" \"t:device:{device}\"");
    let published = monitor.count(&publish);
    other.ingest(message(device, n));
    monitor.wait_past(&publish, published);
}

/// The stopped adopter goes on; A exits having sent the history's tail with its verdict
/// (`tail_sent=1`), and the adopter stitches it in. A's log.
fn stitched_after_a_exits(a: &mut Server, adopter: &Server, adopter_id: &str) -> String {
    adopter.signal(libc::SIGCONT);
    let exit = a.wait_exit(WAIT).expect("A exits");
    assert!(exit.success(), "{exit:?}");
    let lines = a.stderr_lines().join("\n");
    assert!(lines.contains("tail_sent=1") && lines.contains("unsupported=0"), "{lines}");
    let stitched = format!("hubcast_redis_adoptions_total{{instance=\"{adopter_id}\",outcome=\"stitched\"}}");
    adopter.wait_for_metric(&stitched, WAIT, Want::Eq(1.0));
    lines
}

/// The client, back through the proxy now aimed at the adopter, recovers; `other` then takes
/// in dev-1's live message 1002.
fn recovered_on_the_adopter(adopter: &Server, other: &Server, cutter: &Cutter, client: &SioClient) {
    cutter.retarget(adopter.port);
    let back = come_back(cutter, client);
    assert_eq!(back["recovered"], true, "{back}");
    other.ingest(message("dev-1", 1002));
}
