//! The offset's *device part* (design docs/design/recovery.md, step 10 as built): where a
//! session's client stands in device terms, so that another instance can rebuild what it
//! missed from device rings after the client's instance died (`kill -9`, step 11).
//!
//! Why per device and not one watermark over keys: a message's key `K` is given where it
//! enters (an arrival counter per thread, a partition's sequence number), so keys reach a
//! session's core in no order a single number could cut; but one device's messages reach it
//! in the order their device's core applied them, on every instance that had them (one core
//! per device, FIFO queues from the source to the session's core). So a cut per device, the
//! key of the last frame of that device in the stream, names exactly what the client has of
//! it, and the device's ring on another instance is in the same order.
//!
//! Shape: `h1.<epoch>.<seq>` then, per device with a frame in this stream epoch,
//! `.<device hash>-<key hash>` (base 36, 32-bit FNV-1a of the id and a 32-bit mix of `K`);
//! `.<device hash>-` when its last frame had no key (a throttled merge sent later, a TTL's
//! disconnect, a twin a hub read completed: nothing a ring holds); `.x` alone once more than
//! [`MAX_DEVICES`] devices gave frames (the part would grow past ~130 bytes an event: that
//! stream cannot be rebuilt elsewhere, an honest `history_lost`). Both hashes are checked
//! where they are read: two subscribed devices with one hash, or two ring entries of a device
//! with one key hash, fail the rebuild rather than guess.
//!
//! Cost: only with `--redis-url` and a recovery window (a single instance has no one to
//! rebuild on): per delivery to a streamed session, a hash of the device id, a look-up in at
//! most 8 pairs and, per socket, a copy of the 68-byte [`Cuts`] into its queue's parts; the
//! writer writes the text into the frame from the stack ([`Cuts::encode`]): no allocation
//! (docs/benchmarks/2026-11-28-recovery-fanout-cost.md).

use crate::ingest::MsgKey;

/// Devices a part names at most; past it the stream's part is `.x`.
pub const MAX_DEVICES: usize = 8;

/// 32-bit FNV-1a of a device id.
pub fn device_hash(id: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in id.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// A 32-bit mix of a key; never 0 (0 is "no key"). `None` for [`MsgKey::NONE`].
pub fn key_hash(k: MsgKey) -> Option<u32> {
    if k == MsgKey::NONE {
        return None;
    }
    let mut x = (k.ms as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ k.n.rotate_left(29);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    Some(((x >> 32) as u32 ^ x as u32).max(1))
}

/// The cut of one stream epoch: per device, its last frame's key hash (0: no key). `Copy`
/// and 68 bytes: what a delivery hands to its socket's queue is a copy of it (no
/// allocation), and the writer writes its text straight into the frame ([`Cuts::encode`]).
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cuts {
    devices: [(u32, u32); MAX_DEVICES],
    len: u8,
    overflow: bool,
}

/// The longest part: [`MAX_DEVICES`] times `.` + 7 digits + `-` + 7 digits.
pub const PART_BYTES: usize = MAX_DEVICES * 16;

/// A part's text on the stack ([`Cuts::encode`]).
pub struct PartText {
    buf: [u8; PART_BYTES],
    len: u8,
}

impl PartText {
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }

    /// A part's text as given (at most [`PART_BYTES`], cut there).
    pub fn from_bytes(text: &[u8]) -> PartText {
        let mut t = PartText { buf: [0; PART_BYTES], len: 0 };
        t.push(&text[..text.len().min(PART_BYTES)]);
        t
    }

    fn push(&mut self, bytes: &[u8]) {
        let at = usize::from(self.len);
        self.buf[at..at + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len() as u8;
    }
}

impl Cuts {
    /// Notes a frame of `device` with `key`; returns the part its offset carries (a copy:
    /// the writer makes its text, [`Cuts::encode`]).
    #[inline]
    pub fn note(&mut self, device: &str, key: MsgKey) -> Cuts {
        self.note_only(device, key);
        *self
    }

    /// [`Cuts::note`] without the copy (a session with no socket connected).
    pub fn note_only(&mut self, device: &str, key: MsgKey) {
        if !self.overflow {
            let dh = device_hash(device);
            let kh = key_hash(key).unwrap_or(0);
            let len = usize::from(self.len);
            match self.devices[..len].iter().position(|(d, _)| *d == dh) {
                Some(i) => self.devices[i].1 = kh,
                None if len < MAX_DEVICES => {
                    self.devices[len] = (dh, kh);
                    self.len += 1;
                }
                None => *self = Cuts { overflow: true, ..Cuts::default() },
            }
        }
    }

    /// The cuts a client's offset names (a stream rebuilt on another instance goes on from
    /// them: step 11).
    pub fn from_part(part: &DevicePart) -> Cuts {
        match part {
            DevicePart::Overflow => Cuts { overflow: true, ..Cuts::default() },
            DevicePart::Absent => Cuts::default(),
            DevicePart::Cuts(c) => {
                let mut cuts = Cuts::default();
                for (d, k) in c.iter().take(MAX_DEVICES) {
                    cuts.devices[usize::from(cuts.len)] = (*d, k.unwrap_or(0));
                    cuts.len += 1;
                }
                cuts
            }
        }
    }

    /// The part's text (starting with `.`), on the stack.
    pub fn encode(&self) -> PartText {
        let mut t = PartText { buf: [0; PART_BYTES], len: 0 };
        if self.overflow {
            t.push(b".x");
            return t;
        }
        for (dh, kh) in &self.devices[..usize::from(self.len)] {
            t.push(b".");
            t.push(super::stream::Base36::with_suffix(u64::from(*dh), b"-").as_bytes());
            if *kh != 0 {
                t.push(super::stream::Base36::new(u64::from(*kh)).as_bytes());
            }
        }
        t
    }

    /// The part's text.
    pub fn text(&self) -> String {
        String::from_utf8(self.encode().as_bytes().to_vec()).expect("ASCII")
    }
}

/// A device part as read back from an offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DevicePart {
    /// The offset has none (recovery without `--redis-url`, or an offset of a replay).
    Absent,
    /// More than [`MAX_DEVICES`] devices: the stream cannot be rebuilt.
    Overflow,
    /// `(device hash, key hash)`; `None`: that device's last frame had no key.
    Cuts(Vec<(u32, Option<u32>)>),
}

impl DevicePart {
    /// The cut of the device named `id`: `None` when the part does not name it, `Some(None)`
    /// when its last frame had no key, `Some(Some(hash))` the last frame's key hash.
    pub fn cut_of(&self, id: &str) -> Option<&Option<u32>> {
        let dh = device_hash(id);
        match self {
            DevicePart::Cuts(c) => c.iter().find(|(d, _)| *d == dh).map(|(_, k)| k),
            _ => None,
        }
    }
}

/// Parses what follows `h1.<epoch>.<seq>` (`rest`: the offset's dot-separated items after
/// the seq). `None` when it is not a part hubcast writes.
pub fn parse_part<'a>(rest: impl Iterator<Item = &'a str>) -> Option<DevicePart> {
    let mut cuts = Vec::new();
    let mut overflow = false;
    for item in rest {
        if item == "x" {
            overflow = true;
            continue;
        }
        let (dh, kh) = item.split_once('-')?;
        let dh = u32::try_from(super::stream::parse_base36(dh)?).ok()?;
        let kh = match kh {
            "" => None,
            kh => Some(u32::try_from(super::stream::parse_base36(kh)?).ok().filter(|k| *k != 0)?),
        };
        cuts.push((dh, kh));
    }
    Some(match (overflow, cuts.is_empty()) {
        (true, true) => DevicePart::Overflow,
        (true, false) => return None,
        (false, true) => DevicePart::Absent,
        (false, false) if cuts.len() > MAX_DEVICES => return None,
        (false, false) => DevicePart::Cuts(cuts),
    })
}

/// The device part of a whole offset (`None`: not an offset hubcast gave), read once
/// ([`super::stream::parse_offset_with_part`]); only a restore calls it.
pub fn device_part(offset: &str) -> Option<DevicePart> {
    super::stream::parse_offset_with_part(offset).map(|(_, _, part)| part)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ms: i64, n: u64) -> MsgKey {
        MsgKey { ms, n }
    }

    #[test]
    fn a_part_names_each_device_once_with_its_last_key_and_reads_back() {
        let mut c = Cuts::default();
        c.note("d1", key(1, 1));
        c.note("d2", key(2, 2));
        let text = c.note("d1", key(3, 3)).text();
        let offset = format!("h1.ab.7{text}");
        assert_eq!(crate::push::stream::parse_offset(&offset), Some((36 * 10 + 11, 7)));
        let part = device_part(&offset).unwrap();
        assert_eq!(part.cut_of("d1"), Some(&key_hash(key(3, 3))));
        assert_eq!(part.cut_of("d2"), Some(&key_hash(key(2, 2))));
        assert_eq!(part.cut_of("d3"), None);
    }

    #[test]
    fn a_frame_without_a_key_voids_its_device_until_its_next_keyed_frame() {
        let mut c = Cuts::default();
        c.note("d1", key(1, 1));
        let text = c.note("d1", MsgKey::NONE).text();
        let part = device_part(&format!("h1.1.2{text}")).unwrap();
        assert_eq!(part.cut_of("d1"), Some(&None));
        let text = c.note("d1", key(5, 5)).text();
        assert_eq!(device_part(&format!("h1.1.3{text}")).unwrap().cut_of("d1"), Some(&key_hash(key(5, 5))));
    }

    #[test]
    fn past_eight_devices_the_part_is_x_and_stays_so() {
        let mut c = Cuts::default();
        for i in 0..MAX_DEVICES {
            c.note(&format!("d{i}"), key(1, i as u64));
        }
        assert_ne!(c.text(), ".x");
        assert_eq!(c.note("d-last", key(1, 99)).text(), ".x");
        assert_eq!(c.note("d0", key(2, 1)).text(), ".x");
        assert_eq!(device_part("h1.1.9.x"), Some(DevicePart::Overflow));
    }

    #[test]
    fn a_stream_rebuilt_from_an_offset_goes_on_from_its_cuts() {
        let mut c = Cuts::default();
        c.note("d1", key(1, 1));
        let text = c.note("d2", MsgKey::NONE).text();
        let offset = format!("h1.1.2{text}");
        let mut rebuilt = Cuts::from_part(&device_part(&offset).unwrap());
        assert_eq!(rebuilt.text(), text);
        let next = rebuilt.note("d2", key(3, 3));
        assert_eq!(next, c.note("d2", key(3, 3)));
        let s = crate::push::stream::SessionStream::continuing(1, 2, Default::default(), std::time::Instant::now());
        assert_eq!((s.epoch(), s.head(), s.first_seq()), (1, 2, 3));
    }

    #[test]
    fn offsets_without_a_part_or_with_a_foreign_one() {
        assert_eq!(device_part("h1.1.9"), Some(DevicePart::Absent));
        assert_eq!(device_part("h1.1.9.zz"), None);
        assert_eq!(device_part("h1.1.9.a-0"), None);
        assert_eq!(device_part("h1.1.9.x.a-b"), None);
        assert_eq!(crate::push::stream::parse_offset("h1.1.9.zz"), None);
        assert!(key_hash(MsgKey::NONE).is_none());
        assert!(key_hash(key(0, 0)).is_some_and(|k| k != 0));
    }
    #[test]
    fn the_longest_part_fits_its_stack_text_and_reads_back() {
        // Eight devices whose hashes are the largest u32s (7 base-36 digits each): 128 bytes.
        let mut c = Cuts::default();
        for i in 0..MAX_DEVICES as u32 {
            c.devices[i as usize] = (u32::MAX - i, u32::MAX - i);
            c.len += 1;
        }
        let text = c.encode();
        assert_eq!(text.as_bytes().len(), PART_BYTES);
        let Some(DevicePart::Cuts(read)) = device_part(&format!("h1.1.9{}", c.text())) else { panic!("reads back") };
        assert_eq!(read, (0..MAX_DEVICES as u32).map(|i| (u32::MAX - i, Some(u32::MAX - i))).collect::<Vec<_>>());
        assert_eq!(Cuts::from_part(&DevicePart::Cuts(read)), c);
    }
}
