//! Engine.IO HTTP long-polling, and the upgrade of a polling session to WebSocket.
//!
//! A polling session lives on its Socket.IO session's core, like a WebSocket; its Engine.IO
//! sid starts with that core's index, so a `GET`/`POST` that lands on another core is
//! forwarded there. `GET` waits (up to `pingInterval + pingTimeout`) for queued packets and
//! answers them joined by the record separator `\x1e`; `POST` carries the client's packets.
//! Upgrade: the client opens a WebSocket with the sid and sends `2probe`; we answer `3probe`
//! and end the pending poll with a noop `6`; on `5` the WebSocket takes over the outlet.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_channel::oneshot;
use serde_json::json;

use super::socketio::{allowed_before_connect, answer_connect, connect_reply, open_packet, parse_client_packet, ClientPacket, MAX_PAYLOAD};
use super::{limits, Conn, NEXT_SOCKET_ID};
use crate::http::{ConnectionSlot, Request, Response};
use crate::ids::{random_token, SessionId};
use crate::push::outlet::{CloseReason, Out, Outlet};
use crate::app::mesh::{await_reply, CoreMsg, CoreTask};
use crate::app::Core;

/// A polling request forwarded to the core that owns the Engine.IO session.
#[derive(Debug)]
pub struct PollRequest {
    pub sid: Option<String>,
    pub session: Option<SessionId>,
    pub post: Option<Bytes>,
}

impl PollRequest {
    /// Forwards this request to `core`, which holds its polling session; the answer comes back.
    async fn forward(self, core: &Rc<Core>, target: usize) -> Response {
        let (tx, rx) = oneshot::channel();
        core.mesh.post(target, CoreMsg::Task(Box::new(Forwarded { request: self, reply: tx })));
        await_reply(rx).await.unwrap_or_else(|| Response::error(503, "core unavailable"))
    }
}

/// A polling request on its way to the core that holds its session, with its reply.
struct Forwarded {
    request: PollRequest,
    reply: oneshot::Sender<Response>,
}

impl CoreTask for Forwarded {
    fn bytes(&self) -> usize {
        256
    }

    fn run(self: Box<Self>, core: &Rc<Core>) {
        let (core, Forwarded { request, reply }) = (core.clone(), *self);
        monoio::spawn(async move {
            let _ = reply.send(serve(core, request).await);
        });
    }
}

/// This core's Engine.IO polling sessions (by sid), kept on the core ([`Core::ext`]).
#[derive(Default)]
struct Polling {
    sessions: RefCell<hashbrown::HashMap<Box<str>, Rc<PollingSocket>>>,
    /// Sessions here not yet connected to a Socket.IO session (capped).
    pending: Cell<usize>,
}

fn polling(core: &Core) -> Rc<Polling> {
    core.ext.get::<Polling>()
}

/// One Engine.IO session on the polling transport.
pub struct PollingSocket {
    pub sid: Box<str>,
    pub session: Option<SessionId>,
    pub outlet: Rc<Outlet>,
    pub attached: Cell<bool>,
    pub last_heard: Cell<Instant>,
    poll_active: Cell<bool>,
    /// A `GET` has come since the handshake.
    polled: Cell<bool>,
    /// The DISCONNECT of a server-side close went out; the close packet is next.
    disconnect_sent: Cell<bool>,
    /// Its place in the connection budget, given back when it ends.
    slot: Cell<Option<ConnectionSlot>>,
    /// Its first-poll and ping deadlines, on the core's socket timers.
    pub timed: super::timers::Timed,
}

const RECORD_SEPARATOR: u8 = 0x1e;
/// Index into `metrics::TRANSPORTS`.
const POLLING: usize = 2;

fn engine_error(code: u8, message: &str) -> Response {
    Response::json(400, json!({"code": code, "message": message, "errorMessage": message}).to_string())
}

/// Entry point for `GET`/`POST /socket.io/?EIO=4&transport=polling…` on any core.
pub async fn http(core: &Rc<Core>, req: &Request) -> Response {
    if req.query_param("EIO").as_deref() != Some("4") {
        return engine_error(5, "Unsupported protocol version");
    }
    if req.query_param("transport").as_deref() != Some("polling") {
        return engine_error(0, "Transport unknown");
    }
    let sid = req.query_param("sid");
    let session = req.query_param("sessionId").and_then(|s| SessionId::parse(&s));
    let post = match req.method {
        http::Method::GET => None,
        http::Method::POST => Some(req.body.clone()),
        _ => return Response::error(405, "Engine.IO polling uses GET and POST").with_header("allow", "GET, POST"),
    };
    let target = match (&sid, session) {
        (Some(sid), _) => match sid.split_once('-').and_then(|(c, _)| c.parse::<usize>().ok()) {
            Some(c) if c < core.cores() => c,
            _ => return engine_error(1, "Session ID unknown"),
        },
        (None, Some(s)) => core.session_core(s),
        (None, None) => core.index,
    };
    if let (None, Some(s)) = (&sid, session) {
        // Scale-out: a session opened on another instance is loaded here first (an error
        // leaves it unknown: the CONNECT then answers so).
        let _ = core.directory().ensure(core, s).await;
    }
    if sid.is_none() {
        // A handshake makes an Engine.IO session: rate-limited per client (`admission::rate`).
        if let Err(retry) = crate::admission::rate::admit(core, req.peer, &req.headers, crate::admission::rate::Work::EngineIo) {
            return Response::rate_limited(retry);
        }
    }
    let request = PollRequest { sid, session, post };
    if target == core.index {
        return serve(core.clone(), request).await;
    }
    request.forward(core, target).await
}

/// Serves a polling request on the core owning the Engine.IO session.
pub async fn serve(core: Rc<Core>, request: PollRequest) -> Response {
    let Some(sid) = request.sid else {
        if crate::shutdown::STOPPING.is_stopping() {
            return Response::error(503, "shutting down: connect again (to another node)");
        }
        return handshake(&core, request.session);
    };
    let Some(socket) = polling(&core).sessions.borrow().get(sid.as_str()).cloned() else {
        return engine_error(1, "Session ID unknown");
    };
    match request.post {
        Some(body) => on_post(&core, &socket, &body).await,
        None => poll(&core, &socket).await,
    }
}

fn text(body: impl Into<Vec<u8>>) -> Response {
    Response::new(200, "text/plain; charset=UTF-8", body)
}

/// Polling sessions per core that are not yet connected to a session (their handshake was
/// answered, their CONNECT has not come): a client connects within one round trip, so a
/// small cap stops a flood of handshakes without a session. At most 1024, and at most a
/// quarter of the core's share of the connection cap (`--max-connections`, or the open-file
/// limit less `--fd-reserve`), so such a flood cannot take the
/// connection budget from real clients.
pub fn max_pending(core: &Core) -> usize {
    (crate::admission::descriptors::connection_cap(&core.settings.config) / core.cores() / 4).clamp(1, 1024)
}

/// How long after its handshake a polling session may go without its first poll: a
/// handshake never followed by a poll is abandoned (or a flood), so it ends within the first
/// ping interval (the ping schedule stays as the client expects it).
pub fn first_poll_wait(interval: Duration, timeout: Duration) -> Duration {
    timeout.min(Duration::from_secs(10)).min(interval)
}

fn handshake(core: &Rc<Core>, session: Option<SessionId>) -> Response {
    let c = &core.settings.config;
    let registry = polling(core);
    if registry.pending.get() >= max_pending(core) {
        tracing::warn!(core = core.index, "too many Engine.IO polling handshakes without a CONNECT; refusing one");
        return Response::error(503, "too many pending Engine.IO handshakes; retry later");
    }
    // A polling session holds no TCP connection of its own but costs as much: it takes a
    // slot of the connection budget until it ends.
    let Some(slot) = ConnectionSlot::try_acquire(crate::admission::descriptors::connection_cap(c)) else {
        return Response::error(503, "connection limit reached (maxConnections, or the open-file limit less fdReserve)");
    };
    let sid: Box<str> = format!("{}-{}", core.index, random_token(15)).into();
    let socket = Rc::new(PollingSocket {
        sid: sid.clone(),
        session,
        outlet: Outlet::new(NEXT_SOCKET_ID.fetch_add(1, Ordering::Relaxed), limits(core)),
        attached: Cell::new(false),
        last_heard: Cell::new(Instant::now()),
        poll_active: Cell::new(false),
        polled: Cell::new(false),
        disconnect_sent: Cell::new(false),
        slot: Cell::new(Some(slot)),
        timed: super::timers::Timed::new(Instant::now()),
    });
    registry.sessions.borrow_mut().insert(sid.clone(), socket.clone());
    registry.pending.set(registry.pending.get() + 1);
    core.drain.polling(&socket.outlet);
    core.metrics.socket_opened(POLLING);
    super::timers::register_polling(core, &socket);
    text(open_packet(&sid, &["websocket"], c.ping_interval, c.ping_timeout))
}

async fn on_post(core: &Rc<Core>, socket: &Rc<PollingSocket>, body: &[u8]) -> Response {
    if body.len() > MAX_PAYLOAD {
        close(core, socket, CloseReason::new(1009, "payload too large"));
        return engine_error(3, "Bad request");
    }
    let now = Instant::now();
    socket.last_heard.set(now);
    super::timers::heard(core, &socket.timed, now);
    for packet in body.split(|b| *b == RECORD_SEPARATOR) {
        let Some(packet) = std::str::from_utf8(packet).ok().and_then(parse_client_packet) else {
            close(core, socket, CloseReason::new(1002, "not an Engine.IO packet"));
            return engine_error(3, "Bad request");
        };
        let allowed = match packet {
            ClientPacket::Probe | ClientPacket::Upgrade | ClientPacket::Ping => false,
            _ => socket.attached.get() || allowed_before_connect(packet, false),
        };
        if !allowed {
            close(core, socket, CloseReason::new(1008, "only the Socket.IO handshake is accepted before CONNECT"));
            return engine_error(3, "Bad request");
        }
        match packet {
            ClientPacket::Close => close(core, socket, CloseReason::new(1000, "client closed")),
            ClientPacket::Connect(sio) => {
                // Its history may be on another instance (design step 6b, as over WebSocket):
                // asked for first, this POST answered once it came or at most 2 s passed.
                if let Some(session) = super::socketio::connect_restores_elsewhere(core, socket.session, socket.attached.get(), sio) {
                    Box::pin(super::socketio::fetch_history(core.clone(), session, sio)).await;
                    if socket.outlet.is_closing() {
                        return engine_error(1, "Session ID unknown");
                    }
                }
                let was_pending = !socket.attached.get();
                let answer = connect_reply(core, socket.session, &socket.outlet, &socket.attached, sio, POLLING);
                if was_pending && socket.attached.get() {
                    let registry = polling(core);
                    registry.pending.set(registry.pending.get() - 1);
                }
                answer_connect(&socket.outlet, answer);
            }
            ClientPacket::Disconnect => close(core, socket, CloseReason::new(1000, "client disconnected")),
            _ => {}
        }
    }
    text("ok")
}

async fn poll(core: &Rc<Core>, socket: &Rc<PollingSocket>) -> Response {
    if socket.poll_active.replace(true) {
        close(core, socket, CloseReason::new(1002, "overlapping polls"));
        return engine_error(3, "Bad request");
    }
    socket.polled.set(true);
    let c = &core.settings.config;
    let wait = Duration::from_millis(c.ping_interval + c.ping_timeout);
    // `drain` takes items only when it completes, so giving up on it loses nothing.
    let drained = monoio::time::timeout(wait, socket.outlet.drain()).await;
    socket.poll_active.set(false);
    let Ok(drained) = drained else { return text("6") };
    let envelopes = drained.items.iter().filter(|i| matches!(i, Out::Envelope(..))).count();
    core.metrics.messages_out(POLLING, envelopes as u64);
    // Observed when the answer is handed to the HTTP writer (its write is not tracked here).
    core.metrics.delivered(POLLING, drained.arrived());
    let mut body = Vec::new();
    let offsets = socket.outlet.offsets();
    for item in &drained.items {
        if !body.is_empty() {
            body.push(RECORD_SEPARATOR);
        }
        match item {
            Out::Envelope(frame, seq) => {
                body.extend_from_slice(super::socketio::EVENT_PREFIX);
                body.extend_from_slice(frame.as_bytes());
                // The offset as the event's last argument (connection state recovery).
                if let Some(prefix) = offsets.as_deref().filter(|_| *seq > 0) {
                    body.extend_from_slice(b",\"");
                    body.extend_from_slice(prefix.as_bytes());
                    body.extend_from_slice(crate::push::stream::Base36::new(*seq).as_bytes());
                    // Its device part, with `--redis-url` (push/cut.rs).
                    if let Some(part) = socket.outlet.take_part(*seq) {
                        body.extend_from_slice(part.encode().as_bytes());
                    }
                    body.push(b'"');
                }
                body.push(b']');
            }
            Out::Packet(p) => body.extend_from_slice(p.as_bytes()),
            Out::Ping | Out::Pong(_) => {}
        }
    }
    if let Some(reason) = &drained.closing {
        if !body.is_empty() {
            body.push(RECORD_SEPARATOR);
        }
        if reason.server_disconnect && socket.attached.get() && !socket.disconnect_sent.replace(true) {
            // Socket.IO DISCONNECT alone: the client handles it on its next tick, and a close
            // packet in the same payload would be seen first ("transport close"). The close
            // follows on the next poll, or the pinger drops the socket.
            body.extend_from_slice(b"41");
            return text(body);
        }
        body.push(b'1');
        forget(core, socket);
    }
    if body.is_empty() {
        body.push(b'6');
    }
    text(body)
}

fn forget(core: &Rc<Core>, socket: &PollingSocket) {
    let removed = polling(core).sessions.borrow_mut().remove(&socket.sid);
    if removed.is_some() {
        released(core, socket);
    }
    if socket.attached.replace(false) {
        if let Some(s) = socket.session {
            core.detach_socket(s, socket.outlet.id);
        }
    }
}

/// A polling session left this core's [`Polling`]: give back what it held.
fn released(core: &Core, socket: &PollingSocket) {
    if socket.outlet.take_overflow() {
        core.metrics.slow_consumer_closed();
    }
    core.metrics.socket_closed(POLLING);
    drop(socket.slot.take());
    core.drain.polling_gone(socket.outlet.id);
    if !socket.attached.get() {
        let registry = polling(core);
        registry.pending.set(registry.pending.get() - 1);
    }
}

/// Closes a polling session: the next (or pending) poll answers the close packet.
pub fn close(core: &Rc<Core>, socket: &PollingSocket, reason: CloseReason) {
    socket.outlet.close(reason);
    if !socket.poll_active.get() {
        forget(core, socket);
    }
}

/// A polling session's deadline came (on the core's socket timers): end it when it was
/// never polled, went away, or left a ping unanswered for `timeout`; otherwise ping it
/// `interval` after its last answer. The next deadline; `None` when it is over.
pub fn liveness(core: &Rc<Core>, socket: &Rc<PollingSocket>, timeout: Duration, now: Instant) -> Option<Instant> {
    let alive = polling(core).sessions.borrow().contains_key(&socket.sid) && !socket.outlet.is_closing();
    if !alive {
        // Closed while no poll was pending (e.g. session deleted): nobody will collect it.
        if !socket.poll_active.get() {
            forget(core, socket);
        }
        return None;
    }
    if !socket.polled.get() {
        close(core, socket, CloseReason::new(1008, "no poll after the handshake"));
        forget(core, socket);
        return None;
    }
    let timed = &socket.timed;
    if let Some(sent) = timed.ping_sent() {
        if now.duration_since(sent) >= timeout {
            close(core, socket, CloseReason::new(1001, "ping timeout"));
            forget(core, socket);
            return None;
        }
        return Some(sent + timeout);
    }
    if now < timed.next_ping() {
        return Some(timed.next_ping());
    }
    socket.outlet.push(Out::Packet("2".into()));
    timed.pinged(now);
    Some(now + timeout)
}

/// A WebSocket opened with a polling session's sid: it answers the probe; `5` completes.
pub fn take_over(conn: &Conn, sid: &str) -> bool {
    let exists = polling(&conn.core).sessions.borrow().contains_key(sid);
    if !exists {
        conn.outlet.close(CloseReason::new(1008, "unknown Engine.IO session id"));
        return false;
    }
    *conn.upgrading.borrow_mut() = Some(sid.into());
    true
}

/// `2probe` on the upgrading WebSocket: answer it and end the pending poll with a noop.
pub fn on_probe(conn: &Conn) {
    conn.outlet.push(Out::Packet("3probe".into()));
    if let Some(sid) = conn.upgrading.borrow().as_deref() {
        if let Some(socket) = polling(&conn.core).sessions.borrow().get(sid) {
            socket.outlet.push(Out::Packet("6".into()));
        }
    }
}

/// `5` on the upgrading WebSocket: it replaces the polling transport.
pub fn complete_upgrade(conn: &Conn) {
    let Some(sid) = conn.upgrading.borrow_mut().take() else { return };
    let removed = polling(&conn.core).sessions.borrow_mut().remove(&*sid);
    let Some(socket) = removed else { return };
    released(&conn.core, &socket);
    // Whatever the polling side still held (a replay's rest included) goes out on the
    // WebSocket, in order.
    let drained = socket.outlet.take_everything();
    let arrivals = drained.arrivals.into_iter().chain(std::iter::repeat(None));
    for (item, arrived) in drained.items.into_iter().zip(arrivals) {
        if item != Out::Packet("6".into()) {
            conn.outlet.push_arrived(item, arrived);
        }
    }
    socket.outlet.close(CloseReason::new(1000, "upgraded"));
    if socket.attached.get() {
        if let Some(s) = socket.session {
            // The Socket.IO socket is the same: its pid and offsets move to the WebSocket.
            conn.core.recovery_moved(s, &socket.outlet, &conn.outlet);
            conn.core.detach_socket(s, socket.outlet.id);
        }
        conn.attach();
    }
}
