//! The live console (`GET /console`) in a real headless browser (Debian's chromium driven by
//! puppeteer-core from tests/js), and the admin-only device list it pages through
//! (`GET /devices`).

mod common;
mod tools;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

#[test]
fn values_published_with_ingest_appear_in_the_console_in_a_real_browser() {
    let server = Server::start(&[]);
    let script = tools::repo().join("tests/js/console-check.mjs");
    let mut cmd = Command::new("node");
    cmd.arg(&script).arg(&server.base).arg(ADMIN_KEY).env("CHROMIUM", tools::on_path("chromium"));
    // HUBCAST_CONSOLE_SCREENSHOT=docs/console.png (with --simulate in the server) renews the
    // console screenshot (README, docs/PROTOCOL.md).
    if let Ok(path) = std::env::var("HUBCAST_CONSOLE_SCREENSHOT") {
        cmd.arg(path);
    }
    let out = tools::run(&mut cmd);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && report.contains("\"ok\":true"), "the console check failed: {report}");
    server.assert_alive();
}

#[test]
fn console_page_is_self_contained() {
    let server = Server::start(&[]);
    let (status, page, headers) = server.call_raw("GET", "/console", &[], b"");
    assert_eq!(status, 200);
    assert!(headers.get("content-type").unwrap_or("").starts_with("text/html"));
    let csp = headers.get("content-security-policy").expect("a CSP header");
    assert!(csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"), "{csp}");
    // Nothing loaded from elsewhere: no external script, style or image reference.
    for needle in ["src=\"http", "href=\"http", "src=\"//", "href=\"//", "@import"] {
        assert!(!page.contains(needle), "the page references {needle}…");
    }
}

fn page(server: &Server, query: &str) -> Value {
    let (status, body, _) = server.call("GET", &format!("/devices?{query}"), &[ADMIN], None);
    assert_eq!(status, 200, "{body}");
    parse_json(&body)
}

fn ids(page: &Value) -> Vec<&str> {
    page["devices"].as_array().unwrap().iter().map(|d| d["deviceId"].as_str().unwrap()).collect()
}

#[test]
fn devices_are_listed_by_cursor_with_search_and_last_values() {
    let server = Server::start(&[]);
    let mut batch: Vec<Value> = (0..7).map(|i| json!({"deviceId": format!("pg-{i}"), "body": {"n": i}})).collect();
    batch.push(json!({"deviceId": "other", "body": {"n": 99}}));
    batch.push(json!({"deviceId": "pg-3", "source": "deviceConnectionStateEvents",
                      "properties": {"opType": "deviceDisconnected"}, "body": {"sequenceNumber": "9"}}));
    server.ingest(Value::Array(batch));

    let first = page(&server, "q=pg-&limit=3");
    assert_eq!(first["total"], 7);
    assert_eq!(ids(&first), ["pg-0", "pg-1", "pg-2"]);
    assert_eq!(first["devices"][0]["telemetry"], json!({"n": 0}));
    assert_eq!(first["next"], "pg-2");
    let second = page(&server, "q=pg-&limit=3&after=pg-2");
    assert_eq!(ids(&second), ["pg-3", "pg-4", "pg-5"]);
    assert_eq!(second["devices"][0]["connected"], false);
    assert!(second["devices"][1]["lastSeen"].is_string());
    let last = page(&server, "q=pg-&limit=3&after=pg-5");
    assert_eq!(ids(&last), ["pg-6"]);
    assert_eq!(last["next"], Value::Null);
    assert_eq!(page(&server, "")["total"], 8);
    assert!(ids(&page(&server, "q=zzz")).is_empty());
}

#[test]
fn device_list_needs_the_key_and_names_bad_parameters() {
    let server = Server::start(&[]);
    let (status, body, _) = server.call("GET", "/devices", &[], None);
    assert_error(status, &body, 401, "Shared-Access-Key");
    for (query, needle) in [("limit=0", "`limit` is `0`"), ("limit=abc", "from 1 to 200"), ("limit=201", "`limit` is `201`")] {
        let (status, body, _) = server.call("GET", &format!("/devices?{query}"), &[ADMIN], None);
        assert_error(status, &body, 400, needle);
    }
    let long = "x".repeat(129);
    let (status, body, _) = server.call("GET", &format!("/devices?q={long}"), &[ADMIN], None);
    assert_error(status, &body, 400, "`q` is longer than 128 bytes");
}

/// The device list shows last values as the device sent them, like `/lastValue` does: a
/// number no machine type holds is neither rounded nor turned into `null`.
#[test]
fn the_device_list_keeps_big_numbers_as_sent() {
    let server = Server::start(&[]);
    let body = br#"{"deviceId":"big","body":{"u":18446744073709551616,"inf":1e309,"t":21.50}}"#;
    let (status, answer, _) = server.call_raw("POST", "/ingest", &[ADMIN, ("Content-Type", "application/json")], body);
    assert_eq!((status, answer.as_str()), (200, r#"{"accepted":1}"#));
    let (status, list, _) = server.call("GET", "/devices?q=big", &[ADMIN], None);
    assert_eq!(status, 200, "{list}");
    let members = [r#""deviceId":"big""#, r#""u":18446744073709551616"#, r#""inf":1e309"#, r#""t":21.50"#, r#""telemetryKeys":3"#];
    for member in members {
        assert!(list.contains(member), "{member} in {list}");
    }
}
