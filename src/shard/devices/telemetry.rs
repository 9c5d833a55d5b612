//! [`Telemetry`]: a device's last telemetry values in two small buffers, rewritten in place.
//!
//! The hot part of a device entry on the ingest path (issue 25 item 4). Before, each device
//! held a hash map of boxed keys to shared value texts: every message hashed each key, read
//! each key from its own allocation to compare it, allocated one buffer for the message's
//! values and freed the one it replaced, the reference count of which was read from yet
//! another line. Here the keys and value texts of a device sit back to back in one byte
//! buffer, with a small array of entries (where each key and value is, and its time):
//!
//! - a message with the keys it had before (the usual case) finds each at the position it
//!   had, compares it in place, and copies its value over the old one: no hashing, no
//!   allocation, three or four cache lines touched per device;
//! - a value longer than its slot rebuilds the buffer once, giving the grown slot some room
//!   (a number that gains a digit moves once, not at every message);
//! - a new key is appended.
//!
//! Lookups scan the entries (a device has a few to a few dozen keys; a message's keys are
//! tried first at the position they had, so a message in the same key order as the stored
//! one compares each key once).

use crate::timefmt::Millis;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    /// Where the key starts in `text`; its value slot follows it.
    key: u32,
    key_len: u32,
    /// The value's length; its slot reaches the next entry's key (or the end of `text`).
    len: u32,
    at: Millis,
}

/// A device's last telemetry values: key → (value as the JSON text the device sent, time).
#[derive(Default, Clone)]
pub struct Telemetry {
    /// In the order of their place in `text`.
    entries: Vec<Entry>,
    /// Keys and value slots, back to back; every byte range an entry names was copied from a
    /// `&str` (bytes after a value, up to the end of its slot, are spare room).
    text: Vec<u8>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter().map(|(k, v, at)| (k, (v, at)))).finish()
    }
}

impl Telemetry {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of the text (keys, values and their slots' spare room): at least the bytes of
    /// every key and value.
    pub fn text_bytes(&self) -> usize {
        self.text.len()
    }

    /// Drops every value and the buffers.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    fn str_at(&self, start: u32, len: u32) -> &str {
        let bytes = &self.text[start as usize..(start + len) as usize];
        // SAFETY: every range an entry names (a key, or a value's first `len` bytes) was
        // copied whole from a `&str` by `set`/`rebuild` and not written since but by another
        // whole `&str` of that length; the spare bytes of a slot are never read as text.
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }

    fn key_of(&self, e: &Entry) -> &[u8] {
        &self.text[e.key as usize..(e.key + e.key_len) as usize]
    }

    /// Where entry `i`'s value slot ends.
    fn slot_end(&self, i: usize) -> usize {
        self.entries.get(i + 1).map_or(self.text.len(), |next| next.key as usize)
    }

    fn find(&self, key: &str, hint: usize) -> Option<usize> {
        let key = key.as_bytes();
        if let Some(e) = self.entries.get(hint) {
            if e.key_len as usize == key.len() && same_bytes(self.key_of(e), key) {
                return Some(hint);
            }
        }
        self.entries.iter().position(|e| e.key_len as usize == key.len() && same_bytes(self.key_of(e), key))
    }

    /// The value of `key` and its time.
    pub fn get(&self, key: &str) -> Option<(&str, Millis)> {
        let e = &self.entries[self.find(key, 0)?];
        Some((self.str_at(e.key + e.key_len, e.len), e.at))
    }

    /// Every key with its value and time, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, Millis)> + Clone + '_ {
        self.entries.iter().map(|e| (self.str_at(e.key, e.key_len), self.str_at(e.key + e.key_len, e.len), e.at))
    }

    /// Every value as its key's and value's bytes back to back (`key‖value`, as they sit in
    /// the text), the key's length and the value's time, in the order of [`Self::iter`]: for a
    /// writer that copies each value out with one bounds check and no `&str` built (the
    /// store's device record, src/store/format.rs).
    #[inline]
    pub fn pairs(&self) -> impl Iterator<Item = (&[u8], usize, Millis)> + '_ {
        self.entries.iter().map(|e| {
            let key = e.key as usize;
            (&self.text[key..key + e.key_len as usize + e.len as usize], e.key_len as usize, e.at)
        })
    }

    /// The time of the first value in the order of [`Self::iter`].
    #[inline]
    pub fn first_at(&self) -> Option<Millis> {
        self.entries.first().map(|e| e.at)
    }

    /// The newest time of any value.
    pub fn newest(&self) -> Option<Millis> {
        self.entries.iter().map(|e| e.at).max()
    }

    /// Sets `key` to `value` at `at`. `hint`: where the key probably is (its index in the
    /// message, for a message in the stored order); any index is correct.
    pub fn set(&mut self, hint: usize, key: &str, value: &str, at: Millis) {
        match self.find(key, hint) {
            Some(i) => {
                let start = (self.entries[i].key + self.entries[i].key_len) as usize;
                if start + value.len() <= self.slot_end(i) {
                    copy_bytes(&mut self.text[start..start + value.len()], value.as_bytes());
                    let e = &mut self.entries[i];
                    e.len = value.len() as u32;
                    e.at = at;
                } else {
                    self.rebuild(i, value, at);
                }
            }
            None => {
                let key_at = self.text.len();
                self.text.extend_from_slice(key.as_bytes());
                self.text.extend_from_slice(value.as_bytes());
                self.entries.push(Entry { key: key_at as u32, key_len: key.len() as u32, len: value.len() as u32, at });
                assert!(self.text.len() <= u32::MAX as usize, "a device's telemetry text is below 4 GiB");
            }
        }
    }

    /// Writes the buffer again with entry `grown`'s new `value`, whose slot gets a quarter of
    /// its length (at least 2 bytes) to spare; the other slots are shrunk to their values.
    fn rebuild(&mut self, grown: usize, value: &str, at: Millis) {
        let room = value.len() / 4 + 2;
        let size: usize = self.entries.iter().map(|e| (e.key_len + e.len) as usize).sum::<usize>() + value.len() + room;
        let mut text = Vec::with_capacity(size);
        for (i, e) in self.entries.iter_mut().enumerate() {
            let key_at = text.len() as u32;
            text.extend_from_slice(&self.text[e.key as usize..(e.key + e.key_len) as usize]);
            if i == grown {
                text.extend_from_slice(value.as_bytes());
                text.resize(text.len() + room, b' ');
                e.len = value.len() as u32;
                e.at = at;
            } else {
                let v = (e.key + e.key_len) as usize;
                text.extend_from_slice(&self.text[v..v + e.len as usize]);
            }
            e.key = key_at;
        }
        assert!(text.len() <= u32::MAX as usize, "a device's telemetry text is below 4 GiB");
        self.text = text;
    }

    /// Keeps only the keys `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let kept: Vec<(String, String, Millis)> = self
            .iter()
            .filter(|(k, _, _)| keep(k))
            .map(|(k, v, at)| (k.to_string(), v.to_string(), at))
            .collect();
        if kept.len() == self.len() {
            return;
        }
        self.clear();
        for (i, (k, v, at)) in kept.iter().enumerate() {
            self.set(i, k, v, *at);
        }
    }
}

/// `a == b` for slices of equal length, without a call for the short keys telemetry has
/// (1 to 16 bytes: two overlapping loads of each), `memcmp` beyond. Each message compares
/// each of its keys once, and the call was most of the comparison (issue 25 item 4).
#[inline]
pub fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let u64_at = |s: &[u8], i: usize| u64::from_le_bytes(s[i..i + 8].try_into().expect("eight bytes"));
    let u32_at = |s: &[u8], i: usize| u32::from_le_bytes(s[i..i + 4].try_into().expect("four bytes"));
    match n {
        8..=16 => u64_at(a, 0) == u64_at(b, 0) && u64_at(a, n - 8) == u64_at(b, n - 8),
        4..=7 => u32_at(a, 0) == u32_at(b, 0) && u32_at(a, n - 4) == u32_at(b, n - 4),
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        _ => a == b,
    }
}

/// `to.copy_from_slice(from)` without a call for the short values telemetry has (up to 16
/// bytes: two overlapping copies), `memcpy` beyond.
#[inline]
fn copy_bytes(to: &mut [u8], from: &[u8]) {
    let n = from.len();
    match n {
        8..=16 => {
            let (head, tail): ([u8; 8], [u8; 8]) = (from[..8].try_into().expect("eight"), from[n - 8..].try_into().expect("eight"));
            to[..8].copy_from_slice(&head);
            to[n - 8..n].copy_from_slice(&tail);
        }
        4..=7 => {
            let (head, tail): ([u8; 4], [u8; 4]) = (from[..4].try_into().expect("four"), from[n - 4..].try_into().expect("four"));
            to[..4].copy_from_slice(&head);
            to[n - 4..n].copy_from_slice(&tail);
        }
        _ => to.copy_from_slice(from),
    }
}

impl<K: AsRef<str>, V: AsRef<str>> FromIterator<(K, V, Millis)> for Telemetry {
    fn from_iter<I: IntoIterator<Item = (K, V, Millis)>>(iter: I) -> Self {
        let mut t = Self::default();
        for (i, (k, v, at)) in iter.into_iter().enumerate() {
            t.set(i, k.as_ref(), v.as_ref(), at);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(t: &Telemetry) -> Vec<(String, String, Millis)> {
        let mut v: Vec<_> = t.iter().map(|(k, v, at)| (k.to_string(), v.to_string(), at)).collect();
        v.sort();
        v
    }

    #[test]
    fn values_are_rewritten_in_place_grow_once_and_keys_are_added() {
        let mut t = Telemetry::default();
        t.set(0, "temperature", "21.5", 1);
        t.set(1, "seq", "9", 1);
        assert_eq!(t.get("temperature"), Some(("21.5", 1)));
        let (ptr, cap) = (t.text.as_ptr(), t.text.capacity());
        // Same length and shorter: in place, no reallocation.
        t.set(0, "temperature", "22.0", 2);
        t.set(1, "seq", "8", 2);
        t.set(0, "temperature", "3", 3);
        assert_eq!((t.text.as_ptr(), t.text.capacity()), (ptr, cap));
        assert_eq!(t.get("temperature"), Some(("3", 3)));
        assert_eq!(t.get("seq"), Some(("8", 2)));
        // Longer than its slot: rebuilt once with room, the next digits fit.
        t.set(1, "seq", "10", 4);
        assert_eq!(t.get("seq"), Some(("10", 4)));
        let len = t.text.len();
        t.set(1, "seq", "11", 5);
        t.set(1, "seq", "100", 6);
        assert_eq!(t.text.len(), len, "the grown slot kept room");
        // A wrong hint still finds the key; a new key is appended; multi-byte text survives.
        t.set(5, "temperature", "\"é\u{1F600}\"", 7);
        t.set(0, "k\"ey", "{\"a\":[1,2]}", 8);
        t.set(0, "seq", "7", 9);
        assert_eq!(
            sorted(&t),
            [
                ("k\"ey".into(), "{\"a\":[1,2]}".into(), 8),
                ("seq".into(), "7".into(), 9),
                ("temperature".into(), "\"é\u{1F600}\"".into(), 7)
            ]
        );
        assert_eq!(t.newest(), Some(9));
        assert_eq!(t.get("nope"), None);
        t.retain(|k| k != "seq");
        assert_eq!(t.len(), 2);
        assert_eq!(t.get("seq"), None);
        assert_eq!(t.get("temperature"), Some(("\"é\u{1F600}\"", 7)));
        t.clear();
        assert!(t.is_empty() && t.get("temperature").is_none());
    }

    #[test]
    fn short_compares_and_copies_agree_with_the_slice_ones() {
        let mut rng = fastrand::Rng::with_seed(4);
        for _ in 0..20_000 {
            let n = rng.usize(0..40);
            let a: Vec<u8> = (0..n).map(|_| rng.u8(b'a'..b'd')).collect();
            let mut b = a.clone();
            if n > 0 && rng.bool() {
                b[rng.usize(0..n)] = rng.u8(b'a'..b'd');
            }
            assert_eq!(same_bytes(&a, &b), a == b, "{a:?} {b:?}");
            let mut to = vec![0u8; n + 3];
            copy_bytes(&mut to[..n], &a);
            assert_eq!(&to[..n], &a[..]);
            assert_eq!(&to[n..], &[0, 0, 0]);
        }
    }

    /// Against a map, on random keys, value lengths and orders.
    #[test]
    fn behaves_as_a_map_of_key_to_last_value() {
        let mut rng = fastrand::Rng::with_seed(25);
        for _ in 0..200 {
            let mut t = Telemetry::default();
            let mut model: std::collections::BTreeMap<String, (String, Millis)> = Default::default();
            for step in 0..60 {
                let key = format!("k{}", rng.usize(0..8));
                let value = "9".repeat(rng.usize(1..12));
                t.set(rng.usize(0..10), &key, &value, step);
                model.insert(key, (value, step));
                if rng.usize(0..20) == 0 {
                    let drop = format!("k{}", rng.usize(0..8));
                    t.retain(|k| k != drop);
                    model.remove(&drop);
                }
                for (k, (v, at)) in &model {
                    assert_eq!(t.get(k), Some((v.as_str(), *at)));
                }
                assert_eq!(t.len(), model.len());
            }
        }
    }
}
