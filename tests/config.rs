//! Configuration names: SPEC's camelCase names, SCREAMING_SNAKE environment variables and the
//! older aliases all reach the same parameter.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

const TS: &str = "2024-05-06T07:08:09.000Z";

fn timestamp_key_is(server: &Server, key: &str) {
    server.ingest(json!({"deviceId": "c1", "body": {key: TS, "v": 1}}));
    let (status, body) = server.call_json("GET", "/lastValue/c1/v", &[ADMIN], None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["timestamp"], TS, "{key} is the timestamp key");
}

#[test]
fn custom_timestamp_property_flag_is_an_alias() {
    timestamp_key_is(&Server::start(&["--customTimestampProperty", "t"]), "t");
    timestamp_key_is(&Server::start(&["--customTimestampKey", "when"]), "when");
}

#[test]
fn environment_spellings_reach_the_parameter() {
    for (name, key) in [("CUSTOM_TIMESTAMP_KEY", "a"), ("customTimestampKey", "b"), ("CUSTOM_TIMESTAMP_PROPERTY", "c"), ("customTimestampProperty", "d")] {
        let server = Server::start_with_env(&[], &[(name, key)]);
        timestamp_key_is(&server, key);
    }
}

#[test]
fn throttling_parameter_is_an_alias_of_throttling_interval() {
    for args in [vec!["--throttlingParameter", "400"], vec!["--throttling-interval", "400"]] {
        let server = Server::start(&args);
        let session = server.new_session();
        server.grant(&session, json!({"type": "telemetry", "deviceId": "c1"}));
        server.subscribe(&session, json!({"type": "telemetry", "deviceId": "c1"}));
        let mut live = server.live(&session);
        server.ingest(json!([{"deviceId": "c1", "body": {"n": 1}}, {"deviceId": "c1", "body": {"n": 2}}]));
        let frames = live.collect(Duration::from_millis(250));
        assert_eq!(frames.len(), 1, "{args:?}: the second message waits for the interval: {frames:?}");
    }
    let server = Server::start_with_env(&[], &[("THROTTLING_PARAMETER", "400")]);
    let session = server.new_session();
    server.grant(&session, json!({"type": "telemetry", "deviceId": "c1"}));
    server.subscribe(&session, json!({"type": "telemetry", "deviceId": "c1"}));
    let mut live = server.live(&session);
    server.ingest(json!([{"deviceId": "c1", "body": {"n": 1}}, {"deviceId": "c1", "body": {"n": 2}}]));
    assert_eq!(live.collect(Duration::from_millis(250)).len(), 1);
}

#[test]
fn camel_case_flags_with_bad_values_name_the_parameter() {
    let args = full_args(&["--connectionStateCacheTTL", "soon"], true);
    let (ok, _, stderr) = run_expecting_exit(&args, &[]);
    assert!(!ok);
    assert!(stderr.contains("connectionStateCacheTTL") || stderr.contains("connection-state-cache-ttl"), "{stderr}");
    let args = full_args(&[], true);
    let (ok, _, stderr) = run_expecting_exit(&args, &[("THROTTLING_INTERVAL", "-5")]);
    assert!(!ok);
    assert!(stderr.contains("throttling"), "{stderr}");
}

#[test]
fn infrastructure_parameters_are_accepted_and_validated() {
    let server = Server::start(&["--sku", "small", "--serverVersion", "4.2.0", "--logAnalyticsTracesTableTier", "Basic"]);
    let (status, _, _) = server.call("GET", "/version", &[], None);
    assert_eq!(status, 200);
    let (ok, _, stderr) = run_expecting_exit(&full_args(&["--sku", "huge"], true), &[]);
    assert!(!ok && stderr.contains("sku"), "{stderr}");
}
