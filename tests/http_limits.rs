//! Limits over real sockets: `--max-connections` and `--max-sessions` are process totals
//! whichever core takes the connection or session, clients that never read their answers lose
//! their slots, and duration flags are bounded at start.

mod common;

use std::io::{ErrorKind, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{full_args, raw_exchange, raw_get, run_expecting_exit, RawOutcome, Server};

#[test]
fn max_connections_is_a_total_over_all_cores() {
    // Two cores, one connection allowed: split per core, each core would take one.
    let server = Server::start(&["--max-connections", "1", "--cores", "2"]);
    let mut held = server.connect();
    match raw_exchange(&mut held, &raw_get("/version")) {
        RawOutcome::Response(r) => assert_eq!(r.status, 200, "the first connection: {}", r.head),
        other => panic!("the first connection got no answer: {other:?}"),
    }
    // SO_REUSEPORT spreads new connections over both cores: none of them may be served.
    for i in 0..12 {
        let mut extra = server.connect();
        match raw_exchange(&mut extra, &raw_get("/version")) {
            RawOutcome::Response(r) => assert_eq!(r.status, 503, "connection {i} beyond the total of 1: {}", r.head),
            RawOutcome::Closed => {}
            RawOutcome::TimedOut => panic!("connection {i} was neither refused nor closed"),
        }
    }
    match raw_exchange(&mut held, &raw_get("/version")) {
        RawOutcome::Response(r) => assert_eq!(r.status, 200, "the held connection afterwards: {}", r.head),
        other => panic!("the held connection stopped working: {other:?}"),
    }
}

#[test]
fn max_sessions_is_a_total_over_all_cores() {
    // Two cores, one session allowed: split per core, each core would take one.
    let server = Server::start(&["--max-sessions", "1", "--cores", "2"]);
    let (status, body) = server.call_json("POST", "/session", &[], None);
    assert_eq!(status, 200, "the first session: {body}");
    // Session ids hash to either core: none of the next ones may be created.
    for i in 0..12 {
        let (status, body) = server.call_json("POST", "/session", &[], None);
        assert_eq!(status, 503, "session {i} beyond the total of 1: {body}");
    }
}

/// Pipelines `GET /version` without ever reading, until the server stops taking requests
/// (its answers fill both socket buffers, so TCP holds the sender back).
fn pipeline_without_reading(server: &Server) -> TcpStream {
    let stream = server.connect();
    stream.set_nonblocking(true).unwrap();
    let batch: Vec<u8> = raw_get("/version").repeat(256);
    let mut writer = &stream;
    let mut blocked_since: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "the server kept taking pipelined requests for a minute");
        match writer.write(&batch) {
            Ok(_) => blocked_since = None,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                // Blocked for a moment in a row: the server has stopped reading.
                let since = *blocked_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_millis(200) {
                    return stream;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("pipelining failed before the server stalled: {e}"),
        }
    }
}

#[test]
fn clients_that_never_read_their_answers_lose_their_slots() {
    let server = Server::start(&["--max-connections", "4", "--http-idle-timeout", "3"]);
    let port = server.port;
    let stalled: Vec<TcpStream> = std::thread::scope(|s| {
        let server = &server;
        let workers: Vec<_> = (0..4).map(|_| s.spawn(move || pipeline_without_reading(server))).collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    // They hold every slot now.
    let mut refused = server.connect();
    match raw_exchange(&mut refused, &raw_get("/version")) {
        RawOutcome::Response(r) => assert_eq!(r.status, 503, "while the pipeliners hold the slots: {}", r.head),
        RawOutcome::Closed => {}
        RawOutcome::TimedOut => panic!("a connection beyond the limit was neither refused nor closed"),
    }
    drop(refused);
    // Their stalled writes close them (the log line is the event), and their slots come back.
    let closed = |lines: &[String]| lines.iter().filter(|l| l.contains("does not read its answers")).count();
    let deadline = Instant::now() + Duration::from_secs(30);
    // Polls the captured log (as the harness's own waits do).
    while closed(&server.stderr_lines()) < 4 {
        assert!(Instant::now() < deadline, "stalled pipeliners not closed: {:?}", server.stderr_lines());
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut fresh = TcpStream::connect(("127.0.0.1", port)).unwrap();
    fresh.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match raw_exchange(&mut fresh, &raw_get("/version")) {
            RawOutcome::Response(r) if r.status == 200 => break,
            // The last slot is released right after its log line: try again on a new connection.
            outcome => {
                assert!(Instant::now() < deadline, "no slot came back after the pipeliners were closed: {outcome:?}");
                fresh = server.connect();
            }
        }
    }
    drop(stalled);
}

#[test]
fn absurd_durations_are_refused_at_start_naming_the_flag() {
    for flag in [
        "--http-idle-timeout",
        "--session-grace-period",
        "--ping-interval",
        "--ping-timeout",
        "--throttling-interval",
        "--connection-state-cache-ttl",
        "--device-twin-cache-ttl",
    ] {
        let args = full_args(&[flag, "9223372036854775807"], true);
        let (ok, _, stderr) = run_expecting_exit(&args, &[]);
        assert!(!ok, "{flag} 9223372036854775807 was accepted");
        assert!(stderr.contains(flag), "the refusal of {flag} does not name it: {stderr}");
    }
}
