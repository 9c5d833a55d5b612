//! The connection cap, and what happens at it and past it.
//!
//! Every client connection is a file descriptor, and so are the store's logs and snapshots,
//! the Redis link, the IoT Hub client's connections, a TLS reload's reads and a health check.
//! Client connections are capped at `RLIMIT_NOFILE − --fd-reserve` (or `--max-connections`
//! if lower), one count for the whole process ([`ConnectionSlot`]: one atomic touched at
//! accept and close, never per message), so the process's own descriptors are never taken.
//!
//! At the cap a connection is still accepted (it is never left in the backlog, where a load
//! balancer's check would hang): up to [`OVERFLOW_SLOTS`] of them at once have their first
//! request read for up to [`OVERFLOW_READ`], and `GET /status` is answered as usual, so a health
//! check sees the instance; anything else, and every connection past those slots, gets `503`
//! with a JSON error and `Connection: close` (the HTTP loop writes it, `http::over_cap`). The
//! overflow slots sit inside the reserve.
//!
//! Should `accept` still fail for want of descriptors (`EMFILE`/`ENFILE`: another program's
//! limit, a reserve set too small), [`AcceptErrors`] logs it at most once a second with the
//! number of failures since, and gives up a spare descriptor it holds so that the waiting
//! connection can be accepted and closed at once, instead of the loop spinning on it.

use std::fs::File;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::config::Config;

/// Connections over the cap whose first request is read (for a health check) at once.
pub const OVERFLOW_SLOTS: usize = 8;
/// How long a connection over the cap has to send its request before it is answered 503.
pub const OVERFLOW_READ: Duration = Duration::from_millis(500);

static CAP: OnceLock<usize> = OnceLock::new();

/// The connection cap of the process: the open-file limit (as raised at start) minus the
/// reserve, or `--max-connections` if lower. Computed, and logged, on first use (the cores'
/// accept loops, after the limit was raised).
pub fn connection_cap(config: &Config) -> usize {
    *CAP.get_or_init(|| {
        let limit = open_file_limit();
        let by_files = limit.saturating_sub(config.fd_reserve).max(1);
        let cap = by_files.min(config.max_connections) as usize;
        if by_files < config.max_connections {
            tracing::info!(cap, open_file_limit = limit, fd_reserve = config.fd_reserve,
                "client connections capped by the open-file limit, less the descriptors kept for the process (--fd-reserve)");
        } else {
            tracing::debug!(cap, open_file_limit = limit, "client connections capped by --max-connections");
        }
        cap
    })
}

/// The cap once computed (for metrics).
pub fn cap_if_known() -> Option<usize> {
    CAP.get().copied()
}

/// The soft `RLIMIT_NOFILE`.
fn open_file_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    limit.rlim_cur
}

/// Open client connections of the whole process (HTTP and live sockets, and Engine.IO
/// polling sessions, which cost as much), against the cap.
static OPEN: AtomicUsize = AtomicUsize::new(0);

pub fn open() -> usize {
    OPEN.load(Ordering::Relaxed)
}

/// One counted connection; the count goes down when it is dropped, whatever path ends it.
#[must_use]
pub struct ConnectionSlot(());

impl ConnectionSlot {
    /// Takes a slot if fewer than `max` connections are open.
    pub fn try_acquire(max: usize) -> Option<Self> {
        OPEN.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).ok().map(|_| Self(()))
    }

    /// Counts a connection accepted before (a socket taken over after its upgrade).
    pub fn acquire() -> Self {
        OPEN.fetch_add(1, Ordering::AcqRel);
        Self(())
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::AcqRel);
    }
}

static OVERFLOW: AtomicUsize = AtomicUsize::new(0);

/// One of the [`OVERFLOW_SLOTS`] connections over the cap being read for a health check.
#[must_use]
pub struct OverflowSlot(());

impl OverflowSlot {
    pub fn try_acquire() -> Option<Self> {
        OVERFLOW.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < OVERFLOW_SLOTS).then_some(n + 1)).ok().map(|_| Self(()))
    }
}

impl Drop for OverflowSlot {
    fn drop(&mut self) {
        OVERFLOW.fetch_sub(1, Ordering::AcqRel);
    }
}

/// When an accept error was last logged (ms since [`since`]), and how many failed since.
static LAST_LOGGED_MS: AtomicU64 = AtomicU64::new(0);
static UNLOGGED: AtomicU64 = AtomicU64::new(0);

fn since() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// Whether an accept error is for want of descriptors.
pub fn out_of_descriptors(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// One core's accept errors: the log at most once a second for the process, and the spare.
pub struct AcceptErrors {
    core: usize,
    /// Held so that, out of descriptors, one can be given up to accept and close the waiting
    /// connection.
    spare: Option<File>,
}

impl AcceptErrors {
    pub fn new(core: usize) -> Self {
        Self { core, spare: File::open("/dev/null").ok() }
    }

    /// Counts and (at most once a second) logs a failed accept. True when the spare
    /// descriptor was given up: the caller accepts the waiting connection, drops it and calls
    /// [`AcceptErrors::restore_spare`]; false: the caller backs off a moment.
    pub fn failed(&mut self, e: &std::io::Error) -> bool {
        let descriptors = out_of_descriptors(e);
        let stats = &super::STATS;
        if descriptors { &stats.accept_descriptors } else { &stats.accept_other }.fetch_add(1, Ordering::Relaxed);
        let now = since().elapsed().as_millis() as u64 + 1_000;
        let last = LAST_LOGGED_MS.load(Ordering::Relaxed);
        if now >= last + 1_000 && LAST_LOGGED_MS.compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            let suppressed = UNLOGGED.swap(0, Ordering::AcqRel);
            tracing::warn!(core = self.core, error = %e, suppressed,
                "accept failed (logged at most once a second; suppressed: failures since the last line; hubcast_accept_errors_total counts them all)");
        } else {
            UNLOGGED.fetch_add(1, Ordering::Relaxed);
        }
        descriptors && self.spare.take().is_some()
    }

    /// Takes the spare descriptor again (after the waiting connection was closed).
    pub fn restore_spare(&mut self) {
        if self.spare.is_none() {
            self.spare = File::open("/dev/null").ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_given_back_when_dropped() {
        let before = open();
        let a = ConnectionSlot::try_acquire(before + 1).expect("room for one");
        assert!(ConnectionSlot::try_acquire(before + 1).is_none(), "the cap holds");
        drop(a);
        assert!(ConnectionSlot::try_acquire(before + 1).is_some());
    }

    #[test]
    fn accept_errors_are_logged_at_most_once_a_second() {
        let mut errors = AcceptErrors::new(0);
        let emfile = std::io::Error::from_raw_os_error(libc::EMFILE);
        assert!(errors.failed(&emfile), "the spare is given up");
        assert!(!errors.failed(&emfile), "no second spare until restored");
        for _ in 0..100 {
            errors.failed(&emfile);
        }
        assert!(UNLOGGED.load(Ordering::Relaxed) >= 100, "later failures within the second are counted, not logged");
        errors.restore_spare();
        assert!(errors.failed(&emfile), "the spare is back");
    }
}
