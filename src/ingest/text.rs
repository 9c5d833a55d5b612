//! [`JsonText`]: a value's JSON text as a device sent it, kept as last value and carried to
//! subscribers, in a buffer it shares with the other values of its message.
//!
//! One allocation holds the values of one message ([`JsonText::share`]) instead of one per
//! value. Sharing can keep bytes alive after they are replaced: a last value keeps its whole
//! buffer, including values of its message that newer messages replaced. That is bounded:
//! values share a buffer only up to [`SHARED_BYTES`] in all, so a kept value keeps at most
//! that many bytes of other values alive (a value longer than that gets a buffer of its own).

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use smallvec::SmallVec;

/// The most bytes of values one shared buffer holds (see the module documentation).
pub const SHARED_BYTES: usize = 1024;

/// The JSON text of one value, in a buffer that may hold other values of its message.
/// Cheap to clone (a reference count); reads as `&str`.
#[derive(Clone)]
pub struct JsonText {
    buf: Arc<str>,
    start: u32,
    end: u32,
}

impl JsonText {
    /// A value in a buffer of its own.
    pub fn new(text: &str) -> Self {
        Self::whole(Arc::from(text))
    }

    /// A buffer that holds one value.
    pub fn whole(buf: Arc<str>) -> Self {
        let end = u32::try_from(buf.len()).expect("values are smaller than 4 GiB");
        Self { buf, start: 0, end }
    }

    pub fn as_str(&self) -> &str {
        &self.buf[self.start as usize..self.end as usize]
    }

    /// The values `texts`, in order, in as few buffers as [`SHARED_BYTES`] allows (one for a
    /// typical message). `scratch` is where a buffer is put together before it is copied
    /// into its allocation; it is left empty.
    pub fn share<'a>(texts: impl Iterator<Item = &'a str> + Clone, scratch: &mut String) -> SmallVec<[JsonText; 8]> {
        let mut out = SmallVec::new();
        let mut pending: SmallVec<[(u32, u32); 8]> = SmallVec::new();
        let flush = |scratch: &mut String, pending: &mut SmallVec<[(u32, u32); 8]>, out: &mut SmallVec<[JsonText; 8]>| {
            if pending.is_empty() {
                return;
            }
            let buf: Arc<str> = Arc::from(scratch.as_str());
            out.extend(pending.drain(..).map(|(start, end)| JsonText { buf: buf.clone(), start, end }));
            scratch.clear();
        };
        scratch.clear();
        for text in texts {
            if text.len() > SHARED_BYTES {
                flush(scratch, &mut pending, &mut out);
                out.push(JsonText::new(text));
                continue;
            }
            if scratch.len() + text.len() > SHARED_BYTES {
                flush(scratch, &mut pending, &mut out);
            }
            let start = scratch.len() as u32;
            scratch.push_str(text);
            pending.push((start, scratch.len() as u32));
        }
        flush(scratch, &mut pending, &mut out);
        out
    }
}

impl Deref for JsonText {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for JsonText {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for JsonText {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<String> for JsonText {
    fn from(text: String) -> Self {
        Self::whole(text.into())
    }
}

impl PartialEq for JsonText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for JsonText {}

impl PartialEq<str> for JsonText {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for JsonText {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl fmt::Debug for JsonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for JsonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_values_of_a_message_share_one_buffer_up_to_the_bound() {
        let mut scratch = String::new();
        let texts = ["21.5", "{\"lat\":1}", "true"];
        let shared = JsonText::share(texts.iter().copied(), &mut scratch);
        assert_eq!(shared.iter().map(|t| t.as_str()).collect::<Vec<_>>(), texts);
        assert!(shared.iter().all(|t| Arc::ptr_eq(&t.buf, &shared[0].buf)), "one buffer");
        assert!(scratch.is_empty());

        let half = "1".repeat(SHARED_BYTES / 2 + 1);
        let big = "2".repeat(SHARED_BYTES + 1);
        let texts = [half.as_str(), "3", half.as_str(), big.as_str(), "4"];
        let shared = JsonText::share(texts.iter().copied(), &mut scratch);
        assert_eq!(shared.iter().map(|t| t.as_str()).collect::<Vec<_>>(), texts);
        assert!(Arc::ptr_eq(&shared[0].buf, &shared[1].buf));
        assert!(!Arc::ptr_eq(&shared[1].buf, &shared[2].buf), "the bound starts a new buffer");
        assert_eq!(shared[3].buf.len(), big.len(), "a value beyond the bound has its own");
        assert!(shared.iter().all(|t| t.buf.len() <= SHARED_BYTES || t.buf.len() == big.len()));
        assert!(JsonText::share(std::iter::empty(), &mut scratch).is_empty());
    }
}
