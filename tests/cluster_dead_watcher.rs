//! A watcher killed (`kill -9`) holds up nobody (docs/design/redis-cluster.md, step 7's
//! "A watcher that died"): three instances, A takes a device in, B and C watch it; C is
//! killed. Its presence in Redis stands until `--lease-ttl` has passed (10 s here), and on a
//! Redis Cluster, where A counts each `SPUBLISH` against the device's watchers
//! (cluster/resend.rs), every message of the device fell short of C. Before: each was then
//! held back until A's next retry (up to 50 ms, a message every tick; republished every 50
//! ms for up to 2 s, about 36 copies each to B), for the whole TTL (11 s measured). Now the
//! message goes at once behind its device's waiting copies, and A stops counting C within a
//! heartbeat and a second of C's last renewal (`hubcast_redis_dead_watchers`). On one Redis
//! nothing is counted and nothing waits: the same test holds there too.

mod common;

use std::time::{Duration, Instant};

use common::redis::Engine;
use common::{Server, Want};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

both_engines!(a_killed_watcher_holds_up_no_other_watchers_messages);

#[test]
fn cluster_a_paused_instances_master_holds_no_publication() {
    a_paused_instances_master_holds_no_publication(Engine::cluster());
}

#[test]
fn cluster_a_watcher_known_dead_counts_again_once_it_renews() {
    a_watcher_known_dead_counts_again_once_it_renews(Engine::cluster());
}

fn metric(server: &Server, name: &str, id: &str) -> f64 {
    server.metric(&format!("{name}{{instance=\"{id}\"}}")).unwrap_or(0.0)
}

/// A device other than `pump` whose channel is on the same master as pump's (one Redis:
/// any): B's one shard subscriber of that master gets both devices' messages in the order
/// A published them.
fn beside_pump(engine: &Engine) -> String {
    let Engine::Cluster(nodes) = engine else { return "valve".into() };
    let master = nodes.owner_of(nodes.slot_of("t:device:pump"));
    (0..1000).map(|i| format!("valve-{i}")).find(|d| nodes.owner_of(nodes.slot_of(&format!("t:device:{d}"))) == master).expect("a device on pump's master")
}

/// Whether `id`'s presence still stands on the cluster: its member of the instances sorted
/// set is scored with when it expires, compared with the clock of the master holding it.
/// Only a cluster keeps presence that way: on one Redis there is nothing to read here.
fn presence_stands(engine: &Engine, id: &str) -> bool {
    let Engine::Cluster(nodes) = engine else { unreachable!("presence_stands reads a cluster's sorted set") };
    let expires = nodes.command(&format!("ZSCORE {{t}}:instances {id}")).unwrap_or_default();
    let Some(expires) = expires.lines().nth(1).and_then(|s| s.trim().parse::<f64>().ok()) else { return false };
    let time = nodes.command_on(nodes.owner_of(nodes.slot_of("{t}:instances")), "TIME").unwrap_or_default();
    let parts: Vec<i64> = time.lines().filter_map(|l| l.trim().parse().ok()).collect();
    let [secs, micros] = parts[..] else { panic!("TIME: {time:?}") };
    expires as i64 > secs * 1000 + micros / 1000
}

/// The next telemetry frame on `ws`: its device and `n`.
fn next(ws: &mut common::ws::Live, what: &str) -> (String, i64) {
    let frame: Value = ws.next_json(WAIT).unwrap_or_else(|| panic!("{what} reaches B"));
    (frame["deviceId"].as_str().unwrap_or_default().to_string(), frame["telemetry"]["n"].as_i64().unwrap_or(-1))
}

/// Each round A takes in the pump's message `k`, then (a separate request) the other
/// device's `k`; B (one core: its frames in the order its link received them) must get the
/// pump's first. A pump message held back for A's next retry (the bug) comes after the
/// other device's, which nobody dead watches and so goes at once: an order of arrival, not
/// a time. The rounds are paced at about 5 a second (a device sending as IoT devices do, well
/// within what goes at once: 16 messages waiting a device); A must stop counting C while C's
/// presence still stands in Redis (checked there when the gauge moves, not timed).
fn a_killed_watcher_holds_up_no_other_watchers_messages(engine: Engine) {
    let cluster = engine.is_cluster();
    // One core on A: its publications leave in the order it took the messages in.
    let a = engine.instance("a", &["--cores", "1"]);
    let b = engine.instance("b", &["--cores", "1"]);
    let mut c = engine.instance("c", &[]);
    let other = beside_pump(&engine);
    let on_b = a.telemetry_session(&["pump", other.as_str()]);
    let on_c = a.telemetry_session(&["pump"]);
    let mut wb = b.live(&on_b);
    let mut wc = c.live(&on_c);
    a.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"a\"}", WAIT, Want::Eq(2.0));
    // Both watchers of the pump get its first message (so both announced it well before).
    a.ingest(json!({"deviceId": "pump", "body": {"n": 0}}));
    assert_eq!(next(&mut wb, "the pump's first message"), ("pump".to_string(), 0));
    assert_eq!(wc.next_json(WAIT).expect("and C")["telemetry"]["n"], json!(0));
    let round = |wb: &mut common::ws::Live, k: i64| {
        a.ingest(json!({"deviceId": "pump", "body": {"n": k}}));
        a.ingest(json!({"deviceId": other, "body": {"n": k}}));
        let first = next(wb, "the pump's message");
        let second = next(wb, "the other device's message");
        assert_eq!(
            (first, second),
            (("pump".to_string(), k), (other.clone(), k)),
            "round {k}: the pump's message first, held back by nothing\nA: {:?}",
            a.stderr_lines()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    c.signal(libc::SIGKILL);
    c.wait_exit(WAIT).expect("C killed");
    let killed = Instant::now();
    let mut k = 1;
    let mut dead_after = None;
    while k <= 20 || (cluster && dead_after.is_none()) {
        round(&mut wb, k);
        k += 1;
        if cluster && dead_after.is_none() {
            if metric(&a, "hubcast_redis_dead_watchers", "a") == 1.0 {
                dead_after = Some(killed.elapsed());
                // Counted dead while its presence still stood (an event in Redis, not a time:
                // once it expires A drops C from the instances, and the gauge with it).
                assert!(presence_stands(&engine, "c"), "A counted C dead only once its presence had expired");
            } else {
                // A generous bound for a loaded machine: C's presence has long expired by then,
                // so A never counts it dead (the gauge counts instances still present).
                assert!(killed.elapsed() < Duration::from_secs(30), "A never counted C dead while its presence stood (10 s)");
            }
        }
    }
    if !cluster {
        return;
    }
    // C was counted until then (the pump's messages fell short of it and were published
    // again), and no longer: nothing waits, nothing is published again.
    let republished = metric(&a, "hubcast_redis_republished_total", "a");
    assert!(republished > 0.0, "A counted C as a watcher after the kill");
    for _ in 0..5 {
        round(&mut wb, k);
        k += 1;
    }
    assert_eq!(metric(&a, "hubcast_redis_republished_total", "a"), republished, "nothing published again once C is known dead");
    eprintln!("A counted C dead {dead_after:?} after its kill; {republished} copies published meanwhile");
    let log = a.stderr_lines().join("\n");
    assert!(log.contains("no longer waited for as a watcher"), "{log}");
}

/// The measurement behind docs/benchmarks/2026-11-28-dead-watcher.md (not a check: run by
/// hand, `--ignored`): on a fresh 3-master cluster, A takes in `pump`, B and C watch it, C is
/// killed; for 12 s A takes in one message every `PACES` ms (50 and 200; plus 0-49), each timed from
/// its `POST /ingest` to its frame on B's WebSocket. `HUBCAST_OLD` names a binary of the
/// version before (run through a `sh` wrapper in place of this build's), alternating with
/// this build, `ROUNDS` times.
#[test]
#[ignore]
fn measure_the_delay_a_killed_watcher_costs_another() {
    let old = std::env::var("HUBCAST_OLD").expect("HUBCAST_OLD: the binary before");
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);
    for round in 0..rounds {
        let paces: Vec<u64> = std::env::var("PACES").ok().map_or(vec![50, 200], |p| p.split(',').filter_map(|p| p.parse().ok()).collect());
        for &pace in &paces {
            for variant in ["old", "new"] {
                let engine = Engine::cluster();
                let start = |id: &str| {
                    let mut args: Vec<String> = engine.flags();
                    args.extend(["--instance-id", id, "--redis-prefix", "t"].map(String::from));
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    let server = if variant == "old" {
                        // `sh -c 'shift; exec OLD "$@"' sh BIN args…`: BIN dropped, OLD run.
                        Server::start_wrapped(&["sh", "-c", &format!("shift; exec {old} \"$@\""), "sh"], &args)
                    } else {
                        Server::start(&args)
                    };
                    server.wait_for_metric(&format!("hubcast_redis_connected{{instance=\"{id}\"}}"), WAIT, Want::Eq(1.0));
                    server
                };
                let (a, b, mut c) = (start("a"), start("b"), start("c"));
                let session = a.telemetry_session(&["pump"]);
                let mut wb = b.live(&session);
                let _wc = c.live(&session);
                a.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"a\"}", WAIT, Want::Eq(1.0));
                let mut n = 0;
                let mut timed = |wb: &mut common::ws::Live| {
                    n += 1;
                    let t = Instant::now();
                    a.ingest(json!({"deviceId": "pump", "body": {"n": n}}));
                    assert_eq!(next(wb, "pump").1, n);
                    let ms = t.elapsed().as_secs_f64() * 1000.0;
                    // Paced with a spread of 0-49 ms, so the messages do not lock onto A's
                    // 50 ms retry ticks (at a whole multiple of them every message came at
                    // the same point of a tick).
                    std::thread::sleep(Duration::from_millis(pace + (n as u64 * 37) % 50));
                    ms
                };
                let mut before: Vec<f64> = (0..20).map(|_| timed(&mut wb)).collect();
                c.signal(libc::SIGKILL);
                c.wait_exit(WAIT).expect("C killed");
                let killed = Instant::now();
                let mut after: Vec<(f64, f64)> = Vec::new();
                let mut dead_at = None;
                while killed.elapsed() < Duration::from_secs(12) {
                    let at = killed.elapsed().as_secs_f64();
                    after.push((at, timed(&mut wb)));
                    if dead_at.is_none() && metric(&a, "hubcast_redis_dead_watchers", "a") == 1.0 {
                        dead_at = Some(killed.elapsed().as_secs_f64());
                    }
                }
                let median = |v: &mut Vec<f64>| {
                    v.sort_by(|x, y| x.total_cmp(y));
                    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
                };
                let window = |from: f64, to: f64| {
                    let mut v: Vec<f64> = after.iter().filter(|(at, _)| *at >= from && *at < to).map(|(_, ms)| *ms).collect();
                    (median(&mut v), v.len())
                };
                let (w0, w1, w2) = (window(0.0, 3.0), window(3.0, 8.0), window(8.0, 12.0));
                println!(
                    "round={round} pace_ms={pace} variant={variant} before_median_ms={:.1} median_ms(n)_0-3s={:.1}({}) 3-8s={:.1}({}) 8-12s={:.1}({}) counted_dead_at_s={} republished={} given_up={}",
                    median(&mut before),
                    w0.0, w0.1, w1.0, w1.1, w2.0, w2.1,
                    dead_at.map_or("-".to_string(), |s| format!("{s:.2}")),
                    metric(&a, "hubcast_redis_republished_total", "a"),
                    metric(&a, "hubcast_redis_republish_given_up_total", "a"),
                );
            }
        }
    }
}

/// A watcher counted dead that comes back counts again, whether messages wait or not
/// (cluster/resend.rs, `Probe`; a cluster only: one Redis counts nothing). C watches the
/// pump, D the valve. C is frozen (SIGSTOP: its connections stay, so the pump's messages
/// still reach it and none waits), then D killed while A takes the valve's messages in:
/// they fall short of D and wait, so A asks who is dead and finds C (frozen first, so stale
/// first), then D. Once D is known dead nothing waits; C resumes and renews its presence.
/// Before, only a probe made while messages waited could see C renewing: C stayed counted
/// out (`hubcast_redis_dead_watchers` stuck at 1 after D's presence expired), so a pump
/// message that missed C later (a slot move) would have looked delivered. Now A asks every
/// second while any is known dead: the gauge reaches 0 (D gone with its presence, 10 s),
/// and C gets the pump's later messages.
fn a_watcher_known_dead_counts_again_once_it_renews(engine: Engine) {
    let a = engine.instance("a", &["--cores", "1"]);
    let c = engine.instance("c", &[]);
    let mut d = engine.instance("d", &[]);
    let on_c = a.telemetry_session(&["pump"]);
    let on_d = a.telemetry_session(&["valve"]);
    let mut wc = c.live(&on_c);
    let _wd = d.live(&on_d);
    a.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"a\"}", WAIT, Want::Eq(2.0));
    a.ingest(json!({"deviceId": "pump", "body": {"n": 0}}));
    assert_eq!(wc.next_json(WAIT).expect("C gets the pump's first message")["telemetry"]["n"], json!(0));
    c.signal(libc::SIGSTOP);
    // D's last renewal comes after C's, so C is stale first: D's presence (scored with when it
    // expires) renewed after C froze, past C's (an event in Redis, within a heartbeat).
    let Engine::Cluster(nodes) = &engine else { unreachable!("a cluster") };
    let expires = |id: &str| -> i64 {
        let reply = nodes.command(&format!("ZSCORE {{t}}:instances {id}")).unwrap_or_default();
        reply.lines().nth(1).and_then(|s| s.trim().parse::<f64>().ok()).map_or(0, |s| s as i64)
    };
    let d_frozen_at = expires("d");
    let deadline = Instant::now() + WAIT;
    while !(expires("d") > d_frozen_at && expires("d") > expires("c")) {
        assert!(Instant::now() < deadline, "D renews its presence after C froze");
        std::thread::sleep(Duration::from_millis(50));
    }
    d.signal(libc::SIGKILL);
    d.wait_exit(WAIT).expect("D killed");
    let mut n = 0;
    let mut c_dead = false;
    loop {
        n += 1;
        a.ingest(json!({"deviceId": "valve", "body": {"n": n}}));
        // D's presence is read before the gauge: A must count D dead while it still stands
        // (within a heartbeat and a second of D's last renewal, against the 10 s it stands).
        // An event in Redis, not a time: once it has expired A drops D from the instances and
        // can no longer count it, and a killed D never renews, so the loop always ends.
        let d_stands = presence_stands(&engine, "d");
        let dead = metric(&a, "hubcast_redis_dead_watchers", "a");
        c_dead |= dead >= 1.0;
        if dead == 2.0 {
            break;
        }
        assert!(d_stands, "A did not count C and D dead while D's presence stood (it counts {dead})");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(c_dead, "C was known dead first");
    c.signal(libc::SIGCONT);
    // D's presence goes 10 s after its last renewal (an event in Redis: its member expired);
    // from then on A counts only C, until it sees C renewing (A asks every second while one
    // is known dead) and counts 0. The loop's bound, long past D's 10 s, is only so a broken
    // helper fails rather than hangs.
    let deadline = Instant::now() + Duration::from_secs(60);
    while presence_stands(&engine, "d") {
        assert!(Instant::now() < deadline, "D's presence never expired in Redis");
        std::thread::sleep(Duration::from_millis(100));
    }
    a.wait_for_metric("hubcast_redis_dead_watchers{instance=\"a\"}", WAIT, Want::Eq(0.0));
    let log = a.stderr_lines().join("\n");
    assert!(log.contains("renews its presence again"), "{log}");
    for k in 1..=5 {
        a.ingest(json!({"deviceId": "pump", "body": {"n": k}}));
        assert_eq!(wc.next_json(WAIT).unwrap_or_else(|| panic!("C gets the pump's message {k}"))["telemetry"]["n"], json!(k));
    }
}

/// Who is dead is asked by a task of its own (cluster/resend.rs, `Probe`): a slow master
/// holding the instances key holds no publication. D watches the pump, B the valve, both
/// on masters other than the instances key's; D is killed, so the pump's messages fall short
/// of it and wait, and A keeps asking who is dead; the instances key's master is paused
/// (`CLIENT PAUSE`, 2.5 s), so a query gets no answer while it lasts. Asserted by events, not
/// times: A's `hubcast_redis_dead_probe_pending` is 1 and `hubcast_redis_dead_probes_total`
/// reads N before the valve's message is taken in, and both read the same once B has the
/// message: it was published while that one query waited for its answer. Before (the query
/// awaited by the command task, up to 200 ms of every 250 ms, every publication behind it)
/// that cannot happen: the message left only after the query ended (then 7 of 15 took
/// 152-198 ms). A query ends within 1 s (its deadline) and the pause after 2.5 s, so a round
/// can straddle one's end; rounds go on until one shows it, over up to 4 pauses.
fn a_paused_instances_master_holds_no_publication(engine: Engine) {
    let Engine::Cluster(nodes) = &engine else { unreachable!("a cluster") };
    let control = nodes.owner_of(nodes.slot_of("{t}:instances"));
    let elsewhere = |name: &str| {
        (0..1000).map(|i| format!("{name}-{i}")).find(|d| nodes.owner_of(nodes.slot_of(&format!("t:device:{d}"))) != control).expect("a device off the control master")
    };
    let (pump, valve) = (elsewhere("pump"), elsewhere("valve"));
    let a = engine.instance("a", &["--cores", "1"]);
    let b = engine.instance("b", &["--cores", "1"]);
    let mut d = engine.instance("d", &[]);
    let on_b = a.telemetry_session(&[valve.as_str()]);
    let on_d = a.telemetry_session(&[pump.as_str()]);
    let mut wb = b.live(&on_b);
    let _wd = d.live(&on_d);
    a.wait_for_metric("hubcast_redis_watched_elsewhere_devices{instance=\"a\"}", WAIT, Want::Eq(2.0));
    let pending = "hubcast_redis_dead_probe_pending{instance=\"a\"}";
    let asked = "hubcast_redis_dead_probes_total{instance=\"a\"}";
    let mut n = 0;
    // One round: the pump's message (it waits for D: A keeps asking who is dead); then, if a
    // query is pending, the valve's, which B must get: `Some(true)` if that one query was
    // still pending once B had it, `None` if none was pending (nothing else sent).
    let mut round = |wb: &mut common::ws::Live| {
        n += 1;
        a.ingest(json!({"deviceId": pump, "body": {"n": n}}));
        // Both series from one scrape: read apart, a query ending and the next starting in
        // between would pass for the same one still pending.
        let probes = || a.metrics(&[asked, pending]);
        let before = probes();
        if before[1] != Some(1.0) {
            return None;
        }
        a.ingest(json!({"deviceId": valve, "body": {"n": n}}));
        assert_eq!(next(wb, "the valve's message"), (valve.clone(), n));
        Some(probes() == before)
    };
    d.signal(libc::SIGKILL);
    d.wait_exit(WAIT).expect("D killed");
    // The pump's messages wait for D from here on (A asks who is dead).
    let _ = round(&mut wb);
    const PAUSE: Duration = Duration::from_millis(2500);
    let (mut rounds, mut shown) = (0, 0);
    for _ in 0..4 {
        let paused = Instant::now();
        assert_eq!(nodes.command_on(control, &format!("CLIENT PAUSE {} ALL", PAUSE.as_millis())).as_deref().map(str::trim), Some("+OK"));
        // A's next query (at most 250 ms on while the pump's messages wait, a second once D is
        // known dead) gets no answer while the pause lasts.
        while paused.elapsed() < PAUSE && shown == 0 {
            match round(&mut wb) {
                Some(at_once) => {
                    rounds += 1;
                    shown += usize::from(at_once);
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        // The pause's end, an event: the paused master answers again.
        let deadline = Instant::now() + WAIT;
        while nodes.command_on(control, "PING").as_deref().map(str::trim) != Some("+PONG") {
            assert!(Instant::now() < deadline, "the instances key's master answers again after its pause");
        }
        if shown > 0 {
            break;
        }
    }
    eprintln!("rounds with a query of who is dead pending: {rounds}, the valve's message at B while it still was: {shown}");
    assert!(rounds > 0, "A asked who is dead while the instances key's master was paused");
    assert!(shown > 0, "none of {rounds} valve messages taken in while a query of who is dead was pending reached B before the query ended: the publications waited for its answer");
}
