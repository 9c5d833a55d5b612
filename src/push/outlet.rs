//! A socket's outgoing queue, on the socket's core.
//!
//! Producers (the fan-out, protocol packets) push; one writer drains everything queued into a
//! single write. Back-pressure policy of one socket, bounded in messages *and* bytes:
//! - **conflated**: once the consumer is behind (`soft` messages or `soft_bytes` bytes
//!   waiting), telemetry is conflated: only the newest telemetry frame per device is kept,
//!   holding the newest value of every key the replaced frames had (a device that alternates
//!   key sets loses no key's latest value; see [`super::envelope::merge_telemetry`]). The
//!   newer frame takes the older one's place when nothing else of that device was queued after
//!   it, and otherwise goes to the back (the older one is dropped), so every device's frames
//!   still leave in the order they arrived (a conflated reading never overtakes the device's
//!   later connection-state or twin frame, nor falls behind it);
//! - **never dropped**: connection state, twin, device-to-cloud messages and protocol packets;
//! - **refused**: past `hard` messages or `hard_bytes` bytes waiting the socket is closed
//!   (1008, "slow consumer"), and what it held is freed at once (a single frame larger than
//!   `hard_bytes` may still wait alone). The close frame goes out after what the writer had
//!   already begun to write, within a bounded wait the transport sets ([`Outlet::set_on_overflow`]).
//!
//! A slow socket therefore costs bounded memory and never slows the others.
//!
//! Under load the writer may hold a short queue back for a bounded moment so its next write
//! carries more frames (the flush policy and its bound: [`super::linger`]). A held queue
//! wakes its writer once it reaches [`LINGER_FRAMES`] frames or [`LINGER_BYTES`] bytes, or
//! gets a protocol item or a close; nothing else here changes.
//!
//! Each queue slot also holds the arrival of the message its frame carries (4 bytes, in a
//! deque kept parallel to the queue, so bounded by the same limits), handed to the writer with
//! the frames for the delivery latency histogram. A conflated slot takes the newest message's
//! arrival: the frame written is that message's, and the older ones are counted as conflated,
//! not delivered.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use hashbrown::HashMap;

use super::envelope::merge_telemetry;
use super::{Delivery, FrameKind};
use crate::metrics::Arrival;

/// Something for the writer to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    /// A `data` envelope (JSON) and its seq in the session's recovery stream (0: none); the
    /// transport wraps it, with the offset when the socket has offsets ([`Outlet::set_offsets`]).
    Envelope(Arc<str>, u64),
    /// A transport-level text packet sent as is (Engine.IO packets).
    Packet(Box<str>),
    /// WebSocket control frames.
    Ping,
    Pong(Vec<u8>),
}

/// What one queued item is charged against the byte limits: its payload plus the framing
/// and bookkeeping around it.
const ITEM_OVERHEAD: usize = 32;

impl Out {
    pub fn charged_bytes(&self) -> usize {
        ITEM_OVERHEAD
            + match self {
                Out::Envelope(frame, _) => frame.len(),
                Out::Packet(p) => p.len(),
                Out::Ping => 0,
                Out::Pong(payload) => payload.len(),
            }
    }
}

/// A held queue (see [`super::linger`]) is written at once when it reaches this many frames.
pub const LINGER_FRAMES: usize = 64;
/// ... or this many charged bytes.
pub const LINGER_BYTES: usize = 32 * 1024;

/// When a socket's queue counts as behind (`soft*`: conflate) and when it is closed (`hard*`).
#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    pub soft: usize,
    pub hard: usize,
    pub soft_bytes: usize,
    pub hard_bytes: usize,
}

/// Why a socket is being closed: WebSocket close code and reason text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseReason {
    pub code: u16,
    pub text: String,
    /// The server ends the session (not a transport failure): Socket.IO sockets get a
    /// DISCONNECT packet (`41`) before the close, so the client sees "io server disconnect"
    /// and does not reconnect on its own.
    pub server_disconnect: bool,
}

impl CloseReason {
    pub fn new(code: u16, text: impl Into<String>) -> Self {
        Self { code, text: text.into(), server_disconnect: false }
    }

    /// A close the server decided on for the session ([`CloseReason::server_disconnect`]).
    pub fn disconnect(code: u16, text: impl Into<String>) -> Self {
        Self { server_disconnect: true, ..Self::new(code, text) }
    }
}

#[derive(Default)]
struct State {
    /// Items in order; `None` marks a telemetry frame replaced by a newer one further back.
    queue: VecDeque<Option<Out>>,
    /// Items that are not `None`.
    live: usize,
    /// Charged bytes of the live items.
    bytes: usize,
    /// While behind: per device, where its newest telemetry frame sits and whether a frame of
    /// another kind of that device was queued after it (then a newer one must go to the back).
    slots: HashMap<Arc<str>, Slot>,
    closing: Option<CloseReason>,
    /// Parallel to `queue`: the arrival of each slot's message (`None` for protocol items).
    arrivals: VecDeque<Option<Arrival>>,
    /// A protocol packet or control frame is queued: the queue may not be held.
    urgent: bool,
    /// Items the last drain took (at most [`REFILL_RESERVE`]): an emptied queue holds no
    /// memory, and the next message reserves this much at once instead of growing the queue
    /// 4, 8, 16 … item by item.
    refill: u8,
    /// A recovery replay ([`Outlet::start_replay`]): written before the queue, a batch per
    /// drain. Not counted against the queue's limits (the replay is bounded by the session's
    /// recovery bound, `--recovery-session-bytes`) and never conflated: the client asked for
    /// all of it. Live frames queue behind it as usual.
    replay: VecDeque<Out>,
}

/// The most items an emptied queue reserves on its next message.
const REFILL_RESERVE: usize = 64;

/// One drain of a replay takes at most this many frames ...
const REPLAY_BATCH_FRAMES: usize = 256;
/// ... or about this many bytes, so a long replay goes out in writes of the usual size.
const REPLAY_BATCH_BYTES: usize = 64 * 1024;

#[derive(Clone, Copy)]
struct Slot {
    pos: usize,
    sealed: bool,
}

impl State {
    fn push(&mut self, item: Out) -> usize {
        if self.queue.capacity() == 0 && self.refill > 1 {
            self.queue.reserve(usize::from(self.refill));
            self.arrivals.reserve(usize::from(self.refill));
        }
        self.urgent |= !matches!(item, Out::Envelope(..));
        self.bytes += item.charged_bytes();
        self.live += 1;
        self.queue.push_back(Some(item));
        self.arrivals.push_back(None);
        self.queue.len() - 1
    }

    fn push_arrived(&mut self, item: Out, arrived: Option<Arrival>) -> usize {
        let pos = self.push(item);
        self.arrivals[pos] = arrived;
        pos
    }

    /// Takes the live items and their arrivals (same length, same order).
    /// The arrivals keep the deque's own buffer (filtered in place, like the items).
    fn take_all_arrived(&mut self) -> (Vec<Out>, Vec<Option<Arrival>>) {
        let mut arrivals = Vec::from(std::mem::take(&mut self.arrivals));
        if !arrivals.iter().any(Option::is_some) {
            arrivals = Vec::new();
        } else if self.live < self.queue.len() {
            let mut slots = self.queue.iter();
            arrivals.retain(|_| slots.next().is_some_and(Option::is_some));
        }
        (self.take_all(), arrivals)
    }

    /// Takes the queue's own buffer (no copy when it is contiguous, and the holes are
    /// filtered out in place), so an emptied queue holds no memory: an idle socket's outlet
    /// costs only its struct.
    fn take_all(&mut self) -> Vec<Out> {
        self.arrivals = VecDeque::new();
        self.refill = self.live.min(REFILL_RESERVE) as u8;
        // `filter_map` (unlike `flatten`) collects in place, in the deque's own buffer: no
        // allocation per drain (that was ~2.5 % of a saturated core's fan-out samples).
        #[allow(clippy::filter_map_identity)]
        let items = Vec::from(std::mem::take(&mut self.queue)).into_iter().filter_map(|item| item).collect();
        if self.slots.capacity() > 0 {
            self.slots = HashMap::new();
        }
        self.live = 0;
        self.bytes = 0;
        self.urgent = false;
        items
    }

    /// The next batch of a replay, when one is running (no close with it: the close waits
    /// until the replay is out).
    fn replay_batch(&mut self) -> Option<Drained> {
        if self.replay.is_empty() {
            return None;
        }
        let (mut n, mut bytes) = (0, 0);
        for item in &self.replay {
            if n == REPLAY_BATCH_FRAMES || (n > 0 && bytes + item.charged_bytes() > REPLAY_BATCH_BYTES) {
                break;
            }
            n += 1;
            bytes += item.charged_bytes();
        }
        let items = self.replay.drain(..n).collect();
        if self.replay.is_empty() {
            self.replay = VecDeque::new();
        }
        Some(Drained { items, closing: None, arrivals: Vec::new() })
    }

    /// Drops the holes once they outnumber the live items (amortised O(1) per conflation).
    fn compact(&mut self) {
        let holes = self.queue.len() - self.live;
        if holes <= self.live.max(32) {
            return;
        }
        let mut remap = Vec::with_capacity(self.queue.len());
        let mut next = 0;
        for item in &self.queue {
            remap.push(next);
            next += usize::from(item.is_some());
        }
        let mut live = self.queue.iter().map(Option::is_some);
        self.arrivals.retain(|_| live.next().unwrap_or(false));
        self.queue.retain(Option::is_some);
        for slot in self.slots.values_mut() {
            slot.pos = remap[slot.pos];
        }
    }
}

pub struct Outlet {
    pub id: u64,
    limits: QueueLimits,
    state: RefCell<State>,
    waker: RefCell<Option<Waker>>,
    /// What the transport does when the socket goes past a hard limit (bound the wait for
    /// its close frame); set while the socket is open.
    on_overflow: RefCell<Option<Box<dyn FnOnce()>>>,
    /// Closed for going past a hard limit, not yet counted in metrics.
    overflowed: Cell<bool>,
    /// The writer holds its write back ([`super::linger`]): a delivery wakes it only once
    /// the queue reaches [`LINGER_FRAMES`] or [`LINGER_BYTES`].
    held: Cell<bool>,
    /// On its core's [`Linger`](super::linger::Linger) list (so it is listed once however often it is held).
    listed: Cell<bool>,
    /// `h1.<epoch>.`: the socket gets each envelope's offset (connection state recovery,
    /// [`super::stream`]); `None`: no offsets.
    offsets: RefCell<Option<Rc<str>>>,
    /// The device parts of queued envelopes' offsets, by seq, oldest first (with
    /// `--redis-url`: [`super::cut`]). Bounded: at most [`MAX_PARTS`], the oldest dropped
    /// first (its frame's offset then has no part: a rebuild from it fails, honestly); an
    /// entry leaves when the writer passes its seq. Each is a copy of the stream's cuts
    /// (80 bytes with its seq, no allocation: at most 320 KiB a socket); the writer makes the
    /// text ([`super::cut::Cuts::encode`]).
    parts: RefCell<std::collections::VecDeque<(u64, super::cut::Cuts)>>,
    /// Whether its offsets carry device parts (a Socket.IO socket with `--redis-url`; a
    /// plain `offsets=1` socket's writer has no place for them, so none are kept for it).
    parts_on: Cell<bool>,
}

/// Device parts an outlet holds at most (one per queued envelope of a streamed session).
pub const MAX_PARTS: usize = 4096;

/// What the writer got from one drain.
pub struct Drained {
    pub items: Vec<Out>,
    pub closing: Option<CloseReason>,
    /// The arrival of each item's message, index for index with `items`; empty when none has
    /// one (protocol packets only).
    pub arrivals: Vec<Option<Arrival>>,
}

impl Drained {
    /// The arrivals of the envelopes taken, for the delivery latency histogram.
    pub fn arrived(&self) -> impl Iterator<Item = Arrival> + '_ {
        self.arrivals.iter().flatten().copied()
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivered {
    Queued,
    /// It replaced an older telemetry frame of the same device (counted in metrics).
    Conflated,
    /// The socket is closing; nothing was queued.
    Dropped,
}

impl Outlet {
    pub fn new(id: u64, limits: QueueLimits) -> Rc<Self> {
        Rc::new(Self {
            id,
            limits,
            state: RefCell::default(),
            waker: RefCell::new(None),
            on_overflow: RefCell::new(None),
            overflowed: Cell::new(false),
            held: Cell::new(false),
            listed: Cell::new(false),
            offsets: RefCell::new(None),
            parts: RefCell::default(),
            parts_on: Cell::new(false),
        })
    }

    /// What the transport does, once, when the socket goes past its hard limits: the queue is
    /// freed and the close (1008) queued already; the transport bounds how long the close frame
    /// may take to go out after what it is writing (a consumer that far behind may not read it
    /// soon). Clear it (`None`) when the transport ends.
    pub fn set_on_overflow(&self, on_overflow: Option<Box<dyn FnOnce()>>) {
        *self.on_overflow.borrow_mut() = on_overflow;
    }

    /// True once after the socket was closed for going past a hard limit (for metrics).
    pub fn take_overflow(&self) -> bool {
        self.overflowed.replace(false)
    }

    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    pub fn is_closing(&self) -> bool {
        self.state.borrow().closing.is_some()
    }

    /// Items waiting and the bytes charged for them.
    pub fn backlog(&self) -> (usize, usize) {
        let s = self.state.borrow();
        (s.live, s.bytes)
    }

    /// Closes a socket whose queue went past a hard limit; true when it did.
    fn check_hard_limits(&self, s: std::cell::RefMut<'_, State>) -> bool {
        let (live, bytes, urgent) = (s.live, s.bytes, s.urgent);
        drop(s);
        let l = &self.limits;
        let why = if live > l.hard {
            format!("slow consumer: more than {} messages waiting", l.hard)
        } else if bytes > l.hard_bytes && live > 1 {
            // One frame alone may exceed it (a big twin or message): it is what the limit is for.
            format!("slow consumer: more than {} bytes waiting", l.hard_bytes)
        } else {
            // A held queue waits for its writer's release unless it grew enough to go now.
            if !self.held.get() || urgent || live >= LINGER_FRAMES || bytes >= LINGER_BYTES {
                self.held.set(false);
                self.wake();
            }
            return false;
        };
        self.close(CloseReason::new(1008, why));
        self.overflowed.set(true);
        let on_overflow = self.on_overflow.borrow_mut().take();
        if let Some(on_overflow) = on_overflow {
            on_overflow();
        }
        true
    }

    /// Queues a protocol item; never dropped (but counts towards the hard limits).
    pub fn push(&self, item: Out) {
        self.push_arrived(item, None);
    }

    /// Queues a delivery, conflating telemetry when the consumer is behind.
    pub fn deliver(&self, d: &Delivery) -> Delivered {
        self.deliver_seq(d, 0)
    }

    /// Queues a delivery with its seq in the session's recovery stream (0: none). A conflated
    /// frame takes the newer frame's seq: the keys it merged are older.
    pub fn deliver_seq(&self, d: &Delivery, seq: u64) -> Delivered {
        let mut s = self.state.borrow_mut();
        if s.closing.is_some() {
            return Delivered::Dropped;
        }
        let behind = s.live >= self.limits.soft || s.bytes >= self.limits.soft_bytes;
        let item = Out::Envelope(d.frame.clone(), seq);
        let mut outcome = Delivered::Queued;
        if d.kind != FrameKind::Telemetry {
            if let Some(slot) = s.slots.get_mut(&d.device) {
                slot.sealed = true;
            }
            s.push_arrived(item, d.arrived);
        } else if !behind {
            s.push_arrived(item, d.arrived);
        } else {
            let old = s.slots.get(&d.device).copied();
            match old {
                Some(Slot { pos, sealed: false }) => {
                    let item = merged_with(s.queue[pos].as_ref(), item);
                    let new_bytes = item.charged_bytes();
                    let previous = s.queue[pos].replace(item).map_or(0, |o| o.charged_bytes());
                    s.bytes = s.bytes + new_bytes - previous;
                    // The newest message's arrival: it is the one whose frame will be written.
                    s.arrivals[pos] = d.arrived;
                }
                Some(Slot { pos, sealed: true }) => {
                    let previous = s.queue[pos].take();
                    if let Some(previous) = &previous {
                        s.bytes -= previous.charged_bytes();
                        s.live -= 1;
                    }
                    let item = merged_with(previous.as_ref(), item);
                    s.arrivals[pos] = None;
                    let pos = s.push_arrived(item, d.arrived);
                    s.slots.insert(d.device.clone(), Slot { pos, sealed: false });
                    s.compact();
                }
                None => {
                    let pos = s.push_arrived(item, d.arrived);
                    s.slots.insert(d.device.clone(), Slot { pos, sealed: false });
                }
            }
            if old.is_some() {
                outcome = Delivered::Conflated;
            }
        }
        if self.check_hard_limits(s) {
            return Delivered::Dropped;
        }
        outcome
    }

    /// The device part of the offset of the envelope queued with `seq` ([`super::cut`]).
    pub fn set_part(&self, seq: u64, part: &super::cut::Cuts) {
        if seq == 0 || !self.parts_on.get() {
            return;
        }
        let mut parts = self.parts.borrow_mut();
        if parts.len() >= MAX_PARTS {
            parts.pop_front();
        }
        parts.push_back((seq, *part));
    }

    /// The device part for the envelope with `seq` the writer is about to write (parts of
    /// lower seqs are dropped: their frames were conflated away or written).
    pub fn take_part(&self, seq: u64) -> Option<super::cut::Cuts> {
        let mut parts = self.parts.borrow_mut();
        if parts.is_empty() {
            return None;
        }
        while parts.front().is_some_and(|(s, _)| *s < seq) {
            parts.pop_front();
        }
        match parts.front() {
            Some((s, _)) if *s == seq => parts.pop_front().map(|(_, p)| p),
            _ => None,
        }
    }

    /// Whether this socket's offsets carry device parts (see [`Outlet::set_part`]).
    pub fn set_parts_on(&self, on: bool) {
        self.parts_on.set(on);
    }

    pub fn parts_on(&self) -> bool {
        self.parts_on.get()
    }

    /// Whether any device part waits (the writer looks them up only then).
    pub fn has_parts(&self) -> bool {
        !self.parts.borrow().is_empty()
    }

    /// The offsets this socket's envelopes carry: `h1.<epoch>.` of its session's stream.
    pub fn set_offsets(&self, prefix: Option<Rc<str>>) {
        *self.offsets.borrow_mut() = prefix;
    }

    /// See [`Outlet::set_offsets`].
    pub fn offsets(&self) -> Option<Rc<str>> {
        self.offsets.borrow().clone()
    }

    /// Starts a recovery replay: what is queued now (the handshake's packets) goes first, then
    /// `items`, then everything queued later. See [`State::replay`] for its bounds.
    pub fn start_replay(&self, items: impl IntoIterator<Item = Out>) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_some() {
            return;
        }
        let before = s.take_all();
        let replay = std::mem::take(&mut s.replay);
        s.replay = before.into_iter().chain(replay).chain(items).collect();
        drop(s);
        self.held.set(false);
        self.wake();
    }

    /// Takes the replay left and everything queued, in order (a polling socket's queue moving
    /// to the WebSocket that upgrades it); arrivals as in [`Drained`].
    pub fn take_everything(&self) -> Drained {
        let mut s = self.state.borrow_mut();
        let replay: Vec<Out> = std::mem::take(&mut s.replay).into();
        let (items, arrivals) = s.take_all_arrived();
        let arrivals = if arrivals.is_empty() || replay.is_empty() {
            arrivals
        } else {
            std::iter::repeat_n(None, replay.len()).chain(arrivals).collect()
        };
        let items = if replay.is_empty() { items } else { replay.into_iter().chain(items).collect() };
        Drained { items, closing: s.closing.clone(), arrivals }
    }

    /// Asks the writer to close the socket now; what is still queued is dropped.
    pub fn close(&self, reason: CloseReason) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_none() {
            drop(s.take_all());
            s.replay = VecDeque::new();
            s.closing = Some(reason);
        }
        drop(s);
        self.held.set(false);
        self.wake();
    }

    /// Asks the writer to send what is queued, then close; nothing more is accepted.
    pub fn finish(&self, reason: CloseReason) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_none() {
            s.closing = Some(reason);
        }
        drop(s);
        self.held.set(false);
        self.wake();
    }

    /// Waits until there is something to write and the queue is not held (or a close).
    pub async fn ready(&self) {
        poll_fn(|cx| {
            let s = self.state.borrow();
            if s.closing.is_some() || !s.replay.is_empty() || (s.live > 0 && !self.held.get()) {
                return Poll::Ready(());
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Holds the queue back ([`super::linger`]) when it may be: something queued, below
    /// [`LINGER_FRAMES`] and [`LINGER_BYTES`], no protocol item, not closing. `None`: not
    /// held; `Some(true)`: held and to be listed on the core's [`Linger`](super::linger::Linger) (it was not yet).
    pub(super) fn hold(&self) -> Option<bool> {
        let s = self.state.borrow();
        if s.closing.is_some() || s.live == 0 || s.urgent || s.live >= LINGER_FRAMES || s.bytes >= LINGER_BYTES || !s.replay.is_empty() {
            return None;
        }
        self.held.set(true);
        Some(!self.listed.replace(true))
    }

    /// The core's [`Linger`](super::linger::Linger) lets a held queue go.
    pub(super) fn release(&self) {
        self.listed.set(false);
        if self.held.replace(false) {
            self.wake();
        }
    }

    /// Whether the writer holds the queue back.
    pub fn is_held(&self) -> bool {
        self.held.get()
    }

    /// Takes everything queued, waiting until there is something (or a close).
    pub async fn drain(&self) -> Drained {
        poll_fn(|cx| {
            let mut s = self.state.borrow_mut();
            if let Some(replayed) = s.replay_batch() {
                return Poll::Ready(replayed);
            }
            if s.closing.is_some() || s.live > 0 {
                let (items, arrivals) = s.take_all_arrived();
                return Poll::Ready(Drained { items, closing: s.closing.clone(), arrivals });
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Takes what is queued without waiting (long-polling).
    pub fn try_drain(&self) -> Drained {
        let mut s = self.state.borrow_mut();
        if let Some(replayed) = s.replay_batch() {
            return replayed;
        }
        let (items, arrivals) = s.take_all_arrived();
        Drained { items, closing: s.closing.clone(), arrivals }
    }

    /// Queues an item taken from another outlet with its arrival (a polling session's queue
    /// moving to the WebSocket that upgrades it); never dropped, like [`Outlet::push`].
    pub fn push_arrived(&self, item: Out, arrived: Option<Arrival>) {
        let mut s = self.state.borrow_mut();
        if s.closing.is_some() {
            return;
        }
        s.push_arrived(item, arrived);
        self.check_hard_limits(s);
    }
}

/// The telemetry frame that replaces `older` in the queue: `newer` with every key only `older`
/// had, so conflation drops superseded values, never a key's newest one.
fn merged_with(older: Option<&Out>, newer: Out) -> Out {
    match (older, newer) {
        (Some(Out::Envelope(old, _)), Out::Envelope(new, seq)) => Out::Envelope(merge_telemetry(old, &new), seq),
        (_, newer) => newer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SessionId;

    #[test]
    fn device_parts_are_kept_by_seq_only_for_sockets_that_write_them_and_bounded() {
        let o = Outlet::new(1, limits(2, 100));
        let cuts = |n: u64| super::super::cut::Cuts::default().note("d", crate::ingest::MsgKey { ms: 1, n });
        let part = cuts(0);
        o.set_part(1, &part);
        assert!(!o.has_parts(), "a socket without parts keeps none");
        o.set_parts_on(true);
        for seq in 1..=3 {
            o.set_part(seq, &cuts(seq));
        }
        o.set_part(0, &part);
        // The writer passes seq 2 (seq 1 was conflated away), then 3.
        assert_eq!(o.take_part(2), Some(cuts(2)));
        assert_eq!(o.take_part(2), None);
        assert_eq!(o.take_part(3), Some(cuts(3)));
        assert!(!o.has_parts());
        for seq in 1..=(MAX_PARTS as u64 + 10) {
            o.set_part(seq, &part);
        }
        assert_eq!(o.parts.borrow().len(), MAX_PARTS);
        assert_eq!(o.take_part(5), None, "the oldest went first");
    }

    fn delivery(device: &str, kind: FrameKind, frame: &str) -> Delivery {
        Delivery { session: SessionId(1), device: device.into(), kind, frame: frame.into(), arrived: None, key: Default::default() }
    }

    fn limits(soft: usize, hard: usize) -> QueueLimits {
        QueueLimits { soft, hard, soft_bytes: usize::MAX, hard_bytes: usize::MAX }
    }

    fn frames(d: Drained) -> Vec<String> {
        d.items.iter().map(|i| match i { Out::Envelope(f, _) => f.to_string(), _ => unreachable!() }).collect()
    }

    #[test]
    fn behind_consumer_gets_newest_telemetry_per_device_and_every_state_change() {
        let o = Outlet::new(1, limits(2, 100));
        assert_eq!(o.deliver(&delivery("a", FrameKind::Telemetry, "t1")), Delivered::Queued);
        o.deliver(&delivery("a", FrameKind::Telemetry, "t2"));
        assert_eq!(o.deliver(&delivery("a", FrameKind::Telemetry, "t3")), Delivered::Queued);
        o.deliver(&delivery("a", FrameKind::ConnectionState, "c1"));
        assert_eq!(o.deliver(&delivery("a", FrameKind::Telemetry, "t4")), Delivered::Conflated);
        assert_eq!(frames(o.try_drain()), vec!["t1", "t2", "c1", "t4"]);
    }

    #[test]
    fn a_conflated_frame_keeps_its_place_before_later_state_frames() {
        let o = Outlet::new(1, limits(1, 100));
        o.deliver(&delivery("b", FrameKind::Telemetry, "b1"));
        o.deliver(&delivery("a", FrameKind::Telemetry, "t1"));
        o.deliver(&delivery("b", FrameKind::Telemetry, "b2"));
        assert_eq!(o.deliver(&delivery("a", FrameKind::Telemetry, "t2")), Delivered::Conflated);
        o.deliver(&delivery("a", FrameKind::ConnectionState, "off"));
        assert_eq!(frames(o.try_drain()), vec!["b1", "t2", "b2", "off"]);
    }

    #[test]
    fn past_the_hard_limit_the_socket_closes() {
        let o = Outlet::new(1, limits(1, 3));
        for i in 0..5 {
            o.deliver(&delivery("a", FrameKind::ConnectionState, &format!("c{i}")));
        }
        assert!(o.is_closing());
        assert!(o.try_drain().closing.unwrap().text.contains("slow consumer"));
    }

    #[test]
    fn one_frame_larger_than_the_byte_limit_may_wait_alone() {
        let o = Outlet::new(1, QueueLimits { soft: 10, hard: 10, soft_bytes: 10, hard_bytes: 100 });
        assert_eq!(o.deliver(&delivery("a", FrameKind::DeviceTwin, &"x".repeat(1000))), Delivered::Queued);
        assert!(!o.is_closing());
    }

    #[test]
    fn past_the_hard_byte_limit_the_socket_closes_and_frees_its_queue() {
        let o = Outlet::new(1, QueueLimits { soft: 1000, hard: 1000, soft_bytes: 1000, hard_bytes: 4000 });
        let big = "x".repeat(1000);
        for _ in 0..3 {
            o.deliver(&delivery("a", FrameKind::Message, &big));
        }
        assert!(!o.is_closing());
        assert_eq!(o.deliver(&delivery("a", FrameKind::Message, &big)), Delivered::Dropped);
        assert_eq!(o.backlog(), (0, 0));
        assert!(o.try_drain().closing.unwrap().text.contains("bytes"));
    }

    #[test]
    fn conflation_by_bytes_keeps_one_frame_per_device_and_holes_are_compacted() {
        let o = Outlet::new(1, QueueLimits { soft: 1000, hard: 100_000, soft_bytes: 10, hard_bytes: 10 << 20 });
        for i in 0..10_000 {
            o.deliver(&delivery("a", FrameKind::Telemetry, &format!("t{i}")));
            o.deliver(&delivery("a", FrameKind::ConnectionState, "c"));
        }
        assert!(!o.is_closing(), "conflation keeps a chatty device under the limits");
        assert!(o.state.borrow().queue.len() <= 2 * o.backlog().0 + 33, "holes are compacted");
        let all = frames(o.try_drain());
        assert_eq!(all.iter().filter(|f| f.starts_with('t')).count(), 2, "{all:?}");
        assert_eq!(all.last().map(String::as_str), Some("c"));
        assert_eq!(all[all.len() - 2], "t9999");
    }

    #[test]
    fn a_held_queue_is_let_go_by_its_size_a_protocol_item_a_close_or_a_release() {
        let o = Outlet::new(1, limits(1000, 10_000));
        assert_eq!(o.hold(), None, "nothing queued: nothing to hold");
        o.deliver(&delivery("a", FrameKind::Telemetry, "t0"));
        assert_eq!(o.hold(), Some(true), "held, and to be listed");
        assert_eq!(o.hold(), Some(false), "held again while listed: not listed twice");
        for i in 1..LINGER_FRAMES - 1 {
            o.deliver(&delivery("a", FrameKind::Telemetry, &format!("t{i}")));
            assert!(o.is_held(), "{} frames still wait", i + 1);
        }
        o.deliver(&delivery("a", FrameKind::Telemetry, "last"));
        assert!(!o.is_held(), "{LINGER_FRAMES} frames go at once");
        assert_eq!(o.hold(), None, "a queue that big is never held");
        o.try_drain();

        o.deliver(&delivery("a", FrameKind::Telemetry, "t"));
        assert!(o.hold().is_some());
        o.push(Out::Pong(b"p".to_vec()));
        assert!(!o.is_held(), "a control frame goes at once");
        assert_eq!(o.hold(), None, "and a queue holding one is never held");
        o.try_drain();

        o.deliver(&delivery("a", FrameKind::Telemetry, &"x".repeat(LINGER_BYTES)));
        assert_eq!(o.hold(), None, "{LINGER_BYTES} bytes go at once");
        o.try_drain();

        o.deliver(&delivery("a", FrameKind::Telemetry, "t"));
        assert!(o.hold().is_some());
        o.release();
        assert!(!o.is_held());
        assert_eq!(o.hold(), Some(true), "released: listed anew");
        o.finish(CloseReason::new(1000, "bye"));
        assert!(!o.is_held(), "a close goes at once");
        assert_eq!(o.hold(), None);
    }

    #[test]
    fn a_replay_goes_after_what_was_queued_before_it_and_before_later_frames() {
        let o = Outlet::new(1, limits(1, 3));
        o.push(Out::Packet("40".into()));
        o.start_replay((1..=600).map(|i| Out::Envelope(format!("r{i}").into(), i)));
        assert_eq!(o.hold(), None, "a replay is never held");
        assert_eq!(o.deliver_seq(&delivery("a", FrameKind::Telemetry, "live"), 601), Delivered::Queued);
        let mut got = Vec::new();
        loop {
            let d = o.try_drain();
            if d.items.is_empty() {
                break;
            }
            assert!(d.items.len() <= REPLAY_BATCH_FRAMES);
            assert!(d.arrivals.is_empty() || d.arrivals.len() == d.items.len());
            got.extend(d.items);
        }
        assert!(!o.is_closing(), "a replay past the queue's hard limit does not close the socket");
        assert_eq!(got.len(), 602);
        assert_eq!(got[0], Out::Packet("40".into()));
        let seqs: Vec<u64> = got[1..].iter().map(|i| match i { Out::Envelope(_, s) => *s, _ => 0 }).collect();
        assert_eq!(seqs, (1..=601).collect::<Vec<_>>());
    }

    #[test]
    fn a_finish_waits_for_the_replay_and_a_close_drops_it() {
        let o = Outlet::new(1, limits(10, 100));
        o.start_replay((1..=300).map(|i| Out::Envelope("r".into(), i)));
        o.finish(CloseReason::new(1000, "bye"));
        let first = o.try_drain();
        assert!(first.closing.is_none() && first.items.len() == REPLAY_BATCH_FRAMES);
        let second = o.try_drain();
        assert!(second.closing.is_none() && second.items.len() == 300 - REPLAY_BATCH_FRAMES);
        assert!(o.try_drain().closing.is_some());
        let o = Outlet::new(2, limits(10, 100));
        o.start_replay((1..=300).map(|i| Out::Envelope("r".into(), i)));
        o.close(CloseReason::new(1000, "gone"));
        let d = o.try_drain();
        assert!(d.items.is_empty() && d.closing.is_some());
    }

    #[test]
    fn take_everything_gives_the_replay_then_the_queue_with_aligned_arrivals() {
        let o = Outlet::new(1, limits(10, 100));
        o.start_replay([Out::Envelope("r".into(), 1)]);
        o.deliver(&arrived("a", FrameKind::Message, "m", 7));
        let d = o.take_everything();
        assert_eq!(d.items.len(), 2);
        assert_eq!(d.arrivals, vec![None, Some(Arrival::at(7))]);
    }

    fn arrived(device: &str, kind: FrameKind, frame: &str, at: u32) -> Delivery {
        Delivery { arrived: Some(Arrival::at(at)), ..delivery(device, kind, frame) }
    }

    #[test]
    fn each_frame_keeps_its_arrival_and_a_conflated_one_the_newest() {
        let o = Outlet::new(1, limits(1, 100));
        o.deliver(&arrived("b", FrameKind::Telemetry, "b1", 1));
        o.push(Out::Packet("2".into()));
        o.deliver(&arrived("a", FrameKind::Telemetry, "a1", 2));
        o.deliver(&arrived("a", FrameKind::Telemetry, "a2", 3)); // replaces a1 in place
        o.deliver(&arrived("b", FrameKind::ConnectionState, "off", 4));
        o.deliver(&arrived("b", FrameKind::Telemetry, "b2", 5)); // behind: new slot at the back
        o.deliver(&arrived("b", FrameKind::Telemetry, "b3", 6)); // replaces b2 in place
        o.deliver(&delivery("c", FrameKind::Telemetry, "c1")); // no arrival (throttled, TTL)
        let d = o.try_drain();
        assert_eq!(d.items.len(), d.arrivals.len());
        let at = |n| Some(Arrival::at(n));
        assert_eq!(d.arrivals, vec![at(1), None, at(3), at(4), at(6), None]);
        assert_eq!(d.arrived().count(), 4);
        assert!(o.try_drain().arrivals.is_empty(), "nothing left behind");
    }

    #[test]
    fn an_emptied_queue_holds_nothing_and_reserves_its_last_drain_on_the_next_message() {
        let o = Outlet::new(1, limits(100, 1000));
        for i in 0..20 {
            o.deliver(&arrived("a", FrameKind::ConnectionState, &format!("s{i}"), i + 1));
        }
        assert_eq!(o.try_drain().items.len(), 20);
        assert_eq!(o.state.borrow().queue.capacity(), 0, "a drained queue keeps no buffer");
        o.deliver(&arrived("a", FrameKind::ConnectionState, "next", 21));
        let s = o.state.borrow();
        assert!(s.queue.capacity() >= 20 && s.arrivals.capacity() >= 20, "{}", s.queue.capacity());
    }

    #[test]
    fn arrivals_follow_their_frames_through_compaction() {
        let o = Outlet::new(1, QueueLimits { soft: 1, hard: 100_000, soft_bytes: usize::MAX, hard_bytes: usize::MAX });
        for i in 1..=1000 {
            o.deliver(&arrived("a", FrameKind::Telemetry, &format!("t{i}"), i));
            o.deliver(&arrived("a", FrameKind::ConnectionState, "c", 100_000 + i));
        }
        let d = o.try_drain();
        let pairs: Vec<(String, Arrival)> = d
            .items
            .iter()
            .zip(&d.arrivals)
            .map(|(i, a)| match i {
                Out::Envelope(f, _) => (f.to_string(), a.expect("every frame has its arrival")),
                _ => unreachable!(),
            })
            .collect();
        for (frame, at) in &pairs {
            if let Some(n) = frame.strip_prefix('t') {
                assert_eq!(*at, Arrival::at(n.parse().unwrap()), "{frame}");
            }
        }
        let telemetry: Vec<&str> = pairs.iter().map(|(f, _)| f.as_str()).filter(|f| f.starts_with('t')).collect();
        assert_eq!(telemetry, ["t1", "t1000"]);
        assert_eq!(pairs.len(), 1002);
        assert_eq!(pairs.last().unwrap().1, Arrival::at(101_000));
    }
}
