//! `hubcast-load peer` against the real brokers (nats-server, mosquitto; scripts/test.sh
//! installs them): a short run of issue 25's fan-out shape at a tiny scale, checking that the
//! subscribers got every message the broker answered for, each with its send time.

use std::process::Command;

use serde_json::Value;

fn run_peer(peer: &str) -> Value {
    let json = std::env::temp_dir().join(format!("hubcast-load-peer-{peer}-{}.json", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_hubcast-load"))
        .args(["--warmup", "0.2", "--duration", "0.6", "--json"])
        .arg(&json)
        .args(["peer", "--peer", peer, "--clients", "20", "--subs", "5", "--devices", "50", "--batch", "10"])
        .args(["--fleet-conns", "2", "--pipeline", "4", "--rate", "2000,0"])
        .output()
        .expect("run hubcast-load");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "hubcast-load peer --peer {peer} failed\n{stdout}\n{stderr}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    doc
}

fn every_message_arrives(peer: &str) {
    let doc = run_peer(peer);
    let result = &doc["results"][0];
    assert_eq!(result["params"]["connected"], 20, "{result}");
    // 20 subscribers x 5 of 50 devices: every device has 2 subscribers.
    assert_eq!(result["params"]["subscribers_per_device"].as_f64(), Some(2.0), "{result}");
    let rows = result["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "one row per rate: {result}");
    for row in rows {
        let sent = row["sent_total"].as_u64().unwrap();
        assert!(sent > 0, "nothing published: {row}");
        assert_eq!(row["delivered_total"].as_u64(), Some(2 * sent), "every message reached both subscribers: {row}");
        assert!(row["delivered_msg_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["p99_ms"].as_f64().unwrap() > 0.0, "latency measured from sentAt: {row}");
        assert!(row["server_cpu"].as_f64().unwrap() > 0.0, "the broker's CPU read from /proc: {row}");
        assert_eq!(row["fleet_errors"], 0, "{row}");
        assert_eq!(row["socket_closes"], 0, "{row}");
    }
}

#[test]
fn nats_subscribers_get_every_message_published_over_websocket() {
    every_message_arrives("nats");
}

#[test]
fn mosquitto_subscribers_get_every_message_published_over_websocket() {
    every_message_arrives("mosquitto");
}
