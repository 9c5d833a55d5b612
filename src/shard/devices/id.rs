//! [`DeviceId`]: the device table's key, a short id held inside the map's bucket.
//!
//! The table's key was a `Box<str>`: every look-up compared the id with the key's own
//! allocation, a cache miss per message (17.6 % of the `POST /ingest` samples, issue 25 item
//! 4). An id of up to [`INLINE`] bytes (the usual: `dev-000042`, a short serial) is now kept
//! in the key itself, zero-padded, so the compare reads the bucket it already loaded and
//! compares a few words without a call. A longer id (a UUID: 36 bytes) is kept on the heap
//! as before.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};

/// The longest id kept inline.
pub const INLINE: usize = 22;

/// A device id, inline up to [`INLINE`] bytes. 24 bytes, like the `Box<str>` (16) it
/// replaces plus the alignment a bucket had anyway.
#[derive(Clone)]
pub enum DeviceId {
    /// The id's length and its bytes, zero-padded (so two inline ids are equal exactly when
    /// their lengths and whole arrays are).
    Inline(u8, [u8; INLINE]),
    Heap(Box<str>),
}

impl DeviceId {
    pub fn new(id: &str) -> Self {
        match Packed::of(id) {
            Some(p) => DeviceId::Inline(p.len, p.bytes),
            None => DeviceId::Heap(id.into()),
        }
    }

    #[inline]
    pub fn as_str(&self) -> &str {
        match self {
            DeviceId::Inline(len, bytes) => {
                // SAFETY: the first `len` bytes were copied whole from a `&str` in `new`.
                unsafe { std::str::from_utf8_unchecked(&bytes[..*len as usize]) }
            }
            DeviceId::Heap(s) => s,
        }
    }
}

impl std::ops::Deref for DeviceId {
    type Target = str;
    #[inline]
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for DeviceId {
    #[inline]
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for DeviceId {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

/// Hashes as the `str` it holds (look-ups by `&str` find it: [`Borrow`]).
impl Hash for DeviceId {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl PartialEq for DeviceId {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (DeviceId::Inline(a, x), DeviceId::Inline(b, y)) => a == b && x == y,
            _ => self.as_str() == other.as_str(),
        }
    }
}

impl Eq for DeviceId {}

impl std::fmt::Debug for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for DeviceId {
    fn from(id: &str) -> Self {
        DeviceId::new(id)
    }
}

impl From<Box<str>> for DeviceId {
    fn from(id: Box<str>) -> Self {
        if id.len() <= INLINE {
            DeviceId::new(&id)
        } else {
            DeviceId::Heap(id)
        }
    }
}

impl From<&DeviceId> for Box<str> {
    fn from(id: &DeviceId) -> Self {
        id.as_str().into()
    }
}

/// A look-up key made once per look-up: the id packed as an inline [`DeviceId`] is, so
/// that comparing it with an inline key is a compare of two small arrays (no call, no
/// pointer followed). Hashes as the `str`.
pub struct Lookup<'a> {
    id: &'a str,
    packed: Option<Packed>,
}

#[derive(Clone, Copy)]
struct Packed {
    len: u8,
    bytes: [u8; INLINE],
}

impl Packed {
    #[inline]
    fn of(id: &str) -> Option<Packed> {
        let n = id.len();
        if n > INLINE {
            return None;
        }
        let mut bytes = [0u8; INLINE];
        bytes[..n].copy_from_slice(id.as_bytes());
        Some(Packed { len: n as u8, bytes })
    }
}

impl<'a> Lookup<'a> {
    #[inline]
    pub fn new(id: &'a str) -> Self {
        Lookup { id, packed: Packed::of(id) }
    }
}

impl Hash for Lookup<'_> {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state)
    }
}

impl hashbrown::Equivalent<DeviceId> for Lookup<'_> {
    #[inline]
    fn equivalent(&self, key: &DeviceId) -> bool {
        match (key, &self.packed) {
            (DeviceId::Inline(len, bytes), Some(p)) => *len == p.len && *bytes == p.bytes,
            // A long id is never inline, a short one never on the heap.
            (DeviceId::Inline(..), None) | (DeviceId::Heap(_), Some(_)) => false,
            (DeviceId::Heap(s), None) => **s == *self.id,
        }
    }
}

impl<'a> From<&Lookup<'a>> for DeviceId {
    #[inline]
    fn from(q: &Lookup<'a>) -> Self {
        match q.packed {
            Some(p) => DeviceId::Inline(p.len, p.bytes),
            None => DeviceId::Heap(q.id.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_ids_are_inline_long_ones_on_the_heap_and_all_are_found_by_str_and_lookup() {
        assert_eq!(std::mem::size_of::<DeviceId>(), 24);
        let ids: Vec<String> = ["", "d", "dev-000042", &"x".repeat(INLINE), &"y".repeat(INLINE + 1), "0f8fad5b-d9cb-469f-a165-70867728950e", "é😀"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut map: hashbrown::HashMap<DeviceId, usize> = hashbrown::HashMap::new();
        for (i, id) in ids.iter().enumerate() {
            let key = DeviceId::new(id);
            assert_eq!(matches!(key, DeviceId::Inline(..)), id.len() <= INLINE, "{id}");
            assert_eq!(key.as_str(), id);
            assert_eq!(DeviceId::from(Box::<str>::from(id.as_str())), key);
            map.insert(key, i);
        }
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(map.get(id.as_str()), Some(&i), "{id}");
            assert_eq!(map.get(&Lookup::new(id)), Some(&i), "{id}");
            // A prefix, a longer id, one byte changed: not found.
            let mut other = id.clone();
            other.push('z');
            assert_eq!(map.get(&Lookup::new(&other)), None);
            assert_eq!(map.get(other.as_str()), None);
            if !id.is_empty() && id.is_ascii() {
                assert_eq!(map.get(&Lookup::new(&id[..id.len() - 1])).is_some(), id.len() == 1, "{id}");
            }
        }
        // Inserted through a look-up key.
        let fresh = "dev-999999";
        *map.entry_ref(&Lookup::new(fresh)).or_default() = 99;
        assert_eq!(map.get(fresh), Some(&99));
        assert_eq!(map.get_key_value(fresh).map(|(k, _)| k.as_str()), Some(fresh));
    }
}
