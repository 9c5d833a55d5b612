//! The sessions a core owns, with idle expiry.
//!
//! Expiry keeps one deadline per session in a min-heap and re-arms it lazily: touching a
//! session only updates `last_active`; when its deadline comes up, a session that was active
//! since is pushed back with its new deadline instead of expiring. A session with an open socket
//! holds no deadline; detaching its last socket arms one. No periodic full scan, and the core's
//! clock ([`crate::app::clock`]) sleeps until [`SessionTable::next_deadline`].
//!
//! A session that never got a grant nor a socket (`POST /session` needs no key, so anyone can
//! make one) is kept only `--unused-session-ttl` without activity, not the whole grace period,
//! so unused sessions cannot pile up to `--max-sessions` ([`SessionTable::with_unused_ttl`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use std::rc::Rc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use hashbrown::{HashMap, HashSet};
use smallvec::SmallVec;

use crate::ids::{SessionId, SessionKey};
use crate::push::outlet::Outlet;
use crate::push::stream::SessionRecovery;
use crate::shard::change::Change;

pub struct SessionRecord {
    last_active: Instant,
    /// Devices the session has held grants on: where to clean up when it goes.
    pub devices: DeviceSet,
    /// Open sockets (each gets the session's data); a session with a socket never expires.
    pub sockets: SmallVec<[Rc<Outlet>; 1]>,
    /// A socket was attached once (with a grant, in `devices`: the session is in use).
    pub had_socket: bool,
    /// Connection state recovery: its Socket.IO pids and the stream of what it was given
    /// (`None` until a recovery socket attaches: no cost for other sessions).
    pub recovery: Option<Box<SessionRecovery>>,
}

impl SessionRecord {
    /// Whether the session ever got a grant or a socket (restored sessions count as used).
    pub fn used(&self) -> bool {
        self.had_socket || !self.devices.is_empty()
    }
}

/// The devices a session has held grants on: while few, their ids in one buffer (each its
/// length as a LEB128 varint, then its bytes); a hash set beyond [`DeviceSet::FEW`], so that
/// adding one to a session on thousands of devices does not scan them all. Issue 25 item 3:
/// a hash set of 10 boxed ids was 11 allocations, ~400 bytes per session; the buffer is one
/// allocation of ~80 bytes.
#[derive(Debug, Clone)]
pub enum DeviceSet {
    Few(Vec<u8>),
    Many(Box<HashSet<Box<str>>>),
}

impl Default for DeviceSet {
    fn default() -> Self {
        DeviceSet::Few(Vec::new())
    }
}

fn put_len(buf: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            buf.push(byte);
            return;
        }
        buf.push(byte | 0x80);
    }
}

/// The ids of a [`DeviceSet`].
pub enum DeviceIter<'a> {
    Few(&'a [u8]),
    Many(hashbrown::hash_set::Iter<'a, Box<str>>),
}

impl<'a> Iterator for DeviceIter<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        match self {
            DeviceIter::Few(rest) => {
                if rest.is_empty() {
                    return None;
                }
                let (mut len, mut shift, mut at) = (0usize, 0, 0);
                loop {
                    let byte = rest[at];
                    at += 1;
                    len |= ((byte & 0x7f) as usize) << shift;
                    shift += 7;
                    if byte & 0x80 == 0 {
                        break;
                    }
                }
                let (id, tail) = rest[at..].split_at(len);
                *rest = tail;
                // The bytes were copied from a `&str`.
                Some(std::str::from_utf8(id).expect("a device id copied from a str"))
            }
            DeviceIter::Many(ids) => ids.next().map(|id| &**id),
        }
    }
}

impl DeviceSet {
    /// Beyond this many ids, a hash set.
    pub const FEW: usize = 32;

    pub fn iter(&self) -> DeviceIter<'_> {
        match self {
            DeviceSet::Few(buf) => DeviceIter::Few(buf),
            DeviceSet::Many(ids) => DeviceIter::Many(ids.iter()),
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        match self {
            DeviceSet::Few(_) => self.iter().any(|x| x == id),
            DeviceSet::Many(ids) => ids.contains(id),
        }
    }

    /// Adds `id`; false when it was there already.
    pub fn insert(&mut self, id: &str) -> bool {
        match self {
            DeviceSet::Few(buf) => {
                // One walk: whether it is there, and how many are.
                let mut n = 0;
                if DeviceIter::Few(buf).inspect(|_| n += 1).any(|x| x == id) {
                    return false;
                }
                if n >= Self::FEW {
                    let ids: HashSet<Box<str>> = DeviceIter::Few(buf).map(Box::from).chain([Box::from(id)]).collect();
                    *self = DeviceSet::Many(Box::new(ids));
                } else {
                    // Exact: a session's ids are added once and kept (the allocator rounds up).
                    buf.reserve_exact(id.len() + 3);
                    put_len(buf, id.len());
                    buf.extend_from_slice(id.as_bytes());
                }
            }
            DeviceSet::Many(ids) => {
                if ids.contains(id) {
                    return false;
                }
                ids.insert(id.into());
            }
        }
        true
    }

    pub fn len(&self) -> usize {
        match self {
            DeviceSet::Few(buf) => few_len(buf),
            DeviceSet::Many(ids) => ids.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        match self {
            DeviceSet::Few(buf) => buf.is_empty(),
            DeviceSet::Many(ids) => ids.is_empty(),
        }
    }
}

fn few_len(buf: &[u8]) -> usize {
    DeviceIter::Few(buf).count()
}

impl<S: AsRef<str>> FromIterator<S> for DeviceSet {
    fn from_iter<I: IntoIterator<Item = S>>(ids: I) -> Self {
        let mut set = DeviceSet::default();
        for id in ids {
            set.insert(id.as_ref());
        }
        set
    }
}

pub struct SessionTable {
    /// Keyed 8-aligned ([`SessionKey`]): a `u128` key would pad each entry to 16.
    sessions: HashMap<SessionKey, SessionRecord>,
    deadlines: BinaryHeap<Reverse<(Instant, SessionId)>>,
    grace: Duration,
    /// How long a session never used ([`SessionRecord::used`]) is kept (at most `grace`).
    unused: Duration,
    capacity: usize,
    /// `capacity` bounds the sessions of every core together ([`PROCESS_SESSIONS`]), not this table's.
    process_total: bool,
    /// Sessions created, changed or gone since the core last committed (off without a store).
    pub dirty: SessionDirty,
}

#[derive(Default)]
pub struct SessionDirty {
    pub on: bool,
    ids: HashSet<SessionId>,
}

impl SessionDirty {
    pub fn mark(&mut self, id: SessionId) {
        if self.on {
            self.ids.insert(id);
        }
    }
}

/// Live sessions of the whole process, for tables made with [`SessionTable::process_total`]:
/// `maxSessions` is a real total whichever core a session hashes to. One atomic touched when a
/// session is created or ends, never per message.
static PROCESS_SESSIONS: AtomicUsize = AtomicUsize::new(0);

/// Sessions expired unused, in the whole process (for metrics; touched only at expiry).
static EXPIRED_UNUSED: AtomicU64 = AtomicU64::new(0);

pub fn expired_unused() -> u64 {
    EXPIRED_UNUSED.load(Ordering::Relaxed)
}

impl SessionTable {
    pub fn new(grace: Duration, capacity: usize) -> Self {
        Self { sessions: HashMap::new(), deadlines: BinaryHeap::new(), grace, unused: grace, capacity, process_total: false, dirty: SessionDirty::default() }
    }

    /// Sessions never used are kept `ttl` without activity (at most the grace period).
    pub fn with_unused_ttl(mut self, ttl: Duration) -> Self {
        self.unused = ttl.min(self.grace);
        self
    }

    /// How long `record` is kept without activity.
    fn keep(&self, record: &SessionRecord) -> Duration {
        if record.used() {
            self.grace
        } else {
            self.unused
        }
    }

    /// Counts against `capacity` together with every other core's table.
    pub fn process_total(mut self) -> Self {
        self.process_total = true;
        self
    }

    fn released(&self, n: usize) {
        if self.process_total && n > 0 {
            PROCESS_SESSIONS.fetch_sub(n, Ordering::AcqRel);
        }
    }

    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Returns false when the session limit is used up.
    pub fn create(&mut self, id: SessionId, now: Instant) -> bool {
        let full = if self.process_total {
            let capacity = self.capacity;
            PROCESS_SESSIONS.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < capacity).then_some(n + 1)).is_err()
        } else {
            self.sessions.len() >= self.capacity
        };
        if full {
            return false;
        }
        let record = SessionRecord { last_active: now, devices: DeviceSet::default(), sockets: SmallVec::new(), had_socket: false, recovery: None };
        if self.sessions.insert(SessionKey::of(id), record).is_some() {
            self.released(1);
        }
        self.deadlines.push(Reverse((now + self.unused, id)));
        self.dirty.mark(id);
        true
    }

    /// Marks the session active; `None` when there is no such session.
    pub fn touch(&mut self, id: SessionId, now: Instant) -> Option<&mut SessionRecord> {
        let record = self.sessions.get_mut(&SessionKey::of(id))?;
        record.last_active = now;
        Some(record)
    }

    pub fn get(&self, id: SessionId) -> Option<&SessionRecord> {
        self.sessions.get(&SessionKey::of(id))
    }

    /// The session's record to change, without marking it active (a delivery is not activity).
    pub fn get_mut(&mut self, id: SessionId) -> Option<&mut SessionRecord> {
        self.sessions.get_mut(&SessionKey::of(id))
    }

    pub fn remove(&mut self, id: SessionId) -> Option<SessionRecord> {
        self.dirty.mark(id);
        let record = self.sessions.remove(&SessionKey::of(id));
        self.released(record.iter().count());
        record
    }

    /// Every live session of this table (scale-out: their Redis keys are kept alive).
    pub fn ids(&self) -> Vec<SessionId> {
        self.sessions.keys().map(|k| k.id()).collect()
    }

    pub fn drain(&mut self) -> Vec<(SessionId, SessionRecord)> {
        self.released(self.sessions.len());
        self.deadlines.clear();
        let all: Vec<_> = self.sessions.drain().map(|(k, r)| (k.id(), r)).collect();
        for (id, _) in &all {
            self.dirty.mark(*id);
        }
        all
    }

    /// The earliest session deadline (possibly stale): the core's clock sleeps until it.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.peek().map(|Reverse((t, _))| *t)
    }

    /// Detaches a closed socket and marks the session active; when it was the last socket, the
    /// grace period starts now and gets its deadline. False when there is no such session.
    pub fn detach_socket(&mut self, id: SessionId, outlet_id: u64, now: Instant) -> bool {
        let Some(record) = self.touch(id, now) else { return false };
        record.sockets.retain(|o| o.id != outlet_id);
        if record.sockets.is_empty() {
            self.deadlines.push(Reverse((now + self.grace, id)));
        }
        true
    }

    /// Removes and returns the sessions idle for the grace period at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<(SessionId, SessionRecord)> {
        let mut expired = Vec::new();
        while let Some(Reverse((deadline, id))) = self.deadlines.peek().copied() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            let Some(record) = self.sessions.get(&SessionKey::of(id)) else { continue };
            let keep = self.keep(record);
            let due = record.last_active + keep;
            if !record.sockets.is_empty() {
                // No deadline while a socket is open: `detach_socket` arms one when the last goes.
                continue;
            }
            if due <= now {
                self.dirty.mark(id);
                if keep < self.grace {
                    EXPIRED_UNUSED.fetch_add(1, Ordering::Relaxed);
                }
                expired.push((id, self.sessions.remove(&SessionKey::of(id)).expect("present")));
            } else {
                self.deadlines.push(Reverse((due.max(now + keep / 4), id)));
            }
        }
        self.released(expired.len());
        expired
    }
}

/// Durable-state hooks: changed sessions as [`Change`]s, the whole table, restore at start.
impl SessionTable {
    pub fn drain_dirty(&mut self, put: &mut dyn FnMut(Change<'_>)) {
        let mut ids = std::mem::take(&mut self.dirty.ids);
        let drained = ids.len();
        for id in ids.drain() {
            put(Change::Session { id, devices: self.sessions.get(&SessionKey::of(id)).map(|r| &r.devices) });
        }
        crate::shard::devices::shrink_after(&mut ids, drained);
        self.dirty.ids = ids;
    }

    pub fn for_each_state(&self, put: &mut dyn FnMut(Change<'_>)) {
        for (id, r) in &self.sessions {
            put(Change::Session { id: id.id(), devices: Some(&r.devices) });
        }
    }

    /// Restores sessions read back at start; each gets a fresh grace period from `now`.
    /// Restored sessions count against the limit like created ones (they may exceed it: then
    /// new ones are refused until enough have gone), so their end is not released twice.
    pub fn restore(&mut self, sessions: impl Iterator<Item = (SessionId, Vec<Box<str>>)>, now: Instant) {
        let mut added = 0;
        for (id, devices) in sessions {
            // A restored session was kept before: it counts as used (the full grace period).
            let record = SessionRecord {
                last_active: now,
                devices: devices.into_iter().collect(),
                sockets: SmallVec::new(),
                had_socket: true,
                recovery: None,
            };
            if self.sessions.insert(SessionKey::of(id), record).is_none() {
                added += 1;
            }
            self.deadlines.push(Reverse((now + self.grace, id)));
        }
        if self.process_total && added > 0 {
            PROCESS_SESSIONS.fetch_add(added, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_sessions_expire_and_active_ones_do_not() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(10);
        let mut table = SessionTable::new(grace, 10);
        let (a, b) = (SessionId(1), SessionId(2));
        table.create(a, t0);
        table.create(b, t0);
        table.touch(b, t0 + Duration::from_secs(8));
        let gone = table.expire(t0 + Duration::from_secs(11));
        assert_eq!(gone.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![a]);
        assert!(table.touch(b, t0 + Duration::from_secs(11)).is_some());
        assert!(table.expire(t0 + Duration::from_secs(30)).iter().any(|(id, _)| *id == b));
    }

    /// A session restored from the store and then expired must not wrap the process-wide
    /// count below zero (which refused every new session for the life of the process).
    #[test]
    fn restored_sessions_are_counted_and_released_once() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(10);
        let mut table = SessionTable::new(grace, usize::MAX).process_total();
        table.restore([(SessionId(0xfeed_0001), vec![Box::<str>::from("d")])].into_iter(), t0);
        assert_eq!(table.expire(t0 + Duration::from_secs(11)).len(), 1);
        assert!(table.create(SessionId(0xfeed_0002), t0), "a new session after a restored one expired");
        assert!(table.remove(SessionId(0xfeed_0002)).is_some());
    }

    #[test]
    fn a_session_never_used_expires_at_the_shorter_ttl() {
        let t0 = Instant::now();
        let mut table = SessionTable::new(Duration::from_secs(120), 10).with_unused_ttl(Duration::from_secs(60));
        let (unused, granted, socket) = (SessionId(1), SessionId(2), SessionId(3));
        for id in [unused, granted, socket] {
            table.create(id, t0);
        }
        table.touch(granted, t0).unwrap().devices.insert("d");
        table.touch(socket, t0).unwrap().had_socket = true;
        assert_eq!(table.next_deadline(), Some(t0 + Duration::from_secs(60)));
        let gone = table.expire(t0 + Duration::from_secs(61));
        assert_eq!(gone.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![unused]);
        let gone = table.expire(t0 + Duration::from_secs(121));
        assert_eq!(gone.len(), 2, "the used ones keep the whole grace period");
    }

    #[test]
    fn capacity_is_enforced() {
        let mut table = SessionTable::new(Duration::from_secs(1), 1);
        assert!(table.create(SessionId(1), Instant::now()));
        assert!(!table.create(SessionId(2), Instant::now()));
    }

    /// A session's device set: one buffer while few, a hash set beyond, the same answers.
    #[test]
    fn device_sets_keep_ids_in_one_buffer_while_few() {
        let mut set = DeviceSet::default();
        assert!(set.is_empty() && set.iter().next().is_none());
        let long = "x".repeat(300);
        assert!(set.insert("dev-1") && set.insert(&long) && set.insert("é"));
        assert!(!set.insert("dev-1"), "already there");
        assert!(matches!(set, DeviceSet::Few(_)));
        assert_eq!(set.iter().collect::<Vec<_>>(), ["dev-1", long.as_str(), "é"]);
        assert!(set.contains(&long) && !set.contains("dev-2") && !set.contains("dev"));
        for i in 0..DeviceSet::FEW * 2 {
            set.insert(&format!("d{i}"));
        }
        assert!(matches!(set, DeviceSet::Many(_)));
        assert_eq!(set.len(), DeviceSet::FEW * 2 + 3);
        assert!(set.contains("é") && set.contains("d0") && !set.insert("d5"));
        let few: DeviceSet = ["a", "b", "a"].into_iter().collect();
        assert_eq!(few.len(), 2);
        assert!(std::mem::size_of::<DeviceSet>() <= 24);
    }
}
