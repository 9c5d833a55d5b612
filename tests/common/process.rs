//! Signalling a server process and waiting for its exit (shared by both harnesses).

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Sends `signal` (e.g. `libc::SIGTERM`) to `child`. A `SIGSTOP` returns only once every
/// thread of the process has stopped: kill(2) merely queues it, and a thread that is running
/// or waiting for a CPU goes on until it is scheduled and takes the group stop. On a loaded
/// machine an adopter "stopped" this way still subscribed and answered a hand-over 2 ms after
/// the stop was sent (tests/recovery_adopt.rs, whose order of events needs it stopped).
pub fn signal(child: &Child, signal: i32) {
    // Safety: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(rc, 0, "kill({}, {signal}) failed", child.id());
    if signal == libc::SIGSTOP {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !stopped(child.id()) {
            assert!(Instant::now() < deadline, "process {} not stopped 10 s after SIGSTOP", child.id());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Whether every thread of process `pid` is stopped (or gone): the state letter of each
/// `/proc/<pid>/task/<tid>/stat`, after the command name in parentheses. Seen right after
/// `kill -STOP` of an idle server: one thread of four in `T`, the others still `R` and `S`.
/// io_uring's workers (`iou-*`) are left out: they run none of the program's code.
fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().all(|task| {
        if std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c.starts_with("iou-")) {
            return true;
        }
        // A thread that exited meanwhile has no stat to read: it runs no more.
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { return true };
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
        matches!(state, Some('T' | 't' | 'Z' | 'X'))
    })
}

/// Waits up to `timeout` for `child` to exit; its status, or `None` while it runs.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
