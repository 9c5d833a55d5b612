//! Administrative endpoints (version, status, log level) and start-up configuration.

mod common;
mod tools;

use common::*;
use std::time::Duration;

#[test]
fn version_needs_no_credentials_and_is_not_empty() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("GET", "/version", &[], None);
    assert_eq!(status, 200, "GET /version: {body}");
    assert!(!body.trim().is_empty(), "GET /version answered an empty body");
}

#[test]
fn status_is_ok_without_an_event_source() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("GET", "/status", &[], None);
    assert_eq!(status, 200, "GET /status: {body}");
    assert_eq!(body.trim(), "OK");
}

/// ux4iot answers `GET /status` with the text `OK` whatever the headers; its admin SDK always
/// sends the key, so the key must not change the answer (issue 26, item 1).
#[test]
fn status_is_the_text_ok_with_or_without_the_admin_key() {
    let server = Server::start(&[]);
    let wrong = ("Shared-Access-Key", "not-the-key");
    let secondary = ("Shared-Access-Key", SECONDARY_KEY);
    for (what, headers) in [("no key", vec![]), ("the admin key", vec![ADMIN]), ("the secondary key", vec![secondary]), ("a wrong key", vec![wrong])] {
        let (status, body, response_headers) = server.call("GET", "/status", &headers, None);
        assert_eq!((status, body.as_str()), (200, "OK"), "GET /status with {what}");
        let content_type = response_headers.get("content-type").unwrap_or("");
        assert!(content_type.starts_with("text/plain"), "GET /status with {what}: content-type {content_type}");
    }
}

/// `GET /status` read by the call ux4iot's admin SDK makes (`status()`: axios, the key in the
/// `Shared-Access-Key` header, `response.data` as the result), from node.
#[test]
fn admin_sdk_status_reads_the_text_ok() {
    let server = Server::start(&[]);
    let script = tools::repo().join("tests/js/admin-status.mjs");
    let out = tools::run(std::process::Command::new("node").arg(&script).arg(&server.base).arg(ADMIN_KEY));
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the admin SDK's status() failed: {report}");
    assert_eq!(parse_json(report.trim())["result"], serde_json::json!("OK"), "status() must return the string OK: {report}");
}

/// The instance's details, which `GET /status` answered as JSON to the admin key before, have
/// their own admin-only endpoint: the answer without Redis is `{"status": "OK"}`.
#[test]
fn status_details_need_the_admin_key() {
    let server = Server::start(&[]);
    let (status, body, headers) = server.call("GET", "/status/details", &[ADMIN], None);
    assert_eq!(status, 200, "GET /status/details with the key: {body}");
    assert!(headers.get("content-type").unwrap_or("").starts_with("application/json"));
    assert_eq!(parse_json(&body), serde_json::json!({"status": "OK"}));
    let (status, body, _) = server.call("GET", "/status/details", &[], None);
    assert_error(status, &body, 401, "no Shared-Access-Key");
    let (status, body, _) = server.call("GET", "/status/details", &[("Shared-Access-Key", "not-the-key")], None);
    assert_error(status, &body, 401, "invalid Shared-Access-Key");
}

/// The details share `/status`'s health: a malformed connection string is the same 500.
#[test]
fn status_details_report_a_malformed_connection_string() {
    let server = Server::start(&["--iot-hub-event-hub-connection-string", "garbage"]);
    let (status, body, _) = server.call("GET", "/status/details", &[ADMIN], None);
    assert_error(status, &body, 500, "iotHubEventHubConnectionString");
}

#[test]
fn log_level_can_be_set_with_the_primary_key() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("PUT", "/logLevel/verbose", &[ADMIN], None);
    assert_eq!(status, 204, "PUT /logLevel/verbose: {body}");
    for level in ["error", "warn", "info", "debug"] {
        let (status, body, _) = server.call("PUT", &format!("/logLevel/{level}"), &[ADMIN], None);
        assert_eq!(status, 204, "PUT /logLevel/{level}: {body}");
    }
}

#[test]
fn log_level_can_be_set_with_the_secondary_key() {
    let server = Server::start(&[]);
    let (status, body, _) =
        server.call("PUT", "/logLevel/verbose", &[("Shared-Access-Key", SECONDARY_KEY)], None);
    assert_eq!(status, 204, "PUT /logLevel/verbose with the secondary key: {body}");
}

#[test]
fn log_level_without_key_is_unauthorized() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("PUT", "/logLevel/verbose", &[], None);
    assert_eq!(status, 401, "PUT /logLevel without key: {body}");
    let msg = error_message(&body);
    assert!(msg.starts_with("Unauthorized:"), "errorMessage {msg:?} does not start with `Unauthorized:`");
}

#[test]
fn log_level_with_wrong_key_is_unauthorized() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("PUT", "/logLevel/verbose", &[("Shared-Access-Key", "wrong")], None);
    assert_eq!(status, 401, "PUT /logLevel with a wrong key: {body}");
    let msg = error_message(&body);
    assert!(msg.starts_with("Unauthorized:"), "errorMessage {msg:?} does not start with `Unauthorized:`");
}

#[test]
fn unknown_log_level_is_400() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("PUT", "/logLevel/chatty", &[ADMIN], None);
    assert_error(status, &body, 400, "Unknown log level");
}

#[test]
fn status_reports_malformed_event_hub_connection_string() {
    let server = Server::start(&["--iot-hub-event-hub-connection-string", "garbage"]);
    let (status, body, _) = server.call("GET", "/status", &[], None);
    assert_error(status, &body, 500, "iotHubEventHubConnectionString");
}

#[test]
fn status_reports_malformed_service_connection_string() {
    let server = Server::start(&["--iot-hub-service-connection-string", "garbage"]);
    let (status, body, _) = server.call("GET", "/status", &[], None);
    assert_error(status, &body, 500, "iotHubServiceConnectionString");
}

#[test]
fn status_is_503_while_the_event_source_is_connecting() {
    let server = Server::start(&[
        "--iot-hub-event-hub-connection-string",
        "Endpoint=sb://127.0.0.1:1/;SharedAccessKeyName=k;SharedAccessKey=a2V5;EntityPath=hub",
    ]);
    let (status, body, _) = server.call("GET", "/status", &[], None);
    assert_eq!(status, 503, "GET /status while the source cannot connect: {body}");
    error_message(&body);
    // The rest of the API keeps working while the source is down.
    server.assert_alive();
}

#[test]
fn invalid_flag_value_stops_start_up_naming_the_parameter() {
    let args = full_args(&["--connection-state-cache-ttl", "abc"], true);
    let (ok, _, stderr) = run_expecting_exit(&args, &[]);
    assert!(!ok, "the server must exit with a failure status");
    assert!(
        stderr.contains("connection-state-cache-ttl"),
        "stderr does not name the parameter:\n{stderr}"
    );
}

#[test]
fn invalid_environment_value_stops_start_up_naming_the_parameter() {
    let args = full_args(&[], true);
    let (ok, _, stderr) = run_expecting_exit(&args, &[("CONNECTION_STATE_CACHE_TTL", "abc")]);
    assert!(!ok, "the server must exit with a failure status");
    let lower = stderr.to_lowercase();
    assert!(
        lower.contains("connection-state-cache-ttl") || lower.contains("connection_state_cache_ttl"),
        "stderr does not name the parameter:\n{stderr}"
    );
}

#[test]
fn invalid_camel_case_environment_value_stops_start_up() {
    let args = full_args(&[], true);
    let (ok, _, stderr) = run_expecting_exit(&args, &[("connectionStateCacheTTL", "abc")]);
    assert!(!ok, "the server must exit with a failure status");
    let lower = stderr.to_lowercase();
    assert!(
        lower.contains("connection-state-cache-ttl")
            || lower.contains("connection_state_cache_ttl")
            || lower.contains("connectionstatecachettl"),
        "stderr does not name the parameter:\n{stderr}"
    );
}

#[test]
fn generated_admin_secret_is_printed_in_a_connection_string_and_accepted() {
    let server = Server::start_without_secrets(&[]);
    let prefix = format!("Endpoint=http://127.0.0.1:{};SharedAccessKey=", server.port);
    let line = server
        .wait_for_stdout(Duration::from_secs(5), |l| l.contains(&prefix))
        .unwrap_or_else(|| panic!("no stdout line contains {prefix:?}; stdout:\n{}", server.stdout_lines().join("\n")));
    let rest = &line[line.find(&prefix).unwrap() + prefix.len()..];
    let key: String = rest
        .chars()
        .take_while(|c| !c.is_whitespace() && !matches!(c, '"' | '\'' | ';' | ',' | ')'))
        .collect();
    assert!(key.len() >= 16, "generated key {key:?} is too short");

    let (status, body, _) = server.call("PUT", "/logLevel/info", &[("Shared-Access-Key", &key)], None);
    assert_eq!(status, 204, "the printed key must work as Shared-Access-Key: {body}");
    // And the test secrets are not configured on this server.
    let (status, _, _) = server.call("PUT", "/logLevel/info", &[ADMIN], None);
    assert_eq!(status, 401, "a key that was never configured must not work");
}

#[test]
fn log_level_change_takes_effect_at_once() {
    // Log lines are written in the order things happen, so a session opened later at verbose is
    // the sentinel: once its "session opened" line is there, an earlier session's line would be too.
    let server = Server::start(&["--log-level", "error"]);
    let set_level = |level: &str| assert_eq!(server.call("PUT", &format!("/logLevel/{level}"), &[ADMIN], None).0, 204);
    let opened = |session: &str| server.stderr_lines().iter().any(|l| l.contains("session opened") && l.contains(session));
    let shown_at_verbose = || {
        set_level("verbose");
        let sentinel = server.new_session();
        let line = server.wait_for_stderr(Duration::from_secs(3), |l| l.contains("session opened") && l.contains(&sentinel));
        assert!(line.is_some(), "verbose lines shown after PUT /logLevel/verbose");
    };
    let hidden_at_error = server.new_session();
    shown_at_verbose();
    assert!(!opened(&hidden_at_error), "verbose lines hidden at error");
    set_level("warn");
    let hidden_at_warn = server.new_session();
    shown_at_verbose();
    assert!(!opened(&hidden_at_warn), "hidden again at warn");
}
