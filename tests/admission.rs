//! Issue 26, items 13 and 14, over real sockets against the real binary: client connections
//! never take the descriptors the process needs (a lowered open-file limit, more idle
//! connections than it allows), and unauthenticated work is rate-limited per client address
//! (a second address is 127.0.0.2, the client socket bound to it; a trusted proxy's forwarded
//! addresses count apart). Every wait is on an answer, a metric or a log line, with a deadline.

mod common;

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

/// A connection to the server from `source` (a loopback address: 127.0.0.2 is another client).
fn connect_from(server: &Server, source: &str) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    let local: SocketAddr = format!("{source}:0").parse().unwrap();
    socket.bind(&local.into()).unwrap_or_else(|e| panic!("bind {source}: {e}"));
    let remote: SocketAddr = format!("127.0.0.1:{}", server.port).parse().unwrap();
    socket.connect(&remote.into()).expect("connect to server");
    let stream: TcpStream = socket.into();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

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

/// The value of a header in a raw response head.
fn header<'a>(r: &'a RawResponse, name: &str) -> Option<&'a str> {
    r.head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
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

/// `POST /session` from `stream` until the first 429 (at most `tries`): the 200s before it.
fn sessions_until_limited(stream: &mut TcpStream, headers: &[(&str, &str)], tries: usize) -> (usize, Option<RawResponse>) {
    for made in 0..tries {
        let r = exchange(stream, &request("POST", "/session", headers, ""));
        match r.status {
            200 => {}
            429 => return (made, Some(r)),
            other => panic!("POST /session answered {other}: {}", r.body),
        }
    }
    (tries, None)
}

fn assert_rate_limited(r: &RawResponse) {
    assert_eq!(r.status, 429);
    let retry: u64 = header(r, "retry-after").expect("Retry-After").parse().expect("Retry-After in seconds");
    assert!(retry >= 1, "{}", r.head);
    let body: Value = serde_json::from_str(&r.body).expect("a JSON error");
    assert!(body["errorMessage"].as_str().is_some_and(|m| m.contains("client-rate")), "{body}");
}

#[test]
fn one_client_address_cannot_make_sessions_or_handshakes_beyond_its_rate() {
    // One token per 100 s after a burst of 5: nothing refills while the test runs.
    let server = Server::start(&["--cores", "1", "--client-rate", "0.01", "--client-burst", "5"]);
    let mut one = connect_from(&server, "127.0.0.1");
    let (made, limited) = sessions_until_limited(&mut one, &[], 20);
    assert_eq!(made, 5, "the burst, then no more");
    assert_rate_limited(&limited.expect("a 429 beyond the burst"));
    // With the admin key (a backend making sessions for its users) it is not limited.
    let r = exchange(&mut one, &request("POST", "/session", &[ADMIN], ""));
    assert_eq!(r.status, 200, "with the admin key: {}", r.body);
    // The same address's Engine.IO and WebSocket handshakes draw on the same bucket.
    let r = exchange(&mut one, &request("GET", "/socket.io/?EIO=4&transport=polling", &[], ""));
    assert_rate_limited(&r);
    let mut ws = connect_from(&server, "127.0.0.1");
    let upgrade = [("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Version", "13"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")];
    let r = exchange(&mut ws, &request("GET", "/socket.io/?EIO=4&transport=websocket", &upgrade, ""));
    assert_rate_limited(&r);
    let mut ws = connect_from(&server, "127.0.0.1");
    let r = exchange(&mut ws, &request("GET", "/ws?sessionId=AAAAAAAAAAAAAAAAAAAAAA", &upgrade, ""));
    assert_rate_limited(&r);

    // Another client address is unaffected.
    let mut two = connect_from(&server, "127.0.0.2");
    let r = exchange(&mut two, &request("POST", "/session", &[], ""));
    assert_eq!(r.status, 200, "another address: {}", r.body);
    let r = exchange(&mut two, &request("GET", "/socket.io/?EIO=4&transport=polling", &[], ""));
    assert_eq!(r.status, 200, "another address's handshake: {}", r.body);
    assert!(r.body.contains("\"sid\""), "{}", r.body);

    let r = exchange(&mut two, &request("GET", "/metrics", &[ADMIN], ""));
    assert_eq!(metric_in(&r.body, "hubcast_rate_limited_total{work=\"session\"}"), Some(1.0), "{}", r.body);
    assert_eq!(metric_in(&r.body, "hubcast_rate_limited_total{work=\"engineio\"}"), Some(2.0), "{}", r.body);
    assert_eq!(metric_in(&r.body, "hubcast_rate_limited_total{work=\"websocket\"}"), Some(1.0), "{}", r.body);
}

#[test]
fn forwarded_addresses_count_apart_only_behind_a_trusted_proxy() {
    let server = Server::start(&["--cores", "1", "--client-rate", "0.01", "--client-burst", "2", "--trusted-proxies", "127.0.0.3,10.0.0.0/8"]);
    let via = |client: &str| [("X-Forwarded-For", client.to_string())];
    // Through the trusted proxy: each forwarded client has its own bucket.
    let mut proxy = connect_from(&server, "127.0.0.3");
    let xff = via("203.0.113.1, 10.1.2.3");
    let h: Vec<(&str, &str)> = xff.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (made, limited) = sessions_until_limited(&mut proxy, &h, 10);
    assert_eq!(made, 2);
    assert_rate_limited(&limited.unwrap());
    let xff = via("203.0.113.2");
    let h: Vec<(&str, &str)> = xff.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (made, _) = sessions_until_limited(&mut proxy, &h, 10);
    assert_eq!(made, 2, "another forwarded client counts apart");

    // From a peer that is not a trusted proxy, X-Forwarded-For is ignored: one bucket.
    let mut untrusted = connect_from(&server, "127.0.0.4");
    let xff = via("198.51.100.1");
    let h: Vec<(&str, &str)> = xff.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (made, _) = sessions_until_limited(&mut untrusted, &h, 10);
    assert_eq!(made, 2);
    let xff = via("198.51.100.2");
    let h: Vec<(&str, &str)> = xff.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (made, limited) = sessions_until_limited(&mut untrusted, &h, 10);
    assert_eq!(made, 0, "a forged X-Forwarded-For does not make a new client");
    assert_rate_limited(&limited.unwrap());
}

#[test]
fn a_session_never_used_expires_at_the_shorter_ttl_and_a_granted_one_lives() {
    let server = Server::start(&["--unused-session-ttl", "1", "--session-grace-period", "600"]);
    let unused = server.new_session();
    let granted = server.new_session();
    let grant = json!({"type": "telemetry", "deviceId": "dev-1", "telemetryKey": "n"});
    server.grant(&granted, grant);
    server.wait_for_metric("hubcast_sessions_expired_unused_total", WAIT, Want::Eq(1.0));
    let (status, body) = server.call_json("DELETE", &format!("/sessions/{unused}"), &[ADMIN], None);
    assert_eq!(status, 404, "the unused session is gone: {body}");
    let (status, body) = server.call_json("DELETE", &format!("/sessions/{granted}"), &[ADMIN], None);
    assert_eq!(status, 204, "the granted session lives: {body}");
}
