//! The stable key of a device message, `K = (ms, n)` (docs/design/recovery.md step 9), given
//! where the message enters and carried with it to every core and every replica.
//!
//! Why: after a `kill -9` the instance that takes a partition over reads it again from the
//! last checkpoint, so messages already applied (and delivered) come again. A message read
//! from an event stream partition has a key its source gives it again on every read
//! (`x-opt-enqueued-time`, `x-opt-sequence-number`), so a re-read is recognised on every
//! instance that saw the first read ([`ReadMark`]) and is neither applied nor delivered twice.
//! Messages of sources without partitions (`POST /ingest`, the simulator) are never read
//! again: their key is `(arrival ms, instance counter)`, marked as such, and never compared
//! for re-reads (an arrival time and a broker's enqueued time are different clocks).
//!
//! `n` of a partition key holds the partition too (`[0][partition: 15 bits][sequence number:
//! 48 bits]`): IoT Hub puts all of a device's messages in one partition, but a plain Event
//! Hub sender may spread a device over several, and sequence numbers of two partitions do
//! not compare. A partition id that is not a number below 2¹⁵, or a sequence number from
//! 2⁴⁸ on (9 years at a million messages a second in one partition), gives an arrival key:
//! such messages are applied as before, never taken for re-reads.
//!
//! Where it does not hold: the mark lives in the device's entry, so a device entry removed
//! (a `deleteDeviceIdentity` event, or pruned once it holds no value and no session's access,
//! e.g. after `DELETE` of its values) takes its mark with it, and a re-read after a takeover
//! applies and pushes that device's messages again (at least once, as before step 9).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::timefmt::Millis;

/// The top bit of [`MsgKey::n`]: the key was given at arrival (not by a partition).
const ARRIVAL: u64 = 1 << 63;
/// The bits of a partition key's `n` that hold the sequence number; the partition above.
const SEQUENCE_BITS: u32 = 48;
const SEQUENCE: u64 = (1 << SEQUENCE_BITS) - 1;
/// The greatest partition number a key holds.
pub const MAX_PARTITION: u16 = (1 << 15) - 1;

/// `K = (ms, n)`: a partition's `(enqueued ms, partition × 2⁴⁸ + sequence number)`, or
/// `(arrival ms, instance counter | 2⁶³)`. [`MsgKey::NONE`] when nothing gave one (tests, an older instance's frame).
/// Ordered as `(ms, n)`: one device's messages as they were ingested.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MsgKey {
    pub ms: Millis,
    pub n: u64,
}

impl Default for MsgKey {
    fn default() -> Self {
        MsgKey::NONE
    }
}

thread_local! {
    /// This thread's next arrival counter: its own range of the instance's counters, so
    /// keys are unique in the instance without a shared atomic per message.
    static NEXT: Cell<u64> = Cell::new(THREADS.fetch_add(1, Ordering::Relaxed) << 40);
}
static THREADS: AtomicU64 = AtomicU64::new(0);

impl MsgKey {
    pub const NONE: MsgKey = MsgKey { ms: i64::MIN, n: 0 };

    /// The key of a message read from partition number `partition`: its enqueued time and
    /// sequence number (an arrival key past the bounds: see the module docs).
    pub fn partition(partition: u16, enqueued_ms: Millis, sequence: i64) -> MsgKey {
        match u64::try_from(sequence) {
            Ok(seq) if seq <= SEQUENCE && partition <= MAX_PARTITION && enqueued_ms != i64::MIN => {
                MsgKey { ms: enqueued_ms, n: u64::from(partition) << SEQUENCE_BITS | seq }
            }
            _ => MsgKey::arrival(enqueued_ms.max(0)),
        }
    }

    /// This partition key moved to the partition named `id` (its number; an id that is not a
    /// number up to [`MAX_PARTITION`] gives an arrival key). Other keys are kept.
    pub fn in_partition(self, id: &str) -> MsgKey {
        self.in_numbered(partition_number(id))
    }

    /// [`Self::in_partition`] with the id's [`partition_number`], parsed once per partition
    /// (not once per message).
    #[inline]
    pub fn in_numbered(self, number: Option<u16>) -> MsgKey {
        if !self.from_partition() {
            return self;
        }
        match number {
            Some(p) => MsgKey::partition(p, self.ms, (self.n & SEQUENCE) as i64),
            None => MsgKey::arrival(self.ms),
        }
    }

    /// The partition number of a partition key.
    fn partition_of(self) -> u64 {
        self.n >> SEQUENCE_BITS
    }

    /// The key of a message that arrived at `ms` from a source without partitions: the
    /// instance's next counter (unique here; the thread's range, 2⁴⁰ counters a thread).
    pub fn arrival(ms: Millis) -> MsgKey {
        let n = NEXT.with(|c| {
            let n = c.get();
            c.set(n + 1);
            n
        });
        MsgKey { ms, n: n | ARRIVAL }
    }

    pub fn is_none(self) -> bool {
        self.ms == i64::MIN
    }

    /// Given by a partition, so it may be read again after a takeover.
    pub fn from_partition(self) -> bool {
        !self.is_none() && self.n & ARRIVAL == 0
    }
}

/// A partition id as [`MsgKey::in_numbered`] takes it: its number, `None` when it is not a
/// `u16` (a number above [`MAX_PARTITION`] is given as it is: the key refuses it).
pub fn partition_number(id: &str) -> Option<u16> {
    id.parse::<u16>().ok()
}

/// What a device has applied of one partition's keys (the partition of the last one): the
/// greatest `ms` and the greatest sequence number seen (each on its own). A key of that
/// partition at or below both is a re-read: every message read again has exactly a key
/// already applied. A new message has a greater sequence number than any before it in its
/// partition; should the sequence numbers start again (a new event stream), its enqueued time
/// is later than any before. Taking each maximum on its own keeps a broker clock that stepped
/// back from hiding a re-read. A key of another partition starts the mark again from it (a
/// device spread over partitions is recognised in the partition it was last in, and a new
/// message is never taken for a re-read). 16 bytes a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadMark(MsgKey);

impl Default for ReadMark {
    fn default() -> Self {
        ReadMark(MsgKey::NONE)
    }
}

impl ReadMark {
    /// The mark as stored (`MsgKey::NONE`: nothing read from a partition yet).
    pub fn key(self) -> MsgKey {
        self.0
    }

    pub fn from_key(key: MsgKey) -> ReadMark {
        ReadMark(if key.from_partition() { key } else { MsgKey::NONE })
    }

    /// Whether `key` was applied already (a re-read); if not, and it is a partition key, the
    /// mark takes it in. Keys of sources without partitions are never re-reads.
    #[inline]
    pub fn take(&mut self, key: MsgKey) -> bool {
        if !key.from_partition() {
            return false;
        }
        if self.0.is_none() || self.0.partition_of() != key.partition_of() {
            self.0 = key;
            return false;
        }
        if key.ms <= self.0.ms && key.n <= self.0.n {
            return true;
        }
        self.0.ms = self.0.ms.max(key.ms);
        self.0.n = self.0.n.max(key.n);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_key_read_again_is_a_re_read_and_arrival_keys_never_are() {
        let mut mark = ReadMark::default();
        assert!(!mark.take(MsgKey::partition(3, 1_000, 5)));
        assert!(!mark.take(MsgKey::partition(3, 1_000, 6)), "same ms, next sequence number");
        assert!(mark.take(MsgKey::partition(3, 1_000, 5)), "read again");
        assert!(mark.take(MsgKey::partition(3, 1_000, 6)), "read again");
        // The broker's clock stepped back: still a new message (its sequence number grew),
        // and the one before it read again is still recognised.
        assert!(!mark.take(MsgKey::partition(3, 990, 7)));
        assert!(mark.take(MsgKey::partition(3, 1_000, 6)));
        assert!(mark.take(MsgKey::partition(3, 990, 7)));
        // A new event stream: sequence numbers from 0 again, later enqueued times.
        assert!(!mark.take(MsgKey::partition(3, 2_000, 0)));
        assert!(!mark.take(MsgKey::partition(3, 2_001, 1)));
        assert!(mark.take(MsgKey::partition(3, 2_001, 1)));
        // Arrival keys and no key: never re-reads, and the mark does not move.
        let before = mark;
        let a = MsgKey::arrival(5);
        assert!(!a.from_partition() && !a.is_none());
        assert!(!mark.take(a) && !mark.take(a) && !mark.take(MsgKey::NONE));
        assert_eq!(mark, before);
        assert_eq!(ReadMark::from_key(a), ReadMark::default());
        assert_eq!(ReadMark::from_key(mark.key()), mark);
        // A device spread over partitions: another partition's sequence numbers do not
        // compare (its first key is new), and the mark follows the partition last read.
        assert!(!mark.take(MsgKey::partition(4, 1_500, 0)));
        assert!(mark.take(MsgKey::partition(4, 1_500, 0)));
        assert!(!mark.take(MsgKey::partition(3, 2_001, 2)));
    }

    #[test]
    fn keys_out_of_bounds_are_arrival_keys_and_a_key_moves_to_its_partition() {
        assert!(MsgKey::partition(MAX_PARTITION, 1, (1 << 48) - 1).from_partition());
        assert!(!MsgKey::partition(MAX_PARTITION + 1, 1, 0).from_partition());
        assert!(!MsgKey::partition(0, 1, 1 << 48).from_partition());
        assert!(!MsgKey::partition(0, 1, -1).from_partition());
        let k = MsgKey::partition(0, 77, 12);
        assert_eq!(k.in_partition("5"), MsgKey::partition(5, 77, 12));
        assert!(!k.in_partition("queue/x").from_partition());
        assert!(!k.in_partition("40000").from_partition());
        let a = MsgKey::arrival(1);
        assert_eq!(a.in_partition("5"), a);
        // Numbered once per partition: the same keys.
        for id in ["0", "5", "40000", "queue/x", "-1"] {
            assert_eq!(k.in_numbered(partition_number(id)).from_partition(), k.in_partition(id).from_partition(), "{id}");
            if k.in_partition(id).from_partition() {
                assert_eq!(k.in_numbered(partition_number(id)), k.in_partition(id), "{id}");
            }
        }
    }

    #[test]
    fn arrival_keys_are_unique_in_the_instance_and_grow_on_a_thread() {
        let here: Vec<MsgKey> = (0..3).map(|_| MsgKey::arrival(7)).collect();
        assert!(here.windows(2).all(|w| w[0] < w[1]));
        let there = std::thread::spawn(|| MsgKey::arrival(7)).join().unwrap();
        assert!(!here.contains(&there));
    }
}
