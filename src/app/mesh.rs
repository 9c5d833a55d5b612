//! The application's cross-core messages: [`CoreMsg`], the one enum of everything a core
//! sends another, each request carrying its own typed reply. The mesh that carries them
//! (bounded inboxes, per-destination batching and backlog, the back-pressure policy) is the
//! runtime's, generic: `src/runtime/mesh.rs`. Here is what it needs to know of these
//! messages: what each counts for, and that telemetry deliveries for the same (session,
//! device) may be conflated while their destination is behind.

use std::rc::Rc;
use std::sync::Arc;

use crate::ids::SessionId;
use crate::ingest::IngestMessage;
use crate::push::envelope::merge_telemetry;
use crate::push::{Delivery, FrameKind};
use crate::shard::{DeviceOp, SessionOp};

pub use crate::runtime::mesh::{await_reply, MeshLimits, Reply, INBOX_BATCHES};

/// One core's view of the mesh.
pub type Mesh = crate::runtime::mesh::Mesh<CoreMsg>;
/// A core's inbox.
pub type Inbox = crate::runtime::mesh::Inbox<CoreMsg>;
pub type Inboxes = crate::runtime::mesh::Inboxes<CoreMsg>;

/// Makes one bounded inbox per core.
pub fn inboxes(cores: usize) -> (Inboxes, Vec<Inbox>) {
    crate::runtime::mesh::inboxes(cores)
}

/// Every message one core can send another.
pub enum CoreMsg {
    /// Device messages for devices this core owns; `done` is answered once they are applied.
    Ingest { batch: Vec<IngestMessage>, done: Option<Reply<()>> },
    /// Operations on devices this core owns, applied in order; each answers its own caller.
    Devices { ops: Vec<DeviceOp> },
    /// An operation on a session this core owns.
    Session { op: SessionOp },
    /// This core's metrics snapshot, for `GET /metrics`.
    Metrics(Reply<crate::metrics::Snapshot>),
    /// Live data for sessions this core owns (from the devices' cores).
    Deliver(Vec<Delivery>),
    /// Work of the network face for this core: a WebSocket whose handshake was read on
    /// another core, moving to its session's core; an Engine.IO long-polling request for a
    /// polling session this core holds (it carries its own reply).
    Task(Box<dyn CoreTask>),
}

/// Work a layer above the application (`src/transport`) sends to the core that holds what
/// it needs; the application runs it without knowing what it is.
pub trait CoreTask: Send {
    /// Bytes it is charged for against the mesh bounds (an estimate of what it holds).
    fn bytes(&self) -> usize;
    /// Runs on the receiving core, from its inbox task: never blocks (spawns what waits).
    fn run(self: Box<Self>, core: &Rc<crate::app::Core>);
}

impl CoreMsg {
    /// Items it counts for against the bounds (at least 1).
    pub fn items(&self) -> usize {
        match self {
            CoreMsg::Ingest { batch, .. } => batch.len().max(1),
            CoreMsg::Devices { ops, .. } => ops.len().max(1),
            CoreMsg::Deliver(deliveries) => deliveries.len().max(1),
            _ => 1,
        }
    }

    /// Bytes it is charged for against the bounds (an estimate of what it holds).
    pub fn bytes(&self) -> usize {
        match self {
            CoreMsg::Ingest { batch, .. } => batch.iter().map(IngestMessage::charge).sum(),
            CoreMsg::Deliver(deliveries) => deliveries.iter().map(delivery_bytes).sum(),
            CoreMsg::Devices { ops, .. } => ops.len() * 128,
            CoreMsg::Task(task) => task.bytes(),
            _ => 256,
        }
    }
}

fn delivery_bytes(d: &Delivery) -> usize {
    d.frame.len() + 64
}

/// Deliveries are what a backlog splits and conflates: a telemetry delivery replaces the one
/// still waiting for the same (session, device), keeping the newest value of every key the
/// older one carried; a delivery of another kind for that pair seals the older one, so a
/// device's frames keep their order.
impl crate::runtime::mesh::Message for CoreMsg {
    type Item = Delivery;
    type Key = (SessionId, Arc<str>);

    fn items(&self) -> usize {
        CoreMsg::items(self)
    }

    fn bytes(&self) -> usize {
        CoreMsg::bytes(self)
    }

    fn into_items(self) -> Result<Vec<Delivery>, Self> {
        match self {
            CoreMsg::Deliver(deliveries) => Ok(deliveries),
            other => Err(other),
        }
    }

    fn join(batch: &mut Vec<Self>, d: Delivery) {
        match batch.last_mut() {
            Some(CoreMsg::Deliver(ds)) => ds.push(d),
            _ => batch.push(CoreMsg::Deliver(vec![d])),
        }
    }

    fn item_bytes(d: &Delivery) -> usize {
        delivery_bytes(d)
    }

    fn key(d: &Delivery) -> Self::Key {
        (d.session, d.device.clone())
    }

    fn conflatable(d: &Delivery) -> bool {
        d.kind == FrameKind::Telemetry
    }

    fn merge(old: &mut Delivery, d: Delivery) {
        // Keep the newest value of every key the replaced delivery carried.
        let frame = merge_telemetry(&old.frame, &d.frame);
        *old = Delivery { frame, ..d };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SessionId;
    use crate::push::FrameKind;
    use crate::runtime::mesh::{MeshLimits, Outgoing};

    fn delivery(session: u128, device: &str, kind: FrameKind, frame: &str) -> Delivery {
        Delivery { session: SessionId(session), device: device.into(), kind, frame: frame.into(), arrived: None, key: Default::default() }
    }

    fn frames(batch: &[CoreMsg]) -> Vec<String> {
        batch
            .iter()
            .flat_map(|m| match m {
                CoreMsg::Deliver(ds) => ds.iter().map(|d| d.frame.to_string()).collect::<Vec<_>>(),
                _ => vec!["msg".into()],
            })
            .collect()
    }

    #[test]
    fn a_behind_backlog_conflates_telemetry_per_session_and_device_in_order() {
        let limits = MeshLimits { batch_items: 100, batch_bytes: 1 << 20, backlog_soft: 10 };
        let mut out = Outgoing::<CoreMsg>::default();
        out.draining = true;
        assert!(!out.push_item(delivery(1, "a", FrameKind::Telemetry, "a1")));
        assert!(!out.push_item(delivery(2, "a", FrameKind::Telemetry, "other-session")));
        assert!(out.push_item(delivery(1, "a", FrameKind::Telemetry, "a2")));
        assert!(!out.push_item(delivery(1, "a", FrameKind::ConnectionState, "off")));
        assert!(!out.push_item(delivery(1, "a", FrameKind::Telemetry, "a3")), "sealed by the state");
        assert!(out.push_item(delivery(1, "a", FrameKind::Telemetry, "a4")));
        assert_eq!(out.items, 4);
        let (batch, items) = out.take_batch(&limits).unwrap();
        assert_eq!(items, 4);
        assert_eq!(frames(&batch), vec!["a2", "other-session", "off", "a4"]);
        assert!(out.slots.is_empty());
    }

    #[test]
    fn conflation_keeps_the_newest_value_of_every_key_when_key_sets_alternate() {
        let limits = MeshLimits { batch_items: 100, batch_bytes: 1 << 20, backlog_soft: 10 };
        let mut out = Outgoing::<CoreMsg>::default();
        out.draining = true;
        let env = |k: &str, v: &str| crate::push::envelope::EnvelopeBuilder::new("a", "t").telemetry([(k, v)].into_iter());
        for (k, v) in [("x", "1"), ("y", "1"), ("x", "2"), ("y", "2")] {
            out.push_item(delivery(1, "a", FrameKind::Telemetry, &env(k, v)));
        }
        let (batch, _) = out.take_batch(&limits).unwrap();
        let frames = frames(&batch);
        assert_eq!(frames.len(), 1, "{frames:?}");
        let got: serde_json::Value = serde_json::from_str(&frames[0]).unwrap();
        assert_eq!(got["telemetry"], serde_json::json!({"y": 2, "x": 2}));
    }

    #[test]
    fn batches_respect_the_item_and_byte_bounds() {
        let limits = MeshLimits { batch_items: 3, batch_bytes: 200, backlog_soft: 10 };
        let mut out = Outgoing::<CoreMsg>::default();
        for i in 0..7 {
            out.push_item(delivery(1, "a", FrameKind::Message, &format!("m{i}")));
        }
        out.push_item(delivery(1, "a", FrameKind::Message, &"x".repeat(500)));
        let sizes: Vec<usize> = std::iter::from_fn(|| out.take_batch(&limits)).map(|(_, n)| n).collect();
        assert_eq!(sizes, vec![3, 3, 1, 1], "3 items (198 bytes) a batch; the big one alone");
        assert_eq!(out.items, 0);
    }
}
