//! `hubcast-load`: drives a running hubcast over its real interfaces — the device fleet in
//! (`POST /ingest`, or an AMQP 1.0 Event Hubs-like endpoint served here), live sockets out
//! (plain WebSocket, Socket.IO), REST — bounded in time and count, on loopback only, and
//! reports rates, latency, CPU and memory as a table and as JSON.
//!
//! - [`cli`]: options and modes;
//! - [`target`]: the hubcast under test (spawned or given), `/proc` CPU and RSS, `/metrics`;
//! - [`fleet`]: devices sending telemetry with a `sentAt` time, over [`fleet::http`] or [`fleet::amqp`];
//! - [`clients`]: sessions, grants, subscriptions and socket readers that count and time messages;
//! - [`http`], [`ws`]: the small HTTP/1.1 and WebSocket / Engine.IO clients;
//! - [`hist`]: latency histograms;
//! - [`modes`]: `ingest`, `fanout`, `idle`, `rest`, `all`;
//! - [`peers`]: `peer`, the fan-out shapes against NATS or Mosquitto (issue 25's comparison);
//! - [`scale`]: `fleet`, the fleet-scale run (1 or N instances, kill -9 and restart);
//! - [`report`]: tables, JSON, the machine's description;
//! - [`pin`]: `--pin`, hubcast and the harness on separate CPUs;
//! - [`hook`]: `--step-hook`, a command run at the edges of each measured fan-out window.

pub mod cli;
pub mod clients;
pub mod fleet;
pub mod hist;
pub mod hook;
pub mod http;
pub mod modes;
pub mod peers;
pub mod pin;
pub mod report;
pub mod scale;
pub mod target;
pub mod ws;

use std::io;

use cli::{Cli, Mode};
use report::Results;

/// Runs one invocation: the mode's results, printed and (with `--json`) written.
pub fn run(cli: Cli) -> io::Result<Vec<Results>> {
    report::raise_file_limit();
    // Before the runtime: its threads inherit the calling thread's CPU mask.
    let pinning = cli.global.pinning()?;
    if let Some(p) = &pinning {
        pin::set_affinity(0, &p.harness).map_err(|e| io::Error::other(format!("cannot pin the harness: {e}")))?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(cli.global.threads.max(1)).enable_all().build()?;
    let global = cli.global.clone();
    let results = runtime.block_on(async move {
        match &cli.mode {
            Mode::Ingest(a) => modes::ingest(&global, a).await.map(|r| vec![r]),
            Mode::Fanout(a) => modes::fanout(&global, a).await.map(|r| vec![r]),
            Mode::Idle(a) => modes::idle(&global, a).await.map(|r| vec![r]),
            Mode::Rest(a) => modes::rest(&global, a).await.map(|r| vec![r]),
            Mode::All(a) => modes::all(&global, a).await,
            Mode::Fleet(a) => scale::fleet_scale(&global, a).await,
            Mode::Peer(a) => peers::fanout(&global, a).await.map(|r| vec![r]),
        }
    });
    // Socket tasks may still be parked: do not wait for them.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    let results = results?;
    let machine = report::machine();
    println!(
        "machine: {} × {}, {} GiB, Linux {}",
        machine["nproc"], machine["cpu"].as_str().unwrap_or("?"), machine["memory_gib"], machine["kernel"].as_str().unwrap_or("?")
    );
    let pinned = pinning.as_ref().map_or_else(|| "not pinned (hubcast and the harness share every CPU)".to_string(), pin::Pinning::describe);
    println!("pinning: {pinned}");
    for r in &results {
        println!("{}", r.table());
    }
    if let Some(path) = &cli.global.json {
        let doc = serde_json::json!({
            "machine": machine,
            "args": std::env::args().collect::<Vec<_>>(),
            "pinning": pinning.as_ref().map(|p| serde_json::json!({"hubcast": p.hubcast, "harness": p.harness})),
            "results": results.iter().map(Results::to_json).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap())?;
    }
    Ok(results)
}
