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

/// A graceful stop: SIGTERM, and a clean exit.
pub fn sigterm(server: &mut Server) {
    server.signal(libc::SIGTERM);
    let exit = server.wait_exit(WAIT).expect("exits after SIGTERM");
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
    pub fn start(port: u16) -> Monitor {
        use std::io::BufRead;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("redis");
        stream.write_all(b"MONITOR\r\n").unwrap();
        let lines: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
        let into = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stream).lines() {
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
