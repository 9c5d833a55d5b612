//! A core's shard of the state: the devices it owns (last values, grants, subscriber lists)
//! and the sessions it owns. Only the owning core's thread ever touches a shard.
//!
//! The operations other cores may request are the closed set [`DeviceOp`] / [`SessionOp`].

pub mod access;
pub mod devices;
pub mod listing;
pub mod sessions;

use crate::ids::SessionId;
use crate::model::{Grant, Rejection, Subscription};
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

/// An operation on one device, run on the device's core.
#[derive(Debug)]
pub enum DeviceOp {
    Grant { device: Box<str>, session: SessionId, grant: Grant },
    Revoke { device: Box<str>, session: SessionId, grant: Grant },
    Subscribe { device: Box<str>, session: SessionId, sub: Subscription },
    Unsubscribe { device: Box<str>, session: SessionId, sub: Subscription },
    /// Last telemetry: one key, or all keys (`key: None`).
    ReadTelemetry { device: Box<str>, key: Option<Box<str>>, viewer: Viewer },
    DeleteTelemetry { device: Box<str>, viewer: Viewer },
    ReadTwin { device: Box<str>, viewer: Viewer },
    ReadConnectionState { device: Box<str>, viewer: Viewer },
    /// Whether the session holds a grant covering `grant` (direct methods, desired properties).
    CheckGrant { device: Box<str>, session: SessionId, grant: Grant },
    /// The session is gone: drop its grants and subscriptions on this device.
    ForgetSession { device: Box<str>, session: SessionId },
    /// IoT Hub configured: the cached twin if a hub read is fresh per `ttl`, else `Miss`
    /// (the viewer's grant is checked first).
    ReadHubTwin { device: Box<str>, viewer: Viewer, ttl: TwinCacheTtl },
    /// A twin read from (or returned by) the IoT Hub: cache it; replies with the record served.
    StoreHubTwin { device: Box<str>, doc: serde_json::Value },
    /// The cached connection state, or `Miss` when none is known (grant checked first).
    ReadConnectionStateOrMiss { device: Box<str>, viewer: Viewer },
    /// Scale-out (src/cluster): the session's whole access here, as an instance decided it.
    SetAccess { device: Box<str>, session: SessionId, access: Option<(Grants, Subscriptions)> },
    /// Scale-out: the session's access here, replicated after a change ([`DeviceReply::Access`]).
    ReadAccess { device: Box<str>, session: SessionId },
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
            | DeviceOp::ReadConnectionStateOrMiss { device, .. }
            | DeviceOp::SetAccess { device, .. }
            | DeviceOp::ReadAccess { device, .. }
            | DeviceOp::Presence { device, .. } => device,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum DeviceReply {
    Done,
    /// Subscribe/unsubscribe/check: whether a grant permitted it.
    Permitted(bool),
    /// A read: the JSON response body, or why not.
    Body(Result<String, Rejection>),
    /// A read the cache cannot answer (permitted, but nothing fresh): ask the IoT Hub.
    Miss,
    /// [`DeviceOp::ReadAccess`]: the session's grants and subscriptions (`None`: nothing).
    Access(Option<(Grants, Subscriptions)>),
}

/// An operation on one session, run on the session's core.
#[derive(Debug)]
pub enum SessionOp {
    Create(SessionId),
    Delete(SessionId),
    /// Delete every session this core owns.
    DeleteAll,
    /// Check the session exists and keep it alive; remember the devices of `ops` when
    /// `register_devices` (grants), then run `ops` on their devices' cores.
    Scoped { session: SessionId, register_devices: bool, ops: Vec<DeviceOp> },
    /// One page of this core's devices (the console's `GET /devices`; see `listing`).
    ListDevices(listing::PageRequest),
}

#[derive(Debug)]
pub enum SessionReply {
    Created,
    /// This core holds its share of `maxSessions` already.
    Full,
    Deleted(bool),
    /// `None`: no such session.
    Scoped(Option<Vec<DeviceReply>>),
    Devices(listing::Page),
}
