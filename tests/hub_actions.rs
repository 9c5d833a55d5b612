//! Device hub actions against a local IoT Hub double: direct methods and desired-property
//! patches reach the hub with the right request, only for callers with the grant (or the
//! key), and the hub's answers and errors come back to the caller.

mod common;
mod hub_double;

use common::*;
use hub_double::{Answer, HubDouble};
use serde_json::{json, Value};

fn start(hub: &HubDouble, extra: &[&str]) -> Server {
    let mut args: Vec<String> = hub.args();
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(&args)
}

fn method_grant(device: &str, method: Option<&str>) -> Value {
    json!({"type": "directMethod", "deviceId": device, "directMethodName": method})
}

fn invoke(server: &Server, headers: &[(&str, &str)], device: &str, params: Value) -> (u16, String) {
    let body = json!({"deviceId": device, "methodParams": params});
    let (status, text, _) = server.call("POST", "/directMethod", headers, Some(body));
    (status, text)
}

fn patch(server: &Server, headers: &[(&str, &str)], device: &str, patch: Value) -> (u16, String) {
    let body = json!({"deviceId": device, "desiredPropertyPatch": patch});
    let (status, text, _) = server.call("PATCH", "/deviceTwinDesiredProperties", headers, Some(body));
    (status, text)
}

// ---- direct methods ---------------------------------------------------------------------------

#[test]
fn direct_method_is_posted_to_the_hub_and_answers_status_and_payload() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let session = server.new_session();
    server.grant(&session, method_grant("d1", None));
    let params = json!({"methodName": "reboot", "payload": {"delay": 3}, "responseTimeoutInSeconds": 10, "connectTimeoutInSeconds": 5});
    let (status, body) = invoke(&server, &[("sessionId", &session)], "d1", params);
    assert_eq!(status, 200, "{body}");
    assert_eq!(parse_json(&body), json!({"status": 200, "payload": {"method": "reboot", "received": {"delay": 3}}}));
    let requests = hub.requests();
    assert_eq!(requests.len(), 1);
    let r = &requests[0];
    assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/twins/d1/methods"));
    assert_eq!(
        r.json(),
        json!({"methodName": "reboot", "payload": {"delay": 3}, "responseTimeoutInSeconds": 10, "connectTimeoutInSeconds": 5})
    );
    hub.assert_clean();
}

#[test]
fn direct_method_without_payload_sends_null_and_omits_absent_timeouts() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "ping"}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(hub.requests()[0].json(), json!({"methodName": "ping", "payload": null}));
    hub.assert_clean();
}

#[test]
fn device_id_is_percent_encoded_in_the_hub_path() {
    let hub = HubDouble::start();
    hub.add_device("room 1/pump#2", true);
    let server = start(&hub, &[]);
    let (status, body) = invoke(&server, &[ADMIN], "room 1/pump#2", json!({"methodName": "ping"}));
    assert_eq!(status, 200, "{body}");
    let r = &hub.requests()[0];
    assert_eq!(r.path, "/twins/room%201%2Fpump%232/methods");
    assert_eq!(r.device, "room 1/pump#2");
    hub.assert_clean();
}

#[test]
fn direct_method_grant_for_that_method_or_the_wildcard_is_needed() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let session = server.new_session();
    let headers = [("sessionId", session.as_str())];
    let (status, body) = invoke(&server, &headers, "d1", json!({"methodName": "reboot"}));
    assert_error(status, &body, 403, "missing grant");
    server.grant(&session, method_grant("d1", Some("reboot")));
    assert_eq!(invoke(&server, &headers, "d1", json!({"methodName": "reboot"})).0, 200);
    let (status, body) = invoke(&server, &headers, "d1", json!({"methodName": "reset"}));
    assert_error(status, &body, 403, "missing grant");
    // A grant on another device does not count either.
    let (status, body) = invoke(&server, &headers, "d2", json!({"methodName": "reboot"}));
    assert_error(status, &body, 403, "missing grant");
    server.grant(&session, method_grant("d1", None));
    assert_eq!(invoke(&server, &headers, "d1", json!({"methodName": "reset"})).0, 200);
    assert_eq!(hub.request_count(), 2, "refused calls must not reach the hub");
    hub.assert_clean();
}

#[test]
fn direct_method_with_the_admin_key_needs_no_grant_and_a_bad_key_is_401() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    assert_eq!(invoke(&server, &[ADMIN], "d1", json!({"methodName": "reboot"})).0, 200);
    assert_eq!(invoke(&server, &[("Shared-Access-Key", SECONDARY_KEY)], "d1", json!({"methodName": "reboot"})).0, 200);
    let (status, body) = invoke(&server, &[("Shared-Access-Key", "wrong")], "d1", json!({"methodName": "reboot"}));
    assert_error(status, &body, 401, "");
    let (status, body) = invoke(&server, &[], "d1", json!({"methodName": "reboot"}));
    assert_error(status, &body, 401, "");
    assert_eq!(hub.request_count(), 2);
}

#[test]
fn device_status_inside_a_hub_200_is_passed_through() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    hub.script(Answer::ok(json!({"status": 500, "payload": {"error": "disk full"}})));
    let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "format"}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(parse_json(&body), json!({"status": 500, "payload": {"error": "disk full"}}));
}

#[test]
fn unknown_and_offline_devices_are_the_hubs_404() {
    let hub = HubDouble::start();
    hub.add_device("sleepy", false);
    let server = start(&hub, &[]);
    let (status, body) = invoke(&server, &[ADMIN], "ghost", json!({"methodName": "reboot"}));
    assert_error(status, &body, 404, "Device ghost not registered");
    let (status, body) = invoke(&server, &[ADMIN], "sleepy", json!({"methodName": "reboot"}));
    assert_error(status, &body, 404, "DeviceNotOnline");
    hub.assert_clean();
}

#[test]
fn direct_method_forwards_every_hub_error_class_with_its_message() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    let classes = [
        (400, "ArgumentInvalid", "responseTimeoutInSeconds out of range"),
        (401, "IotHubUnauthorizedAccess", "token expired"),
        (403, "IotHubQuotaExceeded", "daily message quota exceeded"),
        (404, "DeviceNotFound", "no such device"),
        (412, "PreconditionFailed", "etag mismatch"),
        (429, "ThrottlingException", "slow down"),
        (500, "ServerError", "internal error"),
        (503, "ServiceUnavailable", "try again"),
        (504, "GatewayTimeout", "device did not answer in time"),
    ];
    for (code, name, message) in classes {
        hub.script(Answer::hub_error(code, name, message));
        let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "reboot"}));
        assert_error(status, &body, code, message);
        assert_error(status, &body, code, name);
    }
    // A nested-JSON message and a plain-text body are forwarded too.
    hub.script(Answer::Json {
        status: 429,
        body: json!({"Message": "{\"errorCode\":429001,\"trackingId\":\"t\",\"message\":\"Throttled by IoT Hub\"}"}),
        error_code: None,
    });
    let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "reboot"}));
    assert_error(status, &body, 429, "Throttled by IoT Hub");
    hub.script(Answer::Text { status: 502, body: "bad gateway upstream".into() });
    let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "reboot"}));
    assert_error(status, &body, 502, "bad gateway upstream");
    hub.assert_clean();
}

#[test]
fn hub_success_that_is_not_json_is_502() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    hub.script(Answer::Text { status: 200, body: "<html>hello</html>".into() });
    let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "reboot"}));
    assert_error(status, &body, 502, "not JSON");
}

#[test]
fn invalid_direct_method_bodies_are_400_and_never_reach_the_hub() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    for params in [json!(null), json!({}), json!({"methodName": "m", "responseTimeoutInSeconds": "soon"})] {
        let (status, body) = invoke(&server, &[ADMIN], "d1", params.clone());
        assert_error(status, &body, 400, "methodParams");
    }
    assert_eq!(hub.request_count(), 0);
}

// ---- desired properties ----------------------------------------------------------------------

#[test]
fn desired_patch_is_sent_under_properties_desired_and_answers_the_hubs_twin() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let session = server.new_session();
    server.grant(&session, kind("desiredProperties", "d1"));
    let (status, body) = patch(&server, &[("sessionId", &session)], "d1", json!({"interval": 30, "mode": {"eco": true}}));
    assert_eq!(status, 200, "{body}");
    let v = parse_json(&body);
    assert_eq!(v["status"], json!(200));
    assert_eq!(v["payload"], hub.twin("d1").unwrap(), "payload is the hub's updated twin");
    assert_eq!(v["payload"]["properties"]["desired"]["interval"], json!(30));
    assert_eq!(v["payload"]["properties"]["desired"]["mode"], json!({"eco": true}));
    let r = &hub.requests()[0];
    assert_eq!((r.method.as_str(), r.path.as_str()), ("PATCH", "/twins/d1"));
    assert_eq!(r.json(), json!({"properties": {"desired": {"interval": 30, "mode": {"eco": true}}}}));
    assert_eq!(r.header("if-match"), Some("*"));
    assert_eq!(r.header("content-type"), Some("application/json; charset=utf-8"));
    hub.assert_clean();
}

#[test]
fn desired_patch_needs_a_desired_properties_grant_or_the_key() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let session = server.new_session();
    server.grant(&session, kind("deviceTwin", "d1")); // reading is not writing
    let (status, body) = patch(&server, &[("sessionId", &session)], "d1", json!({"a": 1}));
    assert_error(status, &body, 403, "missing grant");
    assert_eq!(hub.request_count(), 0);
    assert_eq!(patch(&server, &[ADMIN], "d1", json!({"a": 1})).0, 200);
    server.grant(&session, kind("desiredProperties", "d1"));
    assert_eq!(patch(&server, &[("sessionId", &session)], "d1", json!({"a": 2})).0, 200);
    server.revoke(&session, kind("desiredProperties", "d1"));
    let (status, body) = patch(&server, &[("sessionId", &session)], "d1", json!({"a": 3}));
    assert_error(status, &body, 403, "missing grant");
    assert_eq!(hub.request_count(), 2);
    hub.assert_clean();
}

#[test]
fn desired_patch_forwards_hub_errors() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    let (status, body) = patch(&server, &[ADMIN], "ghost", json!({"a": 1}));
    assert_error(status, &body, 404, "Device ghost not registered");
    for (code, name, message) in [
        (412, "PreconditionFailed", "Precondition failed: etag mismatch"),
        (429, "ThrottlingException", "throttled"),
        (500, "ServerError", "boom"),
    ] {
        hub.script(Answer::hub_error(code, name, message));
        let (status, body) = patch(&server, &[ADMIN], "d1", json!({"a": 1}));
        assert_error(status, &body, code, message);
    }
    hub.assert_clean();
}

#[test]
fn payloads_larger_than_the_hubs_limits_are_413_before_any_hub_call() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let big = "x".repeat(129 * 1024);
    let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "m", "payload": big}));
    assert_error(status, &body, 413, "128");
    let (status, body) = patch(&server, &[ADMIN], "d1", json!({"blob": "y".repeat(33 * 1024)}));
    assert_error(status, &body, 413, "32");
    assert_eq!(hub.request_count(), 0);
    let (status, body) = invoke(&server, &[ADMIN], "d1", json!({"methodName": "m", "payload": "x".repeat(100 * 1024)}));
    assert_eq!(status, 200, "{body}");
}
