//! Test harness: runs the real `hubcast` binary on a free port and talks to it over HTTP.
//!
//! Every test starts its own [`Server`] (port 0, so tests can run in parallel) and drops it at
//! the end, which kills the process. [`Server::call`] treats 4xx/5xx answers as ordinary results,
//! so a test reads like the contract: "this request answers 404 with this errorMessage".
//! Raw TCP helpers ([`Server::connect`], [`read_response`]) cover what an HTTP client would hide
//! (garbage bytes, oversized heads, connection limits).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

pub mod process;
pub mod lb;
pub mod redis;
pub mod rawws;
pub mod recovery;
pub mod sio;
pub mod ws;

/// The primary admin secret every [`Server::start`] configures.
pub const ADMIN_KEY: &str = "test-primary";
/// The secondary admin secret every [`Server::start`] configures.
pub const SECONDARY_KEY: &str = "test-secondary";
/// The admin header, ready to pass to [`Server::call`].
pub const ADMIN: (&str, &str) = ("Shared-Access-Key", ADMIN_KEY);
/// Timeout of every HTTP request made by the harness.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for the `listening on` line.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Polls captured output lines until one matches `pred`, or `timeout` passes.
fn wait_for_line(lines: &Mutex<Vec<String>>, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(line) = lines.lock().unwrap().iter().find(|l| pred(l)) {
            return Some(line.clone());
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What [`Server::wait_for_metric`] waits for; shown in its panic message.
#[derive(Clone, Copy, Debug)]
pub enum Want {
    /// Exactly this value.
    Eq(f64),
    /// This value or more (a counter that may run past it).
    AtLeast(f64),
}

impl Want {
    fn holds(self, v: f64) -> bool {
        match self {
            Want::Eq(x) => v == x,
            Want::AtLeast(x) => v >= x,
        }
    }
}

impl std::fmt::Display for Want {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Want::Eq(x) => write!(f, "= {x}"),
            Want::AtLeast(x) => write!(f, ">= {x}"),
        }
    }
}

/// Path of the binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_hubcast");

/// Flags every server gets unless the test passes the same flag itself.
const DEFAULT_FLAGS: &[(&str, &str)] = &[("--bind", "127.0.0.1"), ("--port", "0"), ("--cores", "2")];
const SECRET_FLAGS: &[(&str, &str)] =
    &[("--primary-admin-secret", ADMIN_KEY), ("--secondary-admin-secret", SECONDARY_KEY)];

/// The only environment variables the binary gets from the test's environment: hubcast reads
/// its configuration from the environment too (every flag has one, e.g. `REDIS_URL`,
/// `LOG_LEVEL`, and the ux4iot camelCase names), so a developer's settings must not reach it.
/// A test passes the ones it means explicitly.
const KEPT_ENV: &[&str] = &["PATH", "HOME", "TMPDIR", "RUST_BACKTRACE"];

/// Clears `cmd`'s environment but for [`KEPT_ENV`].
fn neutral_env(cmd: &mut Command) {
    cmd.env_clear();
    for var in KEPT_ENV {
        if let Some(value) = std::env::var_os(var) {
            cmd.env(var, value);
        }
    }
}

/// Response headers (names compared case-insensitively).
#[derive(Debug, Clone, Default)]
pub struct Headers(pub Vec<(String, String)>);

impl Headers {
    /// First value of the header `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// All values of `name`, joined with ", ".
    pub fn joined(&self, name: &str) -> Option<String> {
        let values: Vec<&str> =
            self.0.iter().filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect();
        if values.is_empty() {
            None
        } else {
            Some(values.join(", "))
        }
    }
}

/// One running `hubcast` process.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`, as printed by the server.
    pub base: String,
    pub port: u16,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
    agent: ureq::Agent,
    /// A data dir the harness made for this server (removed on drop).
    own_data_dir: Option<std::path::PathBuf>,
    /// The threads reading its stdout and stderr (done at the pipes' end).
    drains: Vec<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Start the binary with the default flags (loopback, port 0, 2 cores, both test secrets)
    /// plus `args`; a flag in `args` replaces the default of the same name.
    pub fn start(args: &[&str]) -> Server {
        Self::launch(args, true, &[])
    }

    /// Like [`Server::start`], with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        Self::launch(args, true, env)
    }

    /// Start without `--primary-admin-secret` / `--secondary-admin-secret` (the server generates a key).
    pub fn start_without_secrets(args: &[&str]) -> Server {
        Self::launch(args, false, &[])
    }

    /// Like [`Server::start`], with the binary run through `wrapper` (a program and its
    /// arguments that exec the binary, e.g. `prlimit --as=N --`).
    pub fn start_wrapped(wrapper: &[&str], args: &[&str]) -> Server {
        let (program, wrapper_args) = wrapper.split_first().expect("a wrapper program");
        let args = full_args(args, true);
        let mut cmd = Command::new(program);
        cmd.args(wrapper_args).arg(BIN).args(&args);
        neutral_env(&mut cmd);
        Self::launch_command(cmd, harness_data_dir(&args))
    }

    fn launch(args: &[&str], with_secrets: bool, env: &[(&str, &str)]) -> Server {
        let args = full_args(args, with_secrets);
        let own_data_dir = harness_data_dir(&args);
        let mut cmd = command(&args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::launch_command(cmd, own_data_dir)
    }

    /// `own_data_dir`: a data dir the harness made for this server (removed with it).
    fn launch_command(mut cmd: Command, own_data_dir: Option<std::path::PathBuf>) -> Server {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {BIN}: {e}"));

        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<String>();
        let drains = vec![drain(child.stdout.take().unwrap(), stdout.clone(), Some(tx)), drain(child.stderr.take().unwrap(), stderr.clone(), None)];

        let deadline = Instant::now() + START_TIMEOUT;
        let base = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(url) = parse_listening_url(&line) {
                        break url;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "server printed no `listening on` line within {START_TIMEOUT:?}\nstdout:\n{}\nstderr:\n{}",
                        stdout.lock().unwrap().join("\n"),
                        stderr.lock().unwrap().join("\n")
                    );
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait();
                    std::thread::sleep(Duration::from_millis(100)); // let the stderr thread finish
                    panic!(
                        "server exited before listening ({status:?})\nstdout:\n{}\nstderr:\n{}",
                        stdout.lock().unwrap().join("\n"),
                        stderr.lock().unwrap().join("\n")
                    );
                }
            }
        };
        let port = port_of(&base).unwrap_or_else(|| panic!("no port in listening URL {base:?}"));
        Server { child, base, port, stdout, stderr, agent: new_agent(), own_data_dir, drains }
    }

    /// Absolute URL of `path` (which starts with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// A request on the server's shared agent, with the harness timeout.
    pub fn req(&self, method: &str, path: &str) -> ureq::Request {
        self.agent.request(method, &self.url(path)).timeout(TIMEOUT)
    }

    /// Send a request; any HTTP status is a normal result. `body` is sent as JSON.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (u16, String, Headers) {
        self.call_on(&self.agent, method, path, headers, body)
    }

    /// [`Server::call`] over a given agent (a fresh agent means a fresh TCP connection).
    pub fn call_on(
        &self,
        agent: &ureq::Agent,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (u16, String, Headers) {
        let bytes = body.map(|b| serde_json::to_vec(&b).unwrap());
        send(agent, &self.url(path), method, headers, bytes.as_deref())
    }

    /// Send raw body bytes (Content-Type application/json unless `headers` sets one).
    pub fn call_raw(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String, Headers) {
        send(&self.agent, &self.url(path), method, headers, Some(body))
    }

    /// [`Server::call_raw`] on a fresh connection; a transport failure is an `Err`.
    pub fn try_call_raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(u16, String, Headers), String> {
        try_send(&new_agent(), &self.url(path), method, headers, Some(body))
    }

    /// [`Server::call`] whose answer body is parsed as JSON (`Null` when empty).
    pub fn call_json(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<Value>) -> (u16, Value) {
        let (status, text, _) = self.call(method, path, headers, body);
        (status, parse_json(&text))
    }

    // ---- domain helpers --------------------------------------------------------------------

    /// POST /session → 200 `{"sessionId": ...}`; returns the id.
    pub fn new_session(&self) -> String {
        self.new_session_on(&self.agent)
    }

    /// [`Server::new_session`] over the given agent.
    pub fn new_session_on(&self, agent: &ureq::Agent) -> String {
        let (status, body, _) = self.call_on(agent, "POST", "/session", &[], None);
        assert_eq!(status, 200, "POST /session answered {status}: {body}");
        let v = parse_json(&body);
        v["sessionId"].as_str().unwrap_or_else(|| panic!("POST /session body has no sessionId string: {body}")).to_string()
    }

    /// PUT /grants with the admin key and `sessionId` merged into `grant`; returns status and body.
    pub fn try_grant(&self, session: &str, grant: Value) -> (u16, String) {
        let (status, body, _) = self.call("PUT", "/grants", &[ADMIN], Some(with_session(session, grant)));
        (status, body)
    }

    /// PUT /grants that must answer 204 with an empty body.
    pub fn grant(&self, session: &str, grant: Value) {
        self.grant_on(&self.agent, session, grant)
    }

    /// [`Server::grant`] over the given agent.
    pub fn grant_on(&self, agent: &ureq::Agent, session: &str, grant: Value) {
        let body = with_session(session, grant);
        let (status, text, _) = self.call_on(agent, "PUT", "/grants", &[ADMIN], Some(body.clone()));
        assert_eq!(status, 204, "PUT /grants {body} answered {status}: {text}");
        assert!(text.is_empty(), "PUT /grants answered 204 with a body: {text:?}");
    }

    /// A new session granted and subscribed (204) to the telemetry of each of `devices`.
    pub fn telemetry_session<D: AsRef<str>>(&self, devices: &[D]) -> String {
        let session = self.new_session();
        for device in devices {
            let request = json!({"type": "telemetry", "deviceId": device.as_ref()});
            self.grant(&session, request.clone());
            let (status, body) = self.subscribe(&session, request);
            assert_eq!(status, 204, "PUT /subscription answered {status}: {body}");
        }
        session
    }

    /// DELETE /grants with the admin key; returns status and body.
    pub fn try_revoke(&self, session: &str, grant: Value) -> (u16, String) {
        let (status, body, _) = self.call("DELETE", "/grants", &[ADMIN], Some(with_session(session, grant)));
        (status, body)
    }

    /// DELETE /grants that must answer 204.
    pub fn revoke(&self, session: &str, grant: Value) {
        let body = with_session(session, grant);
        let (status, text, _) = self.call("DELETE", "/grants", &[ADMIN], Some(body.clone()));
        assert_eq!(status, 204, "DELETE /grants {body} answered {status}: {text}");
    }

    /// PUT /subscription (no key; the session is in the body); returns status and body.
    pub fn subscribe(&self, session: &str, request: Value) -> (u16, String) {
        self.subscribe_on(&self.agent, session, request)
    }

    /// [`Server::subscribe`] over the given agent.
    pub fn subscribe_on(&self, agent: &ureq::Agent, session: &str, request: Value) -> (u16, String) {
        let (status, body, _) = self.call_on(agent, "PUT", "/subscription", &[], Some(with_session(session, request)));
        (status, body)
    }

    /// DELETE /subscription; returns status and body.
    pub fn unsubscribe(&self, session: &str, request: Value) -> (u16, String) {
        let (status, body, _) = self.call("DELETE", "/subscription", &[], Some(with_session(session, request)));
        (status, body)
    }

    /// POST /ingest with the admin key (one message or an array); must answer 200.
    /// Returns the `accepted` count.
    pub fn ingest(&self, messages: Value) -> u64 {
        self.ingest_on(&self.agent, messages)
    }

    /// [`Server::ingest`] over the given agent.
    pub fn ingest_on(&self, agent: &ureq::Agent, messages: Value) -> u64 {
        let (status, body, _) = self.call_on(agent, "POST", "/ingest", &[ADMIN], Some(messages));
        assert_eq!(status, 200, "POST /ingest answered {status}: {body}");
        let v = parse_json(&body);
        v["accepted"].as_u64().unwrap_or_else(|| panic!("POST /ingest body has no accepted count: {body}"))
    }

    // ---- process output --------------------------------------------------------------------

    /// Every stdout line printed so far.
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// Every stderr line printed so far.
    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// Wait until a stdout line satisfies `pred`.
    pub fn wait_for_stdout(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        wait_for_line(&self.stdout, timeout, pred)
    }

    /// Waits for a stderr (log) line matching `pred`.
    pub fn wait_for_stderr(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        wait_for_line(&self.stderr, timeout, pred)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's resident memory in KiB (`VmRSS` of /proc/PID/status).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// One sample of `GET /metrics` (with the admin key): the value of the series whose name
    /// and labels are exactly `series` (e.g. `hubcast_sockets{transport="websocket"}`).
    pub fn metric(&self, series: &str) -> Option<f64> {
        self.metrics(&[series])[0]
    }

    /// Several series from one sample of `GET /metrics` (so they are read at one moment),
    /// each as [`Server::metric`] reads it.
    pub fn metrics(&self, series: &[&str]) -> Vec<Option<f64>> {
        let (status, text, _) = self.call_on(&new_agent(), "GET", "/metrics", &[ADMIN], None);
        assert_eq!(status, 200, "GET /metrics answered {status}: {text}");
        series.iter().map(|series| text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())).collect()
    }

    /// Polls `GET /metrics` until `series` is what `want` says; returns that value. Panics
    /// after `timeout` naming the series, what was wanted and the last value read (a wait
    /// that returned the last value instead let callers pass on a time-out).
    #[track_caller]
    pub fn wait_for_metric(&self, series: &str, timeout: Duration, want: Want) -> f64 {
        let deadline = Instant::now() + timeout;
        loop {
            let value = self.metric(series);
            if let Some(v) = value.filter(|&v| want.holds(v)) {
                return v;
            }
            if Instant::now() >= deadline {
                let tail = self.stderr_lines();
                let tail = tail[tail.len().saturating_sub(20)..].join("\n");
                panic!("{series} did not become {want} within {timeout:?}: last value {value:?}\n--- hubcast log (tail) ---\n{tail}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to the process.
    pub fn signal(&self, signal: i32) {
        process::signal(&self.child, signal)
    }

    /// Waits up to `timeout` for the process to exit; its status, or `None` while it runs.
    /// Once it has exited, every line it wrote is in [`Server::stdout_lines`] and
    /// [`Server::stderr_lines`]: the reading threads are waited for too (the pipes end with
    /// the process; at most 5 s more), so a line logged just before the exit is never missed
    /// (a loaded machine could schedule the reader after the test read the lines).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let status = process::wait_exit(&mut self.child, timeout)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.drains.iter().any(|d| !d.is_finished()) {
            if Instant::now() >= deadline {
                // A child of the server holding its pipes open: its lines may be incomplete.
                eprintln!("harness: the server exited ({status}) but its output is still open after 5 s: its last log lines may be missing");
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Some(status)
    }

    // ---- raw TCP ---------------------------------------------------------------------------

    /// A new TCP connection to the server with 5 s read/write timeouts.
    pub fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect to server");
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        stream.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
    }

    /// Assert the server still answers GET /version with 200 on a fresh connection.
    pub fn assert_alive(&self) {
        let (status, body, _) = self.call_on(&new_agent(), "GET", "/version", &[], None);
        assert_eq!(status, 200, "server no longer serves GET /version: {status} {body}");
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

/// A fresh directory under the system temp dir, removed on drop: give one to each hubcast
/// (`--data-dir`), since tests run in parallel and one data dir has one owner.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        Self::named("hubcast-test-dir-")
    }

    fn named(prefix: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos();
        TempDir(std::env::temp_dir().join(format!("{prefix}{}-{n}-{nanos}", std::process::id())))
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("temp paths are UTF-8")
    }

    /// Keeps the directory (the caller removes it).
    pub fn keep(self) -> std::path::PathBuf {
        let p = self.0.clone();
        std::mem::forget(self);
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Data dirs the harness made itself start with this (and are removed with their server).
const HARNESS_DIR_PREFIX: &str = "hubcast-test-auto-";

/// The data dir in `args` if the harness made it.
fn harness_data_dir(args: &[String]) -> Option<std::path::PathBuf> {
    let i = args.iter().position(|a| a == "--data-dir")?;
    let dir = std::path::PathBuf::from(args.get(i + 1)?);
    dir.file_name()?.to_str()?.starts_with(HARNESS_DIR_PREFIX).then_some(dir)
}

/// The full argument list: defaults not overridden by `args`, then `args`. Unless `args`
/// names one, the server gets a fresh `--data-dir` of its own (removed with the server).
pub fn full_args(args: &[&str], with_secrets: bool) -> Vec<String> {
    let overridden = |flag: &str| args.iter().any(|a| *a == flag || a.starts_with(&format!("{flag}=")));
    let mut out = Vec::new();
    if !overridden("--data-dir") {
        out.push("--data-dir".to_string());
        out.push(TempDir::named(HARNESS_DIR_PREFIX).keep().to_string_lossy().into_owned());
    }
    let secrets: &[(&str, &str)] = if with_secrets { SECRET_FLAGS } else { &[] };
    for (flag, value) in DEFAULT_FLAGS.iter().chain(secrets) {
        if !overridden(flag) {
            out.push(flag.to_string());
            out.push(value.to_string());
        }
    }
    out.extend(args.iter().map(|s| s.to_string()));
    out
}

/// A `Command` for the binary with `args` and a configuration-neutral environment.
pub fn command(args: &[String]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    neutral_env(&mut cmd);
    cmd
}

/// Run the binary (not through [`Server`]) expecting it to stop on its own within 10 s.
/// Returns (exit success, stderr text). Panics when it keeps running.
pub fn run_expecting_exit(args: &[String], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = command(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start binary");
    let out = Arc::new(Mutex::new(Vec::new()));
    let err = Arc::new(Mutex::new(Vec::new()));
    let (tx, _rx) = mpsc::channel();
    let t_out = drain(child.stdout.take().unwrap(), out.clone(), Some(tx));
    let t_err = drain(child.stderr.take().unwrap(), err.clone(), None);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "binary with {args:?} did not exit within 10 s\nstdout:\n{}",
                out.lock().unwrap().join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = t_out.join();
    let _ = t_err.join();
    if let Some(dir) = harness_data_dir(args) {
        let _ = std::fs::remove_dir_all(dir);
    }
    let stdout = out.lock().unwrap().join("\n");
    let stderr = err.lock().unwrap().join("\n");
    (status.success(), stdout, stderr)
}

/// Reads a child's pipe line by line into `lines` (bounded, so a chatty server cannot grow
/// the test's memory), forwarding each line to `tx` when given.
fn drain(pipe: impl Read + Send + 'static, lines: Arc<Mutex<Vec<String>>>, tx: Option<mpsc::Sender<String>>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    let mut all = lines.lock().unwrap();
                    if all.len() < 10_000 {
                        all.push(line.clone());
                    }
                    drop(all);
                    if let Some(tx) = &tx {
                        let _ = tx.send(line);
                    }
                }
            }
        }
    })
}

/// `http://127.0.0.1:PORT` from a line containing `listening on http://127.0.0.1:PORT`.
fn parse_listening_url(line: &str) -> Option<String> {
    let rest = &line[line.find("listening on ")? + "listening on ".len()..];
    let url: String = rest.split_whitespace().next()?.to_string();
    let url = url.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).trim_end_matches('/').to_string();
    port_of(&url)?;
    Some(url)
}

fn port_of(url: &str) -> Option<u16> {
    let after_scheme = url.split("://").nth(1)?;
    let authority = after_scheme.split('/').next()?;
    authority.rsplit(':').next()?.parse().ok().filter(|p| *p != 0)
}

/// A new agent (its own connection pool) with the harness timeout.
pub fn new_agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(TIMEOUT).build()
}

fn send(agent: &ureq::Agent, url: &str, method: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> (u16, String, Headers) {
    try_send(agent, url, method, headers, body).unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

/// Like `send`, but a transport failure (connection reset, timeout) is an `Err`.
pub fn try_send(
    agent: &ureq::Agent,
    url: &str,
    method: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<(u16, String, Headers), String> {
    let mut request = agent.request(method, url).timeout(TIMEOUT);
    for (k, v) in headers {
        request = request.set(k, v);
    }
    let result = match body {
        Some(bytes) => {
            if request.header("Content-Type").is_none() {
                request = request.set("Content-Type", "application/json");
            }
            request.send_bytes(bytes)
        }
        None => request.call(),
    };
    let response = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(ureq::Error::Transport(t)) => return Err(format!("transport error: {t}")),
    };
    let status = response.status();
    let mut names = response.headers_names();
    names.dedup();
    let mut pairs = Vec::new();
    for name in names {
        if pairs.iter().any(|(n, _): &(String, String)| *n == name) {
            continue;
        }
        for value in response.all(&name) {
            pairs.push((name.clone(), value.to_string()));
        }
    }
    let text = response.into_string().map_err(|e| format!("cannot read body: {e}"))?;
    Ok((status, text, Headers(pairs)))
}

// ---- log lines ---------------------------------------------------------------------------------

/// The `key=value` field of a log line in the text format (tracing's: ` key=value` after the
/// message), the value up to the next space. The space before the key is required, so `log`
/// does not match inside `prev_log=`.
pub fn log_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split(&format!(" {key}=")).nth(1)?.split_whitespace().next()
}

/// [`log_field`] as a whole number.
pub fn log_number(line: &str, key: &str) -> Option<u64> {
    log_field(line, key)?.parse().ok()
}

// ---- JSON helpers ------------------------------------------------------------------------------

/// Parse a response body as JSON; an empty body is `Null`.
pub fn parse_json(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Null;
    }
    serde_json::from_str(text).unwrap_or_else(|e| panic!("response body is not JSON ({e}): {text:?}"))
}

/// The `errorMessage` of an error body; panics unless the body is `{"errorMessage": "<string>"}`.
pub fn error_message(body: &str) -> String {
    let v: Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("error body is not JSON ({e}): {body:?}"));
    v.get("errorMessage")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("error body has no string errorMessage: {body}"))
        .to_string()
}

/// Assert `status` and that the JSON error message contains `needle` (case-insensitive).
pub fn assert_error(status: u16, body: &str, expected: u16, needle: &str) {
    assert_eq!(status, expected, "expected {expected} containing {needle:?}, got {status}: {body}");
    let msg = error_message(body);
    assert!(
        msg.to_lowercase().contains(&needle.to_lowercase()),
        "errorMessage {msg:?} does not contain {needle:?}"
    );
}

/// `request` with `"sessionId": session` added.
pub fn with_session(session: &str, request: Value) -> Value {
    let mut request = request;
    match request.as_object_mut() {
        Some(object) => {
            object.insert("sessionId".into(), json!(session));
        }
        None => panic!("request must be a JSON object"),
    }
    request
}

/// A telemetry grant/subscription body; `key: None` is the wildcard (`telemetryKey: null`).
pub fn telemetry(device: &str, key: Option<&str>) -> Value {
    json!({"type": "telemetry", "deviceId": device, "telemetryKey": key})
}

/// A grant/subscription body of a type without a restricting field.
pub fn kind(kind: &str, device: &str) -> Value {
    json!({"type": kind, "deviceId": device})
}

// ---- time --------------------------------------------------------------------------------------

/// Milliseconds since the epoch of an RFC 3339 UTC timestamp ending in `Z`
/// (`2024-01-02T03:04:05Z`, `2024-01-02T03:04:05.123Z`); `None` when it is not one.
pub fn parse_utc_millis(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || *b.last()? != b'Z' {
        return None;
    }
    if b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |from: usize, to: usize| -> Option<i64> {
        let t = s.get(from..to)?;
        if t.bytes().all(|c| c.is_ascii_digit()) { t.parse().ok() } else { None }
    };
    let (y, mo, d, h, mi, se) = (num(0, 4)?, num(5, 7)?, num(8, 10)?, num(11, 13)?, num(14, 16)?, num(17, 19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let frac = &s[19..s.len() - 1];
    let millis = if frac.is_empty() {
        0
    } else {
        let digits = frac.strip_prefix('.')?;
        if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let mut ms = String::from(&digits[..digits.len().min(3)]);
        while ms.len() < 3 {
            ms.push('0');
        }
        ms.parse::<i64>().ok()?
    };
    // Days from civil date (proleptic Gregorian).
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = if yy >= 0 { yy } else { yy - 399 } / 400;
    let yoe = yy - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + h) * 60 + mi) * 60_000 + se * 1000 + millis)
}

/// Now, in milliseconds since the epoch.
pub fn now_millis() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Assert `v` is an RFC 3339 UTC timestamp string within a minute of now.
pub fn assert_recent_timestamp(v: &Value) {
    let s = v.as_str().unwrap_or_else(|| panic!("timestamp is not a string: {v}"));
    let t = parse_utc_millis(s).unwrap_or_else(|| panic!("timestamp {s:?} is not RFC 3339 UTC (…Z)"));
    let skew = (now_millis() - t).abs();
    assert!(skew < 60_000, "timestamp {s} is {skew} ms away from now");
}

// ---- raw HTTP over TCP -------------------------------------------------------------------------

/// A response read from a raw TCP stream.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub head: String,
    pub body: String,
}

/// What became of a raw request.
#[derive(Debug)]
pub enum RawOutcome {
    /// The server answered.
    Response(RawResponse),
    /// The server closed (EOF) or reset the connection without an answer.
    Closed,
    /// Nothing happened before the read timeout.
    TimedOut,
}

/// Write `request` (ignoring write errors: the server may close early) and read one response.
pub fn raw_exchange(stream: &mut TcpStream, request: &[u8]) -> RawOutcome {
    let _ = stream.write_all(request);
    let _ = stream.flush();
    read_response(stream)
}

/// Read one HTTP/1.1 response (Content-Length or chunked body) from `stream`.
pub fn read_response(stream: &mut TcpStream) -> RawOutcome {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(pos) = find(&buf, b"\r\n\r\n") {
            break pos + 4;
        }
        match stream.read(&mut chunk) {
            Ok(0) => return RawOutcome::Closed,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return if buf.is_empty() { RawOutcome::TimedOut } else { RawOutcome::Closed };
            }
            Err(_) => return RawOutcome::Closed,
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let header = |name: &str| -> Option<String> {
        head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let mut body = buf[head_end..].to_vec();
    if let Some(len) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while body.len() < len {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => body.extend_from_slice(&chunk[..n]),
            }
        }
        body.truncate(len);
    } else if header("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        while find(&body, b"0\r\n\r\n").is_none() {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => body.extend_from_slice(&chunk[..n]),
            }
        }
    }
    RawOutcome::Response(RawResponse { status, head, body: String::from_utf8_lossy(&body).to_string() })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A minimal keep-alive GET request for raw TCP tests.
pub fn raw_get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n").into_bytes()
}
