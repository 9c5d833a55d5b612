//! Store logs used again (src/store/log.rs, "Logs used again"): a log a snapshot replaced is
//! written over as a later log, so after a few snapshots every commit is written over an older
//! log's frames. A `kill -9` in the middle of that stream (the kill lands in a commit's write
//! or between two) must leave what a start expects: every answered commit back, no damage.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);
const DEVICES: usize = 200;

fn start_in(dir: &TempDir) -> Server {
    Server::start(&["--data-dir", dir.path(), "--cores", "1", "--snapshot-log-bytes", "200000", "--log-level", "verbose"])
}

/// One round: every device gets `{"n": round}` (a commit of ~200 records).
fn round(n: u64) -> Value {
    Value::Array((0..DEVICES).map(|d| json!({"deviceId": format!("dev-{d}"), "body": {"n": n}})).collect())
}

#[test]
fn a_kill_9_while_commits_are_written_over_an_older_log_keeps_every_answered_commit() {
    let dir = TempDir::new();
    let mut server = start_in(&dir);
    let answered = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let streamer = scope.spawn(|| {
            let agent = new_agent();
            let mut n = 0;
            while !stop.load(Ordering::Acquire) {
                n += 1;
                // Answered only once committed; the kill fails the one in flight.
                let body = round(n).to_string();
                match try_send(&agent, &server.url("/ingest"), "POST", &[ADMIN, ("Content-Type", "application/json")], Some(body.as_bytes())) {
                    Ok((200, _, _)) => {}
                    _ => break,
                }
                answered.store(n, Ordering::Release);
            }
        });
        // Two logs written over spares (the first is log 3): the stream now writes over older frames.
        let reused = |l: &str| l.contains("store log written over the spare") && log_number(l, "log").is_some_and(|g| g >= 4);
        server.wait_for_stderr(WAIT, reused).expect("a second log written over the spare");
        let commits = server.metric("hubcast_store_commits_total").unwrap();
        server.wait_for_metric("hubcast_store_commits_total", WAIT, Want::AtLeast(commits + 3.0));
        server.signal(libc::SIGKILL);
        stop.store(true, Ordering::Release);
        streamer.join().unwrap();
    });
    server.wait_exit(WAIT).expect("killed");
    let last = answered.load(Ordering::Acquire);
    assert!(last > 0);
    drop(server);

    // No flag needed: no damage, every answered round is back.
    let server = start_in(&dir);
    server.wait_for_stderr(WAIT, |l| l.contains("stored state loaded")).expect("loaded");
    for d in 0..DEVICES {
        let (status, body) = server.call_json("GET", &format!("/lastValue/dev-{d}/n"), &[ADMIN], None);
        assert_eq!(status, 200, "{body}");
        let n = body["data"]["n"].as_u64().unwrap_or_else(|| panic!("{body}"));
        assert!(n >= last && n <= last + 1, "dev-{d}: {n}, the last answered round {last}");
    }
    assert!(!server.stderr_lines().iter().any(|l| l.contains("ERROR")), "{}", server.stderr_lines().join("\n"));
}
