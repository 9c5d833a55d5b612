//! Test support for the AMQP ingest tests: the real `hubcast` binary ([`Server`]) and a
//! local Event Hubs-like AMQP 1.0 endpoint ([`FakeHub`]) built on fe2o3-amqp's acceptor.
//!
//! The fake speaks what hubcast uses of Event Hubs and IoT Hub, on 127.0.0.1:0:
//! - SASL PLAIN (key name / key) or SASL ANONYMOUS + CBS `put-token` on `$cbs` (the SAS
//!   token is checked: signature with the raw key bytes, audience, expiry; a connection whose
//!   token expires without renewal is dropped);
//! - `$management` READ of `com.microsoft:eventhub` (partition ids) and
//!   `com.microsoft:partition` (last enqueued sequence number);
//! - partition links `<hub>/ConsumerGroups/<cg>/Partitions/<id>` honouring the selector
//!   filter (`x-opt-sequence-number`, `x-opt-offset` incl. `@latest` and `-1`,
//!   `x-opt-enqueued-time`) and link credit;
//! - messages carrying IoT Hub's annotations (or, for plain Event Hub input, properties);
//! - an IoT Hub mode that answers `messages/events` with `amqp:link:redirect` to another fake;
//! - switches to drop every connection (now, or after N more deliveries, or at the first
//!   `$management` read after a partition link attached) and to refuse connections for a while.

#![allow(dead_code)]

// The same file as `common::process`; a test crate that uses both harnesses loads it twice.
#[allow(clippy::duplicate_mod)]
#[path = "../common/process.rs"]
mod process;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::Shutdown;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use fe2o3_amqp::acceptor::sasl_acceptor::{SaslAcceptor, SaslServerFrame};
use fe2o3_amqp::acceptor::{ConnectionAcceptor, LinkAcceptor, LinkEndpoint, SessionAcceptor};
use fe2o3_amqp::types::definitions::{self, AmqpError, LinkError};
use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::{AmqpValue, ApplicationProperties, Body, Data, Message, MessageAnnotations, MessageId, Properties};
use fe2o3_amqp::types::primitives::{Array, Binary, OrderedMap, SimpleValue, Symbol, Timestamp, Value};
use fe2o3_amqp::types::sasl::{SaslCode, SaslInit, SaslOutcome, SaslResponse};
use fe2o3_amqp::{Receiver, Sendable, Sender};
use serde_json::Value as Json;

// ---- the hubcast binary ------------------------------------------------------------------------

pub const ADMIN_KEY: &str = "test-primary";
pub const ADMIN: (&str, &str) = ("Shared-Access-Key", ADMIN_KEY);
pub const BIN: &str = env!("CARGO_BIN_EXE_hubcast");

/// One running `hubcast` process (killed on drop).
pub struct Server {
    child: Child,
    pub base: String,
    stderr: Arc<Mutex<Vec<String>>>,
    agent: ureq::Agent,
    own_data_dir: Option<std::path::PathBuf>,
}

/// A fresh, not yet existing directory under the system temp dir.
pub fn fresh_data_dir() -> std::path::PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos();
    std::env::temp_dir().join(format!("hubcast-amqp-test-{}-{n}-{nanos}", std::process::id()))
}

impl Server {
    /// Starts the binary on 127.0.0.1:0 with 2 cores, the test admin key, and `args`.
    pub fn start(args: &[&str]) -> Server {
        let mut cmd = Command::new(BIN);
        cmd.args(["--bind", "127.0.0.1", "--port", "0", "--cores", "2", "--primary-admin-secret", ADMIN_KEY]);
        // Every hubcast gets a data dir of its own unless the test gives one (tests run in parallel).
        let own_data_dir = (!args.contains(&"--data-dir")).then(fresh_data_dir);
        if let Some(dir) = &own_data_dir {
            cmd.arg("--data-dir").arg(dir);
        }
        cmd.args(args);
        // Every setting comes from the arguments: hubcast reads its configuration from the
        // environment too (REDIS_URL, LOG_LEVEL, …), so the developer's must not reach it.
        cmd.env_clear();
        for keep in ["PATH", "HOME", "TMPDIR", "RUST_BACKTRACE"] {
            if let Some(value) = std::env::var_os(keep) {
                cmd.env(keep, value);
            }
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {BIN}: {e}"));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        {
            let pipe = child.stderr.take().unwrap();
            let lines = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    let mut all = lines.lock().unwrap();
                    if all.len() < 200_000 {
                        all.push(line);
                    }
                }
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let pipe = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let base = loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        break rest.split_whitespace().next().unwrap().trim_end_matches('/').to_string();
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    panic!("hubcast did not start: {}", stderr.lock().unwrap().join("\n"));
                }
            }
        };
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(10)).build();
        Server { child, base, stderr, agent, own_data_dir }
    }

    /// `GET path` with the admin key: status and body.
    /// hubcast reading `hub` (`--log-level verbose`: some tests read its lines), once connected.
    pub fn reading(hub: &FakeHub, extra: &[&str]) -> Server {
        let cs = hub.connection_string();
        let mut args = vec!["--iot-hub-event-hub-connection-string", cs.as_str(), "--log-level", "verbose"];
        args.extend_from_slice(extra);
        let server = Server::start(&args);
        server.wait_connected();
        server
    }

    /// The batches handed to the cores, per partition: (count, first, last sequence number),
    /// from the `verbose` log lines `handed to the cores partition=P count=N first_seq=A last_seq=B`.
    pub fn handed_over(&self) -> std::collections::BTreeMap<String, Vec<(i64, i64, i64)>> {
        let mut out: std::collections::BTreeMap<String, Vec<(i64, i64, i64)>> = Default::default();
        for line in self.stderr_lines().iter().filter(|l| l.contains("handed to the cores")) {
            let field = |name: &str| -> Option<String> {
                let rest = line.split(&format!(" {name}=")).nth(1)?;
                Some(rest.split_whitespace().next()?.trim_matches('"').to_string())
            };
            let (Some(p), Some(n), Some(a), Some(b)) = (field("partition"), field("count"), field("first_seq"), field("last_seq")) else {
                continue;
            };
            out.entry(p).or_default().push((n.parse().unwrap(), a.parse().unwrap(), b.parse().unwrap()));
        }
        out
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        match self.agent.get(&format!("{}{path}", self.base)).set(ADMIN.0, ADMIN.1).call() {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => panic!("GET {path}: {e}"),
        }
    }

    pub fn get_json(&self, path: &str) -> (u16, Json) {
        let (status, body) = self.get(path);
        (status, serde_json::from_str(&body).unwrap_or(Json::String(body)))
    }

    /// Polls `GET path` until `done(status, body)` holds; panics after `within`.
    pub fn wait_for(&self, path: &str, within: Duration, done: impl Fn(u16, &str) -> bool) -> (u16, String) {
        let deadline = Instant::now() + within;
        loop {
            let (status, body) = self.get(path);
            if done(status, &body) {
                return (status, body);
            }
            if Instant::now() > deadline {
                panic!("GET {path} still answers {status} {body} after {within:?}\n--- hubcast log (tail) ---\n{}", self.log_tail(40));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Waits until `GET /status` answers 200 (every source connected).
    pub fn wait_connected(&self) {
        self.wait_for("/status", Duration::from_secs(10), |s, _| s == 200);
    }

    /// Stops (`SIGSTOP`, returning once every thread has stopped) or resumes (`SIGCONT`) the
    /// process: a gateway that takes nothing.
    pub fn freeze(&self, frozen: bool) {
        process::signal(&self.child, if frozen { libc::SIGSTOP } else { libc::SIGCONT });
    }

    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    pub fn log_tail(&self, n: usize) -> String {
        let lines = self.stderr_lines();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Waits until a log line contains `needle`.
    pub fn wait_for_log(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(line) = self.stderr_lines().into_iter().find(|l| l.contains(needle)) {
                return line;
            }
            if Instant::now() > deadline {
                panic!("no log line with {needle:?} after {within:?}\n{}", self.log_tail(40));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Server {
    /// Sends `signal` (e.g. `libc::SIGTERM`) to the process.
    pub fn signal(&self, signal: i32) {
        process::signal(&self.child, signal)
    }

    /// Waits up to `timeout` for the process to exit; its status, or `None` while it runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        process::wait_exit(&mut self.child, timeout)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.own_data_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

pub fn now_millis() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

// ---- the fake Event Hub ----------------------------------------------------------------------

/// A key that is valid base64 (IoT Hub decodes it; Event Hubs signs with its raw bytes).
pub const KEY: &str = "c2VjcmV0LWtleS0xMjM0NQ==";
pub const KEY_NAME: &str = "listen";
pub const ENTITY: &str = "fake-hub";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeAuth {
    /// SASL PLAIN with `KEY_NAME` / `KEY`.
    Plain,
    /// SASL ANONYMOUS, then a SAS token on `$cbs` before any partition or `$management` use.
    Cbs,
}

/// One event as the fake stores it.
#[derive(Clone, Debug)]
pub struct Event {
    pub sequence: i64,
    pub enqueued: i64,
    annotations: Vec<(String, Value)>,
    properties: Vec<(String, SimpleValue)>,
    body: Vec<u8>,
}

/// An event to publish.
#[derive(Clone, Debug)]
pub struct NewEvent {
    device: Option<String>,
    /// IoT Hub style: device id and source as annotations; else as application properties.
    iot_hub: bool,
    source: Option<String>,
    properties: Vec<(String, String)>,
    body: Vec<u8>,
    enqueued: Option<i64>,
    /// Sent without `x-opt-sequence-number` (a hub that omits it, or a relay that strips it).
    no_sequence: bool,
}

impl NewEvent {
    /// IoT Hub telemetry from `device` with a JSON body.
    pub fn telemetry(device: &str, body: Json) -> Self {
        Self {
            device: Some(device.into()),
            iot_hub: true,
            source: Some("Telemetry".into()),
            properties: vec![],
            body: body.to_string().into_bytes(),
            enqueued: None,
            no_sequence: false,
        }
    }

    /// An IoT Hub event of another source (`twinChangeEvents`…) with its `opType`.
    pub fn event(device: &str, source: &str, op_type: &str, body: Json) -> Self {
        Self::telemetry(device, body).source(source).prop("opType", op_type).prop("deviceId", device)
    }

    /// A plain Event Hub message: no IoT Hub annotations; the device id (if any) is given with
    /// [`NewEvent::prop`] or sits in the body.
    pub fn plain(body: &[u8]) -> Self {
        Self {
            device: None,
            iot_hub: false,
            source: None,
            properties: vec![],
            body: body.to_vec(),
            enqueued: None,
            no_sequence: false,
        }
    }

    pub fn source(mut self, source: &str) -> Self {
        self.source = Some(source.into());
        self
    }

    pub fn prop(mut self, key: &str, value: &str) -> Self {
        self.properties.push((key.into(), value.into()));
        self
    }

    pub fn raw_body(mut self, body: &[u8]) -> Self {
        self.body = body.to_vec();
        self
    }

    pub fn without_sequence_number(mut self) -> Self {
        self.no_sequence = true;
        self
    }

    pub fn enqueued_at(mut self, ms: i64) -> Self {
        self.enqueued = Some(ms);
        self
    }
}

/// What the fake saw, for assertions.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub connections: usize,
    pub put_tokens: usize,
    pub management_reads: usize,
    /// (link address, selector filter) of every partition link attached.
    pub partition_links: Vec<(String, String)>,
    pub redirects: usize,
    /// Connections dropped because their CBS token expired.
    pub expired: usize,
    /// Events sent on partition links (each needs a unit of link credit).
    pub deliveries: usize,
    /// Sends on partition links that could not go at once: the link had no credit left (or,
    /// rarely, fe2o3's session queue was full), so the fake waits for the peer's `flow`.
    pub sends_waiting: usize,
    /// Connections dropped (FIN) by [`FakeHub::drop_at_lag_read`], with when.
    pub lag_read_drops: Vec<Instant>,
    /// Partition links the client closed with a detach (closed=true) while idle.
    pub closed_links: usize,
    /// Connections refused (closed at once) while [`FakeHub::set_refusing`] was on.
    pub refused: usize,
    /// Connections the client ended with an AMQP `close` (answered), not by dropping the socket.
    pub closed_connections: usize,
}

struct State {
    partitions: Vec<String>,
    events: HashMap<String, Vec<Event>>,
    stats: Stats,
    /// Kill switches of the open connections.
    open: HashMap<u64, std::net::TcpStream>,
    refusing: bool,
    /// Drop every connection once this many more events were delivered.
    drop_after: Option<usize>,
    /// Every connection's auth record, for the token expiry watch.
    conns: HashMap<u64, std::sync::Weak<Conn>>,
    /// Misbehave like a broker that ignores the resume position: start every link at 0.
    replay: bool,
    /// Detach this many partition links with an error (the description given).
    detach_links: Option<(usize, String)>,
    /// Drop the connection, and refuse new ones, at the first partition READ on `$management`
    /// after a partition link attached (a lag measurement), leaving it unanswered.
    drop_at_lag_read: bool,
}

struct Inner {
    auth: FakeAuth,
    /// amqps: TLS first (Event Hubs' "alternative TLS establishment"), then AMQP.
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// IoT Hub mode: redirect `messages/events` to this (port, entity).
    redirect_to: Option<(u16, String)>,
    port: AtomicU64,
    state: Mutex<State>,
    changed: tokio::sync::Notify,
    next_conn: AtomicU64,
}

/// A local Event Hubs-like endpoint (see the module documentation).
pub struct FakeHub {
    pub port: u16,
    inner: Arc<Inner>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl FakeHub {
    /// An Event Hub named [`ENTITY`] with the given partitions.
    pub fn start(partitions: &[&str], auth: FakeAuth) -> FakeHub {
        Self::launch(partitions, auth, None, false)
    }

    /// Like [`FakeHub::start`], over TLS with a certificate for `localhost` issued by the test
    /// CA `tests/amqp_support/tls/ca.pem`.
    pub fn start_tls(partitions: &[&str], auth: FakeAuth) -> FakeHub {
        Self::launch(partitions, auth, None, true)
    }

    /// An IoT Hub front that redirects `messages/events` to `target`.
    pub fn start_iot_hub(target: &FakeHub) -> FakeHub {
        Self::launch(&[], FakeAuth::Plain, Some((target.port, ENTITY.to_string())), false)
    }

    fn launch(partitions: &[&str], auth: FakeAuth, redirect_to: Option<(u16, String)>, tls: bool) -> FakeHub {
        let inner = Arc::new(Inner {
            auth,
            tls: tls.then(tls_acceptor),
            redirect_to,
            port: AtomicU64::new(0),
            state: Mutex::new(State {
                partitions: partitions.iter().map(|p| p.to_string()).collect(),
                events: partitions.iter().map(|p| (p.to_string(), Vec::new())).collect(),
                stats: Stats::default(),
                open: HashMap::new(),
                refusing: false,
                drop_after: None,
                conns: HashMap::new(),
                replay: false,
                detach_links: None,
                drop_at_lag_read: false,
            }),
            changed: tokio::sync::Notify::new(),
            next_conn: AtomicU64::new(1),
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        inner.port.store(u64::from(port), Ordering::Relaxed);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let shared = inner.clone();
        std::thread::Builder::new()
            .name("fake-event-hub".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                    tokio::spawn(watch_token_expiry(shared.clone()));
                    let accept = async {
                        loop {
                            let Ok((tcp, _)) = listener.accept().await else { continue };
                            tokio::spawn(serve_connection(shared.clone(), tcp));
                        }
                    };
                    tokio::select! {
                        _ = accept => {}
                        _ = stop_rx => {}
                    }
                });
            })
            .unwrap();
        FakeHub { port, inner, stop: Some(stop_tx) }
    }

    /// `Endpoint=amqp://127.0.0.1:PORT;…;EntityPath=fake-hub`
    pub fn connection_string(&self) -> String {
        format!("Endpoint=amqp://127.0.0.1:{};SharedAccessKeyName={KEY_NAME};SharedAccessKey={KEY};EntityPath={ENTITY}", self.port)
    }

    /// `Endpoint=amqps://localhost:PORT;…` for a [`FakeHub::start_tls`] hub.
    pub fn tls_connection_string(&self) -> String {
        format!("Endpoint=amqps://localhost:{};SharedAccessKeyName={KEY_NAME};SharedAccessKey={KEY};EntityPath={ENTITY}", self.port)
    }

    /// `HostName=amqp://127.0.0.1:PORT;…` (the IoT Hub form).
    pub fn iot_hub_connection_string(&self) -> String {
        format!("HostName=amqp://127.0.0.1:{};SharedAccessKeyName={KEY_NAME};SharedAccessKey={KEY}", self.port)
    }

    /// Appends an event to a partition; returns its sequence number.
    pub fn publish(&self, partition: &str, event: NewEvent) -> i64 {
        let seq = {
            let mut state = self.inner.state.lock().unwrap();
            let events = state.events.get_mut(partition).unwrap_or_else(|| panic!("no partition {partition}"));
            let sequence = events.len() as i64;
            let enqueued = event.enqueued.unwrap_or_else(now_millis);
            let mut annotations = vec![
                ("x-opt-sequence-number".to_string(), Value::Long(sequence)),
                ("x-opt-offset".to_string(), Value::String((sequence * 100).to_string())),
                ("x-opt-enqueued-time".to_string(), Value::Timestamp(Timestamp::from_milliseconds(enqueued))),
            ];
            if event.no_sequence {
                annotations.remove(0);
            }
            let mut properties: Vec<(String, SimpleValue)> =
                event.properties.iter().map(|(k, v)| (k.clone(), SimpleValue::String(v.clone()))).collect();
            if event.iot_hub {
                annotations.push(("iothub-enqueuedtime".into(), Value::Timestamp(Timestamp::from_milliseconds(enqueued))));
                if let Some(d) = &event.device {
                    annotations.push(("iothub-connection-device-id".into(), Value::String(d.clone())));
                }
                if let Some(s) = &event.source {
                    annotations.push(("iothub-message-source".into(), Value::String(s.clone())));
                }
            } else if let Some(d) = &event.device {
                properties.push(("iothub-connection-device-id".into(), SimpleValue::String(d.clone())));
            }
            events.push(Event { sequence, enqueued, annotations, properties, body: event.body });
            sequence
        };
        self.inner.changed.notify_waiters();
        seq
    }

    pub fn stats(&self) -> Stats {
        self.inner.state.lock().unwrap().stats.clone()
    }

    /// Drops every open connection at once (both directions shut down).
    pub fn drop_connections(&self) {
        kill_all(&self.inner);
    }

    /// Drops every connection once `n` more events have been delivered.
    pub fn drop_after(&self, n: usize) {
        self.inner.state.lock().unwrap().drop_after = Some(n);
    }

    /// While set, new connections are closed right after the TCP accept.
    /// Waits until the stats satisfy `done`; panics with them after `within`.
    pub fn wait_for_stats(&self, within: Duration, done: impl Fn(&Stats) -> bool) -> Stats {
        let deadline = Instant::now() + within;
        loop {
            let stats = self.stats();
            if done(&stats) {
                return stats;
            }
            assert!(Instant::now() < deadline, "the fake hub's stats did not get there within {within:?}: {stats:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn set_refusing(&self, refusing: bool) {
        self.inner.state.lock().unwrap().refusing = refusing;
        if refusing {
            kill_all(&self.inner);
        }
    }

    /// While set, new connections are refused (closed at once); the open ones go on.
    pub fn refuse_new_connections(&self, refusing: bool) {
        self.inner.state.lock().unwrap().refusing = refusing;
    }

    /// Once set, the first `$management` partition READ on a connection with a partition link
    /// attached (hubcast's lag measurement, right after attach) is left unanswered, the
    /// connection is closed (FIN), and new connections are refused.
    pub fn drop_at_lag_read(&self) {
        self.inner.state.lock().unwrap().drop_at_lag_read = true;
    }

    /// The next `n` partition links to look detach with `amqp:link:stolen` and `description`
    /// (as Event Hubs does when another receiver takes the partition).
    pub fn detach_partition_links(&self, n: usize, description: &str) {
        self.inner.state.lock().unwrap().detach_links = Some((n, description.to_string()));
        self.inner.changed.notify_waiters();
    }

    /// While set, every partition link starts at the first event, whatever its filter says.
    pub fn replay_everything(&self, replay: bool) {
        self.inner.state.lock().unwrap().replay = replay;
    }

    pub fn open_connections(&self) -> usize {
        self.inner.state.lock().unwrap().open.len()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        kill_all(&self.inner);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Path of the test CA certificate (PEM) that issued the fake's `localhost` certificate.
pub fn test_ca_file() -> String {
    format!("{}/tests/amqp_support/tls/ca.pem", env!("CARGO_MANIFEST_DIR"))
}

fn tls_acceptor() -> tokio_rustls::TlsAcceptor {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let dir = format!("{}/tests/amqp_support/tls", env!("CARGO_MANIFEST_DIR"));
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(format!("{dir}/server.pem")).unwrap().collect::<Result<_, _>>().unwrap();
    let key = PrivateKeyDer::from_pem_file(format!("{dir}/server.key")).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn kill_all(inner: &Inner) {
    let open: Vec<_> = inner.state.lock().unwrap().open.drain().collect();
    for (_, socket) in open {
        let _ = socket.shutdown(Shutdown::Both);
    }
    inner.changed.notify_waiters();
}

// ---- per connection ----------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Identity {
    /// SASL PLAIN with the Event Hub key.
    Key,
    /// SASL ANONYMOUS: needs a CBS token.
    Anonymous,
    /// SASL PLAIN as `<policy>@sas.root.<hub>` with an IoT Hub SAS token.
    IotHub,
}

/// What one connection established: who it is and until when its CBS token is valid.
struct Conn {
    id: u64,
    identity: Mutex<Option<Identity>>,
    authorized_until_ms: AtomicI64,
    /// Reply links by the client node address they deliver to.
    replies: Mutex<HashMap<String, tokio::sync::mpsc::Sender<Message<AmqpValue<Value>>>>>,
    /// A partition link was attached on this connection.
    partition_attached: std::sync::atomic::AtomicBool,
}

#[derive(Clone)]
struct FakeSasl {
    auth: FakeAuth,
    iot_hub: bool,
    conn: Arc<Conn>,
}

fn sign(key: &[u8], text: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    base64::engine::general_purpose::STANDARD.encode(ring::hmac::sign(&key, text.as_bytes()).as_ref())
}

/// Checks a SAS token; returns (resource, expiry seconds).
fn verify_token(token: &str, key: &[u8]) -> Result<(String, i64), String> {
    let fields = token.strip_prefix("SharedAccessSignature ").ok_or("not a SharedAccessSignature")?;
    let mut map = HashMap::new();
    for part in fields.split('&') {
        let (k, v) = part.split_once('=').ok_or("malformed field")?;
        map.insert(k, v);
    }
    let sr = *map.get("sr").ok_or("no sr")?;
    let se: i64 = map.get("se").ok_or("no se")?.parse().map_err(|_| "bad se")?;
    let sig = percent_encoding::percent_decode_str(map.get("sig").ok_or("no sig")?).decode_utf8_lossy().to_string();
    if map.get("skn").copied() != Some(KEY_NAME) {
        return Err("wrong skn".into());
    }
    if sign(key, &format!("{sr}\n{se}")) != sig {
        return Err("bad signature".into());
    }
    if se * 1000 < now_millis() {
        return Err("expired".into());
    }
    Ok((percent_encoding::percent_decode_str(sr).decode_utf8_lossy().to_string(), se))
}

impl SaslAcceptor for FakeSasl {
    fn mechanisms(&self) -> Array<Symbol> {
        let mut m = vec![Symbol::from("PLAIN")];
        if self.auth == FakeAuth::Cbs {
            m.push(Symbol::from("ANONYMOUS"));
        }
        Array::from(m)
    }

    fn on_init(&mut self, init: SaslInit) -> SaslServerFrame {
        let identity = match init.mechanism.0.as_str() {
            "ANONYMOUS" if self.auth == FakeAuth::Cbs => Some(Identity::Anonymous),
            "PLAIN" => {
                let response = init.initial_response.map(|b| b.into_vec()).unwrap_or_default();
                let mut parts = response.split(|b| *b == 0).skip(1);
                let user = String::from_utf8_lossy(parts.next().unwrap_or_default()).to_string();
                let pass = String::from_utf8_lossy(parts.next().unwrap_or_default()).to_string();
                if self.iot_hub && user.starts_with(&format!("{KEY_NAME}@sas.root.")) {
                    let key = base64::engine::general_purpose::STANDARD.decode(KEY).unwrap();
                    match verify_token(&pass, &key) {
                        Ok((resource, _)) if resource.ends_with("/messages/events") => Some(Identity::IotHub),
                        _ => None,
                    }
                } else if !self.iot_hub && self.auth == FakeAuth::Plain && user == KEY_NAME && pass == KEY {
                    Some(Identity::Key)
                } else {
                    None
                }
            }
            _ => None,
        };
        *self.conn.identity.lock().unwrap() = identity;
        let code = if identity.is_some() { SaslCode::Ok } else { SaslCode::Auth };
        SaslServerFrame::Outcome(SaslOutcome { code, additional_data: None })
    }

    fn on_response(&mut self, _response: SaslResponse) -> SaslServerFrame {
        SaslServerFrame::Outcome(SaslOutcome { code: SaslCode::Auth, additional_data: None })
    }
}

async fn serve_connection(inner: Arc<Inner>, tcp: tokio::net::TcpStream) {
    let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
    let std = tcp.into_std().unwrap();
    let killer = std.try_clone().unwrap();
    let tcp = tokio::net::TcpStream::from_std(std).unwrap();
    {
        let mut state = inner.state.lock().unwrap();
        if state.refusing {
            let _ = killer.shutdown(Shutdown::Both);
            state.stats.refused += 1;
            return;
        }
        state.stats.connections += 1;
        state.open.insert(id, killer);
    }
    let conn = Arc::new(Conn {
        id,
        identity: Mutex::new(None),
        authorized_until_ms: AtomicI64::new(0),
        replies: Mutex::new(HashMap::new()),
        partition_attached: std::sync::atomic::AtomicBool::new(false),
    });
    inner.state.lock().unwrap().conns.insert(id, Arc::downgrade(&conn));
    let sasl = FakeSasl { auth: inner.auth, iot_hub: inner.redirect_to.is_some(), conn: conn.clone() };
    let acceptor = ConnectionAcceptor::builder().container_id("fake-event-hub").sasl_acceptor(sasl).build();
    let accepted = match &inner.tls {
        Some(tls) => match tls.accept(tcp).await {
            Ok(stream) => acceptor.accept(stream).await,
            Err(_) => Err(fe2o3_amqp::connection::OpenError::IllegalState),
        },
        None => acceptor.accept(tcp).await,
    };
    if let Ok(mut connection) = accepted {
        let sessions = SessionAcceptor::new();
        while let Ok(session) = sessions.accept(&mut connection).await {
            tokio::spawn(serve_session(inner.clone(), conn.clone(), session));
        }
        // `RemoteClosed`: the client sent `close` (no error); a dropped socket ends otherwise.
        if matches!(connection.on_close().await, Err(fe2o3_amqp::connection::Error::RemoteClosed)) {
            inner.state.lock().unwrap().stats.closed_connections += 1;
        }
    }
    if let Some(socket) = inner.state.lock().unwrap().open.remove(&id) {
        let _ = socket.shutdown(Shutdown::Both);
    }
}

async fn serve_session(inner: Arc<Inner>, conn: Arc<Conn>, mut session: fe2o3_amqp::acceptor::ListenerSessionHandle) {
    let links = LinkAcceptor::new();
    while let Ok(link) = links.accept(&mut session).await {
        match link {
            LinkEndpoint::Sender(sender) => {
                tokio::spawn(serve_outgoing(inner.clone(), conn.clone(), sender));
            }
            LinkEndpoint::Receiver(receiver) => {
                tokio::spawn(serve_incoming(inner.clone(), conn.clone(), receiver));
            }
        }
    }
}

fn refuse(condition: impl Into<definitions::ErrorCondition>, text: &str) -> definitions::Error {
    definitions::Error::new(condition, Some(text.to_string()), None)
}

fn authorized(conn: &Conn) -> bool {
    match *conn.identity.lock().unwrap() {
        Some(Identity::Key) => true,
        Some(Identity::Anonymous) => conn.authorized_until_ms.load(Ordering::Relaxed) > now_millis(),
        _ => false,
    }
}

/// A link on which the fake sends: a partition, a reply link, or the IoT Hub redirect.
async fn serve_outgoing(inner: Arc<Inner>, conn: Arc<Conn>, mut sender: Sender) {
    let address = sender.source().as_ref().and_then(|s| s.address.clone()).unwrap_or_default();
    if address == "$management" || address == "$cbs" {
        let client = sender.target().as_ref().and_then(|t| t.address.clone()).unwrap_or_default();
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        conn.replies.lock().unwrap().insert(client, tx);
        while let Some(reply) = rx.recv().await {
            if sender.send(Sendable::builder().message(reply).settled(true).build()).await.is_err() {
                break;
            }
        }
        return;
    }
    if address.contains("messages/events") {
        let identity = *conn.identity.lock().unwrap();
        if let (Some((port, entity)), Some(Identity::IotHub)) = (&inner.redirect_to, identity) {
            inner.state.lock().unwrap().stats.redirects += 1;
            let mut info = OrderedMap::new();
            info.insert(Symbol::from("hostname"), Value::String("127.0.0.1".into()));
            info.insert(Symbol::from("network-host"), Value::String("127.0.0.1".into()));
            info.insert(Symbol::from("port"), Value::Int(i32::from(*port)));
            info.insert(Symbol::from("address"), Value::String(format!("amqps://127.0.0.1:{port}/{entity}/$management")));
            let error = definitions::Error::new(LinkError::Redirect, Some("redirect".into()), Some(info));
            let _ = sender.close_with_error(error).await;
        } else {
            let _ = sender.close_with_error(refuse(AmqpError::UnauthorizedAccess, "not an IoT Hub connection")).await;
        }
        return;
    }
    let Some((path, partition)) = address.rsplit_once("/Partitions/") else {
        let _ = sender.close_with_error(refuse(AmqpError::NotFound, "no such node")).await;
        return;
    };
    if !path.starts_with(&format!("{ENTITY}/ConsumerGroups/")) || !inner.state.lock().unwrap().events.contains_key(partition) {
        let _ = sender.close_with_error(refuse(AmqpError::NotFound, "no such partition")).await;
        return;
    }
    if !authorized(&conn) {
        let _ = sender.close_with_error(refuse(AmqpError::UnauthorizedAccess, "no valid CBS token")).await;
        return;
    }
    let filter = selector_of(&sender).unwrap_or_default();
    let mut next = {
        let mut state = inner.state.lock().unwrap();
        state.stats.partition_links.push((address.clone(), filter.clone()));
        conn.partition_attached.store(true, Ordering::Relaxed);
        if state.replay {
            0
        } else {
            start_index(&state.events[partition], &filter)
        }
    };
    loop {
        let notified = inner.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let stolen = {
            let mut state = inner.state.lock().unwrap();
            match state.detach_links.as_mut() {
                Some((n, description)) if *n > 0 => {
                    *n -= 1;
                    Some(description.clone())
                }
                _ => None,
            }
        };
        if let Some(description) = stolen {
            let _ = sender.close_with_error(refuse(definitions::LinkError::Stolen, &description)).await;
            return;
        }
        let event = inner.state.lock().unwrap().events[partition].get(next).cloned();
        let Some(event) = event else {
            tokio::select! {
                _ = &mut notified => continue,
                detached = sender.on_detach() => {
                    if matches!(detached, fe2o3_amqp::link::DetachError::ClosedByRemote) {
                        inner.state.lock().unwrap().stats.closed_links += 1;
                    }
                    let _ = sender.close().await;
                    return;
                }
            }
        };
        let message = to_message(&event);
        let mut send = std::pin::pin!(sender.send(Sendable::builder().message(message).settled(true).build()));
        let sent = match std::future::poll_fn(|cx| std::task::Poll::Ready(std::future::Future::poll(send.as_mut(), cx))).await {
            std::task::Poll::Ready(sent) => sent,
            std::task::Poll::Pending => {
                inner.state.lock().unwrap().stats.sends_waiting += 1;
                send.await
            }
        };
        if sent.is_err() {
            return;
        }
        next += 1;
        let kill = {
            let mut state = inner.state.lock().unwrap();
            state.stats.deliveries += 1;
            match state.drop_after.as_mut() {
                Some(0) | Some(1) => {
                    state.drop_after = None;
                    true
                }
                Some(n) => {
                    *n -= 1;
                    false
                }
                None => false,
            }
        };
        if kill {
            kill_all(&inner);
            return;
        }
    }
}

fn to_message(event: &Event) -> Message<Data> {
    let mut annotations = OrderedMap::new();
    for (k, v) in &event.annotations {
        annotations.insert(OwnedKey::Symbol(Symbol::from(k.as_str())), v.clone());
    }
    let mut properties = OrderedMap::new();
    for (k, v) in &event.properties {
        properties.insert(k.clone(), v.clone());
    }
    Message::builder()
        .message_annotations(MessageAnnotations(annotations))
        .application_properties(ApplicationProperties(properties))
        .data(Binary::from(event.body.clone()))
        .build()
}

fn selector_of(sender: &Sender) -> Option<String> {
    let filter = sender.source().as_ref()?.filter.as_ref()?;
    match filter.get(&Symbol::from("apache.org:selector-filter:string"))? {
        Value::Described(d) => match &d.value {
            Value::String(s) => Some(s.clone()),
            _ => None,
        },
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

/// Index of the first event the selector lets through.
fn start_index(events: &[Event], filter: &str) -> usize {
    let Some((field, rest)) = filter.split_once("amqp.annotation.").and_then(|(_, r)| {
        let field_end = r.find([' ', '>', '='])?;
        Some((&r[..field_end], &r[field_end..]))
    }) else {
        return events.len(); // no filter: Event Hubs starts at the end
    };
    let rest = rest.trim();
    let (inclusive, value) = match rest.strip_prefix(">=") {
        Some(v) => (true, v),
        None => (false, rest.strip_prefix('>').unwrap_or(rest)),
    };
    let value = value.trim().trim_matches('\'');
    let passes = |e: &Event| -> bool {
        let (have, want): (i64, i64) = match field {
            "x-opt-sequence-number" => (e.sequence, value.parse().unwrap()),
            "x-opt-offset" => match value {
                "@latest" => return false,
                "-1" => return true,
                v => (e.sequence * 100, v.parse().unwrap()),
            },
            "x-opt-enqueued-time" => (e.enqueued, value.parse().unwrap()),
            other => panic!("unknown selector field {other}"),
        };
        if inclusive {
            have >= want
        } else {
            have > want
        }
    };
    events.iter().position(passes).unwrap_or(events.len())
}

/// A link on which the fake receives: requests to `$management` or `$cbs`.
async fn serve_incoming(inner: Arc<Inner>, conn: Arc<Conn>, mut receiver: Receiver) {
    let address = receiver.target().as_ref().and_then(|t| t.address.clone()).unwrap_or_default();
    if address != "$management" && address != "$cbs" {
        let _ = receiver.close_with_error(refuse(AmqpError::NotFound, "no such node")).await;
        return;
    }
    while let Ok(delivery) = receiver.recv::<Body<Value>>().await {
        let _ = receiver.accept(&delivery).await;
        let request = delivery.into_message();
        let app = request.application_properties.clone().unwrap_or_default();
        let text = |k: &str| match app.get(k) {
            Some(SimpleValue::String(s)) => s.clone(),
            _ => String::new(),
        };
        let props = request.properties.clone().unwrap_or_default();
        let reply_to = props.reply_to.clone().unwrap_or_default();
        let (status, body) = if address == "$cbs" {
            put_token(&inner, &conn, &text("name"), &request.body)
        } else if !authorized(&conn) {
            (401, Value::Null)
        } else if drops_at_lag_read(&inner, &conn, &text("type")) {
            kill_all(&inner);
            return;
        } else {
            read(&inner, &text("type"), &text("partition"))
        };
        let mut reply_props = OrderedMap::new();
        reply_props.insert("status-code".to_string(), SimpleValue::Int(status));
        reply_props.insert("status-description".to_string(), SimpleValue::String(if status < 300 { "OK" } else { "refused" }.into()));
        let reply = Message::builder()
            .properties(Properties { correlation_id: props.message_id.clone().or(Some(MessageId::Ulong(0))), ..Default::default() })
            .application_properties(ApplicationProperties(reply_props))
            .value(body)
            .build();
        let route = conn.replies.lock().unwrap().get(&reply_to).cloned();
        match route {
            Some(tx) => {
                let _ = tx.send(reply).await;
            }
            None => return,
        }
    }
}

/// Whether this `$management` READ is the lag measurement [`FakeHub::drop_at_lag_read`] waits
/// for; if so the switch is used up, new connections are refused and the drop is recorded.
fn drops_at_lag_read(inner: &Inner, conn: &Conn, kind: &str) -> bool {
    if kind != "com.microsoft:partition" || !conn.partition_attached.load(Ordering::Relaxed) {
        return false;
    }
    let mut state = inner.state.lock().unwrap();
    if !state.drop_at_lag_read {
        return false;
    }
    state.drop_at_lag_read = false;
    state.refusing = true;
    state.stats.lag_read_drops.push(Instant::now());
    true
}

fn put_token(inner: &Inner, conn: &Conn, audience: &str, body: &Body<Value>) -> (i32, Value) {
    let token = match body {
        Body::Value(v) => match &v.0 {
            Value::String(s) => s.clone(),
            _ => String::new(),
        },
        _ => String::new(),
    };
    match verify_token(&token, KEY.as_bytes()) {
        Ok((resource, expiry)) if resource == audience && audience.ends_with(&format!("/{ENTITY}")) => {
            conn.authorized_until_ms.store(expiry * 1000, Ordering::Relaxed);
            inner.state.lock().unwrap().stats.put_tokens += 1;
            (202, Value::Null)
        }
        _ => (401, Value::Null),
    }
}

fn read(inner: &Inner, kind: &str, partition: &str) -> (i32, Value) {
    let mut state = inner.state.lock().unwrap();
    state.stats.management_reads += 1;
    let mut map = OrderedMap::new();
    map.insert(Value::String("name".into()), Value::String(ENTITY.into()));
    match kind {
        "com.microsoft:eventhub" => {
            let ids: Vec<Value> = state.partitions.iter().map(|p| Value::String(p.clone())).collect();
            map.insert(Value::String("partition_count".into()), Value::Int(ids.len() as i32));
            map.insert(Value::String("partition_ids".into()), Value::Array(Array::from(ids)));
        }
        "com.microsoft:partition" => {
            let Some(events) = state.events.get(partition) else { return (404, Value::Null) };
            map.insert(Value::String("last_enqueued_sequence_number".into()), Value::Long(events.len() as i64 - 1));
            map.insert(Value::String("is_partition_empty".into()), Value::Bool(events.is_empty()));
        }
        _ => return (400, Value::Null),
    }
    (200, Value::Map(map))
}

/// Drops connections whose CBS token expired without renewal (as Event Hubs does).
async fn watch_token_expiry(inner: Arc<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = now_millis();
        let mut state = inner.state.lock().unwrap();
        state.conns.retain(|_, c| c.strong_count() > 0);
        let expired: Vec<u64> = state
            .conns
            .iter()
            .filter_map(|(id, c)| {
                let until = c.upgrade()?.authorized_until_ms.load(Ordering::Relaxed);
                (until > 0 && until < now).then_some(*id)
            })
            .collect();
        for id in expired {
            state.conns.remove(&id);
            if let Some(socket) = state.open.remove(&id) {
                let _ = socket.shutdown(Shutdown::Both);
                state.stats.expired += 1;
            }
        }
    }
}
