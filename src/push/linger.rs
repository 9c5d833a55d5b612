//! The flush policy of a core's socket writers: under load a socket's write may wait a
//! bounded moment so that it carries more frames (`--socket-linger-us`, 0: off).
//!
//! Most of what a live socket costs its core is per write, not per frame: the syscall and the
//! loopback or network path behind it (docs/benchmarks/2026-11-23-missed-targets.md:
//! about 9 µs per write, two thirds in the kernel). A writer always sends everything queued
//! in one write, so under load a write carries what the fan-out queued during the previous
//! one; this policy lets a busy socket skip a turn of its core now and then so the next write
//! carries more.
//!
//! **When a write is held.** The writer ([`crate::transport`]) asks to hold only when all of
//! these hold:
//! - the linger is on (`--socket-linger-us` > 0);
//! - **the core is saturated**: its thread has not once waited for I/O (no voluntary context
//!   switch, `getrusage(RUSAGE_THREAD)`) while it ran for [`SATURATION_WINDOW`] of **CPU
//!   time** (the same call's user + system time). A core that keeps up with its load runs out
//!   of work between inbound batches and sleeps in the driver, many times a window; one that
//!   is behind always finds completions ready and never does. Preemption by other processes is
//!   an involuntary switch and does not count, and it stops the thread's CPU clock: a core
//!   kept from its CPU by other work (a machine shared with builds) has not slept either, but
//!   it has not run, and holding its writes would only add to its wait (a window in wall time
//!   held thousands of writes per 4 s at 5,000 msgs/s, a load that takes a tenth of the core:
//!   docs/benchmarks/2026-11-28-peers.md). A core that is behind on a shared CPU still reaches
//!   the window, later. Sampled at most once per [`SAMPLE_EVERY`] (one cheap syscall), so
//!   the signal is up to that stale;
//! - the socket's previous write was a data write (its first frames after opening go at once);
//! - the queue is small: fewer than [`super::outlet::LINGER_FRAMES`] frames and
//!   [`super::outlet::LINGER_BYTES`] bytes, and it holds no protocol packet or control frame
//!   (ping, pong, Engine.IO packets) and no close.
//!
//! A writer holds at most once per write: after a hold ends it writes whatever is queued.
//!
//! **When a held write goes** (the first of):
//! - its queue reaches [`super::outlet::LINGER_FRAMES`] frames or
//!   [`super::outlet::LINGER_BYTES`] bytes, or gets a protocol packet, a control frame or a
//!   close ([`super::outlet::Outlet`] wakes the writer then);
//! - **the core's next turn**, once the hold is at least the linger old and the core has
//!   applied a batch of inbound deliveries since ([`Linger::inbound_applied`]: its ingest or
//!   its mesh inbox). A turn is one collection of the core's I/O completions and the tasks it
//!   wakes; the writers see the turns go by: the first write completion seen that began in
//!   the current turn starts the next one ([`Linger::write_completed`]), and it releases the
//!   sockets held in an earlier turn. Released writers run after the tasks that collection
//!   woke, so after the turn's inbound work is applied, and their write carries it. (With the
//!   epoll driver a write usually completes inside the call, so every completion counts as a
//!   new turn; the linger and the inbound batch still bound the hold from below);
//! - a backstop timer, for a core whose writes stop completing (all its busy sockets held,
//!   or it went quiet): one per core, not per socket, at the oldest hold's linger, rounded up
//!   to monoio's 1 ms timer tick.
//!
//! So under load a held socket skips one turn of its core (or several, while they are shorter
//! than the linger) and its next write carries what those turns queued; the hold lasts at
//! most `max(linger, the rest of the turn in progress)` plus one turn, and `linger + 1 ms`
//! when the core goes quiet. A time bound shorter than the core's turn would not help:
//! releasing held sockets within the turn in which they were held adds nothing to their
//! writes, since the inbound work of a turn is applied in one stretch before it. An idle core
//! never holds a write and adds no latency.
//!
//! **The default linger, 5 ms, is measured** (docs/benchmarks/2026-11-25-flush-policy.md): with a
//! thousand sockets each getting a message every millisecond or so, a sub-millisecond hold
//! adds about one frame to a write; 5 ms nearly doubled the frames per write of the one-core
//! fan-out at 4 publishers without raising its p99, while a core that keeps up (5,000
//! messages/s in) held no write at all.
//!
//! **Bounds.** One list entry per held socket (a socket held again while still listed is
//! not listed twice), so at most the sockets of the core; entries leave as they are
//! released. One backstop task per core while anything is held. Holds are counted in
//! `hubcast_socket_writes_held_total`.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::{Duration, Instant};

use super::outlet::Outlet;

/// A core whose thread has run this long (CPU time) without once waiting for I/O is saturated
/// (module docs).
/// Longer than the bursts of a core that keeps up (a batch of inbound messages fanned out to
/// thousands of sockets takes a few milliseconds), so such a core never holds a write.
pub const SATURATION_WINDOW: Duration = Duration::from_millis(20);

/// The thread's voluntary context switches are read at most this often.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(1);

/// What is read of the core thread: voluntary context switches and CPU time (user + system).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Usage {
    switches: i64,
    cpu: Duration,
}

/// A held socket: the turn and the inbound batch count when it was held, and when.
struct Held {
    turn: u64,
    applied: u64,
    at: Instant,
    outlet: Rc<Outlet>,
}

/// One core's held sockets (see the module docs).
pub struct Linger {
    /// The least a held write waits (zero: writes are never held).
    max: Duration,
    /// Held sockets in the order they were held, with the turn and the instant of the hold.
    listed: RefCell<VecDeque<Held>>,
    /// The core's turns as its writers see them (see [`Linger::write_completed`]).
    turn: Cell<u64>,
    /// Batches of inbound deliveries the core applied ([`Linger::inbound_applied`]).
    applied: Cell<u64>,
    /// A backstop timer is armed.
    timer: Cell<bool>,
    /// The core thread's usage when last read, and when that was.
    sampled: Cell<Option<(Instant, Usage)>>,
    /// The core thread's CPU time when it was last seen to have waited for I/O.
    waited: Cell<Option<Duration>>,
    /// Writes held (for `/metrics`).
    pub holds: Cell<u64>,
}

impl Linger {
    pub fn new(max: Duration) -> Rc<Self> {
        Rc::new(Self {
            max,
            listed: RefCell::default(),
            turn: Cell::new(0),
            applied: Cell::new(0),
            timer: Cell::new(false),
            sampled: Cell::new(None),
            waited: Cell::new(None),
            holds: Cell::new(0),
        })
    }

    pub fn enabled(&self) -> bool {
        !self.max.is_zero()
    }

    /// Whether a socket may hold what is queued now: the linger is on and the core saturated.
    /// Call it on the core's thread.
    pub fn may_hold(&self, now: Instant) -> bool {
        self.enabled() && self.saturated(now, thread_usage)
    }

    /// Whether the core has run for [`SATURATION_WINDOW`] of CPU time without waiting for
    /// I/O, reading the thread's usage (`usage`) at most every [`SAMPLE_EVERY`].
    fn saturated(&self, now: Instant, usage: impl Fn() -> Usage) -> bool {
        let due = self.sampled.get().is_none_or(|(at, _)| now.saturating_duration_since(at) >= SAMPLE_EVERY);
        if due {
            let u = usage();
            if self.sampled.get().is_none_or(|(_, before)| before.switches != u.switches) {
                self.waited.set(Some(u.cpu));
            }
            self.sampled.set(Some((now, u)));
        }
        match (self.waited.get(), self.sampled.get().map(|(_, u)| u.cpu)) {
            (Some(cpu_then), Some(cpu_now)) => cpu_now.saturating_sub(cpu_then) >= SATURATION_WINDOW,
            _ => false,
        }
    }

    /// The core's current turn, for a write that begins now.
    pub fn turn(&self) -> u64 {
        self.turn.get()
    }

    /// A write that began in turn `began` completed. A completion is only seen once the core
    /// collected its I/O completions, so the first one seen that began in the current turn
    /// starts a new turn. Then the sockets held in an earlier turn, at least the linger ago,
    /// and before an inbound batch the core has applied since, are released: they write after
    /// the tasks that collection woke (the turn's inbound work).
    pub fn write_completed(&self, began: u64) {
        if began == self.turn.get() {
            self.turn.set(began + 1);
        }
        if !self.listed.borrow().is_empty() {
            let turn = self.turn.get();
            let applied = self.applied.get();
            self.release_while(|held| held.turn < turn && held.applied < applied);
        }
    }

    /// The core applied a batch of inbound deliveries (its ingest, its mesh inbox): a held
    /// socket waits for at least one, so its write carries more than before.
    pub fn inbound_applied(&self) {
        self.applied.set(self.applied.get() + 1);
    }

    /// Holds `outlet`'s write if its queue allows it ([`Outlet::hold`]); true when held.
    pub fn hold(self: &Rc<Self>, outlet: &Rc<Outlet>) -> bool {
        let Some(newly_listed) = outlet.hold() else { return false };
        self.holds.set(self.holds.get() + 1);
        if newly_listed {
            let held = Held { turn: self.turn.get(), applied: self.applied.get(), at: Instant::now(), outlet: outlet.clone() };
            self.listed.borrow_mut().push_back(held);
            if !self.timer.replace(true) {
                monoio::spawn(self.clone().backstop());
            }
        }
        true
    }

    /// Releases the held sockets (from the oldest) while `due(held)` and the hold is
    /// at least the linger old.
    fn release_while(&self, due: impl Fn(&Held) -> bool) {
        let now = Instant::now();
        loop {
            let next = {
                let mut listed = self.listed.borrow_mut();
                match listed.front() {
                    Some(held) if due(held) && now.saturating_duration_since(held.at) >= self.max => listed.pop_front(),
                    _ => None,
                }
            };
            let Some(held) = next else { break };
            held.outlet.release();
        }
    }

    /// For a core that goes quiet (no write completes to mark its turns): sleeps until the
    /// oldest hold is the linger old (at least one timer tick), then releases the holds of an
    /// earlier turn, or every hold that old when no write completed meanwhile; ends once
    /// nothing is held.
    async fn backstop(self: Rc<Self>) {
        loop {
            let oldest = self.listed.borrow().front().map(|held| held.at);
            let Some(at) = oldest else { break };
            let (turn, age) = (self.turn.get(), Instant::now().saturating_duration_since(at));
            monoio::time::sleep(self.max.saturating_sub(age).max(Duration::from_millis(1))).await;
            let now = self.turn.get();
            let quiet = now == turn;
            self.release_while(|held| quiet || held.turn < now);
        }
        self.timer.set(false);
    }
}

/// The calling thread's voluntary context switches (each time it slept waiting, for I/O) and
/// CPU time, in one `getrusage`.
fn thread_usage() -> Usage {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) } != 0 {
        return Usage { switches: -1, cpu: Duration::ZERO };
    }
    let time = |t: libc::timeval| Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64);
    Usage { switches: usage.ru_nvcsw as i64, cpu: time(usage.ru_utime) + time(usage.ru_stime) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_core_is_saturated_once_it_has_not_waited_for_a_whole_window() {
        let linger = Linger::new(Duration::from_micros(500));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // A core busy all the time: its CPU time follows the clock.
        let (switches, clock) = (Cell::new(7), Cell::new(0u64));
        let read = || Usage { switches: switches.get(), cpu: Duration::from_millis(clock.get()) };
        let busy = |ms: u64| {
            clock.set(ms);
            linger.saturated(at(ms), read)
        };
        assert!(!busy(0), "nothing known yet");
        assert!(!busy(10), "10 ms without a wait is not enough");
        assert!(busy(20), "{SATURATION_WINDOW:?} without a wait: saturated");
        switches.set(8);
        assert!(linger.saturated(at(20) + Duration::from_micros(500), read), "not read again within {SAMPLE_EVERY:?}");
        assert!(!busy(21), "the core waited: not saturated");
        assert!(!busy(40));
        assert!(busy(41));
        assert!(!Linger::new(Duration::ZERO).may_hold(at(41)), "0: off");
    }

    #[test]
    fn a_core_kept_from_its_cpu_by_other_work_is_not_saturated_until_it_has_run_a_window() {
        let linger = Linger::new(Duration::from_micros(500));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let cpu = Cell::new(0u64);
        let read = || Usage { switches: 3, cpu: Duration::from_millis(cpu.get()) };
        assert!(!linger.saturated(at(0), read));
        // 30 ms without a wait, but only 5 of them on the CPU: others held it.
        cpu.set(5);
        assert!(!linger.saturated(at(30), read), "runnable, not running: not behind on its own work");
        cpu.set(19);
        assert!(!linger.saturated(at(55), read), "19 ms of CPU since its last wait");
        // Behind on a shared CPU: a whole window of CPU time without a wait.
        cpu.set(20);
        assert!(linger.saturated(at(60), read), "20 ms of CPU without a wait: saturated");
    }
}
