//! Live clients as a front end would be: a session each (`POST /session`), grants forwarded
//! with the admin key (`PUT /grants`), subscriptions (`PUT /subscriptions`, in bulk), then
//! one socket per session, plain WebSocket or Socket.IO. Each socket has one reader task that
//! counts the data messages and records their latency from the `sentAt` in the telemetry.
//!
//! Set-up requests go over a few keep-alive connections in parallel ([`run_requests`]);
//! sockets connect with a bounded number of handshakes in flight, which is also how the
//! connect rate is measured.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::fleet::{device_id, now_micros};
use crate::hist::Striped;
use crate::http::{request_bytes, HttpConn, Response};
use crate::ws::{batched, sent_at, Transport, WsClient, OP_CLOSE, OP_PING, OP_PONG, OP_TEXT};

/// Sends every request over `conns` keep-alive connections; answers in request order.
pub async fn run_requests(addr: SocketAddr, requests: Vec<Vec<u8>>, conns: usize) -> io::Result<Vec<Response>> {
    let n = requests.len();
    let conns = conns.clamp(1, n.max(1));
    let requests = Arc::new(requests);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..conns {
        let requests = requests.clone();
        let next = next.clone();
        tasks.spawn(async move {
            let mut conn = HttpConn::new(addr);
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                if i >= requests.len() {
                    return Ok::<_, io::Error>(out);
                }
                let mut tries = 0;
                let response = loop {
                    match conn.send(&requests[i]).await {
                        Ok(r) => break r,
                        Err(e) if tries < 3 => {
                            tries += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            let _ = e;
                        }
                        Err(e) => return Err(e),
                    }
                };
                out.push((i, response));
            }
        });
    }
    let mut all: Vec<Option<Response>> = (0..n).map(|_| None).collect();
    while let Some(done) = tasks.join_next().await {
        for (i, r) in done.map_err(io::Error::other)?? {
            all[i] = Some(r);
        }
    }
    Ok(all.into_iter().map(|r| r.expect("every request answered")).collect())
}

/// Opens `n` sessions; returns their ids.
pub async fn open_sessions(addr: SocketAddr, n: usize, conns: usize) -> io::Result<Vec<String>> {
    let request = request_bytes("POST", "/session", &[], b"");
    let answers = run_requests(addr, vec![request; n], conns).await?;
    answers
        .iter()
        .map(|r| {
            if r.status != 200 {
                return Err(io::Error::other(format!("POST /session answered {}: {}", r.status, r.text())));
            }
            r.json()?["sessionId"].as_str().map(str::to_string).ok_or_else(|| io::Error::other("no sessionId"))
        })
        .collect()
}

/// The devices client `c` subscribes to: `per_client` consecutive ones, spread evenly.
pub fn devices_of(c: usize, per_client: usize, devices: usize) -> impl Iterator<Item = usize> {
    (0..per_client).map(move |j| (c * per_client + j) % devices.max(1))
}

/// Grants every session a wildcard telemetry grant on its devices and subscribes it to them.
pub async fn grant_and_subscribe(
    addr: SocketAddr,
    admin_key: &str,
    sessions: &[String],
    per_client: usize,
    devices: usize,
    conns: usize,
) -> io::Result<()> {
    let mut grants = Vec::new();
    let mut subscriptions = Vec::new();
    for (c, session) in sessions.iter().enumerate() {
        for d in devices_of(c, per_client, devices) {
            let body = json!({"sessionId": session, "deviceId": device_id(d), "type": "telemetry", "telemetryKey": null});
            grants.push(request_bytes(
                "PUT",
                "/grants",
                &[("shared-access-key", admin_key), ("content-type", "application/json")],
                body.to_string().as_bytes(),
            ));
            subscriptions.push(body);
        }
    }
    for r in run_requests(addr, grants, conns).await? {
        if r.status != 204 {
            return Err(io::Error::other(format!("PUT /grants answered {}: {}", r.status, r.text())));
        }
    }
    let bulk: Vec<Vec<u8>> = subscriptions
        .chunks(500)
        .map(|chunk| {
            request_bytes("PUT", "/subscriptions", &[("content-type", "application/json")], serde_json::to_vec(chunk).unwrap().as_slice())
        })
        .collect();
    for r in run_requests(addr, bulk, conns).await? {
        if r.status != 200 {
            return Err(io::Error::other(format!("PUT /subscriptions answered {}: {}", r.status, r.text())));
        }
    }
    Ok(())
}

/// What the sockets saw, shared by their reader tasks.
pub struct LiveStats {
    /// Data messages received (whole run).
    pub delivered: AtomicU64,
    /// Latencies are recorded only while set (the measurement window).
    pub measuring: AtomicBool,
    pub latency: Striped,
    /// Messages whose `sentAt` was missing.
    pub without_time: AtomicU64,
    pub connected: AtomicU64,
    pub connect_failures: AtomicU64,
    /// Sockets the server closed, or that failed, after they were connected.
    pub closed: AtomicU64,
}

impl Default for LiveStats {
    fn default() -> Self {
        Self {
            delivered: AtomicU64::new(0),
            measuring: AtomicBool::new(false),
            latency: Striped::new(16),
            without_time: AtomicU64::new(0),
            connected: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
            closed: AtomicU64::new(0),
        }
    }
}

/// How the sockets connect.
#[derive(Clone, Debug)]
pub struct SocketPlan {
    pub transport: Transport,
    /// Handshakes in flight at once.
    pub concurrency: usize,
    /// Initial read buffer per socket (grows for a larger read).
    pub buffer: usize,
}

/// Connects one socket per session and keeps reading; returns once every socket is connected
/// or failed, with the time that took. The reader tasks live in `tasks` until aborted.
pub async fn connect_sockets(
    addr: SocketAddr,
    sessions: &[String],
    plan: &SocketPlan,
    stats: Arc<LiveStats>,
    tasks: &mut JoinSet<()>,
) -> Duration {
    let started = Instant::now();
    let gate = Arc::new(Semaphore::new(plan.concurrency.max(1)));
    let target = stats.connected.load(Ordering::Relaxed) + stats.connect_failures.load(Ordering::Relaxed) + sessions.len() as u64;
    for (i, session) in sessions.iter().enumerate() {
        let path = plan.transport.path(session);
        let gate = gate.clone();
        let stats = stats.clone();
        let transport = plan.transport;
        let buffer = plan.buffer;
        tasks.spawn(async move {
            let socket = {
                let _permit = gate.acquire().await;
                let mut attempt = 0;
                loop {
                    let result = async {
                        let mut ws = WsClient::connect(addr, &path, buffer).await?;
                        if transport == Transport::Socketio {
                            ws.socketio_handshake().await?;
                        }
                        Ok::<_, io::Error>(ws)
                    }
                    .await;
                    match result {
                        Ok(ws) => break Some(ws),
                        Err(e) if attempt < 3 => {
                            attempt += 1;
                            let _ = e;
                            tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                        }
                        Err(e) => {
                            if stats.connect_failures.fetch_add(1, Ordering::Relaxed) < 3 {
                                eprintln!("hubcast-load: socket {i} did not connect: {e}");
                            }
                            break None;
                        }
                    }
                }
            };
            let Some(ws) = socket else { return };
            stats.connected.fetch_add(1, Ordering::Relaxed);
            read_loop(ws, transport, i, &stats).await;
            stats.closed.fetch_add(1, Ordering::Relaxed);
        });
    }
    while stats.connected.load(Ordering::Relaxed) + stats.connect_failures.load(Ordering::Relaxed) < target {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    started.elapsed()
}

/// What one read of a subscriber's socket took in (`fanout`'s readers and `peer`'s): data
/// messages counted and, in the measurement window, each one's `arrival − sentAt`, the
/// arrival time and whether the window is open both taken at the read's first message
/// (after the read returned), once per read.
pub struct Tally {
    count: u64,
    untimed: u64,
    now: u64,
    measuring: Option<bool>,
    latencies: Vec<u64>,
}

impl Tally {
    pub fn new() -> Self {
        Self { count: 0, untimed: 0, now: 0, measuring: None, latencies: Vec::with_capacity(64) }
    }

    /// Whether this read's messages are timed (the window was open at its first one).
    fn timing(&mut self, stats: &LiveStats) -> bool {
        let timing = *self.measuring.get_or_insert_with(|| stats.measuring.load(Ordering::Relaxed));
        if timing && self.now == 0 {
            self.now = now_micros();
        }
        timing
    }

    /// One data message, its `sentAt` read from `payload`.
    pub fn message(&mut self, stats: &LiveStats, payload: &[u8]) {
        self.count += 1;
        if self.timing(stats) {
            match sent_at(payload) {
                Some(t) => self.latencies.push(self.now.saturating_sub(t)),
                None => self.untimed += 1,
            }
        }
    }

    /// The read is over: what it took in goes to `stats` (subscriber `index`'s stripe), and
    /// the next read starts afresh.
    pub fn record(&mut self, stats: &LiveStats, index: usize) {
        if self.count > 0 {
            stats.delivered.fetch_add(self.count, Ordering::Relaxed);
        }
        if self.untimed > 0 {
            stats.without_time.fetch_add(self.untimed, Ordering::Relaxed);
        }
        stats.latency.record_all(index, &self.latencies);
        self.latencies.clear();
        (self.count, self.untimed, self.now, self.measuring) = (0, 0, 0, None);
    }
}

/// Reads one socket until it closes: counts data messages, records latencies, answers pings.
async fn read_loop(mut ws: WsClient, transport: Transport, index: usize, stats: &LiveStats) {
    let mut tally = Tally::new();
    let mut replies: Vec<(u8, Vec<u8>)> = Vec::new();
    loop {
        let mut closed = false;
        let read = ws
            .read_frames(|op, payload| match op {
                OP_TEXT if transport == Transport::WsBatch => {
                    let timing = tally.timing(stats);
                    let mut timed = 0;
                    let now = tally.now;
                    let n = batched(payload, |t| {
                        if timing {
                            tally.latencies.push(now.saturating_sub(t));
                            timed += 1;
                        }
                    });
                    tally.count += n;
                    if timing {
                        tally.untimed += n.saturating_sub(timed);
                    }
                }
                OP_TEXT => {
                    let data = match transport {
                        Transport::Ws | Transport::WsBatch | Transport::WsOffsets => true,
                        Transport::Socketio => {
                            if payload == b"2" {
                                replies.push((OP_TEXT, b"3".to_vec()));
                            }
                            payload.starts_with(b"42[")
                        }
                    };
                    if data {
                        tally.message(stats, payload);
                    }
                }
                OP_PING => replies.push((OP_PONG, payload.to_vec())),
                OP_CLOSE => closed = true,
                _ => {}
            })
            .await;
        tally.record(stats, index);
        for (op, payload) in replies.drain(..) {
            if ws.send(op, &payload).await.is_err() {
                return;
            }
        }
        if closed || !matches!(read, Ok(true)) {
            return;
        }
    }
}
