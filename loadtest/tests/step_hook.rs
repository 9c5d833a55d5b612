//! `--step-hook`: the command runs at both edges of every measured fan-out window, in order,
//! with the step's rate, and a failing hook stops the run (docs/benchmarks/redis-cluster.sh
//! reads Redis's CPU there). Against the real hubcast binary of this workspace, as smoke.rs.

mod common;

use std::process::Command;

use common::hubcast_binary;

fn fanout(hook: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hubcast-load"))
        .arg("--spawn")
        .arg(hubcast_binary())
        .args(["--cores", "1", "--warmup", "0.2", "--duration", "0.3", "--step-hook", hook])
        .args(["fanout", "--clients", "2", "--subs", "1", "--devices", "2", "--rate", "100,200"])
        .output()
        .expect("run hubcast-load")
}

#[test]
fn the_step_hook_runs_at_both_edges_of_every_window_with_its_rate() {
    let log = std::env::temp_dir().join(format!("hubcast-load-hook-{}.log", std::process::id()));
    let output = fanout(&format!("echo \"$HUBCAST_LOAD_STEP $HUBCAST_LOAD_RATE\" >> {}; echo hook-ran", log.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "hubcast-load failed\n{stdout}\n{stderr}");
    let lines = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert_eq!(lines, "begin 100\nend 100\nbegin 200\nend 200\n", "{stderr}");
    // The hook's output goes to stderr, not into the report.
    assert_eq!(stderr.matches("hook-ran").count(), 4, "{stderr}");
    assert!(!stdout.contains("hook-ran"), "{stdout}");
}

#[test]
fn a_failing_step_hook_stops_the_run() {
    let output = fanout("exit 3");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the run went on past a failed hook");
    assert!(stderr.contains("--step-hook (begin) failed"), "{stderr}");
}
