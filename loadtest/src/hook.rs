//! `--step-hook CMD`: a shell command run at the edges of each measured window (fan-out
//! steps), so that a script can read what the harness cannot see at the same instants:
//! Redis's `INFO` (CPU, commands), another instance's `/metrics`
//! (docs/benchmarks/redis-cluster.sh). The command runs with `sh -c`, its environment has
//! `HUBCAST_LOAD_STEP` = `begin` (just before the window's first snapshot) or `end` (just
//! after its last) and `HUBCAST_LOAD_RATE` (the step's fleet rate, `0` = as fast as taken);
//! its output goes to the harness's stderr. The window is waited on while it runs (keep it
//! short: a few `redis-cli` calls). A hook that fails stops the run.

use std::io;
use std::process::Command;

/// Runs `hook` (if any) for the `edge` of a step at `rate`.
pub async fn run(hook: Option<&str>, edge: &'static str, rate: f64) -> io::Result<()> {
    let Some(hook) = hook else { return Ok(()) };
    let hook = hook.to_string();
    let status = tokio::task::spawn_blocking(move || {
        Command::new("sh")
            .arg("-c")
            .arg(&hook)
            .env("HUBCAST_LOAD_STEP", edge)
            .env("HUBCAST_LOAD_RATE", rate.to_string())
            .stdout(std::process::Stdio::from(io::stderr()))
            .status()
    })
    .await
    .map_err(io::Error::other)??;
    if !status.success() {
        return Err(io::Error::other(format!("--step-hook ({edge}) failed: {status}")));
    }
    Ok(())
}
