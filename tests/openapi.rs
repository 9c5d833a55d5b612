//! The OpenAPI document (`docs/openapi.json`, served at `GET /openapi.json`) checked by real
//! tools: `openapi-spec-validator` validates it, and Schemathesis sends generated requests
//! (valid and invalid) to a live hubcast with an IoT Hub double behind it, failing on any 5xx,
//! any status, content type, header or body the document does not declare, valid data refused
//! or invalid data accepted.

mod common;
mod hub_double;
mod tools;

use std::process::Command;

use common::*;
use hub_double::HubDouble;

#[test]
fn served_document_is_the_repo_document_and_valid_openapi() {
    let server = Server::start(&[]);
    let (status, body, headers) = server.call_raw("GET", "/openapi.json", &[], b"");
    assert_eq!(status, 200);
    assert!(headers.get("content-type").unwrap_or("").starts_with("application/json"));
    let in_repo = std::fs::read_to_string(tools::repo().join("docs/openapi.json")).unwrap();
    assert_eq!(body, in_repo, "GET /openapi.json serves docs/openapi.json as built");
    let generated = tools::run(Command::new(tools::venv_bin("python")).arg(tools::repo().join("docs/openapi.py")));
    assert!(generated.status.success());
    assert_eq!(String::from_utf8_lossy(&generated.stdout), in_repo, "docs/openapi.json is stale: run `python3 docs/openapi.py --write`");
    let doc = parse_json(&body);
    assert_eq!(doc["openapi"], "3.1.0");
    // Every route of SPEC.md and hubcast's own is described.
    for path in [
        "/version", "/status", "/status/details", "/logLevel/{level}", "/session", "/sessions", "/sessions/{sessionId}", "/grants",
        "/subscription", "/subscriptions", "/lastValue/{deviceId}", "/lastValue/{deviceId}/{telemetryKey}",
        "/deviceTwin/{deviceId}", "/connectionState/{deviceId}", "/directMethod", "/deviceTwinDesiredProperties",
        "/ingest", "/metrics", "/openapi.json", "/devices", "/console",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} is not in the document");
    }
    let file = std::env::temp_dir().join(format!("hubcast-openapi-{}.json", std::process::id()));
    std::fs::write(&file, &body).unwrap();
    let out = tools::run(Command::new(tools::venv_bin("openapi-spec-validator")).arg(&file));
    let _ = std::fs::remove_file(&file);
    assert!(out.status.success(), "openapi-spec-validator refused the document");
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK"));
}

#[test]
fn schemathesis_finds_nothing_against_a_live_server() {
    let hub = HubDouble::start();
    let mut args = hub.args();
    // Bounded: Schemathesis's requests must stay well inside the limits (no 503 for sessions).
    args.extend(["--log-level", "warn"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args);
    let max_time = std::env::var("HUBCAST_SCHEMATHESIS_SECONDS").unwrap_or_else(|_| "60".into());
    let out = tools::run(
        Command::new(tools::venv_bin("schemathesis"))
            .current_dir(tools::repo().join("tests"))
            .env("NO_COLOR", "1")
            .args(["--config-file", "schemathesis.toml", "run"])
            .arg(server.url("/openapi.json"))
            .args(["--url", &server.base, "--header", &format!("Shared-Access-Key: {ADMIN_KEY}")])
            .args(["--max-examples", "25", "--max-time", &max_time, "--seed", "1"])
            .args(["--generation-database", "none", "--no-color", "--request-timeout", "10", "--workers", "1"]),
    );
    server.assert_alive();
    assert!(out.status.success(), "Schemathesis found failures (see its report above)");
}
