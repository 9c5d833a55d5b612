//! Subscriptions: single and bulk, grant checks, set semantics, all-or-nothing validation.

mod common;

use common::*;
use serde_json::{json, Value};

const TYPES: [&str; 4] = ["telemetry", "deviceTwin", "connectionState", "d2cMessages"];

fn request(session: &str, kind_name: &str, device: &str) -> Value {
    if kind_name == "telemetry" {
        with_session(session, telemetry(device, Some("temperature")))
    } else {
        with_session(session, kind(kind_name, device))
    }
}

fn bulk(server: &Server, method: &str, body: Value) -> (u16, Value) {
    server.call_json(method, "/subscriptions", &[], Some(body))
}

/// A session granted every subscription type on d1 and d2.
fn granted_session(server: &Server) -> String {
    let session = server.new_session();
    for device in ["d1", "d2"] {
        server.grant(&session, telemetry(device, None));
        for k in ["deviceTwin", "connectionState", "d2cMessages"] {
            server.grant(&session, kind(k, device));
        }
    }
    session
}

#[test]
fn subscribing_to_each_granted_type_answers_204() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    for t in TYPES {
        let (status, body, _) = server.call("PUT", "/subscription", &[], Some(request(&session, t, "d1")));
        assert_eq!(status, 204, "PUT /subscription {t}: {body}");
        assert!(body.is_empty(), "204 with a body: {body:?}");
    }
}

#[test]
fn subscribing_without_grant_is_403() {
    let server = Server::start(&[]);
    let session = server.new_session();
    for t in TYPES {
        let (status, body, _) = server.call("PUT", "/subscription", &[], Some(request(&session, t, "d1")));
        assert_error(status, &body, 403, "subscription request not granted");
    }
}

#[test]
fn grant_for_one_type_does_not_cover_another() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, kind("deviceTwin", "d1"));
    for t in ["telemetry", "connectionState", "d2cMessages"] {
        let (status, body, _) = server.call("PUT", "/subscription", &[], Some(request(&session, t, "d1")));
        assert_error(status, &body, 403, "not granted");
    }
}

#[test]
fn subscribing_with_unknown_session_is_404() {
    let server = Server::start(&[]);
    for t in TYPES {
        let (status, body, _) =
            server.call("PUT", "/subscription", &[], Some(request("no-such-session-abcdefghij", t, "d1")));
        assert_error(status, &body, 404, "");
        let (status, body, _) =
            server.call("DELETE", "/subscription", &[], Some(request("no-such-session-abcdefghij", t, "d1")));
        assert_error(status, &body, 404, "");
    }
}

#[test]
fn unknown_subscription_type_is_400() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    for t in ["directMethod", "desiredProperties", "bogus"] {
        let (status, body, _) = server.call("PUT", "/subscription", &[], Some(request(&session, t, "d1")));
        assert_error(status, &body, 400, "unknown subscription type");
        let (status, body, _) = server.call("DELETE", "/subscription", &[], Some(request(&session, t, "d1")));
        assert_error(status, &body, 400, "unknown subscription type");
    }
}

#[test]
fn subscriptions_are_a_set() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    for t in TYPES {
        let req = request(&session, t, "d1");
        for round in 1..=2 {
            let (status, body, _) = server.call("PUT", "/subscription", &[], Some(req.clone()));
            assert_eq!(status, 204, "subscribe {t} #{round}: {body}");
        }
        for round in 1..=2 {
            let (status, body, _) = server.call("DELETE", "/subscription", &[], Some(req.clone()));
            assert_eq!(status, 204, "unsubscribe {t} #{round}: {body}");
        }
    }
}

#[test]
fn unsubscribing_needs_the_grant() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let (status, body, _) = server.call("DELETE", "/subscription", &[], Some(request(&session, "deviceTwin", "d1")));
    assert_error(status, &body, 403, "");
}

#[test]
fn bulk_subscribe_answers_the_request_when_all_are_granted() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    let items = json!([
        with_session(&session, telemetry("d1", Some("temperature"))),
        with_session(&session, telemetry("d1", None)),
        with_session(&session, kind("deviceTwin", "d1")),
        with_session(&session, kind("connectionState", "d2")),
        with_session(&session, kind("d2cMessages", "d2")),
    ]);
    let (status, applied) = bulk(&server, "PUT", items.clone());
    assert_eq!(status, 200, "{applied}");
    assert_eq!(applied, items);
}

#[test]
fn bulk_subscribe_accepts_the_admin_sdk_body_shape() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    let items = json!([
        with_session(&session, telemetry("d1", Some("temperature"))),
        with_session(&session, kind("deviceTwin", "d2")),
    ]);
    let body = json!({"subscriptionRequests": items});
    let (status, text, _) = server.call("PUT", "/subscriptions", &[("sessionId", &session)], Some(body));
    assert_eq!(status, 200, "{text}");
    assert_eq!(parse_json(&text), items);
}

#[test]
fn bulk_subscribe_skips_ungranted_requests() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("a")));
    server.grant(&session, kind("deviceTwin", "d2"));
    let granted_a = with_session(&session, telemetry("d1", Some("a")));
    let granted_twin = with_session(&session, kind("deviceTwin", "d2"));
    let items = json!([
        granted_a,
        with_session(&session, telemetry("d1", Some("b"))),
        with_session(&session, kind("connectionState", "d2")),
        granted_twin,
        with_session(&session, telemetry("d3", None)),
    ]);
    let (status, applied) = bulk(&server, "PUT", items);
    assert_eq!(status, 200, "{applied}");
    assert_eq!(applied, json!([granted_a, granted_twin]));
}

#[test]
fn bulk_subscribe_with_an_invalid_element_fails_whole() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    let valid = with_session(&session, telemetry("d1", Some("temperature")));
    let invalid_elements = [
        json!({"sessionId": session, "type": "telemetry", "telemetryKey": "t"}), // no deviceId
        json!({"sessionId": session, "deviceId": "d1", "type": "bogus"}),
        json!({"sessionId": session, "deviceId": 5, "type": "deviceTwin"}),
        json!({"sessionId": session, "deviceId": "d1"}), // no type
        json!({"sessionId": session, "deviceId": "d1", "type": "telemetry", "telemetryKey": 7}),
        json!("not an object"),
        json!(5),
    ];
    for invalid in invalid_elements {
        for method in ["PUT", "DELETE"] {
            let body = json!([valid, invalid]);
            let (status, text, _) = server.call(method, "/subscriptions", &[], Some(body.clone()));
            assert_eq!(status, 400, "{method} /subscriptions {body}: {text}");
            error_message(&text);
        }
    }
    // The server is consistent afterwards: the valid element alone is applied and echoed.
    let (status, applied) = bulk(&server, "PUT", json!([valid]));
    assert_eq!((status, applied), (200, json!([valid])));
    let (status, removed) = bulk(&server, "DELETE", json!([valid]));
    assert_eq!((status, removed), (200, json!([valid])));
}

#[test]
fn bulk_body_that_is_not_a_list_is_400() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    for body in [json!({"sessionId": session}), json!(5), json!({"subscriptionRequests": 5})] {
        let (status, text, _) = server.call("PUT", "/subscriptions", &[], Some(body.clone()));
        assert_eq!(status, 400, "PUT /subscriptions {body}: {text}");
        error_message(&text);
    }
}

#[test]
fn bulk_with_empty_list_answers_empty_list() {
    let server = Server::start(&[]);
    for method in ["PUT", "DELETE"] {
        let (status, applied) = bulk(&server, method, json!([]));
        assert_eq!((status, applied), (200, json!([])), "{method} /subscriptions []");
    }
    let (status, applied) = bulk(&server, "PUT", json!({"subscriptionRequests": []}));
    assert_eq!((status, applied), (200, json!([])));
}

#[test]
fn bulk_unsubscribe_mirrors_bulk_subscribe() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", None));
    server.grant(&session, kind("connectionState", "d1"));
    let items = json!([
        with_session(&session, telemetry("d1", Some("a"))),
        with_session(&session, kind("connectionState", "d1")),
    ]);
    let (status, applied) = bulk(&server, "PUT", items.clone());
    assert_eq!((status, applied), (200, items.clone()));
    let (status, removed) = bulk(&server, "DELETE", items.clone());
    assert_eq!((status, removed), (200, items.clone()));

    // Ungranted items are skipped on removal too.
    let mut with_ungranted = items.as_array().unwrap().clone();
    with_ungranted.push(with_session(&session, kind("deviceTwin", "d1")));
    let (status, removed) = bulk(&server, "DELETE", Value::Array(with_ungranted));
    assert_eq!((status, removed), (200, items));
}

#[test]
fn bulk_unsubscribe_accepts_the_session_header_with_a_bare_list() {
    let server = Server::start(&[]);
    let session = granted_session(&server);
    let items = json!([with_session(&session, kind("deviceTwin", "d1"))]);
    let (status, text, _) = server.call("DELETE", "/subscriptions", &[("sessionId", &session)], Some(items.clone()));
    assert_eq!(status, 200, "{text}");
    assert_eq!(parse_json(&text), items);
}
