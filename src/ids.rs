//! Identifiers: session ids, random tokens and the routing hash.
//!
//! A session id is 128 random bits printed as 22 URL-safe base64 characters. It is the only
//! credential a browser holds, so it must be unguessable; inside the server it is a `u128`,
//! which makes it `Copy` and cheap to hash on every core.

use std::fmt;
use std::hash::{BuildHasher, Hash};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u128);

impl SessionId {
    pub fn generate() -> Self {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).expect("the OS random source failed");
        SessionId(u128::from_le_bytes(bytes))
    }

    /// Parses the printed form; anything else cannot name a session.
    pub fn parse(s: &str) -> Option<Self> {
        if s.len() != 22 {
            return None;
        }
        let mut bytes = [0u8; 16];
        let n = URL_SAFE_NO_PAD.decode_slice(s.as_bytes(), &mut bytes).ok()?;
        (n == 16).then(|| SessionId(u128::from_le_bytes(bytes)))
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0u8; 22];
        let n = URL_SAFE_NO_PAD
            .encode_slice(self.0.to_le_bytes(), &mut out)
            .expect("16 bytes encode to 22 characters");
        f.write_str(std::str::from_utf8(&out[..n]).expect("base64 is ASCII"))
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({self})")
    }
}

/// A session id as a map key aligned to 8 bytes: a `u128` aligns to 16, which pads every
/// entry of a map keyed by it (issue 25 item 3: one access entry per session per device).
/// Hashes as the [`SessionId`] it holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct SessionKey(u64, u64);

impl SessionKey {
    pub fn of(s: SessionId) -> Self {
        SessionKey(s.0 as u64, (s.0 >> 64) as u64)
    }

    pub fn id(self) -> SessionId {
        SessionId(self.0 as u128 | (self.1 as u128) << 64)
    }
}

impl Hash for SessionKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.id().hash(h);
    }
}

impl From<SessionId> for SessionKey {
    fn from(s: SessionId) -> Self {
        Self::of(s)
    }
}

/// A random URL-safe token of `bytes` random bytes (used for generated admin secrets).
pub fn random_token(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).expect("the OS random source failed");
    URL_SAFE_NO_PAD.encode(buf)
}

/// The one hash every core uses to decide who owns a key: fixed seed, so all threads agree.
pub fn stable_hash<T: Hash + ?Sized>(value: &T) -> u64 {
    foldhash::fast::FixedState::with_seed(0x6875_6263_6173_7421).hash_one(value)
}

/// Core owning a device: its ingest, last values, grants and subscriber list. The one place
/// that decides which core owns a key (Seastar's `shard_of`), with [`core_of_session`]; here in
/// the base layer because the store re-shards with it too.
pub fn core_of_device(device_id: &str, cores: usize) -> usize {
    (stable_hash(device_id) % cores as u64) as usize
}

/// Core owning a session record (existence, activity, sockets).
pub fn core_of_session(session: SessionId, cores: usize) -> usize {
    (stable_hash(&session.0) % cores as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_round_trip_and_are_url_safe() {
        for _ in 0..100 {
            let id = SessionId::generate();
            let s = id.to_string();
            assert_eq!(s.len(), 22);
            assert!(s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
            assert_eq!(SessionId::parse(&s), Some(id));
        }
        assert_eq!(SessionId::parse("short"), None);
        assert_eq!(SessionId::parse("!!!!!!!!!!!!!!!!!!!!!!"), None);
    }

    /// The 8-aligned key gives back the id and hashes as it (the same map order and cost).
    #[test]
    fn session_keys_round_trip_and_hash_as_the_id() {
        for id in [SessionId(0), SessionId(u128::MAX), SessionId(1 << 64 | 7), SessionId::generate()] {
            let key = SessionKey::of(id);
            assert_eq!(key.id(), id);
            assert_eq!(stable_hash(&key), stable_hash(&id));
        }
        assert_eq!(std::mem::align_of::<SessionKey>(), 8);
    }
}
