//! Signalling a server process and waiting for its exit (shared by both harnesses).

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Sends `signal` (e.g. `libc::SIGTERM`) to `child`.
pub fn signal(child: &Child, signal: i32) {
    // Safety: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(rc, 0, "kill({}, {signal}) failed", child.id());
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
