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
    // Another seed explores other examples (the run is bounded by time, so it varies anyway).
    let seed = std::env::var("HUBCAST_SCHEMATHESIS_SEED").unwrap_or_else(|_| "1".into());
    let out = tools::run(
        Command::new(tools::venv_bin("schemathesis"))
            .current_dir(tools::repo().join("tests"))
            .env("NO_COLOR", "1")
            // Byte limits that JSON Schema cannot state (see the hooks file).
            .env("SCHEMATHESIS_HOOKS", tools::repo().join("tests/schemathesis_hooks.py"))
            .args(["--config-file", "schemathesis.toml", "run"])
            .arg(server.url("/openapi.json"))
            .args(["--url", &server.base, "--header", &format!("Shared-Access-Key: {ADMIN_KEY}")])
            .args(["--max-examples", "25", "--max-time", &max_time, "--seed", &seed])
            .args(["--generation-database", "none", "--no-color", "--request-timeout", "10", "--workers", "1"]),
    );
    server.assert_alive();
    assert!(out.status.success(), "Schemathesis found failures (see its report above)");
}

/// The hook that lets `positive_data_acceptance` stay on (tests/schemathesis_hooks.py) drops
/// a failure only for a value within its limit in characters and over it in bytes, refused
/// for that: any other 400 to schema-valid data, or a message naming a field the request does
/// not hold over the limit, still fails the run.
#[test]
fn the_byte_limit_hook_drops_only_byte_limit_refusals() {
    let script = r#"
import importlib.util, json, sys, types
spec = importlib.util.spec_from_file_location("hooks", sys.argv[1])
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)
def case(body=None, path=None, query=None):
    return types.SimpleNamespace(body=body, path_parameters=path, query=query, operation=types.SimpleNamespace(label="PUT /x"))
def response(status, message):
    return types.SimpleNamespace(status_code=status, content=json.dumps({"errorMessage": message}).encode())
valid = types.SimpleNamespace(code="ST202")
other = types.SimpleNamespace(code="ST201")
wide = "\U0001F600" * 40  # 40 characters, 160 bytes
msg = "element 1: field `deviceId` is longer than 128 bytes"
keep = lambda *a: hooks.filter_failure(None, *a)
assert keep(valid, case(body=[{"deviceId": "a"}, {"deviceId": wide}]), response(400, msg)) is False
assert keep(valid, case(path={"deviceId": wide}), response(400, "deviceId is longer than 128 bytes")) is False
assert keep(valid, case(query={"q": wide}), response(400, "query parameter `q` is longer than 128 bytes")) is False
from urllib.parse import quote
assert keep(valid, case(path={"telemetryKey": quote("\u00e9" * 200, safe="")}), response(400, "telemetryKey is longer than 256 bytes")) is False, "a path value kept percent-encoded"
assert keep(valid, case(body={"deviceId": "a" * 129}), response(400, msg)) is True, "over in characters: the schema's own limit"
assert keep(valid, case(body={"deviceId": "a"}), response(400, msg)) is True, "no value over the limit"
assert keep(valid, case(body={"telemetryKey": wide}), response(400, msg)) is True, "another field is over"
assert keep(valid, case(body={"deviceId": wide}), response(400, "unknown grant type")) is True, "another refusal"
assert keep(valid, case(body={"deviceId": wide}), response(413, msg)) is True, "another status"
assert keep(other, case(body={"deviceId": wide}), response(400, msg)) is True, "another check"
print("hook ok")
"#;
    let out = tools::run(
        Command::new(tools::venv_bin("python")).arg("-c").arg(script).arg(tools::repo().join("tests/schemathesis_hooks.py")),
    );
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("hook ok"), "the hook's self-test failed");
}
