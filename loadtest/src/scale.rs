//! `fleet`: the fleet-scale run of issue 25 item 5 in one command. D devices send through the
//! harness's AMQP endpoint (hubcast's event stream), S live plain WebSockets each subscribed
//! to `--subs` devices, the durable store on, on 1 instance or N instances on one Redis (a
//! private redis-server the harness starts on a free port, each instance holding 1/N of the
//! sockets). In order:
//!
//! 1. **memory per device**: hubcast's RSS before and after every device sent once (the fleet
//!    at full speed until `hubcast_devices` counts D), divided by D;
//! 2. **memory per socket**: RSS after S sessions, their grants and subscriptions and one
//!    socket each, divided by S;
//! 3. **fan-out**: the fleet as fast as hubcast takes it, then at `--low` of that rate:
//!    ingested/s, delivered/s (counted by the clients), p50/p99 (client arrival − `sentAt`),
//!    CPU of hubcast, the harness and redis-server;
//! 4. **store bytes per device**: the data dirs' files (snapshots and logs) / D;
//! 5. **`kill -9` and restart** of the first instance on its data dir and port, the fleet
//!    running at the `--low` rate: time until hubcast prints its address, until `GET /status`
//!    answers 200, and until its sockets (which reconnect by themselves with their session
//!    ids, as a browser does) receive live data again (first, half, 99 %, all); and the
//!    clients' delivered/s every 500 ms around the kill.
//!
//! Needs `--spawn`. Every hubcast gets `--cores` and `--pin` as the other modes give them; with
//! several instances they share those CPUs (the point is the cost per device, socket and
//! message, not scaling on 2 vCPUs). Bounds: the sockets are capped by the open-file limit
//! (raised to the hard limit), each client's read buffer starts at 4 KiB; reconnects back off
//! 100 ms doubling to 800 ms (± 50 %), so a dead hubcast is not hammered.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::{sleep, Instant};

use crate::cli::Global;
use crate::clients::{devices_of, open_sessions, run_requests};
use crate::fleet::{amqp, device_id, now_micros, FleetPlan, FleetStats, Via};
use crate::hist::Striped;
use crate::http::request_bytes;
use crate::report::{Results, Row};
use crate::target::{Metrics, ProcSample, Target};
use crate::ws::{sent_at, WsClient, OP_CLOSE, OP_PING, OP_PONG, OP_TEXT};

#[derive(Args, Debug, Clone)]
pub struct ScaleArgs {
    /// Devices in the fleet (each sends once before the sockets come).
    #[arg(long, default_value_t = 1_000_000)]
    pub devices: usize,
    /// Live sockets (one session each), capped by the open-file limit.
    #[arg(long, default_value_t = 18_000)]
    pub sockets: usize,
    /// Devices each socket's session is granted and subscribed to.
    #[arg(long, default_value_t = 10)]
    pub subs: usize,
    /// hubcast instances; above 1 they share a redis-server the harness starts.
    #[arg(long, default_value_t = 1)]
    pub instances: usize,
    /// Partitions of the AMQP endpoint (divided among the instances by Redis leases).
    #[arg(long, default_value_t = 6)]
    pub partitions: usize,
    /// --event-hub-prefetch of each hubcast.
    #[arg(long, default_value_t = 2000)]
    pub prefetch: u32,
    /// The second fan-out step, and the fleet during the kill, as a fraction of the max rate.
    #[arg(long, default_value_t = 0.5)]
    pub low: f64,
    /// redis-server binary (several instances).
    #[arg(long, default_value = "redis-server")]
    pub redis_server: String,
    /// Port of the private redis-server (0: a free one).
    #[arg(long, default_value_t = 0)]
    pub redis_port: u16,
    /// Seconds to wait for the sockets of the killed instance to get live data again.
    #[arg(long, default_value_t = 60.0)]
    pub recovery_timeout: f64,
    /// Skip the kill -9 and restart.
    #[arg(long)]
    pub no_kill: bool,
    #[arg(long, default_value_t = 8)]
    pub setup_conns: usize,
    #[arg(long, default_value_t = 256)]
    pub connect_concurrency: usize,
    /// Directory for each instance's log (`--log-level info`), written after the kill -9 and
    /// restart: `i<N>.log`, and `i0-killed.log` for the instance before its kill.
    #[arg(long)]
    pub logs: Option<PathBuf>,
}

/// A redis-server of the run's own (killed at the end).
struct Redis {
    child: Child,
    port: u16,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn start_redis(bin: &str, port: u16) -> io::Result<Redis> {
    let port = if port == 0 { free_port()? } else { port };
    let child = Command::new(bin)
        .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no", "--protected-mode", "no"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| io::Error::other(format!("cannot start {bin}: {e}")))?;
    let redis = Redis { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if Instant::now() > deadline {
            return Err(io::Error::other(format!("redis-server on port {port} did not listen within 10 s")));
        }
        sleep(Duration::from_millis(20)).await;
    }
    Ok(redis)
}

/// One hubcast of the run: how to start it again, and the running process.
struct Instance {
    args: Vec<String>,
    data_dir: PathBuf,
    target: Target,
}

async fn spawn(global: &Global, args: &[String]) -> io::Result<Target> {
    let spec = global.target_spec();
    let more = args.to_vec();
    tokio::task::spawn_blocking(move || Target::open(&spec, &more)).await.map_err(io::Error::other)?
}

/// What the sockets saw.
struct Live {
    delivered: AtomicU64,
    /// Deliveries per instance (socket `s` is on instance `s % N`).
    by_instance: Vec<AtomicU64>,
    measuring: AtomicBool,
    latency: Striped,
    /// Sockets connected now.
    connected: AtomicU64,
    /// Sockets that connected at least once / never could.
    ever: AtomicU64,
    failed: AtomicU64,
    reconnects: AtomicU64,
    /// µs since the epoch of the kill (0: none yet).
    kill_at: AtomicU64,
    /// Per socket: µs of its first data message on a connection opened after the kill.
    back_at: Vec<AtomicU64>,
    stop: AtomicBool,
}

/// One socket: connects, reads and counts; after it was connected once it reconnects with
/// its session id whenever the connection ends (as a browser's client does), until `stop`.
async fn socket(addr: SocketAddr, path: String, index: usize, instance: usize, live: Arc<Live>, mut permit: Option<tokio::sync::OwnedSemaphorePermit>) {
    let mut attempt = 0u32;
    let mut was_connected = false;
    let mut latencies: Vec<u64> = Vec::with_capacity(64);
    let mut replies: Vec<Vec<u8>> = Vec::new();
    while !live.stop.load(Ordering::Relaxed) {
        let mut ws = match WsClient::connect(addr, &path, 4096).await {
            Ok(ws) => ws,
            Err(e) => {
                attempt += 1;
                if !was_connected && attempt > 3 {
                    drop(permit.take());
                    if live.failed.fetch_add(1, Ordering::Relaxed) < 3 {
                        eprintln!("hubcast-load: socket {index} did not connect: {e}");
                    }
                    return;
                }
                let base = 100u64 << attempt.min(4).saturating_sub(1);
                sleep(Duration::from_millis(base / 2 + fastrand::u64(0..=base))).await;
                continue;
            }
        };
        attempt = 0;
        drop(permit.take());
        let opened = now_micros();
        if was_connected {
            live.reconnects.fetch_add(1, Ordering::Relaxed);
        } else {
            live.ever.fetch_add(1, Ordering::Relaxed);
            was_connected = true;
        }
        live.connected.fetch_add(1, Ordering::Relaxed);
        loop {
            let mut count = 0u64;
            let mut closed = false;
            let mut now = 0;
            let measuring = live.measuring.load(Ordering::Relaxed);
            let read = ws
                .read_frames(|op, payload| match op {
                    OP_TEXT => {
                        count += 1;
                        if now == 0 {
                            now = now_micros();
                        }
                        if measuring {
                            if let Some(t) = sent_at(payload) {
                                latencies.push(now.saturating_sub(t));
                            }
                        }
                    }
                    OP_PING => replies.push(payload.to_vec()),
                    OP_CLOSE => closed = true,
                    _ => {}
                })
                .await;
            if count > 0 {
                live.delivered.fetch_add(count, Ordering::Relaxed);
                live.by_instance[instance].fetch_add(count, Ordering::Relaxed);
                let kill = live.kill_at.load(Ordering::Relaxed);
                if kill != 0 && opened > kill && live.back_at[index].load(Ordering::Relaxed) == 0 {
                    live.back_at[index].store(now, Ordering::Relaxed);
                }
            }
            live.latency.record_all(index, &latencies);
            latencies.clear();
            let mut failed = false;
            for p in replies.drain(..) {
                failed |= ws.send(OP_PONG, &p).await.is_err();
            }
            if closed || failed || !matches!(read, Ok(true)) || live.stop.load(Ordering::Relaxed) {
                break;
            }
        }
        live.connected.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Grants each session (socket number `s` of the run, session id) its devices and subscribes it.
/// The requests are interleaved by session (every session's first grant, then every second
/// one, …) so that the connections in parallel do not change one session at once: on Redis a
/// change of a session is optimistic, and concurrent changes of one session retry and may
/// answer 503. A 503 is retried (changes are idempotent), at most 5 rounds.
async fn grant_and_subscribe(addr: SocketAddr, key: &str, members: &[(usize, &str)], args: &ScaleArgs) -> io::Result<()> {
    let mut grants = Vec::new();
    let mut subscriptions = Vec::new();
    for j in 0..args.subs {
        for &(s, session) in members {
            let d = devices_of(s, args.subs, args.devices.max(1)).nth(j).expect("j < subs");
            let body = json!({"sessionId": session, "deviceId": device_id(d), "type": "telemetry", "telemetryKey": null});
            grants.push(request_bytes(
                "PUT",
                "/grants",
                &[("shared-access-key", key), ("content-type", "application/json")],
                body.to_string().as_bytes(),
            ));
            subscriptions.push(body);
        }
    }
    let bulk: Vec<Vec<u8>> = subscriptions
        .chunks(500)
        .map(|c| request_bytes("PUT", "/subscriptions", &[("content-type", "application/json")], serde_json::to_vec(c).unwrap().as_slice()))
        .collect();
    for (what, requests, ok) in [("PUT /grants", grants, 204), ("PUT /subscriptions", bulk, 200)] {
        let mut pending = requests;
        for round in 0.. {
            let answers = run_requests(addr, pending.clone(), args.setup_conns).await?;
            let mut again = Vec::new();
            for (r, request) in answers.iter().zip(pending) {
                if r.status == 503 && round < 5 {
                    again.push(request);
                } else if r.status != ok {
                    return Err(io::Error::other(format!("{what} answered {}: {}", r.status, r.text())));
                }
            }
            if again.is_empty() {
                break;
            }
            eprintln!("hubcast-load fleet: {what}: {} answered 503 (Redis), retried", again.len());
            pending = again;
        }
    }
    Ok(())
}

/// Sum of one metric over every instance.
async fn total(instances: &[Instance], name: &str) -> io::Result<f64> {
    let mut sum = 0.0;
    for i in instances {
        sum += i.target.metrics().await?.sum(name);
    }
    Ok(sum)
}

/// Every instance's metrics.
async fn all_metrics(instances: &[Instance]) -> io::Result<Vec<Metrics>> {
    let mut out = Vec::new();
    for i in instances {
        out.push(i.target.metrics().await?);
    }
    Ok(out)
}

fn rss_kb(instances: &[Instance]) -> u64 {
    instances.iter().filter_map(|i| i.target.proc_sample()).map(|s| s.rss_kb).sum()
}

fn cpu_secs(instances: &[Instance]) -> f64 {
    instances.iter().filter_map(|i| i.target.proc_sample()).map(|s| s.cpu_secs).sum()
}

/// (bytes of every file, bytes of snapshots) under `dir`.
fn dir_bytes(dir: &Path) -> (u64, u64) {
    let (mut all, mut snap) = (0, 0);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                let (a, s) = dir_bytes(&e.path());
                all += a;
                snap += s;
            } else {
                all += m.len();
                if e.file_name().to_string_lossy().ends_with(".snap") {
                    snap += m.len();
                }
            }
        }
    }
    (all, snap)
}

/// What each instance's `/metrics` said at one point of the kill timeline (`None`: no answer
/// within 400 ms, e.g. the killed instance).
type Sample = Option<[f64; SAMPLED.len()]>;

/// The counters (rates between points) and gauges read per instance around the kill.
const SAMPLED: [(&str, &str, bool); 9] = [
    ("in", "hubcast_messages_in_total", true),
    ("amqp", "hubcast_amqp_messages_received_total", true),
    ("out", "hubcast_messages_out_total", true),
    ("pub", "hubcast_redis_published_total", true),
    ("recv", "hubcast_redis_received_total", true),
    ("drop", "hubcast_redis_dropped_total", true),
    ("leases", "hubcast_redis_partition_leases", false),
    ("amqp_up", "hubcast_amqp_connected", false),
    ("redis_up", "hubcast_redis_connected", false),
];

async fn sample(addr: SocketAddr, key: &str) -> Sample {
    let scrape = async {
        let mut conn = crate::http::HttpConn::new(addr);
        let r = conn.call("GET", "/metrics", &[("shared-access-key", key)], b"").await.ok()?;
        (r.status == 200).then(|| crate::target::Metrics::parse(&r.text()))
    };
    let m = tokio::time::timeout(Duration::from_millis(400), scrape).await.ok()??;
    Some(SAMPLED.map(|(_, name, _)| m.sum(name)))
}

/// One instance's timeline: `+t:name=value,…` per point, counters as rates per second.
fn instance_timeline(points: &[(u64, Vec<u64>, Vec<Sample>)], i: usize, kill_at: u64) -> String {
    let mut out = Vec::new();
    for w in points.windows(2) {
        let ((t0, d0, s0), (t1, d1, s1)) = (&w[0], &w[1]);
        let dt = t1.saturating_sub(*t0).max(1) as f64 / 1e6;
        let mut p = format!("{:+.1}s:d={:.0}", (*t1 as f64 - kill_at as f64) / 1e6, (d1[i] - d0[i]) as f64 / dt);
        match (&s0[i], &s1[i]) {
            (_, None) => p.push_str(",-"),
            (a, Some(b)) => {
                for (k, (name, _, counter)) in SAMPLED.iter().enumerate() {
                    if *counter {
                        match a {
                            Some(a) => p.push_str(&format!(",{name}={:.0}", (b[k] - a[k]).max(0.0) / dt)),
                            None => p.push_str(&format!(",{name}=?")),
                        }
                    } else {
                        p.push_str(&format!(",{name}={:.0}", b[k]));
                    }
                }
            }
        }
        out.push(p);
    }
    out.join(" ")
}

/// Waits until `GET /status` answers 200 (or `within` passes); the time it took.
async fn until_ready(target: &Target, within: Duration) -> io::Result<Duration> {
    let t = Instant::now();
    target.wait_ready(within).await?;
    Ok(t.elapsed())
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// Removes the run's data dirs and stops the sockets, whatever happens.
struct Cleanup {
    dirs: Vec<PathBuf>,
    live: Option<Arc<Live>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(l) = &self.live {
            l.stop.store(true, Ordering::Relaxed);
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

pub async fn fleet_scale(global: &Global, args: &ScaleArgs) -> io::Result<Vec<Results>> {
    if global.spawn.is_none() {
        return Err(io::Error::other("`fleet` starts (and kills) hubcast itself: give --spawn <path to hubcast>"));
    }
    let n = args.instances.max(1);
    let devices = args.devices.max(1);
    let limit = crate::report::raise_file_limit();
    let mut sockets = args.sockets;
    if sockets as u64 + 300 > limit {
        sockets = limit.saturating_sub(300) as usize;
        eprintln!("hubcast-load fleet: open-file limit {limit}: {sockets} of {} sockets", args.sockets);
    }
    let redis = if n > 1 { Some(start_redis(&args.redis_server, args.redis_port).await?) } else { None };
    let redis_pid = redis.as_ref().map(|r| r.child.id());

    let plan = FleetPlan { via: Via::Amqp, devices, rate: 0.0, batch: 1, conns: 1, partitions: args.partitions, pipeline: 1 };
    let endpoint = amqp::start(0, &plan).await?;
    let stamp = format!("{}-{}", std::process::id(), now_micros());
    let mut cleanup = Cleanup { dirs: Vec::new(), live: None };
    let mut instances = Vec::new();
    let started = Instant::now();
    for i in 0..n {
        let data_dir = std::env::temp_dir().join(format!("hubcast-fleet-{stamp}-{i}"));
        cleanup.dirs.push(data_dir.clone());
        let mut a = vec![
            "--port".to_string(),
            free_port()?.to_string(),
            "--data-dir".to_string(),
            data_dir.display().to_string(),
            "--iot-hub-event-hub-connection-string".to_string(),
            endpoint.connection_string(),
            "--event-hub-prefetch".to_string(),
            args.prefetch.to_string(),
            // The set-up of 18,000 sessions with 10 grants each can outlast the default 60 s
            // a session without a grant is kept (a loaded machine did: 404 on a grant), and
            // the 120 s one without a socket; sockets hold them once connected.
            "--unused-session-ttl".to_string(),
            "3600".to_string(),
            "--session-grace-period".to_string(),
            "3600".to_string(),
        ];
        if args.logs.is_some() {
            a.extend(["--log-level".to_string(), "info".to_string()]);
        }
        if let Some(r) = &redis {
            a.extend([
                "--redis-url".to_string(),
                format!("redis://127.0.0.1:{}", r.port),
                "--redis-prefix".to_string(),
                format!("fleet-{stamp}"),
                "--instance-id".to_string(),
                format!("i{i}"),
            ]);
        }
        let target = spawn(global, &a).await?;
        instances.push(Instance { args: a, data_dir, target });
    }
    for i in &instances {
        i.target.wait_ready(Duration::from_secs(60)).await?;
    }
    eprintln!("hubcast-load fleet: {n} instance(s) ready in {:.1} s", started.elapsed().as_secs_f64());
    // Leases settle: every partition read by someone.
    if n > 1 {
        let deadline = Instant::now() + Duration::from_secs(30);
        while total(&instances, "hubcast_redis_partition_leases").await? < args.partitions as f64 && Instant::now() < deadline {
            sleep(Duration::from_millis(200)).await;
        }
    }
    sleep(Duration::from_millis(500)).await;
    let rss_start = rss_kb(&instances);

    // 1. Every device once.
    let stats = Arc::new(FleetStats::default());
    endpoint.set_run(stats.clone(), 0.0);
    let t = Instant::now();
    stats.run();
    let deadline = Instant::now() + Duration::from_secs(600);
    let seen = loop {
        let seen = total(&instances, "hubcast_devices").await?;
        if seen >= devices as f64 || Instant::now() > deadline {
            break seen;
        }
        sleep(Duration::from_millis(100)).await;
    };
    stats.stop();
    let fill_secs = t.elapsed().as_secs_f64();
    let fill_sent = stats.sent.load(Ordering::Relaxed);
    eprintln!("hubcast-load fleet: {seen} devices after {fill_sent} messages in {fill_secs:.1} s");
    sleep(Duration::from_secs(2)).await;
    let rss_devices = rss_kb(&instances);

    // 2. Sessions, grants, subscriptions, sockets: instance i holds sockets i, i + n, …
    let t = Instant::now();
    let mut by_instance: Vec<Vec<usize>> = vec![Vec::new(); n];
    for s in 0..sockets {
        by_instance[s % n].push(s);
    }
    let mut session_of = vec![String::new(); sockets];
    for (i, members) in by_instance.iter().enumerate() {
        let addr = instances[i].target.addr;
        let ids = open_sessions(addr, members.len(), args.setup_conns).await?;
        for (k, &s) in members.iter().enumerate() {
            session_of[s] = ids[k].clone();
        }
        let members: Vec<(usize, &str)> = members.iter().map(|&s| (s, session_of[s].as_str())).collect();
        grant_and_subscribe(addr, &instances[i].target.admin_key, &members, args).await?;
    }
    let setup_secs = t.elapsed().as_secs_f64();
    let live = Arc::new(Live {
        delivered: AtomicU64::new(0),
        by_instance: (0..n).map(|_| AtomicU64::new(0)).collect(),
        measuring: AtomicBool::new(false),
        latency: Striped::new(16),
        connected: AtomicU64::new(0),
        ever: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        reconnects: AtomicU64::new(0),
        kill_at: AtomicU64::new(0),
        back_at: (0..sockets).map(|_| AtomicU64::new(0)).collect(),
        stop: AtomicBool::new(false),
    });
    cleanup.live = Some(live.clone());
    let t = Instant::now();
    let mut tasks = JoinSet::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(args.connect_concurrency.max(1)));
    for (s, session) in session_of.iter().enumerate() {
        let addr = instances[s % n].target.addr;
        let path = format!("/ws?sessionId={session}");
        let live = live.clone();
        let gate = gate.clone();
        tasks.spawn(async move {
            // The gate bounds the handshakes in flight (held until the first connect ends).
            let permit = gate.acquire_owned().await.ok();
            socket(addr, path, s, s % n, live, permit).await;
        });
    }
    while live.ever.load(Ordering::Relaxed) + live.failed.load(Ordering::Relaxed) < sockets as u64 {
        sleep(Duration::from_millis(10)).await;
    }
    let connect_secs = t.elapsed().as_secs_f64();
    sleep(secs(global.warmup.max(1.0))).await;
    let rss_sockets = rss_kb(&instances);
    let server_sockets = total(&instances, "hubcast_sockets").await?;
    eprintln!(
        "hubcast-load fleet: {} sockets connected ({} failed) in {connect_secs:.1} s, set-up {setup_secs:.1} s",
        live.ever.load(Ordering::Relaxed),
        live.failed.load(Ordering::Relaxed)
    );

    let mut memory = Results::new(&format!("fleet: memory and store ({n} instance{})", if n > 1 { "s" } else { "" }));
    memory
        .param("instances", n)
        .param("cores", instances[0].target.cores.map_or(serde_json::Value::Null, |c| c.into()))
        .param("devices", devices)
        .param("sockets", sockets)
        .param("subs", args.subs)
        .param("partitions", args.partitions)
        .param("file_limit", limit);
    if let Some(cpus) = &instances[0].target.cpus_allowed {
        memory.param("hubcast_cpus", cpus.as_str());
    }

    // 3. Fan-out at max, then at `low` of it.
    let subscribed = (sockets * args.subs).min(devices * sockets.max(1)) as f64;
    let fanout_factor = subscribed / devices as f64;
    let mut fan = Results::new(&format!("fleet: fan-out ({n} instance{}, store on)", if n > 1 { "s" } else { "" }));
    fan.param("subscribers_per_device", fanout_factor);
    let mut max_rate = 0.0;
    for step in 0..2 {
        let rate = if step == 0 { 0.0 } else { (max_rate * args.low).max(1.0) };
        let stats = Arc::new(FleetStats::default());
        endpoint.set_run(stats.clone(), rate);
        stats.run();
        sleep(secs(global.warmup)).await;
        live.latency.reset();
        live.measuring.store(true, Ordering::Relaxed);
        let m0 = all_metrics(&instances).await?;
        let (c0, h0, r0, d0, t0) = (
            cpu_secs(&instances),
            ProcSample::this_process(),
            redis_pid.and_then(ProcSample::of),
            live.delivered.load(Ordering::Relaxed),
            Instant::now(),
        );
        sleep(secs(global.duration)).await;
        let m1 = all_metrics(&instances).await?;
        let (c1, h1, r1, d1) = (cpu_secs(&instances), ProcSample::this_process(), redis_pid.and_then(ProcSample::of), live.delivered.load(Ordering::Relaxed));
        let wall = t0.elapsed().as_secs_f64();
        live.measuring.store(false, Ordering::Relaxed);
        stats.stop();
        let lat = live.latency.merged();
        let delta = |name: &str| m1.iter().map(|m| m.sum(name)).sum::<f64>() - m0.iter().map(|m| m.sum(name)).sum::<f64>();
        let ingested = delta("hubcast_messages_in_total") / wall;
        if step == 0 {
            max_rate = ingested;
        }
        let delivered = (d1 - d0) as f64 / wall;
        let cpu = (c1 - c0) / wall;
        let mut row = Row::default();
        row.put("rate", if rate > 0.0 { rate.into() } else { serde_json::Value::from("max") });
        row.put("ingest_msg_s", ingested);
        row.put("expected_msg_s", ingested * fanout_factor);
        row.put("delivered_msg_s", delivered);
        row.put("p50_ms", lat.quantile(0.50) as f64 / 1000.0);
        row.put("p99_ms", lat.quantile(0.99) as f64 / 1000.0);
        row.put("max_ms", lat.max() as f64 / 1000.0);
        row.put("hubcast_cpu", cpu);
        row.put("in_per_cpu_s", if cpu > 0.0 { ingested / cpu } else { 0.0 });
        row.put("us_cpu_per_delivered", if delivered > 0.0 { cpu * 1e6 / delivered } else { 0.0 });
        if let (Some(a), Some(b)) = (h0, h1) {
            row.put("harness_cpu", a.cores_used(&b));
        }
        if let (Some(a), Some(b)) = (r0, r1) {
            let redis_cpu = a.cores_used(&b);
            let crossed = delta("hubcast_redis_published_total") / wall;
            row.put("redis_cpu", redis_cpu);
            row.put("redis_published_s", crossed);
            row.put("redis_ms_per_1000", if crossed > 0.0 { redis_cpu * 1e6 / crossed } else { 0.0 });
        }
        row.put("rss_mb", rss_kb(&instances) as f64 / 1024.0);
        row.put("socket_closes", live.reconnects.load(Ordering::Relaxed));
        fan.row(row);
        sleep(Duration::from_millis(500)).await;
    }

    // 4. The store.
    let (mut store_all, mut store_snap) = (0, 0);
    for i in &instances {
        let (a, s) = dir_bytes(&i.data_dir);
        store_all += a;
        store_snap += s;
    }
    let mut row = Row::default();
    let kib = |kb: u64| kb as f64;
    row.put("rss_start_mb", kib(rss_start) / 1024.0);
    row.put("rss_devices_mb", kib(rss_devices) / 1024.0);
    row.put("rss_sockets_mb", kib(rss_sockets) / 1024.0);
    row.put("bytes_per_device", kib(rss_devices.saturating_sub(rss_start)) * 1024.0 / devices as f64);
    row.put("kib_per_socket", if sockets > 0 { kib(rss_sockets.saturating_sub(rss_devices)) / sockets as f64 } else { 0.0 });
    row.put("server_sockets", server_sockets);
    row.put("store_mb", store_all as f64 / 1048576.0);
    row.put("store_bytes_per_device", store_all as f64 / devices as f64);
    row.put("snap_bytes_per_device", store_snap as f64 / devices as f64);
    row.put("fill_msg_s", fill_sent as f64 / fill_secs);
    row.put("setup_s", setup_secs);
    row.put("connect_s", connect_secs);
    memory.row(row);

    let mut out = vec![memory, fan];
    if args.no_kill {
        return Ok(out);
    }
    match kill_and_restart(global, args, &endpoint, &mut instances, &live, &by_instance[0], max_rate * args.low).await {
        Ok(r) => out.push(r),
        Err(e) => {
            // What was measured before stays reported.
            eprintln!("hubcast-load fleet: the kill -9 and restart failed: {e}");
            let mut r = Results::new("fleet: kill -9 and restart (seconds after the kill)");
            r.param("error", e.to_string());
            out.push(r);
        }
    }
    live.stop.store(true, Ordering::Relaxed);
    tasks.abort_all();
    drop(redis);
    Ok(out)
}

/// `kill -9` of instance 0 under the fleet at `rate`, and its restart on its data dir and port.
async fn kill_and_restart(
    global: &Global,
    args: &ScaleArgs,
    endpoint: &amqp::Endpoint,
    instances: &mut [Instance],
    live: &Arc<Live>,
    victims: &[usize],
    rate: f64,
) -> io::Result<Results> {
    let stats = Arc::new(FleetStats::default());
    endpoint.set_run(stats.clone(), rate.max(1.0));
    stats.run();
    sleep(Duration::from_secs(2)).await;
    let timeline_live = live.clone();
    let timeline_stop = Arc::new(AtomicBool::new(false));
    let stop = timeline_stop.clone();
    let timeline = tokio::spawn(async move {
        // (µs since the epoch, deliveries/s since the previous point), measured over the real
        // interval: on a loaded machine a 500 ms sleep may last longer.
        let mut points = Vec::new();
        let (mut last, mut last_at) = (timeline_live.delivered.load(Ordering::Relaxed), now_micros());
        while !stop.load(Ordering::Relaxed) && points.len() < 400 {
            sleep(Duration::from_millis(500)).await;
            let (now, at) = (timeline_live.delivered.load(Ordering::Relaxed), now_micros());
            points.push((at, (now - last) as f64 * 1e6 / at.saturating_sub(last_at).max(1) as f64));
            (last, last_at) = (now, at);
        }
        points
    });
    // Per instance: its sockets' deliveries and its own counters, every 500 ms (each scrape
    // given 400 ms: an instance slow to answer shows as `-`).
    let probe_live = live.clone();
    let probe_stop = timeline_stop.clone();
    let targets: Vec<(SocketAddr, String)> = instances.iter().map(|i| (i.target.addr, i.target.admin_key.clone())).collect();
    let probe = tokio::spawn(async move {
        let mut points: Vec<(u64, Vec<u64>, Vec<Sample>)> = Vec::new();
        while !probe_stop.load(Ordering::Relaxed) && points.len() < 400 {
            let at = now_micros();
            let delivered = probe_live.by_instance.iter().map(|d| d.load(Ordering::Relaxed)).collect();
            let scrapes: Vec<_> = targets.iter().cloned().map(|(addr, key)| tokio::spawn(async move { sample(addr, &key).await })).collect();
            let mut samples = Vec::new();
            for s in scrapes {
                samples.push(s.await.unwrap_or(None));
            }
            points.push((at, delivered, samples));
            sleep(Duration::from_millis(500).saturating_sub(Duration::from_micros(now_micros().saturating_sub(at)))).await;
        }
        points
    });
    sleep(Duration::from_secs(2)).await;
    let kill_at = now_micros();
    let t = Instant::now();
    live.kill_at.store(kill_at, Ordering::Relaxed);
    instances[0].target.kill_hard()?;
    let killed_ms = t.elapsed().as_secs_f64() * 1000.0;
    if let Some(dir) = &args.logs {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("i0-killed.log"), instances[0].target.log_lines().join("\n"))?;
    }
    let restarted = spawn(global, &instances[0].args).await?;
    let listening = t.elapsed().as_secs_f64();
    instances[0].target = restarted;
    let ready = until_ready(&instances[0].target, Duration::from_secs(120)).await?;
    let ready = listening + ready.as_secs_f64();
    let deadline = Instant::now() + secs(args.recovery_timeout);
    let back = loop {
        let back = victims.iter().filter(|&&s| live.back_at[s].load(Ordering::Relaxed) != 0).count();
        if back == victims.len() || Instant::now() > deadline {
            break back;
        }
        sleep(Duration::from_millis(20)).await;
    };
    sleep(Duration::from_secs(2)).await;
    stats.stop();
    let mut times: Vec<f64> = victims
        .iter()
        .filter_map(|&s| match live.back_at[s].load(Ordering::Relaxed) {
            0 => None,
            at => Some(at.saturating_sub(kill_at) as f64 / 1e6),
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let q = |f: f64| if times.is_empty() { f64::NAN } else { times[((times.len() as f64 * f).ceil() as usize).clamp(1, times.len()) - 1] };
    timeline_stop.store(true, Ordering::Relaxed);
    let points = timeline.await.unwrap_or_default();
    let probed = probe.await.unwrap_or_default();
    if let Some(dir) = &args.logs {
        for (i, instance) in instances.iter().enumerate() {
            std::fs::write(dir.join(format!("i{i}.log")), instance.target.log_lines().join("\n"))?;
        }
    }
    let mut kill = Results::new("fleet: kill -9 and restart (seconds after the kill)");
    kill.param("instance_killed", 0)
        .param("fleet_msg_s", rate)
        .param(
            "delivered_per_s_timeline",
            json!(points
                .iter()
                .map(|&(at, rate)| format!("{:+.1}s:{:.0}", (at as f64 - kill_at as f64) / 1e6, rate))
                .collect::<Vec<_>>()
                .join(" ")),
        );
    for i in 0..instances.len() {
        kill.param(&format!("i{i}_timeline"), json!(instance_timeline(&probed, i, kill_at)));
    }
    let mut row = Row::default();
    row.put("kill_ms", killed_ms);
    row.put("listening_s", listening);
    row.put("status_200_s", ready);
    row.put("sockets", victims.len());
    row.put("back", back);
    row.put("first_s", q(0.0));
    row.put("p50_s", q(0.5));
    row.put("p99_s", q(0.99));
    row.put("all_s", if back == victims.len() { q(1.0) } else { f64::NAN });
    row.put("reconnects", live.reconnects.load(Ordering::Relaxed));
    kill.row(row);
    Ok(kill)
}
