//! Connection state recovery on a session's core (docs/design/recovery.md): pids for
//! Socket.IO sockets, the restore of a CONNECT with `{pid, offset}`, the streams' bounds and
//! their expiry. The stream and its rules are in `push/stream.rs`; this is where they meet
//! the session table, the clock and the metrics.
//!
//! Everything runs on the session's core, synchronously: a restore takes the frames after the
//! client's offset and attaches the socket in one step, so no live delivery can slip between
//! the replay and the queue (live frames get later seqs and wait behind the replay).
//!
//! Bounds: each stream by age and `--recovery-session-bytes` (push/stream.rs); all streams of
//! the core by `--recovery-core-bytes`, oldest first: when a delivery batch leaves the core's
//! log above it, the log's oldest frames go until it counts 7/8 of the bound and every stream
//! drops the entries naming them (so the sweep over streamed sessions runs once per eighth of
//! the bound, not per delivery). The log is borrowed once per delivery batch. A pid away
//! longer than the window has its stream dropped by the core's clock ([`Core::expire_recovery`]).
//!
//! Durable (`--recovery-durable` with a data dir, design step 7): the frames a delivery batch
//! appends and the count of deliveries taken in are committed at the end of the batch, before
//! any socket's writer runs ([`Core::recovery_taken_in`]); pids are committed as they change,
//! before a CONNECT answer carries one; a unit of work that posts deliveries commits how many
//! it posts to each core ([`Core::recovery_posting`]). At start `store::log::crash_rule`
//! compares the counts: a history that may lack a delivery posted before a crash is dropped.

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashSet;
use smallvec::SmallVec;

use crate::app::Core;
use crate::ids::SessionId;
use crate::push::outlet::{CloseReason, Outlet};
use crate::push::stitch::{Noted, TailFrame};
use crate::push::stream::{Failure, History, PushBatch, PushClock, SessionRecovery, StoredRecovery, TrimCause, Trimmed};
use crate::store::Change;

/// The shutdown writes the streams in commits of about this many bytes, apart from the state's
/// own commit (each session's record whole in one): a core's streams may exceed what one store
/// frame may hold (`store::format::MAX_FRAME`, 256 MiB, while `--recovery-core-bytes` may be
/// set higher), and a frame too long to be read back would lose its whole commit.
const STREAM_COMMIT_BYTES: usize = 4 << 20;

/// How often the core bound's trim is logged at `info` per core.
const BOUND_LOG_EVERY: Duration = Duration::from_secs(60);

/// A core's recovery settings and bookkeeping.
pub struct CoreRecovery {
    /// `None`: recovery is off (`--recovery-window 0`).
    pub window: Option<Duration>,
    pub session_bytes: usize,
    pub core_bytes: usize,
    /// The core's log of frames its streams name, and the charged bytes of every stream
    /// (kept by the streams themselves).
    pub history: Rc<History>,
    /// Sessions of this core that have a stream (what the core bound's trim looks at).
    pub(crate) streamed: RefCell<HashSet<SessionId>>,
    /// When a session's stream may go (its last pid left a window before); stale entries are
    /// skipped when they come up.
    pub(crate) deadlines: RefCell<BinaryHeap<Reverse<(Instant, SessionId)>>>,
    last_bound_log: Cell<Option<Instant>>,
    /// `--recovery-durable` with a store (set when the store is attached): the streams are
    /// written ahead (design step 7).
    pub durable: Cell<bool>,
    /// Deliveries this core has posted to each core (itself included), in all; committed
    /// before they leave (the crash rule, `store::log::crash_rule`).
    posted: RefCell<Vec<u64>>,
    /// Deliveries this core has taken in, in all; committed with their appends.
    received: Cell<u64>,
    /// Whether `received` moved since it was last committed.
    received_dirty: Cell<bool>,
    /// The frames the delivery batch being handed out appended (reused).
    appends: RefCell<crate::push::stream::AppendBatch>,
    /// SIGTERM, adoption (design step 6), on the instance that stops: the sessions whose
    /// histories were handed to another instance, with the head each had when written and
    /// the marks counted so far ([`Core::adoption_marked`]). Never written to the store again.
    handed: RefCell<hashbrown::HashMap<SessionId, Handed>>,
    /// On the adopting instance: the pids of histories taken in and not yet confirmed by the
    /// instance that handed them (a restore meanwhile fails `unknown_pid`).
    pub(crate) adopting: RefCell<hashbrown::HashMap<SessionId, SmallVec<[crate::push::stream::PidEntry; 2]>>>,
    /// CONNECTs waiting for a history asked of another instance (design step 6b), woken by
    /// the verdict or [`TAKE_WAIT`]; one per waiting socket (bounded by the connections).
    takers: RefCell<hashbrown::HashMap<SessionId, Vec<futures_channel::oneshot::Sender<()>>>>,
    /// With a relay (`--redis-url`) and a window: every offset carries its stream's device
    /// part ([`crate::push::cut`]), so another instance can rebuild it (design steps 10–11).
    /// Off on one instance: nothing to rebuild on, nothing paid.
    pub cuts: Cell<bool>,
    /// CONNECTs rebuilding a history from device rings here (design step 11, app/rebuild.rs):
    /// the session's deliveries meanwhile are held ([`Core::rebuild_hold`]). One per session
    /// at most, while its CONNECT waits (at most 2 s).
    pub(crate) rebuilding: RefCell<hashbrown::HashMap<SessionId, crate::app::rebuild::Held>>,
    /// While a hand-over runs, on either side (design step 6): the keys of each such
    /// session's frames since, for the stitch ([`crate::push::stitch`]); bounded per session
    /// by `stitch::MAX_KEYS`, one entry per session handed or adopting (bounded as those are).
    noted: RefCell<hashbrown::HashMap<SessionId, Noted>>,
    /// Whether `noted` has any: the one check a delivery pays.
    noting: Cell<bool>,
}

/// How long a CONNECT waits for its history to come from another instance (design step 6b:
/// three Redis round trips and the cores' marks) before it is answered without it.
const TAKE_WAIT: Duration = Duration::from_secs(2);

/// A history handed over at SIGTERM: its head when written, marks counted, verdict given.
struct Handed {
    head: u64,
    marks: Marks,
    decided: bool,
}

/// What a mark of a handed session stands for (design step 6, step 2 of the handshake): on
/// one Redis a device core of the session (the link hands one to each, behind the device
/// messages before the adopter's `watching`); on a Redis Cluster a device of the session
/// (one `SPUBLISH`ed on each device's own channel, cluster/adopt.rs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MarkOf {
    Core(usize),
    Device(Box<str>),
}

/// The marks of one handed session, each counted once: the verdict waits for one from every
/// core or device, so a mark that comes twice (a `watching` answered twice, a command the
/// redis crate sent again after a lost reply) must not stand for one still on its way behind
/// device messages the adopter lacks. At most as many as expected are kept (then decided).
#[derive(Debug, Default)]
struct Marks(hashbrown::HashSet<MarkOf>);

impl Marks {
    /// Counts `mark` (once, however often it comes); whether all `of` are in.
    fn mark(&mut self, mark: MarkOf, of: usize) -> bool {
        self.0.insert(mark);
        self.0.len() >= of
    }
}

impl CoreRecovery {
    pub fn new(settings: &crate::config::Settings) -> Self {
        let c = &settings.config;
        Self {
            window: settings.recovery_window(),
            session_bytes: c.recovery_session_bytes as usize,
            core_bytes: c.recovery_core_bytes as usize,
            history: Rc::default(),
            streamed: RefCell::default(),
            deadlines: RefCell::default(),
            last_bound_log: Cell::new(None),
            durable: Cell::new(false),
            posted: RefCell::new(vec![0; settings.cores]),
            received: Cell::new(0),
            received_dirty: Cell::new(false),
            appends: RefCell::default(),
            handed: RefCell::default(),
            adopting: RefCell::default(),
            takers: RefCell::default(),
            cuts: Cell::new(false),
            rebuilding: RefCell::default(),
            noted: RefCell::default(),
            noting: Cell::new(false),
        }
    }

    /// The earliest stream deadline (possibly stale).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.borrow().peek().map(|Reverse((at, _))| *at)
    }
}

/// A session's recovery state as the write-ahead commits it after a change of its pids.
pub(super) enum Written {
    Whole(Box<StoredRecovery>),
    Pids(Vec<crate::push::stream::StoredPid>),
}

/// What a Socket.IO CONNECT on a known session gets.
pub struct SocketIoAttached {
    /// The Socket.IO sid to answer (a recovered socket keeps its old one).
    pub sid: Box<str>,
    /// The pid to answer; `None` when recovery is off.
    pub pid: Option<Box<str>>,
    /// The pid the client sent is the one answered: `socket.recovered` is true.
    pub recovered: bool,
    /// The frames to replay after the CONNECT answer, in order, with their seqs.
    pub replay: Vec<(Arc<str>, u64)>,
}

/// What a plain WebSocket with `offsets=1` gets.
pub struct PlainAttached {
    /// With `since`: `{"recovered":true,"replayed":N}` or `{"recovered":false,"reason":…}`.
    pub first: Option<String>,
    /// The frames after `since`, in order, with their seqs.
    pub replay: Vec<(Arc<str>, u64)>,
}

impl Core {
    /// Attaches a Socket.IO socket to its session (on the session's core) with connection
    /// state recovery: a new pid, or the restore of `restore = (pid, offset)`. `None` for an
    /// unknown or expired session. `transport` indexes `metrics::TRANSPORTS`.
    pub fn attach_socketio(
        self: &Rc<Self>,
        session: SessionId,
        outlet: &Rc<Outlet>,
        restore: Option<(&str, Option<&str>)>,
        transport: usize,
    ) -> Option<SocketIoAttached> {
        let Some(window) = self.recovery.window else {
            if !self.attach_socket(session, outlet.clone()) {
                return None;
            }
            if restore.is_some() {
                self.recovery_failed(session, transport, Failure::Off);
            }
            return Some(SocketIoAttached {
                sid: crate::ids::random_token(15).into(),
                pid: None,
                recovered: false,
                replay: Vec::new(),
            });
        };
        let now = Instant::now();
        let mut aged = Trimmed::default();
        let written;
        let (attached, displaced, first) = {
            let mut sessions = self.sessions.borrow_mut();
            let record = sessions.touch(session, now)?;
            let recovery = record.recovery.get_or_insert_with(Default::default);
            let created = recovery.stream.is_none();
            if created {
                self.recovery.streamed.borrow_mut().insert(session);
            }
            let stream = recovery.stream_or_new(&self.recovery.history, now);
            stream.trim_age(now, window, &mut aged);
            let prefix = stream.prefix().clone();
            let restored = restore
                .map(|(pid, offset)| (pid, recovery.restore(pid, offset, outlet.id, now, window)));
            let (attached, displaced) = match restored {
                Some((pid, Ok(r))) => (
                    Ok(SocketIoAttached {
                        sid: r.sid,
                        pid: Some(pid.into()),
                        recovered: true,
                        replay: r.frames,
                    }),
                    r.displaced,
                ),
                failed_or_fresh => {
                    let (sid, pid) = recovery.issue(outlet.id, now);
                    let fresh = SocketIoAttached {
                        sid,
                        pid: Some(pid),
                        recovered: false,
                        replay: Vec::new(),
                    };
                    match failed_or_fresh {
                        Some((_, Err(failure))) => (Err((failure, fresh)), None),
                        _ => (Ok(fresh), None),
                    }
                }
            };
            written = self.durable_record(recovery, created, now);
            outlet.set_offsets(Some(prefix));
            outlet.set_parts_on(self.recovery.cuts.get());
            record.sockets.push(outlet.clone());
            record.had_socket = true;
            let displaced =
                displaced.and_then(|id| record.sockets.iter().find(|o| o.id == id).cloned());
            let first = (record.sockets.len() == 1)
                .then(|| record.devices.iter().map(Box::from).collect::<Vec<_>>());
            (attached, displaced, first)
        };
        self.count_trimmed(aged);
        // The pid is durable before the CONNECT answer carries it (design step 7b).
        self.recovery_write(session, written);
        if let Some(old) = displaced {
            old.close(CloseReason::new(1000, "replaced by a recovered connection"));
        }
        if let Some(devices) = first {
            self.presence(session, devices, true);
        }
        let attached = match attached {
            Ok(a) => {
                if restore.is_some() {
                    let m = &self.metrics;
                    m.recovery_attempts[transport].set(m.recovery_attempts[transport].get() + 1);
                    m.recovery_succeeded[transport].set(m.recovery_succeeded[transport].get() + 1);
                    m.recovery_replayed
                        .set(m.recovery_replayed.get() + a.replay.len() as u64);
                    tracing::debug!(session = %session, replayed = a.replay.len(), "connection recovered");
                }
                a
            }
            Err((failure, a)) => {
                self.recovery_failed(session, transport, failure);
                a
            }
        };
        Some(attached)
    }

    /// A CONNECT asked to recover on a session that is gone: `unknown_pid` (`off` when
    /// recovery is off).
    pub fn recovery_session_unknown(&self, transport: usize) {
        let failure = if self.recovery.window.is_some() {
            Failure::UnknownPid
        } else {
            Failure::Off
        };
        let m = &self.metrics;
        m.recovery_attempts[transport].set(m.recovery_attempts[transport].get() + 1);
        m.recovery_failed[failure.index()].set(m.recovery_failed[failure.index()].get() + 1);
        tracing::debug!(
            reason = failure.as_str(),
            "connection not recovered: unknown or expired session"
        );
    }

    /// Attaches a plain WebSocket opened with `offsets=1` (on the session's core): its envelopes
    /// carry offsets, and with `since` it first gets what followed that offset. It holds a pid
    /// the client never sees, so its session's stream lives while it is connected and a window
    /// after. `None` for an unknown or expired session.
    pub fn attach_plain_offsets(self: &Rc<Self>, session: SessionId, outlet: &Rc<Outlet>, since: Option<&str>) -> Option<PlainAttached> {
        let window = self.recovery.window?;
        // An adopted history still awaiting its verdict may yet be voided: nothing is resumed
        // from it (a Socket.IO socket's pids are held aside then; a plain one has none).
        let adopting = since.is_some() && self.recovery.adopting.borrow().contains_key(&session);
        let now = Instant::now();
        let mut aged = Trimmed::default();
        let written;
        let (resumed, first) = {
            let mut sessions = self.sessions.borrow_mut();
            let record = sessions.touch(session, now)?;
            let recovery = record.recovery.get_or_insert_with(Default::default);
            let created = recovery.stream.is_none();
            if created {
                self.recovery.streamed.borrow_mut().insert(session);
            }
            let stream = recovery.stream_or_new(&self.recovery.history, now);
            stream.trim_age(now, window, &mut aged);
            outlet.set_offsets(Some(stream.prefix().clone()));
            // The device part too, exactly when a Socket.IO socket gets it (design step 10).
            outlet.set_parts_on(self.recovery.cuts.get());
            let resumed = since.map(|offset| if adopting { Err(Failure::HistoryLost) } else { recovery.resume(offset) });
            recovery.issue(outlet.id, now);
            written = self.durable_record(recovery, created, now);
            record.sockets.push(outlet.clone());
            record.had_socket = true;
            let first = (record.sockets.len() == 1).then(|| record.devices.iter().map(Box::from).collect::<Vec<_>>());
            (resumed, first)
        };
        self.count_trimmed(aged);
        self.recovery_write(session, written);
        if let Some(devices) = first {
            self.presence(session, devices, true);
        }
        Some(match resumed {
            None => PlainAttached { first: None, replay: Vec::new() },
            Some(Ok(replay)) => {
                let m = &self.metrics;
                m.recovery_attempts[0].set(m.recovery_attempts[0].get() + 1);
                m.recovery_succeeded[0].set(m.recovery_succeeded[0].get() + 1);
                m.recovery_replayed.set(m.recovery_replayed.get() + replay.len() as u64);
                tracing::debug!(session = %session, replayed = replay.len(), "connection recovered");
                let first = serde_json::json!({"recovered": true, "replayed": replay.len()}).to_string();
                PlainAttached { first: Some(first), replay }
            }
            Some(Err(failure)) => {
                self.recovery_failed(session, 0, failure);
                let first = serde_json::json!({"recovered": false, "reason": failure.as_str()}).to_string();
                PlainAttached { first: Some(first), replay: Vec::new() }
            }
        })
    }

    fn recovery_failed(&self, session: SessionId, transport: usize, failure: Failure) {
        let m = &self.metrics;
        m.recovery_attempts[transport].set(m.recovery_attempts[transport].get() + 1);
        let i = failure.index();
        m.recovery_failed[i].set(m.recovery_failed[i].get() + 1);
        tracing::debug!(session = %session, reason = failure.as_str(), "connection not recovered");
    }

    /// A socket left its session (called with the table borrowed): its pid is away from now,
    /// and the stream's deadline is set.
    pub(crate) fn recovery_left(
        &self,
        record: &mut crate::shard::sessions::SessionRecord,
        session: SessionId,
        outlet_id: u64,
        now: Instant,
    ) {
        let (Some(window), Some(recovery)) = (self.recovery.window, record.recovery.as_deref_mut())
        else {
            return;
        };
        if recovery.left(outlet_id, now) {
            if let Some(at) = recovery.stream_deadline(window) {
                self.recovery
                    .deadlines
                    .borrow_mut()
                    .push(Reverse((at, session)));
            }
            // The table is borrowed: written straight to the store (no other change pends).
            if let Some(Written::Pids(pids)) = self.durable_record(recovery, false, now) {
                if let Some(store) = self.store.borrow_mut().as_mut() {
                    store.put(Change::StreamPids { id: session, pids: &pids });
                    store.commit();
                }
            }
        }
    }

    /// What the write-ahead keeps of a session's recovery state after a change of its pids
    /// (the whole stream when it was just `created`); `None` unless `--recovery-durable`.
    pub(super) fn durable_record(&self, recovery: &SessionRecovery, created: bool, now: Instant) -> Option<Written> {
        if !self.recovery.durable.get() {
            return None;
        }
        let now_ms = crate::timefmt::now_millis();
        Some(match recovery.to_stored_live(now, now_ms).filter(|_| created) {
            Some(whole) => Written::Whole(Box::new(whole)),
            None => Written::Pids(recovery.stored_pids(now, now_ms)),
        })
    }

    /// Commits a [`Core::durable_record`] (the session table not borrowed).
    pub(super) fn recovery_write(&self, session: SessionId, written: Option<Written>) {
        let Some(written) = written else { return };
        if let Some(store) = self.store.borrow_mut().as_mut() {
            match &written {
                Written::Whole(whole) => store.put(Change::Stream { id: session, recovery: Some(whole) }),
                Written::Pids(pids) => store.put(Change::StreamPids { id: session, pids }),
            }
            // A core that had no stream left its count of deliveries uncommitted.
            if self.recovery.received_dirty.take() {
                store.put(Change::Received { n: self.recovery.received.get() });
            }
        }
        self.persist(None);
    }

    /// Before a unit of work that posts `deliveries` is committed (`--recovery-durable`):
    /// adds to the unit how many it posts to each core in all, so they are committed before
    /// they leave (the crash rule: `store::log::crash_rule`).
    pub(crate) fn recovery_posting(&self, deliveries: &[crate::push::Delivery]) {
        if deliveries.is_empty() || !self.recovery.durable.get() {
            return;
        }
        let mut posted = self.recovery.posted.borrow_mut();
        let cores = posted.len();
        if cores == 1 {
            posted[0] += deliveries.len() as u64;
        } else {
            for d in deliveries {
                posted[crate::runtime::routing::core_of_session(d.session, cores)] += 1;
            }
        }
        let mut store = self.store.borrow_mut();
        let Some(store) = store.as_mut() else { return };
        if cores == 1 {
            store.put(Change::Posted { to: 0, n: posted[0] });
            return;
        }
        let mut seen = vec![false; cores];
        for d in deliveries {
            let to = crate::runtime::routing::core_of_session(d.session, cores);
            if !std::mem::replace(&mut seen[to], true) {
                store.put(Change::Posted { to, n: posted[to] });
            }
        }
    }

    /// At the end of a delivery batch of `n` deliveries (`--recovery-durable`): the frames it
    /// appended to streams and the count of deliveries taken in, committed before the
    /// writers run (they are tasks that run after this returns to the event loop).
    pub(crate) fn recovery_taken_in(&self, n: usize) {
        if !self.recovery.durable.get() {
            return;
        }
        let received = self.recovery.received.get() + n as u64;
        self.recovery.received.set(received);
        {
            let mut appends = self.recovery.appends.borrow_mut();
            if appends.is_empty() && self.recovery.streamed.borrow().is_empty() {
                // No history on this core: written with the next one's first record.
                self.recovery.received_dirty.set(true);
                return;
            }
            let mut store = self.store.borrow_mut();
            let Some(store) = store.as_mut() else { return };
            if !appends.is_empty() {
                appends.at_ms = crate::timefmt::now_millis();
                store.put(Change::StreamAppend(&appends));
                let frames: usize = appends.sessions.iter().map(|s| s.3.len()).sum();
                let m = &self.metrics.recovery_appended;
                m.set(m.get() + frames as u64);
                appends.clear();
            }
            store.put(Change::Received { n: received });
            self.recovery.received_dirty.set(false);
        }
        self.persist(None);
    }

    /// The snapshot's last slice (design step 7d): every stream whole (the logs it replaces
    /// hold their appends) and the delivery counts.
    pub(crate) fn recovery_snapshot(&self, put: &mut dyn FnMut(Change<'_>)) {
        for (to, n) in self.recovery.posted.borrow().iter().enumerate() {
            put(Change::Posted { to, n: *n });
        }
        put(Change::Received { n: self.recovery.received.get() });
        if !self.recovery.durable.get() {
            return;
        }
        let (now, now_ms) = (Instant::now(), crate::timefmt::now_millis());
        let sessions = self.sessions.borrow();
        for id in self.recovery.streamed.borrow().iter() {
            let stored = sessions.get(*id).and_then(|r| r.recovery.as_ref()).and_then(|r| r.to_stored_live(now, now_ms));
            if let Some(stored) = stored {
                put(Change::Stream { id: *id, recovery: Some(&stored) });
            }
        }
    }

    /// A polling socket became a WebSocket: its pid and offsets move with it.
    pub fn recovery_moved(&self, session: SessionId, old: &Outlet, new: &Outlet) {
        let mut sessions = self.sessions.borrow_mut();
        if let Some(recovery) = sessions
            .get_mut(session)
            .and_then(|r| r.recovery.as_deref_mut())
        {
            recovery.moved(old.id, new.id);
        }
        new.set_offsets(old.offsets());
        new.set_parts_on(old.parts_on());
    }

    /// The recovery step of a delivery to a session with a stream: its seq (0: no stream).
    /// `batch` is made once per delivery batch, at its first streamed delivery: the clock read
    /// and the core's log borrowed for all of the batch's pushes (dropped before
    /// [`Core::recovery_after_batch`]).
    #[inline]
    pub(crate) fn recovery_push<'a>(
        &'a self,
        session: SessionId,
        record: &mut crate::shard::sessions::SessionRecord,
        d: &crate::push::Delivery,
        batch: &mut Option<PushBatch<'a>>,
        trimmed: &mut Trimmed,
    ) -> (u64, Option<crate::push::cut::Cuts>) {
        let Some(stream) = record
            .recovery
            .as_deref_mut()
            .and_then(|r| r.stream.as_mut())
        else {
            return (0, None);
        };
        let batch = batch.get_or_insert_with(|| PushBatch {
            clock: PushClock::new(Instant::now(), self.recovery.window.unwrap_or_default()),
            log: self.recovery.history.log.borrow_mut(),
        });
        let frame = &d.frame;
        let seq = stream.push_at(frame, &batch.clock, &self.recovery.history, &mut batch.log, self.recovery.session_bytes, trimmed);
        if self.recovery.noting.get() {
            if let Some(noted) = self.recovery.noted.borrow_mut().get_mut(&session) {
                noted.note(&d.device, d.key);
            }
        }
        if self.recovery.durable.get() {
            self.recovery.appends.borrow_mut().add(session, stream.epoch(), seq, frame);
        }
        // The part's text only for a socket to write it (an away session's cut moves all the same).
        let part = match (self.recovery.cuts.get(), record.sockets.is_empty()) {
            (false, _) => None,
            (true, false) => Some(stream.cuts.note(&d.device, d.key)),
            (true, true) => {
                stream.cuts.note_only(&d.device, d.key);
                None
            }
        };
        (seq, part)
    }

    /// After a delivery batch (its log borrow dropped): count what was trimmed, age the log,
    /// and hold the core bound.
    pub(crate) fn recovery_after_batch(&self, trimmed: Trimmed, now: Instant) {
        self.count_trimmed(trimmed);
        if let Some(window) = self.recovery.window {
            self.recovery.history.trim_age(now, window);
        }
        if self.recovery.history.over(self.recovery.core_bytes) {
            self.trim_to_core_bound();
        }
    }

    fn count_trimmed(&self, trimmed: Trimmed) {
        if trimmed.is_empty() {
            return;
        }
        for cause in TrimCause::ALL {
            let c = &self.metrics.recovery_trimmed[cause.index()];
            c.set(c.get() + trimmed.0[cause.index()] as u64);
        }
    }

    /// Holds the core bound, oldest first: the log's oldest frames go until what it counts is
    /// 7/8 of `--recovery-core-bytes` (so the sweep over streamed sessions runs once per
    /// eighth of the bound, not per delivery), then every stream drops its entries naming
    /// them. A client whose missed frames went gets `bound`; one away for less than the
    /// history's horizon recovers (push/stream.rs [`History::cut`]).
    fn trim_to_core_bound(&self) {
        let bound = self.recovery.core_bytes;
        let target = bound - bound / 8;
        let before = self.recovery.history.held();
        self.recovery.history.cut(target);
        let now = Instant::now();
        let window = self.recovery.window.unwrap_or_default();
        let mut trimmed = Trimmed::default();
        let mut sessions = self.sessions.borrow_mut();
        // Each stream ages (entries past the window: `window`) and drops its entries whose
        // frames the log no longer holds (`core_bound`), so what they hold is within what the
        // log counts again.
        self.recovery.streamed.borrow_mut().retain(|id| {
            match sessions.get_mut(*id).and_then(|r| r.recovery.as_deref_mut()).and_then(|r| r.stream.as_mut()) {
                Some(stream) => {
                    stream.trim_age(now, window, &mut trimmed);
                    true
                }
                None => false,
            }
        });
        drop(sessions);
        self.count_trimmed(trimmed);
        if self
            .recovery
            .last_bound_log
            .get()
            .is_none_or(|at| now.duration_since(at) >= BOUND_LOG_EVERY)
        {
            self.recovery.last_bound_log.set(Some(now));
            tracing::info!(
                core = self.index,
                before,
                after = self.recovery.history.held(),
                bound,
                "recovery history over its core bound: the oldest trimmed"
            );
        }
    }

    /// The core's clock: drops the streams whose pids have all been away past the window,
    /// and ages the others that come due.
    pub(crate) fn expire_recovery(self: &Rc<Self>, now: Instant) {
        let Some(window) = self.recovery.window else {
            return;
        };
        self.recovery.history.trim_age(now, window);
        let mut trimmed = Trimmed::default();
        loop {
            let due = {
                let mut deadlines = self.recovery.deadlines.borrow_mut();
                match deadlines.peek() {
                    Some(Reverse((at, _))) if *at <= now => {
                        deadlines.pop().map(|Reverse((_, id))| id)
                    }
                    _ => None,
                }
            };
            let Some(id) = due else { break };
            let mut sessions = self.sessions.borrow_mut();
            let Some(record) = sessions.get_mut(id) else { continue };
            let Some(recovery) = record.recovery.as_deref_mut() else { continue };
            let t = recovery.sweep(now, window);
            for (all, part) in trimmed.0.iter_mut().zip(t.0) {
                *all += part;
            }
            let mut unwatch = None;
            if recovery.stream.is_none() {
                self.recovery.streamed.borrow_mut().remove(&id);
                if self.recovery.durable.get() {
                    if let Some(store) = self.store.borrow_mut().as_mut() {
                        store.put(Change::Stream { id, recovery: None });
                        store.commit();
                    }
                }
                // Its devices stayed watched for it (Core::detach_socket): no longer.
                if record.sockets.is_empty() {
                    unwatch = Some(record.devices.iter().map(Box::from).collect::<Vec<_>>());
                }
            } else if let Some(at) = recovery.stream_deadline(window) {
                self.recovery.deadlines.borrow_mut().push(Reverse((at, id)));
            }
            drop(sessions);
            if let Some(devices) = unwatch {
                self.presence(id, devices, false);
            }
        }
        self.count_trimmed(trimmed);
    }

    /// Graceful shutdown, before the final commit (its sockets said goodbye, so every pid is
    /// away): each stream of this core and its pids go into that commit (design step 5).
    /// Returns how many.
    pub(crate) fn persist_recovery(&self) -> usize {
        if self.recovery.window.is_none() {
            return 0;
        }
        // The state's last changes first, in a commit of their own.
        self.persist(None);
        let mut store = self.store.borrow_mut();
        let Some(store) = store.as_mut() else { return 0 };
        let (now, now_ms) = (Instant::now(), crate::timefmt::now_millis());
        let sessions = self.sessions.borrow();
        let mut written = 0;
        let mut pending = 0;
        let handed = self.recovery.handed.borrow();
        for id in self.recovery.streamed.borrow().iter() {
            if handed.contains_key(id) {
                // Another instance holds it now (adoption): a restart here must not find a
                // copy that stopped growing when it was handed over.
                if self.recovery.durable.get() {
                    store.put(Change::Stream { id: *id, recovery: None });
                }
                continue;
            }
            let stored = sessions
                .get(*id)
                .and_then(|r| r.recovery.as_ref())
                .and_then(|r| r.to_stored(now, now_ms));
            if let Some(stored) = stored {
                let bytes = stored.encoded_bytes_at_most();
                if bytes > crate::store::format::MAX_FRAME / 2 {
                    tracing::warn!(core = self.index, session = %id, bytes, "a recovery stream too large for one store frame is not written (--recovery-session-bytes): its clients will not recover after the restart");
                    continue;
                }
                pending += bytes;
                store.put(Change::Stream { id: *id, recovery: Some(&stored) });
                written += 1;
                if pending > STREAM_COMMIT_BYTES {
                    store.commit();
                    pending = 0;
                }
            }
        }
        store.commit();
        written
    }

    /// Start: the streams the store kept (written by the last graceful shutdown, or ahead
    /// while running with `--recovery-durable`) come back with their sessions, each pid away
    /// since it left (the time down counts against the window; one connected at a crash, since
    /// this start). With `--recovery-durable` each kept stream is written whole again, the base
    /// its appends of this run follow; without, each is marked gone in the store at once: from
    /// here on the stream grows in memory only, so a later crash must find no stream rather
    /// than this stale one (a client would be replayed frames that are not what followed its
    /// offset). A stream of a session that is gone, or any stream when recovery is now off, is
    /// dropped. The delivery counts continue from the stored ones (`reset`: the crash rule
    /// changed this core's, committed again).
    pub(crate) fn restore_recovery(
        &self,
        streams: hashbrown::HashMap<SessionId, StoredRecovery>,
        posted: &hashbrown::HashMap<u32, u64>,
        received: u64,
        reset: Option<u64>,
    ) {
        {
            let mut mine = self.recovery.posted.borrow_mut();
            for (to, n) in posted {
                if let Some(p) = mine.get_mut(*to as usize) {
                    *p = *n;
                }
            }
        }
        // The crash rule made it equal to what was posted here (store::log::crash_rule).
        self.recovery.received.set(received);
        if let (Some(n), Some(store)) = (reset, self.store.borrow_mut().as_mut()) {
            store.put(Change::Received { n });
            store.commit();
        }
        if streams.is_empty() {
            return;
        }
        let (now, now_ms) = (Instant::now(), crate::timefmt::now_millis());
        let mut restored = 0;
        if let Some(window) = self.recovery.window {
            let mut sessions = self.sessions.borrow_mut();
            let mut trimmed = Trimmed::default();
            for (id, stored) in &streams {
                let Some(record) = sessions.get_mut(*id) else { continue };
                let mut recovery = SessionRecovery::from_stored(stored.clone(), self.recovery.history.clone(), now, now_ms);
                let t = recovery.sweep(now, window);
                for (all, part) in trimmed.0.iter_mut().zip(t.0) {
                    *all += part;
                }
                match recovery.stream_deadline(window) {
                    Some(at) => {
                        self.recovery.deadlines.borrow_mut().push(Reverse((at, *id)));
                        self.recovery.streamed.borrow_mut().insert(*id);
                        restored += 1;
                    }
                    // No pid to come back with it.
                    None => recovery.stream = None,
                }
                record.recovery = Some(Box::new(recovery));
            }
            drop(sessions);
            self.count_trimmed(trimmed);
            if self.recovery.history.over(self.recovery.core_bytes) {
                self.trim_to_core_bound();
            }
        }
        if let Some(store) = self.store.borrow_mut().as_mut() {
            let durable = self.recovery.durable.get();
            let (sessions, streamed) = (self.sessions.borrow(), self.recovery.streamed.borrow());
            let mut pending = 0;
            for id in streams.keys() {
                // Durable: each stream kept is written whole again, the base its appends
                // follow in this run (with the epoch the crash rule may have changed).
                let kept = sessions.get(*id).and_then(|r| r.recovery.as_ref()).filter(|_| durable && streamed.contains(id)).and_then(|r| r.to_stored_live(now, now_ms));
                match kept {
                    Some(whole) => {
                        pending += whole.encoded_bytes_at_most();
                        store.put(Change::Stream { id: *id, recovery: Some(&whole) });
                    }
                    None => store.put(Change::Stream { id: *id, recovery: None }),
                }
                if pending > STREAM_COMMIT_BYTES {
                    store.commit();
                    pending = 0;
                }
            }
            store.commit();
        }
        tracing::info!(core = self.index, read = streams.len(), restored, "recovery streams read back from the last graceful shutdown");
    }

    /// Scale-out, once the plugins started (the relay is set): the sessions whose streams came
    /// back from the store and have no socket yet watch their devices, as an away session does
    /// (Core::detach_socket), so what other instances take in before the client is back
    /// reaches the stream.
    pub(crate) fn watch_restored_streams(self: &Rc<Self>) {
        if self.relay.borrow().is_none() {
            return;
        }
        let away: Vec<(SessionId, Vec<Box<str>>)> = {
            let sessions = self.sessions.borrow();
            self.recovery
                .streamed
                .borrow()
                .iter()
                .filter_map(|id| {
                    let record = sessions.get(*id).filter(|r| r.sockets.is_empty())?;
                    Some((*id, record.devices.iter().map(Box::from).collect()))
                })
                .collect()
        };
        for (id, devices) in away {
            self.presence(id, devices, true);
        }
    }

    /// SIGTERM with a relay and `--recovery-handoff` (design step 6, adoption), after the
    /// goodbyes (every pid away) and before the flush: each stream of this core is handed to
    /// another live instance ([`Relay::adopt`](crate::app::relay::Relay::adopt)), as the
    /// store's `Change::Stream` record. The stream stays here until the process ends, still
    /// taking deliveries: whether one arrived after it was written decides whether the
    /// adopter may keep the history ([`Core::adoption_marked`]). Returns (handed, kept here).
    pub(crate) fn hand_off_streams(&self) -> (usize, usize) {
        let Some(window) = self.recovery.window else { return (0, 0) };
        if !self.settings.recovery_handoff() {
            return (0, 0);
        }
        if self.relay.borrow().is_none() {
            return (0, 0);
        }
        let ids: Vec<SessionId> = self.recovery.streamed.borrow().iter().copied().collect();
        let (mut handed, mut kept) = (0, 0);
        for id in ids {
            match self.hand_off(id, window, None) {
                Some(true) => handed += 1,
                Some(false) => kept += 1,
                None => {}
            }
        }
        (handed, kept)
    }

    /// One history handed to `to` (or the adopter the link picks): `None` when there is none
    /// to hand (a socket connected, no pid within the window, already handed or adopting).
    fn hand_off(&self, id: SessionId, window: Duration, to: Option<&str>) -> Option<bool> {
        let relay = self.relay.borrow().clone()?;
        if self.recovery.handed.borrow().contains_key(&id) || self.recovery.adopting.borrow().contains_key(&id) {
            return None;
        }
        let (now, now_ms) = (Instant::now(), crate::timefmt::now_millis());
        // At a stop every socket was told goodbye. A polling socket whose long poll was cut
        // has none to carry it and stays until its ping timeout, so its pid is away from
        // here: its client is not coming back to this instance.
        let stopping = to.is_none() && crate::shutdown::STOPPING.is_stopping();
        if stopping {
            let mut sessions = self.sessions.borrow_mut();
            if let Some(record) = sessions.get_mut(id).filter(|r| !r.sockets.is_empty() && r.sockets.iter().all(|o| o.is_closing())) {
                let outlets: Vec<u64> = record.sockets.iter().map(|o| o.id).collect();
                if let Some(recovery) = record.recovery.as_deref_mut() {
                    for outlet in outlets {
                        recovery.left(outlet, now);
                    }
                }
            }
        }
        let (stored, devices, left, head) = {
            let sessions = self.sessions.borrow();
            sessions.get(id).filter(|r| r.sockets.is_empty() || (stopping && r.sockets.iter().all(|o| o.is_closing()))).and_then(|record| {
                let recovery = record.recovery.as_ref()?;
                let left = recovery.stream_deadline(window)?.saturating_duration_since(now);
                let stored = recovery.to_stored(now, now_ms).filter(|_| !left.is_zero())?;
                let head = recovery.stream.as_ref().map_or(0, |s| s.head());
                Some((stored, record.devices.iter().map(Box::from).collect::<Vec<_>>(), left, head))
            })?
        };
        let mut blob = Vec::with_capacity(stored.encoded_bytes_at_most() + 32);
        crate::store::format::encode(&mut blob, Change::Stream { id, recovery: Some(&stored) });
        if !relay.adopt(id, devices, blob, left, to) {
            return Some(false);
        }
        self.recovery.handed.borrow_mut().insert(id, Handed { head, marks: Marks::default(), decided: false });
        self.note_from(id, head);
        // Its pids are the adopter's now: a client back here must not restore from this copy.
        if let Some(recovery) = self.sessions.borrow_mut().get_mut(id).and_then(|r| r.recovery.as_deref_mut()) {
            recovery.pids.clear();
        }
        Some(true)
    }

    /// Design step 6b: instance `to` asks for `session`'s history (its client came back
    /// there); handed over as at a SIGTERM, or none (the answer lets its CONNECT go on).
    pub fn give_stream(self: &Rc<Self>, session: SessionId, to: &str) {
        let given = self.recovery.window.and_then(|window| self.hand_off(session, window, Some(to)));
        if given != Some(true) {
            if let Some(relay) = self.relay.borrow().clone() {
                relay.give_none(session, to);
            }
            return;
        }
        // No verdict ever (the asker gone): the copy kept for the check goes all the same.
        let me = self.clone();
        monoio::spawn(async move {
            monoio::time::sleep(TAKE_WAIT * 4).await;
            if me.recovery.handed.borrow().contains_key(&session) {
                me.drop_handed(session);
            }
        });
    }

    /// Design step 6b, on the session's core: whether a CONNECT restoring `pid` should first
    /// ask another instance for the session's history (the pid is unknown here, and recovery
    /// and a relay are on).
    pub fn recovery_elsewhere(&self, session: SessionId, pid: &str) -> bool {
        if self.recovery.window.is_none() || self.relay.borrow().is_none() {
            return false;
        }
        if self.recovery.adopting.borrow().contains_key(&session) {
            return true;
        }
        let sessions = self.sessions.borrow();
        let known = sessions.get(session).and_then(|r| r.recovery.as_ref()).is_some_and(|r| r.pids.iter().any(|p| &*p.pid == pid));
        !known
    }

    /// Design steps 6b and 11 for a plain WebSocket's `since=` (it has no pid: its stream is
    /// found by the offset's epoch): whether the history should first be asked of the
    /// instance holding it, then rebuilt from the device rings. True when recovery and a
    /// relay are on and the session has no stream here (or one being adopted, whose verdict
    /// is awaited). A stream of another epoch here is never replaced: `history_lost` at once.
    pub fn since_elsewhere(&self, session: SessionId) -> bool {
        if self.recovery.window.is_none() || self.relay.borrow().is_none() {
            return false;
        }
        if self.recovery.adopting.borrow().contains_key(&session) {
            return true;
        }
        let sessions = self.sessions.borrow();
        sessions.get(session).is_some_and(|r| r.recovery.as_ref().and_then(|r| r.stream.as_ref()).is_none())
    }

    /// Design step 6b: asks for `session`'s history and waits (at most [`TAKE_WAIT`]) until
    /// it is adopted here, or the answer is that there is none.
    pub async fn take_stream(self: &Rc<Self>, session: SessionId) {
        let (tx, rx) = futures_channel::oneshot::channel();
        let first = {
            let mut takers = self.recovery.takers.borrow_mut();
            let waiting = takers.entry(session).or_default();
            waiting.push(tx);
            waiting.len() == 1
        };
        if first && !self.recovery.adopting.borrow().contains_key(&session) {
            if let Some(relay) = self.relay.borrow().clone() {
                relay.take(session);
            }
        }
        if monoio::time::timeout(TAKE_WAIT, rx).await.is_err() {
            self.recovery.takers.borrow_mut().remove(&session);
            tracing::debug!(session = %session, "no history came from another instance in time");
        }
    }

    /// The CONNECTs waiting for `session`'s history go on.
    pub fn recovery_take_done(&self, session: SessionId) {
        if let Some(waiting) = self.recovery.takers.borrow_mut().remove(&session) {
            for w in waiting {
                let _ = w.send(());
            }
        }
    }

    /// On the instance that stops: one of the `of` marks of a handed session came (each
    /// device core of the session posts one, on a cluster one per device, once it has
    /// delivered every message the adopter did not receive itself). With all of them, each
    /// counted once ([`MarkOf`]), the verdict: kept when the history here did not grow after
    /// it was written (the adopter has everything), else voided.
    pub fn adoption_marked(self: &Rc<Self>, session: SessionId, mark: MarkOf, of: usize) {
        let mut handed = self.recovery.handed.borrow_mut();
        let Some(h) = handed.get_mut(&session).filter(|h| !h.decided) else { return };
        if !h.marks.mark(mark, of) {
            return;
        }
        h.decided = true;
        let head = h.head;
        drop(handed);
        let noted = self.unnote(session);
        let now_head = self.sessions.borrow().get(session).and_then(|r| r.recovery.as_ref()).and_then(|r| r.stream.as_ref()).map(|s| s.head());
        let kept = now_head == Some(head);
        let tail = if kept { None } else { self.tail_of(session, head, noted) };
        match &tail {
            Some((_, n)) => tracing::info!(session = %session, frames = n, "deliveries reached the history after it was handed over: sent to the adopter, which stitches in what it lacks"),
            None if !kept => tracing::info!(session = %session, "a delivery reached the history after it was handed over and cannot be stitched (a frame without a key, or past the bounds): the adopter drops it (its client gets recovered false)"),
            None => {}
        }
        if let Some(relay) = self.relay.borrow().clone() {
            relay.adopt_verdict(session, kept, tail.map(|(blob, _)| blob));
        }
        self.drop_handed(session);
    }

    /// A history handed over is gone from here (the adopter holds it, or nobody), and from
    /// the store; an away session stops watching its devices for it.
    fn drop_handed(self: &Rc<Self>, session: SessionId) {
        self.recovery.handed.borrow_mut().remove(&session);
        self.unnote(session);
        let unwatch = {
            let mut sessions = self.sessions.borrow_mut();
            let Some(record) = sessions.get_mut(session) else { return };
            if let Some(recovery) = record.recovery.as_deref_mut() {
                recovery.stream = None;
            }
            self.recovery.streamed.borrow_mut().remove(&session);
            record.sockets.is_empty().then(|| record.devices.iter().map(Box::from).collect::<Vec<_>>())
        };
        if self.recovery.durable.get() {
            if let Some(store) = self.store.borrow_mut().as_mut() {
                store.put(Change::Stream { id: session, recovery: None });
                store.commit();
            }
        }
        if let Some(devices) = unwatch {
            self.presence(session, devices, false);
        }
    }

    /// On the adopting instance (design step 6): the history another instance handed over
    /// at its SIGTERM, for `session` (loaded here first). Its pids are held aside until the
    /// verdict ([`Core::adoption_verdict`]); the stream takes deliveries from now on, and the
    /// session watches its devices at once (as an away session does), so what others take
    /// in meanwhile lands in it. `Err` says why it is not taken.
    pub fn adopt_stream(self: &Rc<Self>, session: SessionId, stored: StoredRecovery) -> Result<(), &'static str> {
        let window = self.recovery.window.ok_or("recovery is off here")?;
        let (now, now_ms) = (Instant::now(), crate::timefmt::now_millis());
        let (devices, trimmed, written) = {
            let mut sessions = self.sessions.borrow_mut();
            let record = sessions.touch(session, now).ok_or("no such session here")?;
            if record.recovery.as_ref().is_some_and(|r| r.stream.is_some()) {
                return Err("the session has a history here already");
            }
            let mut recovery = SessionRecovery::from_stored(stored, self.recovery.history.clone(), now, now_ms);
            let trimmed = recovery.sweep(now, window);
            if recovery.stream.is_none() {
                self.count_trimmed(trimmed);
                return Err("past the window");
            }
            let pids = std::mem::take(&mut recovery.pids);
            self.note_from(session, recovery.stream.as_ref().map_or(0, |s| s.head()));
            let written = self.durable_record(&recovery, true, now);
            record.recovery = Some(Box::new(recovery));
            self.recovery.streamed.borrow_mut().insert(session);
            self.recovery.adopting.borrow_mut().insert(session, pids);
            (record.devices.iter().map(Box::from).collect::<Vec<_>>(), trimmed, written)
        };
        self.count_trimmed(trimmed);
        self.recovery_write(session, written);
        if self.recovery.history.over(self.recovery.core_bytes) {
            self.trim_to_core_bound();
        }
        if self.sessions.borrow().get(session).is_some_and(|r| r.sockets.is_empty()) {
            self.presence(session, devices, true);
        }
        Ok(())
    }

    /// On the adopting instance: the verdict of the instance that handed `session`'s history
    /// over (or none in time: `kept` false). Kept: its pids are valid here from now on.
    /// Voided: the history gets a new epoch with nothing in it, so every offset of the old
    /// one fails `history_lost` (a frame may be missing) and nothing is claimed that cannot be
    /// replayed. False when no adoption of it was pending.
    pub fn adoption_verdict(&self, session: SessionId, kept: bool, tail: Option<&[u8]>) -> Option<Verdict> {
        let woken = self.recovery.takers.borrow().contains_key(&session);
        let applied = self.apply_verdict(session, kept, tail);
        if woken {
            self.recovery_take_done(session);
        }
        applied
    }

    fn apply_verdict(&self, session: SessionId, kept: bool, tail: Option<&[u8]>) -> Option<Verdict> {
        let noted = self.unnote(session);
        let pids = self.recovery.adopting.borrow_mut().remove(&session)?;
        let window = self.recovery.window?;
        let now = Instant::now();
        let (written, verdict) = {
            let mut sessions = self.sessions.borrow_mut();
            let record = sessions.get_mut(session)?;
            let sockets = record.sockets.len();
            let recovery = record.recovery.as_deref_mut()?;
            let verdict = match tail {
                _ if kept => Verdict::Kept,
                None => Verdict::Voided,
                // A socket attached meanwhile has seen this instance's seqs: they stay.
                Some(_) if sockets > 0 => Verdict::Voided,
                Some(tail) => {
                    let mut trimmed = Trimmed::default();
                    let clock = PushClock::new(now, window);
                    let stitched = stitch_in(recovery, noted, tail, &clock, self.recovery.session_bytes, &mut trimmed);
                    self.count_trimmed(trimmed);
                    match stitched {
                        Ok(n) => {
                            tracing::info!(session = %session, frames = n, "frames the stopping instance took in after the hand-over stitched into the adopted history");
                            Verdict::Stitched
                        }
                        Err(why) => {
                            tracing::info!(session = %session, reason = why, "the stopping instance's frames after the hand-over cannot be stitched: voided (its client gets recovered false)");
                            Verdict::Voided
                        }
                    }
                }
            };
            if verdict == Verdict::Voided {
                // A socket may have attached while the verdict was awaited (its CONNECT waited
                // at most TAKE_WAIT, then got a new pid on this stream): its outlet writes the
                // new epoch from now on, or its next restore would fail `history_lost`.
                let prefix = recovery.void_history(&self.recovery.history, now);
                for outlet in record.sockets.iter().filter(|o| o.offsets().is_some()) {
                    outlet.set_offsets(Some(prefix.clone()));
                }
            }
            for pid in pids {
                if !recovery.pids.iter().any(|p| p.pid == pid.pid) {
                    recovery.pids.push(pid);
                }
            }
            if let Some(at) = recovery.stream_deadline(window) {
                self.recovery.deadlines.borrow_mut().push(Reverse((at, session)));
            }
            (self.durable_record(recovery, verdict != Verdict::Kept, now), verdict)
        };
        self.recovery_write(session, written);
        if self.recovery.history.over(self.recovery.core_bytes) {
            self.trim_to_core_bound();
        }
        // Its deadline may be the core's earliest now.
        self.arm_clock();
        Some(verdict)
    }

    /// A hand-over of `session` began at its stream's `head`: its frames' keys are noted.
    fn note_from(&self, session: SessionId, head: u64) {
        self.recovery.noted.borrow_mut().insert(session, Noted::new(head));
        self.recovery.noting.set(true);
    }

    fn unnote(&self, session: SessionId) -> Option<Noted> {
        let mut noted = self.recovery.noted.borrow_mut();
        let gone = noted.remove(&session);
        self.recovery.noting.set(!noted.is_empty());
        gone
    }

    /// On the stopping instance: the frames `session`'s history took in after it was handed
    /// over at `head`, with their keys, encoded for the adopter and how many; `None` when
    /// they cannot be stitched (one without a key, too many, not all held, or past the
    /// history's own bound).
    fn tail_of(&self, session: SessionId, head: u64, noted: Option<Noted>) -> Option<(Vec<u8>, usize)> {
        let noted = noted.filter(|n| !n.spoilt && n.head == head)?;
        let frames = {
            let sessions = self.sessions.borrow();
            sessions.get(session)?.recovery.as_ref()?.stream.as_ref()?.after(head).ok()?
        };
        if frames.len() != noted.keys.len() {
            return None;
        }
        let tail: Vec<TailFrame> = noted.keys.into_iter().zip(frames).map(|((device, key), (frame, _))| TailFrame { device: (*device).into(), key, frame }).collect();
        let blob = crate::push::stitch::encode(&tail);
        (blob.len() <= crate::push::stitch::tail_max(self.recovery.session_bytes)).then_some((blob, tail.len()))
    }

    /// A session ended: it leaves the streamed set (its stream went with its record).
    pub(crate) fn recovery_session_gone(&self, session: SessionId) {
        if self.recovery.window.is_some() {
            self.recovery.streamed.borrow_mut().remove(&session);
        }
    }
}

/// How an adoption ended on the adopter ([`Core::adoption_verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The history as handed over is whole: its pids are valid here.
    Kept,
    /// The stopping instance's frames after the hand-over were stitched in: whole, valid.
    Stitched,
    /// A frame may be missing: a new epoch, the client gets `history_lost`.
    Voided,
}

/// The adopter's stitch (design step 6, [`crate::push::stitch`]): `tail` (what the stopping
/// instance took in after the hand-over) against the keys `noted` of what came here since;
/// the frames this instance lacks go in after the history as handed over, then its own,
/// renumbered (no client has seen them: its pids were held aside). Returns how many went in.
fn stitch_in(recovery: &mut SessionRecovery, noted: Option<Noted>, tail: &[u8], clock: &PushClock, session_bytes: usize, trimmed: &mut Trimmed) -> Result<usize, &'static str> {
    let noted = noted.filter(|n| !n.spoilt).ok_or("a frame here had no key, or too many")?;
    let tail = crate::push::stitch::decode(tail).ok_or("an undecodable tail")?;
    let insert = crate::push::stitch::missing(&tail, &noted.keys).ok_or("the tail has a frame without a key, or one this instance lacks after one it has")?;
    let stream = recovery.stream.as_mut().ok_or("no history")?;
    if stream.head() != noted.head + noted.keys.len() as u64 {
        return Err("frames here were not noted");
    }
    let mine = stream.take_after(noted.head).ok_or("frames here were trimmed")?;
    for &i in &insert {
        stream.push_clocked(&tail[i].frame, clock, session_bytes, trimmed);
    }
    for frame in &mine {
        stream.push_clocked(frame, clock, session_bytes, trimmed);
    }
    // A device's cut is its last frame's: this instance's own, else the tail's.
    let here: HashSet<&str> = noted.keys.iter().map(|(d, _)| &**d).collect();
    for &i in &insert {
        if !here.contains(&*tail[i].device) {
            stream.cuts.note_only(&tail[i].device, tail[i].key);
        }
    }
    Ok(insert.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mark that comes twice counts once: with two devices handed, the first device's mark
    /// seen twice must not decide the verdict before the second device's arrives (it comes
    /// behind that device's messages the adopter may lack).
    #[test]
    fn a_mark_that_comes_twice_counts_once() {
        let mut marks = Marks::default();
        assert!(!marks.mark(MarkOf::Device("dev-1".into()), 2));
        assert!(!marks.mark(MarkOf::Device("dev-1".into()), 2), "dev-1 again: still waiting for dev-2");
        assert!(marks.mark(MarkOf::Device("dev-2".into()), 2));
        let mut cores = Marks::default();
        assert!(!cores.mark(MarkOf::Core(1), 2));
        assert!(!cores.mark(MarkOf::Core(1), 2), "core 1 again: still waiting for core 0");
        assert!(cores.mark(MarkOf::Core(0), 2));
    }
}
