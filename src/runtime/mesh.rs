//! Cross-core messaging: one inbox per core, batched per destination.
//!
//! A core never touches another core's state; it posts a [`CoreMsg`] to the owner. Messages
//! posted while a task runs are buffered per destination and sent as one `Vec` when the
//! current burst of work yields, so a burst of N messages to a core costs one channel
//! operation and one wake-up instead of N. Each (sender, receiver) pair is FIFO: a core's
//! messages to another core are applied in the order they were posted.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use futures_channel::oneshot;

use crate::ingest::IngestMessage;
use crate::push::Delivery;
use crate::shard::{DeviceOp, DeviceReply, SessionOp, SessionReply};

/// Where the answer to a cross-core request goes.
pub type Reply<T> = oneshot::Sender<T>;

/// Every message one core can send another.
pub enum CoreMsg {
    /// Device messages for devices this core owns; `done` is answered once they are applied.
    Ingest { batch: Vec<IngestMessage>, done: Option<Reply<()>> },
    /// Operations on devices this core owns, answered in order.
    Devices { ops: Vec<DeviceOp>, reply: Option<Reply<Vec<DeviceReply>>> },
    /// An operation on a session this core owns.
    Session { op: SessionOp, reply: Reply<SessionReply> },
    /// This core's metrics snapshot, for `GET /metrics`.
    Metrics(Reply<crate::metrics::Snapshot>),
    /// Live data for sessions this core owns (from the devices' cores).
    Deliver(Vec<Delivery>),
    /// A WebSocket whose handshake was read on another core, moving to its session's core.
    AdoptSocket(crate::transport::MovedSocket),
    /// An Engine.IO long-polling request for a polling session this core holds.
    Poll { request: crate::transport::socketio_polling::PollRequest, reply: Reply<crate::http::Response> },
}

pub type Inbox = async_channel::Receiver<Vec<CoreMsg>>;
pub type InboxSender = async_channel::Sender<Vec<CoreMsg>>;

/// One core's view of the mesh: senders to every inbox and the outgoing buffers.
pub struct Mesh {
    pub me: usize,
    inboxes: Vec<InboxSender>,
    outbox: RefCell<Vec<Vec<CoreMsg>>>,
    flush_scheduled: Cell<bool>,
}

impl Mesh {
    pub fn new(me: usize, inboxes: Vec<InboxSender>) -> Rc<Self> {
        let outbox = RefCell::new((0..inboxes.len()).map(|_| Vec::new()).collect());
        Rc::new(Self { me, inboxes, outbox, flush_scheduled: Cell::new(false) })
    }

    pub fn cores(&self) -> usize {
        self.inboxes.len()
    }

    /// Queue `msg` for core `to`; it leaves with the rest of this burst.
    pub fn post(self: &Rc<Self>, to: usize, msg: CoreMsg) {
        debug_assert_ne!(to, self.me, "local work is done in place, not posted");
        self.outbox.borrow_mut()[to].push(msg);
        if !self.flush_scheduled.replace(true) {
            let mesh = self.clone();
            monoio::spawn(async move {
                // Runs after the tasks that are ready now: their messages join this batch.
                mesh.flush();
            });
        }
    }

    /// Send every buffered batch now.
    pub fn flush(&self) {
        self.flush_scheduled.set(false);
        let mut outbox = self.outbox.borrow_mut();
        for (to, batch) in outbox.iter_mut().enumerate() {
            if !batch.is_empty() {
                let batch = std::mem::take(batch);
                // Unbounded: only fails when the receiving core has shut down.
                if self.inboxes[to].try_send(batch).is_err() {
                    tracing::warn!(core = to, "message to a stopped core dropped");
                }
            }
        }
    }
}

/// Waits for a reply; a dropped sender means the other core stopped.
pub async fn await_reply<T>(rx: oneshot::Receiver<T>) -> Option<T> {
    rx.await.ok()
}
