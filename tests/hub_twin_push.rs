//! Live twin pushes with an IoT Hub service connection: every `deviceTwin` envelope carries the
//! whole twin. ux4iot's `useDeviceTwin` replaces its state with each push, so a change pushed
//! alone would wipe `desired`, `deviceId` and the rest. A change is merged into the last whole
//! twin known, read from the hub first when none is.

mod common;
mod hub_double;

use std::time::{Duration, Instant};

use common::*;
use hub_double::{Answer, HubDouble};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(5);

fn start(hub: &HubDouble) -> Server {
    let args: Vec<String> = hub.args(); // deviceTwinCacheTTL: the default, -1
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(&args)
}

/// A session granted and subscribed to `device`'s twin.
fn twin_subscriber(server: &Server, device: &str) -> String {
    let session = server.new_session();
    server.grant(&session, kind("deviceTwin", device));
    let (status, body) = server.subscribe(&session, kind("deviceTwin", device));
    assert_eq!(status, 204, "{body}");
    session
}

fn update(device: &str, body: Value) -> Value {
    json!({"deviceId": device, "source": "twinChangeEvents", "properties": {"opType": "updateTwin"}, "body": body})
}

fn twin_gets(hub: &HubDouble) -> usize {
    hub.requests().iter().filter(|r| r.method == "GET").count()
}

fn next_twin(live: &mut common::ws::Live) -> Value {
    let frame = live.next_json(WAIT).expect("a deviceTwin frame");
    assert_eq!(frame["deviceId"], json!("d1"), "{frame}");
    frame["deviceTwin"].clone()
}

#[test]
fn a_change_with_no_twin_known_is_merged_into_the_hub_twin_and_pushed_whole() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub);
    let session = twin_subscriber(&server, "d1");
    let mut live = server.live(&session);
    server.ingest(update("d1", json!({"version": 5, "properties": {"reported": {"fw": "2.0", "mode": "eco"}}})));
    let twin = next_twin(&mut live);
    assert_eq!(twin["deviceId"], json!("d1"), "{twin}");
    assert_eq!(twin["version"], json!(5));
    assert_eq!(twin["properties"]["desired"]["interval"], json!(10), "desired kept: {twin}");
    assert_eq!(twin["properties"]["reported"]["fw"], json!("2.0"));
    assert_eq!(twin["properties"]["reported"]["mode"], json!("eco"));
    assert_eq!(twin["connectionState"], json!("Connected"));
    assert_eq!(twin_gets(&hub), 1);
    // The next change merges into the twin now known, without asking the hub again.
    server.ingest(update("d1", json!({"version": 6, "properties": {"reported": {"mode": null}}})));
    let twin = next_twin(&mut live);
    assert_eq!(twin["version"], json!(6));
    assert_eq!(twin["properties"]["desired"]["interval"], json!(10));
    assert_eq!(twin["properties"]["reported"]["fw"], json!("2.0"));
    assert!(twin["properties"]["reported"].get("mode").is_none(), "null deletes: {twin}");
    assert_eq!(twin_gets(&hub), 1);
    hub.assert_clean();
}

/// ux4iot's order: grant, read the twin (the hook's first state), subscribe, then live changes.
/// The read is kept as the base of the pushes, so the first change needs no second hub read.
#[test]
fn the_use_device_twin_flow_reads_the_hub_once_and_pushes_whole_twins() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub);
    let session = server.new_session();
    server.grant(&session, kind("deviceTwin", "d1"));
    let (status, body, _) = server.call("GET", "/deviceTwin/d1", &[("sessionId", &session)], None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(parse_json(&body)["data"]["properties"]["reported"]["fw"], json!("1.0"));
    assert_eq!(server.subscribe(&session, kind("deviceTwin", "d1")).0, 204);
    let mut live = server.live(&session);
    server.ingest(update("d1", json!({"version": 5, "properties": {"reported": {"fw": "2.0"}}})));
    let twin = next_twin(&mut live);
    assert_eq!(twin["deviceId"], json!("d1"));
    assert_eq!(twin["properties"]["desired"]["interval"], json!(10), "{twin}");
    assert_eq!(twin["properties"]["reported"]["fw"], json!("2.0"));
    assert_eq!(twin_gets(&hub), 1, "the session's read is the base");
    // A change older than the twin known is dropped; the next one is pushed (same socket).
    server.ingest(update("d1", json!({"version": 5, "properties": {"reported": {"fw": "stale"}}})));
    server.ingest(update("d1", json!({"version": 7, "properties": {"reported": {"fw": "3.0"}}})));
    let twin = next_twin(&mut live);
    assert_eq!((twin["version"].clone(), twin["properties"]["reported"]["fw"].clone()), (json!(7), json!("3.0")));
    // Without a twin cache, reads still ask the hub.
    server.call("GET", "/deviceTwin/d1", &[("sessionId", &session)], None);
    assert_eq!(twin_gets(&hub), 2);
    hub.assert_clean();
}

/// When the hub cannot give the whole twin, the change is not pushed (a change alone is not the
/// twin); it is counted as `twin_unavailable`, and the next change tries the hub again.
#[test]
fn a_failed_hub_read_pushes_nothing_partial_and_the_next_change_is_pushed_whole() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub);
    let session = twin_subscriber(&server, "d1");
    let mut live = server.live(&session);
    hub.script(Answer::hub_error(500, "ServerError", "try later"));
    server.ingest(update("d1", json!({"version": 5, "properties": {"reported": {"partial": true}}})));
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, metrics, _) = server.call("GET", "/metrics", &[ADMIN], None);
        if metrics.contains("hubcast_ingest_faults_total{kind=\"twin_unavailable\"} 1") {
            break;
        }
        assert!(Instant::now() < deadline, "twin_unavailable not counted: {metrics}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(server.wait_for_stderr(WAIT, |l| l.contains("twin_unavailable")).is_some(), "the failure is logged");
    // The hub answers again: the next change is pushed, whole; nothing was pushed before it.
    server.ingest(update("d1", json!({"version": 6, "properties": {"reported": {"fw": "2.0"}}})));
    let twin = next_twin(&mut live);
    assert_eq!(twin["version"], json!(6), "the first frame is the whole twin at v6: {twin}");
    assert_eq!(twin["deviceId"], json!("d1"));
    assert_eq!(twin["properties"]["desired"]["interval"], json!(10));
    assert_eq!(twin["properties"]["reported"]["fw"], json!("2.0"));
    assert_eq!(twin_gets(&hub), 2);
}

/// A change nobody is subscribed to, with no whole twin to merge into, is not kept at all (it
/// is not the twin, and a later read asks the hub): no device entry is left behind.
#[test]
fn a_change_nobody_watches_with_no_twin_known_leaves_nothing() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub);
    server.ingest(json!([
        update("d1", json!({"version": 5, "properties": {"reported": {"fw": "2.0"}}})),
        {"deviceId": "d2", "body": {"t": 1}}
    ]));
    let (_, metrics, _) = server.call("GET", "/metrics", &[ADMIN], None);
    assert!(metrics.contains("\nhubcast_devices 1\n"), "only d2's telemetry is kept: {metrics}");
    assert_eq!(twin_gets(&hub), 0, "nobody to push to: the hub is not asked");
    let (status, body, _) = server.call("GET", "/deviceTwin/d1", &[ADMIN], None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(parse_json(&body)["data"]["properties"]["reported"]["fw"], json!("1.0"), "the hub's twin");
}
