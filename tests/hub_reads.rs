//! Reads that consult the IoT Hub: `GET /deviceTwin` with the `deviceTwinCacheTTL` rules, and
//! the `GET /connectionState` fallback to the hub twin's `connectionState`.

mod common;
mod hub_double;

use std::time::{Duration, Instant};

use common::*;
use hub_double::{Answer, HubDouble};
use serde_json::{json, Value};

fn start(hub: &HubDouble, extra: &[&str]) -> Server {
    let mut args: Vec<String> = hub.args();
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(&args)
}

fn get(server: &Server, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let (status, body, _) = server.call("GET", path, headers, None);
    (status, body)
}

fn get_json(server: &Server, path: &str, headers: &[(&str, &str)]) -> Value {
    let (status, body) = get(server, path, headers);
    assert_eq!(status, 200, "GET {path}: {body}");
    parse_json(&body)
}

fn twin_gets(hub: &HubDouble) -> usize {
    hub.requests().iter().filter(|r| r.method == "GET").count()
}

fn twin_event(device: &str, op: &str, body: Value) -> Value {
    json!({"deviceId": device, "source": "twinChangeEvents", "properties": {"opType": op}, "body": body})
}

// ---- device twin -----------------------------------------------------------------------------

#[test]
fn twin_without_cache_reads_the_hub_on_every_request() {
    let hub = HubDouble::start();
    let twin = hub.add_device("d1", true);
    let server = start(&hub, &[]); // deviceTwinCacheTTL defaults to -1
    for n in 1..=2 {
        let v = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
        assert_eq!(v["deviceId"], json!("d1"));
        assert_eq!(v["data"], twin);
        assert_recent_timestamp(&v["timestamp"]);
        assert_eq!(twin_gets(&hub), n);
    }
    let r = &hub.requests()[0];
    assert_eq!(r.path, "/twins/d1");
    assert_eq!(r.query, "api-version=2021-04-12");
    assert!(r.body.is_empty());
    hub.assert_clean();
}

#[test]
fn twin_cache_ttl_minus_one_does_not_serve_twin_change_events_either() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &["--device-twin-cache-ttl", "-1"]);
    server.ingest(twin_event("d1", "replaceTwin", json!({"version": 99, "properties": {"reported": {"stale": true}}})));
    let v = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    assert_eq!(v["data"]["version"], json!(4), "the hub's twin, not the cached event: {v}");
    assert_eq!(twin_gets(&hub), 1);
}

#[test]
fn twin_cache_ttl_zero_reads_the_hub_once_and_keeps_the_twin() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &["--device-twin-cache-ttl", "0"]);
    let first = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    // "Forever" cannot be awaited: time passing is what is under test (a 1 s TTL would be over).
    std::thread::sleep(Duration::from_millis(1200));
    let second = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    assert_eq!(first, second);
    assert_eq!(twin_gets(&hub), 1);
}

#[test]
fn twin_change_events_update_a_cached_hub_twin() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &["--device-twin-cache-ttl", "0"]);
    get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    server.ingest(twin_event("d1", "updateTwin", json!({"version": 5, "properties": {"reported": {"fw": "2.0"}}})));
    let v = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    assert_eq!(v["data"]["version"], json!(5), "{v}");
    assert_eq!(v["data"]["properties"]["reported"]["fw"], json!("2.0"));
    assert_eq!(v["data"]["properties"]["desired"]["interval"], json!(10), "the rest of the hub twin stays");
    assert_eq!(v["data"]["connectionState"], json!("Connected"));
    assert_eq!(twin_gets(&hub), 1);
}

#[test]
fn twin_known_only_from_events_is_not_served_in_place_of_a_hub_read() {
    let hub = HubDouble::start();
    let twin = hub.add_device("d1", true);
    let server = start(&hub, &["--device-twin-cache-ttl", "0"]);
    // An updateTwin event carries only the change: not a whole twin.
    server.ingest(twin_event("d1", "updateTwin", json!({"version": 2, "properties": {"reported": {"x": 1}}})));
    let v = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    assert_eq!(v["data"], twin);
    assert_eq!(twin_gets(&hub), 1);
}

#[test]
fn twin_cache_ttl_n_serves_the_cache_for_n_seconds_then_reads_the_hub_again() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    // The TTL in milliseconds (hidden flag) so the test waits a fraction of a second.
    let server = start(&hub, &["--device-twin-cache-ttl-ms", "500"]);
    get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    let read = Instant::now(); // the twin was cached before this
    get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    assert_eq!(twin_gets(&hub), 1, "second read within the TTL comes from the cache");
    // Time passing is what is under test: wait out the TTL.
    std::thread::sleep(Duration::from_millis(600).saturating_sub(read.elapsed()));
    // The hub's twin changed meanwhile (someone else patched it).
    hub.script(Answer::ok(json!({"deviceId": "d1", "version": 9, "properties": {"desired": {}, "reported": {}}})));
    let v = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    assert_eq!(twin_gets(&hub), 2);
    assert_eq!(v["data"]["version"], json!(9));
}

#[test]
fn desired_patch_refreshes_the_cached_twin() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &["--device-twin-cache-ttl", "0"]);
    get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    let body = json!({"deviceId": "d1", "desiredPropertyPatch": {"interval": 60}});
    let (status, text, _) = server.call("PATCH", "/deviceTwinDesiredProperties", &[ADMIN], Some(body));
    assert_eq!(status, 200, "{text}");
    let v = get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    assert_eq!(v["data"]["properties"]["desired"]["interval"], json!(60), "{v}");
    assert_eq!(twin_gets(&hub), 1);
}

#[test]
fn twin_of_a_device_the_hub_does_not_know_is_404() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    let (status, body) = get(&server, "/deviceTwin/ghost", &[ADMIN]);
    assert_error(status, &body, 404, "No last devicetwin found");
    assert_error(status, &body, 404, "DeviceNotFound");
    hub.assert_clean();
}

#[test]
fn twin_read_with_a_session_needs_the_device_twin_grant() {
    let hub = HubDouble::start();
    let twin = hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", None)); // the wrong kind
    let (status, body) = get(&server, "/deviceTwin/d1", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "missing grant");
    assert_eq!(hub.request_count(), 0, "a refused read must not reach the hub");
    server.grant(&session, kind("deviceTwin", "d1"));
    let v = get_json(&server, "/deviceTwin/d1", &[("sessionId", &session)]);
    assert_eq!(v["data"], twin);
    let (status, body) = get(&server, "/deviceTwin/d1", &[("sessionId", "no-such-session-abcdefghij")]);
    assert_error(status, &body, 404, "No such sessionId");
}

#[test]
fn cached_twin_still_needs_the_grant() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &["--device-twin-cache-ttl", "0"]);
    get_json(&server, "/deviceTwin/d1", &[ADMIN]);
    let session = server.new_session();
    let (status, body) = get(&server, "/deviceTwin/d1", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "missing grant");
}

#[test]
fn twin_read_forwards_hub_errors() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    for (code, name, message) in [(401, "IotHubUnauthorizedAccess", "unauthorized"), (429, "ThrottlingException", "too many"), (500, "ServerError", "boom")] {
        hub.script(Answer::hub_error(code, name, message));
        let (status, body) = get(&server, "/deviceTwin/d1", &[ADMIN]);
        assert_error(status, &body, code, message);
    }
}

// ---- connection state ------------------------------------------------------------------------

#[test]
fn connection_state_without_a_cached_value_is_read_from_the_hub() {
    let hub = HubDouble::start();
    hub.add_device("on", true);
    hub.add_device("off", false);
    let server = start(&hub, &[]);
    let v = get_json(&server, "/connectionState/on", &[ADMIN]);
    assert_eq!(v["deviceId"], json!("on"));
    assert_eq!(v["data"], json!(true));
    assert_recent_timestamp(&v["timestamp"]);
    assert_eq!(get_json(&server, "/connectionState/off", &[ADMIN])["data"], json!(false));
    assert_eq!(hub.requests().iter().map(|r| r.path.as_str()).collect::<Vec<_>>(), ["/twins/on", "/twins/off"]);
    hub.assert_clean();
}

#[test]
fn connection_state_of_a_device_the_hub_does_not_know_is_404_no_device_found() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    let (status, body) = get(&server, "/connectionState/ghost", &[ADMIN]);
    assert_error(status, &body, 404, "No device found");
}

#[test]
fn cached_connection_state_is_served_without_asking_the_hub() {
    let hub = HubDouble::start();
    hub.add_device("d1", false);
    let server = start(&hub, &[]);
    server.ingest(json!({"deviceId": "d1", "body": {"temperature": 20}}));
    assert_eq!(get_json(&server, "/connectionState/d1", &[ADMIN])["data"], json!(true));
    assert_eq!(hub.request_count(), 0);
}

#[test]
fn connection_state_does_not_ask_the_hub_with_a_custom_connection_state_key() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &["--custom-connection-state-key", "online"]);
    let (status, body) = get(&server, "/connectionState/d1", &[ADMIN]);
    assert_error(status, &body, 404, "No device found");
    assert_eq!(hub.request_count(), 0);
    server.ingest(json!({"deviceId": "d1", "body": {"online": false}}));
    assert_eq!(get_json(&server, "/connectionState/d1", &[ADMIN])["data"], json!(false));
    assert_eq!(hub.request_count(), 0);
}

#[test]
fn connection_state_fallback_needs_the_connection_state_grant() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    let session = server.new_session();
    let (status, body) = get(&server, "/connectionState/d1", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "missing grant");
    assert_eq!(hub.request_count(), 0);
    server.grant(&session, kind("connectionState", "d1"));
    assert_eq!(get_json(&server, "/connectionState/d1", &[("sessionId", &session)])["data"], json!(true));
}

#[test]
fn connection_state_fallback_forwards_hub_errors() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    hub.script(Answer::hub_error(429, "ThrottlingException", "too many requests"));
    let (status, body) = get(&server, "/connectionState/d1", &[ADMIN]);
    assert_error(status, &body, 429, "too many requests");
}
