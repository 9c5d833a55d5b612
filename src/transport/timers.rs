//! Every socket timer of a core on one deadline heap, swept by one task per core.
//!
//! A live socket needs four deadlines: the next ping (`pingInterval` after the client's last
//! answer, as Engine.IO does), the answer to that ping (`pingTimeout` after it), the silence
//! limit of its reader, and the stall limit of a write in progress; a socket closed as a slow
//! consumer gets a fifth, the end of its close ([`close_by`]). None of them gets a task
//! or a runtime timer of its own: each socket keeps its state in a few `Cell`s ([`Timed`]),
//! and this core's [`SocketTimers`] holds a min-heap of `(instant, slot, generation, kind)`
//! entries with one task sleeping until the earliest ([`Clock`], as the shard's clock does).
//!
//! - **Lazy deletion.** A closed socket's entries are not looked for: its slot is freed and
//!   its generation bumped, so they are skipped when they come up. A socket has at most one
//!   liveness entry (re-armed only by the sweep that pops it) and one write entry.
//! - **Nothing per write.** A write records its start in [`Timed::writing_since`]; only when
//!   no write entry of the socket is in the heap does it add one (`start + WRITE_STALL_LIMIT`).
//!   When that entry comes up and the write is still the same, the socket is closed; when a
//!   later write is pending, the entry moves to that write's limit. A busy socket adds at most
//!   one entry per stall limit, and an idle one none.
//! - **Nothing per answer.** The reader only notes when a ping was answered
//!   ([`Timed::heard`]); the sweep at the answer's deadline finds it and schedules the next
//!   ping from it.
//! - **Coarse ticks.** Deadlines are rounded up to a tick of `min(pingInterval, pingTimeout)/16`
//!   (1 ms to 250 ms), so thousands of sockets share a wake-up: the core wakes at most once
//!   per tick however many sockets it holds, and not at all between pings when idle. A ping or
//!   a timeout may therefore come up to one tick late (the previous per-socket pong wait
//!   polled every `pingTimeout/8`, 10–250 ms).
//!
//! Bounds: one slot per open socket (bounded by `--max-connections`) and at most three live heap
//! entries per slot (liveness, write, close); stale entries (of closed sockets) are at most one per socket closed
//! within the last `pingInterval + pingTimeout`, each popped when its instant comes.
//!
//! Each wake-up of the task counts in `hubcast_core_timer_wakeups_total` with the shard
//! clock's (src/runtime/clock.rs).

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use super::socketio_polling::{self, PollingSocket};
use super::{Conn, SocketKind};
use crate::push::outlet::{CloseReason, Out};
use crate::runtime::clock::Clock;
use crate::app::Core;

/// A write that makes no progress for this long means a stalled client: the socket is dropped.
pub const WRITE_STALL_LIMIT: Duration = Duration::from_secs(10);

/// One socket's timer state (inside its `Conn` or `PollingSocket`).
pub struct Timed {
    /// Its place in the core's registry (`u32::MAX`: not registered).
    slot: Cell<u32>,
    generation: Cell<u32>,
    /// The instant of its liveness entry in the heap (`None`: no liveness entry).
    due: Cell<Option<Instant>>,
    /// A ping went out then and is not answered yet.
    ping_sent: Cell<Option<Instant>>,
    /// When the next ping is due (set when the previous one is answered).
    next_ping: Cell<Instant>,
    /// When the write in progress began (`None`: no write in progress).
    writing_since: Cell<Option<Instant>>,
    /// A write entry of this socket is in the heap.
    write_watched: Cell<bool>,
    /// The instant of its close entry in the heap: the socket is shut down then ([`close_by`]).
    close_by: Cell<Option<Instant>>,
}

impl Timed {
    pub fn new(now: Instant) -> Self {
        Self {
            slot: Cell::new(u32::MAX),
            generation: Cell::new(0),
            due: Cell::new(None),
            ping_sent: Cell::new(None),
            next_ping: Cell::new(now),
            writing_since: Cell::new(None),
            write_watched: Cell::new(false),
            close_by: Cell::new(None),
        }
    }

    /// The unanswered ping's instant.
    pub fn ping_sent(&self) -> Option<Instant> {
        self.ping_sent.get()
    }

    pub fn next_ping(&self) -> Instant {
        self.next_ping.get()
    }

    /// A ping went out at `now`.
    pub fn pinged(&self, now: Instant) {
        self.ping_sent.set(Some(now));
    }
}

/// What a registry slot holds.
enum Target {
    WebSocket(Rc<Conn>),
    Polling(Rc<PollingSocket>),
}

impl Target {
    fn timed(&self) -> &Timed {
        match self {
            Target::WebSocket(conn) => &conn.timed,
            Target::Polling(socket) => &socket.timed,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// Ping due, ping answer due, reader silence (and, for polling, the first poll).
    Liveness,
    /// The stall limit of a write in progress.
    Write,
    /// The end of a closing socket's wait for its close frame to go out ([`close_by`]).
    Close,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    at: Instant,
    slot: u32,
    generation: u32,
    kind: Kind,
}

#[derive(Default)]
struct Slot {
    generation: u32,
    target: Option<Target>,
}

/// This core's socket timers (see the module docs).
pub struct SocketTimers {
    clock: Clock,
    /// Deadlines are rounded up to `epoch + k * tick`.
    epoch: Instant,
    tick: Duration,
    interval: Duration,
    timeout: Duration,
    /// The reader's silence limit: no frame for this long closes the socket.
    silence: Duration,
    heap: RefCell<BinaryHeap<Reverse<Entry>>>,
    slots: RefCell<Vec<Slot>>,
    free: RefCell<Vec<u32>>,
}

/// Where a core keeps its socket timers ([`Core::ext`]), made on first use.
#[derive(Default)]
struct Holder(RefCell<Option<Rc<SocketTimers>>>);

/// This core's socket timers; the first call on a core starts its sweeping task.
fn timers(core: &Rc<Core>) -> Rc<SocketTimers> {
    let holder = core.ext.get::<Holder>();
    let mut slot = holder.0.borrow_mut();
    slot.get_or_insert_with(|| {
        let c = &core.settings.config;
        let (interval, timeout) = (Duration::from_millis(c.ping_interval), Duration::from_millis(c.ping_timeout));
        let tick = (interval.min(timeout) / 16).clamp(Duration::from_millis(1), Duration::from_millis(250));
        let timers = Rc::new(SocketTimers {
            clock: Clock::default(),
            epoch: Instant::now(),
            tick,
            interval,
            timeout,
            silence: interval + timeout + Duration::from_secs(5),
            heap: RefCell::default(),
            slots: RefCell::default(),
            free: RefCell::default(),
        });
        monoio::spawn(sweeper(core.clone(), timers.clone()));
        timers
    })
    .clone()
}

impl SocketTimers {
    /// `at` rounded up to the next tick.
    fn round(&self, at: Instant) -> Instant {
        let tick = self.tick.as_nanos();
        let since = at.saturating_duration_since(self.epoch).as_nanos();
        let ticks = since.div_ceil(tick);
        self.epoch + Duration::from_nanos((ticks * tick) as u64)
    }

    fn register(&self, target: Target, now: Instant) {
        let index = match self.free.borrow_mut().pop() {
            Some(i) => i,
            None => {
                let mut slots = self.slots.borrow_mut();
                slots.push(Slot::default());
                (slots.len() - 1) as u32
            }
        };
        let mut slots = self.slots.borrow_mut();
        let slot = &mut slots[index as usize];
        let timed = target.timed();
        timed.slot.set(index);
        timed.generation.set(slot.generation);
        slot.target = Some(target);
        drop(slots);
        let polling = matches!(self.target(index).as_deref(), Some(Target::Polling(_)));
        let first = match polling {
            true => now + socketio_polling::first_poll_wait(self.interval, self.timeout),
            false => now + self.interval,
        };
        self.timed(index, |timed| timed.next_ping.set(now + self.interval));
        self.arm_liveness(index, first);
    }

    fn target(&self, index: u32) -> Option<std::cell::Ref<'_, Target>> {
        std::cell::Ref::filter_map(self.slots.borrow(), |s| s[index as usize].target.as_ref()).ok()
    }

    fn timed<R>(&self, index: u32, f: impl FnOnce(&Timed) -> R) -> Option<R> {
        self.target(index).map(|t| f(t.timed()))
    }

    fn unregister(&self, timed: &Timed) {
        let index = timed.slot.replace(u32::MAX);
        if index == u32::MAX {
            return;
        }
        let target = {
            let mut slots = self.slots.borrow_mut();
            let slot = &mut slots[index as usize];
            slot.generation = slot.generation.wrapping_add(1);
            slot.target.take()
        };
        timed.due.set(None);
        timed.write_watched.set(false);
        timed.close_by.set(None);
        self.free.borrow_mut().push(index);
        // Dropped after the borrows end: a socket's last reference may go with it.
        drop(target);
    }

    fn push(&self, at: Instant, index: u32, kind: Kind) -> Instant {
        let at = self.round(at);
        let generation = self.slots.borrow()[index as usize].generation;
        self.heap.borrow_mut().push(Reverse(Entry { at, slot: index, generation, kind }));
        self.clock.arm(at);
        at
    }

    fn arm_liveness(&self, index: u32, at: Instant) {
        let at = self.push(at, index, Kind::Liveness);
        self.timed(index, |t| t.due.set(Some(at)));
    }

    /// The earliest entry that still stands (stale ones on top are dropped).
    fn next_deadline(&self) -> Option<Instant> {
        let mut heap = self.heap.borrow_mut();
        while let Some(Reverse(top)) = heap.peek() {
            if self.stands(top) {
                return Some(top.at);
            }
            heap.pop();
        }
        None
    }

    fn stands(&self, e: &Entry) -> bool {
        let slots = self.slots.borrow();
        let slot = &slots[e.slot as usize];
        match (&slot.target, e.kind) {
            (Some(t), Kind::Liveness) if slot.generation == e.generation => t.timed().due.get() == Some(e.at),
            (Some(t), Kind::Write) if slot.generation == e.generation => t.timed().write_watched.get(),
            (Some(t), Kind::Close) if slot.generation == e.generation => t.timed().close_by.get() == Some(e.at),
            _ => false,
        }
    }

    /// Runs every entry due by `now`.
    fn sweep(&self, core: &Rc<Core>, now: Instant) {
        loop {
            let entry = {
                let mut heap = self.heap.borrow_mut();
                match heap.peek() {
                    Some(Reverse(top)) if top.at <= now => heap.pop().map(|Reverse(e)| e),
                    _ => None,
                }
            };
            let Some(entry) = entry else { break };
            if !self.stands(&entry) {
                continue;
            }
            let target = match self.target(entry.slot).as_deref() {
                Some(Target::WebSocket(conn)) => Target::WebSocket(conn.clone()),
                Some(Target::Polling(socket)) => Target::Polling(socket.clone()),
                None => continue,
            };
            let timed = target.timed();
            match (entry.kind, &target) {
                (Kind::Write, Target::WebSocket(conn)) => {
                    timed.write_watched.set(false);
                    match timed.writing_since.get() {
                        Some(since) if now.duration_since(since) >= WRITE_STALL_LIMIT => {
                            conn.outlet.close(CloseReason::new(1001, "write failed or stalled"));
                            conn.shutdown();
                        }
                        Some(since) => {
                            timed.write_watched.set(true);
                            self.push(since + WRITE_STALL_LIMIT, entry.slot, Kind::Write);
                        }
                        None => {}
                    }
                }
                (Kind::Write | Kind::Close, Target::Polling(_)) => {}
                (Kind::Close, Target::WebSocket(conn)) => {
                    // Whatever the close still waits for (the write before it, the close frame,
                    // the client's answer): the socket is shut down now.
                    timed.close_by.set(None);
                    conn.shutdown();
                }
                (Kind::Liveness, Target::WebSocket(conn)) => {
                    timed.due.set(None);
                    if let Some(at) = self.websocket_liveness(conn, now) {
                        self.arm_liveness(entry.slot, at);
                    }
                }
                (Kind::Liveness, Target::Polling(socket)) => {
                    timed.due.set(None);
                    match socketio_polling::liveness(core, socket, self.timeout, now) {
                        Some(at) => self.arm_liveness(entry.slot, at),
                        None => self.unregister(timed),
                    }
                }
            }
        }
    }

    /// A WebSocket's liveness deadline came: ping it, or close it for a missing answer or
    /// silence; the next deadline (`None`: none, the socket is closing).
    fn websocket_liveness(&self, conn: &Conn, now: Instant) -> Option<Instant> {
        if conn.outlet.is_closing() {
            return None;
        }
        let timed = &conn.timed;
        if now.duration_since(conn.last_heard.get()) >= self.silence {
            conn.outlet.close(CloseReason::new(1001, "no traffic from the client"));
            return None;
        }
        if let Some(sent) = timed.ping_sent.get() {
            if now.duration_since(sent) >= self.timeout {
                conn.outlet.close(CloseReason::new(1001, "ping timeout"));
                return None;
            }
            return Some(sent + self.timeout);
        }
        if now < timed.next_ping.get() {
            return Some(timed.next_ping.get());
        }
        if !conn.attached.get() && conn.upgrading.borrow().is_none() {
            // A Socket.IO socket gets one ping interval to send its CONNECT.
            conn.outlet.close(CloseReason::new(1008, "no Socket.IO CONNECT in time"));
            return None;
        }
        conn.outlet.push(match conn.kind {
            SocketKind::Plain { .. } => Out::Ping,
            SocketKind::SocketIo { .. } => Out::Packet("2".into()),
        });
        timed.pinged(now);
        Some(now + self.timeout)
    }
}

/// Starts a WebSocket's timers: its first ping is due one interval from now.
pub fn register_websocket(conn: &Rc<Conn>) {
    timers(&conn.core).register(Target::WebSocket(conn.clone()), Instant::now());
}

/// Starts a polling session's timers: its first poll, then pings.
pub fn register_polling(core: &Rc<Core>, socket: &Rc<PollingSocket>) {
    timers(core).register(Target::Polling(socket.clone()), Instant::now());
}

/// Ends a socket's timers (its entries are skipped when they come up).
pub fn unregister(core: &Rc<Core>, timed: &Timed) {
    timers(core).unregister(timed);
}

/// Something arrived from the client at `now`: an unanswered ping is answered, and the next
/// one is due one interval later. Nothing else is done unless that is before the answer's
/// deadline (only when `pingTimeout > pingInterval`): then the liveness entry moves earlier.
pub fn heard(core: &Rc<Core>, timed: &Timed, now: Instant) {
    if timed.ping_sent.take().is_none() {
        return;
    }
    let timers = timers(core);
    let next = now + timers.interval;
    timed.next_ping.set(next);
    let index = timed.slot.get();
    if index != u32::MAX && timed.due.get().is_some_and(|due| timers.round(next) < due) {
        timers.arm_liveness(index, next);
    }
}

/// A write of this socket begins: it must complete within [`WRITE_STALL_LIMIT`].
pub fn write_begins(conn: &Conn) {
    let timed = &conn.timed;
    let now = Instant::now();
    timed.writing_since.set(Some(now));
    if !timed.write_watched.get() && timed.slot.get() != u32::MAX {
        timed.write_watched.set(true);
        timers(&conn.core).push(now + WRITE_STALL_LIMIT, timed.slot.get(), Kind::Write);
    }
}

/// The socket is shut down at `at` (rounded up to the tick) unless it ended before; false when
/// it has no timers (then nothing bounds a wait for its close).
pub fn close_by(conn: &Conn, at: Instant) -> bool {
    let timed = &conn.timed;
    if timed.slot.get() == u32::MAX {
        return false;
    }
    if timed.close_by.get().is_none() {
        let at = timers(&conn.core).push(at, timed.slot.get(), Kind::Close);
        timed.close_by.set(Some(at));
    }
    true
}

/// The write in progress completed (or failed).
pub fn write_ends(conn: &Conn) {
    conn.timed.writing_since.set(None);
}

/// The per-core task: sleeps until the earliest deadline, then runs what is due.
async fn sweeper(core: Rc<Core>, timers: Rc<SocketTimers>) {
    loop {
        timers.clock.sleep(timers.next_deadline()).await;
        core.clock.wakeups.set(core.clock.wakeups.get() + 1);
        timers.sweep(&core, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_round_up_to_the_tick() {
        let epoch = Instant::now();
        let t = SocketTimers {
            clock: Clock::default(),
            epoch,
            tick: Duration::from_millis(250),
            interval: Duration::from_secs(25),
            timeout: Duration::from_secs(20),
            silence: Duration::from_secs(50),
            heap: RefCell::default(),
            slots: RefCell::default(),
            free: RefCell::default(),
        };
        assert_eq!(t.round(epoch), epoch);
        assert_eq!(t.round(epoch + Duration::from_millis(1)), epoch + Duration::from_millis(250));
        assert_eq!(t.round(epoch + Duration::from_millis(250)), epoch + Duration::from_millis(250));
        assert_eq!(t.round(epoch + Duration::from_millis(251)), epoch + Duration::from_millis(500));
    }
}
