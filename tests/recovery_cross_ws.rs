//! Issue 24 item 2 across instances: a plain WebSocket (`/ws?sessionId=…&offsets=1`, then
//! `&since=<offset>`) recovers where a Socket.IO client does (docs/design/recovery.md steps
//! 6b, 10 and 11): its offsets carry the device part with `--redis-url`, and a `since=` whose
//! history is not on the instance it lands on is taken from the instance holding it or
//! rebuilt from the device rings, before its first frame says `recovered`.
//! Real binaries on one `redis-server`, a tungstenite client behind the cutting proxy; every
//! wait is on an event (a frame, a metric, a log line, the proxy's counters).

mod common;

use std::time::Duration;

use common::lb::Cutter;
use common::recovery::*;
use common::ws::{connect, Live};
use common::*;
use serde_json::{json, Value};

/// A lease TTL of 2 s: a killed instance leaves the others' view of live instances soon.
const FAST_LEASE: [&str; 2] = ["--lease-ttl", "2"];

const PLAIN_GAUGE: &str = "hubcast_sockets{transport=\"websocket\"}";

/// The next frame (JSON) within [`WAIT`].
fn frame(ws: &mut Live) -> Value {
    ws.next_json(WAIT).unwrap_or_else(|| panic!("a frame within {WAIT:?} (closed: {:?})", ws.closed))
}

/// The next envelope: its message's device, `n` and offset.
fn next(ws: &mut Live) -> (String, u64, String) {
    let e = frame(ws);
    let n = e["message"]["n"].as_u64().unwrap_or_else(|| panic!("a d2c message: {e}"));
    let device = e["deviceId"].as_str().unwrap_or_else(|| panic!("{e}")).to_string();
    let offset = e["offset"].as_str().unwrap_or_else(|| panic!("an offset: {e}")).to_string();
    (device, n, offset)
}

/// The device part of an offset, one `device hash-key hash` item per device (as
/// tests/recovery_cross.rs reads it).
fn part_of(offset: &str) -> Vec<String> {
    let items: Vec<&str> = offset.split('.').collect();
    assert!(items.len() >= 3 && items[0] == "h1", "{offset}");
    items[3..].iter().map(|i| i.to_string()).collect()
}

/// The seq of an offset (base 36), device part or not.
fn seq(offset: &str) -> u64 {
    u64::from_str_radix(offset.split('.').nth(2).unwrap_or_else(|| panic!("{offset}")), 36).unwrap()
}

/// The plain socket of `session` through the cutter, with offsets, after `since` if any.
fn plain_at(cutter: &Cutter, session: &str, since: Option<&str>) -> Live {
    let since = since.map(|s| format!("&since={s}")).unwrap_or_default();
    connect(&cutter.base(), &format!("/ws?sessionId={session}&offsets=1{since}"))
}

/// Cuts the client off and waits until `server` has let the socket go.
fn cut_plain(cutter: &Cutter, server: &Server) {
    cutter.cut();
    server.wait_for_metric(PLAIN_GAUGE, WAIT, Want::Eq(0.0));
}

/// Lets the client back in (through the proxy, now aimed at `port`) with `since`.
fn back_at(cutter: &Cutter, port: u16, session: &str, since: &str) -> Live {
    cutter.retarget(port);
    cutter.release();
    plain_at(cutter, session, Some(since))
}

fn kill(server: &mut Server) {
    server.signal(libc::SIGKILL);
    server.wait_exit(WAIT).expect("killed");
}

/// Two instances (B at `--log-level debug`); the plain client on A behind a cutter, its
/// session reading dev-1's d2c messages; a first message (`n` 0) ingested on `first_on` and
/// received. Returns its offset too.
fn plain_on_a(first_on: &str) -> (common::redis::Redis, Server, Server, Cutter, String, String) {
    let redis = common::redis::Redis::start();
    let a = instance_with(&redis, "a", &FAST_LEASE);
    let b = instance_with(&redis, "b", &[FAST_LEASE[0], FAST_LEASE[1], "--log-level", "debug"]);
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let mut ws = plain_at(&cutter, &session, None);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    let first = if first_on == "a" { &a } else { &b };
    first.ingest(message("dev-1", 0));
    let (_, n, offset) = next(&mut ws);
    assert_eq!(n, 0);
    assert_eq!(part_of(&offset).len(), 1, "the offset names dev-1, as a Socket.IO one does: {offset}");
    (redis, a, b, cutter, session, offset)
}

/// Issue 24's "`kill -9` of the client's instance with `--redis-url`" over plain WebSocket
/// (design step 11): cut off A while B ingests 20 (A takes them into the history), A killed,
/// B ingests 10 more; the client reconnects to B with `since=` its last offset: B rebuilds
/// the history from its ring of dev-1 after the offset's cut: the first frame says
/// `recovered` true, then all 30 once, in order, then live data (whose offset still names
/// dev-1).
#[test]
fn a_plain_client_whose_instance_was_killed_recovers_on_another_from_its_device_rings() {
    let (_redis, mut a, b, cutter, session, offset) = plain_on_a("b");
    cut_plain(&cutter, &a);
    b.ingest(json!((1..=20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(21.0));
    kill(&mut a);
    b.ingest(json!((21..=30).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    let mut ws = back_at(&cutter, b.port, &session, &offset);
    let first = frame(&mut ws);
    assert_eq!(first, json!({"recovered": true, "replayed": 30}), "{}", b.stderr_lines().join("\n"));
    b.ingest(message("dev-1", 999));
    let got: Vec<(String, u64, String)> = (0..31).map(|_| next(&mut ws)).collect();
    let mut want: Vec<u64> = (1..=30).collect();
    want.push(999);
    assert_eq!(got.iter().map(|(_, n, _)| *n).collect::<Vec<_>>(), want, "once, in order, then live");
    let seqs: Vec<u64> = std::iter::once(seq(&offset)).chain(got.iter().map(|(_, _, o)| seq(o))).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "the client's seqs go on: {seqs:?}");
    assert_eq!(part_of(&got[30].2).len(), 1, "a live offset names dev-1 again: {}", got[30].2);
    assert_eq!(b.metric("hubcast_recovery_succeeded_total{transport=\"websocket\"}"), Some(1.0));
    assert_eq!(b.metric("hubcast_recovery_replayed_frames_total"), Some(30.0), "all 30 rebuilt on B");
}

/// Issue 24's "graceful SIGTERM deploy" over plain WebSocket (design steps 6a–6b): three
/// instances, the client cut off A, C ingests 20, A stops (SIGTERM) and hands the history to
/// the adopter (B or C, by the session id), the other instance ingests 20 more; the client
/// reconnects with `since=` to the instance that is *not* the adopter, which takes the history
/// from it before the first frame: `recovered` true, all 40 once, in order, then live.
#[test]
fn a_plain_client_landing_on_a_third_instance_takes_its_history_from_the_adopter() {
    let redis = common::redis::Redis::start();
    let flags = ["--recovery-handoff", "true"];
    let mut a = instance_with(&redis, "a", &flags);
    let (b, c) = (instance_with(&redis, "b", &flags), instance_with(&redis, "c", &flags));
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(3.0));
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let mut ws = plain_at(&cutter, &session, None);
    a.ingest(message("dev-1", 1000));
    let (_, n, offset) = next(&mut ws);
    assert_eq!(n, 1000);
    cut_plain(&cutter, &a);
    c.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"c\"}", WAIT, Want::Eq(1.0));
    c.ingest(json!((0..20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(21.0));
    sigterm(&mut a);
    let handed = a.wait_for_stderr(WAIT, |l| l.contains("recovery histories handed to other instances"));
    assert!(handed.as_deref().is_some_and(|l| l.contains("handed=1")), "{handed:?}\n{}", a.stderr_lines().join("\n"));
    let confirmed = |server: &Server, id: &str| {
        server.metric(&format!("hubcast_redis_adoptions_total{{instance=\"{id}\",outcome=\"confirmed\"}}")) == Some(1.0)
    };
    let deadline = std::time::Instant::now() + WAIT;
    let (adopter, other) = loop {
        if confirmed(&b, "b") {
            break (&b, &c);
        }
        if confirmed(&c, "c") {
            break (&c, &b);
        }
        assert!(std::time::Instant::now() < deadline, "no instance confirmed the adoption");
        std::thread::sleep(Duration::from_millis(20));
    };
    ingest_seen_by(other, adopter, json!((20..40).map(|n| message("dev-1", n)).collect::<Vec<_>>()), 20.0);
    let mut ws = back_at(&cutter, other.port, &session, &offset);
    let first = frame(&mut ws);
    assert_eq!(first, json!({"recovered": true, "replayed": 40}), "{}\n{}", other.stderr_lines().join("\n"), adopter.stderr_lines().join("\n"));
    other.ingest(message("dev-1", 999));
    let got: Vec<u64> = (0..41).map(|_| next(&mut ws).1).collect();
    let mut want: Vec<u64> = (0..40).collect();
    want.push(999);
    assert_eq!(got, want, "taken from the adopter: once, in order, then live");
    assert_eq!(other.metric("hubcast_recovery_succeeded_total{transport=\"websocket\"}"), Some(1.0));
    // The adopter let it go: its copy is gone.
    adopter.wait_for_metric("hubcast_recovery_history_bytes", WAIT, Want::Eq(0.0));
    other.ingest(message("dev-1", 1001));
    assert_eq!(next(&mut ws).1, 1001, "nothing twice");
}

/// The negative of the first test: the client's last frame came from A itself (ingested there,
/// never published: B holds no ring entry with its key), so B, asked to rebuild after it,
/// cannot know what A took in after it: the rebuild is refused (B's log names dev-1), the
/// first frame says `recovered` false with `history_lost`, and live data flows on the same
/// socket at once, nothing replayed.
#[test]
fn a_plain_since_whose_cut_the_survivor_never_held_is_not_recovered_and_live_data_flows() {
    let (_redis, mut a, b, cutter, session, offset) = plain_on_a("a");
    cut_plain(&cutter, &a);
    kill(&mut a);
    b.ingest(message("dev-1", 5));
    b.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(1.0));
    let mut ws = back_at(&cutter, b.port, &session, &offset);
    assert_eq!(frame(&mut ws), json!({"recovered": false, "reason": "history_lost"}));
    // Logged before the frame was written; read from the pipe by a thread of this test.
    let refused = b.wait_for_stderr(WAIT, |l| l.contains("history not rebuilt from device rings") && l.contains("dev-1"));
    assert!(refused.is_some(), "the rebuild was tried and refused for dev-1:\n{}", b.stderr_lines().join("\n"));
    assert_eq!(b.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    b.ingest(message("dev-1", 999));
    let (_, n, live) = next(&mut ws);
    assert_eq!(n, 999, "live data at once, nothing replayed");
    assert_eq!(part_of(&live).len(), 1, "{live}");
}

/// A dead instance's presence kept renewed in Redis (`SET t:instance:<id> <ms> PX 2000`, as
/// its lease task would at `--lease-ttl 2`), a few times per heartbeat, until dropped: to
/// every other instance's probe it is alive, and it answers nothing.
struct Renewing {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Renewing {
    fn start(redis: &common::redis::Redis, id: &'static str) -> Renewing {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        let stop: std::sync::Arc<std::sync::atomic::AtomicBool> = Default::default();
        let (flag, port) = (stop.clone(), redis.port);
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
                if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                    let _ = s.write_all(format!("SET t:instance:{id} {now} PX 2000\r\n").as_bytes());
                    let _ = s.read(&mut [0u8; 64]);
                }
                // The renewal's period, as the lease task's heartbeat (not a wait for an event).
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        Renewing { stop, thread: Some(thread) }
    }
}

impl Drop for Renewing {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Design step 11 g's deadline: an instance seen alive that then does not answer. Made
/// certain rather than timed: after A's `kill -9` its presence key keeps being renewed in
/// Redis (a thread here writes it as A's lease task would), so B's probe sees A renewing,
/// counts it alive and asks its rings, and nobody answers: after the 2 s wait B refuses the
/// rebuild (its log names the instance not answering), the client's first frame says
/// `recovered` false with `history_lost`, and live data follows on the same socket at once.
/// (The same holds for an instance frozen between two of B's probes, or whose subscriber
/// connection is gone while its lease connection renews: only the timing differs.)
#[test]
fn an_instance_seen_alive_that_does_not_answer_refuses_the_rebuild_after_the_wait_and_live_data_flows() {
    let (redis, mut a, b, cutter, session, offset) = plain_on_a("b");
    cut_plain(&cutter, &a);
    b.ingest(json!((1..=5).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(6.0));
    kill(&mut a);
    // A's presence renewed as its lease task does, until the test ends.
    let renewing = Renewing::start(&redis, "a");
    let mut ws = back_at(&cutter, b.port, &session, &offset);
    let first = frame(&mut ws);
    drop(renewing);
    assert_eq!(first, json!({"recovered": false, "reason": "history_lost"}), "{}", b.stderr_lines().join("\n"));
    // Logged before the frame was written; read from the pipe by a thread of this test.
    let seen = b.wait_for_stderr(WAIT, |l| l.contains("another instance is alive") && l.contains("instance=a"));
    assert!(seen.is_some(), "A was seen alive:\n{}", b.stderr_lines().join("\n"));
    let refused = b.wait_for_stderr(WAIT, |l| l.contains("history not rebuilt") && l.contains("no answer in time") && l.contains("\"a\""));
    assert!(refused.is_some(), "refused at the deadline, naming A:\n{}", b.stderr_lines().join("\n"));
    assert_eq!(b.metric("hubcast_recovery_failed_total{reason=\"history_lost\"}"), Some(1.0));
    b.ingest(message("dev-1", 999));
    assert_eq!(next(&mut ws).1, 999, "live data at once, nothing replayed");
}

/// Without `offsets=1` nothing changes for today's clients, with `--redis-url` and a window
/// too: a plain socket's frame is the envelope exactly (no offset, no device part), the same
/// text an `offsets=1` socket gets after its `"offset":"…",` member; so is a `batch=1` one's
/// array element.
#[test]
fn without_offsets_a_plain_socket_gets_todays_frames_exactly_with_redis_and_a_window() {
    let redis = common::redis::Redis::start();
    let (a, b) = (instance(&redis, "a"), instance(&redis, "b"));
    let session = d2c_session(&a, "dev-1");
    let base = format!("http://127.0.0.1:{}", a.port);
    let mut plain = connect(&base, &format!("/ws?sessionId={session}"));
    let mut batched = connect(&base, &format!("/ws?sessionId={session}&batch=1"));
    let mut offsets = connect(&base, &format!("/ws?sessionId={session}&offsets=1"));
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(message("dev-1", 1));
    let with = offsets.next_text(WAIT).expect("a frame");
    let (text, arr) = (plain.next_text(WAIT).expect("a frame"), batched.next_text(WAIT).expect("a frame"));
    let offset = parse_json(&with)["offset"].as_str().expect("an offset").to_string();
    assert_eq!(part_of(&offset).len(), 1, "the offsets=1 socket's offset names dev-1: {offset}");
    let stripped = with.replacen(&format!("\"offset\":\"{offset}\","), "", 1);
    assert_eq!(text, stripped, "the envelope exactly, as before");
    assert!(!text.contains("offset") && !text.contains("h1."), "{text}");
    assert_eq!(arr, format!("[{text}]"));
    assert_eq!(parse_json(&text)["message"]["n"], 1);
}

/// A `since=` on the adopter while its adopted history still awaits the verdict (the adopter,
/// at `--log-level debug`, was stopped through A's 4 s wait, so none will come, and it voids
/// the history 5 s after taking it in; the socket arrives once it is taken in, by its log
/// line): the socket's wait for the verdict ends at 2 s, and nothing is resumed from
/// a history that may yet be voided (a Socket.IO client's pids are held aside then): the first
/// frame says `recovered` false, `history_lost`; the void comes, and live data flows with the
/// new epoch's offsets.
#[test]
fn a_plain_since_before_the_adopters_verdict_is_not_resumed_from_a_history_it_may_void() {
    let redis = common::redis::Redis::start();
    let flags = ["--recovery-handoff", "true"];
    let mut a = instance_with(&redis, "a", &flags);
    let dflags = ["--recovery-handoff", "true", "--log-level", "debug"];
    let (b, c) = (instance_with(&redis, "b", &dflags), instance_with(&redis, "c", &dflags));
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(3.0));
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let mut ws = plain_at(&cutter, &session, None);
    a.ingest(message("dev-1", 1000));
    let (_, _, offset) = next(&mut ws);
    cut_plain(&cutter, &a);
    let (adopter, adopter_id, other, _) = fill_a_from_the_other(&a, b, c, &session);
    adopter.signal(libc::SIGSTOP);
    sigterm(&mut a);
    assert!(a.wait_for_stderr(WAIT, |l| l.contains("handed over without a verdict in time")).is_some());
    adopter.signal(libc::SIGCONT);
    let adoptions = |outcome: &str| format!("hubcast_redis_adoptions_total{{instance=\"{adopter_id}\",outcome=\"{outcome}\"}}");
    adopter.wait_for_metric(&adoptions("received"), WAIT, Want::Eq(1.0));
    // Installed on the session's core (the socket then finds it adopting, not absent).
    adopter.wait_for_stderr(WAIT, |l| l.contains("recovery history adopted; waiting for the verdict")).expect("adopted");
    let mut ws = back_at(&cutter, adopter.port, &session, &offset);
    assert_eq!(frame(&mut ws), json!({"recovered": false, "reason": "history_lost"}));
    assert_eq!(adopter.metric("hubcast_recovery_replayed_frames_total"), Some(0.0));
    adopter.wait_for_metric(&adoptions("lost"), WAIT, Want::Eq(1.0));
    other.ingest(message("dev-1", 1002));
    let (_, n, live) = next(&mut ws);
    assert_eq!(n, 1002, "live data, nothing of the past");
    let epoch = |o: &str| o.split('.').nth(1).map(str::to_string);
    assert_ne!(epoch(&live), epoch(&offset), "the void gave the history a new epoch: {live} after {offset}");
}

/// Whether B's watch set in Redis names `device` (`SISMEMBER t:watching:b`).
fn b_watches(redis: &common::redis::Redis, device: &str) -> bool {
    redis.command(&format!("SISMEMBER t:watching:b {device}")).is_some_and(|r| r.starts_with(":1"))
}

/// A client that gives up while B seeks its history lets go of what the wait made for it: B
/// watched dev-1 for the rebuild's asks (another instance, A's presence renewed here as in
/// the deadline test, was seen alive), the client leaves during the 2 s wait for A's answer
/// and B closes the socket meanwhile (its pings, every 200 ms there, go unanswered), and once
/// the rebuild is refused the socket is still attached and detached, so its session's
/// history (`--recovery-window 2` on B) goes a window later and with it B's watch of dev-1
/// (before, a socket closed during the wait was never attached: the session kept the watch
/// with no socket and no history).
#[test]
fn a_plain_client_that_leaves_while_its_history_is_sought_leaves_nothing_watched() {
    let redis = common::redis::Redis::start();
    let mut a = instance_with(&redis, "a", &FAST_LEASE);
    let b = instance_with(&redis, "b", &[FAST_LEASE[0], FAST_LEASE[1], "--log-level", "debug", "--recovery-window", "2", "--ping-interval", "200", "--ping-timeout", "200"]);
    let session = d2c_session(&a, "dev-1");
    let cutter = Cutter::start(a.port);
    let mut ws = plain_at(&cutter, &session, None);
    b.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"b\"}", WAIT, Want::Eq(1.0));
    b.ingest(message("dev-1", 0));
    let (_, _, offset) = next(&mut ws);
    cut_plain(&cutter, &a);
    kill(&mut a);
    assert!(!b_watches(&redis, "dev-1"), "nobody on B watches dev-1 yet");
    let renewing = Renewing::start(&redis, "a");
    let ws = back_at(&cutter, b.port, &session, &offset);
    let deadline = std::time::Instant::now() + WAIT;
    while !b_watches(&redis, "dev-1") {
        assert!(std::time::Instant::now() < deadline, "B watches dev-1 for the rebuild's asks");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(ws);
    b.wait_for_stderr(WAIT, |l| l.contains("history not rebuilt") && l.contains("no answer in time")).expect("refused at the deadline");
    drop(renewing);
    let deadline = std::time::Instant::now() + WAIT;
    while b_watches(&redis, "dev-1") {
        assert!(std::time::Instant::now() < deadline, "B still watches dev-1 for a client long gone:\n{}", b.stderr_lines().join("\n"));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(b.metric(PLAIN_GAUGE), Some(0.0));
}
