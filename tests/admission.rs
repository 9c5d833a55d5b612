//! Issue 26, item 13, over real sockets against the real binary: client connections never
//! take the descriptors the process needs (a lowered open-file limit, more idle connections
//! than it allows). Every wait is on an answer, a metric or a log line, with a deadline.

mod common;

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(body);
    out.into_bytes()
}

fn exchange(stream: &mut TcpStream, req: &[u8]) -> RawResponse {
    match raw_exchange(stream, req) {
        RawOutcome::Response(r) => r,
        other => panic!("no answer: {other:?}"),
    }
}

/// The value of `series` in a `/metrics` text.
fn metric_in(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

#[test]
fn idle_connections_beyond_the_open_file_limit_leave_status_and_the_store_working() {
    // 400 descriptors, 256 of them kept back: at most 144 client connections.
    const LIMIT: usize = 400;
    const IDLE: usize = 500;
    let args = ["--snapshot-log-bytes", "20000", "--http-idle-timeout", "300", "--log-level", "verbose"];
    let server = Server::start_wrapped(&["prlimit", &format!("--nofile={LIMIT}:{LIMIT}"), "--"], &args);
    // One client connected before the flood keeps its connection: ingest goes on through it.
    let mut keeper = server.connect();
    keeper.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let metrics = |keeper: &mut TcpStream| {
        let r = exchange(keeper, &request("GET", "/metrics", &[ADMIN], ""));
        assert_eq!(r.status, 200, "{}", r.head);
        r.body
    };
    let text = metrics(&mut keeper);
    let cap = metric_in(&text, "hubcast_connection_cap").expect("the cap is a metric") as usize;
    assert_eq!(cap, LIMIT - 256, "the open-file limit less the reserve");

    // More idle connections than the process may hold descriptors.
    let started = Instant::now();
    let mut idle: Vec<TcpStream> = (0..IDLE).map(|_| server.connect()).collect();
    for s in &idle {
        s.set_nonblocking(true).unwrap();
    }
    // Those over the cap are answered (503) or closed, never left waiting in the backlog.
    let over = IDLE - (cap - 1);
    let mut done = vec![false; IDLE];
    let mut refused_503 = 0;
    let deadline = Instant::now() + WAIT;
    while done.iter().filter(|d| **d).count() < over {
        assert!(Instant::now() < deadline, "only {} of the {over} connections over the cap were answered or closed", done.iter().filter(|d| **d).count());
        for (i, s) in idle.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            let mut buf = [0u8; 1024];
            match s.read(&mut buf) {
                Ok(0) => done[i] = true,
                Ok(n) => {
                    done[i] = true;
                    let text = String::from_utf8_lossy(&buf[..n]);
                    assert!(text.starts_with("HTTP/1.1 503"), "over the cap: {text}");
                    assert!(text.to_ascii_lowercase().contains("connection: close") && text.contains("errorMessage"), "{text}");
                    refused_503 += 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => done[i] = true,
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(refused_503 > 0, "connections over the cap are told why (503)");

    // A health check still gets through.
    let deadline = Instant::now() + WAIT;
    loop {
        let mut check = server.connect();
        match raw_exchange(&mut check, &raw_get("/status")) {
            RawOutcome::Response(r) if r.status == 200 => break,
            RawOutcome::Response(r) => assert_eq!(r.status, 503, "{}", r.head),
            RawOutcome::Closed => {}
            RawOutcome::TimedOut => panic!("GET /status hung while the connections are used up"),
        }
        assert!(Instant::now() < deadline, "GET /status never answered 200 while the connections are used up");
        std::thread::sleep(Duration::from_millis(100));
    }

    // The store still starts new logs: stream until a snapshot replaced the log.
    let mut round = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        round += 1;
        let batch: Vec<Value> = (0..200).map(|d| json!({"deviceId": format!("dev-{d}"), "body": {"n": round}})).collect();
        let r = exchange(&mut keeper, &request("POST", "/ingest", &[ADMIN, ("Content-Type", "application/json")], &Value::Array(batch).to_string()));
        assert!(r.status == 200 || r.status == 202, "ingest: {} {}", r.head, r.body);
        let text = metrics(&mut keeper);
        if metric_in(&text, "hubcast_store_snapshots_total").is_some_and(|n| n >= 2.0) {
            assert_eq!(metric_in(&text, "hubcast_store_write_errors_total"), Some(0.0), "the store wrote every file");
            assert!(metric_in(&text, "hubcast_connections_over_cap_total").is_some_and(|n| n >= over as f64), "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "no snapshot written while the connections are used up");
    }
    let stderr = server.stderr_lines();
    assert!(!stderr.iter().any(|l| l.contains("cannot start a new log")), "{}", stderr.join("\n"));
    // The log stays short: accept errors at most once a second (none with the reserve).
    let accept_lines = stderr.iter().filter(|l| l.contains("accept failed")).count();
    assert!(accept_lines as u64 <= started.elapsed().as_secs() + 1, "{accept_lines} accept warnings");
    drop(idle);
}
