//! The stitch of a hand-over (docs/design/recovery.md step 6, "a device active during the
//! hand-over"): what a stopping instance A's copy of a history took in after it was handed
//! over (its *tail*), joined to what the adopter B took in itself since, so that a device
//! sending through a deploy no longer voids its sessions' histories.
//!
//! Why it is exact: every frame here carries its device message's key `K` (step 9: the same
//! on every instance), and one device's messages reach a session's core in the order that
//! device's core applied them, on every instance (the same argument as `push::cut`). A's tail
//! holds, per device, messages published before B subscribed (B lacks them) followed by ones
//! after (B has them too); so, per device, the tail's frames B lacks must all come before the
//! first one B has, and the frames B lacks go before everything B took in (B's frames of
//! that device all follow them). Anything that does not fit that shape (a frame without a key,
//! a frame B lacks after one B has: a hole) refuses the stitch, and the history is voided as
//! before: never a replay with a hole or a frame twice.
//!
//! Bounds: the tail is sent only when it encodes within the history's own bound
//! (`adopt::blob_max`, the caller's); each side notes at most [`MAX_KEYS`] keys per session
//! while the handshake runs (a few seconds), past which the stitch is refused.

use std::sync::Arc;

use crate::ingest::MsgKey;

/// Keys noted per session during a hand-over, on either side (past it: no stitch).
pub const MAX_KEYS: usize = 65_536;

const VERSION: u8 = 1;

/// The largest tail sent, encoded: as a history's own bound (`cluster::adopt::blob_max`:
/// twice `--recovery-session-bytes`, a stream being trimmed to it, and 64 KiB).
pub fn tail_max(session_bytes: usize) -> usize {
    session_bytes.saturating_mul(2).saturating_add(64 << 10)
}

/// One frame of the tail: its device, its message's key, the frame.
#[derive(Debug, Clone, PartialEq)]
pub struct TailFrame {
    pub device: Box<str>,
    pub key: MsgKey,
    pub frame: Arc<str>,
}

/// Keys noted for a session while its hand-over runs (on A: its copy's frames after the
/// hand-over; on B: its own frames since it adopted), in stream order.
#[derive(Debug, Default)]
pub struct Noted {
    /// The stream's head when the noting began.
    pub head: u64,
    pub keys: Vec<(Arc<str>, MsgKey)>,
    /// More than [`MAX_KEYS`], or a frame without a key: no stitch.
    pub spoilt: bool,
}

impl Noted {
    pub fn new(head: u64) -> Self {
        Self { head, keys: Vec::new(), spoilt: false }
    }

    pub fn note(&mut self, device: &Arc<str>, key: MsgKey) {
        if self.spoilt {
            return;
        }
        if key == MsgKey::NONE || self.keys.len() >= MAX_KEYS {
            self.spoilt = true;
            self.keys = Vec::new();
            return;
        }
        self.keys.push((device.clone(), key));
    }
}

/// `version, count u32, per frame: device (u16 length + bytes), key ms i64, key n u64,
/// frame (u32 length + bytes)`.
pub fn encode(tail: &[TailFrame]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(5 + tail.iter().map(|t| 2 + t.device.len() + 16 + 4 + t.frame.len()).sum::<usize>());
    buf.push(VERSION);
    buf.extend_from_slice(&(tail.len() as u32).to_le_bytes());
    for t in tail {
        buf.extend_from_slice(&(t.device.len() as u16).to_le_bytes());
        buf.extend_from_slice(t.device.as_bytes());
        buf.extend_from_slice(&t.key.ms.to_le_bytes());
        buf.extend_from_slice(&t.key.n.to_le_bytes());
        buf.extend_from_slice(&(t.frame.len() as u32).to_le_bytes());
        buf.extend_from_slice(t.frame.as_bytes());
    }
    buf
}

/// What [`encode`] wrote; `None` for anything else.
pub fn decode(bytes: &[u8]) -> Option<Vec<TailFrame>> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (b.get(..n)?, b.get(n..)?);
        *b = rest;
        Some(head)
    }
    let mut b = bytes;
    if take(&mut b, 1)? != [VERSION] {
        return None;
    }
    let count = u32::from_le_bytes(take(&mut b, 4)?.try_into().ok()?) as usize;
    // Each frame takes at least 30 bytes: a count past what the bytes can hold is garbage.
    if count > b.len() / 30 + 1 {
        return None;
    }
    let mut tail = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u16::from_le_bytes(take(&mut b, 2)?.try_into().ok()?) as usize;
        let device = std::str::from_utf8(take(&mut b, len)?).ok()?.into();
        let ms = i64::from_le_bytes(take(&mut b, 8)?.try_into().ok()?);
        let n = u64::from_le_bytes(take(&mut b, 8)?.try_into().ok()?);
        let len = u32::from_le_bytes(take(&mut b, 4)?.try_into().ok()?) as usize;
        let frame = std::str::from_utf8(take(&mut b, len)?).ok()?.into();
        tail.push(TailFrame { device, key: MsgKey { ms, n }, frame });
    }
    b.is_empty().then_some(tail)
}

/// Which of A's `tail` frames the adopter lacks, given the keys of what it took in itself
/// since (`mine`), as indices into `tail` in order; `None` when they do not fit the shape the
/// module's doc gives (a keyless frame, or per device a frame B lacks after one B has).
pub fn missing(tail: &[TailFrame], mine: &[(Arc<str>, MsgKey)]) -> Option<Vec<usize>> {
    let have: hashbrown::HashSet<(&str, MsgKey)> = mine.iter().map(|(d, k)| (&**d, *k)).collect();
    // Devices of which the tail already gave a frame B has: nothing B lacks may follow.
    let mut joined: hashbrown::HashSet<&str> = hashbrown::HashSet::new();
    let mut out = Vec::new();
    for (i, t) in tail.iter().enumerate() {
        if t.key == MsgKey::NONE {
            return None;
        }
        if have.contains(&(&*t.device, t.key)) {
            joined.insert(&t.device);
        } else if joined.contains(&*t.device) {
            return None;
        } else {
            out.push(i);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> MsgKey {
        MsgKey { ms: 1_700_000_000_000, n }
    }

    fn frame(device: &str, n: u64) -> TailFrame {
        TailFrame { device: device.into(), key: key(n), frame: format!("{{\"deviceId\":\"{device}\",\"n\":{n}}}").into() }
    }

    fn mine(of: &[(&str, u64)]) -> Vec<(Arc<str>, MsgKey)> {
        of.iter().map(|(d, n)| (Arc::from(*d), key(*n))).collect()
    }

    #[test]
    fn tails_round_trip_and_garbage_does_not_decode() {
        let tail = vec![frame("dev-1", 1), frame("dév-2", 2)];
        let bytes = encode(&tail);
        assert_eq!(decode(&bytes), Some(tail));
        assert_eq!(decode(&encode(&[])), Some(vec![]));
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_none(), "{cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_none());
        let mut huge = vec![VERSION];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&huge).is_none());
    }

    #[test]
    fn the_frames_the_adopter_lacks_are_those_before_each_devices_first_shared_one() {
        // dev-1: 1, 2 published before B subscribed, 3 after; dev-2: 7 only before.
        let tail = vec![frame("dev-1", 1), frame("dev-2", 7), frame("dev-1", 2), frame("dev-1", 3)];
        assert_eq!(missing(&tail, &mine(&[("dev-1", 3), ("dev-1", 4)])), Some(vec![0, 1, 2]));
        assert_eq!(missing(&tail, &mine(&[])), Some(vec![0, 1, 2, 3]));
        assert_eq!(missing(&tail, &mine(&[("dev-1", 1), ("dev-1", 2), ("dev-1", 3), ("dev-2", 7)])), Some(vec![]));
    }

    #[test]
    fn a_hole_or_a_keyless_frame_refuses_the_stitch() {
        let tail = vec![frame("dev-1", 1), frame("dev-1", 2), frame("dev-1", 3)];
        // B has 2 but not 3, which came after it: a hole B's stream cannot place.
        assert_eq!(missing(&tail, &mine(&[("dev-1", 2)])), None);
        // Another device's frame is no reason.
        assert_eq!(missing(&tail, &mine(&[("dev-2", 2)])), Some(vec![0, 1, 2]));
        let mut keyless = tail.clone();
        keyless[1].key = MsgKey::NONE;
        assert_eq!(missing(&keyless, &mine(&[])), None);
    }

    #[test]
    fn noting_past_the_bound_or_a_keyless_frame_spoils() {
        let dev: Arc<str> = "dev-1".into();
        let mut noted = Noted::new(5);
        noted.note(&dev, key(1));
        assert_eq!(noted.keys.len(), 1);
        noted.note(&dev, MsgKey::NONE);
        assert!(noted.spoilt && noted.keys.is_empty());
        let mut full = Noted::new(0);
        for n in 0..MAX_KEYS as u64 {
            full.note(&dev, key(n));
        }
        assert!(!full.spoilt);
        full.note(&dev, key(u64::MAX));
        assert!(full.spoilt);
    }
}
