//! Connection state recovery: the stream of frames a session's sockets were given, so a
//! Socket.IO client that comes back with `{pid, offset}` gets what it missed, in order, once
//! (docs/design/recovery.md, decisions 1–5).
//!
//! A session has a [`SessionRecovery`] once a recovery socket attached to it: the pids issued
//! to its Socket.IO sockets (connected, or away since a time) and a [`SessionStream`] while one
//! of them is connected or away for less than the window. The stream holds the frames already
//! decided on the device's core (throttled telemetry merged, grants and filters applied), each
//! under a sequence number; the offset a client sees is `h1.<epoch>.<seq>` (base 36).
//!
//! Bounds, each trimming from the front (oldest first) and remembering why (`first_seq` and
//! the cause), so an offset below what is kept fails with `window` or `bound`, never with a
//! partial replay:
//! - **age**: entries older than the window (`--recovery-window`);
//! - **session bytes**: `--recovery-session-bytes` per stream (it also caps one replay);
//! - **core bytes**: every stream of a core together (`--recovery-core-bytes`): the core keeps
//!   its most recent deliveries, the oldest cut first whichever sessions kept them
//!   ([`History::cut`]): one horizon for all, as Socket.IO's adapters and Centrifugo.
//!
//! The frames are the core's, in one log ([`CoreLog`]), each held once however many sessions
//! it went to; a stream's entry is the frame's position in it (16 bytes, no reference count),
//! so neither a delivery nor an entry's exit touches the frame: the frame leaves once, with
//! the log's oldest. An entry is charged `frame.len() + ENTRY_OVERHEAD` bytes; a frame shared
//! by many sessions is charged to each (an upper bound, simple to reason about). The pids of a session are
//! bounded too ([`MAX_PIDS`]): a client that reconnects without recovering adds one each time;
//! the oldest away pid goes first.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

/// Bytes charged per entry besides its frame (the entry itself, the deque slot, the `Arc`).
pub const ENTRY_OVERHEAD: usize = 40;

/// The most pids a session keeps (connected ones included); beyond, the oldest away pid is
/// forgotten (its client then recovers with `unknown_pid`).
pub const MAX_PIDS: usize = 8;

/// Why entries left a stream before their client could ask for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrimCause {
    Window,
    SessionBound,
    CoreBound,
}

impl TrimCause {
    pub const ALL: [TrimCause; 3] = [
        TrimCause::Window,
        TrimCause::SessionBound,
        TrimCause::CoreBound,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TrimCause::Window => "window",
            TrimCause::SessionBound => "session_bound",
            TrimCause::CoreBound => "core_bound",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why a restore failed (`hubcast_recovery_failed_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The pid left longer ago than the window, or what followed the offset aged out.
    Window,
    /// What followed the offset was trimmed by a byte bound.
    Bound,
    /// No such pid for this session (never issued, forgotten, or the session is new).
    UnknownPid,
    /// Not an offset hubcast gave, or one past the stream's head.
    UnknownOffset,
    /// The offset names an earlier incarnation of the stream (its epoch is gone).
    HistoryLost,
    /// Recovery is off (`--recovery-window 0`).
    Off,
}

impl Failure {
    pub const ALL: [Failure; 6] = [
        Failure::Window,
        Failure::Bound,
        Failure::UnknownPid,
        Failure::UnknownOffset,
        Failure::HistoryLost,
        Failure::Off,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Window => "window",
            Failure::Bound => "bound",
            Failure::UnknownPid => "unknown_pid",
            Failure::UnknownOffset => "unknown_offset",
            Failure::HistoryLost => "history_lost",
            Failure::Off => "off",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// 16 bytes: where the frame is in the core's log ([`CoreLog`]), when it was delivered and its
/// length (for the session bound). Its seq is implied (`first_seq` + its position). The frame
/// itself is the log's: an entry holds no reference count, so neither its push nor its exit
/// touches the frame (the exit of a frame delivered ~1 s earlier was a locked decrement of a
/// line long out of cache, once per delivery).
#[derive(Clone, Copy)]
struct Entry {
    /// The frame's position in the core's log.
    pos: u64,
    /// Milliseconds since the stream started (wrapping: entries never live 49 days).
    at_ms: u32,
    /// The frame's length in bytes (a frame is at most `--max-message-bytes` and a bit).
    len: u32,
}

impl Entry {
    fn charged(&self) -> usize {
        self.len as usize + ENTRY_OVERHEAD
    }
}

/// Bytes trimmed by one operation, per [`TrimCause`] (for metrics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Trimmed(pub [usize; 3]);

impl Trimmed {
    fn add(&mut self, cause: TrimCause, bytes: usize) {
        self.0[cause.index()] += bytes;
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|b| *b == 0)
    }
}

/// The process's time base for [`PushClock`]: a stream's start and a batch's time as signed
/// nanoseconds from it, so a batch reads the clock once for all of its pushes.
static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// `t` in nanoseconds from [`BASE`] (negative before it).
fn nanos_from_base(t: Instant) -> i64 {
    let base = *BASE.get_or_init(Instant::now);
    match t.checked_duration_since(base) {
        Some(d) => d.as_nanos().min(i64::MAX as u128) as i64,
        None => -(base.duration_since(t).as_nanos().min(i64::MAX as u128) as i64),
    }
}

/// Nanoseconds from [`BASE`] as the log's milliseconds ([`LogEntry::at_ms`]: wrapping, so
/// differences hold either side of the base).
fn log_ms(nanos: i64) -> u32 {
    nanos.div_euclid(1_000_000) as u32
}

/// The time of one delivery batch and the window, read and converted once for every push of
/// the batch ([`SessionStream::push_at`]): per push, the entry's age is then a subtraction
/// and a division by a constant (callgrind: `Instant` arithmetic and `Duration::as_millis`
/// per push were ~40 instructions per delivery on issue 13's fan-out).
#[derive(Debug, Clone, Copy)]
pub struct PushClock {
    pub now: Instant,
    nanos: i64,
    window_ms: u32,
    /// `now` as the log's milliseconds ([`log_ms`]).
    log_ms: u32,
}

impl PushClock {
    pub fn new(now: Instant, window: Duration) -> Self {
        let nanos = nanos_from_base(now);
        Self {
            now,
            nanos,
            window_ms: window.as_millis().min(u32::MAX as u128) as u32,
            log_ms: log_ms(nanos),
        }
    }
}

/// A delivery batch's recovery context: its clock, and the core's log borrowed once for all
/// of its pushes (made at the batch's first streamed delivery, dropped at its end).
pub struct PushBatch<'a> {
    pub clock: PushClock,
    pub log: std::cell::RefMut<'a, CoreLog>,
}

/// A frame of the core's log: held once however many streams name it.
struct LogEntry {
    frame: Arc<str>,
    /// When it was appended ([`log_ms`]).
    at_ms: u32,
    /// What the entries naming it were charged when pushed, in all (`len + ENTRY_OVERHEAD`
    /// each): an upper bound of what they still hold, since an entry may have left its stream
    /// since (age, session bound, a dropped stream) without touching the log.
    counted: usize,
}

/// The frames a core's streams name, oldest first, each once per delivery batch (a fan-out
/// gives one frame to many sessions in a row: they share one log entry), under positions that
/// count up. Trimmed from the front only: by age (older than the window) and by the core bound
/// ([`History::cut`]); a stream's entry whose position is below [`CoreLog::first`] has lost
/// its frame and leaves at the stream's next push or the cut's sweep.
#[derive(Default)]
pub struct CoreLog {
    frames: VecDeque<LogEntry>,
    /// The position of `frames[0]` (the next position when empty).
    first: u64,
    /// The entries' `counted`, summed.
    counted: usize,
}

impl CoreLog {
    /// Appends `frame` (or names the last entry again when it is the same frame of the same
    /// millisecond: a fan-out); returns its position.
    #[inline(always)]
    fn append(&mut self, frame: &Arc<str>, at_ms: u32, charged: usize) -> u64 {
        self.counted += charged;
        if let Some(back) = self.frames.back_mut() {
            if std::ptr::addr_eq(Arc::as_ptr(&back.frame), Arc::as_ptr(frame)) && back.at_ms == at_ms {
                back.counted += charged;
                return self.first + self.frames.len() as u64 - 1;
            }
        }
        self.frames.push_back(LogEntry {
            frame: frame.clone(),
            at_ms,
            counted: charged,
        });
        self.first + self.frames.len() as u64 - 1
    }

    /// The frame at `pos`, if still held.
    fn get(&self, pos: u64) -> Option<&Arc<str>> {
        let i = usize::try_from(pos.checked_sub(self.first)?).ok()?;
        self.frames.get(i).map(|e| &e.frame)
    }

    /// Drops the frames from the front while `over` says so; the new first position.
    fn trim_front(&mut self, mut over: impl FnMut(&LogEntry, usize) -> bool) -> u64 {
        let mut n = 0;
        let mut counted = self.counted;
        for e in &self.frames {
            if !over(e, counted) {
                break;
            }
            // The frame's counts are touched once more, when it is dropped below: asked for
            // now, the misses of the frames cut together overlap.
            prefetch_count(&e.frame);
            counted -= e.counted;
            n += 1;
        }
        if n > 0 {
            self.frames.drain(..n);
            self.first += n as u64;
            self.counted = counted;
        }
        self.first
    }
}

/// A core's recovery history: the log of frames its streams name and the charged bytes of
/// every stream (shared by the streams of the core: each adds and removes its own).
#[derive(Default)]
pub struct History {
    /// The charged bytes of every stream of the core (kept exact: a stream's are removed when
    /// it is dropped). What `hubcast_recovery_history_bytes` says.
    total: Cell<usize>,
    /// [`CoreLog::first`], readable while a delivery batch holds the log.
    first: Cell<u64>,
    /// Borrowed mutably for a whole delivery batch (app/recovery.rs), and briefly elsewhere.
    pub log: RefCell<CoreLog>,
}

impl History {
    /// The charged bytes of every stream.
    pub fn held(&self) -> usize {
        self.total.get()
    }

    /// What the log counts: at least what the streams hold of the frames it holds (a quiet
    /// stream may still hold entries whose frames aged out of the log: [`History::over`]).
    pub fn counted(&self) -> usize {
        self.log.borrow().counted
    }

    /// Whether the core must cut ([`History::cut`], then a sweep of its streams): what the
    /// log counts or what the streams hold is past `bound`. Both, since the log ages on its
    /// own: after its age trim it may count less than quiet streams still hold.
    pub fn over(&self, bound: usize) -> bool {
        self.counted() > bound || self.held() > bound
    }

    /// Drops the log's frames older than the window (a quiet core ages too).
    pub fn trim_age(&self, now: Instant, window: Duration) {
        let now_ms = log_ms(nanos_from_base(now));
        // One millisecond more than a stream's own test: a stream's entry and its frame get
        // their milliseconds from different starts, and the stream's age test must come first
        // (an entry that ages out is `window`, not `bound`).
        let window_ms = (window.as_millis().min(u32::MAX as u128 - 1) as u32).saturating_add(1);
        let first = self.log.borrow_mut().trim_front(|e, _| now_ms.wrapping_sub(e.at_ms) > window_ms);
        self.first.set(first);
    }

    /// The core bound's cut (`--recovery-core-bytes`, app/recovery.rs): the log's oldest
    /// frames go until what it counts is at most `target`; every stream then drops its
    /// entries below the returned position ([`SessionStream::drop_before`]), which leaves
    /// [`History::held`] at most `target` too. Oldest first, as Socket.IO's adapters and
    /// Centrifugo trim their histories: one horizon for every session of the core.
    pub fn cut(&self, target: usize) -> u64 {
        let first = self.log.borrow_mut().trim_front(|_, counted| counted > target);
        self.first.set(first);
        first
    }

}

/// One session's stream of delivered frames.
///
/// Laid out (`repr(C)`, aligned to a cache line) so that what a push writes and most of what
/// it reads ([`SessionStream::push_at`]: `next_seq`, `started_nanos`, the deque, `bytes`,
/// `front_at_ms`) is one line: a delivery to a session touches its stream once per ~1,000
/// other deliveries on issue 13's fan-out, so each line it spreads over is one more cache
/// miss per delivery (docs/benchmarks/2026-11-28-recovery-cache-lines.md). The core's total
/// comes in with the log (`history`), so the push does not read this stream's `history`
/// pointer, in the second line; a push that trims does.
#[repr(C, align(64))]
pub struct SessionStream {
    /// The seq the next frame gets (the first is 1).
    next_seq: u64,
    /// `started` in nanoseconds from [`BASE`] (for [`PushClock`]).
    started_nanos: i64,
    entries: VecDeque<Entry>,
    bytes: usize,
    /// The front entry's `at_ms` while there is one (kept by every push into an empty
    /// stream and every exit from the front), so a push tests the window without reading
    /// the front entry, a line ~`len` entries away from the back one.
    front_at_ms: u32,
    epoch: u32,
    /// `h1.<epoch>.`: what every offset of this stream starts with (shared with its outlets).
    prefix: Rc<str>,
    started: Instant,
    /// The oldest seq still held (`next_seq` when empty); an offset below `first_seq - 1` has
    /// lost what followed it, for the reason in `cut_by`. The entries' seqs follow each other:
    /// entry `i` has seq `first_seq + i`, so `first_seq + entries.len() == next_seq` always.
    /// Their log positions count up too, so when one entry's frame is still in the log, every
    /// later one's is.
    first_seq: u64,
    cut_by: Option<TrimCause>,
    /// The core's log and the charged bytes of every stream of the core.
    history: Rc<History>,
    /// This epoch's device part (with `--redis-url` only: [`super::cut`]).
    pub cuts: super::cut::Cuts,
}

impl Drop for SessionStream {
    fn drop(&mut self) {
        self.history.total.set(self.history.total.get() - self.bytes);
    }
}

impl SessionStream {
    pub fn new(history: Rc<History>, now: Instant) -> Self {
        Self::with_epoch(fastrand::u32(1..), history, now)
    }

    fn with_epoch(epoch: u32, history: Rc<History>, now: Instant) -> Self {
        let mut prefix = String::from("h1.");
        push_base36(&mut prefix, u64::from(epoch));
        prefix.push('.');
        Self {
            epoch,
            prefix: prefix.into(),
            started: now,
            started_nanos: nanos_from_base(now),
            next_seq: 1,
            entries: VecDeque::new(),
            bytes: 0,
            // Before any entry: a push's at_ms (whole ms since `started`) is never below it.
            front_at_ms: 0,
            first_seq: 1,
            cut_by: None,
            history,
            cuts: Default::default(),
        }
    }

    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// A stream that continues a client's `h1.<epoch>.<seq>` (design step 11: rebuilt on
    /// another instance): its next frame gets `seq + 1`, and `seq` itself is where it starts.
    pub fn continuing(epoch: u32, seq: u64, history: Rc<History>, now: Instant) -> Self {
        let mut s = Self::with_epoch(epoch, history, now);
        s.next_seq = seq.saturating_add(1);
        s.first_seq = s.next_seq;
        s
    }

    /// `h1.<epoch>.`, the start of this stream's offsets.
    pub fn prefix(&self) -> &Rc<str> {
        &self.prefix
    }

    /// The seq of the newest frame (0 before the first).
    pub fn head(&self) -> u64 {
        self.next_seq - 1
    }

    /// The oldest seq held.
    pub fn first_seq(&self) -> u64 {
        self.first_seq
    }

    /// Charged bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn ms(&self, now: Instant) -> u32 {
        now.saturating_duration_since(self.started).as_millis() as u32
    }

    /// Appends a delivered frame; returns its seq. Trims by age and by the session bound
    /// (`trimmed` gets the bytes); the core bound is the caller's ([`History::cut`]).
    pub fn push(
        &mut self,
        frame: &Arc<str>,
        now: Instant,
        window: Duration,
        session_bytes: usize,
        trimmed: &mut Trimmed,
    ) -> u64 {
        self.push_clocked(frame, &PushClock::new(now, window), session_bytes, trimmed)
    }

    /// [`SessionStream::push`] with a batch's clock, the log borrowed for this push alone.
    pub fn push_clocked(&mut self, frame: &Arc<str>, clock: &PushClock, session_bytes: usize, trimmed: &mut Trimmed) -> u64 {
        let history = self.history.clone();
        let mut log = history.log.borrow_mut();
        self.push_at(frame, clock, &history, &mut log, session_bytes, trimmed)
    }

    /// [`SessionStream::push`] with the batch's clock read once ([`PushClock`]) and the core's
    /// log borrowed once (`log`: this stream's [`History::log`], `history` its [`History`]).
    /// The hot path: a log append (most often a count added to its last entry), a deque
    /// push, two adds and a test of the window and the session bound on the stream's line.
    /// Inlined into the delivery loop always (a call per delivery was ~28 instructions more
    /// when a build left it out of line).
    #[inline(always)]
    pub fn push_at(
        &mut self,
        frame: &Arc<str>,
        clock: &PushClock,
        history: &History,
        log: &mut CoreLog,
        session_bytes: usize,
        trimmed: &mut Trimmed,
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        // Exactly `self.ms(clock.now)`: whole milliseconds since the start, wrapping.
        let at_ms = ((clock.nanos - self.started_nanos).max(0) as u64 / 1_000_000) as u32;
        let len = frame.len();
        let charged = len + ENTRY_OVERHEAD;
        let pos = log.append(frame, clock.log_ms, charged);
        if self.entries.is_empty() {
            self.front_at_ms = at_ms;
        }
        debug_assert!(self.entries.front().is_none_or(|f| f.at_ms == self.front_at_ms));
        self.entries.push_back(Entry {
            pos,
            at_ms,
            len: len as u32,
        });
        self.bytes += charged;
        // The core's total through the caller's `history` (the stream's own: its pointer is
        // in the stream's second line, which a push then does not touch).
        debug_assert!(std::ptr::eq(history, &*self.history));
        history.total.set(history.total.get() + charged);
        // Nothing to trim unless over the session bound or the front is past the window.
        // An entry whose frame the core's log cut is dropped by the cut's sweep of every
        // stream (app/recovery.rs), or, aged out of the log, is past the window here too
        // ([`History::trim_age`] waits a millisecond more).
        if self.bytes > session_bytes || at_ms.wrapping_sub(self.front_at_ms) > clock.window_ms {
            self.trim_front_at(at_ms, clock.window_ms, log.first, session_bytes, trimmed);
        }
        seq
    }

    /// [`SessionStream::push_at`]'s trims, when its test says there are some: past the
    /// window, cut from the core's log, over the session bound.
    #[inline(never)]
    fn trim_front_at(&mut self, at_ms: u32, window_ms: u32, first: u64, session_bytes: usize, trimmed: &mut Trimmed) {
        while let Some(front) = self.entries.front() {
            let cause = if at_ms.wrapping_sub(front.at_ms) > window_ms {
                TrimCause::Window
            } else if front.pos < first {
                TrimCause::CoreBound
            } else if self.bytes > session_bytes {
                TrimCause::SessionBound
            } else {
                break;
            };
            trimmed.add(cause, self.pop_front(cause));
        }
    }

    /// Trims entries older than the window (a quiet stream ages too), then those whose frame
    /// the core's log no longer holds (cut by the core bound).
    pub fn trim_age(&mut self, now: Instant, window: Duration, trimmed: &mut Trimmed) {
        let at_ms = self.ms(now);
        let window_ms = window.as_millis().min(u32::MAX as u128) as u32;
        while self
            .entries
            .front()
            .is_some_and(|f| at_ms.wrapping_sub(f.at_ms) > window_ms)
        {
            trimmed.add(TrimCause::Window, self.pop_front(TrimCause::Window));
        }
        trimmed.add(TrimCause::CoreBound, self.drop_before(self.history.first.get(), TrimCause::CoreBound));
    }

    /// Drops the entries whose frame is before log position `first` (the core bound's cut:
    /// [`History::cut`]); returns the bytes freed. Touches this stream's own entries only.
    pub fn drop_before(&mut self, first: u64, cause: TrimCause) -> usize {
        let n = self.entries.iter().take_while(|e| e.pos < first).count();
        self.drop_front(n, cause)
    }

    /// Trims from the front until at most `bytes` are held; returns the bytes freed.
    pub fn trim_to(&mut self, bytes: usize, cause: TrimCause) -> usize {
        let mut freed = 0;
        let n = self
            .entries
            .iter()
            .take_while(|e| {
                let over = self.bytes - freed > bytes;
                if over {
                    freed += e.charged();
                }
                over
            })
            .count();
        self.drop_front(n, cause)
    }

    /// Drops the first `n` entries in one go, the totals updated once; returns their bytes.
    fn drop_front(&mut self, n: usize, cause: TrimCause) -> usize {
        if n == 0 {
            return 0;
        }
        let freed: usize = self.entries.drain(..n).map(|e| e.charged()).sum();
        if let Some(f) = self.entries.front() {
            self.front_at_ms = f.at_ms;
        }
        self.first_seq += n as u64;
        self.bytes -= freed;
        self.history.total.set(self.history.total.get() - freed);
        self.cut_by = Some(cause);
        freed
    }

    fn pop_front(&mut self, cause: TrimCause) -> usize {
        let Some(e) = self.entries.pop_front() else {
            return 0;
        };
        if let Some(f) = self.entries.front() {
            self.front_at_ms = f.at_ms;
        }
        let charged = e.charged();
        self.bytes -= charged;
        self.history.total.set(self.history.total.get() - charged);
        self.first_seq += 1;
        self.cut_by = Some(cause);
        charged
    }

    /// The index of the entry of `seq + 1`, when the stream still holds every frame after
    /// `seq` (its entries and, for the first of them, its frame in the log: positions count
    /// up, so the later ones' too).
    fn held_after(&self, seq: u64, log: &CoreLog) -> Result<usize, Failure> {
        if seq > self.head() {
            return Err(Failure::UnknownOffset);
        }
        if seq + 1 < self.first_seq {
            return Err(match self.cut_by {
                Some(TrimCause::Window) => Failure::Window,
                _ => Failure::Bound,
            });
        }
        let skip = (seq + 1 - self.first_seq) as usize;
        match self.entries.get(skip) {
            Some(e) if e.pos < log.first => Err(Failure::Bound),
            _ => Ok(skip),
        }
    }

    /// The frames after `seq` (exclusive), in order, when the stream still holds all of them.
    pub fn after(&self, seq: u64) -> Result<Vec<(Arc<str>, u64)>, Failure> {
        let log = self.history.log.borrow();
        let skip = self.held_after(seq, &log)?;
        // Every frame is there (positions count up from one held); were one not, `bound`
        // rather than a replay with a hole.
        self.entries
            .iter()
            .skip(skip)
            .zip(seq + 1..)
            .map(|(e, seq)| Some((log.get(e.pos)?.clone(), seq)))
            .collect::<Option<Vec<_>>>()
            .ok_or(Failure::Bound)
    }

    /// Takes the frames after `seq` out of the stream, in order, so the next frame gets
    /// `seq + 1` again (a hand-over's stitch inserts frames there: [`super::stitch`]).
    /// `None`, and nothing changed, unless the stream holds every frame after `seq`.
    pub fn take_after(&mut self, seq: u64) -> Option<Vec<Arc<str>>> {
        let history = self.history.clone();
        let log = history.log.borrow();
        let keep = self.held_after(seq, &log).ok()?;
        // Every frame first (nothing changed unless all are there), then the entries go.
        let taken: Vec<Arc<str>> = self.entries.range(keep..).map(|e| log.get(e.pos).cloned()).collect::<Option<_>>()?;
        let charged: usize = self.entries.drain(keep..).map(|e| e.charged()).sum();
        self.bytes -= charged;
        self.history.total.set(self.history.total.get() - charged);
        self.next_seq = seq + 1;
        Some(taken)
    }

    /// The offset text of `seq`.
    pub fn offset(&self, seq: u64) -> String {
        offset_text(&self.prefix, seq)
    }
}

/// Asks the CPU to bring `frame`'s reference counts into cache (a hint: no effect on what
/// the program does, never a fault). The counts precede the text in the `Arc`'s block.
#[inline(always)]
fn prefetch_count(frame: &Arc<str>) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault, whatever the address.
    unsafe {
        let counts = (Arc::as_ptr(frame) as *const u8).wrapping_sub(2 * std::mem::size_of::<usize>());
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(counts as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = frame;
}

/// `<prefix><seq in base 36>`.
pub fn offset_text(prefix: &str, seq: u64) -> String {
    let mut s = String::with_capacity(prefix.len() + 13);
    s.push_str(prefix);
    push_base36(&mut s, seq);
    s
}

/// Appends `n` in base 36 (lower case).
pub fn push_base36(out: &mut String, n: u64) {
    out.push_str(Base36::new(n).as_str());
}

/// Every two-digit base-36 number, `00` to `zz` (1,296 of them): [`Base36`] writes two digits
/// per division.
const PAIRS: [[u8; 2]; 1296] = {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut t = [[0u8; 2]; 1296];
    let mut i = 0;
    while i < 1296 {
        t[i] = [DIGITS[i / 36], DIGITS[i % 36]];
        i += 1;
    }
    t
};

/// Writes `n` in base 36 into `buf`, its last digit at `end - 1`, from the last digit back
/// two per division by a constant ([`PAIRS`]); returns where the digits start. [`Base36`] and
/// [`OffsetText`] both write with it (`buf` must hold the digits before `end`).
#[inline(always)]
fn write_base36(buf: &mut [u8], end: usize, mut n: u64) -> usize {
    let mut i = end;
    while n >= 1296 {
        let pair = PAIRS[(n % 1296) as usize];
        n /= 1296;
        i -= 2;
        buf[i] = pair[0];
        buf[i + 1] = pair[1];
    }
    let pair = PAIRS[n as usize];
    if n >= 36 {
        i -= 2;
        buf[i] = pair[0];
        buf[i + 1] = pair[1];
    } else {
        i -= 1;
        buf[i] = pair[1];
    }
    i
}

/// `n` in base 36 (lower case), on the stack, optionally followed by a short suffix: the
/// writer appends an offset's seq to every event (`Base36::with_suffix(seq, b"\"]")`, the
/// digits and what closes the event in one slice). Two digits per step from a table: a seq
/// of up to 4 digits costs two divisions by a constant (callgrind: the digit-at-a-time loop
/// was ~67 instructions per event on issue 13's fan-out).
pub struct Base36 {
    buf: [u8; 16],
    start: u8,
    end: u8,
}

impl Base36 {
    #[inline]
    pub fn new(n: u64) -> Self {
        Self::with_suffix(n, b"")
    }

    /// The digits of `n`, then `suffix` (at most 3 bytes).
    #[inline]
    pub fn with_suffix(n: u64, suffix: &[u8]) -> Self {
        let mut buf = [0u8; 16];
        // 13 digits at most (36^13 > 2^64), then the suffix.
        debug_assert!(suffix.len() <= 3, "a suffix of at most 3 bytes");
        let end = 13 + suffix.len().min(3);
        buf[13..end].copy_from_slice(&suffix[..end - 13]);
        let i = write_base36(&mut buf, 13, n);
        Self {
            buf,
            start: i as u8,
            end: end as u8,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[usize::from(self.start)..usize::from(self.end)]
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).expect("ASCII digits")
    }
}

/// 36¹ to 36¹²: a number below `POW36[k - 1]` has at most `k` base-36 digits.
const POW36: [u64; 12] = {
    let mut t = [0u64; 12];
    let mut p = 36u64;
    let mut i = 0;
    while i < 12 {
        t[i] = p;
        p = p.wrapping_mul(36);
        i += 1;
    }
    t
};

/// A socket's offsets as the writer writes them: what every offset of one write starts with
/// (the lead: `,"h1.<epoch>.` for Socket.IO) copied in once, then per event the seq's digits
/// and what follows them written right after it in place, so an event's whole offset is one
/// slice ([`OffsetText::with_seq`]): the frame has as many parts as without offsets.
pub struct OffsetText {
    buf: [u8; Self::CAP],
    lead: usize,
}

impl OffsetText {
    /// Room for a lead of up to 32 bytes (hubcast's are at most 13: `,"` and `h1.` + 7 digits
    /// + `.`), 13 digits and a suffix of up to 3 bytes.
    const CAP: usize = 48;

    /// The lead is the concatenation of `parts`; `None` when longer than 32 bytes.
    pub fn new(parts: &[&[u8]]) -> Option<Self> {
        let mut buf = [0u8; Self::CAP];
        let mut lead = 0;
        for p in parts {
            buf.get_mut(lead..lead + p.len())?.copy_from_slice(p);
            lead += p.len();
        }
        (lead <= Self::CAP - 16).then_some(Self { buf, lead })
    }

    /// The lead, `n` in base 36 and `suffix`, as one slice.
    #[inline]
    pub fn with_seq<const S: usize>(&mut self, n: u64, suffix: &[u8; S]) -> &[u8] {
        const { assert!(S <= 3, "a suffix of at most 3 bytes") };
        // Most seqs have 1 to 4 digits: compared at once, then the table.
        let digits = match n {
            0..36 => 1,
            36..1296 => 2,
            1296..46_656 => 3,
            46_656..1_679_616 => 4,
            _ => 1 + POW36.iter().take_while(|p| n >= **p).count(),
        };
        let end = self.lead + digits;
        let buf = &mut self.buf[..end + S];
        buf[end..].copy_from_slice(suffix);
        write_base36(buf, end, n);
        buf
    }
}

pub(crate) fn parse_base36(s: &str) -> Option<u64> {
    if s.is_empty()
        || s.len() > 13
        || !s
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
    {
        return None;
    }
    u64::from_str_radix(s, 36).ok()
}

/// Parses `h1.<epoch>.<seq>`, with or without a device part after it ([`super::cut`]):
/// `(epoch, seq)`; `None` for anything hubcast did not give.
pub fn parse_offset(s: &str) -> Option<(u32, u64)> {
    parse_offset_with_part(s).map(|(epoch, seq, _)| (epoch, seq))
}

/// [`parse_offset`] and the offset's device part, read once.
pub fn parse_offset_with_part(s: &str) -> Option<(u32, u64, super::cut::DevicePart)> {
    let mut parts = s.split('.');
    let (Some("h1"), Some(epoch), Some(seq)) = (parts.next(), parts.next(), parts.next()) else {
        return None;
    };
    let part = super::cut::parse_part(parts)?;
    let epoch = u32::try_from(parse_base36(epoch)?)
        .ok()
        .filter(|e| *e > 0)?;
    Some((epoch, parse_base36(seq)?, part))
}

/// One pid issued to a Socket.IO socket of the session.
pub struct PidEntry {
    pub pid: Box<str>,
    /// The Socket.IO sid given with it (a restored socket keeps it).
    pub sid: Box<str>,
    /// The outlet it is connected on; `None` while away.
    pub socket: Option<u64>,
    /// When it left (meaningful while away).
    pub since: Instant,
    /// Where the stream stood when the pid was issued: a CONNECT with the pid and no offset
    /// (no event reached the client yet) replays from there.
    pub epoch: u32,
    pub start_seq: u64,
}

/// What a successful restore gives the socket.
pub struct Restored {
    pub sid: Box<str>,
    /// The frames after the client's offset, in order, with their seqs.
    pub frames: Vec<(Arc<str>, u64)>,
    /// Another outlet the pid was still connected on (a connection the server had not yet
    /// seen die): the caller closes it.
    pub displaced: Option<u64>,
}

/// A session's recovery state: its pids and its stream.
#[derive(Default)]
pub struct SessionRecovery {
    pub stream: Option<SessionStream>,
    pub pids: SmallVec<[PidEntry; 2]>,
    /// The epoch of the stream last dropped for the window: an offset of it fails `window`.
    pub lost_epoch: Option<u32>,
}

impl SessionRecovery {
    /// The history may have a hole (an adoption voided: docs/design/recovery.md step 6), so
    /// every offset of it must fail: the stream takes a new epoch with nothing held. Its seqs
    /// go on from where they were, and the pids of the sockets connected now move to the new
    /// epoch: what they received live was complete, so their next restore works. A frame
    /// still queued for such a socket is written with the new epoch at a seq below the new
    /// stream's first, so a restore from it fails `bound`, never replays across the hole.
    /// Returns the new prefix, for those sockets' outlets.
    pub fn void_history(&mut self, history: &Rc<History>, now: Instant) -> Rc<str> {
        let next = self.stream.as_ref().map_or(1, |s| s.next_seq);
        let mut stream = SessionStream::new(history.clone(), now);
        stream.next_seq = next;
        stream.first_seq = next;
        for p in self.pids.iter_mut().filter(|p| p.socket.is_some()) {
            p.epoch = stream.epoch;
        }
        let prefix = stream.prefix.clone();
        self.stream = Some(stream);
        prefix
    }

    /// The stream, made (with a new epoch) when there is none.
    pub fn stream_or_new(
        &mut self,
        history: &Rc<History>,
        now: Instant,
    ) -> &mut SessionStream {
        self.stream
            .get_or_insert_with(|| SessionStream::new(history.clone(), now))
    }

    /// Issues a new pid to the socket `outlet` (the stream must exist); returns `(sid, pid)`.
    pub fn issue(&mut self, outlet: u64, now: Instant) -> (Box<str>, Box<str>) {
        let (epoch, start_seq) = self.stream.as_ref().map_or((0, 0), |s| (s.epoch, s.head()));
        if self.pids.len() >= MAX_PIDS {
            let oldest = self
                .pids
                .iter()
                .enumerate()
                .filter(|(_, p)| p.socket.is_none())
                .min_by_key(|(_, p)| p.since)
                .map(|(i, _)| i);
            self.pids.remove(oldest.unwrap_or(0));
        }
        let pid: Box<str> = crate::ids::random_token(16).into();
        let sid: Box<str> = crate::ids::random_token(15).into();
        self.pids.push(PidEntry {
            pid: pid.clone(),
            sid: sid.clone(),
            socket: Some(outlet),
            since: now,
            epoch,
            start_seq,
        });
        (sid, pid)
    }

    /// Restores the pid on `outlet`: the frames after `offset` (or after where the pid began
    /// when the client sent none). A pid found but failed is forgotten.
    pub fn restore(
        &mut self,
        pid: &str,
        offset: Option<&str>,
        outlet: u64,
        now: Instant,
        window: Duration,
    ) -> Result<Restored, Failure> {
        let Some(at) = self.pids.iter().position(|p| &*p.pid == pid) else {
            return Err(Failure::UnknownPid);
        };
        let result = self.replay_for(at, offset, now, window);
        match result {
            Ok(frames) => {
                let entry = &mut self.pids[at];
                let displaced = entry.socket.replace(outlet);
                Ok(Restored {
                    sid: entry.sid.clone(),
                    frames,
                    displaced,
                })
            }
            Err(failure) => {
                if self.pids[at].socket.is_none() {
                    self.pids.remove(at);
                }
                Err(failure)
            }
        }
    }

    fn replay_for(
        &self,
        at: usize,
        offset: Option<&str>,
        now: Instant,
        window: Duration,
    ) -> Result<Vec<(Arc<str>, u64)>, Failure> {
        let entry = &self.pids[at];
        if entry.socket.is_none() && now.saturating_duration_since(entry.since) > window {
            return Err(Failure::Window);
        }
        let (epoch, seq) = match offset {
            Some(offset) => parse_offset(offset).ok_or(Failure::UnknownOffset)?,
            None => (entry.epoch, entry.start_seq),
        };
        let Some(stream) = &self.stream else {
            return Err(Failure::HistoryLost);
        };
        if stream.epoch != epoch {
            return Err(Failure::HistoryLost);
        }
        stream.after(seq)
    }

    /// Resumes a plain WebSocket after `offset` (`since=`): the frames that followed it. No pid:
    /// the session id and the offset name the stream; the window is the stream's own age trim.
    pub fn resume(&self, offset: &str) -> Result<Vec<(Arc<str>, u64)>, Failure> {
        let (epoch, seq) = parse_offset(offset).ok_or(Failure::UnknownOffset)?;
        match &self.stream {
            Some(stream) if stream.epoch == epoch => stream.after(seq),
            _ if self.lost_epoch == Some(epoch) => Err(Failure::Window),
            _ => Err(Failure::HistoryLost),
        }
    }

    /// The socket `outlet` closed: its pid is away from `now`. True when it had one.
    pub fn left(&mut self, outlet: u64, now: Instant) -> bool {
        match self.pids.iter_mut().find(|p| p.socket == Some(outlet)) {
            Some(p) => {
                p.socket = None;
                p.since = now;
                true
            }
            None => false,
        }
    }

    /// The socket `old` is now `new` (a polling socket upgraded to WebSocket).
    pub fn moved(&mut self, old: u64, new: u64) {
        if let Some(p) = self.pids.iter_mut().find(|p| p.socket == Some(old)) {
            p.socket = Some(new);
        }
    }

    /// Whether a pid is connected.
    pub fn connected(&self) -> bool {
        self.pids.iter().any(|p| p.socket.is_some())
    }

    /// When the stream may go: the window after the last pid left (`None`: one is connected,
    /// or there is no stream).
    pub fn stream_deadline(&self, window: Duration) -> Option<Instant> {
        if self.stream.is_none() || self.connected() {
            return None;
        }
        self.pids.iter().map(|p| p.since + window).max()
    }

    /// Ages the stream, and drops it once no pid is connected or away for less than the window
    /// (the pids stay, so a late client is told `window`). Returns the trimmed bytes.
    pub fn sweep(&mut self, now: Instant, window: Duration) -> Trimmed {
        let mut trimmed = Trimmed::default();
        if self.stream_deadline(window).is_some_and(|at| at <= now) {
            if let Some(stream) = self.stream.take() {
                trimmed.add(TrimCause::Window, stream.bytes);
                self.lost_epoch = Some(stream.epoch);
            }
        } else if let Some(stream) = &mut self.stream {
            stream.trim_age(now, window, &mut trimmed);
        }
        trimmed
    }
}

/// A session's recovery state as the store keeps it across a restart (a graceful shutdown
/// writes it, the next start reads it back: docs/design/recovery.md step 5). Times are wall
/// clock (unix ms), since `Instant`s mean nothing to another process; frames are shared, not
/// copied, until encoded.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StoredRecovery {
    pub epoch: u32,
    pub next_seq: u64,
    pub first_seq: u64,
    /// 0: nothing trimmed; else 1 + the [`TrimCause`] index.
    pub cut_by: u8,
    /// The epoch of the stream last dropped for the window (0: none).
    pub lost_epoch: u32,
    /// `(seq, unix ms it was delivered, frame)`, oldest first.
    pub entries: Vec<(u64, i64, Arc<str>)>,
    pub pids: Vec<StoredPid>,
}

impl StoredRecovery {
    /// An upper bound of its encoded size (`store::format`: fixed fields, then per entry
    /// 8 + 8 + 4 + frame bytes, per pid 8 + 4 + 8 + 4 + 4 + pid and sid bytes): the shutdown
    /// groups records into commits by it, so no frame passes what a reader accepts.
    pub fn encoded_bytes_at_most(&self) -> usize {
        64 + self.entries.iter().map(|e| 20 + e.2.len()).sum::<usize>()
            + self.pids.iter().map(|p| 28 + p.pid.len() + p.sid.len()).sum::<usize>()
    }
}

/// The frames one delivery batch appended to the streams of a core, as the store writes them
/// (`store::format`, tag 10, design step 7a): each distinct frame once (a frame shared by many
/// sessions is one `Arc`), then per session its epoch, the seq of its first frame and its
/// frames' indexes. Committed before the batch's writers run, so no frame reaches a socket
/// before it is written to the OS. Reused from batch to batch (cleared, not freed).
#[derive(Default)]
pub struct AppendBatch {
    /// Unix ms of the batch (every entry of it gets this time).
    pub at_ms: i64,
    pub frames: Vec<Arc<str>>,
    /// Frame (by address) to its index in `frames`.
    index: hashbrown::HashMap<usize, u32>,
    /// `(session, epoch, first seq, frame indexes)`; a session's seqs in one batch follow
    /// each other.
    pub sessions: Vec<(crate::ids::SessionId, u32, u64, Vec<u32>)>,
    /// The session of each entry of `sessions`, to find its entry again.
    at: hashbrown::HashMap<crate::ids::SessionId, usize>,
}

impl AppendBatch {
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    pub fn clear(&mut self) {
        self.frames.clear();
        self.index.clear();
        self.sessions.clear();
        self.at.clear();
    }

    /// Frame `frame` got `seq` in `session`'s stream of epoch `epoch`.
    pub fn add(&mut self, session: crate::ids::SessionId, epoch: u32, seq: u64, frame: &Arc<str>) {
        // A fan-out gives one frame to many sessions in a row: the last frame first.
        let i = match self.frames.last() {
            Some(last) if Arc::ptr_eq(last, frame) => (self.frames.len() - 1) as u32,
            _ => {
                let key = Arc::as_ptr(frame) as *const u8 as usize;
                let frames = &mut self.frames;
                *self.index.entry(key).or_insert_with(|| {
                    frames.push(frame.clone());
                    (frames.len() - 1) as u32
                })
            }
        };
        let at = match self.sessions.last() {
            Some(last) if last.0 == session => self.sessions.len() - 1,
            _ => {
                let sessions = &mut self.sessions;
                *self.at.entry(session).or_insert_with(|| {
                    sessions.push((session, epoch, seq, Vec::new()));
                    sessions.len() - 1
                })
            }
        };
        let entry = &mut self.sessions[at];
        if entry.1 == epoch && entry.2 + entry.3.len() as u64 == seq {
            entry.3.push(i);
        } else {
            // Not the next seq of this entry (never within one batch): an entry of its own.
            self.sessions.push((session, epoch, seq, vec![i]));
            self.at.insert(session, self.sessions.len() - 1);
        }
    }
}

/// Applies one session's appended frames (tag 10) over its stored stream: seqs at or below
/// what it holds are skipped (a snapshot's stream may already hold appends committed after
/// its snapshot point), a gap (never written so) drops what came before it, counted as cut by
/// the session bound; then at most `cap` charged bytes are kept (trimmed, when twice over,
/// from the front).
pub fn apply_append(r: &mut StoredRecovery, first_seq: u64, at_ms: i64, frames: &[Arc<str>], cap: usize, held: &mut usize) {
    for (i, frame) in frames.iter().enumerate() {
        let seq = first_seq + i as u64;
        if seq < r.next_seq {
            continue;
        }
        if seq > r.next_seq {
            r.entries.clear();
            *held = 0;
            r.first_seq = seq;
            r.cut_by = 1 + TrimCause::SessionBound.index() as u8;
        }
        r.entries.push((seq, at_ms, frame.clone()));
        *held += frame.len() + ENTRY_OVERHEAD;
        r.next_seq = seq + 1;
    }
    if r.entries.is_empty() {
        r.first_seq = r.next_seq;
    }
    if cap > 0 && *held > 2 * cap {
        let mut cut = 0;
        while *held > cap && cut < r.entries.len() {
            *held -= r.entries[cut].2.len() + ENTRY_OVERHEAD;
            cut += 1;
        }
        r.entries.drain(..cut);
        r.first_seq = r.entries.first().map_or(r.next_seq, |e| e.0);
        r.cut_by = 1 + TrimCause::SessionBound.index() as u8;
    }
}

/// The charged bytes of a stored stream's entries.
pub fn stored_bytes(r: &StoredRecovery) -> usize {
    r.entries.iter().map(|e| e.2.len() + ENTRY_OVERHEAD).sum()
}

impl StoredRecovery {
    /// After a crash that may have lost deliveries before they were appended (design step 7e):
    /// a new epoch, nothing held, so every offset of the old one fails `history_lost` and no
    /// replay is claimed that cannot be made. The pids stay (with the old epoch).
    pub fn lose_history(&mut self) {
        let mut epoch = fastrand::u32(1..);
        while epoch == self.epoch {
            epoch = fastrand::u32(1..);
        }
        self.epoch = epoch;
        self.entries.clear();
        self.first_seq = self.next_seq;
        self.cut_by = 0;
    }
}

/// A pid as stored: always away (a shutdown said goodbye to its socket), since `away_ms`.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredPid {
    pub pid: Box<str>,
    pub sid: Box<str>,
    /// Unix ms it left (a pid still connected when written counts as leaving then).
    pub away_ms: i64,
    pub epoch: u32,
    pub start_seq: u64,
}

/// `at` in unix ms, given that `now` is `now_ms`.
fn wall_ms(at: Instant, now: Instant, now_ms: i64) -> i64 {
    now_ms - now.saturating_duration_since(at).as_millis() as i64
}

/// Unix ms `ms` as an `Instant`, given that `now` is `now_ms` (a time in the future, e.g. a
/// clock set back, is now; one before the process's `Instant` range is the earliest there is).
fn instant_of(ms: i64, now: Instant, now_ms: i64) -> Instant {
    let age = Duration::from_millis(now_ms.saturating_sub(ms).max(0) as u64);
    now.checked_sub(age).unwrap_or(now)
}

impl SessionRecovery {
    /// What the store keeps of it (`None`: it has no stream, nothing to recover from).
    pub fn to_stored(&self, now: Instant, now_ms: i64) -> Option<StoredRecovery> {
        let stream = self.stream.as_ref()?;
        let log = stream.history.log.borrow();
        // Entries whose frame the core bound cut from the log (not yet dropped by their
        // stream) are not kept: as if the cut had dropped them.
        let stale = stream.entries.iter().take_while(|e| e.pos < log.first).count();
        Some(StoredRecovery {
            epoch: stream.epoch,
            next_seq: stream.next_seq,
            first_seq: stream.first_seq + stale as u64,
            cut_by: if stale > 0 { Some(TrimCause::CoreBound) } else { stream.cut_by }.map_or(0, |c| 1 + c.index() as u8),
            lost_epoch: self.lost_epoch.unwrap_or(0),
            entries: stream
                .entries
                .iter()
                .zip(stream.first_seq..)
                .skip(stale)
                // Its age now (wrapping: an entry read back from the store may predate the
                // stream's start), so the time is right whichever way it wrapped.
                .filter_map(|(e, seq)| {
                    Some((seq, now_ms - i64::from(stream.ms(now).wrapping_sub(e.at_ms)), log.get(e.pos)?.clone()))
                })
                .collect(),
            pids: self
                .pids
                .iter()
                .map(|p| StoredPid {
                    pid: p.pid.clone(),
                    sid: p.sid.clone(),
                    away_ms: if p.socket.is_some() {
                        now_ms
                    } else {
                        wall_ms(p.since, now, now_ms)
                    },
                    epoch: p.epoch,
                    start_seq: p.start_seq,
                })
                .collect(),
        })
    }

    /// [`SessionRecovery::to_stored`] for the write-ahead (design step 7): a pid still
    /// connected is written with `away_ms` `i64::MIN`, away since the start that reads it back
    /// (the crash time is unknown).
    pub fn to_stored_live(&self, now: Instant, now_ms: i64) -> Option<StoredRecovery> {
        let mut stored = self.to_stored(now, now_ms)?;
        stored.pids = self.stored_pids(now, now_ms);
        Some(stored)
    }

    /// The pids as the write-ahead keeps them ([`SessionRecovery::to_stored_live`]).
    pub fn stored_pids(&self, now: Instant, now_ms: i64) -> Vec<StoredPid> {
        self.pids
            .iter()
            .map(|p| StoredPid {
                pid: p.pid.clone(),
                sid: p.sid.clone(),
                away_ms: if p.socket.is_some() { i64::MIN } else { wall_ms(p.since, now, now_ms) },
                epoch: p.epoch,
                start_seq: p.start_seq,
            })
            .collect()
    }

    /// Rebuilds it from the store at start: the same epoch and seqs, each pid away since its
    /// wall-clock time (so the time the process was down counts against the window), each
    /// frame its own allocation again, appended to the core's log and charged to it.
    pub fn from_stored(
        stored: StoredRecovery,
        history: Rc<History>,
        now: Instant,
        now_ms: i64,
    ) -> Self {
        let mut stream = SessionStream::with_epoch(stored.epoch.max(1), history, now);
        stream.next_seq = stored.next_seq.max(1);
        stream.first_seq = stored.first_seq;
        stream.cut_by = TrimCause::ALL
            .get(usize::from(stored.cut_by).wrapping_sub(1))
            .copied();
        let mut first = None;
        let mut kept: Vec<(u32, Arc<str>)> = Vec::new();
        for (seq, at, frame) in stored.entries {
            if seq < stream.first_seq || seq >= stream.next_seq {
                continue;
            }
            // The entries' seqs follow each other (an entry's seq is its position): a gap,
            // which hubcast never writes, drops what came before it, as cut by the session
            // bound (as `apply_append` does).
            let expected = first.map_or(seq, |f: u64| f + kept.len() as u64);
            if seq != expected {
                kept.clear();
                stream.cut_by = Some(TrimCause::SessionBound);
                first = Some(seq);
            }
            first.get_or_insert(seq);
            // Milliseconds since the stream's start, which is now: older entries wrap below
            // zero, and every age test subtracts wrapping (entries never live 49 days).
            let age = now_ms.saturating_sub(at).clamp(0, i64::from(u32::MAX)) as u32;
            kept.push((0u32.wrapping_sub(age), frame));
        }
        // The last entry must be `next_seq - 1` (entry seqs are positions): what follows a
        // gap at the end is lost, as above.
        if first.is_some_and(|f| f + kept.len() as u64 != stream.next_seq) {
            kept.clear();
            stream.cut_by = Some(TrimCause::SessionBound);
        }
        match first.filter(|_| !kept.is_empty()) {
            Some(first) => stream.first_seq = first,
            None => stream.first_seq = stream.next_seq,
        }
        // Into the core's log as of now (the log's age is its own: each entry keeps its
        // delivery time for the stream's window).
        let history = stream.history.clone();
        let mut log = history.log.borrow_mut();
        let log_now = log_ms(nanos_from_base(now));
        for (at_ms, frame) in kept {
            let charged = frame.len() + ENTRY_OVERHEAD;
            let pos = log.append(&frame, log_now, charged);
            stream.entries.push_back(Entry {
                pos,
                at_ms,
                len: frame.len() as u32,
            });
            stream.bytes += charged;
        }
        drop(log);
        // Its entries are older than its start (their at_ms wrap below zero).
        stream.front_at_ms = stream.entries.front().map_or(0, |f| f.at_ms);
        history.total.set(history.total.get() + stream.bytes);
        let pids = stored
            .pids
            .into_iter()
            .take(MAX_PIDS)
            .map(|p| PidEntry {
                pid: p.pid,
                sid: p.sid,
                socket: None,
                // Written while connected (the write-ahead): away since this start.
                since: if p.away_ms == i64::MIN { now } else { instant_of(p.away_ms, now, now_ms) },
                epoch: p.epoch,
                start_seq: p.start_seq,
            })
            .collect();
        Self {
            stream: Some(stream),
            pids,
            lost_epoch: (stored.lost_epoch != 0).then_some(stored.lost_epoch),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(120);

    fn frame(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn take_after_gives_the_frames_back_and_the_seqs_go_on_from_there() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut s = SessionStream::new(total.clone(), t0);
        let mut trimmed = Trimmed::default();
        for n in 0..5 {
            s.push(&frame(&format!("f{n}")), t0, W, usize::MAX, &mut trimmed);
        }
        let (bytes, held) = (s.bytes(), total.held());
        assert_eq!(s.take_after(6), None, "past the head");
        let taken = s.take_after(3).expect("held");
        assert_eq!(taken, vec![frame("f3"), frame("f4")]);
        assert_eq!((s.head(), s.len()), (3, 3));
        assert_eq!(bytes - s.bytes(), 2 * (2 + ENTRY_OVERHEAD));
        assert_eq!(total.held(), held - 2 * (2 + ENTRY_OVERHEAD), "the core's total follows");
        assert_eq!(s.push(&frame("x"), t0, W, usize::MAX, &mut trimmed), 4);
        assert_eq!(s.after(3).unwrap(), vec![(frame("x"), 4)]);
        // A stream that lost the frames after the seq (trimmed) gives nothing.
        s.trim_to(0, TrimCause::CoreBound);
        assert_eq!(s.take_after(2), None);
        assert_eq!(s.take_after(4), Some(vec![]));
    }

    #[test]
    fn reasons_and_causes_are_named_as_the_metrics_name_them() {
        assert_eq!(
            Failure::ALL.map(Failure::as_str),
            crate::metrics::RECOVERY_FAILURES
        );
        assert_eq!(
            TrimCause::ALL.map(TrimCause::as_str),
            crate::metrics::RECOVERY_TRIMS
        );
        assert!(Failure::ALL.iter().enumerate().all(|(i, f)| f.index() == i));
    }

    #[test]
    fn offsets_encode_and_parse_and_nothing_else_parses() {
        let total = Rc::new(History::default());
        let s = SessionStream::with_epoch(0x3f9_a2b1, total, Instant::now());
        let text = s.offset(1_000_000);
        assert!(text.starts_with("h1."), "{text}");
        assert_eq!(parse_offset(&text), Some((0x3f9_a2b1, 1_000_000)));
        assert_eq!(
            parse_offset(&offset_text(s.prefix(), u64::MAX)),
            Some((0x3f9_a2b1, u64::MAX))
        );
        for bad in [
            "",
            "h1",
            "h1.1",
            "h1.1.",
            "h2.1.1",
            "h1.0.1",
            "h1.1.1.1",
            "h1.A.1",
            "h1.1.-1",
            "h1.zzzzzzzzzz.1",
            "h1.1.zzzzzzzzzzzzzz",
        ] {
            assert_eq!(parse_offset(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn base36_writes_every_number_as_from_str_radix_reads_it_with_its_suffix() {
        let mut n = 0u64;
        let check = |n: u64| {
            let b = Base36::new(n);
            assert_eq!(u64::from_str_radix(b.as_str(), 36), Ok(n), "{n}");
            assert!(!b.as_str().starts_with('0') || n == 0, "no leading zero: {n}");
            assert_eq!(b.as_str(), b.as_str().to_lowercase());
            let s = Base36::with_suffix(n, b"\"]");
            assert_eq!(s.as_bytes(), [b.as_bytes(), b"\"]"].concat().as_slice());
        };
        while n < 100_000 {
            check(n);
            n += 1;
        }
        for k in 1..13 {
            let p = 36u64.pow(k);
            for d in [p - 1, p, p + 1, p.saturating_mul(35).saturating_add(17)] {
                check(d);
            }
        }
        check(u64::MAX);
        assert_eq!(Base36::new(u64::MAX).as_str(), "3w5e11264sgsf");
        assert_eq!(Base36::with_suffix(35, b"\",").as_str(), "z\",");
    }

    #[test]
    fn offset_text_writes_the_lead_and_each_seq_as_base36_does_one_after_another() {
        let mut o = OffsetText::new(&[b",\"", b"h1.k3f."]).unwrap();
        let mut check = |n: u64, suffix: &[u8]| {
            let want = [b",\"h1.k3f.".as_slice(), Base36::new(n).as_bytes(), suffix].concat();
            let got = match suffix {
                b"" => o.with_seq(n, b"").to_vec(),
                b"\"]" => o.with_seq(n, b"\"]").to_vec(),
                _ => o.with_seq(n, b"\",").to_vec(),
            };
            assert_eq!(got, want, "{n}");
        };
        // Longer then shorter seqs in turn: nothing of an earlier one is left behind.
        for n in (0..100_000).chain([u64::MAX, 5]) {
            check(n, b"\"]");
            check(n, b"");
        }
        for k in 1..13 {
            let p = 36u64.pow(k);
            for d in [p - 1, p, p + 1, 1, p.saturating_mul(35).saturating_add(17)] {
                check(d, b"\",");
            }
        }
        let lead = "x".repeat(31);
        let mut o = OffsetText::new(&[lead.as_bytes(), b"."]).expect("32 bytes fit");
        assert_eq!(o.with_seq(u64::MAX, b"\"]"), format!("{lead}.3w5e11264sgsf\"]").as_bytes());
        assert!(OffsetText::new(&[lead.as_bytes(), b".."]).is_none(), "33 do not");
        assert!(OffsetText::new(&[&[b'x'; 49]]).is_none());
    }

    #[test]
    fn a_batch_clock_gives_each_entry_the_age_the_instant_arithmetic_gives() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let earlier = t0.checked_sub(Duration::from_millis(1500)).unwrap_or(t0);
        let mut s = SessionStream::new(total, earlier);
        let mut t = Trimmed::default();
        for ms in [0u64, 1, 999, 1000, 1001, 1499, 1500, 1501, 65_537, 3_600_000] {
            for ns in [0u64, 1, 999_999] {
                let now = t0 + Duration::from_millis(ms) + Duration::from_nanos(ns);
                s.push_clocked(&frame("x"), &PushClock::new(now, W), 1 << 20, &mut t);
                assert_eq!(s.entries.back().unwrap().at_ms, s.ms(now), "{ms} ms {ns} ns");
            }
        }
    }

    #[test]
    fn trim_to_cuts_whole_entries_from_the_front_in_one_go() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut s = SessionStream::new(total.clone(), t0);
        let mut t = Trimmed::default();
        for i in 0..10 {
            s.push(&frame(&"x".repeat(i + 1)), t0, W, 1 << 20, &mut t);
        }
        let held = s.bytes();
        assert_eq!(s.trim_to(held, TrimCause::CoreBound), 0, "nothing over: nothing cut");
        assert_eq!(s.first_seq(), 1);
        // One byte over cuts the first entry whole.
        let first = 1 + ENTRY_OVERHEAD;
        assert_eq!(s.trim_to(held - 1, TrimCause::CoreBound), first);
        assert_eq!((s.first_seq(), s.len(), s.bytes(), total.held()), (2, 9, held - first, held - first));
        assert_eq!(s.after(0).err(), Some(Failure::Bound));
        assert_eq!(s.trim_to(0, TrimCause::CoreBound), held - first);
        assert_eq!((s.first_seq(), s.len(), s.bytes(), total.held()), (11, 0, 0, 0));
        assert!(s.after(10).unwrap().is_empty(), "the head's offset still recovers (nothing)");
    }

    /// The core bound as the core holds it (app/recovery.rs `recovery_after_batch`): after each
    /// delivery batch, past `--recovery-core-bytes` the log's oldest frames are cut until what
    /// it counts is 7/8 of it, and every stream drops the entries naming them. Documented
    /// slack: during a batch the total may pass the bound by at most that batch's charged
    /// bytes; after it, never. The log's count is an upper bound of what the streams hold,
    /// and the cut runs about once per eighth of the bound pushed, not per batch.
    #[test]
    fn the_core_bound_is_passed_only_within_a_batch_and_cut_once_per_eighth_of_it() {
        const BOUND: usize = 64 * 1024;
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut streams: Vec<SessionStream> = (0..50).map(|_| SessionStream::new(total.clone(), t0)).collect();
        let mut t = Trimmed::default();
        let (mut cuts, mut pushed, mut rng) = (0, 0, fastrand::Rng::with_seed(7));
        for _ in 0..2_000 {
            let mut batch = 0;
            for _ in 0..rng.usize(1..40) {
                let f = frame(&"y".repeat(rng.usize(20..400)));
                // A fan-out: one frame to a few streams in a row (one log entry).
                for _ in 0..rng.usize(1..4) {
                    let i = if rng.bool() { rng.usize(..5) } else { rng.usize(..streams.len()) };
                    streams[i].push(&f, t0, W, if i == 7 { 2_000 } else { 1 << 20 }, &mut t);
                    batch += f.len() + ENTRY_OVERHEAD;
                    assert!(total.held() <= BOUND + batch, "within a batch: at most its bytes over");
                }
            }
            pushed += batch;
            assert!(total.held() <= total.counted(), "the log counts at least what the streams hold");
            if total.counted() > BOUND {
                cuts += 1;
                let target = BOUND - BOUND / 8;
                let first = total.cut(target);
                let freed: usize = streams.iter_mut().map(|s| s.drop_before(first, TrimCause::CoreBound)).sum();
                assert!(freed > 0);
                assert!(total.counted() <= target, "after a cut: the log at most 7/8 of the bound");
                assert!(total.held() <= target, "after a cut: the streams at most 7/8 of the bound");
            }
            assert!(total.held() <= BOUND, "after a batch: within the bound");
            assert_eq!(total.held(), streams.iter().map(SessionStream::bytes).sum::<usize>());
        }
        assert!(cuts >= 1);
        assert!(cuts <= pushed / (BOUND / 8) + 1, "{cuts} cuts for {pushed} bytes pushed");
    }

    /// Oldest first (the lead's decision, docs/design/recovery.md): the cut drops the log's
    /// oldest frames whichever streams name them; a stream whose entries after an offset all
    /// remain replays exactly, one that lost one fails `bound`, and a frame shared by several
    /// streams is one log entry, held once.
    #[test]
    fn the_core_cut_drops_the_oldest_frames_and_only_offsets_before_them_fail() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let (mut a, mut b) = (SessionStream::new(total.clone(), t0), SessionStream::new(total.clone(), t0));
        let mut t = Trimmed::default();
        let frames: Vec<Arc<str>> = (0..10).map(|i| frame(&format!("{i:010}"))).collect();
        for f in &frames {
            a.push(f, t0, W, 1 << 20, &mut t);
            b.push(f, t0, W, 1 << 20, &mut t);
        }
        let each = 10 + ENTRY_OVERHEAD;
        assert_eq!(total.log.borrow().frames.len(), 10, "a frame pushed to two streams in a row is logged once");
        assert_eq!((total.held(), total.counted()), (20 * each, 20 * each));
        // Keep the newest 6 frames' deliveries (12 entries): frames 0..4 go.
        let first = total.cut(12 * each);
        assert_eq!(first, 4);
        assert_eq!(a.after(5).unwrap().iter().map(|(f, s)| (f.to_string(), *s)).collect::<Vec<_>>(),
            (6..=10).map(|s| (format!("{:010}", s - 1), s)).collect::<Vec<_>>(),
            "after seq 5 (frame 4), before the stream's own sweep: frames 5..9 exactly");
        assert_eq!(a.after(3).err(), Some(Failure::Bound), "frame 3 (seq 4) was cut");
        assert_eq!(a.after(4).unwrap().len(), 6);
        assert_eq!(a.drop_before(first, TrimCause::CoreBound), 4 * each);
        assert_eq!((a.first_seq(), a.len()), (5, 6));
        assert_eq!(a.after(3).err(), Some(Failure::Bound));
        assert_eq!(a.after(4).unwrap().len(), 6);
        // `b` drops its own at the core's sweep (app/recovery.rs runs it right after every
        // cut): meanwhile it is counted, and a push tests only the window and the session
        // bound (it reads no front entry: docs/benchmarks/2026-11-28-recovery-cache-lines.md),
        // while a replay from before the cut still fails `bound`.
        assert_eq!(total.held(), 16 * each);
        b.push(&frame("0123456789"), t0, W, 1 << 20, &mut t);
        assert_eq!((b.first_seq(), b.len()), (1, 11));
        assert_eq!(b.after(3).err(), Some(Failure::Bound));
        assert_eq!(b.after(4).unwrap().len(), 7);
        b.trim_age(t0, W, &mut t);
        assert_eq!((b.first_seq(), b.len()), (5, 7));
        assert_eq!(t.0[TrimCause::CoreBound.index()], 4 * each);
        assert_eq!(total.held(), 13 * each);
        drop((a, b));
        assert_eq!(total.held(), 0);
    }

    /// The log ages on its own (a quiet core's frames go after the window, whatever its
    /// streams still name), and a stream's entry ages before its frame does: an offset
    /// before it fails `window`, not `bound`.
    #[test]
    fn the_log_ages_out_after_the_window_and_its_streams_fail_window_first() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let w = Duration::from_secs(2);
        let mut s = SessionStream::new(total.clone(), t0);
        let mut t = Trimmed::default();
        s.push(&frame("a"), t0, w, 1 << 20, &mut t);
        s.push(&frame("b"), t0 + Duration::from_secs(1), w, 1 << 20, &mut t);
        total.trim_age(t0 + Duration::from_millis(2500), w);
        assert_eq!(total.log.borrow().frames.len(), 1, "a went from the log");
        assert!(total.held() > total.counted(), "the quiet stream still holds a's entry");
        assert!(total.over(total.counted()), "the core cuts on what its streams hold too");
        s.trim_age(t0 + Duration::from_millis(2500), w, &mut t);
        assert_eq!(total.held(), total.counted());
        assert_eq!(s.first_seq(), 2);
        assert_eq!(s.after(0).err(), Some(Failure::Window));
        assert_eq!(t.0[TrimCause::Window.index()], 1 + ENTRY_OVERHEAD);
        assert_eq!(s.after(1).unwrap().len(), 1);
        total.trim_age(t0 + Duration::from_millis(3500), w);
        assert!(total.log.borrow().frames.is_empty());
        assert_eq!(total.counted(), 0);
    }

    #[test]
    fn seqs_count_up_and_after_gives_what_followed() {
        let total = Rc::new(History::default());
        let mut s = SessionStream::new(total.clone(), Instant::now());
        let mut t = Trimmed::default();
        let now = Instant::now();
        for i in 1..=5 {
            assert_eq!(s.push(&frame(&format!("f{i}")), now, W, 1 << 20, &mut t), i);
        }
        assert_eq!(s.head(), 5);
        let after: Vec<u64> = s.after(2).unwrap().iter().map(|(_, q)| *q).collect();
        assert_eq!(after, [3, 4, 5]);
        assert!(s.after(5).unwrap().is_empty());
        assert_eq!(s.after(0).unwrap().len(), 5);
        assert_eq!(s.after(6).err(), Some(Failure::UnknownOffset));
        assert_eq!(total.held(), s.bytes());
        assert_eq!(s.bytes(), 5 * (2 + ENTRY_OVERHEAD));
        drop(s);
        assert_eq!(total.held(), 0, "a dropped stream gives its bytes back");
    }

    #[test]
    fn the_session_bound_trims_the_front_and_an_offset_below_fails_bound() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut s = SessionStream::new(total.clone(), t0);
        let mut t = Trimmed::default();
        let each = 10 + ENTRY_OVERHEAD;
        for i in 0..10 {
            s.push(&frame(&format!("{i:010}")), t0, W, 4 * each, &mut t);
        }
        assert_eq!(s.len(), 4);
        assert_eq!(s.first_seq(), 7);
        assert_eq!(t.0[TrimCause::SessionBound.index()], 6 * each);
        assert_eq!(
            s.after(6).unwrap().len(),
            4,
            "the offset just before first_seq still recovers"
        );
        assert_eq!(s.after(5).err(), Some(Failure::Bound));
        assert_eq!(total.held(), 4 * each);
    }

    #[test]
    fn age_trims_entries_older_than_the_window_and_fails_window() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let w = Duration::from_secs(2);
        let mut s = SessionStream::new(total, t0);
        let mut t = Trimmed::default();
        s.push(&frame("a"), t0, w, 1 << 20, &mut t);
        s.push(&frame("b"), t0 + Duration::from_secs(1), w, 1 << 20, &mut t);
        s.push(
            &frame("c"),
            t0 + Duration::from_millis(2500),
            w,
            1 << 20,
            &mut t,
        );
        assert_eq!(s.first_seq(), 2, "a is older than the window at c");
        assert_eq!(s.after(0).err(), Some(Failure::Window));
        s.trim_age(t0 + Duration::from_millis(3100), w, &mut t);
        assert_eq!(s.first_seq(), 3);
        assert_eq!(t.0[TrimCause::Window.index()], 2 * (1 + ENTRY_OVERHEAD));
    }

    #[test]
    fn the_core_bound_trims_a_stream_to_a_size_and_counts_the_shared_total() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let (mut a, mut b) = (
            SessionStream::new(total.clone(), t0),
            SessionStream::new(total.clone(), t0),
        );
        let mut t = Trimmed::default();
        for i in 0..10 {
            a.push(&frame(&format!("{i:010}")), t0, W, 1 << 20, &mut t);
            b.push(&frame(&format!("{i:010}")), t0, W, 1 << 20, &mut t);
        }
        let each = 10 + ENTRY_OVERHEAD;
        assert_eq!(total.held(), 20 * each);
        assert_eq!(a.trim_to(3 * each, TrimCause::CoreBound), 7 * each);
        assert_eq!(total.held(), 13 * each);
        assert_eq!(a.first_seq(), 8);
        assert_eq!(a.after(1).err(), Some(Failure::Bound));
        assert_eq!(b.after(0).unwrap().len(), 10);
    }

    #[test]
    fn a_pid_restores_once_away_within_the_window_and_fails_after() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut r = SessionRecovery::default();
        r.stream_or_new(&total, t0);
        let (sid, pid) = r.issue(1, t0);
        let mut t = Trimmed::default();
        let stream = r.stream.as_mut().unwrap();
        for i in 0..3 {
            stream.push(&frame(&format!("f{i}")), t0, W, 1 << 20, &mut t);
        }
        let offset = stream.offset(1);
        assert!(r.left(1, t0));
        assert_eq!(r.stream_deadline(W), Some(t0 + W));
        let back = r
            .restore(&pid, Some(&offset), 2, t0 + Duration::from_secs(5), W)
            .ok()
            .unwrap();
        assert_eq!(back.sid, sid);
        assert_eq!(
            back.frames.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
            [2, 3]
        );
        assert_eq!(back.displaced, None);
        // No offset (no event reached the client): from where the pid began.
        assert!(r.left(2, t0));
        assert_eq!(
            r.restore(&pid, None, 3, t0, W).ok().unwrap().frames.len(),
            3
        );
        // Still connected elsewhere: that socket is displaced.
        assert_eq!(
            r.restore(&pid, None, 4, t0, W).ok().unwrap().displaced,
            Some(3)
        );
        assert!(r.left(4, t0));
        assert_eq!(
            r.restore(&pid, Some(&offset), 5, t0 + W + Duration::from_secs(1), W)
                .err(),
            Some(Failure::Window)
        );
        assert_eq!(
            r.restore(&pid, Some(&offset), 5, t0, W).err(),
            Some(Failure::UnknownPid),
            "a failed pid is forgotten"
        );
        assert_eq!(
            r.restore("nope", Some(&offset), 5, t0, W).err(),
            Some(Failure::UnknownPid)
        );
    }

    /// An adoption voided while a socket was connected on the adopter: the pids away fail
    /// `history_lost` (a hole may be before their offset), the connected socket's next
    /// restore from what it received after the void works, and nothing before the void is
    /// replayed to it.
    #[test]
    fn a_voided_history_fails_the_old_epoch_and_keeps_a_connected_socket_recoverable() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut r = SessionRecovery::default();
        r.stream_or_new(&total, t0);
        let (_, away) = r.issue(1, t0);
        let (_, here) = r.issue(2, t0);
        let mut t = Trimmed::default();
        for i in 0..3 {
            r.stream.as_mut().unwrap().push(&frame(&format!("f{i}")), t0, W, 1 << 20, &mut t);
        }
        let old = r.stream.as_ref().unwrap().offset(2);
        assert!(r.left(1, t0));
        let prefix = r.void_history(&total, t0);
        assert_eq!(total.held(), 0, "nothing held after the void");
        let stream = r.stream.as_mut().unwrap();
        assert_eq!(stream.prefix(), &prefix);
        assert_eq!(stream.head(), 3, "seqs go on");
        let seq = stream.push(&frame("live"), t0, W, 1 << 20, &mut t);
        let new = stream.offset(seq);
        assert_eq!(seq, 4);
        assert_eq!(r.restore(&away, Some(&old), 3, t0, W).err(), Some(Failure::HistoryLost));
        r.stream.as_mut().unwrap().push(&frame("after"), t0, W, 1 << 20, &mut t);
        assert!(r.left(2, t0));
        let back = r.restore(&here, Some(&new), 4, t0, W).ok().unwrap();
        assert_eq!(back.frames.iter().map(|(_, s)| *s).collect::<Vec<_>>(), [5]);
        // A frame queued before the void, written with the new epoch: never a replay across it.
        let stale = format!("{prefix}{}", 2);
        assert!(r.left(4, t0));
        assert_eq!(r.restore(&here, Some(&stale), 5, t0, W).err(), Some(Failure::Bound));
    }

    #[test]
    fn bad_offsets_and_lost_epochs_fail_with_their_reason() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut r = SessionRecovery::default();
        r.stream_or_new(&total, t0);
        let (_, pid) = r.issue(1, t0);
        r.left(1, t0);
        assert_eq!(
            r.restore(&pid, Some("x"), 2, t0, W).err(),
            Some(Failure::UnknownOffset)
        );
        let (_, pid) = r.issue(3, t0);
        r.left(3, t0);
        let other_epoch = offset_text(
            &format!(
                "h1.{}.",
                if r.stream.as_ref().unwrap().epoch() == 1 {
                    2
                } else {
                    1
                }
            ),
            0,
        );
        assert_eq!(
            r.restore(&pid, Some(&other_epoch), 4, t0, W).err(),
            Some(Failure::HistoryLost)
        );
    }

    #[test]
    fn a_plain_resume_names_its_stream_by_epoch_and_a_dropped_one_fails_window() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut r = SessionRecovery::default();
        let stream = r.stream_or_new(&total, t0);
        stream.push(&frame("a"), t0, W, 1 << 20, &mut Trimmed::default());
        stream.push(&frame("b"), t0, W, 1 << 20, &mut Trimmed::default());
        let offset = stream.offset(1);
        assert_eq!(r.resume(&offset).unwrap().len(), 1);
        assert_eq!(r.resume("h1.zz.1").err(), Some(Failure::HistoryLost));
        assert_eq!(r.resume("bad").err(), Some(Failure::UnknownOffset));
        r.issue(1, t0);
        r.left(1, t0);
        r.sweep(t0 + W, W);
        assert!(r.stream.is_none());
        r.stream_or_new(&total, t0 + W);
        assert_eq!(
            r.resume(&offset).err(),
            Some(Failure::Window),
            "an offset of the stream dropped for the window"
        );
    }

    #[test]
    fn the_stream_goes_a_window_after_the_last_pid_left_and_the_pids_stay_bounded() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut r = SessionRecovery::default();
        r.stream_or_new(&total, t0);
        r.stream
            .as_mut()
            .unwrap()
            .push(&frame("x"), t0, W, 1 << 20, &mut Trimmed::default());
        for outlet in 0..20 {
            r.issue(outlet, t0);
            r.left(outlet, t0 + Duration::from_secs(outlet));
        }
        assert_eq!(r.pids.len(), MAX_PIDS);
        assert_eq!(r.stream_deadline(W), Some(t0 + Duration::from_secs(19) + W));
        assert!(r.sweep(t0 + W, W).is_empty());
        assert!(r.stream.is_some());
        let t = r.sweep(t0 + Duration::from_secs(19) + W, W);
        assert_eq!(t.0[TrimCause::Window.index()], 1 + ENTRY_OVERHEAD);
        assert!(r.stream.is_none());
        assert_eq!(total.held(), 0);
    }

    #[test]
    fn a_stored_recovery_comes_back_with_its_epoch_seqs_frames_and_away_time() {
        let total = Rc::new(History::default());
        let t0 = Instant::now();
        let mut r = SessionRecovery::default();
        r.stream_or_new(&total, t0);
        let (sid, pid) = r.issue(1, t0);
        let mut t = Trimmed::default();
        let stream = r.stream.as_mut().unwrap();
        for i in 0..5 {
            stream.push(&frame(&format!("f{i}")), t0, W, 1 << 20, &mut t);
        }
        stream.trim_to(3 * (2 + ENTRY_OVERHEAD), TrimCause::SessionBound);
        let offset = stream.offset(3);
        let epoch = stream.epoch();
        r.left(1, t0);
        // Written 10 s after it left; read back by a process whose clock says 30 s later.
        let now_ms = 1_700_000_000_000;
        let stored = r.to_stored(t0 + Duration::from_secs(10), now_ms).unwrap();
        assert_eq!(stored.pids[0].away_ms, now_ms - 10_000);
        assert_eq!(
            stored.entries.iter().map(|e| e.0).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        drop(r);
        assert_eq!(total.held(), 0);
        let later = Instant::now();
        let mut back =
            SessionRecovery::from_stored(stored.clone(), total.clone(), later, now_ms + 20_000);
        assert_eq!(total.held(), 3 * (2 + ENTRY_OVERHEAD));
        assert_eq!(
            back.to_stored(later, now_ms + 20_000)
                .unwrap()
                .entries
                .len(),
            3
        );
        assert_eq!(back.stream.as_ref().unwrap().epoch(), epoch);
        assert_eq!(back.stream.as_ref().unwrap().head(), 5);
        assert_eq!(
            back.resume(&offset)
                .unwrap()
                .iter()
                .map(|(f, s)| (f.to_string(), *s))
                .collect::<Vec<_>>(),
            [("f3".to_string(), 4), ("f4".to_string(), 5)]
        );
        // Seq 1 was trimmed by the bound before the write: still `bound` after it.
        let before = offset_text(back.stream.as_ref().unwrap().prefix(), 1);
        assert_eq!(back.resume(&before).err(), Some(Failure::Bound));
        // Away 30 s: inside the window, the same sid comes back; 91 s later it is past it.
        let restored = back.restore(&pid, Some(&offset), 2, later, W).ok().unwrap();
        assert_eq!(restored.sid, sid);
        assert_eq!(restored.frames.len(), 2);
        let mut again =
            SessionRecovery::from_stored(stored, total.clone(), later, now_ms + 111_000);
        assert_eq!(
            again.restore(&pid, Some(&offset), 3, later, W).err(),
            Some(Failure::Window)
        );
        // The stream's entries aged past the window too.
        let mut t = Trimmed::default();
        again.stream.as_mut().unwrap().trim_age(later, W, &mut t);
        assert!(again.stream.as_ref().unwrap().is_empty());
    }
    #[test]
    fn a_stored_stream_with_a_gap_keeps_only_what_follows_it_and_seqs_stay_positions() {
        // An entry's seq is its position (`first_seq` + index): a stored stream hubcast never
        // writes, with a hole at 3, keeps 4..=5 only, cut as by the session bound.
        let total = Rc::new(History::default());
        let now = Instant::now();
        let now_ms = 1_700_000_000_000;
        let stored = StoredRecovery {
            epoch: 7,
            next_seq: 6,
            first_seq: 1,
            cut_by: 0,
            lost_epoch: 0,
            entries: [1, 2, 4, 5].iter().map(|s| (*s, now_ms, frame(&format!("f{s}")))).collect(),
            pids: Vec::new(),
        };
        let back = SessionRecovery::from_stored(stored.clone(), total.clone(), now, now_ms);
        let stream = back.stream.as_ref().unwrap();
        assert_eq!((stream.first_seq(), stream.head(), stream.len()), (4, 5, 2));
        assert_eq!(total.held(), 2 * (2 + ENTRY_OVERHEAD));
        let got: Vec<(String, u64)> = stream.after(3).unwrap().iter().map(|(f, s)| (f.to_string(), *s)).collect();
        assert_eq!(got, [("f4".to_string(), 4), ("f5".to_string(), 5)]);
        assert_eq!(stream.after(1).err(), Some(Failure::Bound));
        assert_eq!(back.to_stored(now, now_ms).unwrap().entries.iter().map(|e| e.0).collect::<Vec<_>>(), [4, 5]);
        // A stream whose last entry is not `next_seq - 1` keeps nothing: a replay from before
        // the end fails `bound` rather than miss what it cannot give.
        let short = StoredRecovery { next_seq: 8, ..stored };
        let back = SessionRecovery::from_stored(short, total.clone(), now, now_ms);
        let stream = back.stream.as_ref().unwrap();
        assert_eq!((stream.first_seq(), stream.head(), stream.len()), (8, 7, 0));
        assert_eq!(stream.after(5).err(), Some(Failure::Bound));
        drop(back);
    }
}
