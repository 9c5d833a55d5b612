//! A throwaway `redis-server` for the scale-out tests: its own free port, nothing on disk,
//! killed with the test. Started and stopped again on the same port to test outages.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    /// Extra `redis-server` flags (a password, TLS).
    extra: Vec<String>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_with(&[])
    }

    /// With extra `redis-server` flags (e.g. `--requirepass`).
    pub fn start_with(extra: &[&str]) -> Redis {
        let extra = extra.iter().map(|a| a.to_string()).collect();
        let mut r = Redis { port: free_port(), child: None, extra };
        // The free port may be taken again before redis-server binds it (by another test's
        // Redis, say): then it exits, and a fresh port is tried.
        for _ in 0..5 {
            if r.try_up() {
                return r;
            }
            r.port = free_port();
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on its port and waits until it answers.
    pub fn up(&mut self) {
        assert!(self.try_up(), "redis-server could not start again on port {} (taken meanwhile?)", self.port);
    }

    /// Starts the server on its port; `false` if it exited (the port was taken). It is ready
    /// once the server answering on the port is this process (`INFO`'s `process_id`): another
    /// program that took the port would answer a PING too.
    fn try_up(&mut self) -> bool {
        let mut child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/test.sh installs it)");
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if self.process_id() == Some(pid) {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("redis-server on port {} did not answer within 10 s", self.port);
    }

    /// The process id of the server answering on the port (`AUTH` first if it has a password).
    fn process_id(&self) -> Option<u32> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
        let password = self.extra.iter().position(|a| a == "--requirepass").and_then(|i| self.extra.get(i + 1));
        let auth = password.map(|p| format!("AUTH {p}\r\n")).unwrap_or_default();
        s.write_all(format!("{auth}INFO server\r\n").as_bytes()).ok()?;
        let mut text = String::new();
        let mut buf = [0u8; 8192];
        loop {
            let n = s.read(&mut buf).ok().filter(|&n| n > 0)?;
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
            if let Some(rest) = text.split("process_id:").nth(1) {
                if let Some((pid, _)) = rest.split_once("\r\n") {
                    return pid.trim().parse().ok();
                }
            }
        }
    }

    /// Kills the server (SIGKILL: an outage, nothing flushed).
    pub fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// One inline command; the raw first reply bytes.
    pub fn command(&self, line: &str) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(format!("{line}\r\n").as_bytes()).ok()?;
        let mut buf = [0u8; 65536];
        let n = s.read(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.down();
    }
}
