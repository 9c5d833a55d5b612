//! A core's shard of the state: the devices it owns (last values, grants, subscriber lists)
//! and the sessions it owns. Only the owning core's thread ever touches a shard.
//!
//! The operations other cores may request are the closed set [`DeviceOp`] / [`SessionOp`].
//! What changed is handed to a durable store as [`change::Change`]s; the store engines
//! (`src/store`) sit above and name the shard's types, never the other way round.

pub mod access;
pub mod change;
pub mod devices;
pub mod listing;
pub mod sessions;

use crate::ids::SessionId;
use crate::model::{Grant, Subscription};
pub use access::{Grants, Subscriptions};

pub use devices::DeviceTable;
pub use sessions::SessionTable;
pub use crate::config::TwinCacheTtl;

/// Who is reading: the admin key (no grant checks) or a session (grants checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Viewer {
    Admin,
    Session(SessionId),
}

/// The answer channel a request carries: each operation answers its own caller, with its
/// own type, so no caller ever has to guess what came back.
pub type Reply<T> = futures_channel::oneshot::Sender<T>;

/// Why a read is refused, typed: the REST layer turns it into a status and a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// The session holds no grant covering the read.
    Forbidden,
    /// Nothing is known.
    NotFound,
}

/// A read's answer: the data, or why not.
pub type Read<T> = Result<T, Denial>;

/// A read answered from this instance's copy: the view, when the device's newest data here
/// was produced, and whether the copy is current (scale-out: when it is not, another
/// instance may hold newer data and is asked; one instance: always current).
#[derive(Debug, Clone, PartialEq)]
pub struct Local<T> {
    pub view: T,
    pub newest: crate::timefmt::Millis,
    pub current: bool,
}

/// Last telemetry as read from a device (the REST layer renders it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TelemetryView {
    /// One key: its value (JSON text) and time.
    One { key: Box<str>, json: crate::ingest::JsonText, at: crate::timefmt::Millis },
    /// Every key the viewer may see, each with its value and time.
    All(Vec<(Box<str>, crate::ingest::JsonText, crate::timefmt::Millis)>),
}

/// A twin as read from a device.
#[derive(Debug, Clone, PartialEq)]
pub struct TwinView {
    pub doc: serde_json::Value,
    pub at: crate::timefmt::Millis,
}

/// A connection state as read from a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionView {
    pub connected: bool,
    pub at: crate::timefmt::Millis,
}

/// An operation on one device, run on the device's core; those with a reply answer it there.
#[derive(Debug)]
pub enum DeviceOp {
    Grant { device: Box<str>, session: SessionId, grant: Grant, done: Reply<()> },
    Revoke { device: Box<str>, session: SessionId, grant: Grant, done: Reply<()> },
    /// Whether a grant permitted it.
    Subscribe { device: Box<str>, session: SessionId, sub: Subscription, permitted: Reply<bool> },
    Unsubscribe { device: Box<str>, session: SessionId, sub: Subscription, permitted: Reply<bool> },
    /// Last telemetry: one key, or all keys (`key: None`).
    ReadTelemetry { device: Box<str>, key: Option<Box<str>>, viewer: Viewer, reply: Reply<Read<Local<TelemetryView>>> },
    DeleteTelemetry { device: Box<str>, viewer: Viewer, reply: Reply<Read<()>> },
    /// The twin known from the event stream (a session needs a `deviceTwin` grant).
    ReadTwin { device: Box<str>, viewer: Viewer, reply: Reply<Read<Local<TwinView>>> },
    /// The cached connection state (`NotFound`: none known; with an IoT Hub, ask it).
    ReadConnectionState { device: Box<str>, viewer: Viewer, reply: Reply<Read<Local<ConnectionView>>> },
    /// Whether the session holds a grant covering `grant` (direct methods, desired properties).
    CheckGrant { device: Box<str>, session: SessionId, grant: Grant, permitted: Reply<bool> },
    /// The session is gone: drop its grants and subscriptions on this device.
    ForgetSession { device: Box<str>, session: SessionId },
    /// IoT Hub configured: the cached twin if a hub read is fresh per `ttl`, `None` when the
    /// hub must be asked (the viewer's grant is checked first).
    ReadHubTwin { device: Box<str>, viewer: Viewer, ttl: TwinCacheTtl, reply: Reply<Read<Option<TwinView>>> },
    /// A twin read from (or returned by) the IoT Hub: cache it; answers with the twin served.
    StoreHubTwin { device: Box<str>, doc: serde_json::Value, reply: Reply<TwinView> },
    /// Scale-out (src/cluster): the session's whole access here, as an instance decided it,
    /// at the session's version `v` in Redis: applied only if newer than the access held
    /// (0: unversioned, always applied).
    SetAccess { device: Box<str>, session: SessionId, access: Option<(Grants, Subscriptions)>, v: u64, done: Option<Reply<()>> },
    /// Scale-out: the session's access here (`None`: nothing), replicated after a change.
    ReadAccess { device: Box<str>, session: SessionId, reply: Reply<Option<(Grants, Subscriptions)>> },
    /// Scale-out: whether the session has a live socket on this instance, so that this
    /// instance watches the devices it subscribes to ([`DeviceTable::take_watch_changes`]).
    Presence { device: Box<str>, session: SessionId, here: bool },
}

impl DeviceOp {
    pub fn device(&self) -> &str {
        match self {
            DeviceOp::Grant { device, .. }
            | DeviceOp::Revoke { device, .. }
            | DeviceOp::Subscribe { device, .. }
            | DeviceOp::Unsubscribe { device, .. }
            | DeviceOp::ReadTelemetry { device, .. }
            | DeviceOp::DeleteTelemetry { device, .. }
            | DeviceOp::ReadTwin { device, .. }
            | DeviceOp::ReadConnectionState { device, .. }
            | DeviceOp::CheckGrant { device, .. }
            | DeviceOp::ForgetSession { device, .. }
            | DeviceOp::ReadHubTwin { device, .. }
            | DeviceOp::StoreHubTwin { device, .. }
            | DeviceOp::SetAccess { device, .. }
            | DeviceOp::ReadAccess { device, .. }
            | DeviceOp::Presence { device, .. } => device,
        }
    }
}

/// Builds a request with a fresh reply channel: `ask(|reply| DeviceOp::ReadTwin { .., reply })`
/// gives the operation to send and the receiver of its typed answer.
pub fn ask<T>(make: impl FnOnce(Reply<T>) -> DeviceOp) -> (DeviceOp, futures_channel::oneshot::Receiver<T>) {
    let (tx, rx) = futures_channel::oneshot::channel();
    (make(tx), rx)
}

/// An operation on one session, run on the session's core; each answers its own caller.
#[derive(Debug)]
pub enum SessionOp {
    /// Opens a session with this id; `false`: the process holds `maxSessions` already.
    Create { id: SessionId, created: Reply<bool> },
    /// Ends a session (its sockets close); whether it existed.
    Delete { id: SessionId, found: Reply<bool> },
    /// Ends every session this core owns; whether there was any.
    DeleteAll { any: Reply<bool> },
    /// Checks the session exists and keeps it alive; remembers the devices of `ops` when
    /// `register_devices` (grants), then sends `ops` to their devices' cores (each answers its
    /// own caller; without the session they are dropped unanswered). Answers whether it exists.
    Scoped { session: SessionId, register_devices: bool, ops: Vec<DeviceOp>, found: Reply<bool> },
    /// One page of this core's devices (the console's `GET /devices`; see `listing`).
    ListDevices { request: listing::PageRequest, page: Reply<listing::Page> },
}

/// [`ask`] for session operations.
pub fn ask_session<T>(make: impl FnOnce(Reply<T>) -> SessionOp) -> (SessionOp, futures_channel::oneshot::Receiver<T>) {
    let (tx, rx) = futures_channel::oneshot::channel();
    (make(tx), rx)
}
