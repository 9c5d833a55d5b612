//! Log formats: `--log-format json` writes one JSON object per line (time, level with SPEC's
//! names, target, message, fields), and `PUT /logLevel/:level` changes what is written live, in
//! both formats. Each negative ("not written") is checked against a later line on the same
//! stderr stream, which is written in order.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

fn json_lines(server: &Server) -> Vec<Value> {
    server
        .stderr_lines()
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("log line is not JSON ({e}): {line}")))
        .collect()
}

fn wait_json(server: &Server, pred: impl Fn(&Value) -> bool) -> Value {
    let line = server
        .wait_for_stderr(WAIT, |l| serde_json::from_str::<Value>(l).is_ok_and(|v| pred(&v)))
        .unwrap_or_else(|| panic!("no such log line; stderr:\n{}", server.stderr_lines().join("\n")));
    serde_json::from_str(&line).unwrap()
}

fn set_level(server: &Server, level: &str) {
    let (status, body, _) = server.call("PUT", &format!("/logLevel/{level}"), &[ADMIN], None);
    assert_eq!(status, 204, "{body}");
}

fn position(server: &Server, needle: &str) -> Option<usize> {
    server.stderr_lines().iter().position(|l| l.contains(needle))
}

#[test]
fn json_lines_carry_spec_levels_and_follow_the_live_level() {
    let server = Server::start(&["--log-format", "json", "--log-level", "info"]);
    let started = wait_json(&server, |v| v["message"] == "hubcast started");
    assert_eq!(started["level"], "info");
    assert_eq!(started["target"], "hubcast::app");
    assert_eq!(started["fields"]["cores"], 2, "numbers stay numbers: {started}");
    assert!(parse_utc_millis(started["time"].as_str().unwrap()).is_some(), "time is ISO 8601: {started}");

    // At info, opening a session (logged at verbose) writes nothing…
    server.new_session();
    set_level(&server, "verbose");
    let changed = wait_json(&server, |v| v["message"] == "log level changed");
    assert_eq!(changed["fields"]["level"], "verbose");
    assert_eq!(position(&server, "session opened"), None, "written at info: {:?}", server.stderr_lines());

    // …at verbose it does, with SPEC's name for the level (tracing's DEBUG).
    server.new_session();
    let opened = wait_json(&server, |v| v["message"] == "session opened");
    assert_eq!(opened["level"], "verbose");
    assert!(opened["fields"]["session"].is_string());

    // At warn, sessions are silent again, and a warning (an ingest fault) still gets through.
    set_level(&server, "warn");
    let before = server.stderr_lines().len();
    server.new_session();
    server.ingest(json!({"deviceId": "log-dev", "body": "not an object"}));
    let fault = wait_json(&server, |v| v["fields"]["fault"] == "not_object");
    assert_eq!(fault["level"], "warn");
    assert_eq!(fault["fields"]["fault"], "not_object");
    let after: Vec<String> = server.stderr_lines()[before..].to_vec();
    assert!(!after.iter().any(|l| l.contains("session opened")), "written at warn: {after:?}");

    // Every line, from start to end, is one JSON object with the four keys.
    for line in json_lines(&server) {
        for key in ["time", "level", "target", "fields"] {
            assert!(line.get(key).is_some(), "no `{key}` in {line}");
        }
        assert!(["error", "warn", "info", "verbose", "debug"].contains(&line["level"].as_str().unwrap()), "{line}");
    }
}

#[test]
fn text_format_follows_the_live_level_too() {
    let server = Server::start(&["--log-level", "info"]);
    server.wait_for_stderr(WAIT, |l| l.contains("hubcast started")).expect("start line");
    server.new_session();
    set_level(&server, "verbose");
    server.wait_for_stderr(WAIT, |l| l.contains("log level changed")).expect("level change logged");
    assert_eq!(position(&server, "session opened"), None, "written at info");
    server.new_session();
    let line = server.wait_for_stderr(WAIT, |l| l.contains("session opened")).expect("session opened at verbose");
    assert!(serde_json::from_str::<Value>(&line).is_err(), "text format writes text: {line}");
}

#[test]
fn an_unknown_log_format_stops_start_up_naming_the_flag() {
    let (ok, _, stderr) = run_expecting_exit(&full_args(&["--log-format", "yaml"], true), &[]);
    assert!(!ok);
    assert!(stderr.contains("--log-format") && stderr.contains("yaml") && stderr.contains("json"), "{stderr}");
}
