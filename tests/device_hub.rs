//! Device hub actions (direct methods, desired-property patches): disabled without a service
//! connection string, and guarded by grants when one is configured.

mod common;

use common::*;
use serde_json::json;

/// A well-formed IoT Hub service connection string (the hub is never contacted by these tests:
/// every request below is refused before any hub call).
const SERVICE: &str = "HostName=127.0.0.1;SharedAccessKeyName=iothubowner;SharedAccessKey=a2V5";

fn direct_method(server: &Server, session: &str, method: &str) -> (u16, String) {
    let body = json!({"deviceId": "d1", "methodParams": {"methodName": method}});
    let (status, text, _) = server.call("POST", "/directMethod", &[("sessionId", session)], Some(body));
    (status, text)
}

fn patch_desired(server: &Server, session: &str) -> (u16, String) {
    let body = json!({"deviceId": "d1", "desiredPropertyPatch": {"a": 1}});
    let (status, text, _) =
        server.call("PATCH", "/deviceTwinDesiredProperties", &[("sessionId", session)], Some(body));
    (status, text)
}

#[test]
fn direct_method_is_400_without_service_connection_string() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let (status, body) = direct_method(&server, &session, "reboot");
    assert_error(status, &body, 400, "IoT Hub API disabled");
}

#[test]
fn desired_properties_patch_is_400_without_service_connection_string() {
    let server = Server::start(&[]);
    let session = server.new_session();
    let (status, body) = patch_desired(&server, &session);
    assert_error(status, &body, 400, "IoT Hub API disabled");
}

#[test]
fn direct_method_needs_a_direct_method_grant() {
    let server = Server::start(&["--iot-hub-service-connection-string", SERVICE]);
    let session = server.new_session();
    let (status, body) = direct_method(&server, &session, "reboot");
    assert_error(status, &body, 403, "");
    // A grant for another method does not cover this one.
    server.grant(&session, json!({"type": "directMethod", "deviceId": "d1", "directMethodName": "reset"}));
    let (status, body) = direct_method(&server, &session, "reboot");
    assert_error(status, &body, 403, "");
}

#[test]
fn desired_properties_patch_needs_a_desired_properties_grant() {
    let server = Server::start(&["--iot-hub-service-connection-string", SERVICE]);
    let session = server.new_session();
    server.grant(&session, kind("deviceTwin", "d1")); // the wrong kind
    let (status, body) = patch_desired(&server, &session);
    assert_error(status, &body, 403, "");
}

#[test]
fn direct_method_with_unknown_session_is_404() {
    let server = Server::start(&["--iot-hub-service-connection-string", SERVICE]);
    let (status, body) = direct_method(&server, "no-such-session-abcdefghij", "reboot");
    assert_error(status, &body, 404, "");
}
