//! Last values: telemetry, device twin and connection state caches fed through POST /ingest,
//! read back with either a Shared-Access-Key or a sessionId header.

mod common;

use common::*;
use serde_json::{json, Value};

fn ingest_d1(server: &Server) {
    let accepted = server.ingest(json!({
        "deviceId": "d1",
        "body": {"temperature": 21.5, "humidity": 40, "geo": {"lat": 1, "lng": 2}, "running": true}
    }));
    assert_eq!(accepted, 1);
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

// ---- telemetry --------------------------------------------------------------------------------

/// Numbers no machine type holds are kept as the text the device sent, and the rest of the body
/// with them (they used to drop the whole message). Checked on the raw bytes: a JSON library
/// would round them or refuse them.
#[test]
fn numbers_beyond_i64_u64_f64_are_kept_as_sent_with_the_rest_of_the_body() {
    let server = Server::start(&[]);
    let session = server.new_session();
    server.grant(&session, telemetry("big", None));
    assert_eq!(server.subscribe(&session, telemetry("big", None)).0, 204);
    let mut live = server.live(&session);
    let body = br#"{"deviceId":"big","body":{"u":18446744073709551616,"inf":1e309,"long":123456789012345678901234567890,"neg":-1e309,"t":21.50,"ok":true}}"#;
    let (status, answer, _) = server.call_raw("POST", "/ingest", &[ADMIN, ("Content-Type", "application/json")], body);
    assert_eq!((status, answer.as_str()), (200, r#"{"accepted":1}"#));
    let members = [
        ("u", "18446744073709551616"),
        ("inf", "1e309"),
        ("long", "123456789012345678901234567890"),
        ("neg", "-1e309"),
        ("t", "21.50"),
        ("ok", "true"),
    ];
    let frame = live.next_text(std::time::Duration::from_secs(5)).expect("a telemetry frame");
    let all = get(&server, "/lastValue/big", &[ADMIN]).1;
    for (key, text) in members {
        assert!(frame.contains(&format!(r#""{key}":{text}"#)), "pushed {key} = {text}: {frame}");
        assert!(all.contains(&format!(r#""{key}":{{"value":{text},"#)), "all-keys read {key} = {text}: {all}");
        let (status, one) = get(&server, &format!("/lastValue/big/{key}"), &[ADMIN]);
        assert_eq!(status, 200, "{one}");
        assert!(one.starts_with(&format!(r#"{{"deviceId":"big","data":{{"{key}":{text}}},"#)), "{one}");
    }
}

#[test]
fn last_value_of_one_key() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let v = get_json(&server, "/lastValue/d1/temperature", &[ADMIN]);
    assert_eq!(v["deviceId"], json!("d1"));
    assert_eq!(v["data"], json!({"temperature": 21.5}));
    assert_recent_timestamp(&v["timestamp"]);
    assert_eq!(v.as_object().unwrap().len(), 3, "exactly deviceId, data, timestamp: {v}");
}

#[test]
fn last_values_of_all_keys() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let v = get_json(&server, "/lastValue/d1", &[ADMIN]);
    assert_eq!(v["deviceId"], json!("d1"));
    assert_eq!(v["timestamp"], json!(""));
    let data = v["data"].as_object().unwrap_or_else(|| panic!("data is not an object: {v}"));
    let expected = json!({"temperature": 21.5, "humidity": 40, "geo": {"lat": 1, "lng": 2}, "running": true});
    assert_eq!(data.len(), 4, "{v}");
    for (key, value) in expected.as_object().unwrap() {
        let entry = &data[key];
        assert_eq!(&entry["value"], value, "value of {key}: {v}");
        assert_recent_timestamp(&entry["timestamp"]);
        assert_eq!(entry.as_object().unwrap().len(), 2, "entry {key} is exactly {{value, timestamp}}: {entry}");
    }
}

#[test]
fn object_and_falsy_values_are_preserved() {
    let server = Server::start(&[]);
    server.ingest(json!({"deviceId": "d1", "body": {"geo": {"lat": 1, "lng": 2}, "on": false, "n": 0, "s": ""}}));
    let v = get_json(&server, "/lastValue/d1/geo", &[ADMIN]);
    assert_eq!(v["data"], json!({"geo": {"lat": 1, "lng": 2}}));
    let v = get_json(&server, "/lastValue/d1/on", &[ADMIN]);
    assert_eq!(v["data"], json!({"on": false}));
    let v = get_json(&server, "/lastValue/d1/n", &[ADMIN]);
    assert_eq!(v["data"], json!({"n": 0}));
    let v = get_json(&server, "/lastValue/d1/s", &[ADMIN]);
    assert_eq!(v["data"], json!({"s": ""}));
}

#[test]
fn later_ingest_updates_only_the_keys_it_carries() {
    let server = Server::start(&[]);
    server.ingest(json!({"deviceId": "d1", "body": {"temperature": 21.5, "humidity": 40, "_ts": "2024-01-01T00:00:00.000Z"}}));
    server.ingest(json!({"deviceId": "d1", "body": {"humidity": 41, "_ts": "2024-01-01T00:00:10.000Z"}}));
    let v = get_json(&server, "/lastValue/d1", &[ADMIN]);
    assert_eq!(
        v["data"],
        json!({
            "temperature": {"value": 21.5, "timestamp": "2024-01-01T00:00:00.000Z"},
            "humidity": {"value": 41, "timestamp": "2024-01-01T00:00:10.000Z"}
        })
    );
}

#[test]
fn ts_body_key_sets_the_timestamp_and_is_not_telemetry() {
    let server = Server::start(&[]);
    server.ingest(json!({"deviceId": "d2", "body": {"t": 1, "_ts": "2024-01-02T03:04:05.000Z"}}));
    let v = get_json(&server, "/lastValue/d2/t", &[ADMIN]);
    assert_eq!(v["data"], json!({"t": 1}));
    assert_eq!(v["timestamp"], json!("2024-01-02T03:04:05.000Z"));
    let all = get_json(&server, "/lastValue/d2", &[ADMIN]);
    assert_eq!(all["data"], json!({"t": {"value": 1, "timestamp": "2024-01-02T03:04:05.000Z"}}));
    let (status, body) = get(&server, "/lastValue/d2/_ts", &[ADMIN]);
    assert_error(status, &body, 404, "");
}

#[test]
fn timestamp_falls_back_to_creation_time_then_enqueued_time() {
    let server = Server::start(&[]);
    server.ingest(json!([
        {"deviceId": "d1", "enqueuedTime": "2024-05-06T07:08:09.000Z",
         "properties": {"iothub-creation-time-utc": "2024-05-06T07:08:00.000Z"}, "body": {"a": 1}},
        {"deviceId": "d2", "enqueuedTime": "2024-05-06T07:08:09.000Z", "body": {"a": 2}},
    ]));
    let v = get_json(&server, "/lastValue/d1/a", &[ADMIN]);
    assert_eq!(v["timestamp"], json!("2024-05-06T07:08:00.000Z"), "creation time wins over enqueued time");
    let v = get_json(&server, "/lastValue/d2/a", &[ADMIN]);
    assert_eq!(v["timestamp"], json!("2024-05-06T07:08:09.000Z"), "enqueued time when nothing else is given");
}

#[test]
fn unknown_device_has_no_last_telemetry() {
    let server = Server::start(&[]);
    let (status, body) = get(&server, "/lastValue/nobody/temperature", &[ADMIN]);
    assert_error(status, &body, 404, "No last telemetry found");
    let (status, body) = get(&server, "/lastValue/nobody", &[ADMIN]);
    assert_error(status, &body, 404, "No last telemetry found");
}

#[test]
fn unknown_key_of_known_device_is_404() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let (status, body) = get(&server, "/lastValue/d1/pressure", &[ADMIN]);
    assert_error(status, &body, 404, "");
}

#[test]
fn last_value_without_credentials_is_401() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let (status, body) = get(&server, "/lastValue/d1/temperature", &[]);
    assert_error(status, &body, 401, "Provide either a Shared-Access-Key or a sessionId header");
}

#[test]
fn last_value_with_wrong_key_is_403() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let (status, body) = get(&server, "/lastValue/d1/temperature", &[("Shared-Access-Key", "wrong")]);
    assert_error(status, &body, 403, "invalid shared-access-key");
}

#[test]
fn last_value_with_secondary_key() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let v = get_json(&server, "/lastValue/d1/temperature", &[("Shared-Access-Key", SECONDARY_KEY)]);
    assert_eq!(v["data"], json!({"temperature": 21.5}));
}

#[test]
fn last_value_with_session_but_no_grant_is_403() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let session = server.new_session();
    let (status, body) = get(&server, "/lastValue/d1/temperature", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "missing grant");
    let (status, body) = get(&server, "/lastValue/d1", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "missing grant");
}

#[test]
fn last_value_with_per_key_grant_reads_only_that_key() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("temperature")));
    let v = get_json(&server, "/lastValue/d1/temperature", &[("sessionId", &session)]);
    assert_eq!(v["data"], json!({"temperature": 21.5}));
    let (status, body) = get(&server, "/lastValue/d1/humidity", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "missing grant");
}

#[test]
fn all_keys_read_with_per_key_grants_returns_only_granted_keys() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", Some("temperature")));
    server.grant(&session, telemetry("d1", Some("geo")));
    let v = get_json(&server, "/lastValue/d1", &[("sessionId", &session)]);
    let data = v["data"].as_object().unwrap_or_else(|| panic!("{v}"));
    let mut keys: Vec<&str> = data.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["geo", "temperature"], "{v}");
    assert_eq!(data["geo"]["value"], json!({"lat": 1, "lng": 2}));
}

#[test]
fn all_keys_read_with_wildcard_grant_returns_every_key() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", None));
    let v = get_json(&server, "/lastValue/d1", &[("sessionId", &session)]);
    assert_eq!(v["data"].as_object().map(|d| d.len()), Some(4), "{v}");
    let v = get_json(&server, "/lastValue/d1/humidity", &[("sessionId", &session)]);
    assert_eq!(v["data"], json!({"humidity": 40}));
}

#[test]
fn last_value_with_unknown_session_is_404() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let (status, body) = get(&server, "/lastValue/d1/temperature", &[("sessionId", "no-such-session-abcdefghij")]);
    assert_error(status, &body, 404, "");
}

#[test]
fn deleting_last_values_of_a_device() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    server.ingest(json!({"deviceId": "d9", "body": {"x": 1}}));
    let (status, body, _) = server.call("DELETE", "/lastValue/d1", &[ADMIN], None);
    assert_eq!(status, 204, "DELETE /lastValue/d1: {body}");
    let (status, body) = get(&server, "/lastValue/d1", &[ADMIN]);
    assert_error(status, &body, 404, "");
    let (status, body) = get(&server, "/lastValue/d1/temperature", &[ADMIN]);
    assert_error(status, &body, 404, "");
    // Other devices keep theirs.
    assert_eq!(get_json(&server, "/lastValue/d9/x", &[ADMIN])["data"], json!({"x": 1}));
}

#[test]
fn deleting_last_values_checks_credentials() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let session = server.new_session();
    let (status, body, _) = server.call("DELETE", "/lastValue/d1", &[], None);
    assert_error(status, &body, 401, "");
    let (status, body, _) = server.call("DELETE", "/lastValue/d1", &[("Shared-Access-Key", "wrong")], None);
    assert_error(status, &body, 403, "");
    let (status, body, _) = server.call("DELETE", "/lastValue/d1", &[("sessionId", &session)], None);
    assert_error(status, &body, 403, "");
    // Nothing was deleted by the refused requests.
    get_json(&server, "/lastValue/d1/temperature", &[ADMIN]);
    server.grant(&session, telemetry("d1", None));
    let (status, body, _) = server.call("DELETE", "/lastValue/d1", &[("sessionId", &session)], None);
    assert_eq!(status, 204, "DELETE /lastValue with a granted session: {body}");
    let (status, _) = get(&server, "/lastValue/d1", &[ADMIN]);
    assert_eq!(status, 404);
}

// ---- device twin ------------------------------------------------------------------------------

fn ingest_twin(server: &Server) {
    server.ingest(json!({
        "deviceId": "d3",
        "source": "twinChangeEvents",
        "properties": {"opType": "replaceTwin"},
        "body": {"version": 2, "properties": {"reported": {"fw": "1.0"}, "desired": {}}}
    }));
}

#[test]
fn device_twin_is_cached_from_twin_change_events() {
    let server = Server::start(&[]);
    ingest_twin(&server);
    let v = get_json(&server, "/deviceTwin/d3", &[ADMIN]);
    assert_eq!(v["deviceId"], json!("d3"));
    assert_eq!(v["data"]["version"], json!(2), "{v}");
    assert_eq!(v["data"]["properties"]["reported"], json!({"fw": "1.0"}), "{v}");
    assert_eq!(v["data"]["properties"]["desired"], json!({}), "{v}");
    assert_recent_timestamp(&v["timestamp"]);
}

#[test]
fn twin_update_is_merged_into_the_cached_twin() {
    let server = Server::start(&[]);
    ingest_twin(&server);
    server.ingest(json!({
        "deviceId": "d3",
        "source": "twinChangeEvents",
        "properties": {"opType": "updateTwin"},
        "body": {"version": 3, "properties": {"reported": {"mode": "eco"}}}
    }));
    let v = get_json(&server, "/deviceTwin/d3", &[ADMIN]);
    assert_eq!(v["data"]["version"], json!(3), "{v}");
    assert_eq!(v["data"]["properties"]["reported"], json!({"fw": "1.0", "mode": "eco"}), "{v}");
    assert_eq!(v["data"]["properties"]["desired"], json!({}), "{v}");
}

#[test]
fn twin_update_with_null_removes_the_property() {
    let server = Server::start(&[]);
    ingest_twin(&server);
    server.ingest(json!({
        "deviceId": "d3",
        "source": "twinChangeEvents",
        "properties": {"opType": "updateTwin"},
        "body": {"version": 3, "properties": {"reported": {"fw": null, "mode": "eco"}}}
    }));
    let v = get_json(&server, "/deviceTwin/d3", &[ADMIN]);
    assert_eq!(v["data"]["properties"]["reported"], json!({"mode": "eco"}), "{v}");
}

#[test]
fn unknown_device_has_no_twin() {
    let server = Server::start(&[]);
    let (status, body) = get(&server, "/deviceTwin/nobody", &[ADMIN]);
    assert_error(status, &body, 404, "");
}

/// Without an IoT Hub a session cannot hold a deviceTwin grant, so it cannot read the twin;
/// the admin key still reads the twin known from events. (With a hub: tests/hub_reads.rs.)
#[test]
fn device_twin_read_with_session_needs_a_twin_grant() {
    let server = Server::start(&[]);
    ingest_twin(&server);
    let session = server.new_session();
    server.grant(&session, telemetry("d3", None)); // the wrong kind
    let (status, body) = get(&server, "/deviceTwin/d3", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "");
    let (status, body) = server.try_grant(&session, kind("deviceTwin", "d3"));
    assert_error(status, &body, 400, "IoT Hub API disabled");
    let (status, body) = get(&server, "/deviceTwin/d3", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "");
    let v = get_json(&server, "/deviceTwin/d3", &[ADMIN]);
    assert_eq!(v["data"]["properties"]["reported"], json!({"fw": "1.0"}));
}

#[test]
fn device_twin_read_without_credentials_is_401() {
    let server = Server::start(&[]);
    ingest_twin(&server);
    let (status, body) = get(&server, "/deviceTwin/d3", &[]);
    assert_error(status, &body, 401, "");
}

// ---- connection state -------------------------------------------------------------------------

fn connection_event(device: &str, op: &str, sequence: &str) -> Value {
    json!({
        "deviceId": device,
        "source": "deviceConnectionStateEvents",
        "properties": {"opType": op},
        "body": {"sequenceNumber": sequence}
    })
}

#[test]
fn telemetry_marks_the_device_connected() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let v = get_json(&server, "/connectionState/d1", &[ADMIN]);
    assert_eq!(v["deviceId"], json!("d1"));
    assert_eq!(v["data"], json!(true), "{v}");
    assert_recent_timestamp(&v["timestamp"]);
}

#[test]
fn connection_state_on_telemetry_can_be_disabled() {
    let server = Server::start(&["--connection-state-on-telemetry", "false"]);
    ingest_d1(&server);
    let (status, body) = get(&server, "/connectionState/d1", &[ADMIN]);
    assert_error(status, &body, 404, "");
}

#[test]
fn disconnect_event_then_stale_connect_is_ignored() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    server.ingest(connection_event("d1", "deviceDisconnected", "000000000000000001D5"));
    let v = get_json(&server, "/connectionState/d1", &[ADMIN]);
    assert_eq!(v["data"], json!(false), "{v}");
    server.ingest(connection_event("d1", "deviceConnected", "000000000000000001D4"));
    let v = get_json(&server, "/connectionState/d1", &[ADMIN]);
    assert_eq!(v["data"], json!(false), "a stale (older sequenceNumber) event must be ignored: {v}");
    server.ingest(connection_event("d1", "deviceConnected", "000000000000000001D6"));
    let v = get_json(&server, "/connectionState/d1", &[ADMIN]);
    assert_eq!(v["data"], json!(true), "a newer event applies: {v}");
}

#[test]
fn unknown_device_has_no_connection_state() {
    let server = Server::start(&[]);
    let (status, body) = get(&server, "/connectionState/nobody", &[ADMIN]);
    assert_error(status, &body, 404, "");
}

#[test]
fn connection_state_read_with_session_needs_a_connection_state_grant() {
    let server = Server::start(&[]);
    ingest_d1(&server);
    let session = server.new_session();
    server.grant(&session, telemetry("d1", None)); // the wrong kind
    let (status, body) = get(&server, "/connectionState/d1", &[("sessionId", &session)]);
    assert_error(status, &body, 403, "");
    server.grant(&session, kind("connectionState", "d1"));
    let v = get_json(&server, "/connectionState/d1", &[("sessionId", &session)]);
    assert_eq!(v["data"], json!(true));
}

// ---- ingest -----------------------------------------------------------------------------------

#[test]
fn batch_ingest_accepts_every_message() {
    let server = Server::start(&[]);
    let batch: Vec<Value> =
        (0..50).map(|i| json!({"deviceId": format!("dev-{i}"), "body": {"value": i}})).collect();
    let (status, body) = server.call_json("POST", "/ingest", &[ADMIN], Some(Value::Array(batch)));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"accepted": 50}));
    for i in 0..50 {
        let v = get_json(&server, &format!("/lastValue/dev-{i}/value"), &[ADMIN]);
        assert_eq!(v["data"], json!({"value": i}));
    }
}

#[test]
fn ingest_requires_the_admin_key() {
    let server = Server::start(&[]);
    let msg = json!({"deviceId": "d1", "body": {"t": 1}});
    for headers in [&[][..], &[("Shared-Access-Key", "wrong")][..]] {
        let (status, body, _) = server.call("POST", "/ingest", headers, Some(msg.clone()));
        assert_error(status, &body, 401, "Unauthorized");
    }
    let (status, body) = get(&server, "/lastValue/d1", &[ADMIN]);
    assert_error(status, &body, 404, "");
}

/// One pass reads the whole request before anything is applied: a fault anywhere in a batch
/// (after valid messages too) is a 400 naming it, and no message of the batch is stored.
#[test]
fn a_fault_anywhere_in_a_batch_is_400_naming_it_and_stores_none_of_it() {
    let server = Server::start(&[]);
    let good = r#"{"deviceId":"d1","body":{"t":1}}"#;
    for (body, needle) in [
        ([format!("[{good},{{\"deviceId\":\"d2\",\"body\":{{\"t\":\"").as_bytes(), b"\xff\"}}]"].concat(), "UTF-8"),
        (format!("[{good},{{\"deviceId\":\"d2\",\"body\":{{\"t\":01}}}}]").into_bytes(), "line 1"),
        (format!("[{good},{good}] x").into_bytes(), "trailing"),
        (format!("[{good},{{\"deviceId\":\"d2\",\"\\ud800\":1,\"body\":1}}]").into_bytes(), "surrogate"),
        (format!("[{good},{{\"deviceId\":\"d2\",\"body\":1,\"body\":2}}]").into_bytes(), "message 1: duplicate field `body`"),
        (format!("[{good},{{\"deviceId\":[\"d2\"],\"body\":1}}]").into_bytes(), "message 1: field `deviceId` must be a string"),
        (format!("[{good},{{\"deviceId\":\"d2\"}}]").into_bytes(), "message 1: missing field `body`"),
        (format!("[{good},7]").into_bytes(), "message 1: not a message object"),
        (format!("[{good},{{\"deviceId\":\"d2\",\"properties\":[1],\"body\":1}}]").into_bytes(), "message 1: field `properties` must be an object"),
    ] {
        let (status, text, _) = server.call_raw("POST", "/ingest", &[ADMIN], &body);
        assert_error(status, &text, 400, needle);
    }
    // None of d1's messages above was stored; the same message in a valid batch is.
    let (status, body) = get(&server, "/lastValue/d1", &[ADMIN]);
    assert_error(status, &body, 404, "");
    let (status, text, _) = server.call_raw("POST", "/ingest", &[ADMIN], format!("[{good}]").as_bytes());
    assert_eq!((status, text.as_str()), (200, r#"{"accepted":1}"#));
    assert_eq!(get(&server, "/lastValue/d1", &[ADMIN]).0, 200);
}

#[test]
fn invalid_ingest_body_is_400_and_stores_nothing() {
    let server = Server::start(&[]);
    for body in [
        json!({"body": {"t": 1}}),                                            // no deviceId
        json!({"deviceId": 5, "body": {"t": 1}}),                             // wrong type
        json!("not a message"),                                               // not an object
    ] {
        let (status, text, _) = server.call("POST", "/ingest", &[ADMIN], Some(body.clone()));
        assert_eq!(status, 400, "POST /ingest {body}: {text}");
        error_message(&text);
    }
    let (status, body) = get(&server, "/lastValue/d1", &[ADMIN]);
    assert_error(status, &body, 404, "");
}
