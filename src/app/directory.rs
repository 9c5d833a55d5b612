//! The session directory: where a session lives and how a change to it reaches every
//! instance of a deployment. The layers above (the REST API, the socket transports, the event
//! stream consumer) go through it and never name an engine.
//!
//! Two engines implement [`Directory`]:
//! - [`Local`], one instance: the session table on this process's cores (the session's core
//!   creates, deletes and scopes it). Every core holds it from the start.
//! - Redis (`--redis-url`, `src/cluster`): the same calls, with the session also in Redis and
//!   every change published to the other instances; it falls back to [`local`] for the copy
//!   here. The cluster's per-core plugin installs it on each core before the core serves
//!   ([`Core::set_directory`]); main.rs chooses by `--redis-url`.
//!
//! Dispatch: a core holds its engine as an `Rc<dyn Directory>` whose calls return boxed
//! futures. The engine cannot be an enum here: the Redis engine lives above this layer
//! (`src/cluster` depends on the application, not the other way), and making [`Core`] generic
//! over it would spread a type parameter through every layer above. The cost is one
//! allocation per call, paid per request or per session change (a REST call, a socket's
//! first attach), never per device message: the message path (the relay, app/relay.rs) does
//! not go through the directory.
//!
//! Partition leases of the event stream are the other seam the scale-out engine offers:
//! [`Leases`], held by the event stream consumer (on its own thread, not a core).
//!
//! Whether another instance watches a device is kept in three places, all on the Redis
//! side (`src/cluster`), and not merged here: the sets `<prefix>:watching:<instance>` in
//! Redis (the truth every instance reads at connect and is told of on `<prefix>:watch`), the
//! link thread's map device → watching instances (cluster/link.rs, `remote`), and each
//! core's set of its devices that some other instance watches (cluster/mod.rs,
//! `CoreRelay::remote`, which decides on the message path whether to publish). The last two
//! are caches of the first kept on different threads; merging them would put a cross-thread
//! lookup on the message path.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;

use crate::app::Core;
use crate::ids::SessionId;
use crate::model::Checked;
use crate::shard::{ask_session, ConnectionView, DeviceOp, SessionOp, TelemetryView, TwinView, Viewer};
use crate::timefmt::Millis;

/// What a [`Directory`] call returns: a future on the calling core.
pub type Pending<'a, T> = Pin<Box<dyn Future<Output = Checked<T>> + 'a>>;

/// A read another instance may answer: what the device's holders are asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadKind {
    /// One telemetry key, or every key (`None`).
    Telemetry(Option<Box<str>>),
    Twin,
    ConnectionState,
}

/// What another instance answers to a read, typed as the device's core here would answer it;
/// the REST layer renders it once (`app::record`), as for a read answered here.
#[derive(Debug, Clone, PartialEq)]
pub enum View {
    Telemetry(TelemetryView),
    Twin(TwinView),
    Connection(ConnectionView),
}

impl View {
    /// Whether this is an answer to `kind` (an all-keys telemetry read may answer one key's
    /// shape only when asked for that key).
    pub fn answers(&self, kind: &ReadKind) -> bool {
        match (self, kind) {
            (View::Telemetry(TelemetryView::One { key, .. }), ReadKind::Telemetry(Some(asked))) => key == asked,
            (View::Telemetry(TelemetryView::All(_)), ReadKind::Telemetry(None)) => true,
            (View::Twin(_), ReadKind::Twin) | (View::Connection(_), ReadKind::ConnectionState) => true,
            _ => false,
        }
    }
}

/// This instance among the others (`GET /status/details`).
#[derive(Debug, Clone)]
pub struct Membership {
    pub instance: Arc<str>,
    /// Live instances seen, this one included.
    pub instances: u64,
    /// The event stream partitions this instance holds a lease on.
    pub partitions: Vec<String>,
}

/// Where sessions live: the one interface the layers above use for session changes and
/// for reads that may be answered by another instance. See the module doc for the engines.
pub trait Directory {
    /// Makes sure this instance holds its copy of `session`, loading it from elsewhere when
    /// it does not; false when the session exists nowhere. Always true on one instance (the
    /// caller's own check answers).
    fn ensure<'a>(&'a self, core: &'a Rc<Core>, session: SessionId) -> Pending<'a, bool>;
    /// A permission was refused here: this instance's copy may lag a change another instance
    /// has just made. Reads the session again and applies it; true when the caller should
    /// try once more. Always false on one instance.
    fn refresh<'a>(&'a self, core: &'a Rc<Core>, session: SessionId) -> Pending<'a, bool>;
    /// `POST /session`; `false`: `maxSessions` reached.
    fn create<'a>(&'a self, core: &'a Rc<Core>, id: SessionId) -> Pending<'a, bool>;
    /// `DELETE /sessions/:id`: whether it existed (anywhere).
    fn delete<'a>(&'a self, core: &'a Rc<Core>, id: SessionId) -> Pending<'a, bool>;
    /// `DELETE /sessions`: every session (on every instance).
    fn delete_all<'a>(&'a self, core: &'a Rc<Core>) -> Pending<'a, ()>;
    /// A session-scoped batch of device operations from the REST API; false: no such session.
    fn scoped<'a>(&'a self, core: &'a Rc<Core>, session: SessionId, register_devices: bool, ops: Vec<DeviceOp>) -> Pending<'a, bool>;
    /// A read that found nothing here (404, `newer_than: None`), or a copy that is not
    /// current (`shard::Local::current`; `newer_than`: when its newest data was produced):
    /// what the freshest other instance holding newer data answers (with when its newest
    /// data was produced), filtered by `viewer`'s grants. `None` on one instance, or when
    /// nobody holds newer.
    fn read_elsewhere<'a>(&'a self, core: &'a Rc<Core>, viewer: Viewer, device: &'a str, kind: ReadKind, newer_than: Option<Millis>) -> Pending<'a, Option<(Millis, View)>>;
    /// This instance among the others; `None` on one instance.
    fn membership(&self) -> Option<Membership>;
}

/// The single-node engine: the session table of this process's cores.
pub struct Local;

impl Directory for Local {
    fn ensure<'a>(&'a self, _: &'a Rc<Core>, _: SessionId) -> Pending<'a, bool> {
        Box::pin(async { Ok(true) })
    }

    fn refresh<'a>(&'a self, _: &'a Rc<Core>, _: SessionId) -> Pending<'a, bool> {
        Box::pin(async { Ok(false) })
    }

    fn create<'a>(&'a self, core: &'a Rc<Core>, id: SessionId) -> Pending<'a, bool> {
        Box::pin(async move { Ok(local::create(core, id).await) })
    }

    fn delete<'a>(&'a self, core: &'a Rc<Core>, id: SessionId) -> Pending<'a, bool> {
        Box::pin(async move { Ok(local::delete(core, id).await) })
    }

    fn delete_all<'a>(&'a self, core: &'a Rc<Core>) -> Pending<'a, ()> {
        Box::pin(async move {
            local::delete_all(core).await;
            Ok(())
        })
    }

    fn scoped<'a>(&'a self, core: &'a Rc<Core>, session: SessionId, register_devices: bool, ops: Vec<DeviceOp>) -> Pending<'a, bool> {
        Box::pin(async move { Ok(local::scoped(core, session, register_devices, ops).await) })
    }

    fn read_elsewhere<'a>(&'a self, _: &'a Rc<Core>, _: Viewer, _: &'a str, _: ReadKind, _: Option<Millis>) -> Pending<'a, Option<(Millis, View)>> {
        Box::pin(async { Ok(None) })
    }

    fn membership(&self) -> Option<Membership> {
        None
    }
}

/// The session table of this instance, on the session's core: the single-node engine's
/// whole behaviour, and the copy here that the Redis engine keeps in step.
pub mod local {
    use super::*;

    /// Creates the session on its core; false at `maxSessions` (or when it exists).
    pub async fn create(core: &Rc<Core>, id: SessionId) -> bool {
        let target = core.session_core(id);
        core.ask_session(target, ask_session(|created| SessionOp::Create { id, created })).await.unwrap_or(false)
    }

    /// Deletes the session on its core; whether it existed.
    pub async fn delete(core: &Rc<Core>, id: SessionId) -> bool {
        let target = core.session_core(id);
        core.ask_session(target, ask_session(|found| SessionOp::Delete { id, found })).await.unwrap_or(false)
    }

    /// Every core at once, then every answer; whether any session existed.
    pub async fn delete_all(core: &Rc<Core>) -> bool {
        let answers: Vec<_> = (0..core.cores())
            .map(|target| {
                let (op, answer) = ask_session(|any| SessionOp::DeleteAll { any });
                core.session_op_on(target, op);
                answer
            })
            .collect();
        let mut any = false;
        for answer in answers {
            any |= answer.await.unwrap_or(false);
        }
        any
    }

    /// Runs a session-scoped batch on the session's core; false: no such session.
    pub async fn scoped(core: &Rc<Core>, session: SessionId, register_devices: bool, ops: Vec<DeviceOp>) -> bool {
        let target = core.session_core(session);
        let asked = ask_session(|found| SessionOp::Scoped { session, register_devices, ops, found });
        core.ask_session(target, asked).await.unwrap_or(false)
    }
}

/// The partitions of the event stream this instance holds a lease on, each with the
/// checkpoint found when the lease was taken (the consumer resumes after it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Owned {
    pub partitions: std::collections::BTreeMap<String, Option<i64>>,
}

/// What the event stream consumer tells the lease holder at every connect.
pub struct StreamPlan {
    /// Names the stream and consumer group (`app::source_prefix`); leases and
    /// checkpoints are kept per stream.
    pub key: String,
    /// Every partition of the stream.
    pub ids: Vec<String>,
    /// Partition → the last sequence number handed to the cores.
    pub positions: Arc<dyn Fn() -> std::collections::HashMap<String, i64> + Send + Sync>,
    /// With a durable store, the cores' applied marks are kept under `key + partition`: the
    /// checkpoint is the lowest of them (what every core applied), else `positions`.
    pub marks: bool,
}

/// Partition leases of the event stream, when several instances share it (Redis): the
/// consumer names its stream and partitions at every connect and reads only the partitions
/// in [`Owned`] (watched). On one instance there is no lease holder and it reads them all.
pub trait Leases: Send + Sync {
    /// Names the stream's partitions; false when the holder could not take the plan.
    fn stream(&self, plan: StreamPlan) -> bool;
    /// The partitions leased to this instance, as they change.
    fn owned(&self) -> tokio::sync::watch::Receiver<Owned>;
}
