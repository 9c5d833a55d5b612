//! Grants: forwarding and revoking permissions, wildcards, legacy names, auth and errors.

mod common;

use common::*;
use serde_json::{json, Value};

/// A well-formed IoT Hub service connection string (the hub is never contacted by these tests).
const SERVICE: &str = "HostName=127.0.0.1;SharedAccessKeyName=iothubowner;SharedAccessKey=a2V5";

fn bulk_subscribe(server: &Server, items: &[Value]) -> (u16, Value) {
    server.call_json("PUT", "/subscriptions", &[], Some(Value::Array(items.to_vec())))
}

#[test]
fn subscription_grant_types_answer_204_with_empty_body() {
    let server = Server::start(&[]);
    let session = server.new_session();
    for grant in [
        telemetry("d1", Some("temperature")),
        telemetry("d1", None),
        kind("connectionState", "d1"),
        kind("d2cMessages", "d1"),
    ] {
        server.grant(&session, grant); // asserts 204 and an empty body
    }
}

#[test]
fn hub_grant_types_are_400_without_service_connection_string() {
    let server = Server::start(&[]);
    let session = server.new_session();
    for grant in [
        json!({"type": "directMethod", "deviceId": "d1", "directMethodName": "reboot"}),
        json!({"type": "directMethod", "deviceId": "d1", "directMethodName": null}),
        kind("desiredProperties", "d1"),
        kind("deviceTwin", "d1"), // the twin is read from the hub
    ] {
        let (status, body) = server.try_grant(&session, grant.clone());
        assert_error(status, &body, 400, "IoT Hub API disabled");
    }
}

#[test]
fn hub_grant_types_answer_204_with_service_connection_string() {
    let server = Server::start(&["--iot-hub-service-connection-string", SERVICE]);
    let session = server.new_session();
    server.grant(&session, json!({"type": "directMethod", "deviceId": "d1", "directMethodName": "reboot"}));
    server.grant(&session, json!({"type": "directMethod", "deviceId": "d1", "directMethodName": null}));
    server.grant(&session, kind("desiredProperties", "d1"));
    server.grant(&session, kind("deviceTwin", "d1"));
}

#[test]
fn unknown_grant_type_is_400() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let (status, body) = server.try_grant(&session, kind("bogus", "d1"));
    assert_error(status, &body, 400, "unknown grant type");
}

#[test]
fn grants_require_a_valid_admin_key() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let body = with_session(&session, telemetry("d1", None));
    for method in ["PUT", "DELETE"] {
        for headers in [&[][..], &[("Shared-Access-Key", "wrong")][..]] {
            let (status, text, _) = server.call(method, "/grants", headers, Some(body.clone()));
            assert_eq!(status, 401, "{method} /grants with {headers:?}: {text}");
            let msg = error_message(&text);
            assert!(msg.starts_with("Unauthorized: "), "errorMessage {msg:?}");
        }
    }
    // The refused grant was not stored.
    assert_eq!(server.subscribe(&session, telemetry("d1", None)).0, 403);
}

#[test]
fn secondary_key_is_accepted_for_grants() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let body = with_session(&session, telemetry("d1", None));
    let (status, text, _) = server.call("PUT", "/grants", &[("Shared-Access-Key", SECONDARY_KEY)], Some(body));
    assert_eq!(status, 204, "{text}");
}

#[test]
fn grant_for_unknown_session_is_404() {
    let server = Server::start(&[]);
    let (status, body) = server.try_grant("no-such-session-abcdefghij", telemetry("d1", None));
    assert_error(status, &body, 404, "");
}

/// ux4iot 2.x grants also subscribed; 3.x grants only permit. A 2.x grant quietly taken as
/// permission would leave a 2.x client waiting for data, so each one is refused with 400 naming
/// the 3.x type, and grants nothing.
#[test]
fn legacy_grant_types_are_refused_naming_the_current_type() {
    let server = Server::start(&["--iot-hub-service-connection-string", SERVICE]); // for the hub types
    let session = server.new_session();
    for (legacy, current) in [
        ("subscribeToTelemetry", "telemetry"),
        ("subscribeToConnectionState", "connectionState"),
        ("subscribeToDeviceTwin", "deviceTwin"),
        ("subscribeToD2CMessages", "d2cMessages"),
        ("modifyDesiredProperties", "desiredProperties"),
        ("invokeDirectMethod", "directMethod"),
    ] {
        let device = format!("dev-{current}");
        for field in ["grantType", "type"] {
            let grant = json!({field: legacy, "sessionId": session, "deviceId": device});
            let (status, body, _) = server.call("PUT", "/grants", &[ADMIN], Some(grant.clone()));
            assert_error(status, &body, 400, &format!(r#"send {{"type": "{current}"}} instead"#));
            assert_error(status, &body, 400, legacy);
            let (status, body, _) = server.call("DELETE", "/grants", &[ADMIN], Some(grant));
            assert_error(status, &body, 400, "ux4iot 2.x grant");
        }
        if ["telemetry", "connectionState", "deviceTwin", "d2cMessages"].contains(&current) {
            let (status, body) = server.subscribe(&session, kind(current, &device));
            assert_error(status, &body, 403, "not granted");
        }
    }
    // The 3.x type under the 2.x key is refused the same way.
    let grant = json!({"grantType": "telemetry", "sessionId": session, "deviceId": "d1"});
    let (status, body, _) = server.call("PUT", "/grants", &[ADMIN], Some(grant));
    assert_error(status, &body, 400, r#"send {"type": "telemetry"} instead"#);
    // The same request in the 3.x form is granted.
    server.grant(&session, json!({"type": "telemetry", "deviceId": "d1", "telemetryKey": "temperature"}));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("temperature"))).0, 204);
}

#[test]
fn revoking_a_grant_answers_204_and_withdraws_it() {
    let server = Server::start(&["--iot-hub-service-connection-string", SERVICE]);
    let session = server.new_session();
    server.grant(&session, kind("deviceTwin", "d1"));
    let (status, body) = server.try_revoke(&session, kind("deviceTwin", "d1"));
    assert_eq!(status, 204, "DELETE /grants: {body}");
    assert!(body.is_empty(), "DELETE /grants answered 204 with a body: {body:?}");
    let (status, body) = server.subscribe(&session, kind("deviceTwin", "d1"));
    assert_error(status, &body, 403, "not granted");
}

#[test]
fn null_telemetry_key_grant_covers_every_key() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", None));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("temperature"))).0, 204);
    assert_eq!(server.subscribe(&session, telemetry("d1", None)).0, 204);
    // Only for that device.
    assert_eq!(server.subscribe(&session, telemetry("d2", Some("temperature"))).0, 403);
}

#[test]
fn absent_telemetry_key_grant_is_a_wildcard() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, json!({"type": "telemetry", "deviceId": "d1"}));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("temperature"))).0, 204);
    assert_eq!(server.subscribe(&session, telemetry("d1", None)).0, 204);
    assert_eq!(server.subscribe(&session, json!({"type": "telemetry", "deviceId": "d1"})).0, 204);
}

#[test]
fn per_key_grant_covers_only_that_key() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("a")));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("a"))).0, 204);
    let (status, body) = server.subscribe(&session, telemetry("d1", Some("b")));
    assert_error(status, &body, 403, "not granted");
    let (status, body) = server.subscribe(&session, telemetry("d1", None));
    assert_error(status, &body, 403, "not granted");
}

#[test]
fn grants_are_per_session() {
    let server = Server::start(&[]);
    let granted = server.new_session();
    let other = server.new_session();
    server.grant(&granted, telemetry("d1", None));
    assert_eq!(server.subscribe(&other, telemetry("d1", Some("a"))).0, 403);
}

#[test]
fn revoking_the_wildcard_withdraws_subscriptions_it_covered() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", None));
    let items = vec![
        with_session(&session, telemetry("d1", Some("a"))),
        with_session(&session, telemetry("d1", Some("b"))),
    ];
    let (status, applied) = bulk_subscribe(&server, &items);
    assert_eq!((status, applied), (200, Value::Array(items.clone())));

    server.revoke(&session, telemetry("d1", None));

    let (status, body) = server.unsubscribe(&session, telemetry("d1", Some("a")));
    assert_error(status, &body, 403, "");
    let (status, applied) = bulk_subscribe(&server, &items);
    assert_eq!((status, applied), (200, json!([])), "no subscription may be applied after the revoke");
    let (status, removed) = server.call_json("DELETE", "/subscriptions", &[], Some(Value::Array(items)));
    assert_eq!((status, removed), (200, json!([])));
}

#[test]
fn revoking_a_per_key_grant_keeps_the_other_keys() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("a")));
    server.grant(&session, telemetry("d1", Some("b")));
    server.revoke(&session, telemetry("d1", Some("a")));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("a"))).0, 403);
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("b"))).0, 204);
}

#[test]
fn revoking_with_null_key_removes_all_telemetry_grants_of_the_device() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", None));
    server.grant(&session, telemetry("d1", Some("a")));
    server.grant(&session, telemetry("d1", Some("b")));
    server.grant(&session, telemetry("d2", Some("a")));
    server.revoke(&session, telemetry("d1", None));
    for key in [Some("a"), Some("b"), Some("c"), None] {
        let (status, body) = server.subscribe(&session, telemetry("d1", key));
        assert_eq!(status, 403, "d1/{key:?} after revoking all telemetry grants: {body}");
    }
    // Another device keeps its grant.
    assert_eq!(server.subscribe(&session, telemetry("d2", Some("a"))).0, 204);
}

#[test]
fn revoking_another_kind_leaves_telemetry_intact() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("a")));
    server.grant(&session, kind("connectionState", "d1"));
    server.revoke(&session, kind("connectionState", "d1"));
    assert_eq!(server.subscribe(&session, kind("connectionState", "d1")).0, 403);
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("a"))).0, 204);
}

#[test]
fn granting_twice_is_harmless() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("a")));
    server.grant(&session, telemetry("d1", Some("a")));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("a"))).0, 204);
    // One revoke withdraws it: grants are a set, not counted.
    server.revoke(&session, telemetry("d1", Some("a")));
    assert_eq!(server.subscribe(&session, telemetry("d1", Some("a"))).0, 403);
}
