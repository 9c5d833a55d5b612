//! HTTP edges: CORS, malformed and oversized input, unknown routes and methods, raw garbage on
//! the socket, oversized heads, and the connection limit. After each bad request the server
//! keeps serving and its state is unchanged.

mod common;

use common::*;
use serde_json::json;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn contains_token(list: &str, token: &str) -> bool {
    list.split(',').any(|t| t.trim() == "*" || t.trim().eq_ignore_ascii_case(token))
}

/// A server with one session holding a telemetry grant for d1; returns the session.
fn server_with_grant(args: &[&str]) -> (Server, String) {
    let server = Server::start(args);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("t")));
    (server, session)
}

/// The grant made by [`server_with_grant`] still works, and the server is alive.
fn assert_state_intact(server: &Server, session: &str) {
    server.assert_alive();
    let (status, body) = server.subscribe(session, telemetry("d1", Some("t")));
    assert_eq!(status, 204, "the existing grant must still work: {body}");
}

#[test]
fn cors_preflight_allows_the_client_methods_and_headers() {
    let server = Server::start(&[]);
    let (status, body, headers) = server.call(
        "OPTIONS",
        "/grants",
        &[
            ("Origin", "http://example.com"),
            ("Access-Control-Request-Method", "PUT"),
            ("Access-Control-Request-Headers", "shared-access-key,content-type"),
        ],
        None,
    );
    assert!(status == 204 || status == 200, "preflight answered {status}: {body}");
    assert!(headers.get("Access-Control-Allow-Origin").is_some(), "no Allow-Origin: {headers:?}");
    let methods = headers.joined("Access-Control-Allow-Methods").unwrap_or_default();
    for m in ["GET", "PUT", "POST", "PATCH", "DELETE"] {
        assert!(contains_token(&methods, m), "Allow-Methods {methods:?} lacks {m}");
    }
    let allowed = headers.joined("Access-Control-Allow-Headers").unwrap_or_default();
    for h in ["Shared-Access-Key", "Content-Type"] {
        assert!(contains_token(&allowed, h), "Allow-Headers {allowed:?} lacks {h}");
    }
}

#[test]
fn cors_preflight_allows_the_session_id_header() {
    let server = Server::start(&[]);
    let (status, body, headers) = server.call(
        "OPTIONS",
        "/lastValue/d1/t",
        &[
            ("Origin", "http://example.com"),
            ("Access-Control-Request-Method", "GET"),
            ("Access-Control-Request-Headers", "sessionid"),
        ],
        None,
    );
    assert!(status == 204 || status == 200, "preflight answered {status}: {body}");
    assert!(headers.get("Access-Control-Allow-Origin").is_some(), "no Allow-Origin: {headers:?}");
    let allowed = headers.joined("Access-Control-Allow-Headers").unwrap_or_default();
    assert!(contains_token(&allowed, "sessionId"), "Allow-Headers {allowed:?} lacks sessionId");
}

#[test]
fn cors_origin_header_on_normal_and_error_responses() {
    let server = Server::start(&[]);
    let origin = [("Origin", "http://example.com")];
    let (status, _, headers) = server.call("GET", "/version", &origin, None);
    assert_eq!(status, 200);
    assert!(headers.get("Access-Control-Allow-Origin").is_some(), "GET /version: {headers:?}");
    let (status, _, headers) = server.call("GET", "/lastValue/nobody/t", &origin, None);
    assert_eq!(status, 401);
    assert!(headers.get("Access-Control-Allow-Origin").is_some(), "401 answer: {headers:?}");
}

#[test]
fn malformed_json_is_400() {
    let (server, session) = server_with_grant(&[]);
    for (method, path) in [("PUT", "/grants"), ("PUT", "/subscription"), ("PUT", "/subscriptions"), ("POST", "/ingest")] {
        let (status, body, _) = server.call_raw(method, path, &[ADMIN], b"{\"sessionId\": \"x\", ");
        assert_eq!(status, 400, "{method} {path} with malformed JSON: {body}");
        error_message(&body);
    }
    let (status, body, _) = server.call_raw("PUT", "/grants", &[ADMIN], b"");
    assert_eq!(status, 400, "PUT /grants with an empty body: {body}");
    error_message(&body);
    assert_state_intact(&server, &session);
}

#[test]
fn wrong_field_types_are_400() {
    let (server, session) = server_with_grant(&[]);
    let bad = [
        json!({"sessionId": session, "deviceId": 5, "type": "telemetry"}),
        json!({"sessionId": session, "deviceId": "d1", "type": 5}),
        json!({"sessionId": 5, "deviceId": "d1", "type": "telemetry"}),
        json!({"sessionId": session, "deviceId": "d1", "type": "telemetry", "telemetryKey": 5}),
        json!([1, 2]),
    ];
    for body in &bad {
        for path in ["/grants", "/subscription"] {
            let (status, text, _) = server.call("PUT", path, &[ADMIN], Some(body.clone()));
            assert_eq!(status, 400, "PUT {path} {body}: {text}");
            error_message(&text);
        }
    }
    assert_state_intact(&server, &session);
}

#[test]
fn missing_fields_are_400() {
    let (server, session) = server_with_grant(&[]);
    let bad = [
        json!({"sessionId": session, "type": "telemetry"}),
        json!({"sessionId": session, "deviceId": "d1"}),
        json!({"deviceId": "d1", "type": "telemetry"}),
        json!({}),
    ];
    for body in &bad {
        for (method, path) in [("PUT", "/grants"), ("DELETE", "/grants"), ("PUT", "/subscription"), ("DELETE", "/subscription")] {
            let (status, text, _) = server.call(method, path, &[ADMIN], Some(body.clone()));
            assert_eq!(status, 400, "{method} {path} {body}: {text}");
            error_message(&text);
        }
    }
    assert_state_intact(&server, &session);
}

#[test]
fn body_over_the_limit_is_413() {
    let (server, session) = server_with_grant(&["--max-body-bytes", "1024"]);
    let padding = "x".repeat(2000);
    let body = json!({"sessionId": session, "deviceId": "d1", "type": "telemetry", "telemetryKey": "t", "pad": padding});
    let bytes = serde_json::to_vec(&body).unwrap();
    match server.try_call_raw("PUT", "/grants", &[ADMIN], &bytes) {
        Ok((status, text, _)) => {
            assert_eq!(status, 413, "PUT /grants with {} bytes: {text}", bytes.len());
            error_message(&text);
        }
        Err(e) => panic!("expected a 413 answer, the connection failed instead: {e}"),
    }
    assert_state_intact(&server, &session);
}

#[test]
fn device_id_longer_than_128_bytes_is_400() {
    let (server, session) = server_with_grant(&[]);
    let long = "d".repeat(129);
    let (status, body) = server.try_grant(&session, kind("connectionState", &long));
    assert_error(status, &body, 400, "");
    let (status, body) = server.subscribe(&session, kind("connectionState", &long));
    assert_error(status, &body, 400, "");
    let (status, body, _) = server.call("POST", "/ingest", &[ADMIN], Some(json!({"deviceId": long, "body": {"t": 1}})));
    assert_error(status, &body, 400, "");
    // Exactly 128 bytes is fine.
    let max = "d".repeat(128);
    server.grant(&session, kind("connectionState", &max));
    assert_eq!(server.subscribe(&session, kind("connectionState", &max)).0, 204);
    assert_state_intact(&server, &session);
}

#[test]
fn telemetry_key_longer_than_256_bytes_is_400() {
    let (server, session) = server_with_grant(&[]);
    let long = "k".repeat(257);
    let (status, body) = server.try_grant(&session, telemetry("d1", Some(&long)));
    assert_error(status, &body, 400, "");
    let (status, body) = server.subscribe(&session, telemetry("d1", Some(&long)));
    assert_error(status, &body, 400, "");
    // Exactly 256 bytes is fine.
    let max = "k".repeat(256);
    server.grant(&session, telemetry("d1", Some(&max)));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some(&max))).0, 204);
    assert_state_intact(&server, &session);
}

#[test]
fn unknown_route_is_404() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("GET", "/nope", &[], None);
    assert_error(status, &body, 404, "");
    server.assert_alive();
}

#[test]
fn wrong_method_is_405_with_allow_header() {
    let server = Server::start(&[]);
    let (status, body, headers) = server.call("PATCH", "/grants", &[ADMIN], Some(json!({})));
    assert_eq!(status, 405, "PATCH /grants: {body}");
    error_message(&body);
    let allow = headers.joined("Allow").unwrap_or_else(|| panic!("405 without Allow header: {headers:?}"));
    assert!(contains_token(&allow, "PUT") && contains_token(&allow, "DELETE"), "Allow: {allow}");
    server.assert_alive();
}

#[test]
fn garbage_bytes_get_400_or_close_and_server_keeps_serving() {
    let server = Server::start(&[]);
    let mut stream = server.connect();
    match raw_exchange(&mut stream, b"GARBAGE\r\n\r\n") {
        RawOutcome::Response(r) => assert_eq!(r.status, 400, "answer to garbage: {}{}", r.head, r.body),
        RawOutcome::Closed => {}
        RawOutcome::TimedOut => panic!("the server neither answered nor closed a garbage connection"),
    }
    drop(stream);
    server.assert_alive();
}

fn assert_head_refused(outcome: RawOutcome, how: &str) {
    match outcome {
        RawOutcome::Response(r) => assert_eq!(r.status, 431, "answer to a 20 KiB head sent {how}: {}", r.head),
        RawOutcome::Closed => {}
        RawOutcome::TimedOut => panic!("the server neither answered nor closed a 20 KiB head sent {how}"),
    }
}

#[test]
fn oversized_request_head_gets_431_or_close_and_server_keeps_serving() {
    let server = Server::start(&[]);
    let request = format!("GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {}\r\n\r\n", "a".repeat(20 * 1024));

    // Arriving in pieces: the head is still incomplete when it passes the limit.
    let mut stream = server.connect();
    let (first, rest) = request.as_bytes().split_at(17 * 1024);
    let _ = stream.write_all(first);
    // A deliberately slow client: the pause makes the server read the head in two parts.
    std::thread::sleep(Duration::from_millis(200));
    assert_head_refused(raw_exchange(&mut stream, rest), "in two writes");
    drop(stream);
    server.assert_alive();

    // Arriving at once: the complete head is over the limit too.
    let mut stream = server.connect();
    assert_head_refused(raw_exchange(&mut stream, request.as_bytes()), "in one write");
    drop(stream);
    server.assert_alive();
}

#[test]
fn connections_over_the_limit_are_refused_while_others_keep_working() {
    let server = Server::start(&["--max-connections", "2", "--cores", "1"]);
    let mut first = server.connect();
    let mut second = server.connect();
    for (name, stream) in [("first", &mut first), ("second", &mut second)] {
        match raw_exchange(stream, &raw_get("/version")) {
            RawOutcome::Response(r) => assert_eq!(r.status, 200, "{name} connection: {}", r.head),
            other => panic!("{name} connection got no answer: {other:?}"),
        }
    }

    let mut third = server.connect();
    match raw_exchange(&mut third, &raw_get("/version")) {
        RawOutcome::Response(r) => assert_eq!(r.status, 503, "third connection: {}{}", r.head, r.body),
        RawOutcome::Closed => {}
        RawOutcome::TimedOut => panic!("the third connection was neither refused (503) nor closed"),
    }
    drop(third);

    for (name, stream) in [("first", &mut first), ("second", &mut second)] {
        match raw_exchange(stream, &raw_get("/version")) {
            RawOutcome::Response(r) => assert_eq!(r.status, 200, "{name} connection after the refusal: {}", r.head),
            other => panic!("{name} connection stopped working: {other:?}"),
        }
    }

    // Closing one frees its slot for a new connection.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let mut next = server.connect();
        match raw_exchange(&mut next, &raw_get("/version")) {
            RawOutcome::Response(r) if r.status == 200 => break,
            outcome => {
                assert!(Instant::now() < deadline, "no new connection served after closing one: {outcome:?}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[test]
fn expect_100_continue_is_answered_and_an_oversized_body_refused_before_it_is_sent() {
    let server = Server::start(&["--max-body-bytes", "1024"]);
    let mut stream = server.connect();
    let body = br#"{"deviceId":"d1","body":{"t":1}}"#;
    let head = format!(
        "POST /ingest HTTP/1.1\r\nhost: x\r\nshared-access-key: {ADMIN_KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nexpect: 100-continue\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut interim = [0u8; 25];
    stream.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(body).unwrap();
    match read_response(&mut stream) {
        RawOutcome::Response(r) => assert_eq!(r.status, 200, "{}", r.body),
        other => panic!("no answer: {other:?}"),
    }
    let mut big = server.connect();
    let head = format!(
        "POST /ingest HTTP/1.1\r\nhost: x\r\nshared-access-key: {ADMIN_KEY}\r\ncontent-length: 5000\r\nexpect: 100-continue\r\n\r\n"
    );
    match raw_exchange(&mut big, head.as_bytes()) {
        RawOutcome::Response(r) => assert_eq!(r.status, 413),
        other => panic!("expected 413 without sending the body: {other:?}"),
    }
}
