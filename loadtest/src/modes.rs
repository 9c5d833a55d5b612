//! The modes: `ingest`, `fanout`, `idle`, `rest`, and `all` (the suite behind
//! docs/BENCHMARKS.md). Each one opens its hubcast (spawned or given), sets up, loads it for
//! `warmup + duration`, measures over the `duration` window only, and returns [`Results`].
//!
//! Rates are measured on both sides: the server's own counters (`GET /metrics` deltas of
//! `hubcast_messages_in_total` / `hubcast_messages_out_total`) and the harness's counts. CPU
//! is reported in cores (1.0 = one core busy) for hubcast and for the harness itself, since
//! both share this machine's cores.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::{sleep, Instant};

use crate::cli::{AllArgs, FanoutArgs, FleetArgs, Global, IdleArgs, RestArgs};
use crate::clients::{connect_sockets, devices_of, grant_and_subscribe, open_sessions, LiveStats, SocketPlan};
use crate::fleet::{self, amqp, device_id, FleetPlan, FleetStats, Via};
use crate::hist::Histogram;
use crate::http::{request_bytes, HttpConn};
use crate::report::{Results, Row};
use crate::target::{Metrics, ProcSample, Target};
use crate::ws::Transport;

/// A hubcast and, for the AMQP fleet, the endpoint it consumes.
pub struct Setup {
    pub target: Target,
    pub endpoint: Option<amqp::Endpoint>,
    /// `--fleet-target`: where the HTTP fleet posts (default: the target).
    pub fleet_addr: Option<std::net::SocketAddr>,
}

/// Opens the hubcast of `global` (spawning it if asked); with an AMQP fleet, starts the
/// endpoint first and points hubcast at it.
pub async fn open(global: &Global, fleet: Option<&FleetArgs>) -> io::Result<Setup> {
    let mut more = Vec::new();
    let mut endpoint = None;
    if let Some(f) = fleet.filter(|f| f.via == Via::Amqp) {
        let e = amqp::start(f.amqp_port, &f.plan(0.0)).await?;
        if global.spawn.is_some() {
            more.extend([
                "--iot-hub-event-hub-connection-string".to_string(),
                e.connection_string(),
                "--event-hub-prefetch".to_string(),
                f.prefetch.to_string(),
            ]);
        } else {
            eprintln!("hubcast-load: the AMQP fleet is served at: --iot-hub-event-hub-connection-string '{}'", e.connection_string());
        }
        endpoint = Some(e);
    }
    let spec = global.target_spec();
    let target = tokio::task::spawn_blocking(move || Target::open(&spec, &more)).await.map_err(io::Error::other)??;
    let within = if endpoint.is_some() { Duration::from_secs(60) } else { Duration::from_secs(20) };
    target.wait_ready(within).await?;
    let fleet_addr = match fleet.and_then(|f| f.fleet_target.as_deref()) {
        Some(url) => Some(crate::target::loopback_addr(url)?),
        None => None,
    };
    Ok(Setup { target, endpoint, fleet_addr })
}

/// Starts the fleet of `plan` (its senders wait for `stats.run()`).
fn start_fleet(setup: &Setup, plan: &FleetPlan, stats: &Arc<FleetStats>, tasks: &mut JoinSet<()>) {
    match &setup.endpoint {
        Some(e) => e.set_run(stats.clone(), plan.rate),
        None => fleet::http::start(setup.fleet_addr.unwrap_or(setup.target.addr), &setup.target.admin_key, plan, stats.clone(), tasks),
    }
}

/// Stops the fleet and waits (briefly) for its senders.
async fn stop_fleet(stats: &FleetStats, tasks: &mut JoinSet<()>) {
    stats.stop();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !tasks.is_empty() {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(_) => {}
            Err(_) => {
                tasks.abort_all();
                break;
            }
        }
    }
}

/// What is read at the edges of a measurement window.
struct Snapshot {
    at: Instant,
    metrics: Metrics,
    hubcast: Option<ProcSample>,
    harness: Option<ProcSample>,
    accepted: u64,
    fleet_errors: u64,
    delivered: u64,
}

async fn snapshot(target: &Target, fleet: Option<&FleetStats>, live: Option<&LiveStats>) -> io::Result<Snapshot> {
    let metrics = target.metrics().await?;
    Ok(Snapshot {
        at: Instant::now(),
        metrics,
        hubcast: target.proc_sample(),
        harness: ProcSample::this_process(),
        accepted: fleet.map_or(0, |f| f.accepted.load(Ordering::Relaxed)),
        fleet_errors: fleet.map_or(0, |f| f.errors.load(Ordering::Relaxed)),
        delivered: live.map_or(0, |l| l.delivered.load(Ordering::Relaxed)),
    })
}

/// Rates and resources between two snapshots, appended to `row`.
fn window(row: &mut Row, a: &Snapshot, b: &Snapshot) -> f64 {
    let secs = b.at.duration_since(a.at).as_secs_f64();
    let rate = |x: f64, y: f64| (y - x) / secs;
    let ingested = rate(a.metrics.sum("hubcast_messages_in_total"), b.metrics.sum("hubcast_messages_in_total"));
    row.put("ingest_msg_s", ingested);
    row.put("sent_msg_s", rate(a.accepted as f64, b.accepted as f64));
    row.put("fleet_errors", b.fleet_errors - a.fleet_errors);
    if let (Some(x), Some(y)) = (&a.hubcast, &b.hubcast) {
        let cores = x.cores_used(&y);
        row.put("hubcast_cpu", cores);
        row.put("hubcast_runq_ms_s", x.run_queue_ms_per_s(&y));
        row.put("hubcast_rss_mb", y.rss_kb as f64 / 1024.0);
        // How often the cores slept and were woken, per message taken in; and how often the
        // AMQP thread was preempted (each hand-off may wake a core).
        let messages = ingested * secs;
        if messages > 0.0 {
            let (core_vcsw, amqp_nvcsw) = x.switches(&y);
            row.put("user_us_per_msg", (y.cpu_secs - y.sys_secs - (x.cpu_secs - x.sys_secs)) * 1e6 / messages);
            row.put("sys_us_per_msg", (y.sys_secs - x.sys_secs) * 1e6 / messages);
            row.put("core_vcsw_per_msg", core_vcsw as f64 / messages);
            row.put("amqp_nvcsw_s", amqp_nvcsw as f64 / secs);
        }
    }
    // AMQP: batches handed from the consumer thread to the cores (hubcast with the counter).
    let handoffs = b.metrics.sum("hubcast_amqp_handoffs_total") - a.metrics.sum("hubcast_amqp_handoffs_total");
    if handoffs > 0.0 {
        let received = b.metrics.sum("hubcast_amqp_messages_received_total") - a.metrics.sum("hubcast_amqp_messages_received_total");
        row.put("amqp_handoffs_s", handoffs / secs);
        row.put("msgs_per_handoff", received / handoffs);
    }
    if let (Some(x), Some(y)) = (&a.harness, &b.harness) {
        row.put("harness_cpu", x.cores_used(&y));
        row.put("harness_runq_ms_s", x.run_queue_ms_per_s(&y));
    }
    secs
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

// ---- ingest ------------------------------------------------------------------------------------

pub async fn ingest(global: &Global, args: &FleetArgs) -> io::Result<Results> {
    let setup = open(global, Some(args)).await?;
    let mut results = Results::new(&format!("ingest ({})", via_name(args.via)));
    results
        .param("fleet", via_name(args.via))
        .param("devices", args.devices)
        .param("cores", setup.target.cores.map_or(serde_json::Value::Null, |c| c.into()));
    if let Some(cpus) = &setup.target.cpus_allowed {
        results.param("hubcast_cpus", cpus.as_str());
    }
    if args.via == Via::Http {
        results.param("batch", args.batch).param("fleet_conns", args.fleet_conns);
    } else {
        results.param("partitions", args.partitions);
    }
    for &rate in &args.rate {
        let plan = args.plan(rate);
        let stats = Arc::new(FleetStats::default());
        let mut tasks = JoinSet::new();
        start_fleet(&setup, &plan, &stats, &mut tasks);
        let before = setup.target.metrics().await?;
        stats.run();
        sleep(secs(global.warmup)).await;
        let a = snapshot(&setup.target, Some(&stats), None).await?;
        sleep(secs(global.duration)).await;
        let b = snapshot(&setup.target, Some(&stats), None).await?;
        stop_fleet(&stats, &mut tasks).await;
        let mut row = Row::default();
        row.put("rate", if rate > 0.0 { rate.into() } else { serde_json::Value::from("max") });
        window(&mut row, &a, &b);
        if args.via == Via::Amqp {
            every_message_arrived(&mut row, &setup.target, &before, &stats).await?;
        }
        if let (Some(i), Some(c)) = (row.get("ingest_msg_s").and_then(|v| v.as_f64()), row.get("hubcast_cpu").and_then(|v| v.as_f64())) {
            row.put("msg_per_cpu_s", if c > 0.0 { i / c } else { 0.0 });
        }
        results.row(row);
        sleep(Duration::from_millis(300)).await;
    }
    Ok(results)
}

/// AMQP: waits (up to 5 s) until hubcast counts as received and taken in every message the
/// endpoint sent in this run, and reports both totals: a message lost or mangled on the way
/// shows as `hubcast_in_total < fleet_sent_total`.
async fn every_message_arrived(row: &mut Row, target: &Target, before: &Metrics, stats: &FleetStats) -> io::Result<()> {
    let sent = stats.sent.load(Ordering::Relaxed) as f64;
    let deadline = Instant::now() + Duration::from_secs(5);
    let (received, taken_in) = loop {
        let now = target.metrics().await?;
        let received = now.sum("hubcast_amqp_messages_received_total") - before.sum("hubcast_amqp_messages_received_total");
        let taken_in = now.sum("hubcast_messages_in_total") - before.sum("hubcast_messages_in_total");
        if (received >= sent && taken_in >= sent) || Instant::now() >= deadline {
            break (received, taken_in);
        }
        sleep(Duration::from_millis(50)).await;
    };
    row.put("fleet_sent_total", sent);
    row.put("hubcast_received_total", received);
    row.put("hubcast_in_total", taken_in);
    Ok(())
}

fn via_name(v: Via) -> &'static str {
    match v {
        Via::Http => "http",
        Via::Amqp => "amqp",
    }
}

// ---- fan-out -----------------------------------------------------------------------------------

pub async fn fanout(global: &Global, args: &FanoutArgs) -> io::Result<Results> {
    let setup = open(global, Some(&args.fleet)).await?;
    let target = &setup.target;
    let devices = args.fleet.devices.max(1);
    let set_up = Instant::now();
    let sessions = open_sessions(target.addr, args.clients, args.setup_conns).await?;
    grant_and_subscribe(target.addr, &target.admin_key, &sessions, args.subs, devices, args.setup_conns).await?;
    let setup_secs = set_up.elapsed().as_secs_f64();
    let live = Arc::new(LiveStats::default());
    let mut sockets = JoinSet::new();
    let plan = SocketPlan { transport: args.transport, concurrency: args.connect_concurrency, buffer: 16 * 1024 };
    let connect_time = connect_sockets(target.addr, &sessions, &plan, live.clone(), &mut sockets).await;
    let connected = live.connected.load(Ordering::Relaxed);

    // Subscribers per device (the fleet spreads messages evenly over devices).
    let mut per_device = vec![0u64; devices];
    for c in 0..args.clients {
        for d in devices_of(c, args.subs, devices) {
            per_device[d] += 1;
        }
    }
    let fanout_factor = per_device.iter().sum::<u64>() as f64 / devices as f64;

    let mut results = Results::new(&format!("fanout ({}, fleet {})", args.transport.name(), via_name(args.fleet.via)));
    results
        .param("transport", args.transport.name())
        .param("fleet", via_name(args.fleet.via))
        .param("cores", target.cores.map_or(serde_json::Value::Null, |c| c.into()))
        .param("clients", args.clients)
        .param("connected", connected)
        .param("subs_per_client", args.subs)
        .param("devices", devices)
        .param("subscribers_per_device", fanout_factor)
        .param("setup_s", setup_secs)
        .param("connect_s", connect_time.as_secs_f64());
    for &rate in &args.fleet.rate {
        let row = fanout_step(global, &setup, &args.fleet.plan(rate), &live, fanout_factor).await?;
        results.row(row);
    }
    sockets.abort_all();
    Ok(results)
}

/// One fleet rate against connected sockets.
async fn fanout_step(global: &Global, setup: &Setup, plan: &FleetPlan, live: &Arc<LiveStats>, fanout_factor: f64) -> io::Result<Row> {
    let target = &setup.target;
    let stats = Arc::new(FleetStats::default());
    let mut tasks = JoinSet::new();
    let closed_before = live.closed.load(Ordering::Relaxed);
    start_fleet(setup, plan, &stats, &mut tasks);
    stats.run();
    sleep(secs(global.warmup)).await;
    live.latency.reset();
    live.measuring.store(true, Ordering::Relaxed);
    crate::hook::run(global.step_hook.as_deref(), "begin", plan.rate).await?;
    let a = snapshot(target, Some(&stats), Some(live)).await?;
    sleep(secs(global.duration)).await;
    let b = snapshot(target, Some(&stats), Some(live)).await?;
    crate::hook::run(global.step_hook.as_deref(), "end", plan.rate).await?;
    live.measuring.store(false, Ordering::Relaxed);
    stop_fleet(&stats, &mut tasks).await;
    let latency: Histogram = live.latency.merged();

    let mut row = Row::default();
    row.put("rate", if plan.rate > 0.0 { plan.rate.into() } else { serde_json::Value::from("max") });
    let secs = window(&mut row, &a, &b);
    let ingested = row.get("ingest_msg_s").and_then(|v| v.as_f64()).unwrap_or(0.0);
    let delivered = (b.delivered - a.delivered) as f64 / secs;
    let out = |s: &Snapshot| s.metrics.sum("hubcast_messages_out_total");
    row.put("expected_msg_s", ingested * fanout_factor);
    row.put("delivered_msg_s", delivered);
    row.put("server_out_msg_s", (out(&b) - out(&a)) / secs);
    row.put("conflated", b.metrics.sum("hubcast_conflated_total") - a.metrics.sum("hubcast_conflated_total"));
    // How hubcast's writers packed what they sent: WebSocket frames per socket write, and
    // envelopes per frame (above 1 only for batched clients; pings count as frames too).
    let delta = |name: &str| b.metrics.sum(name) - a.metrics.sum(name);
    let (writes, frames) = (delta("hubcast_socket_writes_total"), delta("hubcast_socket_frames_written_total"));
    row.put("frames_per_write", if writes > 0.0 { frames / writes } else { 0.0 });
    row.put("msgs_per_frame", if frames > 0.0 { (out(&b) - out(&a)) / frames } else { 0.0 });
    // Writes the flush policy held back (`--socket-linger-us`): only while the core looked
    // saturated.
    row.put("writes_held", delta("hubcast_socket_writes_held_total"));
    put_client_side(&mut row, &latency, delivered, live.closed.load(Ordering::Relaxed) - closed_before);
    // Let queued deliveries drain before the next step.
    sleep(Duration::from_millis(300)).await;
    Ok(row)
}

/// The client side of a fan-out row (`fanout`'s and `peer`'s): the harness's CPU time per
/// message received (after `harness_cpu`), the latency quantiles in ms, the sockets closed.
pub fn put_client_side(row: &mut Row, latency: &Histogram, delivered: f64, socket_closes: u64) {
    if let Some(cpu) = row.get("harness_cpu").and_then(|v| v.as_f64()) {
        row.put("harness_us_per_msg", if delivered > 0.0 { cpu * 1e6 / delivered } else { 0.0 });
    }
    let ms = |us: u64| us as f64 / 1000.0;
    row.put("p50_ms", ms(latency.quantile(0.50)));
    row.put("p99_ms", ms(latency.quantile(0.99)));
    row.put("p999_ms", ms(latency.quantile(0.999)));
    row.put("max_ms", ms(latency.max()));
    row.put("socket_closes", socket_closes);
}

// ---- idle sockets ------------------------------------------------------------------------------

pub async fn idle(global: &Global, args: &IdleArgs) -> io::Result<Results> {
    let setup = open(global, None).await?;
    let target = &setup.target;
    let limit = crate::report::raise_file_limit();
    let mut clients = args.clients;
    if clients as u64 + 200 > limit {
        clients = limit.saturating_sub(200) as usize;
        eprintln!(
            "hubcast-load: open-file limit {limit}: opening {clients} of {} sockets (see ulimit -Hn; or run several harness processes)",
            args.clients
        );
    }
    let rss = |t: &Target| t.proc_sample().map(|s| s.rss_kb);
    let before = rss(target);
    let sessions = open_sessions(target.addr, clients, args.setup_conns).await?;
    if args.subs > 0 {
        grant_and_subscribe(target.addr, &target.admin_key, &sessions, args.subs, args.devices.max(1), args.setup_conns).await?;
    }
    let with_sessions = rss(target);
    let live = Arc::new(LiveStats::default());
    let mut sockets = JoinSet::new();
    let plan = SocketPlan { transport: args.transport, concurrency: args.connect_concurrency, buffer: 512 };
    let connect_time = connect_sockets(target.addr, &sessions, &plan, live.clone(), &mut sockets).await;
    sleep(secs(global.warmup)).await;
    let after = rss(target);
    sleep(secs(global.duration)).await;
    let metrics = target.metrics().await?;
    let held = rss(target);
    let connected = live.connected.load(Ordering::Relaxed);

    let mut results = Results::new(&format!("idle ({})", args.transport.name()));
    results
        .param("transport", args.transport.name())
        .param("cores", target.cores.map_or(serde_json::Value::Null, |c| c.into()))
        .param("asked", args.clients)
        .param("subs", args.subs)
        .param("devices", args.devices)
        .param("file_limit", limit);
    let mut row = Row::default();
    row.put("sockets", connected);
    row.put("failed", live.connect_failures.load(Ordering::Relaxed));
    row.put("closed_while_idle", live.closed.load(Ordering::Relaxed));
    row.put("server_sockets", metrics.sum("hubcast_sockets"));
    row.put("connect_per_s", connected as f64 / connect_time.as_secs_f64().max(1e-9));
    let mb = |kb: u64| kb as f64 / 1024.0;
    if let (Some(b), Some(s), Some(a), Some(h)) = (before, with_sessions, after, held) {
        row.put("rss_start_mb", mb(b));
        row.put("rss_sessions_mb", mb(s));
        row.put("rss_sockets_mb", mb(a));
        row.put("rss_held_mb", mb(h));
        let per = |from: u64| if connected > 0 { (h.saturating_sub(from)) as f64 / connected as f64 } else { 0.0 };
        row.put("kb_per_socket", per(s));
        row.put("kb_per_session_socket", per(b));
        // What 50,000 would take at the same cost per session and socket.
        row.put("rss_at_50k_mb", mb(b) + per(b) * 50_000.0 / 1024.0);
    }
    results.row(row);
    sockets.abort_all();
    Ok(results)
}

// ---- REST --------------------------------------------------------------------------------------

pub async fn rest(global: &Global, args: &RestArgs) -> io::Result<Results> {
    let setup = open(global, None).await?;
    let target = &setup.target;
    let devices = args.devices.max(1);
    // One message per device, so that every read finds a value.
    let mut body = Vec::from(&b"["[..]);
    for d in 0..devices {
        if d > 0 {
            body.push(b',');
        }
        body.extend_from_slice(format!("{{\"deviceId\":\"{}\",\"body\":", device_id(d)).as_bytes());
        fleet::write_body(&mut body, fleet::now_micros(), d as u64);
        body.push(b'}');
    }
    body.push(b']');
    let mut conn = HttpConn::new(target.addr);
    let r = conn.call("POST", "/ingest", &[("shared-access-key", &target.admin_key)], &body).await?;
    if r.status != 200 {
        return Err(io::Error::other(format!("POST /ingest answered {}: {}", r.status, r.text())));
    }
    let version = Arc::new(vec![request_bytes("GET", "/version", &[], b"")]);
    let last_value = Arc::new(
        (0..devices)
            .map(|d| request_bytes("GET", &format!("/lastValue/{}", device_id(d)), &[("shared-access-key", &target.admin_key)], b""))
            .collect::<Vec<_>>(),
    );
    let rounds = args.rounds.max(1);
    let phase = global.duration / (2 * rounds) as f64;
    // Warm both routes up.
    closed_loop(target, &version, args.conns, global.warmup / 2.0).await;
    closed_loop(target, &last_value, args.conns, global.warmup / 2.0).await;
    let mut totals = [Phase::default(), Phase::default()];
    let hubcast_start = target.proc_sample();
    for _ in 0..rounds {
        for (i, requests) in [&version, &last_value].into_iter().enumerate() {
            let p = closed_loop(target, requests, args.conns, phase).await;
            totals[i].add(&p);
        }
    }
    let hubcast_end = target.proc_sample();
    let mut results = Results::new("rest");
    results
        .param("cores", target.cores.map_or(serde_json::Value::Null, |c| c.into()))
        .param("conns", args.conns)
        .param("devices", devices)
        .param("rounds", rounds);
    for (name, p) in [("GET /version", &totals[0]), ("GET /lastValue/:id", &totals[1])] {
        let mut row = Row::default();
        row.put("route", name);
        row.put("req_s", p.ok as f64 / p.secs);
        row.put("errors", p.errors);
        row.put("p50_ms", p.latency.quantile(0.5) as f64 / 1000.0);
        row.put("p99_ms", p.latency.quantile(0.99) as f64 / 1000.0);
        results.row(row);
    }
    let ratio = (totals[1].ok as f64 / totals[1].secs) / (totals[0].ok as f64 / totals[0].secs).max(1e-9);
    results.param("lastvalue_over_version", ratio);
    if let (Some(a), Some(b)) = (hubcast_start, hubcast_end) {
        results.param("hubcast_cpu", a.cores_used(&b));
    }
    Ok(results)
}

#[derive(Default)]
struct Phase {
    ok: u64,
    errors: u64,
    secs: f64,
    latency: Histogram,
}

impl Phase {
    fn add(&mut self, other: &Phase) {
        self.ok += other.ok;
        self.errors += other.errors;
        self.secs += other.secs;
        self.latency.merge(&other.latency);
    }
}

/// `conns` keep-alive connections, each sending the next request as soon as the previous
/// one is answered, cycling through `requests`, for `seconds`.
async fn closed_loop(target: &Target, requests: &Arc<Vec<Vec<u8>>>, conns: usize, seconds: f64) -> Phase {
    let started = Instant::now();
    let deadline = started + secs(seconds);
    let mut tasks = JoinSet::new();
    for k in 0..conns.max(1) {
        let requests = requests.clone();
        let addr = target.addr;
        tasks.spawn(async move {
            let mut conn = HttpConn::new(addr);
            let mut p = Phase::default();
            let mut i = k;
            while Instant::now() < deadline {
                let t = Instant::now();
                match conn.send(&requests[i % requests.len()]).await {
                    Ok(r) if r.status == 200 => {
                        p.ok += 1;
                        p.latency.record(t.elapsed().as_micros() as u64);
                    }
                    _ => p.errors += 1,
                }
                i += 1;
            }
            p
        });
    }
    let mut total = Phase::default();
    while let Some(Ok(p)) = tasks.join_next().await {
        total.add(&p);
    }
    total.secs = started.elapsed().as_secs_f64();
    total
}

// ---- the suite ---------------------------------------------------------------------------------

/// Scales a count, at least `min`.
fn scaled(n: f64, scale: f64, min: usize) -> usize {
    ((n * scale).round() as usize).max(min)
}

/// Runs the whole suite of docs/BENCHMARKS.md, each part on a fresh hubcast, and adds a
/// summary with the targets and the ratios measured in this run.
pub async fn all(global: &Global, args: &AllArgs) -> io::Result<Vec<Results>> {
    if global.spawn.is_none() {
        return Err(io::Error::other("`all` starts hubcast for each part: give --spawn <path to hubcast>"));
    }
    let cores = global.cores.unwrap_or(2);
    let with_cores = |c: usize| Global { cores: Some(c), ..global.clone() };
    let g = with_cores(cores);
    let s = args.scale;
    let mut out = Vec::new();
    let fleet = |via: Via, devices: usize, rate: Vec<f64>| FleetArgs {
        via,
        devices,
        rate,
        batch: 500,
        fleet_conns: 4,
        partitions: 4,
        amqp_port: 0,
        prefetch: 2000,
        pipeline: 1,
        fleet_target: None,
    };

    eprintln!("hubcast-load all: ingest over POST /ingest");
    let ingest_http = ingest(&g, &fleet(Via::Http, scaled(10_000.0, s, 10), vec![0.0])).await?;
    out.push(ingest_http.clone());
    let mut ingest_amqp = None;
    if !args.no_amqp {
        eprintln!("hubcast-load all: ingest over AMQP");
        match ingest(&g, &fleet(Via::Amqp, scaled(10_000.0, s, 10), vec![0.0])).await {
            Ok(r) => {
                ingest_amqp = Some(r.clone());
                out.push(r);
            }
            Err(e) => eprintln!("hubcast-load all: AMQP ingest failed: {e}"),
        }
    }

    // Fan-out: 10,000 sockets on 10 devices (1,000 subscribers each); ramp the fleet.
    let clients = scaled(10_000.0, s, 10);
    let fan = |transport: Transport, rates: Vec<f64>| FanoutArgs {
        // Batches of 50 over 10 devices: each socket gets 5 messages per batch, in one write.
        fleet: FleetArgs { batch: 50, fleet_conns: 2, ..fleet(Via::Http, 10, rates) },
        clients,
        subs: 1,
        transport,
        setup_conns: 8,
        connect_concurrency: 256,
    };
    let ramp = args.ramp.clone();
    eprintln!("hubcast-load all: fan-out over WebSocket, {cores} cores");
    let ws = fanout(&g, &fan(Transport::Ws, ramp.clone())).await?;
    let best = best_step(&ws);
    // Latency at half the saturation rate, on a fresh server.
    let half_rate = (best.1 / 2.0).max(1.0);
    eprintln!("hubcast-load all: fan-out latency at half the saturation rate ({half_rate:.0} msg/s in)");
    let ws_half = fanout(&g, &fan(Transport::Ws, vec![half_rate])).await?;
    eprintln!("hubcast-load all: fan-out over Socket.IO");
    let sio = fanout(&g, &fan(Transport::Socketio, ramp.clone())).await?;
    eprintln!("hubcast-load all: fan-out over WebSocket with batched frames (/ws?batch=1)");
    let ws_batch = fanout(&g, &fan(Transport::WsBatch, ramp.clone())).await?;
    eprintln!("hubcast-load all: fan-out over WebSocket, 1 core");
    let ws1 = fanout(&with_cores(1), &fan(Transport::Ws, ramp.clone())).await?;
    eprintln!("hubcast-load all: REST");
    let rest_r = rest(&g, &RestArgs { conns: 32, devices: scaled(1000.0, s, 10), rounds: 3 }).await?;
    eprintln!("hubcast-load all: idle sockets");
    let idle_r = idle(&g, &IdleArgs { clients: scaled(args.idle as f64, s, 10), subs: 0, devices: 1000, transport: Transport::Ws, setup_conns: 8, connect_concurrency: 256 }).await?;

    let mut summary = Results::new("summary (targets)");
    let mut line = |what: &str, measured: f64, target: &str, met: Option<bool>| {
        let mut row = Row::default();
        row.put("measure", what).put("value", measured).put("target", target);
        row.put("met", met.map_or("-".to_string(), |m| if m { "yes".into() } else { "NO".into() }));
        summary.row(row);
    };
    let ingest_rate = ingest_http.last("ingest_msg_s").unwrap_or(0.0);
    line("ingest msg/s (POST /ingest)", ingest_rate, ">= 300,000", Some(ingest_rate >= 300_000.0));
    if let Some(a) = &ingest_amqp {
        let r = a.last("ingest_msg_s").unwrap_or(0.0);
        line("ingest msg/s (AMQP)", r, ">= 300,000", Some(r >= 300_000.0));
    }
    let fan2 = best.0;
    line(&format!("fan-out delivered msg/s (ws, {cores} cores)"), fan2, ">= 1,000,000", Some(fan2 >= 1_000_000.0));
    let sio_best = best_step(&sio).0;
    line(&format!("fan-out delivered msg/s (socket.io, {cores} cores)"), sio_best, "-", None);
    let batch_best = best_step(&ws_batch).0;
    line(&format!("fan-out delivered msg/s (ws-batch, {cores} cores)"), batch_best, "-", None);
    // The client's cost per message at each ramp's best step: batched frames vs one per frame.
    for (name, r) in [("ws", &ws), ("ws-batch", &ws_batch)] {
        let us = best_row(r)
            .and_then(|row| row.iter().find(|(k, _)| k == "harness_us_per_msg"))
            .and_then(|(_, v)| v.as_f64())
            .unwrap_or(0.0);
        line(&format!("harness CPU µs per delivered msg ({name})"), us, "-", None);
    }
    let p99 = ws_half.last("p99_ms").unwrap_or(f64::NAN);
    line("p99 latency ms at half saturation", p99, "<= 5", Some(p99 <= 5.0));
    let fan1 = best_step(&ws1).0;
    let ratio_cores = fan2 / fan1.max(1e-9);
    line(&format!("fan-out {cores} cores / 1 core"), ratio_cores, ">= 1.7", Some(ratio_cores >= 1.7));
    let ratio_rest = rest_r.params.iter().find(|(k, _)| k == "lastvalue_over_version").and_then(|(_, v)| v.as_f64()).unwrap_or(0.0);
    line("GET /lastValue / GET /version req/s", ratio_rest, ">= 0.70", Some(ratio_rest >= 0.7));
    let idle_sockets = idle_r.last("sockets").unwrap_or(0.0);
    let rss_held = idle_r.last("rss_held_mb").unwrap_or(0.0);
    line("idle sockets held", idle_sockets, ">= 50,000", Some(idle_sockets >= 50_000.0));
    line("RSS MB with those sockets", rss_held, "<= 1,024 (at 50,000)", Some(rss_held <= 1024.0));
    let at50k = idle_r.last("rss_at_50k_mb").unwrap_or(0.0);
    line("RSS MB extrapolated to 50,000", at50k, "<= 1,024", Some(at50k <= 1024.0));

    out.extend([ws, ws_half, sio, ws_batch, ws1, rest_r, idle_r, summary]);
    Ok(out)
}

/// The step of a ramp that delivered the most.
fn best_row(r: &Results) -> Option<&[(String, serde_json::Value)]> {
    let get = |row: &[(String, serde_json::Value)], k: &str| row.iter().find(|(n, _)| n == k).and_then(|(_, v)| v.as_f64());
    let delivered = |row: &[(String, serde_json::Value)]| get(row, "delivered_msg_s").unwrap_or(0.0);
    r.rows.iter().map(Vec::as_slice).max_by(|a, b| delivered(a).total_cmp(&delivered(b)))
}

/// (largest delivered msg/s of a ramp, the ingest rate of that step).
fn best_step(r: &Results) -> (f64, f64) {
    r.rows
        .iter()
        .map(|row| {
            let get = |k: &str| row.iter().find(|(n, _)| n == k).and_then(|(_, v)| v.as_f64()).unwrap_or(0.0);
            (get("delivered_msg_s"), get("ingest_msg_s"))
        })
        .fold((0.0, 0.0), |a, b| if b.0 > a.0 { b } else { a })
}
