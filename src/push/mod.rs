//! Live push: what the device's core decides to send to whom, and the per-socket queues on
//! the socket's core.
//!
//! The device's core builds each envelope once (shared by every session whose filter gives
//! the same content) and posts per-core batches of [`Delivery`]s to the sessions' cores.
//! There each socket has an [`outlet::Outlet`]: a bounded queue its writer task drains in
//! coalesced writes, held back a bounded moment under load ([`linger`]). A session with a
//! recovery socket also keeps the [`stream`] of what it was given, for a client that comes back.
//!
//! It sits below the shard (`scripts/layers.toml`): the shard's fan-out produces deliveries
//! and its sessions hold outlets; push itself knows nothing of devices, grants or sessions'
//! state.

pub mod cut;
pub mod envelope;
pub mod linger;
pub mod outlet;
pub mod stitch;
pub mod stream;

use std::sync::Arc;

use crate::ids::SessionId;

/// What a frame carries, for the slow-consumer rules: telemetry may be conflated, the rest
/// is never dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    Telemetry,
    ConnectionState,
    DeviceTwin,
    Message,
}

/// One envelope for one session.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub session: SessionId,
    pub device: Arc<str>,
    pub kind: FrameKind,
    /// The JSON envelope `{deviceId, timestamp, <kind>}`.
    pub frame: Arc<str>,
    /// When the device message it carries reached hubcast; observed in
    /// `hubcast_delivery_duration_seconds` once the frame is written. `None` for frames no
    /// single message caused (throttled telemetry sent later, TTL expiry, a twin completed
    /// by a hub read): their wait is hubcast's own choice, not delivery latency.
    pub arrived: Option<crate::metrics::Arrival>,
    /// The key of the device message it carries ([`crate::ingest::MsgKey::NONE`] for frames
    /// no single message caused): the stream's device part names it (design step 10, [`cut`]).
    pub key: crate::ingest::MsgKey,
}
