//! `peer`: `fanout`'s shapes driven against another broker over its WebSocket listener, for
//! issue 25's side-by-side table: NATS ([`nats`], its text protocol) or Mosquitto ([`mqtt`],
//! MQTT 3.1.1 at QoS 0 in binary frames). The broker is started here ([`broker`]), pinned as
//! `--pin` pins hubcast.
//!
//! The same clients and fleet as `fanout`, in the broker's terms:
//! - C subscriber connections, client `c` subscribed to the S devices `devices_of(c, S, D)`
//!   (a subject / topic per device), each reading, counting and timing what arrives;
//! - P publisher connections sharing the rate (or as fast as the broker takes it), each
//!   sending a batch of B messages (devices round-robin, as the HTTP fleet picks them) in one
//!   WebSocket frame with a `PING` / `PINGREQ` behind it, and keeping at most `--pipeline`
//!   batches unanswered: the broker's `PONG` / `PINGRESP` comes once it has handled the batch,
//!   as hubcast's answer to a `POST /ingest` does;
//! - each message is the envelope a hubcast client receives for the same telemetry
//!   (`{"deviceId","timestamp","telemetry":{"sentAt",…}}`), `sentAt` stamped once per batch
//!   just before it is written, exactly as the HTTP fleet stamps a batch of 64, so that the
//!   latency (arrival − `sentAt`) counts the same thing on both sides.
//!
//! The row has `fanout`'s keys (`ingest_msg_s` is what the broker answered for, `server_cpu`
//! its CPU from `/proc/<pid>/stat`), `delivered_pct` (a broker that drops, as Mosquitto's queue
//! limits do, shows it there), and the whole step's `sent_total` and `delivered_total`.

pub mod broker;
pub mod mqtt;
pub mod nats;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::{sleep, Instant};

use crate::cli::{Global, PeerArgs};
use crate::clients::{devices_of, LiveStats, Tally};
use crate::fleet::{device_id, now_micros, FleetStats, Pacer};
use crate::hist::Histogram;
use crate::report::{Results, Row};
use crate::target::ProcSample;
use crate::ws::{push_client_frame, WsClient, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG, OP_TEXT};
use broker::Broker;

/// Which broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Peer {
    /// nats-server's WebSocket listener (`websocket { no_tls: true }`), the NATS text protocol.
    Nats,
    /// mosquitto's `protocol websockets` listener, MQTT 3.1.1, QoS 0.
    Mosquitto,
}

/// What a parser found in the stream from the broker.
#[derive(Debug)]
pub enum Event<'a> {
    /// A delivered message's payload.
    Message(&'a [u8]),
    /// NATS `PONG`; MQTT `CONNACK` (accepted), `SUBACK`, `PINGRESP`.
    Ack,
    /// NATS `PING` (answered with `PONG`).
    Ping,
    /// NATS `-ERR`; MQTT a refused connection or subscription.
    Error(String),
}

impl Peer {
    pub fn name(self) -> &'static str {
        match self {
            Peer::Nats => "nats",
            Peer::Mosquitto => "mosquitto",
        }
    }

    /// The Debian binary (`apt-get install nats-server mosquitto`).
    pub fn default_bin(self) -> &'static str {
        match self {
            Peer::Nats => "/usr/sbin/nats-server",
            Peer::Mosquitto => "/usr/sbin/mosquitto",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Peer::Nats => "/",
            Peer::Mosquitto => "/mqtt",
        }
    }

    fn subprotocol(self) -> Option<&'static str> {
        match self {
            Peer::Nats => None,
            Peer::Mosquitto => Some("mqtt"),
        }
    }

    fn topic(self, device: &str) -> String {
        match self {
            Peer::Nats => nats::subject(device),
            Peer::Mosquitto => mqtt::topic(device),
        }
    }

    fn hello(self, out: &mut Vec<u8>, name: &str) {
        match self {
            Peer::Nats => nats::hello(out, name),
            Peer::Mosquitto => mqtt::hello(out, name),
        }
    }

    fn subscribe<'a>(self, out: &mut Vec<u8>, topics: impl Iterator<Item = &'a str>) {
        match self {
            Peer::Nats => nats::subscribe(out, topics),
            Peer::Mosquitto => mqtt::subscribe(out, topics),
        }
    }

    fn publish(self, out: &mut Vec<u8>, topic: &str, payload: &[u8]) {
        match self {
            Peer::Nats => nats::publish(out, topic, payload),
            Peer::Mosquitto => mqtt::publish(out, topic, payload),
        }
    }

    fn ping(self, out: &mut Vec<u8>) {
        match self {
            Peer::Nats => nats::ping(out),
            Peer::Mosquitto => mqtt::ping(out),
        }
    }

    fn parse(self, buf: &[u8], f: impl FnMut(Event<'_>)) -> io::Result<usize> {
        match self {
            Peer::Nats => nats::parse(buf, f),
            Peer::Mosquitto => mqtt::parse(buf, f),
        }
    }
}

/// One connection to the broker: the WebSocket and the protocol bytes not parsed yet (a
/// message split across frames).
struct Conn<S> {
    peer: Peer,
    ws: WsClient<S>,
    pending: Vec<u8>,
    /// WebSocket pings to answer (payloads).
    pings: Vec<Vec<u8>>,
}

impl<S: AsyncRead + Unpin> Conn<S> {
    /// Reads once (every whole frame buffered, or one read) and hands each protocol event to
    /// `f`; `Ok(false)` when the broker closed. The answers to NATS `PING`s are appended to
    /// `replies`, WebSocket pings kept in `pings`.
    async fn read(&mut self, replies: &mut Vec<u8>, mut f: impl FnMut(Event<'_>)) -> io::Result<bool> {
        let peer = self.peer;
        let pending = &mut self.pending;
        let pings = &mut self.pings;
        let mut closed = false;
        let mut failed = None;
        let open = self
            .ws
            .read_frames(|op, payload| match op {
                OP_BINARY | OP_TEXT | 0 if failed.is_none() => {
                    let mut on = |e: Event<'_>| match e {
                        Event::Ping => nats::pong(replies),
                        other => f(other),
                    };
                    // Parsed in place when nothing is left over from the previous frame.
                    let result = if pending.is_empty() {
                        peer.parse(payload, &mut on).map(|used| pending.extend_from_slice(&payload[used..]))
                    } else {
                        pending.extend_from_slice(payload);
                        peer.parse(pending, &mut on).map(|used| {
                            pending.drain(..used);
                        })
                    };
                    if let Err(e) = result {
                        failed = Some(e);
                    }
                }
                OP_PING => pings.push(payload.to_vec()),
                OP_CLOSE => closed = true,
                _ => {}
            })
            .await?;
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(open && !closed)
    }

    /// Reads until an [`Event::Ack`] (within 20 s); messages before it are not counted.
    async fn wait_ack(&mut self) -> io::Result<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut replies = Vec::new();
        loop {
            let mut acked = false;
            let mut error = None;
            let read = tokio::time::timeout_at(deadline, self.read(&mut replies, |e| match e {
                Event::Ack => acked = true,
                Event::Error(e) => error = Some(e),
                _ => {}
            }))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer from the broker within 20 s"))??;
            if let Some(e) = error {
                return Err(io::Error::other(e));
            }
            if acked {
                return Ok(replies);
            }
            if !read {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the broker closed the connection"));
            }
        }
    }
}

impl Conn<tokio::net::TcpStream> {
    /// Connects, upgrades and says hello (`CONNECT`); returns once the broker acknowledged it.
    async fn open(peer: Peer, addr: SocketAddr, name: &str, buffer: usize) -> io::Result<Self> {
        let ws = WsClient::connect_with(addr, peer.path(), buffer, peer.subprotocol()).await?;
        let mut conn = Conn { peer, ws, pending: Vec::new(), pings: Vec::new() };
        let mut hello = Vec::new();
        peer.hello(&mut hello, name);
        conn.ws.send(OP_BINARY, &hello).await?;
        conn.wait_ack().await?;
        Ok(conn)
    }
}

// ---- the mode ----------------------------------------------------------------------------------

pub async fn fanout(global: &Global, args: &PeerArgs) -> io::Result<Results> {
    let peer = args.peer;
    let bin = args.peer_bin.clone().unwrap_or_else(|| peer.default_bin().to_string());
    let cpus = global.pinning()?.map(|p| p.hubcast);
    let broker = tokio::task::spawn_blocking(move || Broker::spawn(peer, &bin, cpus)).await.map_err(io::Error::other)??;
    let devices = args.devices.max(1);
    let topics: Arc<Vec<String>> = Arc::new((0..devices).map(|d| peer.topic(&device_id(d))).collect());

    let live = Arc::new(LiveStats::default());
    let mut sockets = JoinSet::new();
    let connect_time = connect_subscribers(&broker, args, &topics, &live, &mut sockets).await;
    let connected = live.connected.load(Ordering::Relaxed);
    if connected < args.clients as u64 {
        return Err(io::Error::other(format!(
            "{} of {} subscribers connected to {}\n{}",
            connected,
            args.clients,
            peer.name(),
            broker.log_tail()
        )));
    }
    let mut per_device = vec![0u64; devices];
    for c in 0..args.clients {
        for d in devices_of(c, args.subs, devices) {
            per_device[d] += 1;
        }
    }
    let fanout_factor = per_device.iter().sum::<u64>() as f64 / devices as f64;

    let mut results = Results::new(&format!("peer fanout ({})", peer.name()));
    results
        .param("peer", peer.name())
        .param("version", broker.version.as_str())
        .param("clients", args.clients)
        .param("connected", connected)
        .param("subs_per_client", args.subs)
        .param("devices", devices)
        .param("subscribers_per_device", fanout_factor)
        .param("batch", args.batch)
        .param("fleet_conns", args.fleet_conns)
        .param("pipeline", args.pipeline)
        .param("connect_s", connect_time.as_secs_f64());
    if let Some(cpus) = crate::target::cpus_allowed(broker.pid) {
        results.param("server_cpus", cpus);
    }
    for &rate in &args.rate {
        let row = step(global, args, &broker, &topics, rate, &live, fanout_factor).await?;
        results.row(row);
    }
    sockets.abort_all();
    Ok(results)
}

/// Opens the C subscribers and waits until each is subscribed (or failed).
async fn connect_subscribers(broker: &Broker, args: &PeerArgs, topics: &Arc<Vec<String>>, live: &Arc<LiveStats>, tasks: &mut JoinSet<()>) -> Duration {
    let started = Instant::now();
    let gate = Arc::new(Semaphore::new(args.connect_concurrency.max(1)));
    let (peer, addr, subs, devices) = (args.peer, broker.ws, args.subs, args.devices.max(1));
    for c in 0..args.clients {
        let (gate, live, topics) = (gate.clone(), live.clone(), topics.clone());
        tasks.spawn(async move {
            let subscribed = {
                let _permit = gate.acquire().await;
                async {
                    let mut conn = Conn::open(peer, addr, &format!("sub-{c}"), 16 * 1024).await?;
                    let mut out = Vec::new();
                    peer.subscribe(&mut out, devices_of(c, subs, devices).map(|d| topics[d].as_str()));
                    conn.ws.send(OP_BINARY, &out).await?;
                    conn.wait_ack().await?;
                    Ok::<_, io::Error>(conn)
                }
                .await
            };
            match subscribed {
                Ok(conn) => {
                    live.connected.fetch_add(1, Ordering::Relaxed);
                    subscriber(conn, c, &live).await;
                    live.closed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    if live.connect_failures.fetch_add(1, Ordering::Relaxed) < 3 {
                        eprintln!("hubcast-load: subscriber {c} did not subscribe: {e}");
                    }
                }
            }
        });
    }
    let want = args.clients as u64;
    while live.connected.load(Ordering::Relaxed) + live.connect_failures.load(Ordering::Relaxed) < want {
        sleep(Duration::from_millis(5)).await;
    }
    started.elapsed()
}

/// Reads one subscriber until it closes: counts messages and records `arrival − sentAt`
/// (the arrival time taken once per read, as `fanout`'s readers do).
async fn subscriber(mut conn: Conn<tokio::net::TcpStream>, index: usize, stats: &LiveStats) {
    let mut tally = Tally::new();
    let mut replies = Vec::new();
    loop {
        let read = conn
            .read(&mut replies, |e| {
                if let Event::Message(payload) = e {
                    tally.message(stats, payload);
                }
            })
            .await;
        tally.record(stats, index);
        if !replies.is_empty() && conn.ws.send(OP_BINARY, &replies).await.is_err() {
            return;
        }
        replies.clear();
        for p in std::mem::take(&mut conn.pings) {
            if conn.ws.send(OP_PONG, &p).await.is_err() {
                return;
            }
        }
        match read {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                eprintln!("hubcast-load: subscriber {index}: {e}");
                return;
            }
        }
    }
}

/// The envelope a hubcast client receives for message `seq` (`timestamp` the send time).
fn write_envelope(out: &mut Vec<u8>, device: &str, timestamp: &str, sent_at: u64, seq: u64) {
    out.extend_from_slice(b"{\"deviceId\":\"");
    out.extend_from_slice(device.as_bytes());
    out.extend_from_slice(b"\",\"timestamp\":\"");
    out.extend_from_slice(timestamp.as_bytes());
    out.extend_from_slice(b"\",\"telemetry\":");
    crate::fleet::write_body(out, sent_at, seq);
    out.push(b'}');
}

/// `2026-11-28T08:40:00.123Z` of a time in µs since the epoch.
fn iso_millis(micros: u64) -> String {
    let secs = micros / 1_000_000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let ms = (micros / 1000) % 1000;
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// Starts the P publishers; they wait for `stats.run()` and end at `stats.stop()`.
async fn start_publishers(broker: &Broker, args: &PeerArgs, topics: &Arc<Vec<String>>, rate: f64, stats: &Arc<FleetStats>, tasks: &mut JoinSet<()>) -> io::Result<()> {
    let conns = args.fleet_conns.max(1);
    let ids: Arc<Vec<String>> = Arc::new((0..args.devices.max(1)).map(device_id).collect());
    for k in 0..conns {
        let conn = Conn::open(args.peer, broker.ws, &format!("pub-{k}"), 4096).await?;
        let (peer, batch, depth) = (args.peer, args.batch.max(1), args.pipeline.max(1));
        let (stats, ids, topics) = (stats.clone(), ids.clone(), topics.clone());
        let share = rate / conns as f64;
        let offset = k as f64 / conns as f64;
        tasks.spawn(async move {
            if !stats.started().await {
                return;
            }
            let (read, mut write) = conn.ws.split();
            let mut reader = Conn { peer, ws: read, pending: conn.pending, pings: Vec::new() };
            let permits = Arc::new(Semaphore::new(depth));
            let answers = {
                let (permits, stats) = (permits.clone(), stats.clone());
                async move {
                    let mut replies = Vec::new();
                    loop {
                        let mut acks = 0;
                        match reader.read(&mut replies, |e| match e {
                            Event::Ack => acks += 1,
                            Event::Error(e) => {
                                if stats.errors.fetch_add(1, Ordering::Relaxed) < 3 {
                                    eprintln!("hubcast-load: publisher {k}: {e}");
                                }
                            }
                            _ => {}
                        })
                        .await
                        {
                            Ok(true) => {}
                            _ => return,
                        }
                        stats.accepted.fetch_add(acks * batch as u64, Ordering::Relaxed);
                        permits.add_permits(acks as usize);
                        // A server's PING during a run (NATS: every 2 minutes) is not answered
                        // from here (the sender owns the write half): runs are shorter than
                        // the two PINGs NATS lets go unanswered.
                        replies.clear();
                        reader.pings.clear();
                    }
                }
            };
            let sender = async move {
                let mut pacer = Pacer::new(share, batch, offset);
                let (mut body, mut frame, mut envelope) = (Vec::new(), Vec::new(), Vec::with_capacity(192));
                while !stats.stopped() {
                    pacer.wait().await;
                    let Ok(permit) = permits.acquire().await else { return };
                    permit.forget();
                    if stats.stopped() {
                        break;
                    }
                    // One send time for the whole batch, taken as it is built and written, as
                    // the HTTP fleet stamps a POST /ingest batch.
                    let sent_at = now_micros();
                    let timestamp = iso_millis(sent_at);
                    let first = stats.take(batch);
                    body.clear();
                    for seq in first..first + batch as u64 {
                        let d = (seq % ids.len() as u64) as usize;
                        envelope.clear();
                        write_envelope(&mut envelope, &ids[d], &timestamp, sent_at, seq);
                        peer.publish(&mut body, &topics[d], &envelope);
                    }
                    peer.ping(&mut body);
                    frame.clear();
                    push_client_frame(&mut frame, OP_BINARY, &body);
                    stats.sent.fetch_add(batch as u64, Ordering::Relaxed);
                    if let Err(e) = write.write_all(&frame).await {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        eprintln!("hubcast-load: publisher {k}: {e}");
                        return;
                    }
                }
            };
            tokio::select! {
                _ = answers => {}
                _ = sender => {}
            }
        });
    }
    Ok(())
}

/// One rate against the subscribers: `fanout_step`'s window and keys.
async fn step(global: &Global, args: &PeerArgs, broker: &Broker, topics: &Arc<Vec<String>>, rate: f64, live: &Arc<LiveStats>, fanout_factor: f64) -> io::Result<Row> {
    let stats = Arc::new(FleetStats::default());
    let mut tasks = JoinSet::new();
    start_publishers(broker, args, topics, rate, &stats, &mut tasks).await?;
    let closed_before = live.closed.load(Ordering::Relaxed);
    let delivered_before = live.delivered.load(Ordering::Relaxed);
    stats.run();
    sleep(Duration::from_secs_f64(global.warmup.max(0.0))).await;
    live.latency.reset();
    live.measuring.store(true, Ordering::Relaxed);
    let sample = || (Instant::now(), ProcSample::of(broker.pid), ProcSample::this_process(), stats.sent.load(Ordering::Relaxed), stats.accepted.load(Ordering::Relaxed), live.delivered.load(Ordering::Relaxed));
    let a = sample();
    sleep(Duration::from_secs_f64(global.duration.max(0.0))).await;
    let b = sample();
    live.measuring.store(false, Ordering::Relaxed);
    stats.stop();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !tasks.is_empty() {
        if tokio::time::timeout_at(deadline, tasks.join_next()).await.is_err() {
            tasks.abort_all();
            break;
        }
    }
    // Whole run: every message written should reach its subscribers (unless the broker
    // dropped it); wait (up to 2 s) until they did. Written, not answered: the answers to the
    // last batches are not read once the publishers stop.
    let want = stats.sent.load(Ordering::Relaxed) as f64 * fanout_factor;
    let drained = Instant::now() + Duration::from_secs(2);
    while ((live.delivered.load(Ordering::Relaxed) - delivered_before) as f64) < want && Instant::now() < drained {
        sleep(Duration::from_millis(10)).await;
    }
    let latency: Histogram = live.latency.merged();

    let secs = b.0.duration_since(a.0).as_secs_f64();
    let per_s = |x: u64, y: u64| (y - x) as f64 / secs;
    let mut row = Row::default();
    row.put("rate", if rate > 0.0 { rate.into() } else { serde_json::Value::from("max") });
    let ingested = per_s(a.4, b.4);
    row.put("ingest_msg_s", ingested);
    row.put("sent_msg_s", per_s(a.3, b.3));
    row.put("fleet_errors", stats.errors.load(Ordering::Relaxed));
    if let (Some(x), Some(y)) = (a.1, b.1) {
        row.put("server_cpu", x.cores_used(&y));
        row.put("server_rss_mb", y.rss_kb as f64 / 1024.0);
        row.put("server_runq_ms_s", x.run_queue_ms_per_s(&y));
    }
    if let (Some(x), Some(y)) = (a.2, b.2) {
        row.put("harness_cpu", x.cores_used(&y));
        row.put("harness_runq_ms_s", x.run_queue_ms_per_s(&y));
    }
    let delivered = per_s(a.5, b.5);
    row.put("expected_msg_s", ingested * fanout_factor);
    row.put("delivered_msg_s", delivered);
    row.put("delivered_pct", if ingested > 0.0 { 100.0 * delivered / (ingested * fanout_factor) } else { 0.0 });
    row.put("sent_total", stats.sent.load(Ordering::Relaxed));
    row.put("delivered_total", live.delivered.load(Ordering::Relaxed) - delivered_before);
    crate::modes::put_client_side(&mut row, &latency, delivered, live.closed.load(Ordering::Relaxed) - closed_before);
    sleep(Duration::from_millis(300)).await;
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_envelope_is_what_a_hubcast_client_receives() {
        assert_eq!(iso_millis(1_795_854_000_123_456), "2026-11-28T08:20:00.123Z");
        assert_eq!(iso_millis(951_782_400_000_000), "2000-02-29T00:00:00.000Z");
        let mut out = Vec::new();
        write_envelope(&mut out, "dev-000001", "2026-11-28T08:20:00.123Z", 1_795_854_000_123_456, 7);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["deviceId"], "dev-000001");
        assert_eq!(v["telemetry"]["sentAt"], 1_795_854_000_123_456u64);
        assert_eq!(crate::ws::sent_at(&out), Some(1_795_854_000_123_456));
    }
}
