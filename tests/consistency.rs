//! Cross-core consistency: with several cores, separate connections land on different cores
//! (SO_REUSEPORT), yet every request sees every earlier write, whichever core served it.

mod common;

use common::*;
use serde_json::{json, Value};
use std::sync::Arc;

#[test]
fn parallel_sessions_see_their_own_grants_subscriptions_and_values() {
    let server = Arc::new(Server::start(&["--cores", "2"]));
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let server = server.clone();
            std::thread::spawn(move || {
                let agent = new_agent();
                let devices: Vec<String> = (0..10).map(|i| format!("t{t}-dev{i}")).collect();
                let session = server.new_session_on(&agent);
                for device in &devices {
                    // A fresh connection for every grant: the grant may land on any core.
                    server.grant_on(&new_agent(), &session, telemetry(device, None));
                }
                let batch: Vec<Value> = devices
                    .iter()
                    .enumerate()
                    .map(|(i, d)| json!({"deviceId": d, "body": {"value": t * 100 + i, "thread": t}}))
                    .collect();
                assert_eq!(server.ingest_on(&new_agent(), Value::Array(batch)), 10);

                let requests: Vec<Value> =
                    devices.iter().map(|d| with_session(&session, telemetry(d, Some("value")))).collect();
                let (status, text, _) =
                    server.call_on(&agent, "PUT", "/subscriptions", &[], Some(Value::Array(requests.clone())));
                assert_eq!(status, 200, "thread {t}: bulk subscribe: {text}");
                assert_eq!(parse_json(&text), Value::Array(requests), "thread {t}: every request is granted");

                for (i, device) in devices.iter().enumerate() {
                    let reader = new_agent();
                    let (status, text, _) = server.call_on(
                        &reader,
                        "GET",
                        &format!("/lastValue/{device}/value"),
                        &[("sessionId", &session)],
                        None,
                    );
                    assert_eq!(status, 200, "thread {t}: GET /lastValue/{device}/value: {text}");
                    assert_eq!(parse_json(&text)["data"], json!({"value": t * 100 + i}), "thread {t}");
                    let (status, text, _) = server.call_on(
                        &reader,
                        "GET",
                        &format!("/lastValue/{device}"),
                        &[("sessionId", &session)],
                        None,
                    );
                    assert_eq!(status, 200, "thread {t}: GET /lastValue/{device}: {text}");
                    let data = parse_json(&text)["data"].clone();
                    assert_eq!(data["value"]["value"], json!(t * 100 + i), "thread {t}: {data}");
                    assert_eq!(data["thread"]["value"], json!(t), "thread {t}: {data}");
                }
                // A device of another thread is not granted to this session.
                let other = format!("t{}-dev0", (t + 1) % 16);
                let (status, text, _) = server.call_on(
                    &new_agent(),
                    "GET",
                    &format!("/lastValue/{other}/value"),
                    &[("sessionId", &session)],
                    None,
                );
                assert_eq!(status, 403, "thread {t}: foreign device must not be readable: {text}");
            })
        })
        .collect();
    for (t, handle) in threads.into_iter().enumerate() {
        if let Err(panic) = handle.join() {
            std::panic::resume_unwind(Box::new(format!("thread {t} failed: {:?}", panic_text(&panic))));
        }
    }
}

#[test]
fn a_grant_is_visible_from_every_connection() {
    let server = Arc::new(Server::start(&["--cores", "2"]));
    // Several sessions, so that both cores own some of them.
    let sessions: Vec<String> = (0..8)
        .map(|i| {
            let agent = new_agent();
            let session = server.new_session_on(&agent);
            server.grant_on(&agent, &session, telemetry(&format!("dev{i}"), Some("t")));
            session
        })
        .collect();
    let sessions = Arc::new(sessions);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let server = server.clone();
            let sessions = sessions.clone();
            std::thread::spawn(move || {
                for (i, session) in sessions.iter().enumerate() {
                    let (status, body) =
                        server.subscribe_on(&new_agent(), session, telemetry(&format!("dev{i}"), Some("t")));
                    assert_eq!(status, 204, "session {i} subscription over a fresh connection: {body}");
                }
            })
        })
        .collect();
    for (t, handle) in threads.into_iter().enumerate() {
        if let Err(panic) = handle.join() {
            std::panic::resume_unwind(Box::new(format!("thread {t} failed: {:?}", panic_text(&panic))));
        }
    }
}

#[test]
fn ingested_values_are_visible_from_every_connection() {
    let server = Arc::new(Server::start(&["--cores", "2"]));
    let batch: Vec<Value> = (0..200).map(|i| json!({"deviceId": format!("dev{i}"), "body": {"v": i}})).collect();
    assert_eq!(server.ingest(Value::Array(batch)), 200);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let server = server.clone();
            std::thread::spawn(move || {
                let agent = new_agent();
                for i in 0..200 {
                    let (status, text, _) =
                        server.call_on(&agent, "GET", &format!("/lastValue/dev{i}/v"), &[ADMIN], None);
                    assert_eq!(status, 200, "GET /lastValue/dev{i}/v: {text}");
                    assert_eq!(parse_json(&text)["data"], json!({"v": i}));
                }
            })
        })
        .collect();
    for (t, handle) in threads.into_iter().enumerate() {
        if let Err(panic) = handle.join() {
            std::panic::resume_unwind(Box::new(format!("thread {t} failed: {:?}", panic_text(&panic))));
        }
    }
}

#[test]
fn an_ingest_is_visible_to_the_next_request_on_another_connection() {
    let server = Server::start(&["--cores", "2"]);
    for i in 0..50 {
        let writer = new_agent();
        let reader = new_agent();
        server.ingest_on(&writer, json!({"deviceId": "d1", "body": {"n": i}}));
        let (status, text, _) = server.call_on(&reader, "GET", "/lastValue/d1/n", &[ADMIN], None);
        assert_eq!(status, 200, "{text}");
        assert_eq!(parse_json(&text)["data"], json!({"n": i}), "read-after-write across connections");
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else {
        "<non-string panic>".into()
    }
}
