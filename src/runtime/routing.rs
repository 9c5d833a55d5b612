//! The one place that decides which core owns a key (Seastar's `shard_of`).

use crate::ids::{stable_hash, SessionId};

/// Core owning a device: its ingest, last values, grants and subscriber list.
pub fn core_of_device(device_id: &str, cores: usize) -> usize {
    (stable_hash(device_id) % cores as u64) as usize
}

/// Core owning a session record (existence, activity, sockets).
pub fn core_of_session(session: SessionId, cores: usize) -> usize {
    (stable_hash(&session.0) % cores as u64) as usize
}
