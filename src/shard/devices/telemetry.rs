//! [`Telemetry`]: a device's last telemetry values in one small buffer, rewritten in place.
//!
//! The hot part of a device entry on the ingest path (issue 25 item 4). Before, each device
//! held a hash map of boxed keys to shared value texts: every message hashed each key, read
//! each key from its own allocation to compare it, allocated one buffer for the message's
//! values and freed the one it replaced, the reference count of which was read from yet
//! another line. Here the keys and value texts of a device sit back to back, after a small
//! array of entries (where each key and value is, and its time), in one allocation:
//!
//! - a message with the keys it had before (the usual case) finds each at the position it
//!   had, compares it in place, and copies its value over the old one: no hashing, no
//!   allocation, two or three adjacent cache lines touched per device;
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
    /// Where the key starts in the text; its value slot follows it.
    key: u32,
    key_len: u32,
    /// The value's length; its slot reaches the next entry's key (or the end of the text).
    len: u32,
    at: Millis,
}

/// Words an entry takes in [`Telemetry::words`].
const ENTRY_WORDS: usize = 3;

/// A device's last telemetry values: key → (value as the JSON text the device sent, time).
///
/// One allocation (issue 25 item 4: the entries and the text were two, two more cache misses
/// per message): `words[0]` holds the entry count (low 32 bits) and the text's length (high),
/// then each entry in three words (key offset | key length << 32, value length, time), then
/// the text, keys and value slots back to back, as bytes (the last word zero-padded).
#[derive(Default, Clone)]
pub struct Telemetry {
    words: Vec<u64>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter().map(|(k, v, at)| (k, (v, at)))).finish()
    }
}

/// Words holding `n` entries and `text` bytes.
fn words_for(n: usize, text: usize) -> usize {
    1 + n * ENTRY_WORDS + text.div_ceil(8)
}

impl Telemetry {
    pub fn len(&self) -> usize {
        self.words.first().map_or(0, |w| *w as u32 as usize)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn text_len(&self) -> usize {
        self.words.first().map_or(0, |w| (*w >> 32) as usize)
    }

    /// Drops every value and the buffer.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    #[inline]
    fn entry(&self, i: usize) -> Entry {
        let w = &self.words[1 + i * ENTRY_WORDS..1 + (i + 1) * ENTRY_WORDS];
        Entry { key: w[0] as u32, key_len: (w[0] >> 32) as u32, len: w[1] as u32, at: w[2] as i64 }
    }

    #[inline]
    fn put_entry(words: &mut [u64], i: usize, e: Entry) {
        let w = &mut words[1 + i * ENTRY_WORDS..1 + (i + 1) * ENTRY_WORDS];
        w[0] = u64::from(e.key) | u64::from(e.key_len) << 32;
        w[1] = u64::from(e.len);
        w[2] = e.at as u64;
    }

    /// The text: keys and value slots.
    #[inline]
    fn text(&self) -> &[u8] {
        let (n, len) = (self.len(), self.text_len());
        if self.words.is_empty() {
            return &[];
        }
        let words = &self.words[1 + n * ENTRY_WORDS..];
        assert!(words.len() * 8 >= len, "the text fits its words");
        // SAFETY: `words` is initialised memory of at least `len` bytes (checked above), and
        // any bytes are valid `u8`s; the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) }
    }

    #[inline]
    fn text_mut(&mut self) -> &mut [u8] {
        let (n, len) = (self.len(), self.text_len());
        if self.words.is_empty() {
            return &mut [];
        }
        let words = &mut self.words[1 + n * ENTRY_WORDS..];
        assert!(words.len() * 8 >= len, "the text fits its words");
        // SAFETY: as in `text`, borrowed mutably from `self`.
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
    }

    fn str_at(&self, start: u32, len: u32) -> &str {
        let bytes = &self.text()[start as usize..(start + len) as usize];
        // SAFETY: every range an entry names (a key, or a value's first `len` bytes) was
        // copied whole from a `&str` by `set`/`rebuild` and not written since but by another
        // whole `&str` of that length; the spare bytes of a slot are never read as text.
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }

    /// Where entry `i`'s value slot ends.
    fn slot_end(&self, i: usize) -> usize {
        if i + 1 < self.len() {
            self.entry(i + 1).key as usize
        } else {
            self.text_len()
        }
    }

    #[inline]
    fn find(&self, key: &str, hint: usize) -> Option<usize> {
        let key = key.as_bytes();
        let n = self.len();
        let text = self.text();
        let matches = |i: usize| {
            let e = self.entry(i);
            e.key_len as usize == key.len() && same_bytes(&text[e.key as usize..(e.key + e.key_len) as usize], key)
        };
        if hint < n && matches(hint) {
            return Some(hint);
        }
        (0..n).find(|&i| matches(i))
    }

    /// The value of `key` and its time.
    pub fn get(&self, key: &str) -> Option<(&str, Millis)> {
        let e = self.entry(self.find(key, 0)?);
        Some((self.str_at(e.key + e.key_len, e.len), e.at))
    }

    /// Every key with its value and time, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, Millis)> + Clone + '_ {
        (0..self.len()).map(|i| {
            let e = self.entry(i);
            (self.str_at(e.key, e.key_len), self.str_at(e.key + e.key_len, e.len), e.at)
        })
    }

    /// The newest time of any value.
    pub fn newest(&self) -> Option<Millis> {
        (0..self.len()).map(|i| self.entry(i).at).max()
    }

    /// Sets `key` to `value` at `at`. `hint`: where the key probably is (its index in the
    /// message, for a message in the stored order); any index is correct.
    pub fn set(&mut self, hint: usize, key: &str, value: &str, at: Millis) {
        match self.find(key, hint) {
            Some(i) => {
                let mut e = self.entry(i);
                let start = (e.key + e.key_len) as usize;
                if start + value.len() <= self.slot_end(i) {
                    copy_bytes(&mut self.text_mut()[start..start + value.len()], value.as_bytes());
                    e.len = value.len() as u32;
                    e.at = at;
                    Self::put_entry(&mut self.words, i, e);
                } else {
                    self.rebuild(Some(i), value, at, None);
                }
            }
            None => self.rebuild(None, value, at, Some(key)),
        }
    }

    /// Writes the buffer again: with entry `grown`'s new `value`, whose slot gets a quarter of
    /// its length (at least 2 bytes) to spare, or with `added` appended with `value`; the
    /// other slots are shrunk to their values.
    fn rebuild(&mut self, grown: Option<usize>, value: &str, at: Millis, added: Option<&str>) {
        let n = self.len();
        let room = value.len() / 4 + 2;
        let kept = |i: usize| if grown == Some(i) { 0 } else { self.entry(i).len as usize };
        let mut size: usize = (0..n).map(|i| self.entry(i).key_len as usize + kept(i)).sum();
        match added {
            Some(key) => size += key.len() + value.len(),
            None => size += value.len() + room,
        }
        assert!(size <= u32::MAX as usize, "a device's telemetry text is below 4 GiB");
        let count = n + added.is_some() as usize;
        let mut words = vec![0u64; words_for(count, size)];
        words[0] = count as u64 | (size as u64) << 32;
        let mut text: Vec<u8> = Vec::with_capacity(size);
        let old = self.text();
        for i in 0..n {
            let mut e = self.entry(i);
            let key_at = text.len() as u32;
            text.extend_from_slice(&old[e.key as usize..(e.key + e.key_len) as usize]);
            if grown == Some(i) {
                text.extend_from_slice(value.as_bytes());
                text.resize(text.len() + room, b' ');
                e.len = value.len() as u32;
                e.at = at;
            } else {
                let v = (e.key + e.key_len) as usize;
                text.extend_from_slice(&old[v..v + e.len as usize]);
            }
            e.key = key_at;
            Self::put_entry(&mut words, i, e);
        }
        if let Some(key) = added {
            let key_at = text.len() as u32;
            text.extend_from_slice(key.as_bytes());
            text.extend_from_slice(value.as_bytes());
            Self::put_entry(&mut words, n, Entry { key: key_at, key_len: key.len() as u32, len: value.len() as u32, at });
        }
        debug_assert_eq!(text.len(), size);
        for (w, chunk) in words[1 + count * ENTRY_WORDS..].iter_mut().zip(text.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_ne_bytes(b);
        }
        self.words = words;
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
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
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
        // One allocation, one pointer in the device entry (was two `Vec`s: 48 bytes).
        assert_eq!(std::mem::size_of::<Telemetry>(), 24);
        let mut t = Telemetry::default();
        t.set(0, "temperature", "21.5", 1);
        t.set(1, "seq", "9", 1);
        assert_eq!(t.get("temperature"), Some(("21.5", 1)));
        let (ptr, cap) = (t.words.as_ptr(), t.words.capacity());
        // Same length and shorter: in place, no reallocation.
        t.set(0, "temperature", "22.0", 2);
        t.set(1, "seq", "8", 2);
        t.set(0, "temperature", "3", 3);
        assert_eq!((t.words.as_ptr(), t.words.capacity()), (ptr, cap));
        assert_eq!(t.get("temperature"), Some(("3", 3)));
        assert_eq!(t.get("seq"), Some(("8", 2)));
        // Longer than its slot: rebuilt once with room, the next digits fit.
        t.set(1, "seq", "10", 4);
        assert_eq!(t.get("seq"), Some(("10", 4)));
        let len = t.text_len();
        t.set(1, "seq", "11", 5);
        t.set(1, "seq", "100", 6);
        assert_eq!(t.text_len(), len, "the grown slot kept room");
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
