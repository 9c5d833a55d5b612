//! A frame tap under fe2o3-amqp: the receivers' links are served from the wire, not by fe2o3.
//!
//! fe2o3's receiver moves every delivery through its connection, session and link tasks as a
//! decoded frame and a large `Delivery` value: most of the AMQP thread's CPU, even with the
//! message itself left undecoded (docs/benchmarks/2026-11-27-amqp-links-served.md). fe2o3
//! stays an unpatched dependency: it opens the connection (TLS, SASL,
//! CBS tokens, `$management`), begins the sessions, attaches and detaches every link, sends
//! heartbeats and reports every error. [`Tap`] sits between fe2o3 and the socket (TCP or TLS)
//! and parses both directions frame by frame (AMQP 1.0 §2.3), whatever way the bytes are split.
//! On one session, the receivers' one (the session fe2o3 begins next after
//! [`TapHandle::arm`]), it takes over the three per-message parts of a receiving link:
//!
//! - **transfers** (§2.7.5) of its links are never shown to fe2o3: each message (one frame,
//!   or several joined) goes to the link's queue, which the partition task drains
//!   ([`OwnedLink::recv`]);
//! - **settlement**: deliveries the peer sent unsettled are accepted and settled with one
//!   `disposition` per run of consecutive delivery ids once the partition handed them to the
//!   cores ([`OwnedLink::done`]);
//! - **credit** (§2.6.7) and the session window (§2.5.6): the tap grants link credit itself
//!   (the credit fe2o3 asked for in its first `flow`, less the messages held), in a `flow` once
//!   half of it can be granted again or half of the session window is used. fe2o3, which sees
//!   none of these transfers, would announce stale counters: its `flow`s on the session are
//!   rewritten with the tap's `next-incoming-id` (and, for a link, `delivery-count` and
//!   `link-credit`); the link fields of the peer's `flow`s are taken out before fe2o3 sees them
//!   (an `echo` is answered by the tap).
//!
//! Frames the tap writes go out between fe2o3's, never inside one. They are queued by the
//! partitions and written by the connection task (fe2o3 always waits to read, so it polls the
//! tap when woken). Everything else passes both ways unchanged: the control session, SASL,
//! headers, heartbeats, `open`/`close`, `attach`/`detach` (read on the way), transfers of a
//! link the tap does not know. A frame of the tapped session that breaks the protocol fails
//! the connection with an error naming it (hubcast reconnects and resumes from its positions).
//!
//! **Bound and back-pressure.** Link credit bounds the messages held: at most the credit
//! fe2o3 asked for (`--event-hub-prefetch`) per link, counted from arrival until the partition
//! calls [`OwnedLink::done`]; a broker that sends past it fails the connection. Bytes are bounded too: past [`MAX_BYTES`] / 2 of held messages
//! no credit is granted; at [`MAX_BYTES`] the tap stops reading the socket (the peer waits in
//! TCP) until partitions release messages. A message joined from several frames is held up
//! to `maxMessageBytes` + [`SECTION_SLACK`]; beyond, its bytes are dropped as they arrive and
//! the partition is told its size (one message being joined per link). The frames the tap
//! writes are bounded by the credit (a `flow` per hand-off and at most one `disposition`
//! per message), fe2o3's written bytes by [`WRITE_BOUND`].
//!
//! **Threads and locks.** The tap runs inside fe2o3's connection task, the partitions in
//! their own tasks, all on the AMQP thread's current-thread runtime: the table's `Mutex` is
//! never contended (fe2o3 needs its stream `Send`, hence not a `RefCell`); it is taken once
//! per socket read and once per hand-off.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use fe2o3_amqp::types::definitions::{Handle, Role};
use fe2o3_amqp::types::messaging::{Accepted, DeliveryState};
use fe2o3_amqp::types::performatives::{Attach, Begin, Disposition, Flow};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::reader::Reader;

/// Most message bytes held at once (see the module docs).
pub const MAX_BYTES: usize = 64 << 20;
/// Bytes of a message's other sections allowed beyond `maxMessageBytes` of body when joining
/// a message from several frames.
pub const SECTION_SLACK: usize = 64 * 1024;
/// Largest frame the tap buffers whole to look at (the connection's `max-frame-size` is 64 KiB);
/// a larger one passes through as it streams.
const MAX_INSPECT: usize = 1 << 20;
/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 64 * 1024;
/// Bytes fe2o3 may have written that the socket has not taken yet; beyond, its writes wait.
pub const WRITE_BOUND: usize = 256 * 1024;

const BEGIN: u8 = 0x11;
const ATTACH: u8 = 0x12;
const FLOW: u8 = 0x13;
const TRANSFER: u8 = 0x14;
const DETACH: u8 = 0x16;
const END: u8 = 0x17;

/// One message received on a link the tap serves.
#[derive(Debug)]
pub struct Delivery {
    pub id: u32,
    /// The peer sent it settled: nothing to accept.
    pub settled: bool,
    /// The message's sections as sent; `Err(size)`: larger than the bound, dropped (see the
    /// module docs).
    pub message: Result<Bytes, usize>,
}

impl Delivery {
    fn len(&self) -> usize {
        self.message.as_ref().map_or(0, Bytes::len)
    }
}

/// A message arriving in several frames.
struct Assembly {
    id: u32,
    settled: bool,
    parts: BytesMut,
    size: usize,
}

struct Link {
    key: u64,
    name: String,
    /// Our handle (fe2o3's `attach`); `flow`s and `detach`es we send carry it.
    handle_out: u32,
    /// The peer's handle (its `attach`); its transfers carry it. The tap serves the link
    /// from then on.
    handle_in: Option<u32>,
    /// The sender's delivery-count as seen here (its initial one plus deliveries begun).
    delivery_count: u32,
    /// `delivery_count + link_credit` of the last `flow` sent.
    limit: u32,
    /// The highest `limit` ever sent: a delivery past it broke the credit (a lower later
    /// limit may still meet deliveries sent before the broker saw it). RabbitMQ 3.x's AMQP 1.0
    /// plugin overshoots it now and then (tests/amqp_rabbitmq.rs at a credit of 8: the
    /// connection was failed 1 run in 6; with this slack 12 runs of 12 passed): up to one
    /// `window` past it is taken and logged once
    /// ([`Link::overshoot_logged`]); further than that fails the connection. The count held stays
    /// bounded (two windows) and the bytes by [`MAX_BYTES`].
    granted: u32,
    /// The broker's overshoot of the credit has been logged for this link.
    overshoot_logged: bool,
    /// The credit to keep granted: what fe2o3 asked for in its first `flow`.
    window: Option<u32>,
    /// Messages for the partition. Bounded by the credit in count (a delivery past the
    /// highest limit granted fails the connection) and by [`MAX_BYTES`] in bytes for the
    /// whole table (the socket is not read past it); the broker waits for credit.
    queue: VecDeque<Delivery>,
    /// Received and not yet released by the partition (queued or being handed over).
    held: u32,
    assembling: Option<Assembly>,
    waker: Option<Waker>,
    detached: bool,
}

impl Link {
    /// The credit the sender has left; none if it overran.
    fn credit_left(&self) -> u32 {
        u32::try_from(self.limit.wrapping_sub(self.delivery_count) as i32).unwrap_or(0)
    }

    /// Moves up to `max - out.len()` queued messages to `out`; how many.
    fn take(&mut self, out: &mut Vec<Delivery>, max: usize) -> usize {
        let n = max.saturating_sub(out.len()).min(self.queue.len());
        out.extend(self.queue.drain(..n));
        n
    }

    /// Records a `flow` granting `credit` from the current delivery-count.
    fn grant(&mut self, credit: u32) {
        self.limit = self.delivery_count.wrapping_add(credit);
        if self.limit.wrapping_sub(self.granted) as i32 > 0 {
            self.granted = self.limit;
        }
    }
}

/// The receivers' session, as both ends number it.
struct Session {
    channel_out: u16,
    channel_in: Option<u16>,
    /// Transfer frames received: the peer's next-outgoing-id as of its `begin`, plus one per
    /// transfer frame since.
    next_incoming_id: u32,
    /// `next_incoming_id` when the window was last announced.
    window_at: u32,
    /// fe2o3's own session fields, as in its last `begin` or `flow`.
    incoming_window: u32,
    next_outgoing_id: u32,
    outgoing_window: u32,
}

#[derive(Default)]
struct Table {
    /// fe2o3's next `begin` names the receivers' session.
    armed: bool,
    /// Bound of a joined message (see [`SECTION_SLACK`]).
    max_message: usize,
    session: Option<Session>,
    links: Vec<Link>,
    next_key: u64,
    /// Message bytes held (queued or being handed over).
    bytes: usize,
    /// Frames for the peer, written between fe2o3's. Bounded by the credit: at most one
    /// `flow` per hand-off and one `disposition` per message handed over, and emptied
    /// whenever fe2o3 polls the tap.
    inject: BytesMut,
    /// fe2o3's connection task (it writes `inject`, and reads again once bytes are released).
    conn: Option<Waker>,
    /// A protocol error on the tapped session: the connection fails with it.
    failed: Option<String>,
    /// Partition tasks to wake once the lock is released.
    wake: Vec<Waker>,
}

/// What becomes of a frame from the peer.
enum Incoming {
    Pass,
    Replace(Vec<u8>),
    Absorbed,
}

impl Table {
    fn link_in(&self, handle: u32) -> Option<&Link> {
        self.links.iter().find(|l| l.handle_in == Some(handle) && !l.detached)
    }

    fn link_mut(&mut self, key: u64) -> Option<&mut Link> {
        self.links.iter_mut().find(|l| l.key == key)
    }

    fn channel_in(&self) -> Option<u16> {
        self.session.as_ref().and_then(|s| s.channel_in)
    }

    fn fail(&mut self, reason: String) {
        if self.failed.is_none() {
            tracing::error!(reason = %reason, "AMQP tap: the receivers' session broke the protocol; closing the connection");
            self.failed = Some(reason);
        }
    }

    /// A frame fe2o3 writes: `Some` to send instead.
    fn outgoing(&mut self, channel: u16, body: &[u8]) -> Option<Vec<u8>> {
        let code = performative(body)?;
        if code == BEGIN && self.armed {
            let begin: Begin = serde_amqp::from_slice(body).ok()?;
            self.armed = false;
            self.session = Some(Session {
                channel_out: channel,
                channel_in: None,
                next_incoming_id: 0,
                window_at: 0,
                incoming_window: begin.incoming_window,
                next_outgoing_id: begin.next_outgoing_id,
                outgoing_window: begin.outgoing_window,
            });
            return None;
        }
        if self.session.as_ref().map(|s| s.channel_out) != Some(channel) {
            return None;
        }
        match code {
            ATTACH => {
                let attach: Attach = serde_amqp::from_slice(body).ok()?;
                if attach.role == Role::Receiver {
                    // A link attached again under its name replaces the old one; what it still
                    // queued is dropped (its partition finds the link gone).
                    let queued: usize = self.links.iter().filter(|l| l.name == attach.name).flat_map(|l| &l.queue).map(Delivery::len).sum();
                    self.bytes = self.bytes.saturating_sub(queued);
                    self.links.retain(|l| l.name != attach.name);
                    self.next_key += 1;
                    self.links.push(Link {
                        key: self.next_key,
                        name: attach.name,
                        handle_out: attach.handle.0,
                        handle_in: None,
                        delivery_count: 0,
                        limit: 0,
                        granted: 0,
                        overshoot_logged: false,
                        window: None,
                        queue: VecDeque::new(),
                        held: 0,
                        assembling: None,
                        waker: None,
                        detached: false,
                    });
                }
                None
            }
            FLOW => {
                let mut flow: Flow = serde_amqp::from_slice(body).ok()?;
                let bytes = self.bytes;
                let s = self.session.as_mut()?;
                s.incoming_window = flow.incoming_window;
                s.next_outgoing_id = flow.next_outgoing_id;
                s.outgoing_window = flow.outgoing_window;
                if s.channel_in.is_some() {
                    flow.next_incoming_id = Some(s.next_incoming_id);
                    s.window_at = s.next_incoming_id;
                }
                if let Some(h) = flow.handle.as_ref().map(|h| h.0) {
                    if let Some(link) = self.links.iter_mut().find(|l| l.handle_out == h && l.handle_in.is_some()) {
                        let window = *link.window.get_or_insert(flow.link_credit.unwrap_or(0));
                        let grant = credit_to_grant(window, link.held, bytes);
                        flow.delivery_count = Some(link.delivery_count);
                        flow.link_credit = Some(grant);
                        link.grant(grant);
                    }
                }
                Some(encode(channel, &flow))
            }
            _ => None,
        }
    }

    /// A frame from the peer (`frame` whole, its body from `doff`).
    fn incoming(&mut self, channel: u16, frame: &Bytes, doff: usize) -> Incoming {
        let body = &frame[doff..];
        let Some(code) = performative(body) else { return Incoming::Pass };
        if code == BEGIN {
            if let Some(s) = self.session.as_mut().filter(|s| s.channel_in.is_none()) {
                if let Ok(begin) = serde_amqp::from_slice::<Begin>(body) {
                    if begin.remote_channel == Some(s.channel_out) {
                        s.channel_in = Some(channel);
                        s.next_incoming_id = begin.next_outgoing_id;
                        s.window_at = begin.next_outgoing_id;
                    }
                }
            }
            return Incoming::Pass;
        }
        if self.channel_in() != Some(channel) {
            return Incoming::Pass;
        }
        match code {
            TRANSFER => self.transfer(frame, doff),
            ATTACH => {
                if let Ok(attach) = serde_amqp::from_slice::<Attach>(body) {
                    if attach.role == Role::Sender {
                        if let Some(link) = self.links.iter_mut().find(|l| l.name == attach.name && l.handle_in.is_none()) {
                            link.handle_in = Some(attach.handle.0);
                            link.delivery_count = attach.initial_delivery_count.unwrap_or(0);
                            link.limit = link.delivery_count;
                            link.granted = link.delivery_count;
                        }
                    }
                }
                Incoming::Pass
            }
            FLOW => {
                let Ok(mut flow) = serde_amqp::from_slice::<Flow>(body) else { return Incoming::Pass };
                let Some(h) = flow.handle.as_ref().map(|h| h.0) else { return Incoming::Pass };
                let Some(key) = self.link_in(h).map(|l| l.key) else { return Incoming::Pass };
                if flow.echo {
                    self.flow(key, true);
                }
                // Session fields only: fe2o3's view of this link's counters is not kept.
                flow.handle = None;
                flow.delivery_count = None;
                flow.link_credit = None;
                flow.available = None;
                flow.drain = false;
                flow.echo = false;
                Incoming::Replace(encode(channel, &flow))
            }
            DETACH => {
                if let Some(h) = first_uint(&body[3..]) {
                    if let Some(i) = self.links.iter().position(|l| l.handle_in == Some(h) && !l.detached) {
                        let link = &mut self.links[i];
                        link.detached = true;
                        link.assembling = None;
                        if let Some(w) = link.waker.take() {
                            self.wake.push(w);
                        }
                    }
                }
                Incoming::Pass
            }
            END => {
                self.session = None;
                for link in &mut self.links {
                    link.detached = true;
                    if let Some(w) = link.waker.take() {
                        self.wake.push(w);
                    }
                }
                Incoming::Pass
            }
            _ => Incoming::Pass,
        }
    }

    /// A transfer frame of the tapped session.
    fn transfer(&mut self, frame: &Bytes, doff: usize) -> Incoming {
        if let Some(s) = self.session.as_mut() {
            s.next_incoming_id = s.next_incoming_id.wrapping_add(1);
        }
        let Some(t) = parse_transfer(&frame[doff..]) else {
            self.fail("a transfer that is not a valid AMQP transfer performative".into());
            return Incoming::Absorbed;
        };
        let cap = self.max_message;
        let Some(i) = self.links.iter().position(|l| l.handle_in == Some(t.handle) && !l.detached) else { return Incoming::Pass };
        let link = &mut self.links[i];
        // Copied out of the read buffer: a slice would keep the whole buffer (64 KiB) alive
        // for as long as the partition holds the message, and the bound counts messages.
        let payload = Bytes::copy_from_slice(&frame[doff + t.len..]);
        let mut done = None;
        match link.assembling.as_mut() {
            None => {
                let Some(id) = t.delivery_id else {
                    let reason = format!("a transfer begins a delivery on link {} without a delivery-id", link.name);
                    self.fail(reason);
                    return Incoming::Absorbed;
                };
                link.delivery_count = link.delivery_count.wrapping_add(1);
                let past = link.delivery_count.wrapping_sub(link.granted) as i32;
                if past > 0 {
                    // Credit bounds what is held: a small overshoot (one window at most) is taken,
                    // a broker that ignores the credit is not followed.
                    let slack = link.window.unwrap_or(0).max(1);
                    if past as u32 > slack {
                        let reason = format!("the broker sent past the link credit on link {}", link.name);
                        self.fail(reason);
                        return Incoming::Absorbed;
                    }
                    if !link.overshoot_logged {
                        link.overshoot_logged = true;
                        tracing::warn!(link = %link.name, past, slack, "the broker sent past the link credit; taken (at most one window past it is)");
                    }
                }
                if t.aborted {
                    // Nothing to keep: an aborted delivery is settled (§2.6.12).
                } else if !t.more {
                    let message = if payload.len() <= cap { Ok(payload) } else { Err(payload.len()) };
                    done = Some(Delivery { id, settled: t.settled, message });
                } else {
                    let mut parts = BytesMut::new();
                    if payload.len() <= cap {
                        parts.extend_from_slice(&payload);
                    }
                    link.assembling = Some(Assembly { id, settled: t.settled, parts, size: payload.len() });
                }
            }
            Some(a) => {
                a.size = a.size.saturating_add(payload.len());
                if a.size <= cap {
                    a.parts.extend_from_slice(&payload);
                } else {
                    a.parts = BytesMut::new();
                }
                if t.aborted {
                    link.assembling = None;
                } else if !t.more {
                    let a = link.assembling.take().expect("matched Some");
                    let message = if a.size <= cap { Ok(a.parts.freeze()) } else { Err(a.size) };
                    done = Some(Delivery { id: a.id, settled: a.settled, message });
                }
            }
        }
        if let Some(d) = done {
            self.bytes += d.len();
            link.queue.push_back(d);
            link.held += 1;
            if let Some(w) = link.waker.take() {
                self.wake.push(w);
            }
        }
        Incoming::Absorbed
    }

    /// Queues a `flow` for link `key` if enough credit can be granted again, or the session
    /// window is half used (or always, with `force`).
    fn flow(&mut self, key: u64, force: bool) {
        let bytes = self.bytes;
        let (Some(s), Some(link)) = (self.session.as_mut(), self.links.iter_mut().find(|l| l.key == key)) else { return };
        let (Some(window), Some(_)) = (link.window, s.channel_in) else { return };
        if link.detached {
            return;
        }
        let grant = credit_to_grant(window, link.held, bytes);
        let left = link.credit_left();
        let session_used = s.next_incoming_id.wrapping_sub(s.window_at);
        let worth = grant > left && (grant - left >= (window / 2).max(1) || left == 0 || session_used >= s.incoming_window / 2);
        if !(force || worth) {
            return;
        }
        let flow = Flow {
            next_incoming_id: Some(s.next_incoming_id),
            incoming_window: s.incoming_window,
            next_outgoing_id: s.next_outgoing_id,
            outgoing_window: s.outgoing_window,
            handle: Some(Handle(link.handle_out)),
            delivery_count: Some(link.delivery_count),
            link_credit: Some(grant),
            available: None,
            drain: false,
            echo: false,
            properties: None,
        };
        link.grant(grant);
        s.window_at = s.next_incoming_id;
        let frame = encode(s.channel_out, &flow);
        self.inject.extend_from_slice(&frame);
    }
}

/// Credit to grant a link holding `held` messages (none while the bytes held pass half the bound).
fn credit_to_grant(window: u32, held: u32, bytes: usize) -> u32 {
    if bytes > MAX_BYTES / 2 {
        0
    } else {
        window.saturating_sub(held)
    }
}

/// The performative code of a frame body (`00 53 code`).
fn performative(body: &[u8]) -> Option<u8> {
    match body {
        [0x00, 0x53, code, ..] => Some(*code),
        _ => None,
    }
}

/// An AMQP frame (type 0) on `channel` with `performative` and no payload.
fn encode(channel: u16, performative: &impl serde::Serialize) -> Vec<u8> {
    let body = serde_amqp::to_vec(performative).expect("a performative always encodes");
    let mut f = Vec::with_capacity(8 + body.len());
    f.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
    f.extend_from_slice(&[2, 0]);
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&body);
    f
}

/// The table of one connection (its served links and their queues), shared by its [`Tap`] and
/// its partition tasks.
#[derive(Clone, Default)]
pub struct TapHandle(Arc<Mutex<Table>>);

impl TapHandle {
    pub fn new() -> Self {
        Self::default()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves the links of the session fe2o3 begins next; a message joined from several
    /// frames is kept up to `max_message` bytes of body (plus [`SECTION_SLACK`]).
    pub fn arm(&self, max_message: usize) {
        let mut t = self.table();
        t.armed = true;
        t.max_message = max_message.saturating_add(SECTION_SLACK);
    }

    /// The link named `name` if the tap serves it (its attach went both ways on the tapped
    /// session); `None`: fe2o3 serves it.
    pub fn link(&self, name: &str) -> Option<OwnedLink> {
        let t = self.table();
        let link = t.links.iter().find(|l| l.name == name && l.handle_in.is_some() && !l.detached)?;
        Some(OwnedLink { handle: self.clone(), key: link.key })
    }

    /// Message bytes held now.
    pub fn bytes(&self) -> usize {
        self.table().bytes
    }
}

/// A receiving link served by the tap, as its partition task sees it.
pub struct OwnedLink {
    handle: TapHandle,
    key: u64,
}

impl OwnedLink {
    /// Moves up to `max - out.len()` queued messages to `out`, waiting for at least one;
    /// `false`: the link or its session ended. Cancel safe (nothing is taken unless it
    /// returns).
    pub async fn recv(&self, out: &mut Vec<Delivery>, max: usize) -> bool {
        std::future::poll_fn(|cx| {
            let mut t = self.handle.table();
            let Some(link) = t.link_mut(self.key) else { return Poll::Ready(false) };
            if link.queue.is_empty() {
                if link.detached {
                    return Poll::Ready(false);
                }
                remember(&mut link.waker, cx);
                return Poll::Pending;
            }
            link.take(out, max);
            Poll::Ready(true)
        })
        .await
    }

    /// The partition let its link go (its lease moved) and detached it: what the tap still
    /// queues for it is dropped with its entry (its bytes released), as when a link is
    /// attached again under its name. Transfers still on their way pass to fe2o3, which
    /// holds the link until the peer's `detach`.
    pub fn forget(&self) {
        let mut t = self.handle.table();
        if let Some(i) = t.links.iter().position(|l| l.key == self.key) {
            let link = t.links.remove(i);
            let queued: usize = link.queue.iter().map(Delivery::len).sum();
            t.bytes = t.bytes.saturating_sub(queued);
        }
    }

    /// Moves what is queued now (up to `max - out.len()`) to `out` without waiting.
    pub fn try_recv(&self, out: &mut Vec<Delivery>, max: usize) -> usize {
        self.handle.table().link_mut(self.key).map_or(0, |link| link.take(out, max))
    }

    /// The credit the sender has left (messages it may still send before a `flow`).
    pub fn credit(&self) -> u32 {
        self.handle.table().link_mut(self.key).map_or(0, |l| l.credit_left())
    }

    /// `delivered` are with the cores: accepts those sent unsettled (one `disposition` per run
    /// of consecutive ids), releases their credit and bytes, and grants credit if worth it.
    pub fn done(&self, delivered: &[Delivery]) {
        let waker = {
            let mut t = self.handle.table();
            let bytes: usize = delivered.iter().map(Delivery::len).sum();
            t.bytes = t.bytes.saturating_sub(bytes);
            let live = match t.link_mut(self.key) {
                Some(link) => {
                    link.held = link.held.saturating_sub(delivered.len() as u32);
                    !link.detached
                }
                None => return,
            };
            if live {
                if let Some(channel) = t.session.as_ref().map(|s| s.channel_out) {
                    let mut run: Option<(u32, u32)> = None;
                    for id in delivered.iter().filter(|d| !d.settled).map(|d| d.id) {
                        run = match run {
                            Some((first, last)) if last.wrapping_add(1) == id => Some((first, id)),
                            Some(r) => {
                                t.inject.extend_from_slice(&accept(channel, r));
                                Some((id, id))
                            }
                            None => Some((id, id)),
                        };
                    }
                    if let Some(r) = run {
                        t.inject.extend_from_slice(&accept(channel, r));
                    }
                }
                t.flow(self.key, false);
            }
            // Reading may have stopped at the bytes bound: the connection task looks again.
            t.conn.clone()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// A `disposition` accepting and settling deliveries `first..=last`.
fn accept(channel: u16, (first, last): (u32, u32)) -> Vec<u8> {
    let d = Disposition {
        role: Role::Receiver,
        first,
        last: (last != first).then_some(last),
        settled: true,
        state: Some(DeliveryState::Accepted(Accepted {})),
        batchable: false,
    };
    encode(channel, &d)
}

/// Where a direction of the stream is.
#[derive(Clone, Copy)]
enum Mode {
    /// At a frame boundary (or a protocol header).
    Frame,
    /// This many more bytes of the current frame pass through unchanged.
    Pass(usize),
    /// Everything passes through unchanged (the stream could not be followed).
    Off,
}

/// Splits the next piece off `raw`: `Some((frame, doff))` for a whole frame to look at, or
/// moves bytes that pass unchanged to `out`. `None`: more bytes are needed.
fn next_frame(mode: &mut Mode, raw: &mut BytesMut, out: &mut BytesMut) -> Option<Option<(Bytes, usize)>> {
    match *mode {
        Mode::Off => {
            let n = raw.len();
            out.extend_from_slice(&raw.split_to(n));
            None
        }
        Mode::Pass(left) => {
            let n = left.min(raw.len());
            if n == 0 {
                return None;
            }
            out.extend_from_slice(&raw.split_to(n));
            *mode = if left == n { Mode::Frame } else { Mode::Pass(left - n) };
            Some(None)
        }
        Mode::Frame => {
            if raw.len() < 8 {
                return None;
            }
            if &raw[..4] == b"AMQP" {
                *mode = Mode::Pass(8);
                return Some(None);
            }
            let size = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]) as usize;
            let doff = usize::from(raw[4]) * 4;
            if size < 8 || doff < 8 || doff > size {
                *mode = Mode::Off;
                return Some(None);
            }
            if raw[5] != 0 || size > MAX_INSPECT || size == doff {
                // SASL, oversized (fe2o3 refuses it), or an empty (heartbeat) frame.
                *mode = Mode::Pass(size);
                return Some(None);
            }
            if raw.len() < size {
                return None;
            }
            Some(Some((raw.split_to(size).freeze(), doff)))
        }
    }
}

/// The socket as fe2o3 sees it (see the module docs).
pub struct Tap<S> {
    inner: S,
    handle: TapHandle,
    /// Read from the socket, not yet looked at. Bounded without a check of its own: the tap
    /// reads the socket only when fe2o3 has taken all of `out`, and a frame is held whole
    /// only up to [`MAX_INSPECT`] (a larger one streams through): at most one such frame plus
    /// one [`READ_CHUNK`]. Messages are copied out of it (see [`Table::transfer`]).
    raw: BytesMut,
    /// What one socket read fills (then appended to `raw`).
    scratch: Box<[u8]>,
    /// Ready for fe2o3.
    out: BytesMut,
    mode: Mode,
    eof: bool,
    /// Written by fe2o3, not yet a whole frame: at most one frame (fe2o3 writes frames of at
    /// most the peer's max-frame-size; a larger one than [`MAX_INSPECT`] streams through).
    wraw: BytesMut,
    /// Whole frames for the socket (fe2o3's and the tap's), at most about [`WRITE_BOUND`].
    wout: BytesMut,
    wmode: Mode,
}

impl<S> Tap<S> {
    pub fn new(inner: S, handle: TapHandle) -> Self {
        Tap {
            inner,
            handle,
            raw: BytesMut::new(),
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
            out: BytesMut::new(),
            mode: Mode::Frame,
            eof: false,
            wraw: BytesMut::new(),
            wout: BytesMut::new(),
            wmode: Mode::Frame,
        }
    }

    /// Moves what can be decided from `raw` to `out` (and messages to their links).
    fn process(&mut self) {
        let wake = {
            let mut t = self.handle.table();
            while let Some(piece) = next_frame(&mut self.mode, &mut self.raw, &mut self.out) {
                let Some((frame, doff)) = piece else { continue };
                let channel = u16::from_be_bytes([frame[6], frame[7]]);
                match t.incoming(channel, &frame, doff) {
                    Incoming::Pass => self.out.extend_from_slice(&frame),
                    Incoming::Replace(f) => self.out.extend_from_slice(&f),
                    Incoming::Absorbed => {}
                }
            }
            std::mem::take(&mut t.wake)
        };
        for w in wake {
            w.wake();
        }
    }

    /// Moves fe2o3's whole written frames from `wraw` to `wout`, rewritten where needed.
    fn process_writes(&mut self) {
        let mut t = self.handle.table();
        while let Some(piece) = next_frame(&mut self.wmode, &mut self.wraw, &mut self.wout) {
            let Some((frame, doff)) = piece else { continue };
            let channel = u16::from_be_bytes([frame[6], frame[7]]);
            match t.outgoing(channel, &frame[doff..]) {
                Some(f) => self.wout.extend_from_slice(&f),
                None => self.wout.extend_from_slice(&frame),
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> Tap<S> {
    /// Writes `wout` and the tap's queued frames (between whole frames only) to the socket,
    /// as far as it takes them now.
    fn flush_writes(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        if matches!(self.wmode, Mode::Frame) {
            let mut t = self.handle.table();
            if !t.inject.is_empty() {
                self.wout.extend_from_slice(&t.inject);
                t.inject.clear();
            }
        }
        let mut wrote = false;
        while !self.wout.is_empty() {
            match Pin::new(&mut self.inner).poll_write(cx, &self.wout) {
                Poll::Ready(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(n)) => {
                    self.wout.advance(n);
                    wrote = true;
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => break,
            }
        }
        if wrote {
            if let Poll::Ready(Err(e)) = Pin::new(&mut self.inner).poll_flush(cx) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Ready once every byte for the socket (fe2o3's and the tap's) was taken by it.
    fn poll_written(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.flush_writes(cx)?;
        if self.wout.is_empty() {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

/// Keeps the waker of the latest poll in `slot` (a clone only when it changed).
fn remember(slot: &mut Option<Waker>, cx: &Context<'_>) {
    if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
        *slot = Some(cx.waker().clone());
    }
}

/// The parts of a `transfer` performative (§2.7.5) the tap needs.
#[derive(Debug, PartialEq)]
struct TransferHead {
    /// Bytes of the performative (descriptor and list).
    len: usize,
    handle: u32,
    delivery_id: Option<u32>,
    settled: bool,
    more: bool,
    aborted: bool,
}

/// Reads a transfer performative (either list width, every encoding of its fields); `None`
/// if it is not a valid transfer.
fn parse_transfer(body: &[u8]) -> Option<TransferHead> {
    if body.get(..3)? != [0x00, 0x53, TRANSFER] {
        return None;
    }
    let (start, size, count) = match *body.get(3)? {
        0xc0 => (6usize, usize::from(*body.get(4)?).checked_sub(1)?, usize::from(*body.get(5)?)),
        0xd0 => {
            let size = u32::from_be_bytes(body.get(4..8)?.try_into().ok()?) as usize;
            let count = u32::from_be_bytes(body.get(8..12)?.try_into().ok()?) as usize;
            (12, size.checked_sub(4)?, count)
        }
        _ => return None,
    };
    if count == 0 || count > 11 {
        return None;
    }
    let end = start.checked_add(size)?;
    let list = body.get(start..end)?;
    let mut r = Reader::new(list);
    let mut head = TransferHead { len: end, handle: 0, delivery_id: None, settled: false, more: false, aborted: false };
    for i in 0..count {
        match i {
            0 => head.handle = r.uint()??,
            1 => head.delivery_id = r.uint()?,
            4 => head.settled = r.bool()?,
            5 => head.more = r.bool()?,
            9 => head.aborted = r.bool()?,
            // tag, format, rcv-settle-mode, state, resume, batchable: not needed, skipped.
            _ => {
                r.skip(0)?;
            }
        }
    }
    (r.pos == list.len()).then_some(head)
}

/// [`parse_transfer`] for the fuzz target (src/fuzzing.rs): (bytes of the performative,
/// handle, delivery-id, settled, more, aborted).
#[doc(hidden)]
pub fn parse_transfer_fields(body: &[u8]) -> Option<(usize, u32, Option<u32>, bool, bool, bool)> {
    parse_transfer(body).map(|t| (t.len, t.handle, t.delivery_id, t.settled, t.more, t.aborted))
}

/// The first field of a performative's list if it is a uint (a `detach`'s handle).
fn first_uint(list: &[u8]) -> Option<u32> {
    let skip = match *list.first()? {
        0xc0 => 3,
        0xd0 => 9,
        _ => return None,
    };
    Reader::new(list.get(skip..)?).uint()?
}

// fe2o3 wants its stream `Debug`.
impl<S> std::fmt::Debug for Tap<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("buffered", &self.raw.len()).field("ready", &self.out.len()).finish_non_exhaustive()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Tap<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        // The tap's own frames go out whenever fe2o3 polls (it always waits to read).
        this.flush_writes(cx)?;
        loop {
            if !this.out.is_empty() {
                let n = this.out.len().min(buf.remaining());
                buf.put_slice(&this.out[..n]);
                this.out.advance(n);
                return Poll::Ready(Ok(()));
            }
            {
                let mut t = this.handle.table();
                if let Some(reason) = &t.failed {
                    return Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("AMQP tap: {reason}"))));
                }
                remember(&mut t.conn, cx);
                if t.bytes >= MAX_BYTES {
                    // Partitions release bytes, then wake this task.
                    return Poll::Pending;
                }
            }
            if this.eof {
                // A partial frame at the end goes to fe2o3 as it is (it reports the cut).
                let n = this.raw.len();
                this.out.extend_from_slice(&this.raw.split_to(n));
                if this.out.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let read = {
                let mut rb = ReadBuf::new(&mut this.scratch[..]);
                match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) => rb.filled().len(),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            };
            this.raw.extend_from_slice(&this.scratch[..read]);
            if read == 0 {
                this.eof = true;
            } else {
                this.process();
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.wout.len() >= WRITE_BOUND {
            this.flush_writes(cx)?;
            if this.wout.len() >= WRITE_BOUND {
                return Poll::Pending;
            }
        }
        this.wraw.extend_from_slice(buf);
        this.process_writes();
        this.flush_writes(cx)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_written(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_written(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp::types::definitions::{ReceiverSettleMode, SenderSettleMode};
    use fe2o3_amqp::types::performatives::{Detach, Transfer};
    use fe2o3_amqp::types::primitives::Binary;
    use std::collections::VecDeque;

    /// A socket: reads hand over what the test queued, `chunk` bytes at a time (pending
    /// when empty); writes are kept.
    struct Socket {
        input: VecDeque<u8>,
        chunk: usize,
        written: Vec<u8>,
    }

    impl AsyncRead for Socket {
        fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
            if self.input.is_empty() {
                return Poll::Pending;
            }
            let n = self.chunk.min(self.input.len()).min(buf.remaining());
            let bytes: Vec<u8> = self.input.drain(..n).collect();
            buf.put_slice(&bytes);
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Socket {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
            self.written.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// fe2o3's side of a tapped socket.
    struct Fe2o3 {
        tap: Tap<Socket>,
        handle: TapHandle,
    }

    impl Fe2o3 {
        fn new(chunk: usize) -> Self {
            let handle = TapHandle::new();
            Fe2o3 { tap: Tap::new(Socket { input: VecDeque::new(), chunk, written: Vec::new() }, handle.clone()), handle }
        }

        /// The peer sends `bytes`; what fe2o3 reads of them.
        fn peer_sends(&mut self, bytes: &[u8]) -> Vec<u8> {
            self.tap.inner.input.extend(bytes);
            let mut cx = Context::from_waker(Waker::noop());
            let mut got = Vec::new();
            let mut buf = [0u8; 100];
            loop {
                let mut rb = ReadBuf::new(&mut buf);
                match Pin::new(&mut self.tap).poll_read(&mut cx, &mut rb) {
                    Poll::Ready(Ok(())) if rb.filled().is_empty() => break,
                    Poll::Ready(Ok(())) => got.extend_from_slice(rb.filled()),
                    Poll::Ready(Err(e)) => panic!("read failed: {e}"),
                    Poll::Pending => break,
                }
            }
            got
        }

        /// The peer sends `bytes`; fe2o3's next read fails: with what error.
        fn read_fails(&mut self, bytes: &[u8]) -> std::io::Error {
            self.tap.inner.input.extend(bytes);
            let mut cx = Context::from_waker(Waker::noop());
            let mut buf = [0u8; 64];
            match Pin::new(&mut self.tap).poll_read(&mut cx, &mut ReadBuf::new(&mut buf)) {
                Poll::Ready(Err(e)) => e,
                other => panic!("the read did not fail: {other:?}"),
            }
        }

        /// fe2o3 writes `bytes` (in pieces of 3) and flushes; what reaches the peer since the
        /// last call.
        fn writes(&mut self, bytes: &[u8]) -> Vec<u8> {
            let mut cx = Context::from_waker(Waker::noop());
            for piece in bytes.chunks(3) {
                assert!(matches!(Pin::new(&mut self.tap).poll_write(&mut cx, piece), Poll::Ready(Ok(1..=3))));
            }
            assert!(matches!(Pin::new(&mut self.tap).poll_flush(&mut cx), Poll::Ready(Ok(()))));
            std::mem::take(&mut self.tap.inner.written)
        }
    }

    fn frame(channel: u16, body: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
        f.extend_from_slice(&[2, 0]);
        f.extend_from_slice(&channel.to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    fn amqp(performative: &impl serde::Serialize, payload: &[u8], channel: u16) -> Vec<u8> {
        let mut body = serde_amqp::to_vec(performative).unwrap();
        body.extend_from_slice(payload);
        frame(channel, &body)
    }

    /// The performatives of a run of frames (with their channel), decoded.
    fn frames(mut bytes: &[u8]) -> Vec<(u16, Vec<u8>)> {
        let mut out = Vec::new();
        while bytes.len() >= 8 {
            let size = u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize;
            let doff = usize::from(bytes[4]) * 4;
            out.push((u16::from_be_bytes([bytes[6], bytes[7]]), bytes[doff..size].to_vec()));
            bytes = &bytes[size..];
        }
        assert!(bytes.is_empty(), "whole frames only");
        out
    }

    fn transfer(handle: u32, id: Option<u32>, settled: bool, more: bool) -> Transfer {
        Transfer {
            handle: Handle(handle),
            delivery_id: id,
            delivery_tag: id.map(|i| Binary::from(i.to_be_bytes().to_vec())),
            message_format: id.map(|_| 0),
            settled: Some(settled),
            more,
            rcv_settle_mode: None,
            state: None,
            resume: false,
            aborted: false,
            batchable: false,
        }
    }

    fn begin(remote: Option<u16>, next_outgoing_id: u32) -> Begin {
        Begin { remote_channel: remote, next_outgoing_id, incoming_window: 5000, outgoing_window: 5000, handle_max: Handle(u32::MAX), offered_capabilities: None, desired_capabilities: None, properties: None }
    }

    fn attach(name: &str, handle: u32, role: Role, initial: Option<u32>) -> Attach {
        Attach {
            name: name.into(),
            handle: Handle(handle),
            role,
            snd_settle_mode: SenderSettleMode::Mixed,
            rcv_settle_mode: ReceiverSettleMode::First,
            source: None,
            target: None,
            unsettled: None,
            incomplete_unsettled: false,
            initial_delivery_count: initial,
            max_message_size: None,
            offered_capabilities: None,
            desired_capabilities: None,
            properties: None,
        }
    }

    fn flow(handle: Option<u32>, delivery_count: Option<u32>, credit: Option<u32>, next_incoming_id: Option<u32>) -> Flow {
        Flow {
            next_incoming_id,
            incoming_window: 5000,
            next_outgoing_id: 1,
            outgoing_window: 5000,
            handle: handle.map(Handle),
            delivery_count,
            link_credit: credit,
            available: None,
            drain: false,
            echo: false,
            properties: None,
        }
    }

    fn message(n: u8, len: usize) -> Vec<u8> {
        let mut m = vec![0x00, 0x53, 0x75, 0xb0];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(n, len));
        m
    }

    /// A connection up to a served link: fe2o3's session on channel 1 (the peer's 3), link
    /// `p0` our handle 0, the peer's handle 5, the sender's delivery-count from 10, credit 4.
    fn served(chunk: usize, max_message: usize) -> (Fe2o3, OwnedLink) {
        let mut c = Fe2o3::new(chunk);
        // The control session begins before arming: never served.
        let head = [b"AMQP\x00\x01\x00\x00".to_vec(), amqp(&begin(None, 0), &[], 0)].concat();
        assert_eq!(c.writes(&head), head);
        c.handle.arm(max_message);
        let ours = [amqp(&begin(None, 7), &[], 1), amqp(&attach("p0", 0, Role::Receiver, None), &[], 1)].concat();
        assert_eq!(c.writes(&ours), ours, "begin and attach pass unchanged");
        let peer = [
            b"AMQP\x00\x01\x00\x00".to_vec(),
            amqp(&begin(Some(0), 0), &[], 0),
            amqp(&begin(Some(1), 100), &[], 3),
            amqp(&attach("p0", 5, Role::Sender, Some(10)), &[], 3),
        ]
        .concat();
        assert_eq!(c.peer_sends(&peer), peer, "fe2o3 sees the handshake as sent");
        // fe2o3's first flow: its counters are right so far, and it sets the credit kept.
        let written = c.writes(&amqp(&flow(Some(0), Some(10), Some(4), Some(100)), &[], 1));
        assert_eq!(frames(&written), frames(&amqp(&flow(Some(0), Some(10), Some(4), Some(100)), &[], 1)));
        let link = c.handle.link("p0").expect("served");
        assert_eq!(link.credit(), 4);
        (c, link)
    }

    fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> T {
        serde_amqp::from_slice(body).unwrap()
    }

    #[test]
    fn a_served_links_messages_settlement_and_credit_in_every_split() {
        for chunk in [1, 2, 3, 7, 8, 9, 13, 64, 100, 1000, 1 << 20] {
            let (mut c, link) = served(chunk, 1 << 20);
            let control = amqp(&transfer(0, Some(0), true, false), &message(9, 3), 0);
            let heartbeat = frame(3, &[]);
            let input = [
                amqp(&transfer(5, Some(0), false, false), &message(0, 10), 3),
                // Delivery 1 in two frames (the second without id).
                amqp(&transfer(5, Some(1), false, true), &message(1, 70)[..30], 3),
                heartbeat.clone(),
                amqp(&transfer(5, None, false, false), &message(1, 70)[30..], 3),
                control.clone(),
                amqp(&transfer(5, Some(2), true, false), &message(2, 5), 3),
                amqp(&transfer(5, Some(3), false, false), &message(3, 0), 3),
            ]
            .concat();
            assert_eq!(c.peer_sends(&input), [heartbeat, control].concat(), "chunk {chunk}: fe2o3 sees none of the link's transfers");
            let mut got = Vec::new();
            assert_eq!(link.try_recv(&mut got, 10), 4);
            let ids: Vec<(u32, bool)> = got.iter().map(|d| (d.id, d.settled)).collect();
            assert_eq!(ids, [(0, false), (1, false), (2, true), (3, false)]);
            for (d, (n, len)) in got.iter().zip([(0, 10), (1, 70), (2, 5), (3, 0)]) {
                assert_eq!(d.message.as_deref().unwrap(), &message(n, len)[..], "chunk {chunk}");
            }
            assert_eq!(link.credit(), 0, "four deliveries used the four credits");
            assert_eq!(c.handle.bytes(), got.iter().map(Delivery::len).sum::<usize>());
            link.done(&got);
            assert_eq!(c.handle.bytes(), 0);
            // Written between fe2o3's frames: two runs accepted, then the credit again, with
            // the session's next-incoming-id past the five transfer frames.
            let out = frames(&c.writes(&[]));
            assert_eq!(out.len(), 3, "{out:?}");
            let (d1, d2): (Disposition, Disposition) = (decode(&out[0].1), decode(&out[1].1));
            assert_eq!((d1.first, d1.last, d1.settled, d1.role), (0, Some(1), true, Role::Receiver));
            assert_eq!((d2.first, d2.last), (3, None));
            assert!(matches!(d1.state, Some(DeliveryState::Accepted(_))));
            let f: Flow = decode(&out[2].1);
            assert_eq!((out[2].0, f.handle.map(|h| h.0), f.delivery_count, f.link_credit, f.next_incoming_id), (1, Some(0), Some(14), Some(4), Some(105)));
            assert_eq!(link.credit(), 4);
            // fe2o3's own flows carry its stale counters: rewritten.
            let out = frames(&c.writes(&amqp(&flow(Some(0), Some(10), Some(4), Some(100)), &[], 1)));
            let f: Flow = decode(&out[0].1);
            assert_eq!((f.delivery_count, f.link_credit, f.next_incoming_id), (Some(14), Some(4), Some(105)));
        }
    }

    #[test]
    fn credit_is_granted_again_once_half_is_free_and_held_messages_count() {
        let (mut c, link) = served(64, 1 << 20);
        let input: Vec<u8> = (0..3).flat_map(|i| amqp(&transfer(5, Some(i), true, false), &message(i as u8, 4), 3)).collect();
        c.peer_sends(&input);
        let mut got = Vec::new();
        link.try_recv(&mut got, 1);
        assert_eq!(got.len(), 1);
        link.done(&got);
        assert!(c.writes(&[]).is_empty(), "one credit left and two held: no flow for one more");
        let mut rest = Vec::new();
        link.try_recv(&mut rest, 10);
        link.done(&rest);
        let out = frames(&c.writes(&[]));
        let f: Flow = decode(&out[0].1);
        assert_eq!((f.delivery_count, f.link_credit), (Some(13), Some(4)), "nothing settled: all pre-settled; {out:?}");
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn the_peers_link_flows_reach_fe2o3_as_session_flows_and_echo_is_answered() {
        let (mut c, _link) = served(5, 1 << 20);
        let mut peer = flow(Some(5), Some(10), Some(0), Some(1));
        peer.echo = true;
        peer.available = Some(7);
        let seen = frames(&c.peer_sends(&amqp(&peer, &[], 3)));
        let f: Flow = decode(&seen[0].1);
        assert_eq!((f.handle, f.delivery_count, f.link_credit, f.available, f.echo), (None, None, None, None, false));
        assert_eq!((f.next_outgoing_id, f.incoming_window), (1, 5000), "the session fields stay");
        let out = frames(&c.writes(&[]));
        let answer: Flow = decode(&out[0].1);
        assert_eq!((answer.handle.map(|h| h.0), answer.delivery_count, answer.link_credit), (Some(0), Some(10), Some(4)));
    }

    #[test]
    fn a_message_over_the_bound_is_reported_by_size_and_a_detach_ends_the_link() {
        let (mut c, link) = served(1000, 0);
        let big = message(1, SECTION_SLACK);
        let input = [
            amqp(&transfer(5, Some(0), true, false), &big, 3),
            amqp(&transfer(5, Some(1), true, true), &big[..40_000], 3),
            amqp(&transfer(5, None, true, false), &big[40_000..], 3),
            amqp(&transfer(5, Some(2), true, false), &message(2, 3), 3),
            amqp(&Detach { handle: Handle(5), closed: true, error: None }, &[], 3),
        ]
        .concat();
        c.peer_sends(&input);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let mut got = Vec::new();
        assert!(rt.block_on(link.recv(&mut got, 10)));
        let sizes: Vec<Result<usize, usize>> = got.iter().map(|d| d.message.as_ref().map(Bytes::len).map_err(|s| *s)).collect();
        assert_eq!(sizes, [Err(big.len()), Err(big.len()), Ok(message(2, 3).len())]);
        assert_eq!(c.handle.bytes(), message(2, 3).len());
        assert!(!rt.block_on(link.recv(&mut got, 10)), "detached once drained");
    }

    #[test]
    fn a_link_attached_again_under_its_name_replaces_the_old_one_and_its_bytes() {
        let (mut c, old) = served(64, 1 << 20);
        c.peer_sends(&amqp(&transfer(5, Some(0), true, false), &message(1, 50), 3));
        assert!(c.handle.bytes() > 50);
        c.writes(&amqp(&attach("p0", 2, Role::Receiver, None), &[], 1));
        assert_eq!(c.handle.bytes(), 0, "the old link's queued message no longer counts");
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert!(!rt.block_on(old.recv(&mut Vec::new(), 10)), "the old link is gone");
        assert!(c.handle.link("p0").is_none(), "the new one is served once the peer answers");
        c.peer_sends(&amqp(&attach("p0", 6, Role::Sender, Some(0)), &[], 3));
        assert!(c.handle.link("p0").is_some());
    }

    #[test]
    fn a_broker_sending_past_the_credit_fails_the_connection() {
        let (mut c, link) = served(1000, 1 << 20);
        // Four credits (the window): four deliveries are taken, four more past the credit are
        // taken too (RabbitMQ 3.x overshoots a little), the ninth breaks it.
        let eight: Vec<u8> = (0..8).flat_map(|i| amqp(&transfer(5, Some(i), true, false), &message(1, 3), 3)).collect();
        c.peer_sends(&eight);
        assert_eq!(link.try_recv(&mut Vec::new(), 10), 8);
        let e = c.read_fails(&amqp(&transfer(5, Some(8), true, false), &message(1, 3), 3));
        assert!(e.to_string().contains("past the link credit"), "{e}");
    }

    #[test]
    fn a_broken_transfer_on_the_served_session_fails_the_connection() {
        let (mut c, _link) = served(1000, 1 << 20);
        let e = c.read_fails(&frame(3, &[0x00, 0x53, TRANSFER, 0x45]));
        assert!(e.to_string().contains("transfer"), "{e}");
    }

    #[test]
    fn transfer_encodings_peers_write_are_read_and_invalid_ones_refused() {
        let t = transfer(70_000, Some(u32::MAX), true, false);
        let encoded = serde_amqp::to_vec(&t).unwrap();
        let head = parse_transfer(&encoded).unwrap();
        assert_eq!((head.len, head.handle, head.delivery_id, head.settled), (encoded.len(), 70_000, Some(u32::MAX), true));
        let mut wide = transfer(1, Some(2), false, true);
        wide.delivery_tag = Some(Binary::from(vec![3; 300]));
        wide.rcv_settle_mode = Some(ReceiverSettleMode::Second);
        wide.state = Some(DeliveryState::Accepted(Accepted {}));
        let encoded = serde_amqp::to_vec(&wide).unwrap();
        let head = parse_transfer(&encoded).unwrap();
        assert_eq!((head.len, head.more, head.settled), (encoded.len(), true, false));
        // A delivery id as a ulong is not a valid transfer (it is a uint): refused.
        let mut odd = serde_amqp::to_vec(&transfer(0, Some(0), false, false)).unwrap();
        assert_eq!(&odd[..4], &[0x00, 0x53, 0x14, 0xc0]);
        assert_eq!(odd[7], 0x43, "the delivery id, uint 0");
        odd[7] = 0x44; // ulong 0
        assert!(parse_transfer(&odd).is_none());
        // A list32 with a 4-byte uint handle, as another peer may write it: read by hand.
        let mut long = vec![0x00, 0x53, 0x14, 0xd0];
        let fields = [0x70, 0, 0, 0, 9, 0x52, 4, 0xa0, 1, 7];
        long.extend_from_slice(&((fields.len() + 4) as u32).to_be_bytes());
        long.extend_from_slice(&3u32.to_be_bytes());
        long.extend_from_slice(&fields);
        let head = parse_transfer(&long).unwrap();
        assert_eq!((head.len, head.handle, head.delivery_id), (long.len(), 9, Some(4)));
    }
}
