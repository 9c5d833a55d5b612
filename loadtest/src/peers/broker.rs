//! The peer broker under test, started by the harness: its own `nats-server` or `mosquitto`
//! (never the system's instances on 4222 / 1883), on free loopback ports, with a config of
//! our own in a fresh directory, pinned like a spawned hubcast (`--pin`), stopped and its
//! directory removed on drop.
//!
//! - NATS: `listen` on a free port, `websocket { no_tls: true }` on another; every other
//!   setting at its default (max_pending 64 MB per client, write_deadline).
//! - Mosquitto: a TCP listener (2.0.11 refuses to start with a WebSocket listener alone, see
//!   `loadtest/mqtt_idle.py`) and `protocol websockets` on another port; anonymous, no
//!   persistence, every queue limit at its default.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::Peer;

pub struct Broker {
    /// Its WebSocket listener.
    pub ws: SocketAddr,
    pub pid: u32,
    /// What `--version` says (`nats-server: v2.9.10`, `mosquitto version 2.0.11`).
    pub version: String,
    child: Child,
    dir: PathBuf,
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Broker {
    /// Starts `bin` as `peer`, pinned to `cpus`; returns once its WebSocket port accepts.
    pub fn spawn(peer: Peer, bin: &str, cpus: Option<Vec<usize>>) -> io::Result<Broker> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let dir = std::env::temp_dir().join(format!("hubcast-load-{}-{}-{nanos}", peer.name(), std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let (tcp, ws) = (free_port()?, free_port()?);
        let conf = dir.join("broker.conf");
        let (text, args, version_arg) = match peer {
            Peer::Nats => (
                format!("listen: \"127.0.0.1:{tcp}\"\nwebsocket {{\n  host: \"127.0.0.1\"\n  port: {ws}\n  no_tls: true\n}}\n"),
                vec!["-c".to_string(), conf.display().to_string()],
                "--version",
            ),
            Peer::Mosquitto => (
                format!(
                    "per_listener_settings false\nallow_anonymous true\npersistence false\nmax_connections -1\n\
                     log_dest stderr\nlog_type error\nlog_type warning\n\
                     listener {tcp} 127.0.0.1\nlistener {ws} 127.0.0.1\nprotocol websockets\n"
                ),
                vec!["-c".to_string(), conf.display().to_string()],
                "-h",
            ),
        };
        std::fs::write(&conf, text)?;
        let version = Command::new(bin)
            .arg(version_arg)
            .output()
            .map(|o| {
                let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
                all.lines().next().unwrap_or_default().trim().to_string()
            })
            .map_err(|e| io::Error::other(format!("cannot run {bin}: {e}")))?;
        let log = std::fs::File::create(dir.join("broker.log"))?;
        let mut cmd = Command::new(bin);
        cmd.args(&args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        if let Some(cpus) = cpus {
            use std::os::unix::process::CommandExt;
            // SAFETY: runs in the child between fork and exec; set_affinity does not allocate.
            unsafe {
                cmd.pre_exec(move || crate::pin::set_affinity(0, &cpus));
            }
        }
        let child = cmd.spawn().map_err(|e| io::Error::other(format!("cannot start {bin}: {e}")))?;
        let mut broker = Broker { ws: SocketAddr::from(([127, 0, 0, 1], ws)), pid: child.id(), version, child, dir };
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect_timeout(&broker.ws, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline || broker.child.try_wait()?.is_some() {
                return Err(io::Error::other(format!("{bin} did not listen on {}:\n{}", broker.ws, broker.log_tail())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(broker)
    }

    /// The end of the broker's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("broker.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
