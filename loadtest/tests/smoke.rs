//! Smoke run of the harness, so that it cannot rot: `hubcast-load all` at a tiny scale
//! against the real hubcast binary of this workspace (both fleets, every socket transport,
//! REST, idle sockets), checking that every part measured something and nothing failed.
//!
//! The hubcast binary is the one cargo built next to this test (`target/<profile>/hubcast`);
//! `cargo test --workspace` builds it, and when only this package is tested it is built here.

mod common;

use std::process::Command;

use common::hubcast_binary;

use serde_json::Value;

fn rows<'a>(doc: &'a Value, name_prefix: &str) -> Vec<&'a Value> {
    doc["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["name"].as_str().unwrap().starts_with(name_prefix))
        .flat_map(|r| r["rows"].as_array().unwrap())
        .collect()
}

#[test]
fn the_whole_suite_runs_at_a_tiny_scale_and_measures_every_part() {
    let json = std::env::temp_dir().join(format!("hubcast-load-smoke-{}.json", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_hubcast-load"))
        .arg("--spawn")
        .arg(hubcast_binary())
        .args(["--cores", "2", "--warmup", "0.2", "--duration", "0.5", "--json"])
        .arg(&json)
        .args(["all", "--scale", "0.002", "--ramp", "1000", "--idle", "10000"])
        .output()
        .expect("run hubcast-load");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "hubcast-load failed\n{stdout}\n{stderr}");
    assert!(stdout.contains("summary (targets)"), "{stdout}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(doc["machine"]["nproc"].as_u64().map(|n| n > 0), Some(true));

    for row in rows(&doc, "ingest") {
        assert!(row["ingest_msg_s"].as_f64().unwrap() > 0.0, "nothing ingested: {row}");
        assert_eq!(row["fleet_errors"], 0, "{row}");
    }
    assert_eq!(rows(&doc, "ingest (amqp)").len(), 1, "the AMQP fleet ran");
    for row in rows(&doc, "ingest (amqp)") {
        // The endpoint writes its AMQP by hand: every message it sent reached hubcast's cores.
        let sent = row["fleet_sent_total"].as_f64().unwrap();
        assert!(sent > 0.0, "{row}");
        // Nothing lost: at least what it sent. Not equality: 1 run in 4 on 53f2d7c hubcast
        // counted ~0.2 % more than the endpoint's `sent` (115,059 received, 114,968 taken in,
        // 114,830 sent); the cause (the endpoint's count or hubcast's) is not found yet and is
        // an open finding of issue 25 (docs/benchmarks/2026-11-27-issue25-ingest.md).
        let received = row["hubcast_received_total"].as_f64().unwrap();
        let taken_in = row["hubcast_in_total"].as_f64().unwrap();
        assert!(received >= sent && taken_in >= sent, "a message sent did not reach hubcast's cores: {row}");
    }
    for prefix in ["fanout (ws", "fanout (socketio"] {
        let steps = rows(&doc, prefix);
        assert!(!steps.is_empty(), "{prefix}");
        for row in steps {
            assert!(row["delivered_msg_s"].as_f64().unwrap() > 0.0, "nothing delivered: {row}");
            assert!(row["p99_ms"].as_f64().unwrap() > 0.0, "no latency measured: {row}");
            assert_eq!(row["socket_closes"], 0, "{row}");
            assert_eq!(row["fleet_errors"], 0, "{row}");
        }
    }
    let batched = rows(&doc, "fanout (ws-batch");
    assert!(!batched.is_empty(), "the batched-frame client ran");
    for row in rows(&doc, "fanout (") {
        assert!(row["frames_per_write"].as_f64().unwrap() >= 1.0, "writes are counted: {row}");
        assert!(row["msgs_per_frame"].as_f64().unwrap() > 0.0, "{row}");
    }
    for row in rows(&doc, "rest") {
        assert!(row["req_s"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["errors"], 0, "{row}");
    }
    let idle = rows(&doc, "idle");
    assert_eq!(idle[0]["sockets"], 20, "{}", idle[0]);
    assert_eq!(idle[0]["server_sockets"].as_f64(), Some(20.0), "{}", idle[0]);
    assert!(idle[0]["rss_held_mb"].as_f64().unwrap() > 0.0);
    assert!(rows(&doc, "summary").len() >= 8);
}

/// `--pin`: hubcast runs on the first CPU only (read back from /proc while it runs), and the
/// report says where each side ran.
#[test]
fn pin_puts_hubcast_and_the_harness_on_separate_cpus() {
    let json = std::env::temp_dir().join(format!("hubcast-load-pin-{}.json", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_hubcast-load"))
        .arg("--spawn")
        .arg(hubcast_binary())
        .args(["--cores", "1", "--pin", "--warmup", "0.2", "--duration", "0.3", "--json"])
        .arg(&json)
        .args(["ingest", "--devices", "10", "--batch", "10", "--fleet-conns", "1"])
        .output()
        .expect("run hubcast-load");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        // One CPU: nothing to split, and the harness says so instead of measuring.
        assert!(!output.status.success() && stderr.contains("no CPU left for the harness"), "{stdout}\n{stderr}");
        return;
    }
    assert!(output.status.success(), "hubcast-load failed\n{stdout}\n{stderr}");
    assert!(stdout.contains("pinning: hubcast on CPU 0, harness on CPU 1"), "{stdout}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(doc["pinning"]["hubcast"], serde_json::json!([0]));
    assert_eq!(doc["results"][0]["params"]["hubcast_cpus"], "0", "the kernel's view of the spawned hubcast");
    assert!(doc["results"][0]["rows"][0]["ingest_msg_s"].as_f64().unwrap() > 0.0);
}
