//! Strict HTTP/1.1 message framing (RFC 9112) over raw sockets: request-smuggling shapes are
//! refused and the connection closed, valid chunked bodies (extensions, trailers) are read,
//! chunked bodies respect `--max-body-bytes`, empty lines around requests are harmless, HEAD
//! answers carry no body, and early errors are readable by a client still sending.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{raw_exchange, raw_get, read_response, RawOutcome, RawResponse, Server, ADMIN_KEY};

/// Everything the server sends until it closes the connection (or 5 s pass).
fn read_to_close(stream: &mut TcpStream) -> (Vec<u8>, bool) {
    let mut all = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => return (all, true),
            Ok(n) => all.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return (all, false),
            Err(_) => return (all, true),
        }
    }
}

/// Sends `request` followed by a pipelined `GET /version`, and checks the answer is `status`
/// with a JSON error, that the connection is closed after it, and that the smuggled request
/// was never answered.
fn assert_refused_and_closed(server: &Server, request: &str, status: u16) {
    let mut stream = server.connect();
    let mut bytes = request.as_bytes().to_vec();
    bytes.extend_from_slice(&raw_get("/version"));
    let _ = stream.write_all(&bytes);
    let (answer, closed) = read_to_close(&mut stream);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "answer to {request:?}: {text}");
    assert!(text.contains("\"errorMessage\""), "answer to {request:?} has no JSON error: {text}");
    assert!(closed, "connection left open after {request:?}");
    // Nothing follows the first answer: the request after it was not answered.
    let head_end = text.find("\r\n\r\n").expect("a complete head") + 4;
    let length: usize = text[..head_end]
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
        .expect("content-length");
    assert_eq!(answer.len(), head_end + length, "the request after {request:?} was answered: {text}");
    server.assert_alive();
}

#[test]
fn request_smuggling_shapes_are_refused_and_the_connection_closed() {
    let server = Server::start(&[]);
    let post = |fields: &str, body: &str| format!("POST /version HTTP/1.1\r\nHost: a\r\n{fields}\r\n{body}");
    let shapes = [
        post("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", "0\r\n\r\n"),
        post("Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", "0\r\n\r\n"),
        post("Content-Length: 5\r\nContent-Length: 6\r\n", "hello!"),
        post("Content-Length: 5, 6\r\n", "hello!"),
        post("Content-Length: +5\r\n", "hello"),
        post("Content-Length: 5x\r\n", "hello"),
        post("Content-Length: -1\r\n", ""),
        post("Transfer-Encoding: chunked, identity\r\n", "0\r\n\r\n"),
        post("Transfer-Encoding: identity\r\n", "0\r\n\r\n"),
        post("Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n", "0\r\n\r\n"),
        post("Transfer-Encoding: chunked, chunked\r\n", "0\r\n\r\n"),
        post("Transfer-Encoding: xchunked\r\n", "0\r\n\r\n"),
        // An empty chunk-size line is not the last chunk.
        post("Transfer-Encoding: chunked\r\n", "\r\n\r\n"),
        post("Transfer-Encoding: chunked\r\n", "5\r\nhello\r\n\r\n"),
        "POST /version HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_string(),
    ];
    for request in &shapes {
        assert_refused_and_closed(&server, request, 400);
    }
    // A coding hubcast does not implement before chunked: 501 (RFC 9112 §6.1), closed too.
    assert_refused_and_closed(&server, &post("Transfer-Encoding: gzip, chunked\r\n", "0\r\n\r\n"), 501);
}

#[test]
fn http_1_1_requests_need_exactly_one_host_header() {
    let server = Server::start(&[]);
    assert_refused_and_closed(&server, "GET /version HTTP/1.1\r\n\r\n", 400);
    assert_refused_and_closed(&server, "GET /version HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400);
}

fn ingest_chunked(body_framing: &str) -> String {
    format!(
        "POST /ingest HTTP/1.1\r\nHost: a\r\nShared-Access-Key: {ADMIN_KEY}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{body_framing}"
    )
}

#[test]
fn chunk_extensions_and_trailer_fields_are_accepted() {
    let server = Server::start(&[]);
    let json = |device: &str| format!(r#"{{"deviceId":"{device}","body":{{"t":1}}}}"#);
    // The same message, once in plain chunks and once with extensions and trailer fields
    // (RFC 9112 §7.1.1–7.1.2): the answers and what is stored must be the same.
    let plain_json = json("plain");
    let (a, b) = plain_json.split_at(10);
    let plain = format!("{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n", a.len(), b.len());
    let extended_json = json("extended");
    let (a, b) = extended_json.split_at(10);
    let extended = format!(
        "{:x};ext=1\r\n{a}\r\n{:x} ; quoted=\"a b\";flag\r\n{b}\r\n0;last\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n",
        a.len(),
        b.len()
    );
    let mut answers = Vec::new();
    for framing in [plain, extended] {
        let mut stream = server.connect();
        match raw_exchange(&mut stream, ingest_chunked(&framing).as_bytes()) {
            RawOutcome::Response(r) => {
                assert_eq!(r.status, 200, "chunked ingest {framing:?}: {}{}", r.head, r.body);
                answers.push(r.body);
            }
            other => panic!("no answer to the chunked body {framing:?}: {other:?}"),
        }
        // The body ended where its framing said: the next request on the connection is answered.
        match raw_exchange(&mut stream, &raw_get("/version")) {
            RawOutcome::Response(r) => assert_eq!(r.status, 200, "pipelined GET /version: {}", r.head),
            other => panic!("the request after the chunked body was not answered: {other:?}"),
        }
    }
    assert_eq!(answers[0], answers[1], "extensions and trailers changed the answer");
    let (status, plain, _) = server.call_raw("GET", "/lastValue/plain/t", &[(common::ADMIN.0, ADMIN_KEY)], b"");
    let (status2, extended, _) = server.call_raw("GET", "/lastValue/extended/t", &[(common::ADMIN.0, ADMIN_KEY)], b"");
    assert_eq!((status, status2), (200, 200), "{plain} {extended}");
    let value = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap()["data"].clone();
    assert_eq!(value(&plain), value(&extended), "{plain} / {extended}");
    assert_eq!(value(&extended), serde_json::json!({"t": 1}), "{extended}");
}

#[test]
fn over_long_chunk_extensions_or_trailers_are_refused_with_431() {
    let server = Server::start(&[]);
    let ext = format!(";e={}", "x".repeat(1000));
    // Each line within its own limit, the extensions together past the head limit (16 KiB).
    let many: String = (0..20).map(|_| format!("1{ext}\r\nx\r\n")).collect();
    let field = format!("x-t: {}\r\n", "v".repeat(1000));
    let cases = [
        ("extensions adding up past the limit", format!("{many}0\r\n\r\n")),
        ("one extension past the line limit", format!("1;{}\r\nx\r\n0\r\n\r\n", "x".repeat(5000))),
        ("a trailer section past the limit", format!("0\r\n{}\r\n", field.repeat(20))),
        ("too many trailer fields", format!("0\r\n{}\r\n", "x: 1\r\n".repeat(101))),
    ];
    for (what, framing) in cases {
        // A positive answer on the same kind of connection first: the same request, within limits.
        let mut stream = server.connect();
        match raw_exchange(&mut stream, &raw_get("/version")) {
            RawOutcome::Response(r) => assert_eq!(r.status, 200, "{}", r.head),
            other => panic!("no answer to GET /version: {other:?}"),
        }
        let request = format!("POST /version HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n{framing}");
        match raw_exchange(&mut stream, request.as_bytes()) {
            RawOutcome::Response(r) => {
                assert_eq!(r.status, 431, "{what}: {}{}", r.head, r.body);
                let error: serde_json::Value = serde_json::from_str(&r.body).expect("a JSON error");
                let message = error["errorMessage"].as_str().unwrap_or_default();
                assert!(message.contains("chunk extensions and trailer fields"), "{what}: {message}");
            }
            other => panic!("{what}: no answer: {other:?}"),
        }
    }
    server.assert_alive();
}

/// Sends a chunked body to `POST /version` from a second thread (until the server closes) and
/// reads the answer; returns it with the number of bytes the sender got out.
fn chunked_attack(server: &Server, first: Vec<u8>, chunk_data: usize) -> (RawOutcome, usize) {
    let mut stream = server.connect();
    stream.write_all(b"POST /version HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
    let mut writer = stream.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let mut sent = 0;
        if writer.write_all(&first).is_err() {
            return sent;
        }
        let block = vec![b'x'; 64 * 1024];
        while sent < chunk_data {
            match writer.write(&block[..block.len().min(chunk_data - sent)]) {
                Ok(n) if n > 0 => sent += n,
                _ => break,
            }
        }
        sent
    });
    let outcome = read_response(&mut stream);
    drop(stream);
    (outcome, sender.join().unwrap())
}

fn assert_413(outcome: &RawOutcome, what: &str) {
    match outcome {
        RawOutcome::Response(RawResponse { status: 413, body, .. }) => {
            assert!(body.contains("maxBodyBytes"), "413 without a JSON error naming the limit: {body}")
        }
        other => panic!("{what}: expected 413, got {other:?}"),
    }
}

#[test]
fn a_chunked_body_over_the_limit_is_refused_with_413_before_it_is_buffered() {
    let server = Server::start(&["--max-body-bytes", "65536"]);
    // One chunk declared far over the limit: refused on its size line, its data never awaited.
    let (outcome, _) = chunked_attack(&server, b"7fffffff\r\n".to_vec(), 32 * 1024 * 1024);
    assert_413(&outcome, "a chunk declared 7fffffff");
    // Small chunks adding up past the limit.
    let (outcome, _) = chunked_attack(&server, chunks(40, 4096), 0);
    assert_413(&outcome, "chunks adding up past the limit");
    // Within the limit the same framing is accepted (405: POST on /version, body read whole).
    let mut stream = server.connect();
    let mut request = b"POST /version HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    request.extend_from_slice(&chunks(15, 4096));
    request.extend_from_slice(b"0\r\n\r\n");
    match raw_exchange(&mut stream, &request) {
        RawOutcome::Response(r) => assert_eq!(r.status, 405, "{}", r.head),
        other => panic!("no answer to a chunked body within the limit: {other:?}"),
    }
    server.assert_alive();
}

/// `count` chunks of `size` bytes each.
fn chunks(count: usize, size: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..count {
        out.extend_from_slice(format!("{size:x}\r\n").as_bytes());
        out.extend(std::iter::repeat_n(b'x', size));
        out.extend_from_slice(b"\r\n");
    }
    out
}

#[test]
fn empty_lines_before_and_after_a_request_do_not_stall_it() {
    let server = Server::start(&[]);
    let mut stream = server.connect();
    // RFC 9112 §2.2: empty lines before a request line are ignored.
    let mut request = b"\r\n\r\n".to_vec();
    request.extend_from_slice(&raw_get("/version"));
    match raw_exchange(&mut stream, &request) {
        RawOutcome::Response(r) => assert_eq!(r.status, 200, "{}", r.head),
        other => panic!("a request after empty lines was not answered: {other:?}"),
    }
    // Empty lines after a request must not hold back its answer (the idle timeout is 60 s,
    // the read below gives up after 5 s).
    let mut request = raw_get("/version");
    request.extend_from_slice(b"\r\n\r\n\r\n");
    match raw_exchange(&mut stream, &request) {
        RawOutcome::Response(r) => assert_eq!(r.status, 200, "{}", r.head),
        other => panic!("a request followed by empty lines was not answered: {other:?}"),
    }
    // And the connection still serves the next one.
    match raw_exchange(&mut stream, &raw_get("/version")) {
        RawOutcome::Response(r) => assert_eq!(r.status, 200, "{}", r.head),
        other => panic!("no answer after the empty lines: {other:?}"),
    }
}

#[test]
fn head_is_answered_like_get_without_a_body() {
    let server = Server::start(&[]);
    let (_, get_body, _) = server.call_raw("GET", "/version", &[], b"");
    let mut stream = server.connect();
    let mut request = b"HEAD /version HTTP/1.1\r\nHost: a\r\n\r\n".to_vec();
    request.extend_from_slice(&raw_get("/version"));
    stream.write_all(&request).unwrap();
    // Read until the pipelined GET's answer is complete.
    let mut all = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(5);
    while !String::from_utf8_lossy(&all).ends_with(&get_body) {
        assert!(Instant::now() < deadline, "no complete answers: {}", String::from_utf8_lossy(&all));
        let n = stream.read(&mut chunk).expect("read answers");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&all));
        all.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&all);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 "), "HEAD answer: {head}");
    let length = format!("content-length: {}", get_body.len());
    assert!(head.to_ascii_lowercase().contains(&length), "HEAD answer lacks the GET's {length}: {head}");
    assert!(rest.starts_with("HTTP/1.1 200 "), "the HEAD answer carried a body: {rest}");
}

/// Python's http.client sends a body of `body_bytes` to a server limited to `limit` bytes and
/// must read the 413 with its JSON error (it sends the whole body before it reads).
fn python_reads_the_413(limit: &str, body_bytes: usize) {
    let server = Server::start(&["--max-body-bytes", limit]);
    let script = r#"
import http.client, json, sys
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
conn.request("POST", "/ingest", body=b"x" * int(sys.argv[2]), headers={"Content-Type": "application/json"})
r = conn.getresponse()
print(r.status, json.loads(r.read())["errorMessage"])
"#;
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(server.port.to_string())
        .arg(body_bytes.to_string())
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("413 ") && stdout.contains("maxBodyBytes"),
        "python http.client did not read the 413: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    server.assert_alive();
}

#[test]
fn python_http_client_reads_the_413_while_still_sending_its_body() {
    python_reads_the_413("65536", 4 * 1024 * 1024);
}

#[test]
fn python_http_client_reads_the_413_after_sending_20_mib_to_a_1_mib_limit() {
    // The lingering close is bounded by time, not bytes: a client that sends its whole body
    // before reading (http.client, urllib, requests) reads the 413, not a broken pipe.
    python_reads_the_413("1048576", 20 * 1024 * 1024);
}

#[test]
fn a_lingering_close_ends_within_its_time_bound() {
    let server = Server::start(&["--max-body-bytes", "65536"]);
    let mut stream = server.connect();
    stream.write_all(b"POST /version HTTP/1.1\r\nHost: a\r\nContent-Length: 100000000\r\n\r\n").unwrap();
    assert_413(&read_response(&mut stream), "a declared length over the limit");
    // A client that keeps sending a little: read and dropped for at most 5 s (LINGER_TIME in
    // src/http/mod.rs), then the connection is closed and its writes fail.
    let started = Instant::now();
    let block = [b'x'; 1024];
    let failed_after = loop {
        if stream.write_all(&block).is_err() {
            break started.elapsed();
        }
        assert!(started.elapsed() < Duration::from_secs(15), "still lingering after 15 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(failed_after < Duration::from_secs(9), "the lingering close took {failed_after:?}");
    assert!(failed_after > Duration::from_millis(500), "closed at once ({failed_after:?}): no lingering");
    server.assert_alive();
}

#[test]
fn at_most_64_connections_linger_per_core_and_one_more_is_closed_at_once() {
    // One core, so every connection counts against the same budget (LINGER_PER_CORE).
    let server = Server::start(&["--cores", "1", "--max-body-bytes", "65536"]);
    let refused = |what: &str| {
        let mut stream = server.connect();
        stream.write_all(b"POST /version HTTP/1.1\r\nHost: a\r\nContent-Length: 100000000\r\n\r\n").unwrap();
        assert_413(&read_response(&mut stream), what);
        stream
    };
    // How long a client that keeps sending after its 413 can go on (at most `limit`).
    let sends_for = |stream: &mut TcpStream, limit: Duration| {
        let started = Instant::now();
        while started.elapsed() < limit {
            if stream.write_all(&[b'x'; 256]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    };
    // Within the budget a connection lingers (the positive case, on a connection of its own).
    let mut first = refused("the first refused upload");
    let lingered = sends_for(&mut first, Duration::from_millis(1500));
    assert!(lingered >= Duration::from_millis(1500), "a connection within the budget lingers: closed after {lingered:?}");
    drop(first);
    // 64 connections linger at once, kept sending by one thread …
    let mut lingering: Vec<TcpStream> = (0..64).map(|_| refused("a refused upload")).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let feeder = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for stream in &mut lingering {
                    let _ = stream.write_all(&[b'x'; 256]);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    // … so the next one is closed right after its answer: its writes soon fail.
    let mut extra = refused("one refused upload past the budget");
    let closed_after = sends_for(&mut extra, Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    feeder.join().unwrap();
    assert!(closed_after < Duration::from_secs(1), "past the budget the connection lingered for {closed_after:?}");
    server.assert_alive();
}
