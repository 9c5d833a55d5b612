//! Cross-core messaging, generic over the message type: one bounded inbox per core, batched
//! per destination. The application's one message enum (`app::mesh::CoreMsg`) implements
//! [`Message`]: what an item counts for, and which items a backlog may conflate.
//!
//! A core never touches another core's state; it posts a message to the owner. Messages
//! posted while a task runs are buffered per destination and sent as batches when the current
//! burst of work yields, so a burst of N messages to a core costs a few channel operations and
//! one wake-up instead of N. A core's messages to another core leave in the order they were
//! posted (the application may then run some as tasks of their own, so their effects may
//! interleave with later messages).
//!
//! # Bounds and back-pressure
//!
//! Each inbox holds at most [`INBOX_BATCHES`] batches of at most `batch_items` items (a
//! delivery, an ingest message, a device operation) and `batch_bytes` bytes (one message
//! larger than that travels alone): `--mesh-inbox-messages` and `--mesh-inbox-bytes` bound it
//! in count and bytes. When a destination's inbox is full, what is posted to it waits on the
//! sending core, in a per-destination backlog, and a drainer task hands it over as room frees.
//! The policy for that backlog:
//! - **never blocks the inbox task**: a core's inbox task (`Core::serve_inbox`) only ever posts (`try_send` plus the
//!   backlog), it never awaits a send; two cores waiting on each other's full inbox would
//!   deadlock.
//! - **slowed down** (the sources): while any backlog of a core holds more than the inbox
//!   bound (`backlog_soft`), [`Mesh::wait_for_room`] holds back the producers of that core:
//!   the AMQP ingress stops taking batches (its queue fills and link credit stops, see
//!   `app/ingress.rs`), `POST /ingest` answers only once its messages are applied *and* the
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
use std::hash::Hash;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};

use futures_channel::oneshot;
use hashbrown::HashMap;

/// Where the answer to a cross-core request goes.
pub type Reply<T> = oneshot::Sender<T>;

/// What crosses the mesh: the application's one message enum.
pub trait Message: Send + Sized + 'static {
    /// One item of a message a backlog splits so that it may conflate it (a delivery).
    type Item: Send + 'static;
    /// What conflation goes by (a session and a device).
    type Key: Hash + Eq;
    /// Items it counts for against the bounds (at least 1).
    fn items(&self) -> usize;
    /// Bytes it is charged for against the bounds (an estimate of what it holds).
    fn bytes(&self) -> usize;
    /// Its items, when it is a batch a backlog may split; itself otherwise.
    fn into_items(self) -> Result<Vec<Self::Item>, Self>;
    /// Adds an item taken from a backlog to the batch being sent (to its last message when
    /// that is a batch of items).
    fn join(batch: &mut Vec<Self>, item: Self::Item);
    fn item_bytes(item: &Self::Item) -> usize;
    fn key(item: &Self::Item) -> Self::Key;
    /// Whether a newer item of the same key may replace it while its destination is behind
    /// (an item that may not seals the older ones of its key, so the order holds).
    fn conflatable(item: &Self::Item) -> bool;
    /// `new` replaces `old` in place, keeping what of `old` it must (the newest value of
    /// every key of a telemetry frame).
    fn merge(old: &mut Self::Item, new: Self::Item);
}

/// Batches an inbox holds; with `--mesh-inbox-messages` and `--mesh-inbox-bytes` this sets
/// the size of one batch.
pub const INBOX_BATCHES: usize = 64;

pub type Inbox<M> = async_channel::Receiver<Vec<M>>;
pub type InboxSender<M> = async_channel::Sender<Vec<M>>;

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
pub struct Inboxes<M> {
    pub senders: Vec<InboxSender<M>>,
    pub load: Arc<Vec<AtomicUsize>>,
}

impl<M> Clone for Inboxes<M> {
    fn clone(&self) -> Self {
        Self { senders: self.senders.clone(), load: self.load.clone() }
    }
}

/// Makes one bounded inbox per core.
pub fn inboxes<M>(cores: usize) -> (Inboxes<M>, Vec<Inbox<M>>) {
    let (senders, receivers) = (0..cores).map(|_| async_channel::bounded(INBOX_BATCHES)).unzip();
    let load = Arc::new((0..cores).map(|_| AtomicUsize::new(0)).collect());
    (Inboxes { senders, load }, receivers)
}

/// One waiting item of a backlog: a message, or one item of a batch (so it can be conflated).
enum Pending<M: Message> {
    Msg(M),
    One(M::Item),
}

impl<M: Message> Pending<M> {
    fn items(&self) -> usize {
        match self {
            Pending::Msg(m) => m.items(),
            Pending::One(_) => 1,
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Pending::Msg(m) => m.bytes(),
            Pending::One(d) => M::item_bytes(d),
        }
    }
}

/// What waits to go to one destination (crate-visible for the application's unit tests of
/// its [`Message`] implementation).
pub(crate) struct Outgoing<M: Message> {
    queue: VecDeque<Pending<M>>,
    /// Absolute position of `queue[0]` (positions in `slots` stay valid as the front leaves).
    base: u64,
    pub(crate) items: usize,
    /// Where the newest waiting conflatable item of a key sits, while behind.
    pub(crate) slots: HashMap<M::Key, u64>,
    /// The inbox was full: a drainer task is handing this backlog over.
    pub(crate) draining: bool,
}

impl<M: Message> Default for Outgoing<M> {
    fn default() -> Self {
        Self { queue: VecDeque::new(), base: 0, items: 0, slots: HashMap::new(), draining: false }
    }
}

impl<M: Message> Outgoing<M> {
    fn push(&mut self, p: Pending<M>) -> u64 {
        self.items += p.items();
        self.queue.push_back(p);
        self.base + self.queue.len() as u64 - 1
    }

    /// Adds one item; returns true when it replaced an older one (conflated).
    pub(crate) fn push_item(&mut self, d: M::Item) -> bool {
        if !M::conflatable(&d) {
            if !self.slots.is_empty() {
                self.slots.remove(&M::key(&d));
            }
            self.push(Pending::One(d));
            return false;
        }
        if !self.draining {
            self.push(Pending::One(d));
            return false;
        }
        let key = M::key(&d);
        if let Some(&at) = self.slots.get(&key) {
            if let Some(Pending::One(old)) = at.checked_sub(self.base).and_then(|i| self.queue.get_mut(i as usize)) {
                M::merge(old, d);
                return true;
            }
        }
        let at = self.push(Pending::One(d));
        self.slots.insert(key, at);
        false
    }

    /// Takes the next batch from the front: up to `limits` (at least one item).
    pub(crate) fn take_batch(&mut self, limits: &MeshLimits) -> Option<(Vec<M>, usize)> {
        let mut batch: Vec<M> = Vec::new();
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
                Pending::One(d) => M::join(&mut batch, d),
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
pub struct Mesh<M: Message> {
    pub me: usize,
    inboxes: Vec<InboxSender<M>>,
    load: Arc<Vec<AtomicUsize>>,
    limits: MeshLimits,
    outgoing: RefCell<Vec<Outgoing<M>>>,
    flush_scheduled: Cell<bool>,
    /// Producers waiting for the backlogs to shrink.
    room_waiters: RefCell<Vec<Waker>>,
    /// Items replaced in a backlog by newer ones (telemetry deliveries).
    pub conflated: Cell<u64>,
    /// The most items any backlog of this core held.
    pub backlog_peak: Cell<usize>,
}

impl<M: Message> Mesh<M> {
    pub fn new(me: usize, inboxes: &Inboxes<M>, limits: MeshLimits) -> Rc<Self> {
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
    pub fn post(self: &Rc<Self>, to: usize, msg: M) {
        debug_assert_ne!(to, self.me, "local work is done in place, not posted");
        {
            let mut outgoing = self.outgoing.borrow_mut();
            let out = &mut outgoing[to];
            match msg.into_items() {
                Ok(items) => {
                    let mut conflated = 0;
                    for d in items {
                        conflated += u64::from(out.push_item(d));
                    }
                    self.conflated.set(self.conflated.get() + conflated);
                }
                Err(msg) => {
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
    async fn drain(self: Rc<Self>, to: usize, first: Vec<M>, first_items: usize) {
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
