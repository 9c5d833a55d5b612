//! The IoT Hub client itself: SAS tokens (signed, cached, renewed), deadlines, back-pressure
//! when the hub is slow or gone, the hub address override and its plain-http guard.

mod common;
mod hub_double;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::*;
use hub_double::{Answer, HubDouble};
use serde_json::json;

fn start(hub: &HubDouble, extra: &[&str]) -> Server {
    let mut args: Vec<String> = hub.args();
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(&args)
}

fn read_twin(server: &Server) -> (u16, String) {
    let (status, body, _) = server.call_on(&new_agent(), "GET", "/deviceTwin/d1", &[ADMIN], None);
    (status, body)
}

fn invoke(server: &Server, params: serde_json::Value) -> (u16, String) {
    let body = json!({"deviceId": "d1", "methodParams": params});
    let (status, text, _) = server.call_on(&new_agent(), "POST", "/directMethod", &[ADMIN], Some(body));
    (status, text)
}

// ---- SAS tokens ------------------------------------------------------------------------------

#[test]
fn hub_double_refuses_a_wrong_signature() {
    // The double's own check, so a passing test means the server's signature was verified.
    let hub = HubDouble::start();
    let good = hub_double::expected_signature("testhub.azure-devices.net", "9999999999");
    let encoded: String = percent_encoding::utf8_percent_encode(&good, percent_encoding::NON_ALPHANUMERIC).to_string();
    let agent = new_agent();
    let url = format!("{}/twins/d1?api-version=2021-04-12", hub.url());
    let token = |sig: &str| format!("SharedAccessSignature sr=testhub.azure-devices.net&sig={sig}&se=9999999999&skn=service");
    let status = |auth: String| match agent.get(&url).set("Authorization", &auth).call() {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(s, _)) => s,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(status(token(&encoded)), 404, "a correct token reaches the (empty) simulated hub");
    assert_eq!(status(token("AAAA")), 400);
    assert_eq!(status(token(&encoded).replace("skn=service", "skn=other")), 400);
    assert_eq!(hub.violations().len(), 2);
}

#[test]
fn every_request_carries_a_valid_token_for_the_hub_host_and_it_is_reused() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &[]);
    for _ in 0..3 {
        assert_eq!(read_twin(&server).0, 200);
    }
    hub.assert_clean(); // signature, sr, skn, expiry checked on each request
    let requests = hub.requests();
    assert_eq!(requests.len(), 3);
    assert!(requests.iter().all(|r| r.authorization == requests[0].authorization), "the cached token is reused");
    let now = now_millis() as u64 / 1000;
    let expiry = requests[0].expiry;
    assert!(expiry > now + 3000 && expiry <= now + 3601, "default lifetime is an hour: se {expiry}, now {now}");
}

#[test]
fn token_is_renewed_before_it_expires() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let server = start(&hub, &["--iot-hub-sas-token-lifetime", "2"]);
    assert_eq!(read_twin(&server).0, 200);
    let first = hub.requests()[0].expiry;
    // Past three quarters of the lifetime (and past the first token's expiry) a new one is signed.
    // Time passing is what is under test; a token's expiry counts whole seconds (`se`).
    std::thread::sleep(Duration::from_millis(2200));
    let (status, body) = read_twin(&server);
    assert_eq!(status, 200, "{body}");
    let second = hub.requests()[1].expiry;
    assert!(second > first, "renewed token: se {second} after {first}");
    hub.assert_clean(); // an expired token would have been refused by the double
}

// ---- deadlines and back-pressure -------------------------------------------------------------

#[test]
fn hub_that_does_not_answer_gives_504_after_the_timeout() {
    let hub = HubDouble::start();
    let server = start(&hub, &["--iot-hub-timeout", "1"]);
    hub.script(Answer::Hang);
    let started = Instant::now();
    let (status, body) = read_twin(&server);
    let took = started.elapsed();
    assert_error(status, &body, 504, "did not answer within 1 s");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(4), "took {took:?}");
    // The next call works again.
    hub.add_device("d1", true);
    assert_eq!(read_twin(&server).0, 200);
}

#[test]
fn direct_method_deadline_follows_its_response_and_connect_timeouts() {
    let hub = HubDouble::start();
    // --iot-hub-timeout is not used for direct methods; the hub's margin (5 s) is shortened.
    let server = start(&hub, &["--iot-hub-timeout", "1", "--iot-hub-method-timeout-margin-ms", "500"]);
    hub.script(Answer::Hang);
    let started = Instant::now();
    let (status, body) =
        invoke(&server, json!({"methodName": "slow", "responseTimeoutInSeconds": 1, "connectTimeoutInSeconds": 1}));
    let took = started.elapsed();
    // 1 + 1 s for the device, plus the margin for the hub's own answer.
    assert_error(status, &body, 504, "did not answer within 3 s");
    assert!(took >= Duration::from_millis(2400) && took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn full_queue_answers_503_busy_at_once() {
    let hub = HubDouble::start();
    let server = start(&hub, &["--iot-hub-max-concurrency", "1", "--iot-hub-queue-size", "1", "--iot-hub-timeout", "3"]);
    hub.script(Answer::Hang);
    hub.script(Answer::Hang);
    std::thread::scope(|s| {
        let in_flight = s.spawn(|| read_twin(&server));
        assert!(hub.wait_for_requests(1, Duration::from_secs(5)), "first call reaches the hub");
        let queued = s.spawn(|| read_twin(&server));
        // The second call waits in the queue.
        server.wait_for_metric("hubcast_iot_hub_queued_requests", Duration::from_secs(5), Want::Eq(1.0));
        let (status, body) = read_twin(&server);
        assert_error(status, &body, 503, "IoT Hub client busy");
        // At once: answered while the first call still hangs on the one worker (until its
        // 3 s deadline), so the queued call has not reached the hub: an order of events, not
        // a time (before, `< 1 s` of wall time, which a loaded machine can pass).
        assert!(!in_flight.is_finished(), "busy is answered while the first call still hangs");
        assert_eq!(hub.request_count(), 1, "one worker: the queued call has not reached the hub");
        assert_eq!(server.metric("hubcast_iot_hub_queued_requests"), Some(1.0), "the queued call still waits");
        let (status, body) = in_flight.join().unwrap();
        assert_error(status, &body, 504, "");
        // The queued call waited behind the hanging one, then hung too: its deadline counts
        // from the moment it was queued.
        let started = Instant::now();
        let (status, body) = queued.join().unwrap();
        assert_error(status, &body, 504, "");
        assert!(started.elapsed() < Duration::from_secs(2), "the queued call's deadline ran while it waited");
    });
    assert!(hub.request_count() <= 2, "one worker: never more than one call at the hub at a time");
}

#[test]
fn a_hanging_hub_does_not_block_the_cores() {
    let hub = HubDouble::start();
    let server = start(&hub, &["--iot-hub-max-concurrency", "2", "--iot-hub-timeout", "5"]);
    hub.script(Answer::Hang);
    hub.script(Answer::Hang);
    std::thread::scope(|s| {
        let stuck: Vec<_> = (0..2).map(|_| s.spawn(|| read_twin(&server))).collect();
        assert!(hub.wait_for_requests(2, Duration::from_secs(5)));
        // Both cores keep serving everything else meanwhile, on fresh connections: all of it is
        // answered while both hub calls still hang (they end with 504 after 5 s).
        for i in 0..20 {
            server.assert_alive();
            let session = server.new_session_on(&new_agent());
            server.ingest_on(&new_agent(), json!({"deviceId": format!("dev{i}"), "body": {"t": i}}));
            let (status, body, _) =
                server.call_on(&new_agent(), "GET", &format!("/lastValue/dev{i}/t"), &[ADMIN], None);
            assert_eq!(status, 200, "{body}");
            assert!(!session.is_empty());
        }
        assert!(stuck.iter().all(|h| !h.is_finished()), "served while the hub calls hang");
        for h in stuck {
            assert_eq!(h.join().unwrap().0, 504);
        }
    });
}

#[test]
fn unreachable_hub_is_503() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }; // closed again: nothing listens there
    let hub = HubDouble::start();
    let url = format!("http://127.0.0.1:{port}");
    let cs = hub.connection_string();
    let server = Server::start(&[
        "--iot-hub-service-connection-string",
        &cs,
        "--iot-hub-service-url",
        &url,
        "--iot-hub-allow-insecure-http",
    ]);
    let started = Instant::now();
    let (status, body) = read_twin(&server);
    assert_error(status, &body, 503, "IoT Hub unreachable");
    assert!(started.elapsed() < Duration::from_secs(5));
    let (status, body) = invoke(&server, json!({"methodName": "m"}));
    assert_error(status, &body, 503, "IoT Hub unreachable");
}

#[test]
fn connection_closed_without_an_answer_is_502() {
    let hub = HubDouble::start();
    let server = start(&hub, &[]);
    hub.script(Answer::Close);
    let (status, body) = read_twin(&server);
    assert!(status == 502 || status == 503, "{status} {body}");
    assert_error(status, &body, status, "IoT Hub");
    // The pool recovers: the next call gets a new connection.
    hub.add_device("d1", true);
    assert_eq!(read_twin(&server).0, 200);
}

// ---- hub address option ----------------------------------------------------------------------

#[test]
fn plain_http_hub_url_is_refused_without_the_allow_option() {
    let hub = HubDouble::start();
    let args = full_args(
        &["--iot-hub-service-connection-string", &hub.connection_string(), "--iot-hub-service-url", &hub.url()],
        true,
    );
    let (ok, _, stderr) = run_expecting_exit(&args, &[]);
    assert!(!ok, "start-up must fail");
    assert!(stderr.contains("--iot-hub-allow-insecure-http"), "stderr names the option: {stderr}");
}

#[test]
fn hub_url_and_insecure_option_work_as_environment_variables() {
    let hub = HubDouble::start();
    hub.add_device("d1", true);
    let cs = hub.connection_string();
    let url = hub.url();
    let server = Server::start_with_env(
        &["--iot-hub-service-connection-string", &cs],
        &[("IOT_HUB_SERVICE_URL", &url), ("IOT_HUB_ALLOW_INSECURE_HTTP", "true")],
    );
    assert_eq!(read_twin(&server).0, 200);
    hub.assert_clean();
}

#[test]
fn service_key_that_is_not_base64_disables_the_hub_api_and_is_reported() {
    let server = Server::start(&[
        "--iot-hub-service-connection-string",
        "HostName=h.azure-devices.net;SharedAccessKeyName=service;SharedAccessKey=not base64!",
    ]);
    let (status, body, _) = server.call("GET", "/status", &[], None);
    assert_error(status, &body, 500, "base64");
    let (status, body) = invoke(&server, json!({"methodName": "m"}));
    assert_error(status, &body, 400, "IoT Hub API disabled");
}
