//! Device rings (design docs/design/recovery.md, step 10 as built): per device of this core,
//! the messages applied here lately, kept so that a client whose instance died (`kill -9`)
//! can have what it missed rebuilt on this instance (step 11, `app/rebuild.rs`).
//!
//! **Which devices.** With a recovery window and `--redis-url` only. A device's messages
//! taken in here (`here`: `POST /ingest`, the simulator, a partition read here) are kept
//! while another instance watches it, that is exactly while they are published, and for a
//! window after its last watcher left (so what this instance takes in after the watcher's
//! instance died is kept for its client too). Messages another instance published to this
//! one (a socket here watches the device) are kept as well: the replica's copy. A device
//! nobody elsewhere watches and nothing here subscribes to has no ring, costs one failed
//! look-up per message, and adds nothing to Redis: rings are local memory, never sent
//! except as a rebuild's answer on this instance.
//!
//! **What an entry holds** (design step 11, "twin and connection events"): the message, when
//! it was applied here (the batch's clock) and what the live path decided for it here
//! ([`Decided`]: a twin change's whole twin after it, a connection event's state, or that
//! nothing was sent), so a rebuild sends a twin or connection subscriber the frames it was
//! sent rather than deciding again against a state it no longer has. Entries are in the
//! order the device's core applied them: twin changes, connection events and telemetry of
//! one device in one ring, so their order holds as the keys' does.
//!
//! **Bounds and policy** (each entry is charged its message's [`IngestMessage::charge`]
//! and its decision's [`Decided::charge`] (a twin's text) plus [`ENTRY_OVERHEAD`]): an entry older than the window leaves at the ring's next push
//! and at the once-a-second sweep; a ring holds at most [`RING_ENTRIES`] (the oldest leaves);
//! a core holds at most `--recovery-core-bytes` (the same bound as the session streams, a
//! second budget of that size) and [`CORE_ENTRIES`] entries: past either, the largest rings
//! are emptied first until the core is at 7/8 of the bound. Every entry that leaves for a
//! bound marks its ring *cut* (for a window); a cut that names a message no longer held is
//! then not found and the rebuild fails `history_lost` (honest, counted), never a replay with
//! a hole. A ring emptied and silent past its window is dropped; a core that drops a ring
//! cut within the window (emptied for a bound) remembers it for a window (`gap_until`), and
//! a rebuild there of a device with no ring fails instead of assuming there was nothing.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use crate::ingest::IngestMessage;
use crate::push::cut::key_hash;
use crate::shard::devices::{Decided, Kept};

/// Bytes an entry is charged beyond its message's own charge.
pub const ENTRY_OVERHEAD: usize = 48;
/// Entries one ring holds at most.
pub const RING_ENTRIES: usize = 65_536;
/// Entries one core's rings hold at most.
pub const CORE_ENTRIES: usize = 1 << 20;

struct Entry {
    at: Instant,
    /// Taken in on this instance (else published here by another).
    here: bool,
    charged: usize,
    msg: IngestMessage,
    decided: Decided,
}

#[derive(Default)]
struct Ring {
    entries: VecDeque<Entry>,
    bytes: usize,
    /// Keep taking messages of this device until then (a window after it was last watched).
    until: Option<Instant>,
    /// When entries last left it for a bound (a cut older than a window loses nothing a
    /// rebuild could still ask for: what it cut was past the window anyway).
    cut_at: Option<Instant>,
    /// An entry left it, or a message of its device was applied and not kept: its first
    /// entry is no longer the first message since it began ([`Rings::lead`]).
    lost_any: bool,
}

impl Ring {
    /// Whether entries left it for a bound within the last `window`.
    fn cut_lately(&self, now: Instant, window: Duration) -> bool {
        self.cut_at.is_some_and(|t| now.saturating_duration_since(t) <= window)
    }
}

/// Why a rebuild cannot use what a ring holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// The client's last frame of the device is not held (cut by a bound or the window, or
    /// never taken in here).
    CutNotHeld,
    /// Two held messages share the cut's key hash.
    Ambiguous,
    /// The client had no frame of the device in its stream, and the ring holds some: which
    /// of them it would have got is not known.
    NoCut,
    /// Messages of the device came from this and another instance: their order on the dead
    /// instance is not known.
    TwoOrigins,
    /// A ring of this core emptied for a bound within the window was dropped since.
    Gap,
}

/// One core's rings.
pub struct Rings {
    window: Duration,
    core_bytes: usize,
    rings: HashMap<Box<str>, Ring>,
    bytes: usize,
    entries: usize,
    gap_until: Option<Instant>,
    next_sweep: Option<Instant>,
}

impl Rings {
    pub fn new(window: Duration, core_bytes: usize) -> Self {
        Self { window, core_bytes, rings: HashMap::new(), bytes: 0, entries: 0, gap_until: None, next_sweep: None }
    }

    /// Whether [`Rings::note`] would keep anything of a message of `device` (`here`,
    /// `watched` as there): a message taken in here of a device nobody elsewhere watches and
    /// without a ring costs this look-up only, no clock read.
    pub fn may_keep(&self, device: &str, here: bool, watched: bool) -> bool {
        !here || watched || self.rings.contains_key(device)
    }

    /// Charged bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn entries(&self) -> usize {
        self.entries
    }

    /// A message applied on this core: `here` (taken in on this instance) and `watched`
    /// (another instance watches its device now), or published here by another instance;
    /// `decided`: what was decided for it (called only when it is kept). Returns the change
    /// of the bytes held.
    pub fn note(&mut self, msg: &IngestMessage, decided: &dyn Fn() -> Decided, here: bool, watched: bool, now: Instant) -> isize {
        let before = self.bytes as isize;
        let keep = !here || watched;
        let ring = match self.rings.get_mut(&*msg.device_id) {
            Some(ring) => ring,
            None if keep => self.rings.entry(msg.device_id.clone()).or_default(),
            None => {
                self.maybe_sweep(now);
                return self.bytes as isize - before;
            }
        };
        if keep {
            ring.until = Some(now + self.window);
        } else if ring.until.is_none_or(|u| u <= now) {
            ring.lost_any = true;
            self.maybe_sweep(now);
            return self.bytes as isize - before;
        }
        let decided = decided();
        let charged = msg.charge() + decided.charge() + ENTRY_OVERHEAD;
        ring.entries.push_back(Entry { at: now, here, charged, msg: msg.clone(), decided });
        ring.bytes += charged;
        self.bytes += charged;
        self.entries += 1;
        // By age, then the ring's own count.
        while let Some(front) = ring.entries.front() {
            let old = now.saturating_duration_since(front.at) > self.window;
            if !old && ring.entries.len() <= RING_ENTRIES {
                break;
            }
            let e = ring.entries.pop_front().expect("front");
            ring.bytes -= e.charged;
            ring.lost_any = true;
            self.bytes -= e.charged;
            self.entries -= 1;
            if !old {
                ring.cut_at = Some(now);
            }
        }
        if self.bytes > self.core_bytes || self.entries > CORE_ENTRIES {
            self.cut_largest(now);
        }
        self.maybe_sweep(now);
        self.bytes as isize - before
    }

    /// Past a core bound: empties the largest rings first until the core is at 7/8 of it.
    fn cut_largest(&mut self, now: Instant) {
        let (bytes_target, entries_target) = (self.core_bytes - self.core_bytes / 8, CORE_ENTRIES - CORE_ENTRIES / 8);
        let mut sizes: Vec<(usize, Box<str>)> = self.rings.iter().map(|(k, r)| (r.bytes, k.clone())).collect();
        sizes.sort_unstable_by_key(|(bytes, _)| std::cmp::Reverse(*bytes));
        for (_, device) in sizes {
            if self.bytes <= bytes_target && self.entries <= entries_target {
                break;
            }
            if let Some(ring) = self.rings.get_mut(&device) {
                self.bytes -= ring.bytes;
                self.entries -= ring.entries.len();
                ring.bytes = 0;
                ring.entries.clear();
                ring.cut_at = Some(now);
                ring.lost_any = true;
            }
        }
        self.gap_until = Some(now + self.window);
    }

    /// Once a second: entries past the window leave every ring; rings empty and past their
    /// time go (a ring cut for a bound leaves a gap for a window).
    fn maybe_sweep(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|t| t > now) {
            return;
        }
        self.next_sweep = Some(now + Duration::from_secs(1));
        let window = self.window;
        let (mut bytes, mut entries, mut gap) = (0, 0, false);
        self.rings.retain(|_, ring| {
            while ring.entries.front().is_some_and(|e| now.saturating_duration_since(e.at) > window) {
                let e = ring.entries.pop_front().expect("front");
                ring.bytes -= e.charged;
                ring.lost_any = true;
            }
            let keep = !ring.entries.is_empty() || ring.until.is_some_and(|u| u > now);
            if keep {
                bytes += ring.bytes;
                entries += ring.entries.len();
            } else {
                gap |= ring.cut_lately(now, window);
            }
            keep
        });
        self.bytes = bytes;
        self.entries = entries;
        if gap {
            self.gap_until = Some(now + window);
        }
    }

    /// Whether the ring of `device` holds a message taken in on this instance (within the
    /// window): the device is taken in here, so a cut of it not found here is lost.
    pub fn holds_here(&self, device: &str, now: Instant) -> bool {
        self.rings.get(device).is_some_and(|r| r.entries.iter().any(|e| e.here && now.saturating_duration_since(e.at) <= self.window))
    }

    /// The messages of `device` held after the client's last frame of it (`cut`: its key
    /// hash, `None`: the client had none of it in its stream), oldest first, with what was
    /// decided for each and when it was applied.
    pub fn after(&self, device: &str, cut: Option<u32>, now: Instant) -> Result<Vec<Kept>, Lost> {
        let Some(ring) = self.rings.get(device) else {
            return match cut {
                Some(_) => Err(Lost::CutNotHeld),
                None if self.gap_until.is_some_and(|g| g > now) => Err(Lost::Gap),
                None => Ok(Vec::new()),
            };
        };
        let live = |e: &&Entry| now.saturating_duration_since(e.at) <= self.window;
        let held: Vec<&Entry> = ring.entries.iter().filter(live).collect();
        if held.iter().any(|e| e.here) && held.iter().any(|e| !e.here) {
            return Err(Lost::TwoOrigins);
        }
        let Some(cut) = cut else {
            return if held.is_empty() && !ring.cut_lately(now, self.window) { Ok(Vec::new()) } else { Err(Lost::NoCut) };
        };
        let mut at = held.iter().enumerate().filter(|(_, e)| key_hash(e.msg.key) == Some(cut)).map(|(i, _)| i);
        match (at.next(), at.next()) {
            (Some(i), None) => Ok(held[i + 1..].iter().map(|e| Kept { msg: e.msg.clone(), decided: e.decided.clone(), at: e.at }).collect()),
            (Some(_), Some(_)) => Err(Lost::Ambiguous),
            (None, _) => Err(Lost::CutNotHeld),
        }
    }
}

impl Rings {
    /// With throttling (design step 11, "throttled telemetry"): the entries of `device` from
    /// its latest *quiet point* through the client's cut (`cut`, inclusive), and whether
    /// they start at one. A quiet point is an entry `quiet` or more after the one before it,
    /// or the first entry of a ring that has held every message of its device since it
    /// began (before it, nobody elsewhere watched the device: no session elsewhere had a
    /// throttle window of it open). `(just the cut, false)` when there is none; `None`
    /// without the cut (the rebuild's [`Rings::after`] says why).
    pub fn lead(&self, device: &str, cut: u32, now: Instant, quiet: Duration) -> Option<(Vec<Kept>, bool)> {
        let ring = self.rings.get(device)?;
        let held: Vec<&Entry> = ring.entries.iter().filter(|e| now.saturating_duration_since(e.at) <= self.window).collect();
        let k = held.iter().position(|e| key_hash(e.msg.key) == Some(cut))?;
        // The reasoning "nobody elsewhere watched before its first entry" holds only for a
        // device taken in here: a replica's ring begins when this instance began to watch.
        let whole = !ring.lost_any && held.len() == ring.entries.len() && held.first().is_some_and(|e| e.here);
        let start = (0..=k).rev().find(|&i| if i == 0 { whole } else { held[i].at.saturating_duration_since(held[i - 1].at) >= quiet });
        let (from, quiet_point) = match start {
            Some(i) => (i, true),
            None => (k, false),
        };
        Some((held[from..=k].iter().map(|e| Kept { msg: e.msg.clone(), decided: e.decided.clone(), at: e.at }).collect(), quiet_point))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::MsgKey;

    fn msg(device: &str, n: u64) -> IngestMessage {
        IngestMessage::ring_fixture(device, n)
    }

    fn ns(v: Vec<Kept>) -> Vec<u64> {
        v.iter().map(|m| m.msg.key.n).collect()
    }

    fn tel() -> Decided {
        Decided::FromMessage
    }

    fn cut(n: u64) -> Option<u32> {
        key_hash(MsgKey { ms: 1_000, n })
    }

    #[test]
    fn a_device_watched_elsewhere_is_kept_and_what_followed_a_cut_comes_back_in_order() {
        let now = Instant::now();
        let mut r = Rings::new(Duration::from_secs(60), 1 << 20);
        assert!(!r.may_keep("unwatched", true, false), "no clock read for it");
        assert_eq!(r.note(&msg("unwatched", 1), &tel, true, false, now), 0);
        assert_eq!(r.entries(), 0);
        assert!(r.may_keep("unwatched", false, false), "a replica's copy is kept");
        for n in 1..=5 {
            assert!(r.note(&msg("d", n), &tel, true, true, now) > 0);
        }
        assert!(r.may_keep("d", true, false), "a ring goes on a window after its watcher left");
        assert_eq!(ns(r.after("d", cut(2), now).unwrap()), [3, 4, 5]);
        assert_eq!(ns(r.after("d", cut(5), now).unwrap()), Vec::<u64>::new());
        assert_eq!(r.after("d", cut(9), now).unwrap_err(), Lost::CutNotHeld);
        assert_eq!(r.after("d", None, now).unwrap_err(), Lost::NoCut);
        assert_eq!(ns(r.after("other", None, now).unwrap()), Vec::<u64>::new());
        assert_eq!(r.after("other", cut(1), now).unwrap_err(), Lost::CutNotHeld);
    }

    #[test]
    fn a_ring_goes_on_for_a_window_after_its_last_watcher_left() {
        let t0 = Instant::now();
        let mut r = Rings::new(Duration::from_secs(10), 1 << 20);
        r.note(&msg("d", 1), &tel, true, true, t0);
        r.note(&msg("d", 2), &tel, true, false, t0 + Duration::from_secs(5));
        assert_eq!(ns(r.after("d", cut(1), t0 + Duration::from_secs(5)).unwrap()), [2]);
        // Past the window after the watcher left: nothing more is kept, and what was ages out.
        let late = t0 + Duration::from_secs(30);
        r.note(&msg("d", 3), &tel, true, false, late);
        assert_eq!(r.entries(), 0);
        assert_eq!(r.bytes(), 0);
    }

    #[test]
    fn a_lead_starts_at_the_latest_quiet_point_before_the_cut() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let q = ms(500);
        let mut r = Rings::new(Duration::from_secs(60), 1 << 20);
        for (n, at) in [(1, 0), (2, 100), (3, 700), (4, 800), (5, 900)] {
            r.note(&msg("d", n), &tel, true, true, t0 + ms(at));
        }
        let now = t0 + ms(1000);
        let lead = |c| r.lead("d", cut(c).unwrap(), now, q).map(|(l, quiet)| (ns(l), quiet));
        assert_eq!(lead(5), Some((vec![3, 4, 5], true)), "600 ms before 3");
        assert_eq!(lead(2), Some((vec![1, 2], true)), "the ring's first, nothing lost");
        assert_eq!(lead(9), None);
        // Once an entry left (the ring's own count, age or a bound), its first is no quiet point.
        let mut r = Rings::new(ms(250), 1 << 20);
        for (n, at) in [(1, 0), (2, 100), (3, 200), (4, 300)] {
            r.note(&msg("d", n), &tel, true, true, t0 + ms(at));
        }
        assert_eq!(r.lead("d", cut(4).unwrap(), t0 + ms(300), q).map(|(l, quiet)| (ns(l), quiet)), Some((vec![4], false)));
        // A replica's ring (the device taken in elsewhere) began when this instance began to
        // watch: a session elsewhere may have had a window open, so its first is no quiet point.
        let mut r = Rings::new(Duration::from_secs(60), 1 << 20);
        for (n, at) in [(1, 0), (2, 100)] {
            r.note(&msg("d", n), &tel, false, true, t0 + ms(at));
        }
        assert_eq!(r.lead("d", cut(2).unwrap(), t0 + ms(200), q).map(|(l, quiet)| (ns(l), quiet)), Some((vec![2], false)));
    }

    #[test]
    fn two_origins_in_a_ring_and_two_entries_with_one_key_fail() {
        let now = Instant::now();
        let mut r = Rings::new(Duration::from_secs(60), 1 << 20);
        r.note(&msg("d", 1), &tel, true, true, now);
        r.note(&msg("d", 2), &tel, false, false, now);
        assert_eq!(r.after("d", cut(1), now).unwrap_err(), Lost::TwoOrigins);
        r.note(&msg("e", 1), &tel, false, false, now);
        r.note(&msg("e", 1), &tel, false, false, now);
        assert_eq!(r.after("e", cut(1), now).unwrap_err(), Lost::Ambiguous);
    }

    /// A cut older than a window does not make a later dropped ring a gap (found in review:
    /// the flag was never cleared, so a ring cut hours before it was dropped failed every
    /// rebuild of the core's unringed devices for a window).
    #[test]
    fn a_ring_cut_long_before_it_is_dropped_leaves_no_gap() {
        let t0 = Instant::now();
        let w = Duration::from_secs(10);
        let one = msg("big", 0).charge() + ENTRY_OVERHEAD;
        let mut r = Rings::new(w, one * 10);
        for n in 1..=12 {
            r.note(&msg("big", n), &tel, true, true, t0);
        }
        // Watched on long after the cut, then left: the ring ages out and is dropped.
        let mut t = t0;
        for n in 13..=16 {
            t += w;
            r.note(&msg("big", n), &tel, true, true, t);
        }
        // Just past the window after the last watched message: the sweep drops the ring.
        let late = t + w + Duration::from_secs(1);
        r.note(&msg("other", 1), &tel, true, false, late);
        assert!(!r.may_keep("big", true, false), "the ring of big is gone");
        assert_eq!(ns(r.after("never", None, late).unwrap()), Vec::<u64>::new());
    }

    #[test]
    fn past_the_core_bound_the_largest_rings_are_emptied_and_their_cuts_fail() {
        let now = Instant::now();
        let one = msg("big", 0).charge() + ENTRY_OVERHEAD;
        let mut r = Rings::new(Duration::from_secs(60), one * 10);
        r.note(&msg("small", 1), &tel, true, true, now);
        for n in 1..=9 {
            r.note(&msg("big", n), &tel, true, true, now);
        }
        assert!(r.bytes() <= one * 10, "{} over {}", r.bytes(), one * 10);
        assert_eq!(r.after("big", cut(3), now).unwrap_err(), Lost::CutNotHeld);
        assert_eq!(ns(r.after("small", cut(1), now).unwrap()), Vec::<u64>::new());
        // A device with no ring while a ring was dropped within the window: not assumed empty.
        assert_eq!(r.after("never", None, now).unwrap_err(), Lost::Gap);
    }
}
