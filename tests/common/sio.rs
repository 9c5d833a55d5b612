//! The real `socket.io-client` from npm (tests/js), driven as a child process that prints
//! one JSON line per event.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::Server;

pub struct SioClient {
    child: Child,
    stdin: Option<ChildStdin>,
    events: mpsc::Receiver<Value>,
}

impl Server {
    /// Connects one Socket.IO client per session id, with the given transports
    /// (`"websocket"`, `"polling"` or `"websocket,polling"`).
    pub fn socketio(&self, sessions: &[&str], transports: &str) -> SioClient {
        self.socketio_with(sessions, transports, false)
    }

    /// Like [`Server::socketio`], with socket.io-client's automatic reconnection on (as in
    /// a browser); each attempt is reported as a `reconnect_attempt` event.
    pub fn socketio_reconnecting(&self, sessions: &[&str], transports: &str) -> SioClient {
        self.socketio_with(sessions, transports, true)
    }

    fn socketio_with(&self, sessions: &[&str], transports: &str, reconnect: bool) -> SioClient {
        self.socketio_env(sessions, transports, reconnect, &[])
    }

    /// Like [`Server::socketio`], with extra environment variables for node (e.g.
    /// `NODE_EXTRA_CA_CERTS` to trust a test CA over `https://`).
    pub fn socketio_env(&self, sessions: &[&str], transports: &str, reconnect: bool, env: &[(&str, &str)]) -> SioClient {
        socketio_at(&self.base, sessions, transports, reconnect, env)
    }
}

/// The Socket.IO client against any base URL (a load balancer in front of several servers).
pub fn socketio_at(base: &str, sessions: &[&str], transports: &str, reconnect: bool, env: &[(&str, &str)]) -> SioClient {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/js/sio-client.mjs");
    let mut child = Command::new("node")
        .arg(script)
        .arg(base)
        .arg(sessions.join(","))
        .arg(transports)
        .env("SIO_RECONNECT", if reconnect { "1" } else { "0" })
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("node is installed (scripts/test.sh installs it) and tests/js has node_modules");
    let stdout = child.stdout.take().unwrap();
    let stdin = child.stdin.take();
    let (tx, events) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if tx.send(v).is_err() {
                    break;
                }
            }
        }
    });
    SioClient { child, stdin, events }
}

impl SioClient {
    /// The next event (`{index, event, …}`), or `None` within `timeout`.
    pub fn next(&self, timeout: Duration) -> Option<Value> {
        self.events.recv_timeout(timeout).ok()
    }

    /// Waits for an event of the given name (skipping others); returns it.
    pub fn wait_for(&self, event: &str, timeout: Duration) -> Option<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let e = self.next(left)?;
            if e["event"] == event {
                return Some(e);
            }
        }
    }

    /// Every event within `window`.
    pub fn collect(&self, window: Duration) -> Vec<Value> {
        let deadline = Instant::now() + window;
        let mut out = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.next(left) {
                Some(e) => out.push(e),
                None => break,
            }
        }
        out
    }
}

impl Drop for SioClient {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"exit\n");
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
