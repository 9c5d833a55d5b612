//! Live-data transports: plain WebSocket (`/ws?sessionId=…`) and Socket.IO v4 (Engine.IO 4)
//! over WebSocket or HTTP long-polling (`/socket.io/`).
//!
//! A socket lives on its session's core: after the upgrade handshake is read on whichever
//! core accepted the connection, the socket (fd plus any bytes read past the request) moves
//! to `core_of_session` over the mesh. There it gets an [`Outlet`] attached to the session;
//! the device cores' deliveries land in it, and one writer task drains it in coalesced
//! writes; under load a short queue may be held back a bounded moment so a write carries
//! more frames (the flush policy: [`crate::push::linger`]). A reader task handles client frames. Its timers (pings and their answers, a silent
//! client, a stalled write) are entries on the core's socket timers ([`timers`]): two tasks
//! per socket, and no runtime timer armed per socket, read or write.
//!
//! **Closing a slow consumer** (past its queue's hard limits, [`crate::push::outlet`]): its
//! queue is freed at once, and the close frame (1008 "slow consumer") is written after what the
//! writer had already begun to write (a frame is never cut), then the write side is shut down
//! (FIN after the close frame) and the reader reads and drops what the client still sends (at
//! most [`CLOSE_DRAIN_BYTES`]) until the client closes, so its answers (pongs, its close
//! frame) cannot make the kernel reset the connection and drop the close frame before the
//! client read it. The whole close is bounded: [`SLOW_CONSUMER_CLOSE_WAIT`] after the overflow
//! the socket is shut down, wherever it is (a socket timer, [`timers::close_by`]). Other closes
//! shut the socket down right after their close frame.
//!
//! A plain WebSocket opened with `batch=1` gets the envelopes queued at write time packed
//! into JSON-array text frames (`[env1,env2,…]`, each frame's payload at most
//! [`BATCH_FRAME_BYTES`] unless one envelope alone is bigger); see [`encode`]. The queue, its
//! bounds and conflation are the same either way: batching only changes how the writer frames
//! what it drains.

pub mod frame;
pub mod socketio;
pub mod socketio_polling;
pub mod timers;

use std::cell::Cell;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use crate::http::{Framed, Request, RequestHead, Response};
use crate::push::cut::PartText;
use crate::ids::SessionId;
use crate::push::outlet::{CloseReason, Out, Outlet, QueueLimits};
use crate::app::mesh::{CoreMsg, CoreTask};
use crate::app::Core;
use crate::tls::{ReadHalf, Stream, TlsState, WriteHalf};
use frame::{FrameReader, Incoming};

/// The read buffer of a socket that is idle or reads little: it is what the kernel holds
/// while the read waits (on io_uring the buffer is lent for the read's whole life), so it stays
/// small; clients mostly send pongs and small packets. A read that fills it doubles it (up to
/// [`READ_CHUNK_MAX`]) for a burst; a read that uses less than a quarter of a grown buffer
/// brings it back to this size.
const READ_CHUNK: usize = 128;
const READ_CHUNK_MAX: usize = 16 * 1024;

/// Bytes a socket's reader may handle without once waiting for a read before it lets the
/// core's other tasks and its I/O driver run. With the epoll driver a read on a socket that
/// always has data completes at once, so without this a client streaming big frames keeps its
/// core from serving anyone else. The pause is a 1 ms timer, not a bare yield: monoio's
/// legacy driver only collects readiness events once no task is runnable, so a task that
/// merely re-queues itself still starves the others. A read that had to wait (every read on
/// io_uring, whose completions come through the driver; an epoll read on a drained socket)
/// already let the others run, so it starts the budget afresh: only an epoll socket that
/// keeps data ready is ever paused. Clients only send small protocol packets; 64 KiB per
/// millisecond is plenty.
const READ_BUDGET: usize = 64 * 1024;
const READ_PAUSE: Duration = Duration::from_millis(1);

/// Runs `fut` to its end and tells whether it had to wait (was ever `Pending`), i.e. whether
/// the core's other tasks could run meanwhile (see [`READ_BUDGET`]).
/// A future, not an `async fn`: that would hold `fut` twice (its argument and its pinned
/// copy), in the reader task of every idle socket (issue 25 item 3).
fn waited<F: std::future::Future>(fut: F) -> Waited<F> {
    Waited { fut, waited: false }
}

struct Waited<F> {
    fut: F,
    waited: bool,
}

impl<F: std::future::Future> std::future::Future for Waited<F> {
    type Output = (F::Output, bool);

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        // Safety: structural pinning of `fut`: it is never moved out of `Waited` nor
        // reached unpinned, and `Waited` has no `Drop` of its own.
        let this = unsafe { self.get_unchecked_mut() };
        let fut = unsafe { std::pin::Pin::new_unchecked(&mut this.fut) };
        match fut.poll(cx) {
            std::task::Poll::Ready(output) => std::task::Poll::Ready((output, this.waited)),
            std::task::Poll::Pending => {
                this.waited = true;
                std::task::Poll::Pending
            }
        }
    }
}

/// How long a socket closed as a slow consumer may take to get its close frame out (after the
/// write in progress) and to see the client close, before it is shut down anyway.
pub const SLOW_CONSUMER_CLOSE_WAIT: Duration = Duration::from_secs(3);
/// The most client bytes read and dropped while waiting for a slow consumer to close: a client
/// answering a close sends a few control frames; one still streaming is not answering.
const CLOSE_DRAIN_BYTES: usize = 64 * 1024;

pub(crate) static NEXT_SOCKET_ID: AtomicU64 = AtomicU64::new(1);

/// Payload bound of one batched frame (`/ws?batch=1`): envelopes are added to the array
/// while the payload (brackets and commas included) stays within it; the next one starts a
/// new frame. An envelope bigger than this goes alone, in an array of one.
pub const BATCH_FRAME_BYTES: usize = 64 * 1024;

/// Which protocol a WebSocket speaks.
#[derive(Debug, Clone)]
pub enum SocketKind {
    /// `/ws`: one JSON text frame per envelope, or with `batch` (`/ws?batch=1`) one JSON array
    /// of the envelopes queued at write time per frame. `offsets=1`: each envelope carries its
    /// offset; `since=<offset>` resumes after it (connection state recovery, PROTOCOL.md).
    Plain { batch: bool, offsets: bool, since: Option<Box<str>> },
    /// `/socket.io/?EIO=4&transport=websocket`; `upgrade_sid` when upgrading a polling session.
    SocketIo { upgrade_sid: Option<String> },
}

/// A WebSocket moving to its session's core (the 101 answer is sent from there, once the
/// socket is attached: when a client sees the WebSocket open, data reaches it).
///
/// Over TLS the session state moves with the descriptor (`tls`: rustls' connection and the
/// ciphertext not yet processed; `leftover` is the plaintext read past the request). The
/// accepting core writes nothing after reading the upgrade request, so the 101 is the next
/// record of the session, encrypted on the session's core, and the guarantee above holds
/// unchanged. Keeping the TLS stream on the accepting core instead would need a plaintext
/// relay between cores for every message of the socket's life.
pub struct MovedSocket {
    pub fd: OwnedFd,
    pub leftover: Vec<u8>,
    pub kind: SocketKind,
    pub session: Option<SessionId>,
    pub handshake: Vec<u8>,
    pub tls: Option<Box<TlsState>>,
}

/// The live-data transports as the HTTP connection loop sees them: what takes over a
/// connection that asks for an upgrade (plugged in by main.rs:
/// `http::accept_loop::<api::Rest, transport::Sockets>`).
pub struct Sockets;

impl crate::http::Upgrades for Sockets {
    type Kind = SocketKind;

    fn check(head: &RequestHead) -> Result<SocketKind, Response> {
        check_upgrade(head)
    }

    fn admit(core: &Core, peer: Option<std::net::IpAddr>, head: &RequestHead, kind: &SocketKind) -> Result<(), Response> {
        admit_upgrade(core, peer, head, kind)
    }

    async fn upgrade(core: Rc<Core>, head: RequestHead, kind: SocketKind, framed: Framed, write: WriteHalf) {
        upgrade(core, head, kind, framed, write).await
    }
}

fn query_param(head: &RequestHead, name: &str) -> Option<String> {
    let req = Request {
        method: head.method.clone(),
        path: String::new(),
        query: head.uri.query().map(str::to_string),
        headers: Default::default(),
        body: Default::default(),
        peer: None,
    };
    req.query_param(name)
}

/// Checks an upgrade request; the error is the HTTP answer to give instead.
pub fn check_upgrade(head: &RequestHead) -> Result<SocketKind, Response> {
    if crate::shutdown::STOPPING.is_stopping() {
        return Err(Response::error(503, "shutting down: connect again (to another node)"));
    }
    let path = head.uri.path().trim_end_matches('/');
    let kind = match path {
        "/ws" => {
            let batch = match query_param(head, "batch").as_deref() {
                None | Some("0") => false,
                Some("1") => true,
                Some(_) => {
                    return Err(Response::error(
                        400,
                        "batch must be 1 (several envelopes per frame, as a JSON array) or 0 (one envelope per frame)",
                    ))
                }
            };
            let offsets = match query_param(head, "offsets").as_deref() {
                None | Some("0") => false,
                Some("1") => true,
                Some(_) => return Err(Response::error(400, "offsets must be 1 (each envelope carries its offset) or 0")),
            };
            let since = query_param(head, "since");
            if let Some(since) = &since {
                if !offsets {
                    return Err(Response::error(400, "since needs offsets=1"));
                }
                if crate::push::stream::parse_offset(since).is_none() {
                    return Err(Response::error(400, "since: not an offset hubcast gave"));
                }
            }
            SocketKind::Plain { batch, offsets, since: since.map(Into::into) }
        }
        "/socket.io" => {
            if query_param(head, "EIO").as_deref() != Some("4") {
                return Err(Response::error(400, "unsupported Engine.IO protocol version (EIO=4 required)"));
            }
            SocketKind::SocketIo { upgrade_sid: query_param(head, "sid") }
        }
        _ => return Err(Response::error(404, &format!("Not found: {} {}", head.method, head.uri.path()))),
    };
    if head.method != http::Method::GET {
        return Err(Response::error(405, "WebSocket upgrades use GET").with_header("allow", "GET"));
    }
    let version_ok = head.headers.get("sec-websocket-version").is_some_and(|v| v.as_bytes() == b"13");
    if !version_ok || head.headers.get("sec-websocket-key").is_none() {
        return Err(Response::error(400, "a WebSocket upgrade needs Sec-WebSocket-Key and Sec-WebSocket-Version: 13"));
    }
    if !valid_websocket_key(head.headers.get("sec-websocket-key").map(|v| v.as_bytes()).unwrap_or_default()) {
        return Err(Response::error(400, "Sec-WebSocket-Key must be the base64 of 16 bytes (RFC 6455 §4.1)"));
    }
    Ok(kind)
}

/// Rate-limits an upgrade that makes new work per client address (`admission::rate`): a
/// plain WebSocket, or a Socket.IO one that is not the upgrade of a polling session (that
/// session's handshake was counted). The error is the 429 to answer instead.
pub fn admit_upgrade(core: &Core, peer: Option<std::net::IpAddr>, head: &RequestHead, kind: &SocketKind) -> Result<(), Response> {
    use crate::admission::rate::{admit, Work};
    if matches!(kind, SocketKind::Plain { offsets: true, .. }) && core.recovery.window.is_none() {
        // A client must never believe it can resume.
        return Err(Response::error(400, "offsets: recovery is off (--recovery-window 0)"));
    }
    let work = match kind {
        SocketKind::Plain { .. } => Work::WebSocket,
        SocketKind::SocketIo { upgrade_sid: None } => Work::EngineIo,
        SocketKind::SocketIo { upgrade_sid: Some(_) } => return Ok(()),
    };
    admit(core, peer, &head.headers, work).map_err(Response::rate_limited)
}

/// RFC 6455 §4.1: the key is 16 random bytes, base64-encoded (24 characters with padding).
pub fn valid_websocket_key(key: &[u8]) -> bool {
    use base64::Engine;
    let mut decoded = [0u8; 18];
    key.len() == 24
        && base64::engine::general_purpose::STANDARD.decode_slice(key, &mut decoded).is_ok_and(|n| n == 16)
}

/// Completes a checked upgrade read on this core and sends the socket to its session's core.
pub async fn upgrade(core: Rc<Core>, head: RequestHead, kind: SocketKind, framed: Framed, write: WriteHalf) {
    let key = head.headers.get("sec-websocket-key").map(|v| v.as_bytes().to_vec()).unwrap_or_default();
    let accept = tungstenite::handshake::derive_accept_key(&key);
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: {accept}\r\n\r\n"
    );
    let session = query_param(&head, "sessionId").and_then(|s| SessionId::parse(&s));
    let leftover = framed.read_buffer().to_vec();
    let Some(stream) = crate::tls::stream::reunite(framed.into_inner(), write) else {
        tracing::warn!("could not reunite the socket halves after an upgrade");
        return;
    };
    // A polling session's upgrade goes to the core holding it (its sid names the core).
    let polling_core = match &kind {
        SocketKind::SocketIo { upgrade_sid: Some(sid) } => {
            sid.split_once('-').and_then(|(c, _)| c.parse::<usize>().ok()).filter(|c| *c < core.cores())
        }
        _ => None,
    };
    if let (None, Some(s)) = (polling_core, session) {
        // Scale-out: a session opened on another instance is loaded here first.
        let _ = core.directory().ensure(&core, s).await;
    }
    let target = polling_core.unwrap_or_else(|| session.map_or(core.index, |s| core.session_core(s)));
    if target == core.index {
        monoio::spawn(run(core, stream, leftover, kind, session, response.into_bytes()));
    } else {
        let (tcp, tls) = stream.into_parts();
        // Safety of ownership: the stream is consumed; the fd now belongs to the message.
        let fd = unsafe { OwnedFd::from_raw_fd(tcp.into_raw_fd()) };
        let handshake = response.into_bytes();
        core.mesh.post(target, CoreMsg::Task(Box::new(MovedSocket { fd, leftover, kind, session, handshake, tls })));
    }
}

impl CoreTask for MovedSocket {
    fn bytes(&self) -> usize {
        self.leftover.len() + self.handshake.len() + 128
    }

    fn run(self: Box<Self>, core: &Rc<Core>) {
        adopt(core.clone(), *self);
    }
}

/// Takes over a socket moved here from another core.
pub fn adopt(core: Rc<Core>, moved: MovedSocket) {
    let std_stream = std::net::TcpStream::from(moved.fd);
    match TcpStream::from_std(std_stream) {
        Ok(tcp) => {
            let stream = Stream::from_parts(tcp, moved.tls);
            monoio::spawn(run(core, stream, moved.leftover, moved.kind, moved.session, moved.handshake));
        }
        Err(e) => tracing::warn!(error = %e, "could not adopt a moved socket"),
    }
}

/// One live socket's shared state.
pub struct Conn {
    pub core: Rc<Core>,
    pub outlet: Rc<Outlet>,
    pub session: Option<SessionId>,
    pub kind: SocketKind,
    /// Attached to its session (gets deliveries).
    pub attached: Cell<bool>,
    /// Last time anything arrived from the client.
    pub last_heard: Cell<Instant>,
    /// The Engine.IO sid of the polling session this WebSocket is taking over.
    pub upgrading: std::cell::RefCell<Option<Box<str>>>,
    /// Its ping, answer, silence and write deadlines, on the core's socket timers.
    pub timed: timers::Timed,
    fd: RawFd,
    /// Closed as a slow consumer with a bounded close: after its close frame the writer shuts
    /// only the write side and waits for the reader to see the client close (module docs).
    lingering_close: Cell<bool>,
    /// The reader has ended; the writer waiting for it ([`Conn::reader_ended`]).
    reader_done: Cell<bool>,
    writer_waiting: std::cell::RefCell<Option<std::task::Waker>>,
}

impl Conn {
    /// Index into `metrics::TRANSPORTS`.
    fn transport(&self) -> usize {
        match self.kind {
            SocketKind::Plain { .. } => 0,
            SocketKind::SocketIo { .. } => 1,
        }
    }

    /// Attaches the socket to its session; false for an unknown or expired session.
    pub fn attach(&self) -> bool {
        let ok = self.session.is_some_and(|s| self.core.attach_socket(s, self.outlet.clone()));
        self.attached.set(ok);
        ok
    }

    fn shutdown(&self) {
        // Wakes a reader blocked on this socket and refuses further writes.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }

    /// The outlet went past its hard limits (its close is queued): count it, and bound the
    /// close by [`SLOW_CONSUMER_CLOSE_WAIT`] (module docs).
    fn slow_consumer(&self) {
        if self.outlet.take_overflow() {
            self.core.metrics.slow_consumer_closed();
        }
        let bounded = timers::close_by(self, Instant::now() + SLOW_CONSUMER_CLOSE_WAIT);
        self.lingering_close.set(bounded);
        tracing::debug!(core = self.core.index, socket = self.outlet.id, "closing a slow consumer");
    }

    fn reader_ends(&self) {
        self.reader_done.set(true);
        if let Some(w) = self.writer_waiting.borrow_mut().take() {
            w.wake();
        }
    }

    /// Waits until the reader has ended.
    async fn reader_ended(&self) {
        std::future::poll_fn(|cx| {
            if self.reader_done.get() {
                return std::task::Poll::Ready(());
            }
            *self.writer_waiting.borrow_mut() = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
        .await
    }
}

pub fn limits(core: &Core) -> QueueLimits {
    let c = &core.settings.config;
    QueueLimits {
        soft: c.socket_queue_soft_limit as usize,
        hard: c.socket_queue_hard_limit as usize,
        soft_bytes: c.socket_queue_soft_bytes as usize,
        hard_bytes: c.socket_queue_hard_bytes as usize,
    }
}

/// Sets a live socket up at once (its state, greeting, timers and writer task) and gives back
/// its reader task. The setup is not part of the task: an `async fn` keeps every argument
/// for its whole life, and this task lives as long as the socket (issue 25 item 3: the stream,
/// the handshake and the socket kind held twice in every idle socket's reader).
fn run(
    core: Rc<Core>,
    stream: Stream,
    leftover: Vec<u8>,
    kind: SocketKind,
    session: Option<SessionId>,
    handshake: Vec<u8>,
) -> impl std::future::Future<Output = ()> {
    let _ = stream.set_nodelay(true);
    let fd = stream.as_raw_fd();
    let outlet = Outlet::new(NEXT_SOCKET_ID.fetch_add(1, Ordering::Relaxed), limits(&core));
    let conn = Rc::new(Conn {
        core,
        outlet,
        session,
        kind: kind.clone(),
        attached: Cell::new(false),
        last_heard: Cell::new(Instant::now()),
        upgrading: Default::default(),
        timed: timers::Timed::new(Instant::now()),
        fd,
        lingering_close: Cell::new(false),
        reader_done: Cell::new(false),
        writer_waiting: Default::default(),
    });
    conn.core.metrics.socket_opened(conn.transport());
    // A live socket counts towards the connection limit (released however this ends).
    let slot = crate::http::ConnectionSlot::acquire();
    let (read, write) = stream.into_split();
    // Counted until the reader ends; a graceful shutdown closes it with 1001 and waits.
    let live = conn.core.drain.socket(&conn.outlet, fd);
    // Weak: the outlet (in the conn) holds this; both tasks clear it on exit.
    let weak = Rc::downgrade(&conn);
    conn.outlet.set_on_overflow(Some(Box::new(move || {
        if let Some(conn) = weak.upgrade() {
            conn.slow_consumer();
        }
    })));
    // A greeting that fails closes the socket (its close frame is then the only write).
    match &kind {
        SocketKind::Plain { offsets: false, .. } => {
            if !conn.attach() {
                conn.outlet.close(CloseReason::new(1008, "unknown or expired session"));
            }
        }
        SocketKind::Plain { offsets: true, since, .. } => {
            // A `since` whose history is not here is sought first, by the reader (design
            // steps 6b and 11: the take from its holder, the rebuild from the device rings).
            let elsewhere = since.is_some() && conn.session.is_some_and(|s| conn.core.since_elsewhere(s));
            if !elsewhere {
                attach_plain(&conn, since.as_deref());
            }
        }
        SocketKind::SocketIo { upgrade_sid } => {
            socketio::greet_websocket(&conn, upgrade_sid.as_deref());
        }
    }
    // Pings, silence and write stalls: on the core's socket timers (timers.rs), no task of
    // its own. A closing socket is never pinged; only its close write is watched.
    timers::register_websocket(&conn);
    monoio::spawn(writer(conn.clone(), write, handshake));
    read_loop(conn, Reading { _live: live, read, _slot: slot }, leftover)
}

/// Attaches a plain `offsets=1` socket: its first frame (`recovered`, with `since`), then
/// what it missed; an unknown or expired session closes it.
fn attach_plain(conn: &Conn, since: Option<&str>) {
    let attached = conn.session.and_then(|s| conn.core.attach_plain_offsets(s, &conn.outlet, since));
    conn.attached.set(attached.is_some());
    match attached {
        Some(a) => {
            if let Some(first) = a.first {
                conn.outlet.push(Out::Packet(first.into()));
            }
            if !a.replay.is_empty() {
                conn.outlet.start_replay(a.replay.into_iter().map(|(frame, seq)| Out::Envelope(frame, seq)));
            }
        }
        None => conn.outlet.close(CloseReason::new(1008, "unknown or expired session")),
    }
}

/// What the reader owns besides the connection, in drop order: the drain's entry first, so
/// no entry outlives the descriptor, then the read half, then the connection slot.
struct Reading {
    _live: crate::shutdown::Busy,
    read: ReadHalf,
    _slot: crate::http::ConnectionSlot,
}

/// The reader task of a live socket: frames in until the socket ends, then its goodbyes.
async fn read_loop(conn: Rc<Conn>, mut reading: Reading, leftover: Vec<u8>) {
    let read = &mut reading.read;
    let mut parser = FrameReader::default();
    // Bytes read and not yet parsed (a partial frame); freed once empty, so an idle socket
    // holds nothing here.
    let mut pending = leftover;
    let mut chunk = Vec::with_capacity(READ_CHUNK);
    // Bytes handled since this task last waited or paused (see READ_BUDGET).
    let mut budget = 0;
    if let (SocketKind::Plain { offsets: true, since: Some(since), .. }, Some(session)) = (&conn.kind, conn.session) {
        if !conn.attached.get() && !conn.outlet.is_closing() {
            // `run` left it to this task: its history is sought elsewhere before it attaches
            // (as a Socket.IO CONNECT is answered). Boxed, as that one: this task's future
            // stays small (issue 25 item 3).
            Box::pin(socketio::fetch_since(conn.core.clone(), session, since)).await;
            // Attached even if it closed meanwhile (as a Socket.IO CONNECT is answered): the
            // loop below then ends at once and detaches it, which lets go of what the wait
            // made for it (the devices a rebuild watched, a stream's pid: away from now).
            attach_plain(&conn, Some(since));
        }
    }
    'read: loop {
        let mut incoming = Vec::new();
        match parser.parse(&mut pending, &mut incoming) {
            Ok(used) => {
                pending.drain(..used);
            }
            Err(violation) => {
                conn.outlet.close(CloseReason::new(violation.0, violation.1));
                break;
            }
        }
        if pending.is_empty() {
            pending = Vec::new();
        }
        if !incoming.is_empty() {
            let now = Instant::now();
            conn.last_heard.set(now);
            timers::heard(&conn.core, &conn.timed, now);
        }
        for message in incoming {
            match message {
                Incoming::Close => {
                    conn.outlet.close(CloseReason::new(1000, "closing"));
                    break 'read;
                }
                Incoming::Ping(payload) => conn.outlet.push(Out::Pong(payload)),
                Incoming::Pong | Incoming::Binary => {}
                Incoming::Text(text) => {
                    if let SocketKind::SocketIo { .. } = conn.kind {
                        // Its history may be on another instance (design step 6b): asked
                        // for first. Boxed: this task's future stays small (issue 25 item 3).
                        // None came: its instance may have died (`kill -9`); rebuilt from
                        // the device rings here when its offset allows (step 11).
                        if let Some(session) = socketio::restores_elsewhere(&conn, &text) {
                            Box::pin(socketio::fetch_history(conn.core.clone(), session, &text[1..])).await;
                        }
                        socketio::on_websocket_text(&conn, &text);
                    }
                }
            }
        }
        if conn.outlet.is_closing() {
            // Whatever the client still sends is not read: its bytes stay in the kernel's
            // buffers (TCP flow control stops it) while the writer sends the close.
            break;
        }
        if budget >= READ_BUDGET {
            budget = 0;
            conn.core.metrics.socket_read_paused();
            // Boxed: monoio's timer entry is cache-padded (128-byte aligned, ~300 bytes), and
            // held in place it would size and align this task's future for every idle socket,
            // though a pause is rare (issue 25 item 3).
            Box::pin(monoio::time::sleep(READ_PAUSE)).await;
        }
        chunk.clear();
        // No timeout here: a silent client is closed by the socket timers (ping timeout,
        // silence), which shut the socket down and so end this read.
        let ((result, buf), waited) = waited(read.read(chunk)).await;
        chunk = buf;
        if waited {
            budget = 0;
        }
        match result {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                budget += n;
                pending.extend_from_slice(&chunk[..n]);
                if n == chunk.capacity() && chunk.capacity() < READ_CHUNK_MAX {
                    chunk.reserve(chunk.capacity());
                } else if n < chunk.capacity() / 4 && chunk.capacity() > READ_CHUNK {
                    chunk = Vec::with_capacity(READ_CHUNK);
                }
            }
        }
    }
    if conn.lingering_close.get() {
        // A slow consumer's close (module docs): read and drop until the client closes; the
        // close's deadline shuts the socket down, which ends this read.
        let mut drained = 0;
        while drained < CLOSE_DRAIN_BYTES {
            chunk.clear();
            let (result, buf) = read.read(chunk).await;
            chunk = buf;
            match result {
                Ok(n) if n > 0 => drained += n,
                _ => break,
            }
        }
    }
    if !conn.outlet.is_closing() {
        conn.outlet.close(CloseReason::new(1000, "closed"));
    }
    if conn.attached.get() {
        if let Some(s) = conn.session {
            conn.core.detach_socket(s, conn.outlet.id);
        }
    }
    conn.outlet.set_on_overflow(None);
    if conn.outlet.take_overflow() {
        conn.core.metrics.slow_consumer_closed();
    }
    conn.core.metrics.socket_closed(conn.transport());
    conn.reader_ends();
}

/// Drains the outlet into coalesced writes; sends the close frame and shuts the socket down.
async fn writer(conn: Rc<Conn>, write: WriteHalf, handshake: Vec<u8>) {
    write_all_queued(&conn, write, handshake).await;
    timers::write_ends(&conn);
    // The writer ends last (it shuts the socket down, which ends the reader): the socket's
    // timers end with it.
    timers::unregister(&conn.core, &conn.timed);
    conn.outlet.set_on_overflow(None);
    if conn.outlet.take_overflow() {
        conn.core.metrics.slow_consumer_closed();
    }
}

async fn write_all_queued(conn: &Rc<Conn>, mut write: WriteHalf, handshake: Vec<u8>) {
    timers::write_begins(conn);
    let (result, _) = write.write_all(handshake).await;
    timers::write_ends(conn);
    if result.is_err() {
        conn.outlet.close(CloseReason::new(1001, "write failed"));
        conn.shutdown();
        return;
    }
    // Reused while the queue keeps refilling; given back to the core's pool whenever the
    // socket goes idle (nothing queued after a write), so an idle socket holds no write buffer.
    let mut buf: Vec<u8> = Vec::new();
    let linger = conn.core.linger.clone();
    // Whether the next write may still be held: once per write, after a data write.
    let mut may_hold = false;
    loop {
        conn.outlet.ready().await;
        // The flush policy (push/linger.rs): while the core is saturated, a short queue
        // waits a bounded moment for more frames.
        if std::mem::take(&mut may_hold) && linger.may_hold(Instant::now()) && linger.hold(&conn.outlet) {
            continue;
        }
        let drained = conn.outlet.try_drain();
        let metrics = &conn.core.metrics;
        let envelopes = drained.items.iter().filter(|i| matches!(i, Out::Envelope(..))).count();
        metrics.messages_out(conn.transport(), envelopes as u64);
        if buf.capacity() == 0 {
            buf = write_pool::take();
        }
        buf.clear();
        // Every frame fits in its item's charged bytes (payload + 32), a close in 160 more: one
        // allocation at most, no regrowth frame by frame.
        // (An offset adds at most 28 bytes: within the 32 as well.)
        buf.reserve(drained.items.iter().map(Out::charged_bytes).sum::<usize>() + 160);
        let offsets = conn.outlet.offsets();
        // Each envelope's device part (with `--redis-url`: push/cut.rs), its text made here
        // on the write's one vector (the queue holds copies of the cuts, no allocation each).
        let parts: Vec<Option<PartText>> = if conn.outlet.has_parts() {
            drained
                .items
                .iter()
                .map(|i| match i {
                    Out::Envelope(_, seq) if *seq > 0 => conn.outlet.take_part(*seq).map(|c| c.encode()),
                    _ => None,
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut frames = encode(&conn.kind, &drained.items, offsets.as_deref(), &parts, &mut buf);
        if let Some(reason) = &drained.closing {
            if reason.server_disconnect && conn.attached.get() && matches!(conn.kind, SocketKind::SocketIo { .. }) {
                // Socket.IO DISCONNECT: the client reports "io server disconnect".
                frame::write_text(&mut buf, &[b"41"]);
                frames += 1;
            }
            frame::write_close(&mut buf, reason.code, &reason.text);
            frames += 1;
        }
        if !buf.is_empty() {
            // The stall limit is watched by the core's socket timers (timers.rs): a write only
            // records when it began.
            timers::write_begins(conn);
            let turn = linger.turn();
            let (result, b) = write.write_all(std::mem::take(&mut buf)).await;
            timers::write_ends(conn);
            match result {
                Ok(_) => {
                    may_hold = linger.enabled();
                    linger.write_completed(turn);
                    buf = b;
                    metrics.socket_written(conn.transport(), frames);
                    metrics.delivered(conn.transport(), drained.arrived());
                }
                Err(_) => {
                    conn.outlet.close(CloseReason::new(1001, "write failed or stalled"));
                    conn.shutdown();
                    return;
                }
            }
        }
        if drained.closing.is_some() {
            if conn.lingering_close.get() {
                // A slow consumer's close frame is out: FIN after it, and the reader waits for
                // the client to close, within the close's deadline (module docs).
                unsafe { libc::shutdown(conn.fd, libc::SHUT_WR) };
                conn.reader_ended().await;
            }
            conn.shutdown();
            return;
        }
        if buf.capacity() > 256 * 1024 || conn.outlet.backlog().0 == 0 {
            write_pool::give(std::mem::take(&mut buf));
        }
    }
}

/// Write buffers of this core's sockets that went idle, for the next socket that writes.
///
/// Fan-out makes many short writes on many sockets, each of which used to allocate a buffer,
/// grow it frame by frame and free it when its socket went idle: a malloc, reallocs and a free
/// per write (and for buffers of a kilobyte or more glibc consolidates its fast bins on every
/// such malloc): about 9 % of a core's samples in issue 10's fan-out profile. The pool keeps
/// those buffers on the core instead. Bounded: at most [`POOL_BUFFERS`] buffers, each of at most
/// [`POOL_BUFFER_BYTES`] capacity (a bigger one is freed), so at most 2 MiB per core; a core's
/// thread owns its pool (thread-local), no lock.
mod write_pool {
    use std::cell::RefCell;

    pub const POOL_BUFFERS: usize = 64;
    pub const POOL_BUFFER_BYTES: usize = 32 * 1024;

    thread_local! {
        static POOL: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    }

    /// A pooled buffer, or a new empty one.
    pub fn take() -> Vec<u8> {
        POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default()
    }

    /// Keeps `buf` for another socket if the pool has room and it is not too big.
    pub fn give(buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > POOL_BUFFER_BYTES {
            return;
        }
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < POOL_BUFFERS {
                p.push(buf);
            }
        });
    }
}

/// Appends the frames for `items` to `buf`, in order; returns how many frames.
///
/// One frame per item, except on a batching plain socket (`/ws?batch=1`), where each run of
/// envelopes becomes JSON-array frames of at most [`BATCH_FRAME_BYTES`] payload (a bigger
/// envelope alone). A control frame (ping, pong) between envelopes ends the array before it,
/// so frames leave in queue order. With `offsets` (`h1.<epoch>.`, connection state recovery)
/// a Socket.IO event carries its envelope's offset as its last argument:
/// `42["data",<envelope>,"h1.<epoch>.<seq>"]`.
///
/// A plain socket opened with `offsets=1` gets the offset as each envelope's first member
/// (`{"offset":"h1.<epoch>.<seq>","deviceId":…}`, in arrays too), written before the shared
/// envelope's text without copying it.
///
/// Per offset, what is the same for every frame of the socket is written once per call (the
/// Socket.IO `,"h1.<epoch>.` and the plain `{"offset":"h1.<epoch>.`). A Socket.IO event's
/// whole offset and its closing `"]` are one slice (the lead, then the seq's digits written
/// after it in place: [`OffsetText`]), 3 parts per frame as without offsets; a plain one's
/// digits and `",` are one slice ([`Base36::with_suffix`]): 3 parts.
///
/// `parts`: each item's device part (`.<dh>-<kh>…`, push/cut.rs), index for index, or empty
/// when none has one; written after the seq's digits.
fn encode(kind: &SocketKind, items: &[Out], offsets: Option<&str>, parts: &[Option<PartText>], buf: &mut Vec<u8>) -> u64 {
    use crate::push::stream::{Base36, OffsetText};
    let batch = matches!(kind, SocketKind::Plain { batch: true, .. });
    let plain_offsets = offsets.filter(|_| matches!(kind, SocketKind::Plain { .. }));
    // What precedes the seq's digits in every offset of this socket.
    // Built in place (`h1.` + at most 7 digits + `.`: within the inline 32 bytes, no allocation).
    let mut lead: smallvec::SmallVec<[u8; 32]> = smallvec::SmallVec::new();
    // Socket.IO: the lead and each event's digits and `"]` as one slice.
    let mut socketio_offset = None;
    if let Some(prefix) = offsets {
        match kind {
            SocketKind::Plain { .. } => {
                lead.extend_from_slice(b"{\"offset\":\"");
                lead.extend_from_slice(prefix.as_bytes());
            }
            _ => {
                socketio_offset = OffsetText::new(&[b",\"", prefix.as_bytes()]);
                // A lead too long for it (never one hubcast makes): lead and digits apart.
                if socketio_offset.is_none() {
                    lead.extend_from_slice(b",\"");
                    lead.extend_from_slice(prefix.as_bytes());
                }
            }
        }
    }
    // Each item's seq in base 36 and `",` (only the digits when a device part follows them),
    // for a plain socket with offsets (referenced by the parts).
    let digits: Vec<Base36> = match plain_offsets {
        Some(_) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let seq = if let Out::Envelope(_, seq) = item { *seq } else { 0 };
                Base36::with_suffix(seq, if part_of(parts, i).is_some() { b"" } else { b"\"," })
            })
            .collect(),
        None => Vec::new(),
    };
    let mut frames = 0;
    // The batch being gathered: its envelopes (as parts) and its payload length so far.
    let mut run: Vec<[&[u8]; 5]> = Vec::new();
    let mut run_len = 0;
    for (i, item) in items.iter().enumerate() {
        if let Some(Out::Envelope(next, _)) = items.get(i + 1) {
            prefetch_text(next.as_bytes());
        }
        match (kind, item) {
            (SocketKind::Plain { .. }, Out::Envelope(e, seq)) if batch => {
                let parts = plain_parts(e.as_bytes(), *seq, plain_offsets.map(|_| &lead[..]), digits.get(i), part_of(parts, i));
                let added = parts.iter().map(|p| p.len()).sum::<usize>() + 1; // the envelope and its `[` or `,`
                if !run.is_empty() && run_len + added + 1 > BATCH_FRAME_BYTES {
                    frames += frame::write_text_array(buf, &run, run_len + 1);
                    run.clear();
                    run_len = 0;
                }
                run.push(parts);
                run_len += added;
                continue;
            }
            _ if !run.is_empty() => {
                frames += frame::write_text_array(buf, &run, run_len + 1);
                run.clear();
                run_len = 0;
            }
            _ => {}
        }
        frames += 1;
        match (kind, item) {
            (SocketKind::Plain { .. }, Out::Envelope(e, seq)) => {
                frame::write_text(buf, &plain_parts(e.as_bytes(), *seq, plain_offsets.map(|_| &lead[..]), digits.get(i), part_of(parts, i)))
            }
            (SocketKind::SocketIo { .. }, Out::Envelope(e, seq)) => match (offsets.filter(|_| *seq > 0), socketio_offset.as_mut()) {
                (Some(_), Some(offset)) => match part_of(parts, i) {
                    Some(part) => frame::write_text(buf, &[socketio::EVENT_PREFIX, e.as_bytes(), offset.with_seq(*seq, b""), part, b"\"]"]),
                    None => frame::write_text(buf, &[socketio::EVENT_PREFIX, e.as_bytes(), offset.with_seq(*seq, b"\"]")]),
                },
                (Some(_), None) => {
                    let part = part_of(parts, i).unwrap_or_default();
                    let digits = Base36::new(*seq);
                    frame::write_text(buf, &[socketio::EVENT_PREFIX, e.as_bytes(), &lead, digits.as_bytes(), part, b"\"]"])
                }
                (None, _) => frame::write_text(buf, &[socketio::EVENT_PREFIX, e.as_bytes(), b"]"]),
            },
            (_, Out::Packet(p)) => frame::write_text(buf, &[p.as_bytes()]),
            (_, Out::Ping) => frame::write_ping(buf),
            (_, Out::Pong(payload)) => frame::write_pong(buf, payload),
        }
    }
    if !run.is_empty() {
        frames += frame::write_text_array(buf, &run, run_len + 1);
    }
    frames
}

/// Asks the CPU for the first 3 lines of the next envelope's text (an envelope of issue 13's
/// fan-out spans 2 to 3) while this one is copied: a fan-out frame is copied into each of its
/// sockets' writes some milliseconds after it was made, often from lines evicted meanwhile,
/// and a write copies one frame after another (the copies were among the largest on − off
/// differences of recovery's fan-out in cpu-clock samples:
/// docs/benchmarks/2026-11-28-recovery-cache-lines.md). A hint only: 3 instructions, no
/// branch; past a short text's end it asks for lines nothing reads.
#[inline(always)]
fn prefetch_text(text: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = text.as_ptr() as *const i8;
        // SAFETY: a prefetch reads nothing the program sees and cannot fault, whatever the
        // address (`wrapping_add`: no pointer is dereferenced or required in bounds).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(128));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = text;
}

/// The device part of item `i`, if it has one (`parts` is empty when none has).
fn part_of(parts: &[Option<PartText>], i: usize) -> Option<&[u8]> {
    parts.get(i).and_then(|p| p.as_ref()).map(PartText::as_bytes)
}

/// A plain envelope's text as parts: with an offset, `{"offset":"<prefix>` (`lead`), the
/// seq's digits and `",` (with a device `part`: the digits, the part, then `",`), and the
/// envelope after its `{`; without, the envelope alone.
fn plain_parts<'a>(
    e: &'a [u8],
    seq: u64,
    lead: Option<&'a [u8]>,
    digits: Option<&'a crate::push::stream::Base36>,
    part: Option<&'a [u8]>,
) -> [&'a [u8]; 5] {
    match (lead, digits) {
        (Some(lead), Some(digits)) if seq > 0 && e.first() == Some(&b'{') && e.len() > 2 => match part {
            Some(part) => [lead, digits.as_bytes(), part, b"\",", &e[1..]],
            None => [lead, digits.as_bytes(), &e[1..], b"", b""],
        },
        _ => [e, b"", b"", b"", b""],
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;
    use std::sync::Arc;

    use tungstenite::protocol::frame::coding::{Control, OpCode};
    use tungstenite::protocol::frame::FrameHeader;

    use super::*;

    #[test]
    fn the_write_pool_keeps_a_bounded_number_of_small_buffers() {
        for _ in 0..write_pool::POOL_BUFFERS + 10 {
            write_pool::give(Vec::with_capacity(1024));
        }
        write_pool::give(Vec::with_capacity(write_pool::POOL_BUFFER_BYTES + 1));
        let kept: Vec<_> = (0..write_pool::POOL_BUFFERS + 10).map(|_| write_pool::take()).collect();
        assert_eq!(kept.iter().filter(|b| b.capacity() > 0).count(), write_pool::POOL_BUFFERS);
        assert!(kept.iter().all(|b| b.capacity() <= write_pool::POOL_BUFFER_BYTES));
    }

    /// The server frames in `buf`: opcode and payload.
    fn frames(buf: &[u8]) -> Vec<(OpCode, String)> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < buf.len() {
            let mut cursor = Cursor::new(&buf[pos..]);
            let (header, len) = FrameHeader::parse(&mut cursor).unwrap().expect("a whole frame");
            let start = pos + cursor.position() as usize;
            out.push((header.opcode, String::from_utf8(buf[start..start + len as usize].to_vec()).unwrap()));
            pos = start + len as usize;
        }
        out
    }

    fn env(body: &str) -> Out {
        Out::Envelope(Arc::from(format!("{{\"v\":\"{body}\"}}")), 0)
    }

    #[test]
    fn a_batching_socket_gets_runs_of_envelopes_as_arrays_in_queue_order() {
        let items = [env("a"), env("b"), env("c"), Out::Ping, env("d"), Out::Pong(b"p".to_vec()), env("e")];
        let mut buf = Vec::new();
        let n = encode(&SocketKind::Plain { batch: true, offsets: false, since: None }, &items, None, &[], &mut buf);
        let got = frames(&buf);
        assert_eq!(n as usize, got.len());
        let texts: Vec<&str> = got.iter().map(|(_, p)| p.as_str()).collect();
        assert_eq!(texts, [r#"[{"v":"a"},{"v":"b"},{"v":"c"}]"#, "", r#"[{"v":"d"}]"#, "p", r#"[{"v":"e"}]"#]);
        assert_eq!(got[1].0, OpCode::Control(Control::Ping));
    }

    #[test]
    fn batched_frames_stay_within_the_bound_and_a_bigger_envelope_goes_alone() {
        let (small, big) = ("x".repeat(30_000), "y".repeat(BATCH_FRAME_BYTES + 10));
        let items = [env(&small), env(&small), env(&small), env(&big), env(&small), env(&small)];
        let mut buf = Vec::new();
        let n = encode(&SocketKind::Plain { batch: true, offsets: false, since: None }, &items, None, &[], &mut buf);
        let got = frames(&buf);
        let sizes: Vec<usize> = got
            .iter()
            .map(|(_, p)| serde_json::from_str::<Vec<serde_json::Value>>(p).expect("a JSON array").len())
            .collect();
        assert_eq!(sizes, [2, 1, 1, 2]);
        assert_eq!(n, 4);
        for (i, (_, p)) in got.iter().enumerate() {
            assert!(p.len() <= BATCH_FRAME_BYTES || i == 2, "frame {i}: {} bytes", p.len());
        }
    }

    #[test]
    fn a_socketio_event_carries_its_offset_as_its_last_argument_only_with_offsets() {
        let items = [Out::Envelope(Arc::from("{\"v\":1}"), 36 * 36 + 1), Out::Envelope(Arc::from("{\"v\":2}"), 0)];
        let kind = SocketKind::SocketIo { upgrade_sid: None };
        let mut buf = Vec::new();
        encode(&kind, &items, Some("h1.k3f."), &[], &mut buf);
        let got: Vec<String> = frames(&buf).into_iter().map(|(_, p)| p).collect();
        assert_eq!(got, [r#"42["data",{"v":1},"h1.k3f.101"]"#, r#"42["data",{"v":2}]"#]);
        let long = format!("h1.{}.", "k".repeat(40));
        let mut buf = Vec::new();
        encode(&kind, &items, Some(&long), &[], &mut buf);
        assert_eq!(frames(&buf)[0].1, format!(r#"42["data",{{"v":1}},"{long}101"]"#), "a lead of any length");
        let mut buf = Vec::new();
        encode(&kind, &items, None, &[], &mut buf);
        assert_eq!(frames(&buf)[0].1, r#"42["data",{"v":1}]"#, "no offsets: today's bytes");
        let mut buf = Vec::new();
        encode(&SocketKind::Plain { batch: false, offsets: true, since: None }, &items, Some("h1.k3f."), &[], &mut buf);
        let got: Vec<String> = frames(&buf).into_iter().map(|(_, p)| p).collect();
        assert_eq!(got, [r#"{"offset":"h1.k3f.101","v":1}"#, r#"{"v":2}"#], "plain offsets=1: the offset first");
        let mut buf = Vec::new();
        encode(&SocketKind::Plain { batch: true, offsets: true, since: None }, &items, Some("h1.k3f."), &[], &mut buf);
        assert_eq!(frames(&buf)[0].1, r#"[{"offset":"h1.k3f.101","v":1},{"v":2}]"#, "per element in arrays");
        let mut buf = Vec::new();
        encode(&SocketKind::Plain { batch: false, offsets: false, since: None }, &items, None, &[], &mut buf);
        assert_eq!(frames(&buf)[0].1, r#"{"v":1}"#, "a plain socket without offsets is unchanged");
    }

    #[test]
    fn a_device_part_follows_the_seq_in_both_protocols_offsets_and_only_where_an_item_has_one() {
        let items = [
            Out::Envelope(Arc::from("{\"v\":1}"), 36 * 36 + 1),
            Out::Envelope(Arc::from("{\"v\":2}"), 36 * 36 + 2),
            Out::Envelope(Arc::from("{\"v\":3}"), 0),
        ];
        let parts: Vec<Option<PartText>> = vec![Some(PartText::from_bytes(b".abc-12")), None, None];
        let text = |kind: SocketKind| {
            let mut buf = Vec::new();
            encode(&kind, &items, Some("h1.k3f."), &parts, &mut buf);
            frames(&buf).into_iter().map(|(_, p)| p).collect::<Vec<String>>()
        };
        assert_eq!(
            text(SocketKind::SocketIo { upgrade_sid: None }),
            [r#"42["data",{"v":1},"h1.k3f.101.abc-12"]"#, r#"42["data",{"v":2},"h1.k3f.102"]"#, r#"42["data",{"v":3}]"#]
        );
        assert_eq!(
            text(SocketKind::Plain { batch: false, offsets: true, since: None }),
            [r#"{"offset":"h1.k3f.101.abc-12","v":1}"#, r#"{"offset":"h1.k3f.102","v":2}"#, r#"{"v":3}"#]
        );
        let batched = text(SocketKind::Plain { batch: true, offsets: true, since: None });
        assert_eq!(batched, [r#"[{"offset":"h1.k3f.101.abc-12","v":1},{"offset":"h1.k3f.102","v":2},{"v":3}]"#]);
        serde_json::from_str::<serde_json::Value>(&batched[0]).expect("JSON");
    }

    #[test]
    fn without_batch_every_envelope_is_its_own_frame() {
        let items = [env("a"), env("b"), Out::Ping];
        for kind in [SocketKind::Plain { batch: false, offsets: false, since: None }, SocketKind::SocketIo { upgrade_sid: None }] {
            let mut buf = Vec::new();
            assert_eq!(encode(&kind, &items, None, &[], &mut buf), 3);
            let got = frames(&buf);
            assert_eq!(got.len(), 3);
            assert!(got[0].1.ends_with(r#"{"v":"a"}"#) || got[0].1.ends_with(r#"{"v":"a"}]"#), "{}", got[0].1);
        }
    }
}
