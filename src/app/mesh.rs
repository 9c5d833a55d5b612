//! Cross-core messaging: one bounded inbox per core, batched per destination.
//!
//! A core never touches another core's state; it posts a [`CoreMsg`] to the owner. Messages
//! posted while a task runs are buffered per destination and sent as batches when the current
//! burst of work yields, so a burst of N messages to a core costs a few channel operations and
//! one wake-up instead of N. A core's messages to another core leave in the order they were
//! posted (`Session` and `Poll` messages are then run as tasks of their own, so their effects
//! may interleave with later messages).
//!
//! # Bounds and back-pressure
//!
//! Each inbox holds at most [`INBOX_BATCHES`] batches of at most `batch_items` items (a
//! delivery, an ingest message, a device operation) and `batch_bytes` bytes (one message
//! larger than that travels alone): `--mesh-inbox-messages` and `--mesh-inbox-bytes` bound it
//! in count and bytes. When a destination's inbox is full, what is posted to it waits on the
//! sending core, in a per-destination backlog, and a drainer task hands it over as room frees.
//! The policy for that backlog:
//! - **never blocks the inbox task**: `serve_inbox` only ever posts (`try_send` plus the
//!   backlog), it never awaits a send; two cores waiting on each other's full inbox would
//!   deadlock.
//! - **slowed down** (the sources): while any backlog of a core holds more than the inbox
//!   bound (`backlog_soft`), [`Mesh::wait_for_room`] holds back the producers of that core:
//!   the AMQP ingress stops taking batches (its queue fills and link credit stops, see
//!   `ingress.rs`), `POST /ingest` answers only once its messages are applied *and* the
//!   applying core has room again, and the simulated fleet waits.
//! - **conflated**: while a destination is behind (its inbox full), a telemetry delivery
//!   replaces the one still waiting for the same (session, device), in place, keeping the
//!   newest value of every key the older one carried; a delivery of
//!   another kind for that pair seals the older one, so a device's frames keep their order.
//! - **never dropped**: state, twin and message deliveries, device and session operations,
//!   replies and moving sockets. What feeds them is bounded elsewhere: requests by
//!   `--max-connections`, timer-driven state changes by devices × subscribers.
//!
//! The backlog's depth in items, its peak and the conflations are exported on `/metrics`.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};

use futures_channel::oneshot;
use hashbrown::HashMap;

use crate::ids::SessionId;
use crate::ingest::IngestMessage;
use crate::push::envelope::merge_telemetry;
use crate::push::{Delivery, FrameKind};
use crate::shard::{DeviceOp, SessionOp};

/// Where the answer to a cross-core request goes.
pub type Reply<T> = oneshot::Sender<T>;

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
            CoreMsg::Ingest { batch, .. } => batch.iter().map(|m| m.body.len() + m.device_id.len() + 128).sum(),
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

/// Batches an inbox holds; with `--mesh-inbox-messages` and `--mesh-inbox-bytes` this sets
/// the size of one batch.
pub const INBOX_BATCHES: usize = 64;

pub type Inbox = async_channel::Receiver<Vec<CoreMsg>>;
pub type InboxSender = async_channel::Sender<Vec<CoreMsg>>;

/// The bounds of the mesh (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct MeshLimits {
    pub batch_items: usize,
    pub batch_bytes: usize,
    /// Items waiting in one backlog beyond which the producers of this core wait.
    pub backlog_soft: usize,
}

impl MeshLimits {
    pub fn new(inbox_messages: usize, inbox_bytes: usize) -> Self {
        Self {
            batch_items: (inbox_messages / INBOX_BATCHES).max(1),
            batch_bytes: (inbox_bytes / INBOX_BATCHES).max(1),
            backlog_soft: inbox_messages,
        }
    }
}

/// The inboxes of every core, and how many items each holds (for metrics and tests).
#[derive(Clone)]
pub struct Inboxes {
    pub senders: Vec<InboxSender>,
    pub load: Arc<Vec<AtomicUsize>>,
}

/// Makes one bounded inbox per core.
pub fn inboxes(cores: usize) -> (Inboxes, Vec<Inbox>) {
    let (senders, receivers) = (0..cores).map(|_| async_channel::bounded(INBOX_BATCHES)).unzip();
    let load = Arc::new((0..cores).map(|_| AtomicUsize::new(0)).collect());
    (Inboxes { senders, load }, receivers)
}

/// One waiting item of a backlog: a message, or one delivery (so it can be conflated).
enum Pending {
    Msg(CoreMsg),
    One(Delivery),
}

impl Pending {
    fn items(&self) -> usize {
        match self {
            Pending::Msg(m) => m.items(),
            Pending::One(_) => 1,
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Pending::Msg(m) => m.bytes(),
            Pending::One(d) => delivery_bytes(d),
        }
    }
}

/// What waits to go to one destination.
#[derive(Default)]
struct Outgoing {
    queue: VecDeque<Pending>,
    /// Absolute position of `queue[0]` (positions in `slots` stay valid as the front leaves).
    base: u64,
    items: usize,
    /// Where the newest waiting telemetry delivery of a (session, device) sits, while behind.
    slots: HashMap<(SessionId, Arc<str>), u64>,
    /// The inbox was full: a drainer task is handing this backlog over.
    draining: bool,
}

impl Outgoing {
    fn push(&mut self, p: Pending) -> u64 {
        self.items += p.items();
        self.queue.push_back(p);
        self.base + self.queue.len() as u64 - 1
    }

    /// Adds one delivery; returns true when it replaced an older one (conflated).
    fn push_delivery(&mut self, d: Delivery) -> bool {
        if d.kind != FrameKind::Telemetry {
            if !self.slots.is_empty() {
                self.slots.remove(&(d.session, d.device.clone()));
            }
            self.push(Pending::One(d));
            return false;
        }
        if !self.draining {
            self.push(Pending::One(d));
            return false;
        }
        let key = (d.session, d.device.clone());
        if let Some(&at) = self.slots.get(&key) {
            if let Some(Pending::One(old)) = at.checked_sub(self.base).and_then(|i| self.queue.get_mut(i as usize)) {
                // Keep the newest value of every key the replaced delivery carried.
                let frame = merge_telemetry(&old.frame, &d.frame);
                *old = Delivery { frame, ..d };
                return true;
            }
        }
        let at = self.push(Pending::One(d));
        self.slots.insert(key, at);
        false
    }

    /// Takes the next batch from the front: up to `limits` (at least one item).
    fn take_batch(&mut self, limits: &MeshLimits) -> Option<(Vec<CoreMsg>, usize)> {
        let mut batch: Vec<CoreMsg> = Vec::new();
        let (mut items, mut bytes) = (0, 0);
        while let Some(next) = self.queue.front() {
            let (n, b) = (next.items(), next.bytes());
            if items > 0 && (items + n > limits.batch_items || bytes + b > limits.batch_bytes) {
                break;
            }
            items += n;
            bytes += b;
            self.base += 1;
            match self.queue.pop_front().expect("peeked") {
                Pending::Msg(m) => batch.push(m),
                Pending::One(d) => match batch.last_mut() {
                    Some(CoreMsg::Deliver(ds)) => ds.push(d),
                    _ => batch.push(CoreMsg::Deliver(vec![d])),
                },
            }
        }
        self.items -= items;
        if self.queue.is_empty() {
            self.slots.clear();
        }
        (!batch.is_empty()).then_some((batch, items))
    }
}

/// One core's view of the mesh: senders to every inbox and the outgoing backlogs.
pub struct Mesh {
    pub me: usize,
    inboxes: Vec<InboxSender>,
    load: Arc<Vec<AtomicUsize>>,
    limits: MeshLimits,
    outgoing: RefCell<Vec<Outgoing>>,
    flush_scheduled: Cell<bool>,
    /// Producers waiting for the backlogs to shrink.
    room_waiters: RefCell<Vec<Waker>>,
    /// Telemetry deliveries replaced in a backlog by newer ones.
    pub conflated: Cell<u64>,
    /// The most items any backlog of this core held.
    pub backlog_peak: Cell<usize>,
}

impl Mesh {
    pub fn new(me: usize, inboxes: &Inboxes, limits: MeshLimits) -> Rc<Self> {
        let outgoing = RefCell::new((0..inboxes.senders.len()).map(|_| Outgoing::default()).collect());
        Rc::new(Self {
            me,
            inboxes: inboxes.senders.clone(),
            load: inboxes.load.clone(),
            limits,
            outgoing,
            flush_scheduled: Cell::new(false),
            room_waiters: RefCell::default(),
            conflated: Cell::new(0),
            backlog_peak: Cell::new(0),
        })
    }

    pub fn cores(&self) -> usize {
        self.inboxes.len()
    }

    /// Queue `msg` for core `to`; it leaves with the rest of this burst.
    pub fn post(self: &Rc<Self>, to: usize, msg: CoreMsg) {
        debug_assert_ne!(to, self.me, "local work is done in place, not posted");
        {
            let mut outgoing = self.outgoing.borrow_mut();
            let out = &mut outgoing[to];
            match msg {
                CoreMsg::Deliver(deliveries) => {
                    let mut conflated = 0;
                    for d in deliveries {
                        conflated += u64::from(out.push_delivery(d));
                    }
                    self.conflated.set(self.conflated.get() + conflated);
                }
                msg => {
                    out.push(Pending::Msg(msg));
                }
            }
            if out.items > self.backlog_peak.get() {
                self.backlog_peak.set(out.items);
            }
        }
        if !self.flush_scheduled.replace(true) {
            let mesh = self.clone();
            monoio::spawn(async move {
                // Runs after the tasks that are ready now: their messages join this burst.
                mesh.flush();
            });
        }
    }

    /// Hands what waits to the inboxes that have room; a full inbox gets a drainer task.
    pub fn flush(self: &Rc<Self>) {
        self.flush_scheduled.set(false);
        for to in 0..self.inboxes.len() {
            loop {
                let taken = {
                    let mut outgoing = self.outgoing.borrow_mut();
                    if outgoing[to].draining {
                        break;
                    }
                    outgoing[to].take_batch(&self.limits)
                };
                let Some((batch, items)) = taken else { break };
                self.load[to].fetch_add(items, Ordering::Relaxed);
                match self.inboxes[to].try_send(batch) {
                    Ok(()) => {}
                    Err(async_channel::TrySendError::Full(batch)) => {
                        self.load[to].fetch_sub(items, Ordering::Relaxed);
                        self.outgoing.borrow_mut()[to].draining = true;
                        monoio::spawn(self.clone().drain(to, batch, items));
                        break;
                    }
                    Err(async_channel::TrySendError::Closed(_)) => {
                        self.load[to].fetch_sub(items, Ordering::Relaxed);
                        tracing::warn!(core = to, "message to a stopped core dropped");
                    }
                }
            }
        }
        self.wake_producers();
    }

    /// Sends a full inbox's backlog as room frees, in order; `first` was taken from its front.
    async fn drain(self: Rc<Self>, to: usize, first: Vec<CoreMsg>, first_items: usize) {
        let mut next = Some((first, first_items));
        while let Some((batch, items)) = next.take() {
            self.load[to].fetch_add(items, Ordering::Relaxed);
            if self.inboxes[to].send(batch).await.is_err() {
                self.load[to].fetch_sub(items, Ordering::Relaxed);
                tracing::warn!(core = to, "message to a stopped core dropped");
            }
            self.wake_producers();
            next = self.outgoing.borrow_mut()[to].take_batch(&self.limits);
        }
        self.outgoing.borrow_mut()[to].draining = false;
        self.wake_producers();
    }

    /// Items waiting in this core's backlogs, per destination.
    pub fn backlog(&self) -> Vec<usize> {
        self.outgoing.borrow().iter().map(|o| o.items).collect()
    }

    /// Items in core `core`'s inbox (sent, not yet taken).
    pub fn inbox_load(&self, core: usize) -> usize {
        self.load[core].load(Ordering::Relaxed)
    }

    /// The inbox task took a batch of `items` items off this core's inbox.
    pub fn taken(&self, items: usize) {
        self.load[self.me].fetch_sub(items, Ordering::Relaxed);
    }

    /// Whether every backlog of this core is within its bound.
    pub fn has_room(&self) -> bool {
        self.outgoing.borrow().iter().all(|o| o.items <= self.limits.backlog_soft)
    }

    fn wake_producers(&self) {
        if self.has_room() {
            for waker in self.room_waiters.borrow_mut().drain(..) {
                waker.wake();
            }
        }
    }

    /// Waits while a backlog of this core is over its bound: sources call it before they
    /// produce more (never the inbox task).
    pub async fn wait_for_room(&self) {
        poll_fn(|cx| {
            if self.has_room() {
                return Poll::Ready(());
            }
            self.room_waiters.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// Waits for a reply; a dropped sender means the other core stopped.
pub async fn await_reply<T>(rx: oneshot::Receiver<T>) -> Option<T> {
    rx.await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(session: u128, device: &str, kind: FrameKind, frame: &str) -> Delivery {
        Delivery { session: SessionId(session), device: device.into(), kind, frame: frame.into(), arrived: None }
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
        let mut out = Outgoing { draining: true, ..Default::default() };
        assert!(!out.push_delivery(delivery(1, "a", FrameKind::Telemetry, "a1")));
        assert!(!out.push_delivery(delivery(2, "a", FrameKind::Telemetry, "other-session")));
        assert!(out.push_delivery(delivery(1, "a", FrameKind::Telemetry, "a2")));
        assert!(!out.push_delivery(delivery(1, "a", FrameKind::ConnectionState, "off")));
        assert!(!out.push_delivery(delivery(1, "a", FrameKind::Telemetry, "a3")), "sealed by the state");
        assert!(out.push_delivery(delivery(1, "a", FrameKind::Telemetry, "a4")));
        assert_eq!(out.items, 4);
        let (batch, items) = out.take_batch(&limits).unwrap();
        assert_eq!(items, 4);
        assert_eq!(frames(&batch), vec!["a2", "other-session", "off", "a4"]);
        assert!(out.slots.is_empty());
    }

    #[test]
    fn conflation_keeps_the_newest_value_of_every_key_when_key_sets_alternate() {
        let limits = MeshLimits { batch_items: 100, batch_bytes: 1 << 20, backlog_soft: 10 };
        let mut out = Outgoing { draining: true, ..Default::default() };
        let env = |k: &str, v: &str| crate::push::envelope::EnvelopeBuilder::new("a", "t").telemetry([(k, v)].into_iter());
        for (k, v) in [("x", "1"), ("y", "1"), ("x", "2"), ("y", "2")] {
            out.push_delivery(delivery(1, "a", FrameKind::Telemetry, &env(k, v)));
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
        let mut out = Outgoing::default();
        for i in 0..7 {
            out.push_delivery(delivery(1, "a", FrameKind::Message, &format!("m{i}")));
        }
        out.push_delivery(delivery(1, "a", FrameKind::Message, &"x".repeat(500)));
        let sizes: Vec<usize> = std::iter::from_fn(|| out.take_batch(&limits)).map(|(_, n)| n).collect();
        assert_eq!(sizes, vec![3, 3, 1, 1], "3 items (198 bytes) a batch; the big one alone");
        assert_eq!(out.items, 0);
    }
}
