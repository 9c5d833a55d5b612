//! What the connection state recovery tests share (issue 24, docs/design/recovery.md):
//! sessions reading one device's d2c messages, the real `socket.io-client` behind a
//! [`Cutter`] that cuts it off the network and lets it back, and instances on one Redis.
//! Every wait is on an event: a client event, a metric, the proxy's counters.

use std::io::Write;
use std::time::Duration;

use serde_json::{json, Value};

use super::lb::Cutter;
use super::sio::{socketio_at, SioClient};
use super::{kind, Server, Want};

pub const WAIT: Duration = Duration::from_secs(10);
/// What the client prints: `recovered`, pid presence, each event's offset.
pub const PRINT: (&str, &str) = ("SIO_PRINT_OFFSETS", "1");
/// Reconnect attempts 100 ms apart (the default backs off to 5 s).
pub const FAST: (&str, &str) = ("SIO_RECONNECT_DELAY", "100");

pub const WS_GAUGE: &str = "hubcast_sockets{transport=\"socketio_websocket\"}";

/// A session granted and subscribed to `device`'s d2c messages.
pub fn d2c_session(server: &Server, device: &str) -> String {
    let session = server.new_session();
    server.grant(&session, kind("d2cMessages", device));
    let (status, body) = server.subscribe(&session, kind("d2cMessages", device));
    assert_eq!(status, 204, "{body}");
    session
}

pub fn message(device: &str, n: u64) -> Value {
    json!({"deviceId": device, "body": {"n": n}})
}

/// `seq` of an offset `h1.<epoch>.<seq>` (base 36), and its epoch text.
pub fn seq_of(offset: &str) -> (String, u64) {
    let parts: Vec<&str> = offset.split('.').collect();
    assert_eq!(parts.len(), 3, "{offset}");
    assert_eq!(parts[0], "h1", "{offset}");
    (
        parts[1].to_string(),
        u64::from_str_radix(parts[2], 36).unwrap_or_else(|_| panic!("{offset}")),
    )
}

/// The next `data` event's message `n` (skipping other events but a disconnect).
pub fn next_n(client: &SioClient) -> (u64, Value) {
    let e = client.wait_for("data", WAIT).expect("a data event");
    (
        e["data"]["message"]["n"]
            .as_u64()
            .unwrap_or_else(|| panic!("a d2c message: {e}")),
        e,
    )
}

/// A client behind a [`Cutter`] with fast reconnects, connected and past one message (so it
/// holds an offset); returns the client.
pub fn connected_behind(
    cutter: &Cutter,
    server: &Server,
    session: &str,
    transports: &str,
    first: u64,
) -> SioClient {
    let client = socketio_at(&cutter.base(), &[session], transports, true, &[PRINT, FAST]);
    let connected = client.wait_for("connect", WAIT).expect("connect");
    assert_eq!(connected["pid"], true, "{connected}");
    server.ingest(message("dev-1", first));
    assert_eq!(next_n(&client).0, first, "a first message before the cut");
    client
}

/// Cuts the client off and waits until it knows and the server has let the socket go.
pub fn cut(cutter: &Cutter, server: &Server, client: &SioClient, gauge: &str) {
    cutter.cut();
    let gone = client
        .wait_for("disconnect", WAIT)
        .expect("the client sees the cut");
    assert_eq!(gone["reason"], "transport close", "{gone}");
    server.wait_for_metric(gauge, WAIT, Want::Eq(0.0));
}

/// Lets the client back in once it has been refused at least once (a real outage), and
/// returns its `connect` event.
pub fn come_back(cutter: &Cutter, client: &SioClient) -> Value {
    assert!(
        cutter.wait(WAIT, |c| c.refused() >= 1),
        "the client tried to reconnect while cut off"
    );
    cutter.release();
    client.wait_for("connect", WAIT).expect("reconnected")
}

pub fn instance(redis: &super::redis::Redis, id: &str) -> Server {
    instance_with(redis, id, &[])
}

/// An instance `id` on `redis` (prefix `t`), once its link is up.
pub fn instance_with(redis: &super::redis::Redis, id: &str, extra: &[&str]) -> Server {
    let url = redis.url();
    let mut args = vec!["--redis-url", &url, "--instance-id", id, "--redis-prefix", "t"];
    args.extend_from_slice(extra);
    let server = Server::start(&args);
    server.wait_for_metric(&format!("hubcast_redis_connected{{instance=\"{id}\"}}"), WAIT, Want::Eq(1.0));
    server
}

/// How long a stop is waited for: past `--shutdown-timeout`'s default 10 s, the most a stop
/// may take by its own deadline (a hand-over's verdict wait and the leases' hand-over within
/// it), so a loaded machine's slow stop is not taken for a hung one.
pub const STOP_WAIT: Duration = Duration::from_secs(30);

/// A graceful stop: SIGTERM, and a clean exit.
pub fn sigterm(server: &mut Server) {
    server.signal(libc::SIGTERM);
    let exit = server.wait_exit(STOP_WAIT).expect("exits after SIGTERM");
    assert!(
        exit.success(),
        "{exit:?}\n{}",
        server.stderr_lines().join("\n")
    );
}

/// Every command Redis runs from its start on, as `MONITOR` prints them (a thread reads).
pub struct Monitor {
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Monitor {
    /// Returns once Redis has answered `+OK`: every command it runs from then on is seen
    /// (before, a command run between the `MONITOR` written and Redis reading it, e.g. a
    /// stopping instance's hand-over on a loaded machine, was never seen).
    pub fn start(port: u16) -> Monitor {
        use std::io::BufRead;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("redis");
        stream.write_all(b"MONITOR\r\n").unwrap();
        let mut reader = std::io::BufReader::new(stream);
        let mut ok = String::new();
        reader.read_line(&mut ok).expect("MONITOR's answer");
        assert_eq!(ok.trim_end(), "+OK", "MONITOR");
        let lines: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
        let into = lines.clone();
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { break };
                into.lock().unwrap().push(line);
            }
        });
        Monitor { lines }
    }

    /// The commands naming `needle`, as printed.
    pub fn lines(&self, needle: &str) -> Vec<String> {
        self.lines.lock().unwrap().iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    pub fn count(&self, needle: &str) -> usize {
        self.lines.lock().unwrap().iter().filter(|l| l.contains(needle)).count()
    }

    /// Waits until more than `n` commands name `needle`.
    pub fn wait_past(&self, needle: &str, n: usize) {
        let deadline = std::time::Instant::now() + WAIT;
        while self.count(needle) <= n {
            assert!(std::time::Instant::now() < deadline, "no command naming {needle} within {WAIT:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Hand-over flags for the tests that keep the adopter stopped while A waits for its verdict
/// (tests/recovery_adopt.rs, tests/recovery_cluster.rs): the wait (`--recovery-handoff-wait`,
/// 4 s by default) and the stop's deadline long enough that the steps in between (a `MONITOR`
/// line, a POST) fit on a loaded machine (a CI run under load passed A's 4 s, and the other
/// instance, with no watcher left, published nothing).
pub const HANDOFF_PAUSED: [&str; 6] = ["--recovery-handoff", "true", "--recovery-handoff-wait", "30", "--shutdown-timeout", "60"];

/// A's SIGTERM with the adopter stopped (SIGSTOP) first: returns once A has logged the
/// hand-over and `control` (a [`Monitor`] of the one Redis, or of the cluster's master of the
/// control channels, started before) has seen it published on the adopter's `adopt` channel
/// (`channel`): the adopter, stopped, cannot have answered it.
pub fn handed_to_a_stopped_adopter(a: &Server, adopter: &Server, control: &Monitor, channel: &str) {
    adopter.signal(libc::SIGSTOP);
    a.signal(libc::SIGTERM);
    a.wait_for_stderr(WAIT, |l| l.contains("recovery histories handed to other instances")).expect("A hands the history over");
    control.wait_past(&format!("\"PUBLISH\" \"{channel}\""), 0);
}

// ---- design step 11, shared by tests/recovery_cross.rs (one Redis) and
// tests/recovery_cluster.rs (a Redis Cluster): the same scenarios on either engine ----------

/// The next `data` event: its message's device, `n` and offset.
pub fn next_of(client: &SioClient) -> (String, u64, String) {
    let (n, e) = next_n(client);
    let device = e["data"]["deviceId"].as_str().unwrap_or_else(|| panic!("{e}")).to_string();
    let offset = e["offset"].as_str().unwrap_or_else(|| panic!("a string offset: {e}")).to_string();
    (device, n, offset)
}

/// How many devices an offset's device part names (`h1.<epoch>.<seq>.<device>-<key>…`).
pub fn devices_named(offset: &str) -> usize {
    offset.split('.').skip(3).filter(|i| i.contains('-')).count()
}

/// A session on `server` reading every one of `devices`' d2c messages.
pub fn d2c_session_of(server: &Server, devices: &[&str]) -> String {
    let session = d2c_session(server, devices[0]);
    for device in &devices[1..] {
        server.grant(&session, kind("d2cMessages", device));
        let (status, body) = server.subscribe(&session, kind("d2cMessages", device));
        assert_eq!(status, 204, "{body}");
    }
    session
}

/// Three instances: the client (reconnecting fast) behind a cutter to `a`, reading dev-1
/// (taken in on `c`) and dev-2 (taken in on `b`); a first message of each received.
pub fn client_on_a_of_three(a: &Server, b: &Server, c: &Server) -> (Cutter, SioClient) {
    let session = d2c_session_of(a, &["dev-1", "dev-2"]);
    let cutter = Cutter::start(a.port);
    let client = socketio_at(&cutter.base(), &[&session], "websocket", true, &[PRINT, FAST]);
    assert_eq!(client.wait_for("connect", WAIT).expect("connect")["pid"], true);
    for (id, server) in [("b", b), ("c", c)] {
        server.wait_for_metric(&format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{id}\"}}"), WAIT, Want::Eq(2.0));
        server.wait_for_metric(&format!("hubcast_redis_instances{{instance=\"{id}\"}}"), WAIT, Want::Eq(3.0));
    }
    c.ingest(message("dev-1", 0));
    assert_eq!(next_of(&client).1, 0);
    b.ingest(message("dev-2", 0));
    let (_, n, offset) = next_of(&client);
    assert_eq!(n, 0);
    assert_eq!(devices_named(&offset), 2, "the offset names both devices: {offset}");
    (cutter, client)
}

/// Kills `server` (SIGKILL).
pub fn kill(server: &mut Server) {
    server.signal(libc::SIGKILL);
    server.wait_exit(WAIT).expect("killed");
}

/// Design step 11 g with a third live instance (`b` at `--log-level debug`): the client is
/// cut off `a` while C takes in dev-1 and B dev-2, A is killed, both take in more; the
/// client lands on B, which asks C for what its ring of dev-1 holds after the client's cut
/// and rebuilds from C's answer and its own ring: `recovered` true, every missed message
/// once, each device's in order, then live data from C.
pub fn a_third_live_instance_answers_and_the_client_recovers(a: &mut Server, b: &Server, c: &Server, cutter: &Cutter, client: &SioClient) {
    cut(cutter, a, client, WS_GAUGE);
    c.ingest(json!((1..=10).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    b.ingest(json!((11..=20).map(|n| message("dev-2", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(22.0));
    kill(a);
    c.ingest(json!((21..=25).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    b.ingest(json!((26..=30).map(|n| message("dev-2", n)).collect::<Vec<_>>()));
    c.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(16.0));
    b.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(16.0));
    cutter.retarget(b.port);
    let back = come_back(cutter, client);
    assert_eq!(back["recovered"], true, "{back}\n{}", b.stderr_lines().join("\n"));
    c.ingest(message("dev-1", 999));
    let got: Vec<(String, u64)> = (0..31).map(|_| next_of(client)).map(|(d, n, _)| (d, n)).collect();
    let of = |device: &str| got.iter().filter(|(d, _)| d == device).map(|(_, n)| *n).collect::<Vec<_>>();
    let mut want_1: Vec<u64> = (1..=10).chain(21..=25).collect();
    want_1.push(999);
    assert_eq!(of("dev-1"), want_1, "C's, once, in order, then live: {got:?}");
    assert_eq!(of("dev-2"), (11..=20).chain(26..=30).collect::<Vec<_>>(), "B's, once, in order: {got:?}");
    assert_eq!(got.last(), Some(&("dev-1".to_string(), 999)), "live after every replayed one");
    assert_eq!(b.metric("hubcast_recovery_replayed_frames_total"), Some(30.0), "all 30 rebuilt on B");
    assert!(b.stderr_lines().iter().any(|l| l.contains("another instance is alive") && l.contains("instance=c")), "C was asked");
    // C counts its answer, on one Redis and on a cluster alike.
    assert!(c.metric("hubcast_recovery_ring_answers_total{outcome=\"sent\"}").unwrap_or(0.0) >= 1.0, "C's answer counted");
    // The rebuilt stream goes on: the next offset names both devices again.
    b.ingest(message("dev-2", 1000));
    let (_, n, offset) = next_of(client);
    assert_eq!(n, 1000, "nothing twice");
    assert_eq!(devices_named(&offset), 2, "{offset}");
}

/// C keeps taking dev-1 in while the client lands on B (a thread posting batches of 20 to C,
/// paced): what C applied before it read its ring is in its answer, what came after reaches
/// B behind the answer and was held (or is live) and follows. Every acknowledged message
/// once, in order, no hole: exactly once across instances.
pub fn a_third_instance_ingesting_through_the_rebuild_gives_every_message_once(a: &mut Server, b: &Server, c: &Server, cutter: &Cutter, client: &SioClient) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    cut(cutter, a, client, WS_GAUGE);
    kill(a);
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let firehose = {
        let (acked, stop, url) = (acked.clone(), stop.clone(), c.url("/ingest"));
        std::thread::spawn(move || {
            let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(2)).build();
            let mut n = 1;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<Value> = (n..n + 20).map(|i| message("dev-1", i)).collect();
                let r = agent.post(&url).set(super::ADMIN.0, super::ADMIN.1).send_json(json!(batch)).expect("ingested");
                assert_eq!(r.status(), 200);
                acked.store(n + 19, Ordering::SeqCst);
                n += 20;
                // Paced (not a wait): about 1,000 messages a second, so the seconds the
                // rebuild waits for A to show dead stay within the session bound.
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    c.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(100.0));
    cutter.retarget(b.port);
    let back = come_back(cutter, client);
    let given_up = c.metric("hubcast_redis_republish_given_up_total{instance=\"c\"}");
    assert_eq!(back["recovered"], true, "{back}\nC's retries given up: {given_up:?}\n{}", b.stderr_lines().join("\n"));
    let first_live = acked.load(Ordering::SeqCst) + 100;
    let mut got = Vec::new();
    while got.iter().filter(|n| **n >= first_live).count() < 2 {
        let (device, n, _) = next_of(client);
        assert_eq!(device, "dev-1");
        got.push(n);
    }
    stop.store(true, Ordering::Relaxed);
    firehose.join().unwrap();
    let last = acked.load(Ordering::SeqCst);
    while got.len() < last as usize {
        got.push(next_of(client).1);
    }
    assert_eq!(got, (1..=last).collect::<Vec<_>>(), "every message once, in order, no hole");
    let answered = b.stderr_lines().into_iter().filter(|l| l.contains("device rings answered")).collect::<Vec<_>>();
    eprintln!("{}", answered.join("\n"));
}

/// Design step 6's start, on either engine: three instances (`a` to stop), the client on A
/// behind a cutter, cut off; C takes in 20 messages (0..20) that reach A's history.
pub fn cut_off_a_with_a_history_from_c(a: &Server, c: &Server) -> (Cutter, SioClient) {
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(3.0));
    let session = d2c_session(a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, a, &session, "websocket", 1000);
    cut(&cutter, a, &client, WS_GAUGE);
    c.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"c\"}", WAIT, Want::Eq(1.0));
    c.ingest(json!((0..20).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(21.0));
    (cutter, client)
}

/// The instance the stopping one picks for `session` among `live` (sorted ids): the session
/// id modulo their number, as `cluster::adopt::adopter` does.
pub fn adopter_of(session: &str, live: &[&'static str]) -> usize {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(session).expect("a session id");
    let id = u128::from_le_bytes(bytes.try_into().expect("16 bytes"));
    (id % live.len() as u128) as usize
}

/// What [`away_from_a`] leaves: the adopter A will pick and the other instance (with their
/// ids), the proxy (aimed at A) and the client, cut off.
pub struct AwayFromA {
    pub adopter: Server,
    pub adopter_id: &'static str,
    pub other: Server,
    pub other_id: &'static str,
    pub cutter: Cutter,
    pub client: SioClient,
}

/// Design step 6's failure paths' start, on either engine: three instances (`a` to stop),
/// the client on A behind the cutter over `transports`, past one message and cut off; the
/// instance that is not the adopter ingests 0..10, which reach A's history (its session
/// still watches the device).
pub fn away_from_a(a: &Server, b: Server, c: Server, transports: &str) -> AwayFromA {
    a.wait_for_metric("hubcast_redis_instances{instance=\"a\"}", WAIT, Want::Eq(3.0));
    let session = d2c_session(a, "dev-1");
    let cutter = Cutter::start(a.port);
    let client = connected_behind(&cutter, a, &session, transports, 1000);
    if transports == "polling" {
        // A long poll cut by the proxy is not a closed socket for the server (no TCP of its
        // own): A lets it go at its SIGTERM's goodbye, before the hand-over.
        cutter.cut();
        let gone = client.wait_for("disconnect", WAIT).expect("the client sees the cut");
        assert!(gone["reason"].as_str().unwrap().starts_with("transport "), "{gone}");
    } else {
        cut(&cutter, a, &client, WS_GAUGE);
    }
    let (adopter, adopter_id, other, other_id) = fill_a_from_the_other(a, b, c, &session);
    AwayFromA { adopter, adopter_id, other, other_id, cutter, client }
}

/// B and C as (adopter of `session`, its id, the other, its id); the other ingests 0..10 of
/// dev-1, which reach A's history (A had 1 message before: 11 in all).
pub fn fill_a_from_the_other(a: &Server, b: Server, c: Server, session: &str) -> (Server, &'static str, Server, &'static str) {
    let (adopter, adopter_id, other, other_id) = match adopter_of(session, &["b", "c"]) {
        0 => (b, "b", c, "c"),
        _ => (c, "c", b, "b"),
    };
    other.wait_for_metric(&format!("hubcast_redis_watched_elsewhere_devices{{instance=\"{other_id}\"}}"), WAIT, Want::Eq(1.0));
    other.ingest(json!((0..10).map(|n| message("dev-1", n)).collect::<Vec<_>>()));
    a.wait_for_metric("hubcast_messages_in_total{source=\"Telemetry\"}", WAIT, Want::AtLeast(11.0));
    (adopter, adopter_id, other, other_id)
}

/// `from` ingests `batch` (`n` telemetry messages) and `to` (another instance watching the
/// device) has counted them all in: its counter is read before, so what it counted already
/// (its own earlier ingest) does not satisfy the wait.
pub fn ingest_seen_by(from: &Server, to: &Server, batch: Value, n: f64) {
    let series = "hubcast_messages_in_total{source=\"Telemetry\"}";
    let before = to.metric(series).unwrap_or(0.0);
    from.ingest(batch);
    to.wait_for_metric(series, WAIT, Want::AtLeast(before + n));
}
